"""What an origin sees of its shadows: Watch (their states, as they change) and StreamLog (their logs).

- ``watch``: first the shadows of the origin not among ``keys`` are removed
  (so ``keys`` must hold every key the origin owns, a RunShadow in flight
  included); then one ShadowState per remaining shadow (key, ids, status);
  then a heartbeat, which marks the end of that snapshot; then, every
  interval (``heartbeat_s`` or the host's, within 0.2-5 s; read from one
  listing of the host's shadows shared by all Watches, at most 0.5 s old), a ShadowState
  for each shadow that appeared or whose state, exit code or finish time
  changed, ``gone`` (with key and ids, no status) for each that disappeared,
  and a heartbeat. A failure to read containerd ends the stream with its
  status; the origin watches again. An origin that asks for an idle
  heartbeat (``idle_heartbeat_s``: it counts the open stream as contact) is
  told changes the same way, but woken by one thread that looks for every
  Watch (``Pulse``) rather than each Watch looking every interval; it gets
  the host's state (``peer``) with the snapshot's heartbeat and whenever
  the host's room or health moves, and a heartbeat with that state only
  after the idle interval without any other message.
- ``stream_log``: the log file from the offset on, in chunks of at most
  256 KiB that end at a line end (only the last, after the exit, may not);
  it ends (OK) once the container has exited or is gone and the file is read
  to its end. An unknown key is NOT_FOUND.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from shim._pb import mesh_pb2 as pb
from shim.core.reroute import Resources
from shim.core.tracking import room_moved
from shim.crishared.labels import KEY_ANNOTATION, KEY_LABEL, ORIGIN_LABEL
from shim.errors import UnknownContainer, WeftError
from shim.shadowhost.lifecycle import Lifecycle
from shim.shadowhost.logs import STATE_EVERY_S, Life, follow
from shim.shadowhost.runtime import ShadowRuntime, label

HEARTBEAT_BOUNDS_S = (0.2, 5.0)
# What a host keeps an origin's idle heartbeat within: never shorter than the Watch's interval, and often enough
# that the origin's quiet limit for a wedged agent stays bounded.
IDLE_HEARTBEAT_MAX_S = 60.0
# Room that moved is pushed at most this often (health, drain and role at once): a host under a swinging load
# would otherwise push to every watching origin each round.
ROOM_PUSH_EVERY_S = 2.0
# How old the shared listing a Watch round or a log stream reads may be (a change is told at most this much later).
LISTING_TTL_S = STATE_EVERY_S


class NoLog(WeftError):
    """The shadow was created without a log path: there is nothing to stream."""

    code = grpc.StatusCode.FAILED_PRECONDITION


def orphans(shadows: Iterable[cri.Container], keys: Iterable[str]) -> list[cri.Container]:
    """The shadows whose key is none of ``keys`` (the keys an origin still owns); pure."""
    owned = {label(k) for k in keys}
    return [c for c in shadows if c.labels.get(KEY_LABEL) not in owned]


def heartbeat_s(asked: float, default: float) -> float:
    """The Watch interval: what the origin asked (or the host's own), within ``HEARTBEAT_BOUNDS_S``."""
    low, high = HEARTBEAT_BOUNDS_S
    return min(high, max(low, asked if asked > 0 else default))


def idle_heartbeat_s(asked: float, interval: float) -> float:
    """The idle heartbeat an origin asked for, within ``interval`` and ``IDLE_HEARTBEAT_MAX_S``; 0 when it asked
    for none (an older origin: a heartbeat every interval)."""
    return 0.0 if asked <= 0 else min(IDLE_HEARTBEAT_MAX_S, max(interval, asked))


class Listing:
    """Every container on the host from one ListContainers, at most ``ttl`` old, shared by every reader.

    A host follows one log per hosted container and is watched by every origin
    it hosts for: asking containerd for each one's status twice a second, or
    listing once per origin per heartbeat, would cost it more than the
    containers do.
    """

    def __init__(self, rt: ShadowRuntime, ttl: float = LISTING_TTL_S) -> None:
        self.rt, self.ttl = rt, ttl
        self._lock = threading.Lock()
        self._at = float("-inf")
        self._states: dict[str, int] = {}
        self._by_origin: dict[str, list[cri.Container]] = {}

    def _fresh_locked(self) -> None:
        if time.monotonic() - self._at <= self.ttl:
            return
        at = time.monotonic()
        states: dict[str, int] = {}
        by_origin: dict[str, list[cri.Container]] = {}
        for c in self.rt.containers():
            states[c.id] = c.state
            if ORIGIN_LABEL in c.labels:
                by_origin.setdefault(c.labels[ORIGIN_LABEL], []).append(c)
        self._states, self._by_origin, self._at = states, by_origin, at

    def state_of(self, container_id: str) -> int | None:
        """The container's CRI state; None once containerd no longer has it."""
        with self._lock:
            self._fresh_locked()
            state = self._states.get(container_id)
        if state is None:  # created after the listing, or gone: ask for it alone
            s = self.rt.status(container_id)
            return None if s is None else s.state
        return state

    def shadows_of(self, origin: str) -> tuple[list[cri.Container], float]:
        """The origin's shadows, and when they were listed (monotonic, taken before the call)."""
        with self._lock:
            self._fresh_locked()
            return list(self._by_origin.get(origin, ())), self._at

    def marks(self) -> dict[str, frozenset[tuple[str, int]]]:
        """Each origin's shadows as (container ID, state): what a Watch reports changes of."""
        with self._lock:
            self._fresh_locked()
            return {o: frozenset((c.id, c.state) for c in cs) for o, cs in self._by_origin.items()}


def _notable(told: pb.PeerState, now: pb.PeerState) -> bool:
    """Whether the host's state moved enough since it was last pushed: health, drain or role at once, room by
    ``room_moved``."""
    if (told.healthy, told.health_detail, told.role) != (now.healthy, now.health_detail, now.role):
        return True
    return room_moved(Resources(told.free.cpu_cores, told.free.memory_bytes),
                      Resources(now.free.cpu_cores, now.free.memory_bytes),
                      Resources(now.allocatable.cpu_cores, now.allocatable.memory_bytes))


class Pulse:
    """One thread, while any Watch with an idle heartbeat is open, that looks every interval for all of them:
    one listing, one sample of the host's state; it wakes a Watch only when its origin's shadows changed or the
    host's state moved. A Watch that woke on its own every interval cost the host as much per watching origin as
    the rest of its work together."""

    def __init__(self, listing: Listing, interval: float) -> None:
        self.listing, self.interval = listing, interval
        # The host's state as its Hello answers (set by the mesh server); None: nothing to push.
        self.room: Callable[[], pb.PeerState] | None = None
        self._lock = threading.Lock()
        self._subs: dict[str, set[threading.Event]] = {}
        self._marks: dict[str, frozenset[tuple[str, int]]] = {}
        self._running = False
        self._version = 0
        self._told: pb.PeerState | None = None  # the state pushed last (version)
        self._latest: pb.PeerState | None = None  # the last sample, what heartbeats carry
        self._told_at = float("-inf")

    def subscribe(self, origin: str, woke: threading.Event) -> None:
        with self._lock:
            self._subs.setdefault(origin, set()).add(woke)
            start, self._running = not self._running, True
        if start:
            threading.Thread(target=self._run, name="weft-watch-pulse", daemon=True).start()

    def unsubscribe(self, origin: str, woke: threading.Event) -> None:
        with self._lock:
            subs = self._subs.get(origin)
            if subs is not None:
                subs.discard(woke)
                if not subs:
                    del self._subs[origin]

    def state(self) -> tuple[int, pb.PeerState | None]:
        """The version of the state last pushed (it goes up when the state moved) and the latest sample."""
        with self._lock:
            latest = self._latest
        if latest is None and self.room is not None:
            latest = self._sample()
        with self._lock:
            return self._version, latest

    def _sample(self) -> pb.PeerState | None:
        room = self.room
        if room is None:
            return None
        state = room()
        with self._lock:
            self._latest = state
            if self._told is None:
                self._told, self._told_at = state, time.monotonic()
        return state

    def _run(self) -> None:
        stop = threading.Event()
        while True:
            with self._lock:
                if not self._subs:
                    self._running = False
                    return
            stop.wait(self.interval)
            # containerd away: each Watch meets the failure itself when it next looks (at its idle heartbeat),
            # and ends with its status, as it always did.
            with contextlib.suppress(WeftError):
                self._round()

    def _round(self) -> None:
        marks = self.listing.marks()
        with self._lock:
            origins = set(self._subs)
        changed = {o for o in origins if marks.get(o, frozenset()) != self._marks.get(o, frozenset())}
        self._marks = {o: m for o, m in marks.items() if o in origins}
        state = self._sample()
        moved = False
        if state is not None:
            with self._lock:
                told, now = self._told, time.monotonic()
                health = told is None or (told.healthy, told.health_detail, told.role) != (
                    state.healthy, state.health_detail, state.role)
                if told is None or health or (now - self._told_at >= ROOM_PUSH_EVERY_S and _notable(told, state)):
                    self._told, self._told_at, self._version, moved = state, now, self._version + 1, True
        with self._lock:
            wake = [w for o, subs in self._subs.items() if moved or o in changed for w in subs]
        for w in wake:
            w.set()


class Watcher:
    def __init__(self, rt: ShadowRuntime, lifecycle: Lifecycle, heartbeat_interval: float) -> None:
        self.rt, self.lifecycle, self.heartbeat_interval = rt, lifecycle, heartbeat_interval
        self.listing = Listing(rt)
        self.pulse = Pulse(self.listing, heartbeat_s(0, heartbeat_interval))

    def watch(self, origin: str, req: pb.WatchRequest, context: grpc.ServicerContext) -> Iterator[pb.ShadowState]:
        """Orphans removed; one state per shadow; a heartbeat; then changes and a heartbeat every interval.

        Runs in the mesh server's worker thread and starts none of its own; a
        client that goes away wakes the wait (``add_callback``) and ends it.
        """
        interval = heartbeat_s(req.heartbeat_s, self.heartbeat_interval)
        gone = threading.Event()
        context.add_callback(gone.set)
        with self.lifecycle.lock:
            listed_at = time.monotonic()
            shadows = self.rt.containers(labels={ORIGIN_LABEL: origin})
            for c in orphans(shadows, req.keys):
                self.lifecycle.remove_locked(origin, c.annotations.get(KEY_ANNOTATION, ""), c, why="orphan_removed")
        kept = {c.id: c for c in shadows if c.labels.get(KEY_LABEL) in {label(k) for k in req.keys}}
        seen: dict[str, tuple[cri.Container, int, tuple]] = {}
        known_since: dict[str, float] = {}  # when each was first listed: a listing older than that is no news
        for c in kept.values():
            known_since[c.id] = listed_at
            message = self._watched(c, seen)
            if message is not None:
                yield message
        idle = idle_heartbeat_s(req.idle_heartbeat_s, interval)
        if idle:
            yield from self._quiet(origin, context, gone, idle, seen, known_since)
            return
        yield pb.ShadowState(heartbeat=True)
        while context.is_active():
            gone.wait(interval)
            if not context.is_active():
                return
            yield from self._changes(origin, seen, known_since)
            yield pb.ShadowState(heartbeat=True)

    def _quiet(self, origin: str, context: grpc.ServicerContext, woke: threading.Event, idle: float, seen: dict,
               known_since: dict[str, float]) -> Iterator[pb.ShadowState]:
        """After the snapshot, for an origin with an idle heartbeat: changes when the pulse says there are, the
        host's state when it moved, a heartbeat (with the state) after ``idle`` without another message."""
        self.pulse.subscribe(origin, woke)
        try:
            version, state = self.pulse.state()
            yield pb.ShadowState(heartbeat=True, peer=state)
            sent_at = time.monotonic()
            woke.set()  # a change the pulse saw before this Watch listened is looked for at once
            while context.is_active():
                woke.wait(max(0.0, sent_at + idle - time.monotonic()))
                woke.clear()
                if not context.is_active():
                    return
                for message in self._changes(origin, seen, known_since):
                    sent_at = time.monotonic()
                    yield message
                now_version, state = self.pulse.state()
                if now_version != version or time.monotonic() - sent_at >= idle:
                    version, sent_at = now_version, time.monotonic()
                    yield pb.ShadowState(heartbeat=True, peer=state)
        finally:
            self.pulse.unsubscribe(origin, woke)

    def _changes(self, origin: str, seen: dict, known_since: dict[str, float]) -> Iterator[pb.ShadowState]:
        """What changed of the origin's shadows since last told (by the shared listing)."""
        listing, listed_at = self.listing.shadows_of(origin)
        now = {c.id: c for c in listing}
        for cid in [cid for cid in seen if cid not in now and known_since.get(cid, 0.0) < listed_at]:
            known_since.pop(cid, None)
            c = seen.pop(cid)[0]
            yield pb.ShadowState(key=c.annotations.get(KEY_ANNOTATION, ""), shadow_sandbox_id=c.pod_sandbox_id,
                                 shadow_container_id=cid, gone=True)
        for cid, c in now.items():
            known_since.setdefault(cid, listed_at)
            if cid not in seen or seen[cid][1] != c.state:
                message = self._watched(c, seen)
                if message is not None:
                    yield message

    def _watched(self, c: cri.Container, seen: dict) -> pb.ShadowState | None:
        """The state to send for ``c`` if it changed since last sent (updating ``seen``); None if not."""
        status = self.rt.status(c.id)
        if status is None:
            return None  # removed as we looked: the next round reports it gone if it was seen
        mark = (status.state, status.exit_code, status.finished_at)
        previous = seen.get(c.id)
        seen[c.id] = (c, status.state, mark)
        if previous is not None and previous[2] == mark:
            return None
        return pb.ShadowState(key=c.annotations.get(KEY_ANNOTATION, ""), shadow_sandbox_id=c.pod_sandbox_id,
                              shadow_container_id=c.id, status=status.SerializeToString())

    def stream_log(self, origin: str, req: pb.LogRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]:
        """The shadow's log file from ``req.offset``, as it grows, until the container has exited and all is sent."""
        c = self.rt.one(origin, req.key)
        status = self.rt.status(c.id)
        if status is None:
            raise UnknownContainer(f"shadow {req.key} ({c.id}) is gone from this host")
        if not status.log_path:
            raise NoLog(f"shadow {req.key} was created without a log path")
        gone = threading.Event()
        context.add_callback(gone.set)

        def life() -> Life:
            state = self.listing.state_of(c.id)
            if state is None:
                return Life.GONE
            return {cri.CONTAINER_CREATED: Life.CREATED, cri.CONTAINER_RUNNING: Life.RUNNING}.get(
                state, Life.EXITED)

        for offset, data in follow(Path(status.log_path), req.offset, life, context.is_active, gone.wait):
            yield pb.LogChunk(offset=offset, data=data)
