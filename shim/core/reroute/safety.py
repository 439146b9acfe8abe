"""Whether a CPU container may leave its node at all: nothing in it leans on the node, and it has limits."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shim.core.reroute.resources import Resources


@dataclass(frozen=True)
class ContainerFacts:
    """What the safety rules read from a CreateContainer request and its sandbox."""

    privileged: bool = False
    host_network: bool = False
    host_pid: bool = False
    host_ipc: bool = False
    # Data that lives on this node and cannot follow the container: hostPath
    # volumes, and node-attached volumes (see classify_mounts).
    host_path_mounts: tuple[str, ...] = ()
    # Pod volumes this container shares with a container that stays here:
    # neither side would see the other's writes once one of them moved.
    writable_shared_mounts: tuple[str, ...] = ()
    # ConfigMap/Secret/projected/downward-API volumes, copied to the peer.
    readonly_copyable_mounts: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    limits: Resources | None = None  # None: the container declares no limits
    # What breaks the baseline Pod Security Standard (shim.core.baseline), empty when nothing does.
    beyond_baseline: str = ""


class SafetyReason(enum.Enum):
    SAFE = "safe"
    PRIVILEGED = "privileged"
    HOST_NETWORK = "host-network"
    HOST_PID = "host-pid"
    HOST_IPC = "host-ipc"
    HOST_PATH = "host-path-mount"
    SHARED_WRITABLE_VOLUME = "shared-writable-volume"
    DEVICES = "host-devices"
    # Capabilities, SELinux options, sysctls or namespaces a baseline pod may not have: a host would refuse it.
    NOT_BASELINE = "not-baseline"
    NO_LIMITS = "no-limits"  # a peer admits by limits, so without them it cannot admit safely


@dataclass(frozen=True)
class SafetyDecision:
    reason: SafetyReason
    detail: str  # names the offending flag or paths

    @property
    def safe(self) -> bool:
        return self.reason is SafetyReason.SAFE


def check_safety(facts: ContainerFacts) -> SafetyDecision:
    """The first rule the container breaks, in the order of :class:`SafetyReason`; SAFE if none."""
    flags = (
        (facts.privileged, SafetyReason.PRIVILEGED, "securityContext.privileged: true"),
        (facts.host_network, SafetyReason.HOST_NETWORK, "hostNetwork: true"),
        (facts.host_pid, SafetyReason.HOST_PID, "hostPID: true"),
        (facts.host_ipc, SafetyReason.HOST_IPC, "hostIPC: true"),
    )
    for on, reason, detail in flags:
        if on:
            return SafetyDecision(reason, detail)
    paths = (
        (facts.host_path_mounts, SafetyReason.HOST_PATH, "mounts data that stays on this node"),
        (facts.writable_shared_mounts, SafetyReason.SHARED_WRITABLE_VOLUME,
         "shares a volume with a container that stays on this node"),
        (facts.devices, SafetyReason.DEVICES, "uses host devices"),
    )
    for found, reason, what in paths:
        if found:
            return SafetyDecision(reason, f"{what}: {', '.join(found)}")
    if facts.beyond_baseline:
        return SafetyDecision(SafetyReason.NOT_BASELINE, facts.beyond_baseline)
    missing = missing_limits(facts.limits)
    if missing:
        return SafetyDecision(SafetyReason.NO_LIMITS, f"no {missing} limit; a peer admits containers by their limits")
    return SafetyDecision(SafetyReason.SAFE, "no privilege, host namespace, host path, shared volume or device")


def missing_limits(limits: Resources | None) -> str:
    # CRI spells "unlimited" as 0 (cpu_quota, memory_limit_in_bytes); a zero
    # would fit on every peer and then run unbounded there.
    if limits is None or (limits.cpu_cores <= 0 and limits.memory_bytes <= 0):
        return "CPU or memory"
    if limits.cpu_cores <= 0:
        return "CPU"
    if limits.memory_bytes <= 0:
        return "memory"
    return ""
