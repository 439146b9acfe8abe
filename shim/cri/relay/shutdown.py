"""How a kubelet connection ends, and how the relay stops.

A connection ends with GOAWAY naming the last stream weft took: kubelet
retries any newer call on a new connection, so nothing may run it here. The
connection closes once its last call is answered and every queued frame is
out (the short delay lets the final frames leave first). The relay stops the
same way for every connection, then closes what is still open after a grace
period.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Iterable
from typing import Any, Protocol

from shim.cri.relay import h2

CLOSE_DELAY_S = 0.05


class Ending:
    def __init__(self) -> None:
        self.goaway_sent = False
        self.goaway_sid: int | None = None  # streams above it are left unprocessed
        self.closed = False

    def goaway(self, last_sid: int) -> bytes | None:
        """The GOAWAY frame to send, the first time only."""
        if self.goaway_sent:
            return None
        self.goaway_sent, self.goaway_sid = True, last_sid
        return h2.goaway(last_sid)

    def refuses(self, sid: int) -> bool:
        """A stream kubelet opened after our GOAWAY: it retries the call elsewhere."""
        return self.goaway_sid is not None and sid > self.goaway_sid

    def may_close(self, streams: Collection[Any], queued: bool) -> bool:
        return self.goaway_sent and not streams and not queued and not self.closed


class Stoppable(Protocol):
    def shutdown(self) -> None: ...

    def close(self) -> None: ...


async def stop_all(connections: set[Stoppable], grace: float) -> None:
    """GOAWAY on every connection; wait up to ``grace`` for their calls to finish; close the rest."""
    for conn in list(connections):
        conn.shutdown()
    deadline = time.monotonic() + grace
    while connections and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for conn in list(connections):
        conn.close()


def cancel_all(tasks: Iterable[asyncio.Future]) -> None:
    for task in tasks:
        task.cancel()
