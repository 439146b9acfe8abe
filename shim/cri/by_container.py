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
from google.protobuf.message import DecodeError

from shim.cri.fabric import Fabric
from shim.cri.remote import Remote
from shim.errors import WeftError
from shim.mesh.client import PeerClient


class HostUnavailable(WeftError):
    """The host of a remote container is not a peer any more (its calls cannot be made)."""

    code = grpc.StatusCode.UNAVAILABLE


def handler_for(fabric: Fabric, path: str, request_type: Any,
                remote: Callable[[Remote, Any, grpc.ServicerContext], bytes]) -> Callable[..., bytes]:
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

    handle.when = lambda: fabric.remotes.present  # type: ignore[attr-defined]
    # The relay reads the body first: a local container's call then passes to containerd frame by frame,
    # as if weft were not there, and only a remote one's comes here.
    handle.pick = pick  # type: ignore[attr-defined]
    return handle


def client_for(fabric: Fabric, r: Remote) -> PeerClient:
    client = fabric.mesh.client(r.node) if fabric.mesh is not None else None
    if client is None:
        raise HostUnavailable(f"weft: container {r.id[:13]} runs on {r.node}, which is not a peer of this node now")
    return client


def call_host(fabric: Fabric, r: Remote, method: str, request: Any, timeout: float) -> bytes:
    """A CRI call on the container's shadow, through its host; the host's containerd answers."""
    return client_for(fabric, r).call(fabric.mesh.node, r.key, method, request.SerializeToString(), timeout)


def refresh(fabric: Fabric, r: Remote) -> None:
    """Fetch the shadow's status now, after a call that changed it (kubelet asks for it next)."""
    from cri_api.v1 import api_pb2 as cri

    state = client_for(fabric, r).shadow_status(fabric.mesh.node, r.key)
    if state.status:
        fabric.remotes.update(r, cri.ContainerStatus.FromString(state.status))
