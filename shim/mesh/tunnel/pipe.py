"""A pipe joins two ends and behaves as a direct connection would.

EOF on one side is a half-close (``shutdown(SHUT_WR)``) on the other, a reset
or a timeout on either aborts both with a reset, and a slow reader holds the
writer back (a pipe reads from one end only once the other has taken all it
read, no queue). Between two plain sockets what was read waits in a kernel
pipe, moved with splice(2) (``_Spliced``): no copy through Python.

A pipe of an interactive stream (exec, attach: ``busy_poll_us``) does not go
to sleep right after a small transfer: it polls without blocking, yielding
the CPU to any task that can run between two polls, for a window it learns
per direction (``BusyPoll``): up to ``busy_poll_us`` after a keystroke, whose
echo comes back at once, nothing after the echo, when a person's pause
follows. A keystroke's echo crosses two relays, each woken twice, and a
wake-up from idle adds latency each time; busy-polling brings the exec round
trip back near a local container's, for a little more agent CPU a keystroke
(``weft bench network``; figures in docs/benchmarks.md). Bulk transfers (a
wake that moved 16 KiB or more) and pod-network tunnels never spin. Every
pipe is counted (``Pipe.live``) so that tests can see none leaks.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

from shim import log
from shim.mesh.tunnel.ends import End, SocketEnd

_log = log.get("weft.tunnel")

BUFFER = 256 << 10
# A wake that moved less than this is interactive (keystrokes, a screen's update): busy-poll after it.
INTERACTIVE_BYTES = 16 << 10
# A wait that ends within this many busy-poll windows is part of an exchange, not a pause (BusyPoll).
EXCHANGE_WINDOWS = 8

_IN, _OUT, _BAD = select.POLLIN, select.POLLOUT, select.POLLERR | select.POLLHUP


class _Held:
    """What one direction of a pipe has read and the other end has not taken yet: in a buffer of ours."""

    def __init__(self) -> None:
        self._buf = memoryview(bytearray(BUFFER))
        self._view: memoryview | None = None

    def __len__(self) -> int:
        return len(self._view) if self._view is not None else 0

    def fill(self, src: End) -> int | None:
        """Read once from ``src`` (only when empty): as ``End.read_some``; a short read means drained."""
        n = src.read_some(self._buf)
        if n:
            self._view = self._buf[:n]
        return n

    def drain(self, dst: End) -> int:
        """Give ``dst`` what it takes; how much."""
        assert self._view is not None
        n = dst.write_some(self._view)
        self._view = self._view[n:] if n < len(self._view) else None
        return n

    def close(self) -> None:
        pass


class _Spliced:
    """The same between two plain sockets, held in a kernel pipe: splice(2) moves the pages, no copy through us."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        with contextlib.suppress(OSError):
            fcntl.fcntl(self._w, fcntl.F_SETPIPE_SZ, BUFFER)
        self._held = 0

    def __len__(self) -> int:
        return self._held

    def fill(self, src: End) -> int | None:
        try:
            n = os.splice(src.sock.fileno(), self._w, BUFFER, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except (BlockingIOError, InterruptedError):
            return None
        self._held = n
        return n

    def drain(self, dst: End) -> int:
        try:
            n = os.splice(self._r, dst.sock.fileno(), self._held, flags=os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK)
        except (BlockingIOError, InterruptedError):
            return 0
        self._held -= n
        return n

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


class BusyPoll:
    """How long a pipe polls without sleeping after a small transfer, learnt per direction.

    After moving a keystroke one way, the echo comes back the other way within
    a fraction of a millisecond: polling for it without sleeping saves the
    wake-up from idle. After moving the echo on, the next keystroke is a
    person's pause away: polling for it wastes the CPU. So each direction has
    a window, as cpuidle-haltpoll keeps one for a CPU: a wait it caught
    leaves it as it is; a wait that ended within ``EXCHANGE_WINDOWS *
    max_ns`` (an exchange under way: without the spin the echo takes longer
    than the window) restores it to ``max_ns``; a longer one (a pause) halves
    it, down to nothing under ``max_ns / 8``. Between two polls ``relax``
    (sched_yield) lets whatever else can run on this CPU run: the spin keeps
    the CPU from going idle, it takes no time from other work.
    """

    def __init__(self, max_ns: int, *, clock: Callable[[], int] = time.monotonic_ns,
                 relax: Callable[[], None] = os.sched_yield) -> None:
        self.max_ns = max_ns
        self.window_ns = [max_ns, max_ns]
        self._clock, self._relax = clock, relax

    def wait(self, poll: Callable[[int | None], list], direction: int) -> list:
        """``poll``'s events, after data moved in ``direction``: polled without blocking for the window first."""
        window = self.window_ns[direction]
        t0 = self._clock()
        while window:
            if events := poll(0):
                return events
            if self._clock() - t0 >= window:
                break
            self._relax()
        events = poll(None)
        if self._clock() - t0 <= self.max_ns * EXCHANGE_WINDOWS:
            self.window_ns[direction] = self.max_ns
        else:
            self.window_ns[direction] = window // 2 if window // 2 >= self.max_ns // 8 else 0
        return events


class Pipe:
    """Two ends joined both ways by one thread that polls both; see the module docstring.

    One thread, not one per direction: a reply then goes out from the thread
    that is already awake, where two threads hand the GIL to each other on
    every round trip (measured on loopback, one relay: 80 us a request/response
    that way, 15-17 us this way). Sockets are non-blocking; what one end
    sends is read only once the other has taken the last of it, so a slow
    reader holds the writer back.
    """

    live = 0
    _count_lock = threading.Lock()

    def __init__(self, a: End, b: End, name: str, on_close: Callable[[Pipe], None] | None = None, *,
                 busy_poll_us: int = 0) -> None:
        self.a, self.b, self.name = a, b, name
        self.on_close = on_close
        self.busy_poll_us = busy_poll_us
        self.bytes = [0, 0]
        self.error: str = ""
        self._lock = threading.Lock()
        self._aborted = False
        self._finished = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def start(self) -> Pipe:
        with Pipe._count_lock:
            Pipe.live += 1
        threading.Thread(target=self._run, name=f"weft-pipe-{self.name}", daemon=True).start()
        return self

    def abort(self, exc: BaseException | None = None) -> None:
        """End both sides with a reset; from any thread (the pipe's own thread does the closing)."""
        with self._lock:
            if self._aborted or self._finished:
                return
            self._aborted = True
            if exc is not None:
                self.error = f"{type(exc).__name__}: {exc}"
            with contextlib.suppress(OSError):
                os.eventfd_write(self._wake, 1)
        if exc is not None:
            _log.info("tunnel.reset", pipe=self.name, error=self.error, sent=self.bytes[0], received=self.bytes[1])

    def _run(self) -> None:
        ends = (self.a, self.b)
        try:
            for e in ends:
                e.sock.setblocking(False)
            self._loop(ends)
        except (OSError, ssl.SSLError, ValueError) as exc:
            self.abort(exc)
        finally:
            with self._lock:
                self._finished = True
                os.close(self._wake)
            for e in ends:
                with contextlib.suppress(OSError):
                    e.abort() if self._aborted else e.close()
            with Pipe._count_lock:
                Pipe.live -= 1
            if self.on_close is not None:
                self.on_close(self)

    def _loop(self, ends: tuple[End, End]) -> None:
        # Read from ends[i], not yet taken by the other end; between plain sockets it stays in the kernel.
        kind: type[_Held | _Spliced] = _Spliced if all(type(e) is SocketEnd for e in ends) else _Held
        held = (kind(), kind())
        try:
            self._move(ends, held)
        finally:
            for h in held:
                h.close()

    def _move(self, ends: tuple[End, End], held: tuple[_Held | _Spliced, _Held | _Spliced]) -> None:
        eof, shut = [False, False], [False, False]  # ends[i] said EOF; the other was shut for writing after it
        readable, writable = [True, True], [True, True]
        fds = (ends[0].sock.fileno(), ends[1].sock.fileno())
        poller = select.poll()
        poller.register(self._wake, _IN)
        masks = [0, 0]
        busy = BusyPoll(self.busy_poll_us * 1000) if self.busy_poll_us else None
        while not (shut[0] and shut[1]):
            more = False  # a direction that had its 8 rounds and may move further: no waiting
            moved = [0, 0]
            for i in (0, 1):  # move each direction as far as it goes without blocking
                src, dst, j = ends[i], ends[1 - i], 1 - i
                for _ in range(8):  # then the other direction's turn, so that neither starves
                    if held[i]:
                        if not writable[j]:
                            break
                        if held[i].drain(dst) == 0 or held[i]:
                            writable[j] = False
                            break
                    if eof[i]:
                        if not shut[i]:
                            dst.shutdown_write()
                            shut[i] = True
                        break
                    if not readable[i]:
                        break
                    n = held[i].fill(src)
                    if n is None or 0 < n < BUFFER:
                        readable[i] = False
                    if n == 0:
                        eof[i] = True
                    elif n is not None:
                        self.bytes[i] += n
                        moved[i] += n
                else:
                    more = True
            if shut[0] and shut[1]:
                return
            if more:
                continue
            for k in (0, 1):  # what to wait for on each end; an end with nothing to wait for is left out
                want = (_IN if not (eof[k] or readable[k] or held[k]) else 0) | (
                    _OUT if held[1 - k] and not writable[k] else 0)
                if want != masks[k]:
                    if not masks[k]:
                        poller.register(fds[k], want)
                    elif want:
                        poller.modify(fds[k], want)
                    else:
                        poller.unregister(fds[k])
                    masks[k] = want
            spin = busy is not None and 0 < moved[0] + moved[1] < INTERACTIVE_BYTES
            for fd, ev in busy.wait(poller.poll, int(moved[1] > moved[0])) if spin else poller.poll():
                if fd == self._wake:
                    return  # aborted: _run resets both ends
                k = fds.index(fd)
                if ev & select.POLLNVAL:
                    raise OSError(f"{self.name}: a socket of the pipe was closed under it")
                if ev & select.POLLERR and (err := ends[k].sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)):
                    raise OSError(err, os.strerror(err))
                if ev & (_IN | _BAD):
                    readable[k] = True
                if ev & (_OUT | _BAD):
                    writable[k] = True


class Pipes:
    """The pipes one owner started, each kept until it ends, so that the owner's stop aborts those still open:
    the tunnel port's (``PipeServer``) and the origin's stitched pod network's."""

    def __init__(self) -> None:
        self._open: set[Pipe] = set()
        self._lock = threading.Lock()

    def start(self, a: End, b: End, name: str, *, busy_poll_us: int = 0) -> Pipe:
        pipe = Pipe(a, b, name, on_close=self._closed, busy_poll_us=busy_poll_us)
        with self._lock:
            self._open.add(pipe)
        return pipe.start()

    def abort_all(self) -> None:
        for p in self:
            p.abort()

    def __iter__(self) -> Iterator[Pipe]:
        with self._lock:
            return iter(list(self._open))

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def _closed(self, pipe: Pipe) -> None:
        with self._lock:
            self._open.discard(pipe)
