"""The origin side's settings (``[mesh]`` in the agent's configuration) and the pod cache it may read.

At the bottom of the package: placement, prepared sandboxes and the
stitched network read them, and ``context`` gathers those parts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

# The pod spec of a pod on this node by namespace and name (shim.kube.pods.PodCache), where the agent has the API.
PodSpecOf = Callable[[str, str], "dict | None"]


@dataclass(frozen=True)
class OriginSettings:
    """The mesh settings placement and the stitched network read (``[mesh]`` in the agent's configuration)."""

    # Where kubelet keeps pods' volumes (a rerouted container's emptyDirs are copied from there).
    pods_dir: str = "/var/lib/kubelet/pods"
    # A peer's Hello older than this is not trusted for placement: three Hello intervals, at least 30 s.
    peer_max_age_s: float = 30.0
    # Ask a host for an opted-in pod's shadow sandbox as RunPodSandbox arrives (shim.origin.prepare).
    prepare_shadow_sandbox: bool = False
    # Carry a remote container's ports through the kernel where both ends allow it (shim.crishared.kernel_path).
    stitch_kernel_path: bool = False
    # Dial the pod network's tunnels in TLS even where the host does not ask (mesh.tunnel_tls).
    encrypt_pod_tunnels: bool = True
