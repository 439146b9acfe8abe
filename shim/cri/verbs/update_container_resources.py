"""UpdateContainerResources: a remote container's limits change on its host (its CPU weight stays low there)."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import call_host, route_for
from shim.errors import CannotStart

PATH = "/runtime.v1.RuntimeService/UpdateContainerResources"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.UpdateContainerResourcesRequest, context) -> bytes:
        if r.lost:
            raise CannotStart(f"weft: container {r.id[:13]} was lost with its host {r.node}")
        return call_host(fabric, r, "UpdateContainerResources", req, timeout=30)

    return route_for(fabric, PATH, cri.UpdateContainerResourcesRequest, remote)
