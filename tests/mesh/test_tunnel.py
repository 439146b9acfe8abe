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
from shim.mesh.tunnel import Pipe, SocketEnd, TunnelError, TunnelServer, contexts, dial


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
    assert _pipe_fds() == pipes_fds, "a pipe left its kernel pipes (splice) or its eventfd open"


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


def _grant(server: TunnelServer, target: tuple[str, int], *, tls: bool, origin: str = "origin") -> bytes:
    return server.grants.add(origin, lambda: socket.create_connection(target, 5), tls=tls, what="echo")


def _round_trip(end, payload: bytes) -> bytes:
    end.sendall(payload)
    end.shutdown_write()  # half-close: the far side still answers
    buf, out = bytearray(1 << 16), b""
    while n := end.recv_into(buf):
        out += bytes(buf[:n])
    end.close()
    return out


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_bytes_both_ways_and_half_close(server: TunnelServer, echo, certs: Path, tls: bool) -> None:
    token = _grant(server, echo, tls=tls)
    end = dial(server.address, token, tls=contexts(certs, "origin")[1] if tls else None, node="host")
    payload = bytes(range(256)) * 8192  # 2 MiB
    assert _round_trip(end, payload) == payload + f"<{len(payload)}>".encode()


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_a_slow_reader_holds_the_writer_back_and_nothing_is_lost(server: TunnelServer, echo, certs: Path,
                                                                 tls: bool) -> None:
    """32 MiB through two pipes (ours, as the origin's relay, and the host's) to the echo while the reader sleeps
    first: full sockets on every hop, then all of it, in order."""
    token = _grant(server, echo, tls=tls)
    end = dial(server.address, token, tls=contexts(certs, "origin")[1] if tls else None, node="host")
    app, ours = socket.socketpair()
    Pipe(SocketEnd(ours), end, "test").start()
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
    monkeypatch.setattr("shim.mesh.tunnel.HANDSHAKE_TIMEOUT_S", 0.3)
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
