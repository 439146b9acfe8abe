"""StopContainer: a remote container is stopped on its host, with kubelet's grace period.

One that has exited (or was lost with its host) is stopped already, as
containerd answers for an exited container.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.by_container import call_host, handler_for, refresh
from shim.cri.fabric import Fabric

PATH = "/runtime.v1.RuntimeService/StopContainer"


def handler(fabric: Fabric):
    def remote(r, req: cri.StopContainerRequest, context) -> bytes:
        if r.lost or r.exited:
            return cri.StopContainerResponse().SerializeToString()
        call_host(fabric, r, "StopContainer", req, timeout=req.timeout + 30)
        refresh(fabric, r)
        return cri.StopContainerResponse().SerializeToString()

    return handler_for(fabric, PATH, cri.StopContainerRequest, remote)
