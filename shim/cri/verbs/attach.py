"""Attach: a remote container's stdio is attached on its host, through the origin's URL (as Exec)."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import remote_url, route_for

PATH = "/runtime.v1.RuntimeService/Attach"


def route(fabric: Fabric) -> Route:
    return route_for(fabric, PATH, cri.AttachRequest,
                       lambda r, req, context: remote_url(fabric, "attach", r, req, cri.AttachResponse))
