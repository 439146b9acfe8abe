"""The origin side as the verbs reach it: the mesh, its settings and the parts that serve remote containers.

A node on the mesh places its pods' CPU stages on its peers: placement,
the verbs that forward to a remote container, the supervisor, the stitched
network and the streaming relay all reach the mesh, and each other, through
``Fabric.origin`` (None on a node without a mesh, which reroutes nothing).
``Origin`` is what the proxy's ``shim.crishared.sides.OriginSide`` asks for;
it sits at the top of this package, above the parts it holds.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shim.crishared.attempt import CreateAttempt, LocalBecause
from shim.crishared.remote import PulledImages, Remote, RemoteEvents
from shim.crishared.sides import OriginFabric
from shim.origin.place import place_remote
from shim.origin.prepare import Prepared
from shim.origin.settings import OriginSettings, PodSpecOf
from shim.origin.stitch import OriginNet
from shim.origin.stream_relay import StreamRelay

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode


@dataclass
class Origin:
    mesh: MeshNode
    settings: OriginSettings = field(default_factory=OriginSettings)
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

    def place(self, fabric: OriginFabric, a: CreateAttempt,
              budget_s: float | None = None) -> tuple[Remote | None, LocalBecause | None]:
        """Run a CPU container on a peer (``shim.origin.place``): the Remote kubelet now knows, or why it stays."""
        return place_remote(fabric, a, budget_s, mesh=self.mesh, settings=self.settings, images=self.images,
                            pod_spec=self.pod_spec, prepared=self.prepared)

    def stitch_paths(self, container_id: str) -> dict[int, dict[str, str]]:
        return self.stitch.paths_of(container_id) if self.stitch is not None else {}
