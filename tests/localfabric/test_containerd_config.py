"""The harness's choice of containerd and the config it writes for each release line, without running one.

The integration suite checks against real daemons that every setting takes effect
(``integration/localfabric/test_harness.py``); these pin what is written: version 2 with the one CRI plugin for
1.6 and 1.7, version 3 with the runtime, image and streaming plugins apart for 2.x, and the same
settings in both.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from shim.localfabric import containerd, images
from shim.localfabric.containerd import Containerd, RuntimeHandler


def _config(tmp_path: Path, line: str) -> dict:
    ctrd = Containerd(workdir=tmp_path, slot=7, line=line,
                      handlers=[RuntimeHandler("weft", base_runtime_spec=Path("/spec.json"),
                                               pod_annotations=("weft.io/*",), container_annotations=("weft.io/*",))])
    (tmp_path / "cni").mkdir()
    ctrd._write_config()
    return tomllib.loads((tmp_path / "config.toml").read_text())


@pytest.mark.parametrize("value, line", [(None, "1.6"), ("", "1.6"), ("1.6", "1.6"), ("1.7", "1.7"), ("2", "2")])
def test_weft_containerd_names_the_line(monkeypatch: pytest.MonkeyPatch, value: str | None, line: str) -> None:
    if value is None:
        monkeypatch.delenv(containerd.VERSION_ENV, raising=False)
    else:
        monkeypatch.setenv(containerd.VERSION_ENV, value)
    assert containerd.selected_line() == line


@pytest.mark.parametrize("value", ["2.0", "v2", "1.5", "latest"])
def test_an_unknown_line_is_refused_naming_the_choices(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(containerd.VERSION_ENV, value)
    with pytest.raises(ValueError, match=r"1\.6, 1\.7, 2"):
        containerd.selected_line()


def test_the_default_line_runs_the_containerd_on_path() -> None:
    assert containerd.bin_dir("1.6") is None


def test_a_built_line_without_the_checkout_s_build_script_says_so(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.setattr(containerd, "CONTAINERD_BUILD", tmp_path / "absent" / "build.sh")
    containerd.bin_dir.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="only a checkout has"):
            containerd.bin_dir("2")
    finally:
        containerd.bin_dir.cache_clear()


@pytest.mark.parametrize("line", ["1.6", "1.7"])
def test_1_6_and_1_7_get_version_2_with_one_cri_plugin(tmp_path: Path, line: str) -> None:
    cfg = _config(tmp_path, line)
    assert cfg["version"] == 2
    cri = cfg["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == images.PAUSE_IMAGE
    assert cri["netns_mounts_under_state_dir"] is True and cri["restrict_oom_score_adj"] is True
    assert cri["stream_server_address"] == "127.0.0.1"
    assert cri["registry"]["config_path"] == str(tmp_path / "certs.d")
    assert cri["cni"] == {"bin_dir": "/usr/lib/cni", "conf_dir": str(tmp_path / "cni")}
    assert cri["containerd"]["snapshotter"] == "overlayfs"
    _check_runtimes(cri["containerd"], tmp_path)


def test_2_gets_version_3_with_runtime_images_and_streaming_apart(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "2")
    assert cfg["version"] == 3
    plugins = cfg["plugins"]
    runtime, imgs = plugins["io.containerd.cri.v1.runtime"], plugins["io.containerd.cri.v1.images"]
    assert runtime["netns_mounts_under_state_dir"] is True and runtime["restrict_oom_score_adj"] is True
    assert runtime["cni"] == {"bin_dirs": ["/usr/lib/cni"], "conf_dir": str(tmp_path / "cni")}
    assert imgs == {"snapshotter": "overlayfs", "pinned_images": {"sandbox": images.PAUSE_IMAGE},
                    "registry": {"config_path": str(tmp_path / "certs.d")}}
    # The gRPC CRI plugin keeps only the streaming server in version 3.
    assert plugins["io.containerd.grpc.v1.cri"] == {"stream_server_address": "127.0.0.1", "stream_server_port": "0"}
    _check_runtimes(runtime["containerd"], tmp_path)


@pytest.mark.parametrize("line", ["1.6", "1.7", "2"])
def test_every_line_gets_the_same_daemon_settings(tmp_path: Path, line: str) -> None:
    cfg = _config(tmp_path, line)
    assert (cfg["root"], cfg["state"]) == (str(tmp_path / "root"), str(tmp_path / "state"))
    assert cfg["grpc"]["address"] == str(tmp_path / "containerd.sock")
    assert cfg["ttrpc"]["address"] == str(tmp_path / "containerd.sock.ttrpc")
    assert cfg["plugins"]["io.containerd.internal.v1.opt"]["path"] == str(tmp_path / "opt")


def _check_runtimes(section: dict, workdir: Path) -> None:
    assert section["default_runtime_name"] == "runc"
    runtimes = section["runtimes"]
    assert set(runtimes) == {"runc", "weft"}
    for r in runtimes.values():
        assert r["runtime_type"] == "io.containerd.runc.v2"
        assert r["options"] == {"Root": str(workdir / "runc"), "SystemdCgroup": False}
    assert runtimes["weft"]["base_runtime_spec"] == "/spec.json"
    assert runtimes["weft"]["pod_annotations"] == runtimes["weft"]["container_annotations"] == ["weft.io/*"]
