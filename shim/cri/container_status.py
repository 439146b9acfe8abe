"""ContainerStatus: a remote container's status comes from what its host pushed, with kubelet's own fields.

Answered without a call to the host (``shim.cri.remote.Remote.kubelet_status``);
a local container's request passes to containerd unchanged.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.by_container import handler_for
from shim.cri.fabric import Fabric

PATH = "/runtime.v1.RuntimeService/ContainerStatus"


def handler(fabric: Fabric):
    def remote(r, req: cri.ContainerStatusRequest, context) -> bytes:
        return cri.ContainerStatusResponse(status=r.kubelet_status()).SerializeToString()

    return handler_for(fabric, PATH, cri.ContainerStatusRequest, remote)
