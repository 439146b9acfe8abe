"""The host's side: what it has free, and whether a stage of given limits fits (its Admit)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shim.core.quantity import format_bytes
from shim.core.reroute.resources import CPU_SLACK, ZERO, Resources, cores_text
from shim.core.reroute.safety import missing_limits


def free_capacity(
    allocatable: Resources,
    own_requests: Resources,
    hosted_limits: Resources,
    measured_used: Resources,
    *,
    reserve: Resources = ZERO,
) -> Resources:
    """What a peer can host now: the smaller of what its books and what measurement leave, never negative.

    The books (allocatable minus its own pods' requests and the limits of
    what it already hosts) keep promises that are not being used at the
    moment: an idle pod will want its requests back. Measurement catches use
    the books do not show: pods bursting over their requests, daemons outside
    any pod. ``reserve`` is kept free on both sides.
    """
    books = allocatable.minus(own_requests).minus(hosted_limits).minus(reserve)
    measured = allocatable.minus(measured_used).minus(reserve)
    return Resources(
        max(0.0, min(books.cpu_cores, measured.cpu_cores)),
        max(0, min(books.memory_bytes, measured.memory_bytes)),
    )


class AdmitReason(enum.Enum):
    ADMITTED = "admitted"
    INSUFFICIENT_CPU = "insufficient-cpu"
    INSUFFICIENT_MEMORY = "insufficient-memory"
    UNHEALTHY = "unhealthy"
    NOT_A_CPU_HOST = "not-a-cpu-host"
    # The peer does not trust the origin's safety check: a zero limit is
    # "unlimited" in CRI and would fit anywhere.
    NO_LIMITS = "no-limits"
    # ``weft drain`` on the peer: it keeps what it hosts and takes nothing new.
    DRAINING = "draining"


@dataclass(frozen=True)
class AdmitDecision:
    reason: AdmitReason
    detail: str
    free_after: Resources  # the peer's free capacity once this container is counted; unchanged when refused

    @property
    def admitted(self) -> bool:
        return self.reason is AdmitReason.ADMITTED


def admit(limits: Resources, free: Resources, *, healthy: bool = True, cpu_host: bool = True,
          draining: bool = False, cordoned: bool = False) -> AdmitDecision:
    """Would this peer host a container with these limits now?

    ``draining``: ``weft drain``; ``cordoned``: its Node is unschedulable (``kubectl cordon``, ``kubectl
    drain``). Either way it takes nothing new, with the reason ``draining``.

    The limits are checked before the host (a request no peer could take says
    so), and the host's role before its health (a node that never hosts should
    not be reported as merely unwell). CPU is reported before memory when both
    are short; the detail names both.
    """
    missing = missing_limits(limits)
    if missing:
        return AdmitDecision(AdmitReason.NO_LIMITS, f"no {missing} limit in the request", free)
    if not cpu_host:
        return AdmitDecision(AdmitReason.NOT_A_CPU_HOST, "this node's role does not include cpu", free)
    if not healthy:
        return AdmitDecision(AdmitReason.UNHEALTHY, "this node reports itself unhealthy", free)
    if draining:
        return AdmitDecision(AdmitReason.DRAINING, "this node is draining (weft drain): it takes no new containers",
                             free)
    if cordoned:
        return AdmitDecision(AdmitReason.DRAINING, "this node is cordoned (its Node is unschedulable): it takes no "
                             "new containers", free)
    cpu_short = limits.cpu_cores > free.cpu_cores + CPU_SLACK
    memory_short = limits.memory_bytes > free.memory_bytes
    if cpu_short or memory_short:
        short = []
        if cpu_short:
            short.append(f"{cores_text(limits.cpu_cores)} CPU asked, {cores_text(free.cpu_cores)} free")
        if memory_short:
            short.append(f"{format_bytes(limits.memory_bytes)} memory asked, {format_bytes(free.memory_bytes)} free")
        reason = AdmitReason.INSUFFICIENT_CPU if cpu_short else AdmitReason.INSUFFICIENT_MEMORY
        return AdmitDecision(reason, "; ".join(short), free)
    after = free.minus(limits)
    # Within the CPU slack the difference can dip just below zero.
    after = Resources(max(0.0, after.cpu_cores), after.memory_bytes)
    return AdmitDecision(AdmitReason.ADMITTED, f"fits: asks {limits}; leaves {after}", after)
