"""weft's own admin calls on the agent's socket: status, explain and drain, as JSON.

``weft status --socket`` and ``weft explain`` use the first two; the JSON
document is the one ``weft status --state-dir`` builds from the state files,
so the two ways agree, plus what only the running agent knows: this node
(name, role, mesh address, draining), its peers and their health, the shadows
it hosts for other nodes, and its recent warnings and errors
(``shim.log.recent``). Leases come from the broker when one is configured.

``weft drain`` uses Drain: the body ``{"drain": true}`` makes this node
refuse new shadows (Admit answers ``draining``; peers skip it at the next
Hello) and ``{"drain": false}`` ends that; either way the answer is the
node's drain state and the shadows it still hosts, which the CLI polls until
none is left.
"""

from __future__ import annotations

import json
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.crishared.labels import KEY_ANNOTATION, ORIGIN_LABEL
from shim.errors import ConfigError, MalformedRequest, UnknownContainer, WeftError
from shim.state import report

_STATES = {cri.CONTAINER_CREATED: "created", cri.CONTAINER_RUNNING: "running", cri.CONTAINER_EXITED: "exited",
           cri.CONTAINER_UNKNOWN: "unknown"}


def _leases(fabric: Fabric) -> list[dict] | None:
    if fabric.broker is None:
        return None
    try:
        return [report.lease_from_pb(lease) for lease in fabric.broker.list().leases]
    except WeftError:
        return None


def _node(fabric: Fabric) -> dict[str, Any]:
    mesh = fabric.mesh
    if mesh is None:
        return {"name": None, "role": "standalone", "mesh_address": None, "draining": False,
                "gpu_broker": fabric.broker is not None}
    return {"name": mesh.node, "role": mesh.role, "mesh_address": mesh.server.address, "draining": mesh.draining,
            "gpu_broker": fabric.broker is not None}


def hosted(fabric: Fabric) -> list[dict[str, Any]]:
    """The shadows this node's containerd holds for other nodes (none where this node hosts nothing)."""
    if fabric.mesh is None or "cpu" not in fabric.mesh.role.split(","):
        return []
    raw = fabric.upstream.channel.unary_unary("/runtime.v1.RuntimeService/ListContainers")(
        cri.ListContainersRequest().SerializeToString(), timeout=10)
    return [{"id": c.id, "name": c.metadata.name, "origin": c.labels[ORIGIN_LABEL],
             "state": _STATES.get(c.state, str(c.state)), "key": c.annotations.get(KEY_ANNOTATION, "")}
            for c in cri.ListContainersResponse.FromString(raw).containers if ORIGIN_LABEL in c.labels]


def shadows(fabric: Fabric, hosted: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The hosted shadows with their reservation pods (name and state; "none" where this host makes none)."""
    none = {"name": "", "state": "none"}
    return [{**h, "reservation": (fabric.reservation_of(h["key"]) if fabric.reservation_of else None) or none}
            for h in hosted]


def _hosted_or_error(fabric: Fabric) -> list[dict[str, Any]] | str:
    try:
        return hosted(fabric)
    except grpc.RpcError as exc:
        return f"containerd: {exc.details()}"  # type: ignore[attr-defined]


def status(fabric: Fabric) -> Route:
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        doc: dict[str, Any] = {"node": _node(fabric), **report.status(fabric.store, _leases(fabric))}
        if fabric.mesh is not None:
            doc["peers"] = fabric.mesh.status()
        doc["hosted"] = _hosted_or_error(fabric)
        if isinstance(doc["hosted"], list) and fabric.mesh is not None and "cpu" in fabric.mesh.role.split(","):
            doc["shadows"] = shadows(fabric, doc["hosted"])
        if fabric.host_config is not None:
            doc["containerd_config"] = fabric.host_config
        doc["recent_errors"] = log.recent()[-20:]
        return json.dumps(doc).encode()

    return Route(handle)


def explain(fabric: Fabric) -> Route:
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        container_id = request.decode(errors="replace").strip()
        doc = report.explain(fabric.store, container_id, _leases(fabric))
        if doc is None:
            raise UnknownContainer(f"weft placed no container {container_id!r} on this node")
        paths = fabric.origin.stitch_paths(container_id) if fabric.origin is not None else {}
        if paths:  # a remote container's ports on the origin pod's localhost: through the kernel or a tunnel
            doc["stitched_ports"] = {str(port): p for port, p in paths.items()}
            doc["why"] = [*doc.get("why", []), *(f"port {port} on localhost: {p['path']} ({p['reason']}: {p['detail']})"
                                                 for port, p in paths.items())]
        return json.dumps(doc).encode()

    return Route(handle)


def drain(fabric: Fabric) -> Route:
    def handle(request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            body = json.loads(request or b"{}")
            on = body.get("drain") if isinstance(body, dict) else None
        except ValueError:
            on = None
        if not isinstance(on, bool):
            raise MalformedRequest('Drain takes {"drain": true} or {"drain": false}')
        mesh = fabric.mesh
        if mesh is None or "cpu" not in mesh.role.split(","):
            raise ConfigError("this node hosts no containers for peers (no mesh, or its role has no cpu): "
                              "there is nothing to drain")
        mesh.set_draining(on)
        return json.dumps({"node": mesh.node, "draining": mesh.draining,
                           "hosted": _hosted_or_error(fabric)}).encode()

    return Route(handle)
