"""Sockets in a pod's network namespace, and which TCP ports listen there.

``setns`` changes the namespace of the calling *thread* only, and a socket
belongs to the namespace it was created in for its whole life. So each
namespace gets a small executor whose threads enter it once, at start
(``Netns``); sockets made there (listeners, outgoing connections, the
sock_diag netlink socket) are then used from any thread. The agent's own
threads never change namespace.

Listening ports come from sock_diag through pyroute2 (one netlink dump of
TCP sockets in LISTEN state, v4 and v6), not from running ``ss``.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from cri_api.v1 import api_pb2 as cri

from shim.errors import WeftError

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


class NetnsError(WeftError):
    """A pod's network namespace could not be found or entered."""


def _enter(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


class Netns:
    """Work done inside one network namespace (``path``: a bind mount or ``/proc/<pid>/ns/net``)."""

    def __init__(self, path: str, workers: int = 2) -> None:
        self.path = path
        self._ready = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="weft-netns")
        # sock_diag gets a thread of its own: pyroute2 keeps an event loop (and its transports) in the
        # thread that made the socket, and only closing it there closes them.
        self._diag_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weft-netns-diag")
        self._entered = threading.local()
        self._diag = None
        self._diag_lock = threading.Lock()

    def run(self, fn: Callable[..., T], *args: object, pool: ThreadPoolExecutor | None = None) -> T:
        """``fn(*args)`` in a thread inside the namespace; NetnsError when it cannot be entered."""
        def inside() -> T:
            if not getattr(self._entered, "yes", False):
                try:
                    _enter(self.path)
                except OSError as exc:
                    raise NetnsError(f"network namespace {self.path}: {exc}") from exc
                self._entered.yes = True
            return fn(*args)

        return (pool or self._pool).submit(inside).result()

    def listen(self, host: str, port: int, backlog: int = 512) -> socket.socket:
        return self.run(_listener, socket.AF_INET, host, port, backlog)

    def listen_any(self, port: int, backlog: int = 512) -> socket.socket:
        """A listener on every address, IPv4 and IPv6 (``::``, dual-stack); ``0.0.0.0`` where IPv6 is off."""
        try:
            return self.run(_listener, socket.AF_INET6, "::", port, backlog)
        except OSError as exc:
            if exc.errno not in _IPV6_OFF:
                raise
        return self.listen("0.0.0.0", port, backlog)

    def listen_loopback(self, port: int, backlog: int = 512) -> list[socket.socket]:
        """Listeners on 127.0.0.1 and ::1 (not on the namespace's other addresses); 127.0.0.1 only where IPv6 is off.

        A port already taken on either address is an error (the listener made on the other is closed).
        """
        v4 = self.listen("127.0.0.1", port, backlog)
        try:
            return [v4, self.run(_listener, socket.AF_INET6, "::1", port, backlog)]
        except OSError as exc:
            if exc.errno in _IPV6_OFF:
                return [v4]
            v4.close()
            raise

    def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        return self.run(socket.create_connection, (host, port), timeout)

    def connect_loopback(self, port: int, timeout: float) -> socket.socket:
        """``port`` on 127.0.0.1, or on ::1 for a server that listens there only."""
        try:
            return self.connect("127.0.0.1", port, timeout)
        except ConnectionRefusedError:
            try:
                return self.connect("::1", port, timeout)
            except OSError:
                raise ConnectionRefusedError(errno.ECONNREFUSED,
                                             f"nothing listens on port {port} on 127.0.0.1 or ::1") from None

    def listening(self) -> dict[int, set[int]]:
        """TCP port -> inodes of the sockets listening on it, in this namespace."""
        return {port: set(socks) for port, socks in self.listening_on().items()}

    def listening_on(self) -> dict[int, dict[int, str]]:
        """TCP port -> {inode: the address it is bound to} of the sockets listening on it, in this namespace."""
        return self.run(self._listening, pool=self._diag_pool)

    def _listening(self) -> dict[int, dict[int, str]]:
        from pyroute2 import DiagSocket
        from pyroute2.netlink.diag import SS_LISTEN

        with self._diag_lock:
            if self._diag is None:
                self._diag = DiagSocket()
                self._diag.bind()
            out: dict[int, dict[int, str]] = {}
            for family in (socket.AF_INET, socket.AF_INET6):
                for s in self._diag.get_sock_stats(family=family, states=1 << SS_LISTEN):
                    out.setdefault(s["idiag_sport"], {})[s["idiag_inode"]] = s["idiag_src"]
            return out

    def close(self) -> None:
        with self._diag_lock:
            diag, self._diag = self._diag, None
        if diag is not None:
            try:  # in the thread that made it (see __init__)
                self._diag_pool.submit(diag.close).result()
            except Exception:  # noqa: BLE001 - the pool may be gone already; close here then
                diag.close()
        self._diag_pool.shutdown(wait=True)
        self._pool.shutdown(wait=False)


# What binding an IPv6 address fails with when the namespace has IPv6 off.
_IPV6_OFF = (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT)


def _listener(family: int, host: str, port: int, backlog: int) -> socket.socket:
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(backlog)
    except OSError:
        s.close()
        raise
    return s


def sandbox_netns(call: Callable[[str, object, type], object], sandbox_id: str) -> str:
    """The network namespace path of a sandbox, from containerd's verbose PodSandboxStatus."""
    resp = call("/runtime.v1.RuntimeService/PodSandboxStatus",
                cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox_id, verbose=True), cri.PodSandboxStatusResponse)
    try:
        info = json.loads(resp.info.get("info", "{}"))
    except ValueError:
        info = {}
    # The sandbox's process first: a bind mount under containerd's state directory may not be
    # visible from the agent's mount namespace (an agent started by ``ip netns exec`` has its own).
    if info.get("pid") and os.path.exists(f"/proc/{info['pid']}/ns/net"):
        return f"/proc/{info['pid']}/ns/net"
    for ns in info.get("runtimeSpec", {}).get("linux", {}).get("namespaces", []):
        if ns.get("type") == "network" and ns.get("path"):
            return ns["path"]
    raise NetnsError(f"sandbox {sandbox_id[:13]} has no network namespace that containerd tells")


def owner_of(inodes: set[int]) -> str:
    """Which process holds one of these sockets ("pid 123 (nginx)"), for a log line; "" if none is found."""
    targets = {f"socket:[{i}]" for i in inodes}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        fd_dir = f"/proc/{pid}/fd"
        try:
            for fd in os.listdir(fd_dir):
                if os.readlink(f"{fd_dir}/{fd}") in targets:
                    with open(f"/proc/{pid}/comm") as f:
                        return f"pid {pid} ({f.read().strip()})"
        except OSError:
            continue
    return ""
