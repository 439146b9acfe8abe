"""Which data path carries a mirrored port of the stitched pod network: the kernel, or the agents' tunnel.

Where the pod network is flat (every pod IP routable from every node, as
Kubernetes requires), a connection to 127.0.0.1:<port> in the origin pod can
be forwarded by the kernel straight to the shadow's pod IP, so its bytes
never pass through an agent. That needs the shadow's pod IP (told by its
host), an IPv4 one, and a first connection from the origin pod's namespace to
that IP and port that the shadow accepts: which proves both that the pod
network reaches it and that the shadow listens on its pod IP, not on loopback
only (a loopback-only port is never exposed on the pod IP for this; it keeps
the tunnel). Otherwise, or when the kernel refuses the rules, the user-space
tunnel carries it as before.
"""

from __future__ import annotations

import enum
import ipaddress
from dataclasses import dataclass


class PathReason(enum.Enum):
    KERNEL = "kernel"  # nftables rules in the origin pod's namespace forward it
    DISABLED = "disabled"  # mesh.stitch_kernel_path is off
    NO_POD_IP = "no-pod-ip"  # the host did not tell the shadow's pod IP
    NOT_IPV4 = "not-ipv4"  # the kernel path is IPv4 only
    NOT_REACHABLE = "not-reachable"  # the shadow's pod IP and port did not accept a connection from the origin pod
    NO_KERNEL_SUPPORT = "no-kernel-support"  # the rules could not be set up (no nf_tables, no NAT)


@dataclass(frozen=True)
class PathDecision:
    reason: PathReason
    detail: str

    @property
    def kernel(self) -> bool:
        return self.reason is PathReason.KERNEL

    @property
    def path(self) -> str:
        return "kernel" if self.kernel else "tunnel"


def choose_path(port: int, pod_ip: str, *, enabled: bool, reachable: bool | None = None, probe_error: str = "",
                kernel_error: str = "") -> PathDecision:
    """The path for ``port`` of a shadow at ``pod_ip``; ``reachable`` is the probe's answer (None: not probed).

    The checks that need no probe come first, so a caller asks ``needs_probe``
    before connecting anywhere.
    """
    early = _before_probe(pod_ip, enabled=enabled)
    if early is not None:
        return early
    if kernel_error:
        return PathDecision(PathReason.NO_KERNEL_SUPPORT, f"the kernel refused the forwarding rules: {kernel_error}")
    if not reachable:
        why = f" ({probe_error})" if probe_error else ""
        return PathDecision(PathReason.NOT_REACHABLE, f"{pod_ip}:{port} did not accept a connection from the origin "
                            f"pod{why}: the pod network does not reach it, or the shadow listens on loopback only")
    return PathDecision(PathReason.KERNEL, f"127.0.0.1:{port} forwarded by the kernel to {pod_ip}:{port}")


def needs_probe(pod_ip: str, *, enabled: bool) -> bool:
    return _before_probe(pod_ip, enabled=enabled) is None


def _before_probe(pod_ip: str, *, enabled: bool) -> PathDecision | None:
    if not enabled:
        return PathDecision(PathReason.DISABLED, "mesh.stitch_kernel_path is off")
    if not pod_ip:
        return PathDecision(PathReason.NO_POD_IP, "the host did not tell the shadow's pod IP")
    try:
        ip = ipaddress.ip_address(pod_ip)
    except ValueError:
        return PathDecision(PathReason.NO_POD_IP, f"the host told a pod IP that is none: {pod_ip!r}")
    if ip.version != 4:
        return PathDecision(PathReason.NOT_IPV4, f"the shadow's pod IP {pod_ip} is IPv6; the kernel path is IPv4 only")
    if ip.is_loopback or ip.is_unspecified or ip.is_multicast:
        return PathDecision(PathReason.NO_POD_IP, f"{pod_ip} is not a pod IP")
    return None
