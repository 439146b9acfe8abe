"""Exec (the streaming one): a remote container's session is served by its host, through the origin's URL.

The host's containerd makes the session and its URL (ShadowCall Exec); kubelet
gets a URL of the origin's streaming relay (``shim.origin.stream_relay``) that
leads there. A local container's Exec passes through unchanged.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import remote_url, route_for

PATH = "/runtime.v1.RuntimeService/Exec"


def route(fabric: Fabric) -> Route:
    return route_for(fabric, PATH, cri.ExecRequest,
                       lambda r, req, context: remote_url(fabric, "exec", r, req, cri.ExecResponse))
