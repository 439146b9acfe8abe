"""StopPodSandbox: containerd stops the pod's local containers; weft stops its remote ones on their hosts.

Intercepted only while this node has remote containers, and then only for a
sandbox that has some (the relay reads the body first): any other call goes
to containerd frame by frame. As containerd does for its own, the remote
containers are killed at once (kubelet stopped them with their grace period
before); a host that cannot be reached fails the call, and kubelet retries.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import call_host, refresh
from shim.crishared.remote import Remote
from shim.errors import RemoteStopFailed, WeftError

PATH = "/runtime.v1.RuntimeService/StopPodSandbox"
_log = log.get("weft.cri")


def _stop(fabric: Fabric, r: Remote) -> str | None:
    if r.lost or r.exited:
        return None
    try:
        call_host(fabric, r, "StopContainer", cri.StopContainerRequest(container_id=r.id, timeout=0), timeout=30)
        refresh(fabric, r)
    except WeftError as exc:
        return f"{r.config.metadata.name} on {r.node}: {exc.message}"
    return None


def route(fabric: Fabric) -> Route:
    def stop_pod_sandbox(request: bytes, context: grpc.ServicerContext) -> bytes:
        response = fabric.upstream.unary(PATH, request, context)
        try:
            sandbox_id = cri.StopPodSandboxRequest.FromString(request).pod_sandbox_id
        except DecodeError:
            return response
        remotes = fabric.remotes.in_sandbox(sandbox_id)
        if remotes:
            with ThreadPoolExecutor(max_workers=min(8, len(remotes))) as pool:
                failed = [e for e in pool.map(lambda r: _stop(fabric, r), remotes) if e]
            _log.info("sandbox.remote_stopped", sandbox_id=sandbox_id, containers=len(remotes), failed=len(failed))
            if failed:
                raise RemoteStopFailed(f"weft: could not stop the pod's remote containers: {'; '.join(failed)}")
        return response

    def pick(body: bytes) -> bool:
        return bool(fabric.remotes.in_sandbox(cri.StopPodSandboxRequest.FromString(body).pod_sandbox_id))

    return Route(stop_pod_sandbox, when=lambda: fabric.remotes.present, pick=pick)
