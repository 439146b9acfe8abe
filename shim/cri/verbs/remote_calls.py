"""The container verbs' shared switch: a virtual (remote) container ID is weft's, any other is containerd's.

Each verb module that serves remote containers (``container_status``,
``start_container``, ``stop_container``, ``exec_sync``, ...) hands this its
remote branch. The verb is intercepted only while this node has remote
containers at all (``when``), so on every other node it stays plain
pass-through at no cost; and even then the relay reads the request body
first (``pick``): a call for a local container (or one that does not parse)
goes to containerd frame by frame, and only a remote one's reaches weft.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.crishared.remote import Remote, host_client
from shim.errors import CannotStart, NoStreamServer, WeftError
from shim.mesh.client import PeerClient

STATS_TIMEOUT_S = 10.0
CALL_TIMEOUT_S = 30.0
_log = log.get("weft.cri")




def route_for(fabric: Fabric, path: str, request_type: Any,
              remote: Callable[[Remote, Any, grpc.ServicerContext], bytes]) -> Route:
    """A container verb's route: weft answers for a remote container, containerd for any other."""
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            req = request_type.FromString(request)
        except DecodeError:
            return fabric.upstream.unary(path, request, context)
        r = fabric.remotes.get(req.container_id)
        if r is None:
            return fabric.upstream.unary(path, request, context)
        return remote(r, req, context)

    def pick(body: bytes) -> bool:
        return fabric.remotes.get(request_type.FromString(body).container_id) is not None

    # The relay reads the body first: a local container's call then passes to containerd frame by frame,
    # as if weft were not there, and only a remote one's comes here.
    return Route(handle, when=lambda: fabric.remotes.present, pick=pick)


def client_for(fabric: Fabric, r: Remote) -> PeerClient:
    return host_client(fabric.mesh, r)


def call_host(fabric: Fabric, r: Remote, method: str, request: Any, timeout: float) -> bytes:
    """A CRI call on the container's shadow, through its host; the host's containerd answers."""
    return client_for(fabric, r).call(fabric.mesh.node, r.key, method, request.SerializeToString(), timeout)


def refresh(fabric: Fabric, r: Remote) -> None:
    """Fetch the shadow's status now, after a call that changed it (kubelet asks for it next)."""
    state = client_for(fabric, r).shadow_status(fabric.mesh.node, r.key)
    if state.status:
        fabric.remotes.update(r, cri.ContainerStatus.FromString(state.status))




def with_remote_statuses(fabric: Fabric, sandbox_id: str, statuses) -> bool:
    """Add the sandbox's remote containers to a repeated ContainerStatus field (a pod's whole status, as
    PodSandboxStatus and container events carry it); False when it has none."""
    remotes = fabric.remotes.in_sandbox(sandbox_id) if sandbox_id else []
    known = {s.id for s in statuses}
    statuses.extend(r.kubelet_status() for r in remotes if r.id not in known)
    return bool(remotes)


def stats_of(fabric: Fabric, r: Remote) -> cri.ContainerStats:
    """The host's stats of the shadow with the origin's attributes; attributes alone once it is lost."""
    stats = cri.ContainerStats()
    if not r.lost:
        req = cri.ContainerStatsRequest(container_id=r.id)
        stats = cri.ContainerStatsResponse.FromString(
            call_host(fabric, r, "ContainerStats", req, timeout=STATS_TIMEOUT_S)).stats
    stats.attributes.CopyFrom(r.attributes())
    return stats




def remote_url(fabric: Fabric, kind: str, r, req, response_type) -> bytes:
    if r.lost:
        raise CannotStart(f"weft: container {r.id[:13]} was lost with its host {r.node}; nothing runs in it")
    streams = fabric.origin.streams if fabric.origin is not None else None
    if streams is None:
        raise NoStreamServer(f"weft: container {r.id[:13]} runs on {r.node} and this agent relays no streams")
    method = "Exec" if kind == "exec" else "Attach"
    host = response_type.FromString(call_host(fabric, r, method, req, timeout=CALL_TIMEOUT_S))
    return response_type(url=streams.url(kind, r, host.url)).SerializeToString()


def remove_remote(fabric: Fabric, r: Remote, why: str) -> None:
    """Remove a remote container: its shadow on the host, its log copy, and weft's records.

    A host that cannot be reached now does not keep kubelet's removal from
    finishing: the shadow is fenced by the host if the two stay apart, and
    removed as an orphan by the host's next Watch from this origin, which no
    longer lists its key.
    """
    mesh = fabric.mesh
    client = mesh.client(r.node) if mesh is not None else None
    removed = False
    if client is not None:
        try:
            removed = client.remove_shadow(mesh.node, r.key)
        except WeftError as exc:
            _log.warning("remote.remove_deferred", container_id=r.id, node=r.node, key=r.key, error=exc.message)
    for fn in fabric.origin.events.removed if fabric.origin is not None else ():
        fn(r)
    fabric.remotes.drop(r.id)
    fabric.store.remove_container(r.id)
    _log.info("placement.removed", container_id=r.id, container=r.config.metadata.name, sandbox_id=r.sandbox_id,
              node=r.node, shadow_removed=removed, why=why)
