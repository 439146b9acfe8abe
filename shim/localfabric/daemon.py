"""What every daemon of a local fabric (containerd, a weft agent, a weft broker) does alike as a child process:
wait until it answers, stop it, read its JSON log lines; and the ``with`` of what opens and closes.

Each daemon says only how it starts and what "answers" means; the loops live here once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
from collections.abc import Callable
from typing import Any, Self


def wait_up(proc: subprocess.Popen[Any], answers: Callable[[], bool], timeout: float,
            exited: Callable[[int], str], late: Callable[[], str]) -> None:
    """Return once ``answers()`` is true; RuntimeError with ``exited(code)`` if ``proc`` exits first, or with
    ``late()`` after ``timeout`` seconds (both called then, so a log tail they quote is the latest)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(exited(proc.returncode))
        if answers():
            return
        time.sleep(0.05)
    raise RuntimeError(late())


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
    """Send ``sig`` to a running ``proc``, SIGKILL it after ``timeout`` seconds; its exit code."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def json_lines(text: str) -> list[dict]:
    """The JSON objects among a log's lines (structlog's events), what else it holds passed over."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


class Opened:
    """``with x:`` opens ``x`` and closes it on leaving; an ``open`` that fails part way is closed too, so what
    it had set up (a namespace, a bridge, a lock) is undone before the error goes on."""

    def open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Started:
    """``with x:`` starts ``x`` and stops it on leaving; a ``start`` that fails (the daemon exited, or never
    answered) stops it too, so no child outlives the error."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> int | None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
