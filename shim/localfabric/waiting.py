"""Polling for a condition in tests against real daemons, with a message that says what never happened."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 10.0, what: str = "condition", every: float = 0.05) -> T:
    """The first truthy value ``cond`` returns within ``timeout`` seconds; AssertionError naming ``what`` if none."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
