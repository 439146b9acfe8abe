"""ContainerStats: a remote container's usage is measured on its host, shown under kubelet's ID and labels."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.by_container import call_host, handler_for
from shim.cri.fabric import Fabric
from shim.cri.remote import Remote

PATH = "/runtime.v1.RuntimeService/ContainerStats"
STATS_TIMEOUT_S = 10.0


def stats_of(fabric: Fabric, r: Remote) -> cri.ContainerStats:
    """The host's stats of the shadow with the origin's attributes; attributes alone once it is lost."""
    stats = cri.ContainerStats()
    if not r.lost:
        req = cri.ContainerStatsRequest(container_id=r.id)
        stats = cri.ContainerStatsResponse.FromString(
            call_host(fabric, r, "ContainerStats", req, timeout=STATS_TIMEOUT_S)).stats
    stats.attributes.CopyFrom(r.attributes())
    return stats


def handler(fabric: Fabric):
    def remote(r, req: cri.ContainerStatsRequest, context) -> bytes:
        return cri.ContainerStatsResponse(stats=stats_of(fabric, r)).SerializeToString()

    return handler_for(fabric, PATH, cri.ContainerStatsRequest, remote)
