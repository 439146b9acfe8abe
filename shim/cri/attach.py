"""Attach: a remote container's stdio is attached on its host, through the origin's URL (as Exec)."""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.cri.by_container import handler_for
from shim.cri.exec_stream import remote_url
from shim.cri.fabric import Fabric

PATH = "/runtime.v1.RuntimeService/Attach"


def handler(fabric: Fabric):
    return handler_for(fabric, PATH, cri.AttachRequest,
                       lambda r, req, context: remote_url(fabric, "attach", r, req, cri.AttachResponse))
