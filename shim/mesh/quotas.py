"""How many calls of each kind a peer, and all peers together, may have open on this node.

Workers: a server stream holds a worker thread for its life (a host keeps a
log stream and a stitch stream per hosted container, and a Watch per
origin). ``MeshLimits`` caps each kind of call, per peer and in all, and the
pool has a worker for every call the caps let in: streams, however many,
never take the workers Hello, Admit and Watch need, and one peer cannot take
another's. A call over its cap is RESOURCE_EXHAUSTED at once (``PeerBusy``).
A host counts an origin as heard from while any call or stream of it is open
here (the connection's keepalive ends them within seconds of a cut), not only
when one of its calls starts.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from shim.errors import WeftError


class PeerBusy(WeftError):
    """A peer has as many calls of a kind open here as it may, or this node serves all it can."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


# The kinds of call, each with its own caps and workers: Hello and Admit (quick, the liveness and placement
# path), Watch (one stream per origin with shadows here, held open: a host may serve hundreds of origins), the
# other unary calls (RunShadow may pull an image for minutes) and the per-container streams (StreamLog, Stitch).
HELLO, WATCH, CALL, STREAM = "hello", "watch", "call", "stream"


@dataclass(frozen=True)
class MeshLimits:
    """Concurrent calls of each kind: per peer, and in all (the pool has a worker for each)."""

    streams: int = 1024
    streams_per_peer: int = 768
    calls: int = 192
    calls_per_peer: int = 32
    hellos: int = 128  # Hello and Admit
    hellos_per_peer: int = 4
    watches: int = 2048  # origins whose Watch a host serves at once
    watches_per_peer: int = 2

    def per_peer(self, kind: str) -> int:
        return {HELLO: self.hellos_per_peer, WATCH: self.watches_per_peer, CALL: self.calls_per_peer,
                STREAM: self.streams_per_peer}[kind]

    def total(self, kind: str) -> int:
        return {HELLO: self.hellos, WATCH: self.watches, CALL: self.calls, STREAM: self.streams}[kind]

    @property
    def workers(self) -> int:
        return self.streams + self.calls + self.hellos + self.watches


class PeerLimits:
    """What each peer has open now, held against ``MeshLimits``; which peers have anything open."""

    def __init__(self, limits: MeshLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: Counter[tuple[str, str]] = Counter()  # (node or "", kind) -> open now; "" counts all
        self._active: Counter[str] = Counter()  # node -> its calls and streams open now

    @contextlib.contextmanager
    def hold(self, node: str, kind: str, method: str) -> Iterator[None]:
        pool = kind
        with self._lock:
            if self._open[(node, kind)] >= self.limits.per_peer(kind):
                raise PeerBusy(f"{node} has {self._open[(node, kind)]} {kind} calls open here, the most a peer "
                               f"may; {method} refused")
            if self._open[("", pool)] >= self.limits.total(kind):
                raise PeerBusy(f"this node serves {self._open[('', pool)]} {pool} calls, the most it may; "
                               f"{method} from {node} refused")
            self._open[(node, kind)] += 1
            self._open[("", pool)] += 1
            self._active[node] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[(node, kind)] -= 1
                self._open[("", pool)] -= 1
                self._active[node] -= 1

    def active(self, node: str) -> bool:
        """Whether ``node`` has a call or stream open here: its connection is alive (keepalive ends them
        otherwise)."""
        with self._lock:
            return self._active[node] > 0

    def open_now(self) -> dict[str, int]:
        with self._lock:
            return {kind: n for (node, kind), n in self._open.items() if not node}
