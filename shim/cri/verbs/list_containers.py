"""ListContainers: a host's shadows left out; an origin's remote containers added under kubelet's IDs."""

from __future__ import annotations

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs import listing

PATH = "/runtime.v1.RuntimeService/ListContainers"


def route(fabric: Fabric) -> Route:
    return listing.route_for(fabric, PATH)
