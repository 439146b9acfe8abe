"""RemovePodSandbox: once containerd removed the sandbox, everything weft kept for it goes too.

The sandbox's record, its containers' placements (cascade) and their leases,
and its remote containers on their hosts.
Only after containerd succeeded (or says the sandbox is unknown), so a failed
removal that kubelet retries still finds weft's records.
"""

from __future__ import annotations

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import remove_remote

PATH = "/runtime.v1.RuntimeService/RemovePodSandbox"
_log = log.get("weft.cri")


def route(fabric: Fabric) -> Route:
    def remove_pod_sandbox(request: bytes, context: grpc.ServicerContext) -> bytes:
        response, gone = fabric.upstream.unary_or_missing(PATH, request, context)
        try:
            sandbox_id = cri.RemovePodSandboxRequest.FromString(request).pod_sandbox_id
        except DecodeError:
            sandbox_id = ""
        if sandbox_id in fabric.opted_in:
            for r in fabric.remotes.in_sandbox(sandbox_id):  # the remote parts go too
                remove_remote(fabric, r, "sandbox-removed")
            owned = fabric.store.remove_sandbox(sandbox_id)
            fabric.forget(sandbox_id)
            for placed in owned:
                if placed.lease_id:
                    fabric.release_quietly(placed.lease_id, "sandbox-removed")
            _log.info("sandbox.removed", sandbox_id=sandbox_id, placements=len(owned))
        if gone is not None:
            raise gone
        return response

    return Route(remove_pod_sandbox)
