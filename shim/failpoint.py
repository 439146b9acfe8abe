"""Failpoints: kill this process at a named point, for crash tests (as containerd's failpoint).

``WEFT_FAILPOINTS=lease.acquired,container.created`` makes the process SIGKILL
itself when it reaches those points, so integration tests can prove that a
crash at exactly that moment loses nothing and leaks nothing. Read once at
import; a disabled failpoint costs one set lookup.
"""

from __future__ import annotations

import os
import signal

_ACTIVE = frozenset(filter(None, os.environ.get("WEFT_FAILPOINTS", "").split(",")))


def hit(name: str) -> None:
    if name in _ACTIVE:
        os.kill(os.getpid(), signal.SIGKILL)
