"""What both hook test modules share: a short directory for unix sockets, and a broker stand-in in it."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hooks.fakebroker import FakeHookServer


@pytest.fixture
def short_dir() -> Iterator[Path]:
    # A unix socket path must stay under ~107 bytes; pytest's tmp_path can be longer.
    with tempfile.TemporaryDirectory(prefix="wh", dir="/tmp") as d:
        yield Path(d)


@pytest.fixture
def server(short_dir: Path) -> Iterator[FakeHookServer]:
    s = FakeHookServer(short_dir / "broker.sock", {"ok": True, "state": "bound"})
    yield s
    s.close()
