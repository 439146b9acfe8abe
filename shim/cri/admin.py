"""weft's own admin calls on the agent's socket: status and explain, as JSON.

``weft status --socket`` and ``weft explain`` use them; the JSON document is
the same one ``weft status --state-dir`` builds from the state files, so the
two ways agree. Leases come from the broker when one is configured.
"""

from __future__ import annotations

import json

import grpc

from shim.cri.fabric import Fabric
from shim.cri.methods import ADMIN_EXPLAIN, ADMIN_STATUS
from shim.errors import UnknownContainer, WeftError
from shim.state import report

STATUS = ADMIN_STATUS
EXPLAIN = ADMIN_EXPLAIN


def _leases(fabric: Fabric) -> list[dict] | None:
    if fabric.broker is None:
        return None
    try:
        return [report.lease_from_pb(lease) for lease in fabric.broker.list().leases]
    except WeftError:
        return None


def status_handler(fabric: Fabric):
    def status(request: bytes, context: grpc.ServicerContext) -> bytes:
        doc = report.status(fabric.store, _leases(fabric))
        if fabric.mesh is not None:
            doc["peers"] = fabric.mesh.status()
        return json.dumps(doc).encode()

    return status


def explain_handler(fabric: Fabric):
    def explain(request: bytes, context: grpc.ServicerContext) -> bytes:
        container_id = request.decode(errors="replace").strip()
        doc = report.explain(fabric.store, container_id, _leases(fabric))
        if doc is None:
            raise UnknownContainer(f"weft placed no container {container_id!r} on this node")
        return json.dumps(doc).encode()

    return explain
