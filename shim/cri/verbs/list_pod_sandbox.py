"""ListPodSandbox: a host's shadow sandboxes left out, so its kubelet never sees (or kills) them."""

from __future__ import annotations

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs import listing

PATH = "/runtime.v1.RuntimeService/ListPodSandbox"


def route(fabric: Fabric) -> Route:
    return listing.route_for(fabric, PATH)
