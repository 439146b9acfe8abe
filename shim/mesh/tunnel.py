"""Byte tunnels between agents: the data path of exec/attach streams and of the stitched pod network.

The mesh's gRPC service decides *whether* a tunnel may open (``OpenTunnel``,
``Stitch``: the peer's certificate, the shadow's ownership) and hands out a
one-time token (``Grants``); the bytes then flow over a TCP connection of
their own to the host's tunnel listener (``TunnelServer``), not over gRPC.
Measured on the project's 2-core machine, moving 1 GiB through two relays in
Python: plain sockets with 256 KiB buffers carry 60-70% of a direct
connection (``weft bench network``), the same through TLS about 30% (AES-GCM
in user space on both relays), and a gRPC stream less still. So:

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
back (a pipe reads from one end only once the other has taken all it read,
no queue). Between two plain sockets what was read waits in a kernel pipe,
moved with splice(2) (``_Spliced``): no copy through Python, half the origin's
CPU per GiB.

A pipe of an interactive stream (exec, attach: ``busy_poll_us``) does not go
to sleep right after a small transfer: it polls without blocking, yielding
the CPU to any task that can run between two polls, for a window it learns
per direction (``BusyPoll``): up to ``busy_poll_us`` after a keystroke, whose
echo comes back at once, nothing after the echo, when a person's pause
follows. A keystroke's echo crosses two relays, each woken twice, and a
wake-up from idle costs 25-50 us on the project's 2-vCPU machine (the vCPU
halts; the other processes on the path pay it too), which took the exec
round trip to 1.7-1.9x a local container's; busy-polling up to 200 us takes
it to 0.9-1.3x, for about 0.2 ms more agent CPU a keystroke (``weft bench
network``). Bulk transfers (a wake that moved 16 KiB or more) and
pod-network tunnels never spin.

Tunnel sockets carry keepalives and ``TCP_USER_TIMEOUT``, so a cut link ends
a transfer with an error within seconds rather than TCP's minutes. Every pipe is counted (``Pipe.live``) so
that tests can see none leaks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import select
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
# A wake that moved less than this is interactive (keystrokes, a screen's update): busy-poll after it.
INTERACTIVE_BYTES = 16 << 10
# A wait that ends within this many busy-poll windows is part of an exchange, not a pause (BusyPoll).
EXCHANGE_WINDOWS = 8
_MAX_LINE = 512


class TunnelError(WeftError):
    """A tunnel could not be opened: the peer refused the token, or the target did not answer."""

    code = grpc.StatusCode.UNAVAILABLE


# -- ends -------------------------------------------------------------------------------
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

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, *, server_side: bool,
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


# -- pipes ------------------------------------------------------------------------------
_IN, _OUT, _BAD = select.POLLIN, select.POLLOUT, select.POLLERR | select.POLLHUP


class _Held:
    """What one direction of a pipe has read and the other end has not taken yet: in a buffer of ours."""

    def __init__(self) -> None:
        self._buf = memoryview(bytearray(BUFFER))
        self._view: memoryview | None = None

    def __len__(self) -> int:
        return len(self._view) if self._view is not None else 0

    def fill(self, src: End) -> int | None:
        """Read once from ``src`` (only when empty): as ``End.read_some``; a short read means drained."""
        n = src.read_some(self._buf)
        if n:
            self._view = self._buf[:n]
        return n

    def drain(self, dst: End) -> int:
        """Give ``dst`` what it takes; how much."""
        assert self._view is not None
        n = dst.write_some(self._view)
        self._view = self._view[n:] if n < len(self._view) else None
        return n

    def close(self) -> None:
        pass


class _Spliced:
    """The same between two plain sockets, held in a kernel pipe: splice(2) moves the pages, no copy through us."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, BUFFER)
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def fill(self, src: End) -> int | None:
        try:
            n = os.splice(src.sock.fileno(), self._w, BUFFER, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except (BlockingIOError, InterruptedError):
            return None
        self._held = n
        return n

    def drain(self, dst: End) -> int:
        try:
            n = os.splice(self._r, dst.sock.fileno(), self._held, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except (BlockingIOError, InterruptedError):
            return 0
        self._held -= n
        return n

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class BusyPoll:
    """How long a pipe polls without sleeping after a small transfer, learnt per direction.

    After moving a keystroke one way, the echo comes back the other way within
    a fraction of a millisecond: polling for it without sleeping saves the
    wake-up from idle. After moving the echo on, the next keystroke is a
    person's pause away: polling for it wastes the CPU. So each direction has
    a window, as cpuidle-haltpoll keeps one for a CPU: a wait it caught
    leaves it as it is; a wait that ended within ``EXCHANGE_WINDOWS *
    max_ns`` (an exchange under way: without the spin the echo takes longer
    than the window) restores it to ``max_ns``; a longer one (a pause) halves
    it, down to nothing under ``max_ns / 8``. Between two polls ``relax``
    (sched_yield) lets whatever else can run on this CPU run: the spin keeps
    the CPU from going idle, it takes no time from other work.
    """

    def __init__(self, max_ns: int, *, clock: Callable[[], int] = time.monotonic_ns,
                 relax: Callable[[], None] = os.sched_yield) -> None:
        self.max_ns = max_ns
        self.window_ns = [max_ns, max_ns]
        self._clock, self._relax = clock, relax

    def wait(self, poll: Callable[[int | None], list], direction: int) -> list:
        """``poll``'s events, after data moved in ``direction``: polled without blocking for the window first."""
        window = self.window_ns[direction]
        t0 = self._clock()
        while window:
            if events := poll(0):
                return events
            if self._clock() - t0 >= window:
                break
            self._relax()
        events = poll(None)
        if self._clock() - t0 <= self.max_ns * EXCHANGE_WINDOWS:
            self.window_ns[direction] = self.max_ns
        else:
            self.window_ns[direction] = window // 2 if window // 2 >= self.max_ns // 8 else 0
        return events


class Pipe:
    """Two ends joined both ways by one thread that polls both; see the module docstring.

    One thread, not one per direction: a reply then goes out from the thread
    that is already awake, where two threads hand the GIL to each other on
    every round trip (measured on loopback, one relay: 80 us a request/response
    that way, 15-17 us this way). Sockets are non-blocking; what one end
    sends is read only once the other has taken the last of it, so a slow
    reader holds the writer back.
    """

    live = 0
    _count_lock = threading.Lock()

    def __init__(self, a: End, b: End, name: str, on_close: Callable[[Pipe], None] | None = None, *,
                 busy_poll_us: int = 0) -> None:
        self.a, self.b, self.name = a, b, name
        self.on_close = on_close
        self.busy_poll_us = busy_poll_us
        self.bytes = [0, 0]
        self.error: str = ""
        self._lock = threading.Lock()
        self._aborted = False
        self._finished = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def start(self) -> Pipe:
        with Pipe._count_lock:
            Pipe.live += 1
        threading.Thread(target=self._run, name=f"weft-pipe-{self.name}", daemon=True).start()
        return self

    def abort(self, exc: BaseException | None = None) -> None:
        """End both sides with a reset; from any thread (the pipe's own thread does the closing)."""
        with self._lock:
            if self._aborted or self._finished:
                return
            self._aborted = True
            if exc is not None:
                self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake, 1)
        if exc is not None:
            _log.info("tunnel.reset", pipe=self.name, error=self.error, sent=self.bytes[0], received=self.bytes[1])

    def _run(self) -> None:
        ends = (self.a, self.b)
        try:
            for e in ends:
                e.sock.setblocking(False)
            self._loop(ends)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.abort(exc)
        finally:
            with self._lock:
                self._finished = True
                os.close(self._wake)
            for e in ends:
                with contextlib.suppress(OSError):
                    e.abort() if self._aborted else e.close()
            with Pipe._count_lock:
                Pipe.live -= 1
            if self.on_close is not None:
                self.on_close(self)

    def _loop(self, ends: tuple[End, End]) -> None:
        # Read from ends[i], not yet taken by the other end; between plain sockets it stays in the kernel.
        kind: type[_Held | _Spliced] = _Spliced if all(type(e) is SocketEnd for e in ends) else _Held
        held = (kind(), kind())
        try:
            self._move(ends, held)
        finally:
            for h in held:
                h.close()

    def _move(self, ends: tuple[End, End], held: tuple[_Held | _Spliced, _Held | _Spliced]) -> None:
        eof, shut = [False, False], [False, False]  # ends[i] said EOF; the other was shut for writing after it
        readable, writable = [True, True], [True, True]
        fds = (ends[0].sock.fileno(), ends[1].sock.fileno())
        poller = select.poll()
        poller.register(self._wake, _IN)
        masks = [0, 0]
        busy = BusyPoll(self.busy_poll_us * 1000) if self.busy_poll_us else None
        while not (shut[0] and shut[1]):
            more = False  # a direction that had its 8 rounds and may move further: no waiting
            moved = [0, 0]
            for i in (0, 1):  # move each direction as far as it goes without blocking
                src, dst, j = ends[i], ends[1 - i], 1 - i
                for _ in range(8):  # then the other direction's turn, so that neither starves
                    if held[i]:
                        if not writable[j]:
                            break
                        if held[i].drain(dst) == 0 or held[i]:
                            writable[j] = False
                            break
                    if eof[i]:
                        if not shut[i]:
                            dst.shutdown_write()
                            shut[i] = True
                        break
                    if not readable[i]:
                        break
                    n = held[i].fill(src)
                    if n is None or 0 < n < BUFFER:
                        readable[i] = False
                    if n == 0:
                        eof[i] = True
                    elif n is not None:
                        self.bytes[i] += n
                        moved[i] += n
                else:
                    more = True
            if shut[0] and shut[1]:
                return
            if more:
                continue
            for k in (0, 1):  # what to wait for on each end; an end with nothing to wait for is left out
                want = (_IN if not (eof[k] or readable[k] or held[k]) else 0) | (
                    _OUT if held[1 - k] and not writable[k] else 0)
                if want != masks[k]:
                    if not masks[k]:
                        poller.register(fds[k], want)
                    elif want:
                        poller.modify(fds[k], want)
                    else:
                        poller.unregister(fds[k])
                    masks[k] = want
            spin = busy is not None and 0 < moved[0] + moved[1] < INTERACTIVE_BYTES
            for fd, ev in busy.wait(poller.poll, int(moved[1] > moved[0])) if spin else poller.poll():
                if fd == self._wake:
                    return  # aborted: _run resets both ends
                k = fds.index(fd)
                if ev & select.POLLNVAL:
                    raise OSError(f"{self.name}: a socket of the pipe was closed under it")
                if ev & select.POLLERR and (err := ends[k].sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)):
                    raise OSError(err, os.strerror(err))
                if ev & (_IN | _BAD):
                    readable[k] = True
                if ev & (_OUT | _BAD):
                    writable[k] = True


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
    interactive: bool = False  # a person's stream (exec, attach): its pipe busy-polls (see Pipe)


class Grants:
    """One-time tokens for tunnels, each valid for ``ttl`` seconds."""

    def __init__(self, ttl: float = TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.clock = ttl, clock
        self._lock = threading.Lock()
        self._by_token: dict[bytes, Grant] = {}

    def add(self, origin: str, connect: Callable[[], socket.socket], *, tls: bool, what: str,
            on_expire: Callable[[], None] | None = None, interactive: bool = False) -> bytes:
        token = secrets.token_bytes(24)
        self.expire()
        with self._lock:
            self._by_token[token] = Grant(origin, connect, tls, what, self.clock() + self.ttl, on_expire,
                                          interactive)
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
            end.sock.settimeout(timeout)
        end.sendall(MAGIC + token.hex().encode() + b"\n")
        answer = read_line(end)
    except (OSError, ssl.SSLError, TunnelError) as exc:
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: {exc}") from exc
    if answer != b"OK\n":
        end.close()
        raise TunnelError(f"tunnel to {node or address} at {address}: "
                          f"{answer.decode(errors='replace').strip().removeprefix('ERR ')}")
    end.sock.settimeout(None)
    return end
