"""How the CRI proxy and the origin side reach each other without importing each other.

The verbs ask the origin side to place a CPU container on a peer, to
prepare a pod's shadow sandbox, for a streaming URL and for what carries a
remote container's ports (``OriginSide``: ``shim.origin.context.Origin`` is
it, made by the agent and held by the fabric); the origin side reads the
verbs' containerd connection, store and remote containers
(``OriginFabric``: ``shim.cri.fabric.Fabric`` is it). Both are structural
protocols, so neither package names the other's classes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from cri_api.v1 import api_pb2 as cri

from shim.crishared.attempt import CreateAttempt, LocalBecause
from shim.crishared.containerd import Containerd
from shim.crishared.remote import PulledImages, Remote, RemoteContainers, RemoteEvents
from shim.metrics import Metrics
from shim.state.agent import AgentStore, SandboxRecord

if TYPE_CHECKING:
    from shim.mesh.node import MeshNode


class OriginFabric(Protocol):
    """What the origin side reads of the verbs' fabric."""

    upstream: Containerd
    store: AgentStore
    metrics: Metrics
    remotes: RemoteContainers
    opted_in: dict[str, SandboxRecord]

    def inflight(self) -> set[str]: ...


class Preparing(Protocol):
    def begin(self, config: cri.PodSandboxConfig) -> Any: ...


class StreamUrls(Protocol):
    def url(self, kind: str, r: Remote, host_url: str) -> str: ...


class OriginSide(Protocol):
    """What the verbs ask of the origin side (None on a node without a mesh, which reroutes nothing)."""

    mesh: MeshNode
    # Images pulled through this node, with their credentials, for a host's pull (PullImage remembers them).
    images: PulledImages
    # Told when a remote container starts, when kubelet rotates its log and when it is removed.
    events: RemoteEvents
    # Shadow sandboxes asked for as RunPodSandbox arrives (None: none asked for).
    prepared: Preparing | None
    # Exec, attach and port-forward into remote containers (None: refused with a clear error).
    streams: StreamUrls | None

    def place(self, fabric: OriginFabric, a: CreateAttempt,
              budget_s: float | None = None) -> tuple[Remote | None, LocalBecause | None]: ...

    def stitch_paths(self, container_id: str) -> dict[int, dict[str, str]]: ...
