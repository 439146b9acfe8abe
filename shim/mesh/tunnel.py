"""Byte tunnels between agents: the data path of exec/attach streams and of the stitched pod network.

The mesh's gRPC service decides *whether* a tunnel may open (``OpenTunnel``,
``Stitch``: the peer's certificate, the shadow's ownership) and hands out a
one-time token (``Grants``); the bytes then flow over a TCP connection of
their own to the host's tunnel listener (``TunnelServer``), not over gRPC.
Measured on the project's 2-core machine, moving 1 GiB through two relays in
Python: plain sockets with 256 KiB buffers carry about 60% of a direct
connection, the same through TLS about 30% (AES-GCM in user space on both
relays), and a gRPC stream less still. So:

- **stream tunnels** (Exec, Attach: people's terminals, small and
  interactive) are TLS with the mesh certificates, and the host checks that
  the certificate names the origin the token was granted to;
- **pod-network tunnels** are plain TCP after the token, as the pod network
  between nodes is (the threat model leaves it to the cluster): the token,
  granted over mutual TLS, is what lets a connection through.

On the wire, the dialler sends (inside TLS for a stream tunnel)
``WEFT-TUNNEL/1 <token hex>\\n`` and reads ``OK\\n`` or ``ERR <why>\\n``;
bytes flow both ways after ``OK``. A TLS connection is told from a plain one
by its first byte (a TLS handshake record starts with 0x16).

A ``Pipe`` joins two ends and behaves as a direct connection would: EOF on one
side is a half-close (``shutdown(SHUT_WR)``) on the other, a reset or a
timeout on either aborts both with a reset, and a slow reader holds the writer
back (blocking writes, no queue). Tunnel sockets carry keepalives and
``TCP_USER_TIMEOUT``, so a cut link ends a transfer with an error within
seconds rather than TCP's minutes. Every pipe is counted (``Pipe.live``) so
that tests can see none leaks.
"""

from __future__ import annotations

import contextlib
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from shim import log
from shim.errors import WeftError
from shim.mesh.certs import NODE_URI_PREFIX

_log = log.get("weft.tunnel")

MAGIC = b"WEFT-TUNNEL/1 "
TOKEN_TTL_S = 10.0
HANDSHAKE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
# A tunnel whose peer acknowledges nothing for this long is dead (a cut link, a vanished node).
USER_TIMEOUT_S = 5.0
BUFFER = 256 << 10
_MAX_LINE = 512


class TunnelError(WeftError):
    """A tunnel could not be opened: the peer refused the token, or the target did not answer."""

    code = grpc.StatusCode.UNAVAILABLE


# -- ends -------------------------------------------------------------------------------
class End(Protocol):
    def recv_into(self, buf: bytearray) -> int: ...
    def sendall(self, data: memoryview | bytes) -> None: ...
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

    def shutdown_write(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def abort(self) -> None:
        """Close with a reset (SO_LINGER 0), waking a thread blocked reading it."""
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            self.sock.shutdown(socket.SHUT_RD)
        self.sock.close()

    def close(self) -> None:
        self.sock.close()


class TlsEnd(SocketEnd):
    """TLS over a socket through memory BIOs, so that one thread may read while another writes.

    An ``ssl.SSLSocket`` must not be read and written from two threads at once
    (OpenSSL's SSL object is not thread-safe); here the raw socket I/O happens
    outside the lock and only the short TLS record work inside it. No
    close_notify is sent: EOF on the socket is EOF on the stream, as the
    protocols carried (SPDY, WebSocket) frame their own ends.
    """

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None) -> None:
        super().__init__(sock)
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = ctx.wrap_bio(self._in, self._out, server_side=server_side, server_hostname=server_hostname)
        self._ssl = threading.Lock()
        self._send = threading.Lock()  # held across encrypt-and-send: records leave in order
        self._eof = False

    def handshake(self, timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.sock.settimeout(timeout)
        while True:
            try:
                self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                data = self.sock.recv(65536)
                if not data:
                    raise ConnectionError("the peer closed the connection during the TLS handshake") from None
                self._in.write(data)
        self._flush()
        self.sock.settimeout(None)

    def peer_node(self) -> str | None:
        cert = self._obj.getpeercert() or {}
        nodes = {v[len(NODE_URI_PREFIX):] for k, v in cert.get("subjectAltName", ()) if k == "URI"
                 and v.startswith(NODE_URI_PREFIX)}
        return nodes.pop() if len(nodes) == 1 else None

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.sock.sendall(data)

    def recv_into(self, buf: bytearray) -> int:
        while True:
            with self._ssl:
                try:
                    return self._obj.read(len(buf), buf)
                except ssl.SSLWantReadError:
                    pass
                except ssl.SSLZeroReturnError:
                    return 0
                except ssl.SSLError:  # the socket's EOF after all its records: no close_notify is sent
                    if self._eof:
                        return 0
                    raise
                pending = self._out.pending
            if pending:
                with self._send:
                    with self._ssl:
                        data = self._out.read()
                    self.sock.sendall(data)
            if self._eof:
                return 0
            data = self.sock.recv(BUFFER)
            if not data:
                self._eof = True
                with self._ssl:
                    self._in.write_eof()
                continue
            with self._ssl:
                self._in.write(data)

    def sendall(self, data: memoryview | bytes) -> None:
        with self._send:
            with self._ssl:
                view = memoryview(data)
                while view:
                    n = self._obj.write(view)
                    view = view[n:]
                out = self._out.read()
            self.sock.sendall(out)


# -- pipes ------------------------------------------------------------------------------
class Pipe:
    """Two ends joined both ways, each direction in a thread of its own; see the module docstring."""

    live = 0
    _count_lock = threading.Lock()

    def __init__(self, a: End, b: End, name: str, on_close: Callable[[Pipe], None] | None = None) -> None:
        self.a, self.b, self.name = a, b, name
        self.on_close = on_close
        self.bytes = [0, 0]
        self.error: str = ""
        self._lock = threading.Lock()
        self._left = 2
        self._aborted = False

    def start(self) -> Pipe:
        with Pipe._count_lock:
            Pipe.live += 1
        threading.Thread(target=self._pump, args=(self.a, self.b, 0), name=f"weft-pipe-{self.name}",
                         daemon=True).start()
        threading.Thread(target=self._pump, args=(self.b, self.a, 1), name=f"weft-pipe-{self.name}",
                         daemon=True).start()
        return self

    def _pump(self, src: End, dst: End, i: int) -> None:
        buf = bytearray(BUFFER)
        view = memoryview(buf)
        try:
            while True:
                n = src.recv_into(buf)
                if n == 0:
                    break
                dst.sendall(view[:n])
                self.bytes[i] += n
            if not self._aborted:
                dst.shutdown_write()
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.abort(exc)
        finally:
            self._done()

    def abort(self, exc: BaseException | None = None) -> None:
        with self._lock:
            if self._aborted:
                return
            self._aborted = True
            if exc is not None:
                self.error = f"{type(exc).__name__}: {exc}"
        if exc is not None:
            _log.info("tunnel.reset", pipe=self.name, error=self.error, sent=self.bytes[0], received=self.bytes[1])
        for end in (self.a, self.b):
            with contextlib.suppress(OSError):
                end.abort()

    def _done(self) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        for end in (self.a, self.b):
            with contextlib.suppress(OSError):
                end.close()
        with Pipe._count_lock:
            Pipe.live -= 1
        if self.on_close is not None:
            self.on_close(self)


# -- TLS contexts -----------------------------------------------------------------------
def contexts(tls_dir: str | Path, node: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) contexts from the node's mesh pair and the cluster CA, both requiring the other's cert."""
    d = Path(tls_dir)
    key, cert, ca = d / f"{node}.key", d / f"{node}.crt", d / "ca.crt"
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    server.load_verify_locations(ca)
    server.verify_mode = ssl.CERT_REQUIRED
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_cert_chain(cert, key)
    client.load_verify_locations(ca)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.options |= getattr(ssl, "OP_IGNORE_UNEXPECTED_EOF", 0)  # EOF ends a stream (see TlsEnd)
    return server, client


# -- the host's listener ------------------------------------------------------------------
@dataclass
class Grant:
    origin: str
    # Opens the far end once the token is presented (connects to the target, or hands over an accepted socket).
    connect: Callable[[], socket.socket]
    tls: bool
    what: str
    expires: float
    on_expire: Callable[[], None] | None = None


class Grants:
    """One-time tokens for tunnels, each valid for ``ttl`` seconds."""

    def __init__(self, ttl: float = TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Grant] = {}

    def add(self, origin: str, connect: Callable[[], socket.socket], *, tls: bool, what: str,
            on_expire: Callable[[], None] | None = None) -> bytes:
        token = secrets.token_bytes(24)
        self.expire()
        with self._lock:
            self._by_token[token] = Grant(origin, connect, tls, what, self.clock() + self.ttl, on_expire)
        return token

    def take(self, token: bytes) -> Grant | None:
        with self._lock:
            grant = self._by_token.pop(token, None)
        if grant is not None and grant.expires < self.clock():
            if grant.on_expire is not None:
                grant.on_expire()
            return None
        return grant

    def expire(self) -> int:
        now = self.clock()
        with self._lock:
            old = [t for t, g in self._by_token.items() if g.expires < now]
            gone = [self._by_token.pop(t) for t in old]
        for g in gone:
            if g.on_expire is not None:
                g.on_expire()
        return len(gone)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_token)


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

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
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

    def join(self, a: End, b: End, name: str) -> None:
        """Pipe ``a`` and ``b`` together, tracked until either side ends."""
        pipe = Pipe(a, b, name=name, on_close=self._closed)
        with self._lock:
            self.pipes.add(pipe)
        pipe.start()

    def _closed(self, pipe: Pipe) -> None:
        with self._lock:
            self.pipes.discard(pipe)


class TunnelServer(PipeServer):
    """The host's tunnel port: a token, then the granted target, joined to the connection."""

    thread_name = "weft-tunnel"

    def __init__(self, host: str, tls_dir: str | Path, node: str, *, port: int = 0) -> None:
        self.grants = Grants()
        self._server_ctx, _ = contexts(tls_dir, node)
        super().__init__(socket.create_server((host, port), backlog=512, reuse_port=False))
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
                conn.settimeout(HANDSHAKE_TIMEOUT_S)
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
            conn.settimeout(None)
        except (OSError, ssl.SSLError, TunnelError) as exc:
            _log.warning("tunnel.refused", peer=f"{peer[0]}:{peer[1]}", error=str(exc))
            with contextlib.suppress(OSError):
                if isinstance(exc, TunnelError):
                    end.sendall(f"ERR {exc}\n".encode())
            end.close()
            return
        self.join(end, SocketEnd(target), grant.what)


def dial(address: str, token: bytes, *, tls: ssl.SSLContext | None = None, node: str = "",
         timeout: float = CONNECT_TIMEOUT_S) -> SocketEnd:
    """Open a granted tunnel: connect, TLS when asked (the server must be ``node``), token, wait for OK."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    tune(sock, tunnel=True)
    end: SocketEnd = SocketEnd(sock)
    try:
        if tls is not None:
            end = TlsEnd(sock, tls, server_side=False, server_hostname=node)
            end.handshake(timeout)
            sock.settimeout(timeout)
        end.sendall(MAGIC + token.hex().encode() + b"\n")
        answer = read_line(end)
    except (OSError, ssl.SSLError, TunnelError) as exc:
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: {exc}") from exc
    if answer != b"OK\n":
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: "
                          f"{answer.decode(errors='replace').strip().removeprefix('ERR ')}")
    sock.settimeout(None)
    return end
