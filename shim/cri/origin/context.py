"""What the origin side needs, besides what every verb has (``shim.cri.fabric.Fabric``): the mesh and its settings.

A node on the mesh places its pods' CPU stages on its peers: placement,
the verbs that forward to a remote container, the supervisor, the stitched
network and the streaming relay all reach the mesh, and each other, through
``Fabric.origin`` (None on a node without a mesh, which reroutes nothing).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shim.crishared.remote import PulledImages, Remote

if TYPE_CHECKING:
    from shim.cri.origin.prepare import Prepared
    from shim.cri.origin.stitch import OriginNet
    from shim.cri.origin.stream_relay import StreamRelay
    from shim.mesh.node import MeshNode

# The pod spec of a pod on this node by namespace and name (shim.kube.pods.PodCache), where the agent has the API.
PodSpecOf = Callable[[str, str], "dict | None"]
RemoteListener = Callable[[Remote], None]


@dataclass(frozen=True)
class OriginSettings:
    """The mesh settings placement and the stitched network read (``[mesh]`` in the agent's configuration)."""

    # Where kubelet keeps pods' volumes (a rerouted container's emptyDirs are copied from there).
    pods_dir: str = "/var/lib/kubelet/pods"
    # A peer's Hello older than this is not trusted for placement: three Hello intervals, at least 30 s.
    peer_max_age_s: float = 30.0
    # Ask a host for an opted-in pod's shadow sandbox as RunPodSandbox arrives (shim.cri.origin.prepare).
    prepare_shadow_sandbox: bool = False
    # Carry a remote container's ports through the kernel where both ends allow it (shim.crishared.kernel_path).
    stitch_kernel_path: bool = False
    # Dial the pod network's tunnels in TLS even where the host does not ask (mesh.tunnel_tls).
    encrypt_pod_tunnels: bool = True


@dataclass
class RemoteEvents:
    """Told when a remote container starts, when kubelet rotates its log and when it is removed: the supervisor
    copies its log from the host."""

    started: list[RemoteListener] = field(default_factory=list)
    reopened: list[RemoteListener] = field(default_factory=list)
    removed: list[RemoteListener] = field(default_factory=list)


@dataclass
class Origin:
    mesh: MeshNode
    settings: OriginSettings = OriginSettings()
    # What the pod network's tunnels dial with (None: plain TCP only).
    tunnel_tls: ssl.SSLContext | None = None
    pod_spec: PodSpecOf | None = None
    # Images pulled through this node, with their credentials: a host pulls a rerouted container's image with them.
    images: PulledImages = field(default_factory=PulledImages)
    events: RemoteEvents = field(default_factory=RemoteEvents)
    # Shadow sandboxes made ahead on a host (None: none asked for).
    prepared: Prepared | None = None
    # Exec, attach and port-forward into remote containers (None: refused with a clear error).
    streams: StreamRelay | None = None
    # The stitched pod network: which path carries each port of a remote container, for weft explain.
    stitch: OriginNet | None = None

    def stitch_paths(self, container_id: str) -> dict[int, dict[str, str]]:
        return self.stitch.paths_of(container_id) if self.stitch is not None else {}
