"""StartContainer: a remote container is started on its host (StartShadow), then its log is copied here.

The host's answer carries the shadow's new status, so the ContainerStatus
kubelet sends next already shows it running.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import client_for, route_for
from shim.errors import CannotStart

PATH = "/runtime.v1.RuntimeService/StartContainer"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.StartContainerRequest, context) -> bytes:
        if r.lost:
            raise CannotStart(f"weft: container {r.id[:13]} was lost with its host {r.node}; it cannot be started")
        state = client_for(fabric, r).start_shadow(fabric.mesh.node, r.key)
        if state.status:
            fabric.remotes.update(r, cri.ContainerStatus.FromString(state.status))
        if fabric.origin is not None:
            for fn in fabric.origin.events.started:
                fn(r)
        return cri.StartContainerResponse().SerializeToString()

    return route_for(fabric, PATH, cri.StartContainerRequest, remote)
