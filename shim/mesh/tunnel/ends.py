"""The ends of a tunnel: a plain TCP socket or TLS over one, with blocking calls for setup and non-blocking
ones for a pipe; the mesh's TLS contexts; socket tuning for latency and cut links.

Tunnel sockets carry keepalives and ``TCP_USER_TIMEOUT``, so a cut link ends
a transfer with an error within seconds rather than TCP's minutes.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from pathlib import Path
from typing import Protocol

import grpc

from shim.errors import WeftError
from shim.mesh.certs import NODE_URI_PREFIX
from shim.mesh.tlsreload import NodeTls, ReloadingContext

HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
# A tunnel whose peer acknowledges nothing for this long is dead (a cut link, a vanished node).
USER_TIMEOUT_S = 5.0


class TunnelError(WeftError):
    """A tunnel could not be opened: the peer refused the token, or the target did not answer."""

    code = grpc.StatusCode.UNAVAILABLE


class End(Protocol):
    """One side of a pipe: blocking calls for a tunnel's setup, non-blocking ones for the pipe's loop."""

    sock: socket.socket

    def recv_into(self, buf: bytearray) -> int: ...
    def sendall(self, data: memoryview | bytes) -> None: ...
    # Non-blocking (the socket is set so by the pipe): bytes read, 0 at EOF, None when nothing has come yet.
    # A short read means the end is drained until poll says otherwise.
    def read_some(self, buf: memoryview) -> int | None: ...
    # Non-blocking: bytes taken from ``data`` (0: the socket is full).
    def write_some(self, data: memoryview) -> int: ...
    def shutdown_write(self) -> None: ...
    def abort(self) -> None: ...
    def close(self) -> None: ...


def tune(sock: socket.socket, *, tunnel: bool) -> None:
    """No Nagle (request/response latency); on a tunnel, keepalives and a user timeout (cut links)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tunnel:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(USER_TIMEOUT_S * 1000))


class SocketEnd:
    """A plain TCP socket as one end of a pipe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv_into(self, buf: bytearray) -> int:
        return self.sock.recv_into(buf)

    def sendall(self, data: memoryview | bytes) -> None:
        self.sock.sendall(data)

    def read_some(self, buf: memoryview) -> int | None:
        try:
            return self.sock.recv_into(buf)
        except (BlockingIOError, InterruptedError):
            return None

    def write_some(self, data: memoryview) -> int:
        try:
            return self.sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    # socket.socket's shutdown, not SSLSocket's (which would drop the TLS state): a half-close is the TCP one.
    def shutdown_write(self) -> None:
        socket.socket.shutdown(self.sock, socket.SHUT_WR)

    def abort(self) -> None:
        """Close with a reset (SO_LINGER 0)."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            socket.socket.shutdown(self.sock, socket.SHUT_RD)
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


class TlsEnd(SocketEnd):
    """TLS on a socket, OpenSSL reading and writing the socket itself (one C call a record, no BIOs in Python).

    The socket is wrapped (``sock`` is the ``ssl.SSLSocket`` from then on).
    Non-blocking for the pipe: a read that wants more bytes is ``None``, a
    write the socket would not take is 0 and is retried with the same bytes,
    as OpenSSL requires. No close_notify is sent: EOF on the socket is EOF on
    the stream (``OP_IGNORE_UNEXPECTED_EOF``), as the protocols carried
    (SPDY, WebSocket) frame their own ends; a half-close is the TCP one. One
    thread uses an end at a time: the tunnel's setup, then its pipe.
    """

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext | ReloadingContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        super().__init__(ctx.wrap_socket(sock, server_side=server_side, server_hostname=server_hostname,
                                         do_handshake_on_connect=False))
        self._eof = False

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.sock.settimeout(timeout)
        try:
            self.sock.do_handshake()
        except ssl.SSLEOFError:
            raise ConnectionError("the peer closed the connection during the TLS handshake") from None
        self.sock.settimeout(None)

    def peer_node(self) -> str | None:
        cert = self.sock.getpeercert() or {}
        nodes = {v[len(NODE_URI_PREFIX):] for k, v in cert.get("subjectAltName", ()) if k == "URI"
                 and v.startswith(NODE_URI_PREFIX)}
        return nodes.pop() if len(nodes) == 1 else None

    def recv_into(self, buf: bytearray) -> int:
        try:
            return self.sock.recv_into(buf)
        except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
            return 0

    def read_some(self, buf: memoryview) -> int | None:
        got = 0
        while got < len(buf):
            try:
                n = self.sock.recv_into(buf[got:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError, InterruptedError):
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                n = 0
            if n == 0:
                self._eof = True
                break
            got += n
            # What is left of a record is decrypted here already; the next record is still in the socket,
            # where poll sees it (no read-ahead).
            if not self.sock.pending():
                break
        if got:
            return got
        return 0 if self._eof else None

    def write_some(self, data: memoryview) -> int:
        try:
            return self.sock.send(data)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            return 0


def contexts(tls_dir: str | Path, node: str) -> tuple[ReloadingContext, ReloadingContext]:
    """(server, client) contexts from the node's mesh pair and the cluster CA, both requiring the other's cert.

    Each wraps a socket with the files as they are then: a renewed certificate is used by the next tunnel
    (``shim.mesh.tlsreload``)."""
    source = NodeTls(tls_dir, node)
    return ReloadingContext(source, _server_context), ReloadingContext(source, _client_context)


def _server_context(key: Path, cert: Path, ca: Path) -> ssl.SSLContext:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.load_verify_locations(ca)
    server.verify_mode = ssl.CERT_REQUIRED
    return _common(server)


def _client_context(key: Path, cert: Path, ca: Path) -> ssl.SSLContext:
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.load_verify_locations(ca)
    return _common(client)


def _common(ctx: ssl.SSLContext) -> ssl.SSLContext:
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)  # EOF ends a stream (see TlsEnd)
    return ctx
