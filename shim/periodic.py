"""A background loop, written once: a round every interval in a daemon thread, until stopped.

The agent's and the broker's housekeeping (the fencer, the reconciler, the
remote supervisor, the stitch, the watchdog, the mesh's Hellos) all share
the same shape and the same rules: a round that fails is logged and the loop
goes on, since one bad round must never end enforcement or fencing; ``stop``
wakes the wait at once and joins the thread; ``wake`` runs the next round
early.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from shim import log

_log = log.get("weft.periodic")


class Periodic:
    def __init__(self, name: str, interval: float, work: Callable[[], Any], *, failed: str,
                 first: bool = False) -> None:
        """``work`` runs every ``interval`` s (at once too when ``first``); ``failed`` is the log event of a
        round that raised."""
        self.name, self.interval, self.work, self.failed, self.first = name, interval, work, failed, first
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Run the next round now rather than at the end of the interval."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        if not self.first and self._pause():
            return
        while True:
            try:
                self.work()
            except Exception:  # noqa: BLE001 - one bad round must not end the loop
                _log.exception(self.failed, loop=self.name)
            if self._pause():
                return

    def _pause(self) -> bool:
        """Wait out the interval (or a wake); True once stopping."""
        self._wake.wait(self.interval)
        self._wake.clear()
        return self._stop.is_set()
