"""The service manager and the health checks the installer waits on, behind one small interface.

On a node: ``systemctl`` (``--systemctl`` may prefix it, e.g. ``nsenter -t 1 -m --
systemctl`` from the DaemonSet), kubelet's ``/healthz``, the agent's CRI
``Version``, and which containerd the node runs. With ``--root DIR`` and no ``--systemctl`` the installer only
writes files (:class:`NoServices`): it never touches the real host's systemd.
Tests pass a small real program as ``--systemctl`` and a real health endpoint.
"""

from __future__ import annotations

import shlex
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Protocol

from shim.errors import InstallError


class Services(Protocol):
    active: bool

    def systemctl(self, *args: str, check: bool = True) -> None: ...


class NoServices:
    """Files only: nothing is restarted, nothing waited on."""

    active = False

    def systemctl(self, *args: str, check: bool = True) -> None:
        return None


class Systemctl:
    active = True

    def __init__(self, command: str = "systemctl") -> None:
        self.argv = shlex.split(command)

    def systemctl(self, *args: str, check: bool = True) -> None:
        try:
            res = subprocess.run([*self.argv, *args], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            if check:
                raise InstallError(f"{shlex.join([*self.argv, *args])}: {exc}") from exc
            return
        if check and res.returncode != 0:
            detail = (res.stderr or res.stdout).strip().splitlines()[-1:] or [f"exit {res.returncode}"]
            raise InstallError(f"{shlex.join([*self.argv, *args])} failed: {detail[0]}")


def run_on_host(root: Path, argv: list[str], timeout: float) -> str | None:
    """Run ``argv`` on the host whose root is ``root`` (``chroot`` into it unless it is ``/``); None when it
    exits 0, else what it said last."""
    cmd = argv if root == Path("/") else ["chroot", str(root), *argv]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    if res.returncode == 0:
        return None
    lines = (res.stderr or res.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {res.returncode}"


def agent_version(socket: Path, timeout: float) -> str:
    """The agent's answer to CRI ``Version`` (it relays it from containerd); waits up to ``timeout``."""
    import grpc
    from cri_api.v1 import api_pb2 as cri
    from cri_api.v1 import api_pb2_grpc as cri_grpc

    deadline = time.monotonic() + timeout
    last = "no socket"
    while True:
        if socket.exists():
            with grpc.insecure_channel(f"unix://{socket}") as ch:
                try:
                    v = cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=5)
                    return f"{v.runtime_name} {v.runtime_version}"
                except grpc.RpcError as exc:
                    last = f"{exc.code().name}: {exc.details()}"
        if time.monotonic() >= deadline:
            raise InstallError(f"the weft agent does not answer CRI on {socket} ({last})")
        time.sleep(0.2)


def containerd_version(socket: Path, binaries: list[Path], timeout: float = 5.0) -> tuple[str, str] | None:
    """(containerd's version, where it was learnt), or None when neither way answers.

    First CRI ``Version`` on containerd's socket: the running containerd, the one the install restarts (the
    DaemonSet sees the host's socket under ``/host``). Then ``containerd --version`` of the host's binary, for a
    node whose containerd is stopped: run from the host root as it is, so it needs no chroot.
    """
    import grpc
    from cri_api.v1 import api_pb2 as cri
    from cri_api.v1 import api_pb2_grpc as cri_grpc

    if socket.exists():
        with grpc.insecure_channel(f"unix://{socket}") as ch:
            try:
                v = cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=timeout)
            except grpc.RpcError:
                v = None
        if v is not None and v.runtime_name == "containerd" and v.runtime_version:
            return v.runtime_version, f"CRI Version on {socket}"
    for binary in binaries:
        if binary.is_file():
            try:
                res = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=timeout)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.strip(), f"{binary} --version"
    return None


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (OSError, urllib.error.URLError):
        return False


def wait_healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not healthy(url):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def weft_pods(socket: Path) -> list[str] | None:
    """``namespace/name`` of the ready pod sandboxes on the ``weft`` handler; None if nobody answers on ``socket``."""
    import grpc
    from cri_api.v1 import api_pb2 as cri
    from cri_api.v1 import api_pb2_grpc as cri_grpc

    if not socket.exists():
        return None
    with grpc.insecure_channel(f"unix://{socket}") as ch:
        try:
            items = cri_grpc.RuntimeServiceStub(ch).ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items
        except grpc.RpcError:
            return None
    return sorted(f"{s.metadata.namespace}/{s.metadata.name}" for s in items
                  if s.runtime_handler == "weft" and s.state == cri.SANDBOX_READY)
