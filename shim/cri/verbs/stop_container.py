"""StopContainer: a remote container is stopped on its host, with kubelet's grace period.

One that has exited (or was lost with its host) is stopped already, as
containerd answers for an exited container.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import call_host, refresh, route_for

PATH = "/runtime.v1.RuntimeService/StopContainer"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.StopContainerRequest, context) -> bytes:
        if r.lost or r.exited:
            return cri.StopContainerResponse().SerializeToString()
        call_host(fabric, r, "StopContainer", req, timeout=req.timeout + 30)
        refresh(fabric, r)
        return cri.StopContainerResponse().SerializeToString()

    return route_for(fabric, PATH, cri.StopContainerRequest, remote)
