"""The Pod Security Standard "baseline", as the rules a rerouted container must meet.

A host runs a peer's container under its own kernel: whatever that container
may do beyond a baseline pod (capabilities, an SELinux type of its choosing,
host-wide sysctls, another container's namespaces) it may do to the host and
to every other tenant there. The origin checks these rules before it
reroutes (a container that breaks one stays on its node, with the reason);
the host checks them again on what it is asked, and builds the container it
runs from the fields it knows (``shim.shadowhost.config``) with seccomp and
AppArmor at the runtime's default and the default masked and read-only
``/proc`` paths, whatever the request said.

Pure: values in, a decision out.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline, "Capabilities")
BASELINE_CAPABILITIES = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE", "SETFCAP",
    "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})
# baseline, "Sysctls": namespaced and isolated from the host and other pods.
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
# baseline, "SELinux": the types a pod may ask for (or none).
SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
# What kubelet asks for a container whose procMount is Default (k8s.io/kubernetes pkg/securitycontext).
DEFAULT_MASKED_PATHS = (
    "/proc/asound", "/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
    "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware", "/sys/devices/virtual/powercap",
)
DEFAULT_READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")


class BaselineReason(enum.Enum):
    BASELINE = "baseline"
    CAPABILITIES = "capabilities"
    SELINUX = "selinux"
    SYSCTLS = "sysctls"
    TARGET_NAMESPACE = "target-namespace"  # another container's namespace, by its ID


@dataclass(frozen=True)
class SecurityFacts:
    """What the baseline rules read from a container and its sandbox."""

    added_capabilities: tuple[str, ...] = ()  # add and ambient, as CRI spells them
    selinux: tuple[tuple[str, str, str], ...] = ()  # (user, role, type) of the container and the sandbox
    sysctls: tuple[str, ...] = ()
    target_namespace: bool = False


@dataclass(frozen=True)
class BaselineDecision:
    reason: BaselineReason
    detail: str

    @property
    def allowed(self) -> bool:
        return self.reason is BaselineReason.BASELINE


def capability(name: str) -> str:
    """``CAP_NET_ADMIN``, ``net_admin`` and ``NET_ADMIN`` are one capability."""
    name = name.strip().upper()
    return name.removeprefix("CAP_")


def beyond_baseline(added: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({capability(c) for c in added} - BASELINE_CAPABILITIES))


def check_baseline(facts: SecurityFacts) -> BaselineDecision:
    """The first baseline rule the container breaks; BASELINE if none."""
    caps = beyond_baseline(facts.added_capabilities)
    if caps:
        return BaselineDecision(BaselineReason.CAPABILITIES,
                                f"adds capabilities beyond the baseline set: {', '.join(caps)}")
    for user, role, type_ in facts.selinux:
        if user or role or type_ not in SELINUX_TYPES:
            asked = ", ".join(f"{k}={v}" for k, v in (("user", user), ("role", role), ("type", type_)) if v)
            return BaselineDecision(BaselineReason.SELINUX, f"sets SELinux options a baseline pod may not: {asked}")
    unsafe = sorted(set(facts.sysctls) - SAFE_SYSCTLS)
    if unsafe:
        return BaselineDecision(BaselineReason.SYSCTLS, f"sets sysctls outside the safe set: {', '.join(unsafe)}")
    if facts.target_namespace:
        return BaselineDecision(BaselineReason.TARGET_NAMESPACE, "joins another container's namespace by its ID")
    return BaselineDecision(BaselineReason.BASELINE, "within the baseline Pod Security Standard")
