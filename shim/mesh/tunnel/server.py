"""The host's tunnel port, and the origin's streaming server: listening sockets whose connections become pipes.

On the wire, the dialler sends (inside TLS for a stream tunnel)
``WEFT-TUNNEL/1 <token hex>\\n`` and reads ``OK\\n`` or ``ERR <why>\\n``;
bytes flow both ways after ``OK``. A TLS connection is told from a plain one
by its first byte (a TLS handshake record starts with 0x16).
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
from pathlib import Path

from shim import log
from shim.errors import WeftError
from shim.mesh.tunnel.ends import HANDSHAKE_TIMEOUT_S, End, SocketEnd, TlsEnd, TunnelError, contexts, tune
from shim.mesh.tunnel.grants import Grants
from shim.mesh.tunnel.pipe import Pipe

_log = log.get("weft.tunnel")

MAGIC = b"WEFT-TUNNEL/1 "
_MAX_LINE = 512


def read_line(end: End, limit: int = _MAX_LINE) -> bytes:
    """One line, read byte-exactly for a plain end (nothing past it is consumed)."""
    buf = bytearray()
    one = bytearray(1)
    while not buf.endswith(b"\n"):
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

    def __init__(self, sock: socket.socket, *, busy_poll_us: int = 0) -> None:
        self._sock = sock
        self.busy_poll_us = busy_poll_us  # for the pipes of interactive streams (agent.stream_busy_poll_us)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.pipes: set[Pipe] = set()
        self._lock = threading.Lock()

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
        with self._lock:
            pipes = list(self.pipes)
        for p in pipes:
            p.abort()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, peer = self._sock.accept()
            except OSError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name=f"{self.thread_name}-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        raise NotImplementedError

    def join(self, a: End, b: End, name: str, *, interactive: bool = False) -> None:
        """Pipe ``a`` and ``b`` together, tracked until either side ends; an interactive pipe busy-polls."""
        pipe = Pipe(a, b, name=name, on_close=self._closed, busy_poll_us=self.busy_poll_us if interactive else 0)
        with self._lock:
            self.pipes.add(pipe)
        pipe.start()

    def _closed(self, pipe: Pipe) -> None:
        with self._lock:
            self.pipes.discard(pipe)


class TunnelServer(PipeServer):
    """The host's tunnel port: a token, then the granted target, joined to the connection."""

    thread_name = "weft-tunnel"

    def __init__(self, host: str, tls_dir: str | Path, node: str, *, port: int = 0, busy_poll_us: int = 0) -> None:
        self.grants = Grants()
        self._server_ctx, _ = contexts(tls_dir, node)
        super().__init__(socket.create_server((host, port), backlog=512, reuse_port=False),
                         busy_poll_us=busy_poll_us)
        self.address = "{}:{}".format(*self._sock.getsockname()[:2])

    def start(self) -> None:
        super().start()
        _log.info("tunnel.serving", address=self.address)

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        tune(conn, tunnel=True)
        end: SocketEnd = SocketEnd(conn)
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            first = conn.recv(1, socket.MSG_PEEK)
            node = None
            if first == b"\x16":
                end = TlsEnd(conn, self._server_ctx, server_side=True)
                end.handshake()
                node = end.peer_node()
                end.sock.settimeout(HANDSHAKE_TIMEOUT_S)
            line = read_line(end)
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
            _log.warning("tunnel.refused", peer=f"{peer[0]}:{peer[1]}", error=str(exc))
            with contextlib.suppress(OSError):
                if isinstance(exc, TunnelError):
                    end.sendall(f"ERR {exc}\n".encode())
            end.close()
            return
        self.join(end, SocketEnd(target), grant.what, interactive=grant.interactive)
