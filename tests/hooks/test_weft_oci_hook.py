"""``weft-oci-hook``: binds and releases leases over the broker's JSON hook socket, never blocks needlessly.

The hook is driven through ``run(argv, stdin, stderr)`` with string streams and
a real unix socket server standing in for the broker's hook endpoint.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hooks import weft_oci_hook as hook
from tests.cgroups import own_cgroup
from tests.hooks.fakebroker import FakeHookServer

REPO = Path(__file__).resolve().parents[2]
CONTAINER = "c0ffee" * 10 + "abcd"
LEASE = "lease-0123456789abcdef"


@pytest.fixture(autouse=True)
def _no_env_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEFT_BROKER_SOCKET", raising=False)


def state(lease: str | None = LEASE, pid: int | None = None) -> io.StringIO:
    doc: dict = {"ociVersion": "1.2.0", "id": CONTAINER, "status": "created", "pid": pid or os.getpid(),
                 "bundle": "/run/bundle", "annotations": {"io.kubernetes.cri.container-name": "app"}}
    if lease is not None:
        doc["annotations"]["weft.io/lease"] = lease
    return io.StringIO(json.dumps(doc))


# -- fast path and stdin -----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["createRuntime", "poststop", "somethingNew"])
@pytest.mark.parametrize(
    "lease",
    [pytest.param(None, id="no-lease-annotation"), pytest.param("", id="empty-lease-annotation")],
)
def test_container_without_a_lease_exits_0_without_asking_the_broker(
        monkeypatch: pytest.MonkeyPatch, short_dir: Path, stage: str, lease: str | None) -> None:
    asked = []
    monkeypatch.setattr(hook, "_ask", lambda *a: asked.append(a) or {"ok": True})
    err = io.StringIO()
    assert hook.run([stage, "--broker-socket", str(short_dir / "absent.sock")], state(lease), err) == 0
    assert asked == []
    assert err.getvalue() == ""


def test_no_annotations_at_all_exits_0(short_dir: Path) -> None:
    err = io.StringIO()
    argv = ["createRuntime", "--broker-socket", str(short_dir / "absent.sock")]
    assert hook.run(argv, io.StringIO('{"id": "x", "pid": 1}'), err) == 0
    assert err.getvalue() == ""


@pytest.mark.parametrize(
    "stdin",
    [pytest.param('{"annotations": {"weft.io/lease": "lease-1"', id="truncated"),
     pytest.param('annotations weft.io/lease {not json', id="garbage-mentioning-a-lease")],
)
def test_unreadable_state_with_a_lease_fails_with_a_message(stdin: str) -> None:
    err = io.StringIO()
    assert hook.run(["createRuntime"], io.StringIO(stdin), err) == 1
    assert "cannot read the OCI state on stdin" in err.getvalue()


@pytest.mark.parametrize(
    "stdin", [pytest.param("", id="empty"), pytest.param("{not json", id="garbage")],
)
def test_state_that_cannot_name_a_lease_takes_the_fast_path(stdin: str) -> None:
    err = io.StringIO()
    assert hook.run(["createRuntime"], io.StringIO(stdin), err) == 0
    assert err.getvalue() == ""


def test_state_as_bytes_is_read_like_text(server: FakeHookServer) -> None:
    raw = io.BytesIO(state().getvalue().encode())
    assert hook.run(["poststop", "--broker-socket", str(server.broker_socket)], raw, io.StringIO()) == 0
    assert [r["op"] for r in server.requests] == ["release"]


def test_unknown_stage_warns_and_exits_0(server: FakeHookServer) -> None:
    err = io.StringIO()
    assert hook.run(["prestart", "--broker-socket", str(server.broker_socket)], state(), err) == 0
    assert "unknown hook stage 'prestart'" in err.getvalue()
    assert server.requests == []


# -- talking to the broker ------------------------------------------------------------------------------
def test_create_runtime_binds_the_lease_to_pid_cgroup_and_container(server: FakeHookServer) -> None:
    err = io.StringIO()
    assert hook.run(["createRuntime", "--broker-socket", str(server.broker_socket)], state(), err) == 0
    assert server.requests == [{"op": "bind", "lease_id": LEASE, "container_id": CONTAINER, "pid": os.getpid(),
                                "cgroup": own_cgroup(), "sandbox_id": "", "container": "app"}]
    assert own_cgroup() != ""
    assert err.getvalue() == ""


def test_poststop_releases_the_lease(server: FakeHookServer) -> None:
    assert hook.run(["poststop", "--broker-socket", str(server.broker_socket)], state(), io.StringIO()) == 0
    assert server.requests == [{"op": "release", "lease_id": LEASE, "reason": "poststop", "sandbox_id": "",
                                "container": "app"}]


REFUSAL = {"ok": False, "code": "FAILED_PRECONDITION", "error": "lease is bound to container aaaaaaaaaaaa"}


@pytest.mark.parametrize(
    ("stage", "rc"),
    [pytest.param("createRuntime", 1, id="create-fails-the-container"),
     pytest.param("poststop", 0, id="poststop-never-blocks-removal")],
)
def test_broker_refusal_is_reported(server: FakeHookServer, stage: str, rc: int) -> None:
    server.answer = REFUSAL
    err = io.StringIO()
    assert hook.run([stage, "--broker-socket", str(server.broker_socket)], state(), err) == rc
    message = err.getvalue()
    assert REFUSAL["error"] in message
    assert "FAILED_PRECONDITION" in message
    assert LEASE in message
    assert CONTAINER[:12] in message


@pytest.mark.parametrize(
    ("stage", "rc"),
    [pytest.param("createRuntime", 1, id="create-fails-naming-the-socket"),
     pytest.param("poststop", 0, id="poststop-still-exits-0")],
)
def test_unreachable_broker(monkeypatch: pytest.MonkeyPatch, short_dir: Path, stage: str, rc: int) -> None:
    monkeypatch.setattr(hook, "CONNECT_TIMEOUT_S", 0.3)
    sock = str(short_dir / "absent.sock")
    err = io.StringIO()
    assert hook.run([stage, "--broker-socket", sock], state(), err) == rc
    assert sock in err.getvalue()
    assert "unreachable" in err.getvalue()


@pytest.mark.parametrize(
    "flag",
    [pytest.param(lambda s: ["--broker-socket", s], id="separate-value"),
     pytest.param(lambda s: [f"--broker-socket={s}"], id="equals-form")],
)
def test_broker_socket_flag_beats_the_environment(monkeypatch: pytest.MonkeyPatch, server: FakeHookServer,
                                                   short_dir: Path, flag) -> None:
    monkeypatch.setenv("WEFT_BROKER_SOCKET", str(short_dir / "wrong.sock"))
    monkeypatch.setattr(hook, "CONNECT_TIMEOUT_S", 0.3)
    assert hook.run(["createRuntime", *flag(str(server.broker_socket))], state(), io.StringIO()) == 0
    assert len(server.requests) == 1


def test_environment_names_the_socket_without_a_flag(monkeypatch: pytest.MonkeyPatch,
                                                     server: FakeHookServer) -> None:
    monkeypatch.setenv("WEFT_BROKER_SOCKET", str(server.broker_socket))
    assert hook.run(["poststop"], state(), io.StringIO()) == 0
    assert [r["op"] for r in server.requests] == ["release"]


def test_flag_before_the_stage_is_understood(server: FakeHookServer) -> None:
    assert hook.run(["--broker-socket", str(server.broker_socket), "poststop"], state(), io.StringIO()) == 0
    assert [r["op"] for r in server.requests] == ["release"]


# -- the fast path in a real interpreter -------------------------------------------------------------
def test_fast_path_imports_only_the_standard_library() -> None:
    proc = subprocess.run(
        [sys.executable, "-S", "-I", "-X", "importtime", str(REPO / "hooks" / "weft_oci_hook.py"), "createRuntime"],
        input='{"id": "x"}', capture_output=True, text=True, timeout=30, cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:") and "|" in line and not line.rstrip().endswith("package")]
    assert imported, "importtime printed nothing: the check would prove nothing"
    top = {name.split(".")[0] for name in imported}
    assert top <= set(sys.stdlib_module_names) | {"encodings"}, top - set(sys.stdlib_module_names)
    assert not top & {"grpc", "shim", "google", "structlog", "socket"}
    assert "site-packages" not in proc.stderr
