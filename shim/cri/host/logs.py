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
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CHUNK = 256 << 10
POLL_S = 0.1
# A quiet log is looked at less and less often, up to this: a host follows a log per hosted container.
IDLE_POLL_S = 0.5
STATE_EVERY_S = 0.5


class Life(enum.Enum):
    CREATED = "created"  # not started: its log may not exist yet
    RUNNING = "running"
    EXITED = "exited"
    GONE = "gone"  # removed from the host


def follow(path: Path, offset: int, life: Callable[[], Life], active: Callable[[], bool],
           wait: Callable[[float], object], *, poll: float = POLL_S, idle_poll: float = IDLE_POLL_S,
           state_every: float = STATE_EVERY_S,
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
    try:
        while active():
            if f is None:
                try:
                    f = open(path, "rb")  # noqa: SIM115 - held across yields, closed in finally
                except FileNotFoundError:
                    if life() in (Life.EXITED, Life.GONE):
                        return
                    wait(poll)
                    continue
            f.seek(pos)
            data = f.read(CHUNK)
            cut = len(data) if final or (len(data) == CHUNK and b"\n" not in data) else data.rfind(b"\n") + 1
            if cut:
                yield pos, data[:cut]
                pos += cut
                pause = poll
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
