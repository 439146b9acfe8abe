"""The recent-errors ring that ``weft status`` shows: warnings and errors only, bounded, values as short strings."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest

from shim import log


@pytest.fixture
def logged() -> Iterator[io.StringIO]:
    out = io.StringIO()
    log._RECENT.clear()
    log.configure("debug", stream=out)
    yield out
    log._RECENT.clear()
    log.configure("info")


def test_warnings_and_errors_are_kept_and_still_logged(logged: io.StringIO) -> None:
    lg = log.get("weft.test")
    lg.info("agent.started", pid=1)
    lg.warning("peer.lost", peer="cpu-1", error="connection refused")
    lg.error("lease.release_failed", lease="l-1", error=RuntimeError("broker away"))
    kept = log.recent()
    assert [e["event"] for e in kept] == ["peer.lost", "lease.release_failed"]
    assert kept[0]["peer"] == "cpu-1" and kept[0]["level"] == "warning" and "timestamp" in kept[0]
    assert kept[1]["error"] == "broker away"  # a string, not the live object
    assert [json.loads(line)["event"] for line in logged.getvalue().splitlines()] == [
        "agent.started", "peer.lost", "lease.release_failed"]


def test_the_ring_is_bounded_and_keeps_the_newest(logged: io.StringIO) -> None:
    lg = log.get("weft.test")
    for i in range(log.RECENT_MAX + 7):
        lg.warning("remote.create_failed", n=i, error="x" * 1000)
    kept = log.recent()
    assert len(kept) == log.RECENT_MAX
    assert kept[0]["n"] == 7 and kept[-1]["n"] == log.RECENT_MAX + 6
    assert len(kept[-1]["error"]) == 300


def test_filtered_out_levels_are_not_kept(logged: io.StringIO) -> None:
    log.configure("error", stream=logged)
    log.get("weft.test").warning("peer.lost", peer="cpu-1")
    assert log.recent() == []
