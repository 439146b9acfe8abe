"""Exec (the streaming one): a remote container's session is served by its host, through the origin's URL.

The host's containerd makes the session and its URL (ShadowCall Exec); kubelet
gets a URL of the origin's streaming relay (``shim.cri.stream_relay``) that
leads there. A local container's Exec passes through unchanged.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.by_container import call_host, handler_for
from shim.cri.fabric import Fabric
from shim.cri.start_container import CannotStart
from shim.errors import WeftError

PATH = "/runtime.v1.RuntimeService/Exec"
CALL_TIMEOUT_S = 30.0


class NoStreamServer(WeftError):
    """This agent runs no streaming relay, so a remote container's session has nowhere to go."""


def remote_url(fabric: Fabric, kind: str, r, req, response_type) -> bytes:
    if r.lost:
        raise CannotStart(f"weft: container {r.id[:13]} was lost with its host {r.node}; nothing runs in it")
    if fabric.streams is None:
        raise NoStreamServer(f"weft: container {r.id[:13]} runs on {r.node} and this agent relays no streams")
    method = "Exec" if kind == "exec" else "Attach"
    host = response_type.FromString(call_host(fabric, r, method, req, timeout=CALL_TIMEOUT_S))
    return response_type(url=fabric.streams.url(kind, r, host.url)).SerializeToString()


def handler(fabric: Fabric):
    return handler_for(fabric, PATH, cri.ExecRequest,
                       lambda r, req, context: remote_url(fabric, "exec", r, req, cri.ExecResponse))
