"""systemd's readiness message reaches the socket systemd names, and nothing happens where none is named."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from shim import sdnotify


def test_ready_reaches_the_socket_systemd_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert sdnotify.notify()
        assert s.recv(64) == b"READY=1"


def test_an_abstract_socket_is_named_with_an_at_sign(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"weft-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify("STOPPING=1")
        assert s.recv(64) == b"STOPPING=1"


@pytest.mark.parametrize("value", [None, "", "relative/path", "/nonexistent/notify"])
def test_without_systemd_listening_it_is_a_no_op(value: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify() is False
