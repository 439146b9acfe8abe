"""Configuration: file, then flags; every error names the field and the value."""

from pathlib import Path

import pytest

from shim import config
from shim.errors import ConfigError


def test_defaults_are_a_real_node_layout() -> None:
    cfg = config.load()
    assert cfg.agent.socket == Path("/run/weft/cri.sock")
    assert cfg.agent.containerd_socket == Path("/run/containerd/containerd.sock")
    assert cfg.agent.state_dir == Path("/var/lib/weft")


def test_flags_override_the_file(tmp_path: Path) -> None:
    f = tmp_path / "weft.toml"
    f.write_text('[agent]\nsocket = "/run/a.sock"\nlog_level = "debug"\n')
    cfg = config.load(f, {"agent": {"socket": Path("/run/b.sock"), "log_level": None}})
    assert cfg.agent.socket == Path("/run/b.sock")  # flag wins
    assert cfg.agent.log_level == "debug"  # unset flag leaves the file's value


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param('[agent]\nlog_level = "loud"\n', ["agent.log_level", "loud"], id="bad-level"),
        pytest.param('[agent]\nsokcet = "/x"\n', ["agent.sokcet", "unknown setting"], id="typo-in-key"),
        pytest.param('[agnet]\n', ["agnet", "unknown section"], id="typo-in-section"),
        pytest.param('[agent]\nworkers = "many"\n', ["agent.workers", "expected int"], id="wrong-type"),
        pytest.param('[agent]\nworkers = 1\n', ["agent.workers", "too few"], id="too-few-workers"),
        pytest.param('[agent]\nsocket = "relative.sock"\n', ["agent.socket", "absolute"], id="relative-path"),
        pytest.param('[agent]\nmetrics_address = "9464"\n', ["agent.metrics_address", "HOST:PORT"], id="no-host"),
        pytest.param('[agent]\nstream_busy_poll_us = 5000\n', ["agent.stream_busy_poll_us", "5000", "0 (off)"],
                     id="busy-poll-too-long"),
        pytest.param("[agent]\nstream_busy_poll_us = -1\n", ["agent.stream_busy_poll_us", "-1"],
                     id="busy-poll-negative"),
        pytest.param('[agent]\ncdi_spec_dirs = "/etc/cdi:cdi"\n', ["agent.cdi_spec_dirs", "'cdi'", "absolute"],
                     id="relative-cdi-spec-dir"),
        pytest.param('[mesh]\nfence_timeout = 8\nloss_timeout = 13\n',
                     ["mesh.loss_timeout", "13.0 s", "at least 7 s", "heartbeat", "keepalive"],
                     id="loss-within-keepalive"),
        pytest.param('[agent\n', ["config file"], id="not-toml"),
    ],
)
def test_bad_config_names_what_to_fix(tmp_path: Path, text: str, words: list[str]) -> None:
    f = tmp_path / "weft.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(f)
    for word in words:
        assert word in err.value.message


def test_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml"):
        config.load(tmp_path / "nope.toml")


def test_cdi_spec_dirs_are_containerds_by_default_and_split_on_colons() -> None:
    assert config.load(None).agent.cdi_spec_path_list == [Path("/etc/cdi"), Path("/var/run/cdi")]
    cfg = config.load(None, {"agent": {"cdi_spec_dirs": "/a/cdi::/b/cdi"}})
    assert cfg.agent.cdi_spec_path_list == [Path("/a/cdi"), Path("/b/cdi")]


def test_empty_metrics_address_turns_http_off() -> None:
    assert config.load(None, {"agent": {"metrics_address": ""}}).agent.metrics_address == ""


def test_the_example_file_in_the_docstring_loads_as_written(tmp_path: Path) -> None:
    example = config.__doc__.split("Example file::", 1)[1]
    text = "\n".join(line[4:] for line in example.splitlines())
    (tmp_path / "weft.toml").write_text(text)
    cfg = config.load(tmp_path / "weft.toml")
    assert cfg.agent.workers == 64 and cfg.mesh.role == "gpu" and cfg.report.timeout == 10.0
