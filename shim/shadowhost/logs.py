"""Following a shadow's log file: what StreamLog sends, as (offset, bytes) chunks.

The host's containerd writes the shadow's output in CRI log format to the
file ContainerStatus names. ``follow`` reads it from a byte offset on, as it
grows, and ends once the container has exited and the file is read to its
end. The exit is checked only when the file has nothing new, and the file is
read once more after it is seen: what the container wrote last is never cut
off.

Chunks are at most ``CHUNK`` bytes and end at a line end (CRI log lines are
short: containerd splits long output into 16 KiB partial lines), so the
origin appends whole lines to the file kubelet reads. Only at the very end,
after the exit, may a last chunk end without a newline.

The host keeps no more of a log than the origin may still need: once sent,
all but the last ``KEEP_SENT`` bytes are punched out of the file (its size,
and so every offset, stay as they were; the disk blocks are freed), and
when more than ``MAX_BACKLOG`` bytes wait unsent, the oldest are dropped
from a line end on, as kubelet's rotation would drop them. A reader that
resumes inside what was punched out starts at the first line still there.
While no origin reads a log (it is away, or streams none), ``cap`` does the
same on a timer: at most ``MAX_BACKLOG`` bytes kept.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import enum
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CHUNK = 256 << 10
POLL_S = 0.1
# A quiet log is looked at less and less often, up to this: a host follows a log per hosted container.
IDLE_POLL_S = 0.5
STATE_EVERY_S = 0.5


# Sent bytes kept, for an origin that resumes a little behind what was sent; bytes waiting unsent at most.
KEEP_SENT = 1 << 20
MAX_BACKLOG = 64 << 20
_LINE_START = re.compile(rb"\d{4}-\d\d-\d\dT")  # a CRI log line starts with its RFC 3339 time
_PUNCH = 0x02 | 0x01  # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]


def punch(fd: int, start: int, end: int) -> None:
    """Free the disk blocks of bytes [start, end) of the file; its size stays. Best effort."""
    if end > start:
        _libc.fallocate(fd, _PUNCH, start, end - start)


def cap(path: Path, max_backlog: int = MAX_BACKLOG) -> int:
    """Punch out all but the last ``max_backlog`` bytes of a log, from a line end on (its size and offsets stay,
    as for a log being streamed); the bytes of disk freed."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_blocks * 512 <= max_backlog + CHUNK:
            return 0
        f.seek(max(0, st.st_size - max_backlog))
        f.readline()
        end = f.tell()
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        punch(fd, 0, end)
        return max(0, st.st_blocks * 512 - os.fstat(fd).st_blocks * 512)
    finally:
        os.close(fd)


class Life(enum.Enum):
    CREATED = "created"  # not started: its log may not exist yet
    RUNNING = "running"
    EXITED = "exited"
    GONE = "gone"  # removed from the host


def follow(path: Path, offset: int, life: Callable[[], Life], active: Callable[[], bool],
           wait: Callable[[float], object], *, poll: float = POLL_S, idle_poll: float = IDLE_POLL_S,
           state_every: float = STATE_EVERY_S, keep_sent: int = KEEP_SENT, max_backlog: int = MAX_BACKLOG,
           clock: Callable[[], float] = time.monotonic) -> Iterator[tuple[int, bytes]]:
    """(offset, data) chunks of ``path`` from ``offset`` until the container is done or ``active()`` is false.

    ``life`` says where the container is; ``wait(seconds)`` sleeps (and may
    return early when the reader goes away). The wait starts at ``poll`` and
    doubles while nothing is written, up to ``idle_poll``.
    """
    pos = offset
    pause = poll
    final = False  # the container was seen exited: read to the end, then stop
    checked = float("-inf")
    f = None
    w = -1  # the file for writing: what punches need
    punched = 0  # bytes before this are punched out (by this stream)
    sent_ends: collections.deque[int] = collections.deque()  # line ends sent, not yet punched up to
    after_hole = False
    try:
        while active():
            if f is None:
                try:
                    f = open(path, "rb")  # noqa: SIM115 - held across yields, closed in finally
                    w = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
                except FileNotFoundError:
                    if life() in (Life.EXITED, Life.GONE):
                        return
                    wait(poll)
                    continue
                # The origin has everything before the offset it asked from.
                punch(w, 0, pos - keep_sent)
                punched = max(0, pos - keep_sent)
            size = os.fstat(f.fileno()).st_size
            if size - pos > max_backlog:  # the origin cannot keep up: drop the oldest, from a line end on
                f.seek(size - max_backlog)
                f.readline()
                pos = f.tell()
            f.seek(pos)
            data = f.read(CHUNK)
            if data[:1] == b"\0":  # resumed inside what was punched out: on to the first line still there
                pos += len(data) - len(data.lstrip(b"\0"))
                after_hole = True
                continue
            if after_hole:
                after_hole = False
                if not _LINE_START.match(data):  # the hole ended inside a line: that line's rest is not sent
                    end = data.find(b"\n")
                    if end >= 0:
                        pos += end + 1
                        continue
            cut = len(data) if final or (len(data) == CHUNK and b"\n" not in data) else data.rfind(b"\n") + 1
            if cut:
                yield pos, data[:cut]
                pos += cut
                pause = poll
                sent_ends.append(pos)
                upto = punched
                while sent_ends and sent_ends[0] <= pos - keep_sent:
                    upto = sent_ends.popleft()
                if upto - punched >= CHUNK:  # up to a line end, so a reader resuming there starts at a line
                    punch(w, punched, upto)
                    punched = upto
                continue
            # Nothing new (or only a line being written).
            if final:
                return
            now = clock()
            if now - checked >= state_every:
                checked = now
                if life() in (Life.EXITED, Life.GONE):
                    final = True
                    continue
            wait(pause)
            pause = min(idle_poll, pause * 2)
    finally:
        if f is not None:
            f.close()
        if w >= 0:
            os.close(w)
