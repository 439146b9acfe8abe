"""The ``weft`` runtime handler's base OCI spec: containerd's default plus weft's two hooks."""

from __future__ import annotations

import copy

import pytest

from shim.hookspec import HOOK_TIMEOUT_S, with_hooks

SOCKET = "/run/weft/broker.sock"
OTHER_PRESTART = {"path": "/usr/bin/nvidia-container-runtime-hook", "args": ["nvidia-container-runtime-hook",
                                                                          "prestart"]}
OTHER_CREATE = {"path": "/usr/local/bin/netns-hook", "args": ["netns-hook", "create"]}
DEFAULT = {
    "ociVersion": "1.1.0",
    "hostname": "from-ctr-oci-spec",
    "process": {"args": ["sh"]},
    "hooks": {"prestart": [OTHER_PRESTART], "createRuntime": [OTHER_CREATE]},
}
ARGVS = [
    pytest.param(["/usr/bin/weft-oci-hook"], id="installed-entry-point"),
    pytest.param(["/usr/bin/python3", "-S", "-I", "/opt/src/hooks/weft_oci_hook.py"], id="script-run-by-python"),
]


def weft_entries(spec: dict, stage: str) -> list[dict]:
    return [h for h in spec["hooks"][stage] if h not in (OTHER_CREATE, OTHER_PRESTART)]


@pytest.mark.parametrize("argv", ARGVS)
def test_hostname_is_removed(argv: list[str]) -> None:
    assert "hostname" not in with_hooks(DEFAULT, argv, SOCKET)


@pytest.mark.parametrize("argv", ARGVS)
@pytest.mark.parametrize("stage", ["createRuntime", "poststop"])
def test_hook_runs_at_each_stage_with_socket_and_timeout(argv: list[str], stage: str) -> None:
    [entry] = weft_entries(with_hooks(DEFAULT, argv, SOCKET), stage)
    assert entry["path"] == argv[0]
    assert entry["args"] == [*argv, stage]
    assert f"WEFT_BROKER_SOCKET={SOCKET}" in entry["env"]
    assert any(e.startswith("PATH=") for e in entry["env"])
    assert entry["timeout"] == HOOK_TIMEOUT_S > 0


@pytest.mark.parametrize("argv", ARGVS)
def test_other_hooks_are_kept_in_place(argv: list[str]) -> None:
    spec = with_hooks(DEFAULT, argv, SOCKET)
    assert spec["hooks"]["prestart"] == [OTHER_PRESTART]
    assert spec["hooks"]["createRuntime"][0] == OTHER_CREATE
    assert spec["process"] == DEFAULT["process"]


@pytest.mark.parametrize("argv", ARGVS)
def test_applying_twice_changes_nothing(argv: list[str]) -> None:
    once = with_hooks(DEFAULT, argv, SOCKET)
    assert with_hooks(once, argv, SOCKET) == once


def test_applying_again_with_a_new_socket_replaces_the_hooks() -> None:
    argv = ["/usr/bin/weft-oci-hook"]
    again = with_hooks(with_hooks(DEFAULT, argv, "/old.sock"), argv, SOCKET)
    for stage in ("createRuntime", "poststop"):
        [entry] = weft_entries(again, stage)
        assert f"WEFT_BROKER_SOCKET={SOCKET}" in entry["env"]


def test_spec_without_hooks_gets_them() -> None:
    spec = with_hooks({"ociVersion": "1.1.0"}, ["/usr/bin/weft-oci-hook"], SOCKET)
    assert set(spec["hooks"]) == {"createRuntime", "poststop"}


def test_default_spec_is_not_modified() -> None:
    before = copy.deepcopy(DEFAULT)
    with_hooks(DEFAULT, ["/usr/bin/weft-oci-hook"], SOCKET)
    assert before == DEFAULT
