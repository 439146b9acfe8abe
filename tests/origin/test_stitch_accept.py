"""The origin's stitched-port listeners: connections being opened are capped, and the listener outlives errors."""

from __future__ import annotations

import socket
import threading
from types import SimpleNamespace

import pytest

from shim.mesh.tunnel import accept
from shim.origin import stitch


class _Pod:
    """What PodNet._accept needs of its pod: a _forward that holds its slot until the test lets it go."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.forwarded: list[socket.socket] = []

    def _forward(self, conn: socket.socket, port: int, link) -> None:
        self.forwarded.append(conn)
        try:
            self.release.wait(10)
        finally:
            stitch._OPENING.release()
            conn.close()


def test_connections_beyond_those_being_opened_are_closed_at_once(monkeypatch) -> None:
    monkeypatch.setattr(stitch, "_OPENING", threading.BoundedSemaphore(2))
    lst = socket.create_server(("127.0.0.1", 0))
    pod = _Pod()
    loop = threading.Thread(target=stitch.PodNet._accept, args=(pod, lst, 80, SimpleNamespace(name="c")),
                            daemon=True)
    loop.start()
    clients = [socket.create_connection(lst.getsockname(), timeout=5) for _ in range(2)]
    try:
        for _ in range(100):
            if len(pod.forwarded) == 2:
                break
            threading.Event().wait(0.05)
        with socket.create_connection(lst.getsockname(), timeout=5) as third:
            assert third.recv(10) == b""  # closed at once, not waiting for a slot
        pod.release.set()
        for _ in range(100):
            if stitch._OPENING.acquire(blocking=False):
                stitch._OPENING.release()
                break
            threading.Event().wait(0.05)
        with socket.create_connection(lst.getsockname(), timeout=5):
            for _ in range(100):
                if len(pod.forwarded) == 3:
                    break
                threading.Event().wait(0.05)
        assert len(pod.forwarded) == 3  # the listener still serves
    finally:
        for c in clients:
            c.close()
        lst.shutdown(socket.SHUT_RDWR)  # wakes the accept, as closing a mirror does
        lst.close()
        loop.join(5)
    assert not loop.is_alive()


@pytest.fixture(autouse=True)
def _quiet(monkeypatch) -> None:
    monkeypatch.setattr(accept.time, "sleep", lambda s: None)  # the accept loop's back-off
