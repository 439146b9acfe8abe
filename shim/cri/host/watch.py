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
  status; the origin watches again.
- ``stream_log``: the log file from the offset on, in chunks of at most
  256 KiB that end at a line end (only the last, after the exit, may not);
  it ends (OK) once the container has exited or is gone and the file is read
  to its end. An unknown key is NOT_FOUND.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from shim._pb import mesh_pb2 as pb
from shim.cri.host.lifecycle import Lifecycle
from shim.cri.host.logs import STATE_EVERY_S, Life, follow
from shim.cri.host.runtime import ShadowRuntime, label
from shim.cri.labels import KEY_ANNOTATION, KEY_LABEL, ORIGIN_LABEL
from shim.errors import UnknownContainer, WeftError

HEARTBEAT_BOUNDS_S = (0.2, 5.0)
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


class Watcher:
    def __init__(self, rt: ShadowRuntime, lifecycle: Lifecycle, heartbeat_interval: float) -> None:
        self.rt, self.lifecycle, self.heartbeat_interval = rt, lifecycle, heartbeat_interval
        self.listing = Listing(rt)

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
        yield pb.ShadowState(heartbeat=True)
        while context.is_active():
            gone.wait(interval)
            if not context.is_active():
                return
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
            yield pb.ShadowState(heartbeat=True)

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
