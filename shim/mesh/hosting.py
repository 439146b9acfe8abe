"""What the mesh server asks of the node's host side: the objects that answer an origin's requests, as protocols.

The mesh sits below the host side (``shim.shadowhost``) and never imports it:
a CPU host's server hands each request, with the origin's node name (checked
against its certificate), to the part that does the work, and the host side
answers from its own containerd. ``ShadowHosting`` gathers those parts; the
host side makes it (``shim.shadowhost.side.HostSide.hosting``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from shim._pb import mesh_pb2 as pb
from shim.core.reroute import Resources

Admit = Callable[[pb.AdmitRequest], pb.AdmitResponse]


class Fencing(Protocol):
    # Set by the server: whether an origin has a call or stream open now (heard from, so not fenced).
    in_contact: Callable[[str], bool]

    def touch(self, origin: str) -> None: ...


class ShadowLifecycle(Protocol):
    """RunShadow of a container, StartShadow, ShadowStatus, RemoveShadow and SyncVolumes."""

    # Set by the server: its Admit rule, which RunShadow asks again.
    admit: Admit | None

    def receiving(self, origin: str, key: str, stream: Iterator[pb.VolumeUpload],
                  into: Any) -> AbstractContextManager[None]: ...
    def run(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState: ...
    def start(self, origin: str, key: str) -> pb.ShadowState: ...
    def status(self, origin: str, key: str) -> pb.ShadowState: ...
    def remove(self, origin: str, key: str) -> bool: ...
    def sync_volumes(self, origin: str, req: pb.SyncVolumesRequest) -> pb.SyncVolumesResponse: ...


class SandboxPreparing(Protocol):
    """RunShadow of a sandbox alone (``sandbox_only``), made before a container asks."""

    def prepare(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState: ...


class Pulsing(Protocol):
    # Set by the server: this node's state as Hello answers it, which Watches with an idle heartbeat push.
    room: Callable[[], pb.PeerState] | None


class ShadowWatching(Protocol):
    pulse: Pulsing

    def watch(self, origin: str, req: pb.WatchRequest,
              context: grpc.ServicerContext) -> Iterator[pb.ShadowState]: ...
    def stream_log(self, origin: str, req: pb.LogRequest, context: grpc.ServicerContext) -> Iterator[pb.LogChunk]: ...


class ShadowCalls(Protocol):
    """ShadowCall, and the tunnels into a shadow (OpenTunnel, Stitch)."""

    # Set by the server: its Admit rule, for an update that asks for more.
    admit: Admit | None

    def call(self, origin: str, req: pb.ShadowCallRequest) -> pb.ShadowCallResponse: ...
    def open_tunnel(self, origin: str, req: pb.TunnelRequest) -> pb.TunnelGrant: ...
    def stitch(self, origin: str, req: pb.StitchRequest, context: grpc.ServicerContext) -> Iterator[pb.StitchEvent]: ...


class HostBooks(Protocol):
    """The host's books for its Hellos: its own pods' requests and its shadows' limits."""

    def own_requests(self) -> Resources: ...
    def hosted_limits(self) -> Resources: ...


@dataclass(frozen=True)
class ShadowHosting:
    fence: Fencing
    lifecycle: ShadowLifecycle
    preparer: SandboxPreparing
    watcher: ShadowWatching
    calls: ShadowCalls
    capacity: HostBooks
