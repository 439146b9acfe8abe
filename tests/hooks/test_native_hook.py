"""The native ``weft-oci-hook`` (``hooks/weft_oci_hook.c``) against the Python one, on the same inputs.

Both run as runc runs them: a fresh process, the OCI state on stdin, the stage
as an argument, a real unix socket server standing in for the broker's hook
endpoint. Every case is asserted for both, and where a message is printed the
two print the same one: the Python hook is the reference the native one keeps
to. The native hook is also built for the image's other architecture (arm64,
with Debian's cross compiler) and held to the same cases under qemu-user's
emulator: that binary has run here only emulated.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from hooks import native
from shim.localfabric.broker import PYTHON_HOOK
from tests.cgroups import own_cgroup
from tests.hooks.fakebroker import FakeHookServer

CONTAINER = "c0ffee" * 10 + "abcd"
LEASE = "lease-0123456789abcdef"
REFUSAL = {"ok": False, "code": "FAILED_PRECONDITION", "error": "lease is bound to container aaaaaaaaaaaa"}


@pytest.fixture(scope="module")
def native_hook() -> str:
    try:
        return str(native.build())
    except native.NativeHookUnavailable as exc:
        pytest.fail(f"the native hook could not be built here (scripts/setup.sh installs gcc): {exc}")


OTHER_ARCH = "arm64" if native.host_arch() != "arm64" else "amd64"


@pytest.fixture(scope="module")
def other_arch_hook() -> list[str]:
    try:
        return [*native.runner(OTHER_ARCH), str(native.build(arch=OTHER_ARCH))]
    except native.NativeHookUnavailable as exc:
        pytest.fail(f"the native hook for {OTHER_ARCH} could not be built or run here (scripts/setup.sh installs "
                    f"the cross compiler and qemu-user-static): {exc}")


@pytest.fixture(params=["python", "native", f"native-{OTHER_ARCH}"])
def hook(request: pytest.FixtureRequest, native_hook: str) -> list[str]:
    if request.param == "python":
        return list(PYTHON_HOOK)
    return [native_hook] if request.param == "native" else request.getfixturevalue("other_arch_hook")


def state(lease: str | None = LEASE, pid: int | None = None, **annotations: str) -> str:
    doc: dict = {"ociVersion": "1.2.0", "id": CONTAINER, "status": "created", "pid": pid or os.getpid(),
                 "bundle": "/run/bundle", "annotations": {"io.kubernetes.cri.container-name": "app", **annotations}}
    if lease is not None:
        doc["annotations"]["weft.io/lease"] = lease
    return json.dumps(doc)


def run(hook: list[str], args: list[str], stdin: str | bytes, env: dict[str, str] | None = None,
        timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "WEFT_BROKER_SOCKET"}
    if timeout_s is not None:
        environ["WEFT_HOOK_TIMEOUT_S"] = str(timeout_s)
    data = stdin.encode() if isinstance(stdin, str) else stdin
    res = subprocess.run([*hook, *args], input=data, capture_output=True, env={**environ, **(env or {})},
                         timeout=30, cwd="/")
    return subprocess.CompletedProcess(res.args, res.returncode, res.stdout.decode(), res.stderr.decode())


# -- the fast path and the state ------------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["createRuntime", "poststop", "somethingNew"])
@pytest.mark.parametrize("stdin", [
    pytest.param(state(None), id="no-lease-annotation"), pytest.param(state(""), id="empty-lease-annotation"),
    pytest.param("", id="empty"), pytest.param("{not json", id="garbage"),
    pytest.param('{"id": "x", "pid": 1}', id="no-annotations")])
def test_without_a_lease_exits_0_at_once(hook: list[str], short_dir: Path, stage: str, stdin: str) -> None:
    res = run(hook, [stage, "--broker-socket", str(short_dir / "absent.sock")], stdin)
    assert (res.returncode, res.stderr, res.stdout) == (0, "", "")


@pytest.mark.parametrize(("stdin", "says"), [
    pytest.param('{"annotations": {"weft.io/lease": "lease-1"', "cannot read the OCI state on stdin", id="truncated"),
    pytest.param("annotations weft.io/lease {not json", "cannot read the OCI state on stdin", id="garbage"),
    pytest.param('["weft.io/lease"]', "expected a JSON object, got list", id="a-list"),
    pytest.param('{"annotations": {"weft.io/lease": "l"}} {}', "cannot read the OCI state", id="extra-data")])
def test_unreadable_state_with_a_lease_fails_the_container(hook: list[str], stdin: str, says: str) -> None:
    res = run(hook, ["createRuntime"], stdin)
    assert res.returncode == 1
    assert says in res.stderr and res.stderr.startswith("weft-oci-hook: ")


def test_unknown_stage_warns_and_exits_0(hook: list[str], server: FakeHookServer) -> None:
    res = run(hook, ["prestart", "--broker-socket", str(server.broker_socket)], state())
    assert (res.returncode, res.stderr) == (0, "weft-oci-hook: unknown hook stage 'prestart'; doing nothing\n")
    assert server.requests == []


# -- binding and releasing ------------------------------------------------------------------------------
def test_create_runtime_binds_the_lease_to_pid_cgroup_and_container(hook: list[str],
                                                                    server: FakeHookServer) -> None:
    with subprocess.Popen(["sleep", "30"]) as proc:  # a live process, as runc's container at createRuntime
        try:
            cgroup = own_cgroup(proc.pid)
            res = run(hook, ["createRuntime", "--broker-socket", str(server.broker_socket)],
                      state(pid=proc.pid, **{"io.kubernetes.cri.sandbox-id": "sb-1"}))
        finally:
            proc.kill()
    assert (res.returncode, res.stderr) == (0, "")
    assert server.requests == [{"op": "bind", "lease_id": LEASE, "container_id": CONTAINER, "pid": proc.pid,
                                "cgroup": cgroup, "sandbox_id": "sb-1", "container": "app"}]
    assert cgroup.startswith("/")


def test_poststop_releases_the_lease(hook: list[str], server: FakeHookServer) -> None:
    res = run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], state())
    assert (res.returncode, res.stderr) == (0, "")
    assert server.requests == [{"op": "release", "lease_id": LEASE, "reason": "poststop", "sandbox_id": "",
                                "container": "app"}]


def test_a_state_without_a_pid_binds_pid_0_and_no_cgroup(hook: list[str], server: FakeHookServer) -> None:
    doc = {"id": CONTAINER, "annotations": {"weft.io/lease": LEASE}}
    assert run(hook, ["createRuntime", "--broker-socket", str(server.broker_socket)], json.dumps(doc)).returncode == 0
    assert server.requests[0]["pid"] == 0 and server.requests[0]["cgroup"] == ""


def test_escapes_and_unicode_reach_the_broker_as_they_were(hook: list[str], server: FakeHookServer) -> None:
    lease, name = 'lease-"quoted"\\back\u00e9\U0001f680', "m\u00f6del\n\ttab\u0001"
    text = json.dumps({"id": CONTAINER, "annotations": {"weft.io/lease": lease,
                                                        "io.kubernetes.cri.container-name": name}})
    assert run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], text).returncode == 0
    raw = json.dumps({"id": CONTAINER, "annotations": {"weft.io/lease": lease}}, ensure_ascii=False)
    assert run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], raw).returncode == 0
    assert [(r["lease_id"], r["container"]) for r in server.requests] == [(lease, name), (lease, "")]


def test_the_last_of_a_repeated_key_wins(hook: list[str], server: FakeHookServer) -> None:
    text = ('{"id": "old", "annotations": {"weft.io/lease": "first", "io.kubernetes.cri.container-name": "x"}, '
            '"id": "CONTAINER", "annotations": {"weft.io/lease": "second", "weft.io/lease": "third"}}'
            ).replace("CONTAINER", CONTAINER)
    assert run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], text).returncode == 0
    assert [(r["lease_id"], r["container"]) for r in server.requests] == [("third", "")]


def test_a_large_state_is_read_whole(hook: list[str], server: FakeHookServer) -> None:
    big = {f"example.com/note-{i}": "x" * 1000 for i in range(1000)}  # a megabyte of other annotations
    text = state(**big, nested='{"a": [1, 2.5e3, -0.1, true, false, null]}')
    assert run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], text).returncode == 0
    assert [r["lease_id"] for r in server.requests] == [LEASE]


# -- the broker refusing, missing or making no sense: the same words from both ---------------------------
@pytest.mark.parametrize(("stage", "rc"), [("createRuntime", 1), ("poststop", 0)])
def test_broker_refusal_is_reported(hook: list[str], server: FakeHookServer, stage: str, rc: int) -> None:
    server.answer = REFUSAL
    res = run(hook, [stage, "--broker-socket", str(server.broker_socket)], state())
    assert res.returncode == rc
    assert res.stderr == (f"weft-oci-hook {stage}: the GPU broker refused lease {LEASE} for container "
                          f"{CONTAINER[:12]}: {REFUSAL['error']} ({REFUSAL['code']})\n")


@pytest.mark.parametrize(("stage", "rc"), [("createRuntime", 1), ("poststop", 0)])
def test_unreachable_broker_names_its_socket(hook: list[str], short_dir: Path, stage: str, rc: int) -> None:
    sock = str(short_dir / "absent.sock")
    res = run(hook, [stage, "--broker-socket", sock], state(), timeout_s=0.3)
    assert res.returncode == rc
    assert res.stderr == (f"weft-oci-hook {stage}: container {CONTAINER[:12]}, lease {LEASE}: GPU broker at {sock} "
                          "unreachable for 0s: [Errno 2] No such file or directory\n")


@pytest.mark.parametrize("answer", [pytest.param(b"not json\n", id="not-json"), pytest.param(b"[1]\n", id="a-list")])
@pytest.mark.parametrize(("stage", "rc"), [("createRuntime", 1), ("poststop", 0)])
def test_an_answer_that_is_no_json_object_is_reported(hook: list[str], server: FakeHookServer, answer: bytes,
                                                      stage: str, rc: int) -> None:
    server.answer = answer
    res = run(hook, [stage, "--broker-socket", str(server.broker_socket)], state())
    assert res.returncode == rc
    assert res.stderr.startswith(f"weft-oci-hook {stage}: container {CONTAINER[:12]}, lease {LEASE}: "
                                 "the GPU broker's answer is not a JSON object")


def test_a_broker_that_hangs_up_is_asked_again_until_the_deadline(hook: list[str], server: FakeHookServer) -> None:
    server.answer = b""  # reads the request, closes without a word
    res = run(hook, ["createRuntime", "--broker-socket", str(server.broker_socket)], state(), timeout_s=0.5)
    assert res.returncode == 1
    assert "the broker closed the connection without answering" in res.stderr
    assert len(server.requests) >= 2


# -- where the socket is named ----------------------------------------------------------------------------
@pytest.mark.parametrize("args", [
    pytest.param(lambda s: ["createRuntime", "--broker-socket", s], id="separate-value"),
    pytest.param(lambda s: ["createRuntime", f"--broker-socket={s}"], id="equals-form"),
    pytest.param(lambda s: ["--broker-socket", s, "createRuntime"], id="flag-before-the-stage")])
def test_the_flag_names_the_socket_over_the_environment(hook: list[str], server: FakeHookServer, short_dir: Path,
                                                        args) -> None:
    res = run(hook, args(str(server.broker_socket)), state(), env={"WEFT_BROKER_SOCKET": str(short_dir / "no.sock")},
              timeout_s=0.3)
    assert (res.returncode, len(server.requests)) == (0, 1), res.stderr


def test_the_environment_names_the_socket_without_a_flag(hook: list[str], server: FakeHookServer) -> None:
    res = run(hook, ["poststop"], state(), env={"WEFT_BROKER_SOCKET": str(server.broker_socket)})
    assert res.returncode == 0 and [r["op"] for r in server.requests] == ["release"]


def test_the_native_build_is_static_and_cached(native_hook: str) -> None:
    assert native.build() == Path(native_hook)
    res = subprocess.run(["file", "-b", native_hook], capture_output=True, text=True)
    if res.returncode == 0:  # file(1) where installed; ldd's answer otherwise
        assert "statically linked" in res.stdout or "static-pie" in res.stdout, res.stdout
    else:
        ldd = subprocess.run(["ldd", native_hook], capture_output=True, text=True)
        assert "not a dynamic executable" in ldd.stdout + ldd.stderr


def test_the_other_architectures_build_is_a_static_binary_for_it(other_arch_hook: list[str]) -> None:
    binary = Path(other_arch_hook[-1])
    assert native.build(arch=OTHER_ARCH) == binary and binary != Path(native.build())
    header = binary.read_bytes()[:20]
    machine = int.from_bytes(header[18:20], "little")  # ELF e_machine: 62 x86-64, 183 AArch64
    assert header[:4] == b"\x7fELF" and machine == {"arm64": 183, "amd64": 62}[OTHER_ARCH]
    res = subprocess.run(["file", "-b", str(binary)], capture_output=True, text=True)
    assert res.returncode != 0 or "statically linked" in res.stdout, res.stdout


# -- inputs runc never writes, read alike (found by fuzzing the two side by side) ---------------------------
@pytest.mark.parametrize("stdin", [
    pytest.param(b'{"annotations": {"weft.io/lease": "' + b"a" * 254 + b'\xf0"}}', id="a-cut-sequence-at-the-end"),
    pytest.param(b'{"annotations": {"weft.io/lease": "s\xffb"}}', id="a-byte-that-starts-nothing"),
    pytest.param(b'{"annotations": {"weft.io/lease": "\xed\xa0\x80"}}', id="an-encoded-surrogate"),
    pytest.param(b'{"annotations": {"weft.io/lease": "\xc0\xaf"}}', id="an-overlong-slash")])
def test_invalid_utf8_is_an_unreadable_state(hook: list[str], server: FakeHookServer, stdin: bytes) -> None:
    res = run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], stdin)
    assert res.returncode == 1 and "cannot read the OCI state on stdin" in res.stderr
    assert server.requests == []


def test_a_nul_is_part_of_a_key_and_of_a_value(hook: list[str], server: FakeHookServer) -> None:
    args = ["poststop", "--broker-socket", str(server.broker_socket)]
    res = run(hook, args, '{"id": "x", "annotations": {"weft.io/lease\\u0000x": "L"}}')
    assert (res.returncode, res.stderr, server.requests) == (0, "", [])  # not the lease's key
    res = run(hook, args, '{"id": "x", "annotations": {"weft.io/lease": "L\\u0000rest"}}')
    assert res.returncode == 0 and [r["lease_id"] for r in server.requests] == ["L\x00rest"]


def test_annotations_that_are_no_object_hold_no_lease(hook: list[str], server: FakeHookServer) -> None:
    args = ["poststop", "--broker-socket", str(server.broker_socket)]
    for text in ('{"annotations": {"weft.io/lease": "L"}, "annotations": null}',
                 '{"annotations": ["weft.io/lease"]}', '{"annotations": "weft.io/lease"}'):
        res = run(hook, args, text)
        assert (res.returncode, res.stderr) == (0, ""), text
    assert server.requests == []


@pytest.mark.parametrize("value", ["5", "true", '["L"]'])
def test_a_lease_that_is_no_string_is_refused(hook: list[str], server: FakeHookServer, value: str) -> None:
    res = run(hook, ["createRuntime", "--broker-socket", str(server.broker_socket)],
              '{"id": "x", "annotations": {"weft.io/lease": %s}}'.replace("%s", value))
    assert res.returncode == 1
    assert res.stderr == ("weft-oci-hook: cannot read the OCI state on stdin: annotation weft.io/lease is not "
                          "a string\n")
    assert server.requests == []


def test_a_broker_that_trickles_its_answer_is_given_up_at_the_deadline(hook: list[str], short_dir: Path) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(short_dir / "broker.sock") + ".hook")
    listener.listen()
    stop = threading.Event()

    def trickle() -> None:  # a space every 0.1 s, never the newline that ends an answer
        with contextlib.suppress(OSError):
            while not stop.is_set():
                conn, _ = listener.accept()
                with conn:
                    conn.recv(65536)
                    while not stop.wait(0.1):
                        conn.sendall(b" ")

    threading.Thread(target=trickle, daemon=True).start()
    try:
        t0 = time.monotonic()
        res = run(hook, ["createRuntime", "--broker-socket", str(short_dir / "broker.sock")], state(), timeout_s=0.5)
        took = time.monotonic() - t0
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    assert res.returncode == 1 and "unreachable for" in res.stderr and "timed out" in res.stderr, res.stderr
    assert took < 10, f"the hook kept reading a trickling broker for {took:.1f} s past its 0.5 s deadline"


def test_a_lone_surrogate_reaches_the_broker_as_it_came(hook: list[str], server: FakeHookServer) -> None:
    text = '{"id": "x", "annotations": {"weft.io/lease": "L\\ud83dM"}}'  # JSON allows it; Go's encoder never writes it
    assert run(hook, ["poststop", "--broker-socket", str(server.broker_socket)], text).returncode == 0
    assert [r["lease_id"] for r in server.requests] == ["L\ud83dM"]
