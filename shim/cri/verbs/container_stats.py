"""ContainerStats: a remote container's usage is measured on its host, shown under kubelet's ID and labels."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import route_for, stats_of

PATH = "/runtime.v1.RuntimeService/ContainerStats"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.ContainerStatsRequest, context) -> bytes:
        return cri.ContainerStatsResponse(stats=stats_of(fabric, r)).SerializeToString()

    return route_for(fabric, PATH, cri.ContainerStatsRequest, remote)
