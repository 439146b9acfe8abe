"""Fencing: at most one live copy of a rerouted container.

A host kills the running shadows of an origin it has not heard from for the
fence timeout: no Hello, Watch or shadow call started, and no call or stream
of it open (an open one is the origin's live connection: the mesh's
keepalive ends it within seconds of a cut link, in either direction, long
before the fence timeout). What this host sends itself (Watch heartbeats)
proves nothing about the origin and does not count. The origin gives up on
its shadows only after its longer loss timeout, by which time they are dead.
A fenced shadow stays until the origin removes it or a Watch finds it
orphaned.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.config import FENCE_TICK_S
from shim.crishared.labels import KEY_ANNOTATION, ORIGIN_LABEL
from shim.errors import UpstreamError, WeftError
from shim.periodic import Periodic
from shim.shadowhost.context import HostContext
from shim.shadowhost.runtime import ShadowRuntime

_log = log.get("weft.shadows")


class Fencer:
    def __init__(self, rt: ShadowRuntime, ctx: HostContext, fence_timeout: float) -> None:
        self.rt, self.ctx, self.fence_timeout = rt, ctx, fence_timeout
        self._contact_lock = threading.Lock()
        self._contact: dict[str, float] = {}  # origin -> monotonic time it was last heard from
        self._seeded = False
        # Whether an origin has a mesh call or stream open here (set by the mesh server): that is contact too.
        self.in_contact: Callable[[str], bool] = lambda origin: False
        self._loop = Periodic("weft-shadow-fencer", FENCE_TICK_S, self._round, failed="shadow.fence_crashed")

    def open(self) -> None:
        """Start fencing. Origins with shadows here get one fence timeout from now to show up."""
        self._seed()
        self._loop.start()

    def close(self) -> None:
        self._loop.stop()

    def _round(self) -> None:
        try:
            self.fence()
        except WeftError as exc:
            _log.warning("shadow.fence_failed", error=exc.message)

    def touch(self, origin: str) -> None:
        """The origin was heard from (Hello, Watch or any shadow call): its shadows are not fenced yet."""
        with self._contact_lock:
            self._contact[origin] = time.monotonic()

    def _seed(self) -> None:
        try:
            shadows = [c for c in self.rt.containers() if ORIGIN_LABEL in c.labels]
        except WeftError as exc:
            _log.warning("shadow.fence_seed_failed", error=exc.message)  # the fencer tries again
            return
        now = time.monotonic()
        with self._contact_lock:
            for c in shadows:
                self._contact.setdefault(c.labels[ORIGIN_LABEL], now)
            self._seeded = True
        if shadows:
            self.ctx.shadows.present = True

    def fence(self) -> None:
        """One round: kill the running shadows of every origin silent for longer than the fence timeout."""
        if not self._seeded:
            self._seed()
            if not self._seeded:
                return
        now = time.monotonic()
        with self._contact_lock:
            origins = list(self._contact)
        for origin in origins:
            if self.in_contact(origin):
                self.touch(origin)
        with self._contact_lock:
            overdue = {o: t for o, t in self._contact.items() if now - t > self.fence_timeout}
        if not overdue:
            return
        running = [c for c in self.rt.containers(cri.CONTAINER_RUNNING) if c.labels.get(ORIGIN_LABEL) in overdue]
        for c in running:
            origin = c.labels[ORIGIN_LABEL]
            with self._contact_lock:
                silent = time.monotonic() - self._contact.get(origin, overdue[origin])
            if silent <= self.fence_timeout:  # heard from while we listed
                continue
            try:
                self.rt.stop(c.id)
            except UpstreamError as exc:
                if exc.code is not grpc.StatusCode.NOT_FOUND:
                    raise
            self.ctx.metrics.shadows_fenced.labels(origin).inc()
            _log.warning("shadow.fenced", origin=origin, key=c.annotations.get(KEY_ANNOTATION, ""),
                         container_id=c.id, silent_s=round(silent, 1))
        with self._contact_lock:  # an origin with nothing left running needs no watching until it runs more
            for origin, t in overdue.items():
                if self._contact.get(origin) == t and not any(c.labels[ORIGIN_LABEL] == origin for c in running):
                    del self._contact[origin]
