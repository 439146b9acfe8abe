"""Tunnels over loopback with real mesh certificates: tokens, TLS identity, half-close, resets, no leaks."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.mesh.certs import write_mesh_certs
from shim.mesh.tunnel import BusyPoll, Pipe, SocketEnd, TunnelError, TunnelServer, contexts, dial


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    write_mesh_certs(d, ["host", "origin", "other"])
    return d


@pytest.fixture
def server(certs: Path) -> Iterator[TunnelServer]:
    pipes_fds = _pipe_fds()
    s = TunnelServer("127.0.0.1", certs, "host")
    s.start()
    yield s
    s.stop()
    deadline = time.monotonic() + 5
    while Pipe.live and time.monotonic() < deadline:
        time.sleep(0.02)
    assert Pipe.live == 0, "a pipe outlived its test"
    # At most as many as before: an earlier test's subprocess pipes in this worker may close meanwhile.
    assert _pipe_fds() <= pipes_fds, "a pipe left its kernel pipes (splice) or its eventfd open"


def _pipe_fds() -> int:
    """This process's open pipes and eventfds, which only pipes of ours make here."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(("pipe:", "anon_inode:[eventfd]"))
    return n


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A server that echoes until EOF, then half-closes after a trailer: b'<n bytes>'."""
    lst = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = lst.accept()
            except OSError:
                return
            threading.Thread(target=one, args=(conn,), daemon=True).start()

    def one(conn: socket.socket) -> None:
        n = 0
        with conn:
            try:
                while data := conn.recv(65536):
                    n += len(data)
                    conn.sendall(data)
                conn.sendall(f"<{n}>".encode())
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    yield lst.getsockname()
    lst.close()


def _grant(server: TunnelServer, target: tuple[str, int], *, tls: bool, origin: str = "origin",
           interactive: bool = False) -> bytes:
    return server.grants.add(origin, lambda: socket.create_connection(target, 5), tls=tls, what="echo",
                             interactive=interactive)


# A stream tunnel (exec, attach) busy-polls on both relays; the bytes must not notice.
BUSY = pytest.mark.parametrize("busy_us", [0, 200], ids=["sleeping", "busy-polling"])


def _round_trip(end, payload: bytes) -> bytes:
    end.sendall(payload)
    end.shutdown_write()  # half-close: the far side still answers
    buf, out = bytearray(1 << 16), b""
    while n := end.recv_into(buf):
        out += bytes(buf[:n])
    end.close()
    return out


@BUSY
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_bytes_both_ways_and_half_close(server: TunnelServer, echo, certs: Path, tls: bool, busy_us: int) -> None:
    server.busy_poll_us = busy_us
    token = _grant(server, echo, tls=tls, interactive=True)
    end = dial(server.address, token, tls=contexts(certs, "origin")[1] if tls else None, node="host")
    payload = bytes(range(256)) * 8192  # 2 MiB
    assert _round_trip(end, payload) == payload + f"<{len(payload)}>".encode()


@BUSY
@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_slow_reader_holds_the_writer_back_and_nothing_is_lost(server: TunnelServer, echo, certs: Path,
                                                                 tls: bool, busy_us: int) -> None:
    """32 MiB through two pipes (ours, as the origin's relay, and the host's) to the echo while the reader sleeps
    first: full sockets on every hop, then all of it, in order."""
    server.busy_poll_us = busy_us
    token = _grant(server, echo, tls=tls, interactive=True)
    end = dial(server.address, token, tls=contexts(certs, "origin")[1] if tls else None, node="host")
    app, ours = socket.socketpair()
    Pipe(SocketEnd(ours), end, "test", busy_poll_us=busy_us).start()
    payload = hashlib.sha256(b"weft").digest() * (1 << 20)  # 32 MiB

    def write() -> None:
        app.sendall(payload)
        app.shutdown(socket.SHUT_WR)

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(1.0)  # the writer fills every socket on the way meanwhile and is held back
    got = hashlib.sha256()
    app.settimeout(30)
    while data := app.recv(1 << 16):
        got.update(data)
    writer.join(30)
    app.close()
    assert got.hexdigest() == hashlib.sha256(payload + f"<{len(payload)}>".encode()).hexdigest()


def test_a_token_works_once(server: TunnelServer, echo) -> None:
    token = _grant(server, echo, tls=False)
    dial(server.address, token).close()
    with pytest.raises(TunnelError, match="unknown or expired token"):
        dial(server.address, token)


def test_an_expired_token_is_refused_and_its_target_closed(server: TunnelServer, echo) -> None:
    closed = threading.Event()
    token = server.grants.add("origin", lambda: socket.create_connection(echo, 5), tls=False, what="x",
                              on_expire=closed.set)
    server.grants.ttl = 0
    server.grants._by_token[token].expires = time.monotonic() - 1
    with pytest.raises(TunnelError, match="unknown or expired"):
        dial(server.address, token)
    assert closed.is_set()


def test_a_stream_token_needs_tls_from_the_node_it_was_granted_to(server: TunnelServer, echo, certs: Path) -> None:
    with pytest.raises(TunnelError, match="presented by a plain connection"):
        dial(server.address, _grant(server, echo, tls=True))
    with pytest.raises(TunnelError, match="presented by other"):
        dial(server.address, _grant(server, echo, tls=True), tls=contexts(certs, "other")[1], node="host")


def test_a_host_that_is_not_the_node_dialled_is_refused(server: TunnelServer, echo, certs: Path) -> None:
    with pytest.raises(TunnelError):
        dial(server.address, _grant(server, echo, tls=True), tls=contexts(certs, "origin")[1], node="other")


def test_a_target_that_refuses_is_a_clear_error(server: TunnelServer) -> None:
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    with pytest.raises(TunnelError, match=r"echo: .*refused"):
        dial(server.address, _grant(server, ("127.0.0.1", port), tls=False))


def test_garbage_and_a_stalled_peer_are_let_go(server: TunnelServer, monkeypatch) -> None:
    host, port = server.address.rsplit(":", 1)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"GET / HTTP/1.1\r\n\r\n")
    s.settimeout(5)
    assert s.recv(100).startswith(b"ERR not a weft tunnel")
    s.close()
    monkeypatch.setattr("shim.mesh.tunnel.server.HANDSHAKE_TIMEOUT_S", 0.3)
    s = socket.create_connection((host, int(port)))
    s.sendall(b"WEFT-TUNNEL/1 ab")  # and nothing more
    s.settimeout(5)
    t0 = time.monotonic()
    assert s.recv(100) == b""  # dropped after the handshake timeout, not held
    assert time.monotonic() - t0 < 3
    s.close()


def test_a_reset_on_one_side_is_a_reset_on_the_other(server: TunnelServer) -> None:
    lst = socket.create_server(("127.0.0.1", 0))
    token = _grant(server, lst.getsockname(), tls=False)
    end = dial(server.address, token)
    far, _ = lst.accept()
    end.sendall(b"hello")
    assert far.recv(5) == b"hello"
    end.abort()  # RST from the dialler
    far.settimeout(5)
    with pytest.raises(ConnectionResetError):
        while far.recv(100):
            pass
    far.close()
    lst.close()


def test_keystrokes_through_two_busy_polling_relays_and_only_interactive_grants_spin(server: TunnelServer, echo,
                                                                                    certs: Path) -> None:
    """As an exec session crosses them: one byte at a time, each echoed, then EOF and the echo's trailer."""
    server.busy_poll_us = 200
    end = dial(server.address, _grant(server, echo, tls=True, interactive=True), tls=contexts(certs, "origin")[1],
               node="host")
    app, ours = socket.socketpair()
    Pipe(SocketEnd(ours), end, "origin", busy_poll_us=200).start()
    app.settimeout(5)
    for i in range(300):
        key = bytes([97 + i % 26])
        app.sendall(key)
        assert app.recv(1) == key
    bulk = dial(server.address, _grant(server, echo, tls=False))  # a pod-network tunnel
    deadline = time.monotonic() + 5
    while len(server.pipes) < 2 and time.monotonic() < deadline:  # joined just after its OK
        time.sleep(0.01)
    assert sorted(p.busy_poll_us for p in server.pipes) == [0, 200]
    bulk.close()
    app.shutdown(socket.SHUT_WR)
    assert app.recv(100) == b"<300>"
    app.close()


class _Clock:
    """Nanoseconds that pass only when the test says, ``step`` a reading."""

    def __init__(self, step: int = 0) -> None:
        self.now, self.step = 0, step

    def __call__(self) -> int:
        self.now += self.step
        return self.now


class _Poll:
    """A poller whose non-blocking polls find nothing ``empty`` times; a blocking one takes ``blocks_ns``."""

    def __init__(self, clock: _Clock, empty: int = 10**9, blocks_ns: int = 0) -> None:
        self.clock, self.empty, self.blocks_ns = clock, empty, blocks_ns
        self.calls: list[int | None] = []

    def __call__(self, timeout: int | None) -> list:
        self.calls.append(timeout)
        if timeout is None:
            self.clock.now += self.blocks_ns
            return [(5, 1)]
        if self.empty:
            self.empty -= 1
            return []
        return [(5, 1)]


def test_busy_poll_catches_an_event_in_its_window_without_sleeping() -> None:
    clock, relaxed = _Clock(step=10_000), []
    bp = BusyPoll(200_000, clock=clock, relax=lambda: relaxed.append(1))
    poll = _Poll(clock, empty=3)
    assert bp.wait(poll, 0) == [(5, 1)]
    assert poll.calls == [0, 0, 0, 0]  # never a blocking poll
    assert len(relaxed) == 3  # the CPU offered to others between polls
    assert bp.window_ns == [200_000, 200_000]


def test_busy_poll_spins_no_longer_than_its_window_then_sleeps() -> None:
    clock = _Clock(step=10_000)
    bp = BusyPoll(200_000, clock=clock, relax=lambda: None)
    poll = _Poll(clock, blocks_ns=50_000)  # the event comes soon after the window: an exchange
    assert bp.wait(poll, 1) == [(5, 1)]
    assert poll.calls[-1] is None and 0 < poll.calls.count(0) <= 20
    assert bp.window_ns[1] == 200_000


def test_pauses_close_a_directions_window_and_an_exchange_opens_it_again() -> None:
    clock = _Clock()
    bp = BusyPoll(200_000, clock=clock, relax=lambda: clock.__setattr__("now", clock.now + 10_000))
    pause = _Poll(clock, blocks_ns=100_000_000)  # a person's 0.1 s between keystrokes
    windows = []
    for _ in range(5):
        bp.wait(pause, 1)
        windows.append(bp.window_ns[1])
    assert windows == [100_000, 50_000, 25_000, 0, 0]
    assert bp.window_ns[0] == 200_000  # the other direction keeps its own
    pause.calls.clear()
    bp.wait(pause, 1)
    assert pause.calls == [None]  # a closed window: straight to sleep, no spinning
    bp.wait(_Poll(clock, blocks_ns=300_000), 1)  # an answer 0.3 ms later: an exchange again
    assert bp.window_ns[1] == 200_000


# -- an accept loop outlives what is done to it --------------------------------------------------------
def _closed_by_server(s: socket.socket) -> bool:
    try:
        return s.recv(100) == b"" or True  # EOF, or an ERR line before the close
    except TimeoutError:
        return False
    except OSError:
        return True


def test_a_handshake_has_one_deadline_however_slowly_its_bytes_come(server: TunnelServer, monkeypatch) -> None:
    """A byte every 0.2 s never waits the 0.5 s a single read may: only a deadline for the whole ends it."""
    monkeypatch.setattr("shim.mesh.tunnel.server.HANDSHAKE_TIMEOUT_S", 0.5)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.settimeout(0.2)
        header = b"WEFT-TUNNEL/1 " + b"ab" * 20  # 54 bytes: 11 s at this pace
        sent = 0
        for b in header:
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            if _closed_by_server(s):
                break
            sent += 1
        assert sent < len(header)


def test_connections_beyond_the_handshake_cap_are_closed_and_the_port_still_serves(certs: Path, echo) -> None:
    s = TunnelServer("127.0.0.1", certs, "host", max_handshakes=2)
    s.start()
    host, port = s.address.rsplit(":", 1)
    try:
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]
        time.sleep(0.2)  # both accepted and in their handshake
        with socket.create_connection((host, int(port))) as third:
            third.settimeout(4)  # under the handshake deadline: closed at once, not when the deadline passes
            assert third.recv(100) == b""
        for c in idle:
            c.close()
        assert _round_trip(_dial_retrying(s, echo), b"hello") == b"hello<5>"
        assert s.alive
    finally:
        s.stop()


def _idle_from(server: TunnelServer, source: str, n: int) -> list[socket.socket]:
    """``n`` connections from ``source`` (another loopback address) that never send a byte."""
    host, port = server.address.rsplit(":", 1)
    return [socket.create_connection((host, int(port)), source_address=(source, 0)) for _ in range(n)]


def _held(conns: list[socket.socket]) -> int:
    """How many of ``conns`` the server still holds in their handshake (not closed at once)."""
    held = 0
    for c in conns:
        c.settimeout(0.3)
        try:
            held += c.recv(100) != b""
        except TimeoutError:
            held += 1
        except OSError:
            pass
    return held


def test_one_address_holds_at_most_its_share_of_the_handshake_slots(certs: Path, echo) -> None:
    s = TunnelServer("127.0.0.1", certs, "host", max_handshakes=4, per_source=2)
    s.start()
    idle: list[socket.socket] = []
    try:
        idle = _idle_from(s, "127.0.0.2", 6)
        time.sleep(0.2)
        assert _held(idle) == 2  # the rest closed at once, not at the handshake deadline
        # Another address still finds a slot: the flood took two of the four.
        assert _round_trip(dial(s.address, _grant(s, echo, tls=False), timeout=2), b"hello") == b"hello<5>"
    finally:
        for c in idle:
            c.close()
        s.stop()


def test_mesh_peers_have_handshake_slots_no_stranger_can_take(certs: Path, echo) -> None:
    s = TunnelServer("127.0.0.1", certs, "host", max_handshakes=4, per_source=2,
                     trusted=lambda: frozenset({"127.0.0.1"}))
    s.start()
    idle: list[socket.socket] = []
    try:
        # Strangers from many addresses fill every shared slot.
        idle = [c for i in range(2, 8) for c in _idle_from(s, f"127.0.0.{i}", 2)]
        time.sleep(0.2)
        assert _held(idle) == 4
        # The peer's own pool is untouched.
        assert _round_trip(dial(s.address, _grant(s, echo, tls=False), timeout=2), b"hello") == b"hello<5>"
        assert s.alive
    finally:
        for c in idle:
            c.close()
        s.stop()


def _dial_retrying(server: TunnelServer, echo):
    """The idle connections' slots come back as the server sees them close."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return dial(server.address, _grant(server, echo, tls=False))
        except TunnelError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_thread_that_cannot_start_drops_one_connection_not_the_loop(server: TunnelServer, echo,
                                                                       monkeypatch) -> None:
    real = threading.Thread
    failures = [3]

    class Starved(real):
        def start(self) -> None:
            if self.name.endswith("-conn") and failures[0] > 0:
                failures[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr("shim.mesh.tunnel.server.threading.Thread", Starved)
    for _ in range(3):
        with pytest.raises(TunnelError):
            dial(server.address, _grant(server, echo, tls=False))
    assert _round_trip(dial(server.address, _grant(server, echo, tls=False)), b"hi") == b"hi<2>"
    assert server.alive


def test_a_loop_that_died_says_so(server: TunnelServer, monkeypatch) -> None:
    assert server.alive
    monkeypatch.setattr(server, "_sock", _Broken(server._sock))
    host, port = server.address.rsplit(":", 1)
    with contextlib.suppress(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()
    deadline = time.monotonic() + 5
    while server.alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.alive


class _Broken:
    """A listening socket whose next accept fails in a way no accept loop expects."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def accept(self):
        raise ValueError("not an OSError")

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


def test_the_origin_dials_the_hosts_known_address_whatever_address_the_host_supplies(server: TunnelServer,
                                                                                     echo) -> None:
    from shim.mesh.tunnel.dial import at_known_host

    port = server.address.rsplit(":", 1)[1]
    # A host that names an address elsewhere (here one nothing answers on) gets only its port used.
    supplied = f"192.0.2.1:{port}"
    end = dial(supplied, _grant(server, echo, tls=False), known="127.0.0.1:7443", timeout=5)
    assert _round_trip(end, b"x") == b"x<1>"
    assert at_known_host("[fd00::7]:7443", "10.0.0.9:40001") == "[fd00::7]:40001"
    assert at_known_host("", "10.0.0.9:40001") == "10.0.0.9:40001"
