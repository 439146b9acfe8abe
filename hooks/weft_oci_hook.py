"""``weft-oci-hook``: binds and releases GPU leases from runc's createRuntime and poststop hooks.

Set in the ``weft`` runtime handler's ``base_runtime_spec``. runc passes the
OCI state (id, pid, annotations, ...) on stdin. A container without a
``weft.io/lease`` annotation exits 0 at once: that path imports nothing but
``sys`` and ``os`` and does not parse the state (``import json`` alone would
double the hook's start-up; p99 measured by ``weft bench hook``). With one,
createRuntime binds the lease to the container's PID and cgroup through the
broker's hook socket (``<broker socket>.hook``, JSON lines) and fails the
container with a clear message if the broker refuses or stays unreachable
past a bounded timeout; poststop releases the lease (a failure there is
reported, but never blocks the container's removal). An unknown stage warns
and exits 0, so a newer runtime never blocks a container.

Broker socket: ``--broker-socket PATH`` or ``WEFT_BROKER_SOCKET``; how long
to wait for it: ``WEFT_HOOK_TIMEOUT_S`` (5 s). ``weft_oci_hook.c`` is the same
hook without an interpreter (``hooks/native.py`` builds it); this one is the
reference both are tested against.
"""

from __future__ import annotations

import os
import sys

LEASE_ANNOTATION = "weft.io/lease"
DEFAULT_BROKER_SOCKET = "/run/weft/broker.sock"
CONNECT_TIMEOUT_S = 5.0


def _args(argv: list[str]) -> tuple[str, str]:
    stage, socket = "", os.environ.get("WEFT_BROKER_SOCKET", DEFAULT_BROKER_SOCKET)
    it = iter(argv)
    for arg in it:
        if arg == "--broker-socket":
            socket = next(it, socket)
        elif arg.startswith("--broker-socket="):
            socket = arg.split("=", 1)[1]
        elif not stage:
            stage = arg
    return stage, socket


def _cgroup(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            text = f.read()
    except OSError:
        return ""
    unified = ""
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return path
        if controllers == "":
            unified = path
    return unified


def _timeout() -> float:
    try:
        t = float(os.environ.get("WEFT_HOOK_TIMEOUT_S", ""))
    except ValueError:
        return CONNECT_TIMEOUT_S
    return t if 0 < t <= 60 else CONNECT_TIMEOUT_S


def _ask(socket_path: str, request: dict, timeout: float) -> dict:
    import json
    import socket
    import time

    deadline = time.monotonic() + timeout
    last = ""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.settimeout(max(deadline - time.monotonic(), 0.05))
            s.connect(socket_path + ".hook")
            s.sendall(json.dumps(request).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                s.settimeout(max(deadline - time.monotonic(), 0.05))  # the whole answer by the deadline
                chunk = s.recv(65536)
                if not chunk:
                    raise OSError("the broker closed the connection without answering")
                buf += chunk
            try:
                answer = json.loads(buf)
            except ValueError as exc:
                raise ValueError(f"the GPU broker's answer is not a JSON object: {exc}") from None
            if not isinstance(answer, dict):
                raise ValueError("the GPU broker's answer is not a JSON object")
            return answer
        except OSError as exc:  # not up yet, or restarting: retry until the deadline
            last = str(exc) or type(exc).__name__
            if time.monotonic() >= deadline:
                raise TimeoutError(f"GPU broker at {socket_path} unreachable for {timeout:.0f}s: {last}") from None
            time.sleep(0.1)
        finally:
            s.close()


def run(argv: list[str], stdin, stderr) -> int:
    raw = stdin.read()
    if LEASE_ANNOTATION not in (raw.decode(errors="replace") if isinstance(raw, bytes) else raw):
        return 0  # the fast path: no lease, nothing to parse
    import json

    stage, broker = _args(argv)
    try:
        # Strict UTF-8 (json.loads would let an encoded surrogate through): the native hook reads it so too.
        state = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        if not isinstance(state, dict):
            raise ValueError(f"expected a JSON object, got {type(state).__name__}")
    except ValueError as exc:
        print(f"weft-oci-hook: cannot read the OCI state on stdin: {exc}", file=stderr)
        return 1
    annotations = state.get("annotations")
    if not isinstance(annotations, dict):
        annotations = {}
    lease = annotations.get(LEASE_ANNOTATION)
    if not lease:
        return 0
    if not isinstance(lease, str):
        print(f"weft-oci-hook: cannot read the OCI state on stdin: annotation {LEASE_ANNOTATION} is not a string",
              file=stderr)
        return 1
    container = state.get("id", "")
    # containerd's own annotations say whose container this is; the broker checks
    # them against the lease, so a container cannot bind or release another's.
    owner = {"sandbox_id": annotations.get("io.kubernetes.cri.sandbox-id", ""),
             "container": annotations.get("io.kubernetes.cri.container-name", "")}
    if stage == "createRuntime":
        try:
            pid = int(state.get("pid") or 0)
        except (TypeError, ValueError):
            pid = 0
        request = {"op": "bind", "lease_id": lease, "container_id": container, "pid": pid, "cgroup": _cgroup(pid),
                   **owner}
    elif stage == "poststop":
        request = {"op": "release", "lease_id": lease, "reason": "poststop", **owner}
    else:
        print(f"weft-oci-hook: unknown hook stage {stage!r}; doing nothing", file=stderr)
        return 0
    try:
        answer = _ask(broker, request, _timeout())
    except (TimeoutError, ValueError) as exc:
        print(f"weft-oci-hook {stage}: container {container[:12]}, lease {lease}: {exc}", file=stderr)
        return 1 if stage == "createRuntime" else 0
    if not answer.get("ok"):
        print(f"weft-oci-hook {stage}: the GPU broker refused lease {lease} for container {container[:12]}: "
              f"{answer.get('error')} ({answer.get('code')})", file=stderr)
        return 1 if stage == "createRuntime" else 0
    return 0


def main() -> int:
    return run(sys.argv[1:], sys.stdin.buffer, sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
