"""ExecSync: a command in a remote container runs on its host; stdout, stderr and exit code come back."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.passthrough import timeout_of
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import call_host, route_for
from shim.errors import CannotStart

PATH = "/runtime.v1.RuntimeService/ExecSync"
# kubelet's probes set a timeout; a command without one still must not hold a thread forever.
NO_TIMEOUT_S = 3600.0


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.ExecSyncRequest, context) -> bytes:
        if r.lost:
            raise CannotStart(f"weft: container {r.id[:13]} was lost with its host {r.node}; nothing runs in it")
        deadline = timeout_of(context)
        timeout = deadline if deadline is not None else (req.timeout + 15 if req.timeout else NO_TIMEOUT_S)
        return call_host(fabric, r, "ExecSync", req, timeout=timeout)

    return route_for(fabric, PATH, cri.ExecSyncRequest, remote)
