"""RemoveContainer: after containerd removes it, weft forgets its placement and releases its lease.

The poststop hook usually released the lease already; releasing again is
harmless (Release is idempotent). A container weft never placed costs one
primary-key lookup.
"""

from __future__ import annotations

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.create_container import _release_quietly
from shim.cri.fabric import Fabric
from shim.errors import UpstreamError

PATH = "/runtime.v1.RuntimeService/RemoveContainer"
_log = log.get("weft.cri")


def handler(fabric: Fabric):
    def remove_container(request: bytes, context: grpc.ServicerContext) -> bytes:
        response = b""
        try:
            response = fabric.upstream.unary(PATH, request, context)
        except UpstreamError as exc:
            if exc.code is not grpc.StatusCode.NOT_FOUND:
                raise
            gone = exc
        else:
            gone = None
        try:
            container_id = cri.RemoveContainerRequest.FromString(request).container_id
        except DecodeError:
            container_id = ""
        placed = fabric.store.remove_container(container_id) if container_id else None
        if placed is not None and placed.lease_id:
            _release_quietly(fabric, placed.lease_id, "container-removed")
        if placed is not None:
            _log.info("placement.removed", container_id=container_id, container=placed.name,
                      sandbox_id=placed.sandbox_id, lease=placed.lease_id or None)
        if gone is not None:
            raise gone
        return response

    return remove_container
