"""Ending on SIGTERM or SIGINT promptly at any point of a process's life, also as a container's PID 1.

``weft mesh-signer``, ``weft mesh-identity``, ``weft kube-credentials`` and
``weft install``/``uninstall`` run as containers' main processes, and one
whose container has a PID namespace of its own is its PID 1. Three things
kept such a process from ending on SIGTERM (each reproduced on ``weft
mesh-signer`` run as PID 1 of a new PID namespace and signalled from outside
it, as runc and systemd do):

- The kernel discards a signal sent to a PID namespace's init while that
  signal's disposition is the default. A SIGTERM before the command had set
  its handler (Python's start and weft's imports: about half a second on a
  busy machine) was lost, and the process lived until SIGKILL.
- A Python handler runs in the main thread, between two of its bytecodes.
  One that calls ``threading.Event.set()`` deadlocks when it interrupts the
  main thread inside that Event's own (non-reentrant) lock: a second SIGTERM
  arriving while the first one's ``set()`` or the main thread's ``wait()``
  held it left the process with no signal pending and its main thread
  blocked "in ``stop.wait()``" for good (two SIGTERMs 0 to 200 µs apart: 7
  runs of 40). And a main thread blocked in an untimed lock wait is not woken
  by a signal the kernel delivers to another of its threads (not seen here:
  Linux gives a process-directed signal to the main thread unless that one
  has a signal pending already; the waits below are timed all the same).
- A call that blocks (an API call that hangs, a watch's read) does not
  return because an Event was set.

So: the entry points (``nodeimage/bin/weft``, ``python -m shim``, and
``shim.cli.main`` for the console script) call :func:`end_at_once` as their
first statement, before any import that takes time: until a command takes
the signals over, SIGTERM and SIGINT end the process at once, as their
default action does for any process but a PID 1. :func:`serve` runs a
command's work on a thread of its own while the main thread waits: its
handlers only note the signal (they take no lock, so there is nothing for
them to deadlock on) and it waits in short timed waits (so a signal the
kernel gave another thread is seen at the next). On a signal it sets the
work's stop Event, gives the work ``GRACE_S`` to return, and otherwise ends
the process itself (``os._exit``) once no file is being written: writers
hold :func:`writing` around a write (a temporary file renamed into place),
so no file is left half-written and no temporary one beside it.
:class:`Signals` is the same noting handler for the agent and the broker
(systemd services, never a PID 1, whose work is on threads of their own).

What this cannot reach is the interpreter's own start, from ``exec`` to the
entry point's first statement (10 to 20 ms; more with a virtual
environment's ``.pth`` files), where a PID 1 discards a SIGTERM. The node
image runs ``weft`` under tini (static), which blocks signals within its
first tenths of a millisecond and forwards them; a SIGTERM sent before
that is discarded, whatever program PID 1 is (docs/operations.md, "How
weft's containers end").
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 0.5  # for the work to return once stopped, before the process ends without it
WRITE_WAIT_S = 1.0  # for a write under way to finish before the process ends
POLL_S = 0.1  # how often a waiting main thread looks for a signal the kernel gave another thread

_WRITING = threading.RLock()


def end_at_once() -> None:
    """From now until a command takes them over: SIGTERM and SIGINT end the process at once (128 + the signal).

    That is their default action for any process but a PID 1, which the kernel spares them while their
    disposition is the default. The entry points call this first; nothing is under way yet that should end
    in order.
    """
    for sig in SIGNALS:
        signal.signal(sig, _exit_at_once)


def as_usual() -> None:
    """SIGTERM and SIGINT as Python has them by default (a command that handles them itself, or never needs to)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _exit_at_once(signum: int, _frame: FrameType | None) -> None:
    os._exit(128 + signum)


def writing() -> threading.RLock:
    """Hold around writing a file (or several that go together): the process does not end in the middle."""
    return _WRITING


class Signals:
    """SIGTERM and SIGINT noted by handlers that do nothing else, from now until :meth:`restore`."""

    def __init__(self) -> None:
        self.got: list[int] = []  # appended by the handler: a list's append takes no lock of Python's
        self._previous = {sig: signal.signal(sig, self._note) for sig in SIGNALS}

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self.got.append(signum)

    def wait(self, stop: threading.Event) -> int | None:
        """Until a signal (its number) or until ``stop`` is set (None); from the main thread, where handlers run.

        The handler only appends to a list, so it may interrupt this wait anywhere, the Event's lock held or
        not; and the wait is short, so a signal the kernel gave another thread (whose handler Python runs in
        the main thread when it next can) is seen within ``POLL_S``.
        """
        while not self.got:
            if stop.wait(POLL_S):
                return None
        return self.got[0]

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def serve(work: Callable[[threading.Event], object], *, name: str, grace_s: float = GRACE_S,
          stopped: int | None = 0) -> object:
    """Run ``work(stop)`` on a thread named ``name`` until it returns or SIGTERM or SIGINT comes.

    Returns what ``work`` returned (its exception is raised here), or after a signal ``stopped``: the
    command's exit status when a signal ended it (None: 128 plus the signal's number, as for a process the
    signal killed). After a signal ``stop`` is set and ``work`` has ``grace_s`` to return; if it is still in
    a call then, the process ends here with that status, as soon as no file is being written. Call it from
    the main thread, which waits here.
    """
    from shim import log  # here, not above: the entry points import this module before anything slow

    _log = log.get("weft.stop")
    signals = Signals()  # before the work's thread starts: from here a signal is noted, whichever comes
    stop, done = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def body() -> None:
        try:
            outcome["value"] = work(stop)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, raised there
            outcome["error"] = exc
        finally:
            done.set()

    try:
        threading.Thread(target=body, name=name, daemon=True).start()
        signum = signals.wait(done)
        if signum is None:
            if "error" in outcome:
                raise outcome["error"]
            return outcome.get("value")
        code = 128 + signum if stopped is None else stopped
        _log.info("stop.requested", command=name, signal=signal.Signals(signum).name)
        stop.set()
        if not done.wait(grace_s):
            _end_now(name, code, grace_s)
        return code
    finally:
        signals.restore()


def _end_now(name: str, code: int, grace_s: float) -> None:
    from shim import log

    written = _WRITING.acquire(timeout=WRITE_WAIT_S)  # held from here: no write begins after it
    log.get("weft.stop").info("stop.forced", command=name, grace_s=grace_s, write_finished=written)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
