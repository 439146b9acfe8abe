"""What a host tells its peers about its room: its own pods' requests and its shadows' limits.

The mesh's capacity probe asks for both on every Hello; each is measured at
most every ``CAPACITY_TTL_S`` and forgotten as soon as the hosted set changes.
A container's own resources change only by an in-place resize, so each is
asked of containerd again only every ``OWN_RESOURCES_TTL_S``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.core.reroute import ZERO, Resources
from shim.crishared.labels import CPU_LIMIT_ANNOTATION, CPU_SHARES_ANNOTATION, MEMORY_LIMIT_ANNOTATION, ORIGIN_LABEL
from shim.errors import UpstreamError, WeftError
from shim.metrics import Metrics
from shim.shadowhost.group_weight import ShadowGroupWeight
from shim.shadowhost.runtime import RT, ShadowRuntime

_log = log.get("weft.shadows")
CAPACITY_TTL_S = 2.0
OWN_RESOURCES_TTL_S = 30.0


def limits(resources: cri.LinuxContainerResources) -> tuple[float, int]:
    """(CPU cores, memory bytes) a container is limited to; 0 where it has no limit."""
    cpu = resources.cpu_quota / resources.cpu_period if resources.cpu_quota > 0 and resources.cpu_period > 0 else 0.0
    return cpu, max(0, resources.memory_limit_in_bytes)


def shares_of(c: cri.Container) -> int:
    """The CPU weight a shadow was made with (older shadows, without the annotation: the floor)."""
    try:
        return max(2, int(c.annotations.get(CPU_SHARES_ANNOTATION, "2")))
    except ValueError:
        return 2


# A shadow made and not started holds its room this long at most (the origin starts it at once).
MADE_HOLDS_S = 60.0

class HostedCapacity:
    def __init__(self, rt: ShadowRuntime, metrics: Metrics) -> None:
        self.rt, self.metrics = rt, metrics
        # Limits set by UpdateContainerResources since this agent started (the annotations hold the first ones).
        self.updated: dict[str, tuple[float, int]] = {}
        self._cache: dict[str, tuple[float, Resources]] = {}
        self._own: dict[str, tuple[float, int, int]] = {}  # container id -> (asked at, cpu.shares, memory limit)
        self._cache_lock = threading.Lock()
        # The CPU weight of the cgroup the shadows share, kept at the sum of the running shadows' (None: left).
        self.group: ShadowGroupWeight | None = None
        self.running_shares: list[int] = []  # the CPU weights of the running shadows, as last measured

    def own_requests(self) -> Resources:
        """CPU (cpu.shares / 1024) and memory limits of this node's own running containers, shadows left out."""
        return self._cached("own", self._own_requests)

    def hosted_limits(self) -> Resources:
        """CPU (quota / period) and memory limits of the shadows made or running; also sets
        ``weft_shadows_hosted`` (those running).

        A made shadow counts before it starts: the origin's StartContainer follows its RunShadow, and a
        second RunShadow admitted in between must not take the same room (a burst of origins would). One
        never started within ``MADE_HOLDS_S`` holds nothing (its origin gone, or its start refused)."""
        return self._cached("hosted", self._hosted_limits)

    def _own_requests(self) -> Resources:
        cpu, memory = 0.0, 0
        now = time.monotonic()
        known, self._own = self._own, {}
        for c in self.rt.containers(cri.CONTAINER_RUNNING):
            if ORIGIN_LABEL in c.labels:
                continue
            # Resources change only by an in-place resize: each container is asked again now and then, not each time.
            at, shares, limit = known.get(c.id) or (now, *self._resources(c.id))
            if now - at > OWN_RESOURCES_TTL_S:
                at, shares, limit = now, *self._resources(c.id)
            self._own[c.id] = (at, shares, limit)
            cpu += shares / 1024
            memory += limit
        return Resources(cpu, memory)

    def _resources(self, container_id: str) -> tuple[int, int]:
        """(cpu.shares, memory limit) of a container: the CRI field containerd 1.6 fills, else the OCI spec."""
        try:
            resp = self.rt.call(RT + "ContainerStatus", cri.ContainerStatusRequest(container_id=container_id),
                              cri.ContainerStatusResponse)
            if resp.status.HasField("resources") and resp.status.resources.HasField("linux"):
                r = resp.status.resources.linux
                return r.cpu_shares, max(0, r.memory_limit_in_bytes)
            resp = self.rt.call(RT + "ContainerStatus", cri.ContainerStatusRequest(
                container_id=container_id, verbose=True), cri.ContainerStatusResponse)
        except UpstreamError as exc:
            if exc.code is grpc.StatusCode.NOT_FOUND:
                return 0, 0
            raise
        try:
            spec = json.loads(resp.info.get("info", "{}")).get("runtimeSpec", {})
            r = spec.get("linux", {}).get("resources", {})
            return int(r.get("cpu", {}).get("shares") or 0), max(0, int(r.get("memory", {}).get("limit") or 0))
        except (ValueError, AttributeError, TypeError):
            return 0, 0

    def _hosted_limits(self) -> Resources:
        cpu, memory, count = 0.0, 0, 0
        shares: list[int] = []
        made_since = time.time_ns() - int(MADE_HOLDS_S * 1e9)
        for c in self.rt.containers():
            if ORIGIN_LABEL not in c.labels or c.state not in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING):
                continue
            if c.state == cri.CONTAINER_CREATED and c.created_at < made_since:
                continue
            if c.state == cri.CONTAINER_RUNNING:
                count += 1
                shares.append(shares_of(c))
            try:
                c_cpu, c_mem = self.updated.get(c.id) or (float(c.annotations.get(CPU_LIMIT_ANNOTATION, "0")),
                                                           int(c.annotations.get(MEMORY_LIMIT_ANNOTATION, "0")))
            except ValueError:
                c_cpu, c_mem = 0.0, 0
            cpu += c_cpu
            memory += c_mem
        self.metrics.shadows_hosted.set(count)
        self.running_shares = shares
        return Resources(cpu, memory)

    def _cached(self, name: str, compute: Callable[[], Resources]) -> Resources:
        with self._cache_lock:
            now = time.monotonic()
            hit = self._cache.get(name)
            if hit is not None and now - hit[0] < CAPACITY_TTL_S:
                return hit[1]
            try:
                value = compute()
            except WeftError as exc:  # a Hello must still be answered: the last known figures, or none
                _log.warning("shadow.capacity_failed", what=name, error=exc.message)
                return hit[1] if hit is not None else ZERO
            self._cache[name] = (now, value)
            return value

    def reweigh(self) -> None:
        """The running set changed (a shadow started or went): measure afresh and weigh the group now.

        Only then, not at every measurement: the group's weight moves when its shadows do."""
        self.forget()
        self.hosted_limits()
        if self.group is not None:
            self.group.apply(self.running_shares)

    def forget(self) -> None:
        """What changed the hosted set (a shadow made, started, stopped, removed or resized): measure afresh."""
        with self._cache_lock:
            self._cache.clear()
