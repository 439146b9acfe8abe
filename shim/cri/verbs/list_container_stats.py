"""ListContainerStats: as ListContainers, with each remote container's usage measured on its host."""

from __future__ import annotations

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs import listing

PATH = "/runtime.v1.RuntimeService/ListContainerStats"


def route(fabric: Fabric) -> Route:
    return listing.route_for(fabric, PATH)
