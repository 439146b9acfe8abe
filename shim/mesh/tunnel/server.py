"""The host's tunnel port, and the origin's streaming server: listening sockets whose connections become pipes.

On the wire, the dialler sends (inside TLS for a stream tunnel)
``WEFT-TUNNEL/1 <token hex>\\n`` and reads ``OK\\n`` or ``ERR <why>\\n``;
bytes flow both ways after ``OK``. A TLS connection is told from a plain one
by its first byte (a TLS handshake record starts with 0x16).

An accept loop must outlive whatever is done to it: the tunnel port is
reachable from any pod. At most ``MAX_HANDSHAKES`` connections are in their
handshake at once (more are closed at once), each with one deadline for the
whole handshake however slowly its bytes come (``Deadline``); a failed
accept (out of file descriptors, memory) or a thread that cannot start is
logged and waited out, not the end of the loop; and ``alive`` says whether
the loop still runs, for ``/healthz``.

Nothing is known of a connection before its handshake but its source
address, and idle connections from a tenant pod would otherwise take every
handshake slot and refuse the origins their tunnels. So the tunnel port
splits them: connections from a mesh peer's address (``trusted``, the
addresses discovery gives) have a pool of slots of their own, and every
other source shares the rest with at most ``MAX_PER_SOURCE`` in their
handshake at once from one address.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

from shim import log
from shim.errors import WeftError
from shim.mesh.tunnel.accept import RESOURCE_ERRNOS, NotTaken, accept_loop
from shim.mesh.tunnel.ends import HANDSHAKE_TIMEOUT_S, End, SocketEnd, TlsEnd, TunnelError, contexts, tune
from shim.mesh.tunnel.grants import Grants
from shim.mesh.tunnel.pipe import Pipes

_log = log.get("weft.tunnel")

MAGIC = b"WEFT-TUNNEL/1 "
_MAX_LINE = 512
# Connections in their handshake at once, per listening socket (each holds a thread until its deadline).
MAX_HANDSHAKES = 64
# Of those, from one address that is not a mesh peer's (the tunnel port only).
MAX_PER_SOURCE = 8


class Deadline:
    """One deadline for a whole handshake: each blocking read gets what is left of it."""

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def apply(self, sock: socket.socket) -> None:
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("handshake deadline passed")
        sock.settimeout(left)


def read_line(end: End, limit: int = _MAX_LINE, deadline: Deadline | None = None) -> bytes:
    """One line, read byte-exactly for a plain end (nothing past it is consumed), by ``deadline`` if given."""
    buf = bytearray()
    one = bytearray(1)
    while not buf.endswith(b"\n"):
        if deadline is not None:
            deadline.apply(end.sock)
        if isinstance(end, TlsEnd):
            chunk = bytearray(limit)
            n = end.recv_into(chunk)
            if n == 0:
                break
            buf += chunk[:n]
        else:
            if end.recv_into(one) == 0:
                break
            buf += one
        if len(buf) > limit:
            raise TunnelError("tunnel header too long")
    if not buf.endswith(b"\n"):
        raise TunnelError("tunnel closed before its header ended")
    return bytes(buf)


class PipeServer:
    """A listening socket: a thread per accepted connection (``_serve``), and the pipes they joined.

    ``stop`` closes the socket and aborts every pipe still open, so nothing
    it accepted outlives it. The tunnel port and the origin's streaming
    server are both one.
    """

    thread_name = "weft-pipe"

    def __init__(self, sock: socket.socket, *, busy_poll_us: int = 0, max_handshakes: int = MAX_HANDSHAKES,
                 per_source: int | None = None, trusted: Callable[[], Collection[str]] | None = None) -> None:
        self._sock = sock
        self.busy_poll_us = busy_poll_us  # for the pipes of interactive streams (agent.stream_busy_poll_us)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pipes = Pipes()
        self._lock = threading.Lock()
        self._handshakes = threading.BoundedSemaphore(max_handshakes)
        # Sources whose connections have slots of their own (None: every source shares one pool).
        self._trusted = trusted
        self._trusted_handshakes = threading.BoundedSemaphore(max_handshakes)
        self._per_source = per_source  # None: no cap per address
        self._in_handshake: dict[str, int] = {}  # untrusted source address -> its connections in their handshake

    @property
    def alive(self) -> bool:
        """Whether the accept loop runs (or was stopped on purpose): False only for a loop that died."""
        return self._thread is None or self._stop.is_set() or self._thread.is_alive()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._accept_loop, name=f"{self.thread_name}-accept", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._thread is not None:
            self._thread.join(5)
        self.pipes.abort_all()

    def _accept_loop(self) -> None:
        try:
            self._accept_until_stopped()
        except Exception as exc:  # noqa: BLE001 - nothing expected gets here; /healthz says the loop died
            _log.error("tunnel.accept_loop_died", server=self.thread_name, error=f"{type(exc).__name__}: {exc}")

    def _accept_until_stopped(self) -> None:
        # Only a stop ends it: an accept that fails otherwise is waited out (the socket is this server's alone).
        accept_loop(lambda: self._sock.accept(), self._take, self._failed, stop=self._stop)

    def _take(self, conn: socket.socket, peer: tuple) -> None:
        release = self._slot(peer)
        if release is None:
            _log.warning("tunnel.busy", server=self.thread_name, peer=_peer(peer))
            _drop(conn)
            return
        try:
            threading.Thread(target=self._handshake, args=(conn, peer, release), name=f"{self.thread_name}-conn",
                             daemon=True).start()
        except RuntimeError as exc:  # no thread to be had (a task limit): this connection waits for none
            release()
            _drop(conn)
            raise NotTaken(str(exc)) from exc

    def _failed(self, exc: OSError | NotTaken) -> None:
        if isinstance(exc, NotTaken) or exc.errno in RESOURCE_ERRNOS:
            _log.warning("tunnel.accept_failed", server=self.thread_name, error=str(exc))

    def _slot(self, peer: tuple) -> Callable[[], None] | None:
        """A handshake slot for a connection from ``peer``, as the function that gives it back; None: none free."""
        source = _source(peer)
        if self._trusted is not None and source in self._trusted():
            pool = self._trusted_handshakes
            return pool.release if pool.acquire(blocking=False) else None
        if self._per_source is not None:
            with self._lock:
                if self._in_handshake.get(source, 0) >= self._per_source:
                    return None
        if not self._handshakes.acquire(blocking=False):
            return None
        if self._per_source is None:
            return self._handshakes.release
        with self._lock:
            self._in_handshake[source] = self._in_handshake.get(source, 0) + 1

        def release() -> None:
            with self._lock:
                left = self._in_handshake.pop(source) - 1
                if left:
                    self._in_handshake[source] = left
            self._handshakes.release()
        return release

    def _handshake(self, conn: socket.socket, peer: tuple, release: Callable[[], None]) -> None:
        try:
            self._serve(conn, peer)
        except Exception as exc:  # noqa: BLE001 - one connection's failure is never the server's
            _log.warning("tunnel.refused", peer=_peer(peer), error=f"{type(exc).__name__}: {exc}")
            _drop(conn)
        finally:
            release()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError

    def join(self, a: End, b: End, name: str, *, interactive: bool = False) -> None:
        """Pipe ``a`` and ``b`` together, tracked until either side ends; an interactive pipe busy-polls."""
        self.pipes.start(a, b, name, busy_poll_us=self.busy_poll_us if interactive else 0)


def _peer(peer: tuple) -> str:
    return f"{peer[0]}:{peer[1]}" if len(peer) >= 2 else str(peer)


def _source(peer: tuple) -> str:
    """The connection's source address as discovery spells a peer's (an IPv4-mapped one as plain IPv4)."""
    address = str(peer[0]) if peer else ""
    return address.removeprefix("::ffff:") if address.startswith("::ffff:") and "." in address else address


def _drop(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.close()


class TunnelServer(PipeServer):
    """The host's tunnel port: a token, then the granted target, joined to the connection."""

    thread_name = "weft-tunnel"

    def __init__(self, host: str, tls_dir: str | Path, node: str, *, port: int = 0, busy_poll_us: int = 0,
                 max_handshakes: int = MAX_HANDSHAKES, per_source: int = MAX_PER_SOURCE,
                 trusted: Callable[[], Collection[str]] | None = None) -> None:
        """``trusted``: the mesh peers' addresses now (``MeshNode.peer_addresses``), whose connections have
        handshake slots of their own; every other address has at most ``per_source`` of the shared ones."""
        self.grants = Grants()
        self._server_ctx, _ = contexts(tls_dir, node)
        super().__init__(socket.create_server((host, port), backlog=512, reuse_port=False),
                         busy_poll_us=busy_poll_us, max_handshakes=max_handshakes, per_source=per_source,
                         trusted=trusted)
        self.address = "{}:{}".format(*self._sock.getsockname()[:2])

    def start(self) -> None:
        super().start()
        _log.info("tunnel.serving", address=self.address)

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        tune(conn, tunnel=True)
        end: SocketEnd = SocketEnd(conn)
        deadline = Deadline(HANDSHAKE_TIMEOUT_S)  # for everything up to OK, however slowly it comes
        try:
            deadline.apply(conn)
            first = conn.recv(1, socket.MSG_PEEK)
            node = None
            if first == b"\x16":
                end = TlsEnd(conn, self._server_ctx, server_side=True)
                end.handshake(max(0.001, deadline.at - time.monotonic()))
                node = end.peer_node()
            line = read_line(end, deadline=deadline)
            if not line.startswith(MAGIC):
                raise TunnelError("not a weft tunnel")
            try:
                token = bytes.fromhex(line[len(MAGIC):].strip().decode())
            except ValueError:
                raise TunnelError("malformed token") from None
            grant = self.grants.take(token)
            if grant is None:
                raise TunnelError("unknown or expired token")
            if grant.tls and node != grant.origin:
                if grant.on_expire is not None:
                    grant.on_expire()
                raise TunnelError(f"token granted to {grant.origin} presented by {node or 'a plain connection'}")
            try:
                target = grant.connect()
            except (OSError, WeftError) as exc:
                end.sendall(f"ERR {grant.what}: {exc}\n".encode())
                _log.warning("tunnel.target_failed", origin=grant.origin, target=grant.what, error=str(exc))
                end.close()
                return
            tune(target, tunnel=False)
            target.settimeout(None)
            end.sendall(b"OK\n")
            end.sock.settimeout(None)
        except (OSError, ssl.SSLError, TunnelError) as exc:
            _log.warning("tunnel.refused", peer=_peer(peer), error=str(exc) or type(exc).__name__)
            with contextlib.suppress(OSError):
                if isinstance(exc, TunnelError):
                    end.sendall(f"ERR {exc}\n".encode())
            end.close()
            return
        self.join(end, SocketEnd(target), grant.what, interactive=grant.interactive)
