"""ContainerStatus: a remote container's status comes from what its host pushed, with kubelet's own fields.

Answered without a call to the host (``shim.crishared.remote.Remote.kubelet_status``);
a local container's request passes to containerd unchanged.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import route_for

PATH = "/runtime.v1.RuntimeService/ContainerStatus"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.ContainerStatusRequest, context) -> bytes:
        return cri.ContainerStatusResponse(status=r.kubelet_status()).SerializeToString()

    return route_for(fabric, PATH, cri.ContainerStatusRequest, remote)
