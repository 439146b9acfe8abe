"""This node's real free capacity, as the mesh reports it in Hello and checks it in Admit (docs/architecture.md).

A peer hosts a rerouted container only from what is really free: the books
(allocatable minus the requests of its own pods minus the limits of what it
already hosts) and the measurement (allocatable minus what is in use now)
must both have room, less a reserve kept for the node itself. Either alone
misleads: the books miss usage outside Kubernetes and pods that burst over
their requests; the measurement misses a pod that was admitted but is idle
for the moment.

The arithmetic and the admission rule are ``shim.core.reroute``'s (pure, and
the same ones the origin ranks peers with); this module feeds them this
node's counters, and whether the node is draining (``weft drain``): a
draining node still says it is healthy, with the health detail
``draining``, so its origins skip it for new containers (and do not take it
for lost), and it refuses every Admit with the reason ``draining``. The
counters sit behind ``Host`` so a probe is tested without a real machine:
``PsutilHost`` reads them through psutil, ``FixedHost`` holds values a test
sets.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import psutil

from shim._pb import mesh_pb2 as pb
from shim.core import reroute
from shim.core.reroute import ZERO, Resources
from shim.errors import ConfigError

MIB = 2**20
# PeerState.health_detail of a draining node (a detail, not a proto field: see the module docstring).
DRAINING = reroute.AdmitReason.DRAINING.value
ROLES = frozenset({"gpu", "cpu", "gpu,cpu"})

Amount = tuple[float, int]  # (cpu cores, memory bytes), accepted wherever Resources is


class Host(Protocol):
    def cpu_count(self) -> int: ...

    def cpu_busy(self) -> float:
        """Fraction (0..1) of all CPUs busy since the previous call."""
        ...

    def memory(self) -> tuple[int, int]:
        """(total, available) bytes."""
        ...


class PsutilHost:
    """The machine's own counters.

    CPU busy time is taken as a difference of ``psutil.cpu_times()`` kept here,
    not ``psutil.cpu_percent()``, whose "since the last call" is one interval
    shared by every caller in the process.
    """

    def __init__(self) -> None:
        self._last = psutil.cpu_times()

    def cpu_count(self) -> int:
        return psutil.cpu_count(logical=True) or 1

    def cpu_busy(self) -> float:
        now = psutil.cpu_times()
        total = _total(now) - _total(self._last)
        idle = _idle(now) - _idle(self._last)
        self._last = now
        if total <= 0:
            return 0.0
        return min(1.0, max(0.0, 1.0 - idle / total))

    def memory(self) -> tuple[int, int]:
        vm = psutil.virtual_memory()
        return vm.total, vm.available


@dataclass
class FixedHost:
    """A host whose counters a test (or the demo) sets: ``busy`` is the fraction of all CPUs in use."""

    cores: int
    memory_total: int
    memory_available: int
    busy: float = 0.0

    def cpu_count(self) -> int:
        return self.cores

    def cpu_busy(self) -> float:
        return self.busy

    def memory(self) -> tuple[int, int]:
        return self.memory_total, self.memory_available


def fixed_host(spec: str) -> FixedHost | None:
    """``"CORES,MEMORY"`` (e.g. ``"4,8Gi"``): a node that advertises this and measures nothing; "" measures.

    For test and demo nodes that share one machine, where psutil would report
    the machine's load to every one of them. A real node measures.
    """
    if not spec:
        return None
    from shim.core.quantity import AnnotationError, parse_memory

    try:
        cores, memory = (part.strip() for part in spec.split(","))
        total = parse_memory("mesh.fixed_capacity", memory)
        return FixedHost(cores=int(cores), memory_total=total, memory_available=total)
    except (ValueError, AnnotationError) as exc:
        raise ConfigError(f"mesh.fixed_capacity: {spec!r} is not CORES,MEMORY (e.g. 4,8Gi): {exc}") from None


def _total(t) -> float:
    # On Linux guest time is already counted in user and nice.
    return sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def _idle(t) -> float:
    return t.idle + getattr(t, "iowait", 0.0)


def _nothing() -> Resources:
    return ZERO


def as_resources(amount: Resources | Amount) -> Resources:
    if isinstance(amount, Resources):
        return amount
    return Resources(float(amount[0]), int(amount[1]))


class CapacityProbe:
    """Samples this node into a ``PeerState`` (node name left for the server to set)."""

    def __init__(
        self,
        role: str,
        reserve_cpu: float = 0.5,
        reserve_memory: int = 512 * MIB,
        own_requests: Callable[[], Resources | Amount] = _nothing,
        hosted_limits: Callable[[], Resources | Amount] = _nothing,
        *,
        host: Host | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if role not in ROLES:
            raise ConfigError(f"mesh role {role!r} is not one of {sorted(ROLES)}")
        if reserve_cpu < 0 or reserve_memory < 0:
            raise ConfigError(f"mesh reserve must not be negative (cpu {reserve_cpu}, memory {reserve_memory})")
        self.role = role
        self.reserve = Resources(float(reserve_cpu), int(reserve_memory))
        self._own_requests = own_requests
        self._hosted_limits = hosted_limits
        self._host = host or PsutilHost()
        self._clock = clock
        self.draining = False
        self.cordoned = False  # the host's Node is unschedulable (told by the host's reservations)

    @property
    def hosts_cpu(self) -> bool:
        return "cpu" in self.role.split(",")

    def sample(self) -> pb.PeerState:
        cores = self._host.cpu_count()
        total, available = self._host.memory()
        allocatable = Resources(float(cores), int(total))
        used = Resources(self._host.cpu_busy() * cores, max(0, int(total) - int(available)))
        own, hosted = as_resources(self._own_requests()), as_resources(self._hosted_limits())
        free = reroute.free_capacity(allocatable, own, hosted, used, reserve=self.reserve)
        return pb.PeerState(
            role=self.role, allocatable=_pb(allocatable), own_requests=_pb(own), hosted_limits=_pb(hosted),
            measured_used=_pb(used), free=_pb(free), healthy=True, sampled_at=self._clock(),
            health_detail=DRAINING if self.draining or self.cordoned else "",
        )

    def admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        """The default answer to Admit: the container's limits against free capacity now.

        The rule is ``shim.core.reroute.admit``, the same one the origin used to
        rank this peer, so the two sides agree on what fits. It books nothing:
        what this node hosts is counted through ``hosted_limits`` once the
        container exists, so the origin's create follows promptly.
        """
        state = self.sample()
        limits = Resources(request.limits.cpu_cores, request.limits.memory_bytes)
        free = Resources(state.free.cpu_cores, state.free.memory_bytes)
        decision = reroute.admit(limits, free, healthy=state.healthy, cpu_host=self.hosts_cpu,
                                 draining=self.draining, cordoned=self.cordoned)
        return pb.AdmitResponse(admitted=decision.admitted, reason=decision.reason.value, detail=decision.detail,
                                free_after=_pb(decision.free_after))


def _pb(amount: Resources) -> pb.Resources:
    return pb.Resources(cpu_cores=max(0.0, amount.cpu_cores), memory_bytes=max(0, int(amount.memory_bytes)))
