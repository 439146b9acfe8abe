"""ReopenContainerLog: kubelet rotated a remote container's log; weft's copy continues in a new file.

kubelet renames the log file and asks for it to be reopened; the origin is
the one writing that file (the shadow's output, copied), so the copy closes
its file and opens a new one at kubelet's path, losing and repeating nothing.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import route_for

PATH = "/runtime.v1.RuntimeService/ReopenContainerLog"


def route(fabric: Fabric) -> Route:
    def remote(r, req: cri.ReopenContainerLogRequest, context) -> bytes:
        if fabric.origin is not None:
            for fn in fabric.origin.events.reopened:
                fn(r)
        return cri.ReopenContainerLogResponse().SerializeToString()

    return route_for(fabric, PATH, cri.ReopenContainerLogRequest, remote)
