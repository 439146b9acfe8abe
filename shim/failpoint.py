"""Failpoints: kill this process at a named point, for crash tests (as containerd's failpoint), or hold it there.

``WEFT_FAILPOINTS=lease.acquired,container.created`` makes the process SIGKILL
itself when it reaches those points, so integration tests can prove that a
crash at exactly that moment loses nothing and leaks nothing.
``WEFT_FAILPOINT_DELAYS=reservation.lost_seen=3`` makes it sleep that many
seconds at a ``pause`` point: a host too loaded to act at once, on demand.
Read once at import; a disabled failpoint costs one lookup.
"""

from __future__ import annotations

import os
import signal
import time

_ACTIVE = frozenset(filter(None, os.environ.get("WEFT_FAILPOINTS", "").split(",")))


def _delays(spec: str) -> dict[str, float]:
    delays = {}
    for item in filter(None, spec.split(",")):
        name, _, seconds = item.partition("=")
        try:
            delays[name] = float(seconds)
        except ValueError:
            raise ValueError(f"WEFT_FAILPOINT_DELAYS: {item!r} is not NAME=SECONDS") from None
    return delays


_DELAYS = _delays(os.environ.get("WEFT_FAILPOINT_DELAYS", ""))


def hit(name: str) -> None:
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)


def pause(name: str) -> None:
    if name in _DELAYS:
        time.sleep(_DELAYS[name])
