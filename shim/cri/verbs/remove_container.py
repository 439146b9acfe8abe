"""RemoveContainer: after containerd removes it, weft forgets its placement and releases its lease.

A remote container is removed on its host instead (``remote_calls.remove_remote``).

The poststop hook usually released the lease already; releasing again is
harmless (Release is idempotent). A container weft never placed costs one
primary-key lookup.
"""

from __future__ import annotations

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import remove_remote

PATH = "/runtime.v1.RuntimeService/RemoveContainer"
_log = log.get("weft.cri")


def route(fabric: Fabric) -> Route:
    def remove_container(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            container_id = cri.RemoveContainerRequest.FromString(request).container_id
        except DecodeError:
            container_id = ""
        r = fabric.remotes.get(container_id)
        if r is not None:
            remove_remote(fabric, r, "container-removed")
            return cri.RemoveContainerResponse().SerializeToString()
        response, gone = fabric.upstream.unary_or_missing(PATH, request, context)
        # containerd accepts a unique ID prefix (crictl rm abc123); so does weft's lookup.
        known = fabric.store.placement(container_id, by_key=False) if container_id else None
        placed = fabric.store.remove_container(known.container_id) if known and known.container_id else None
        if placed is not None and placed.lease_id:
            fabric.release_quietly(placed.lease_id, "container-removed")
        if placed is not None:
            _log.info("placement.removed", container_id=container_id, container=placed.name,
                      sandbox_id=placed.sandbox_id, lease=placed.lease_id or None)
        if gone is not None:
            raise gone
        return response

    return Route(remove_container)
