"""What the proxy knows about CRI methods, derived from the CRI stubs.

The shape (unary or server-streaming) of each known method comes from the
``runtime.v1`` descriptors, so a method added to CRI is forwarded with the
right shape as soon as the stubs know it. A method the stubs do not know is
forwarded too, as a bidirectional stream, which carries any shape on the wire.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from cri_api.v1 import api_pb2


class Shape(enum.Enum):
    UNARY = "unary"
    SERVER_STREAM = "server_stream"
    ANY = "any"  # unknown method: a bidirectional stream carries every shape


@dataclass(frozen=True)
class Method:
    path: str
    name: str
    shape: Shape
    # Polling verbs are logged at debug, the rest at info (as containerd does).
    polling: bool
    # The request's field 1 when it names what the call is about ("container_id" or "pod_sandbox_id"):
    # read off the wire for the call's log line, without parsing the request.
    id_field: str = ""


_POLLING_PREFIXES = ("List", "Version", "Status", "ImageStatus", "ImageFsInfo", "ContainerStatus",
                     "PodSandboxStatus", "ContainerStats", "PodSandboxStats", "RuntimeConfig")


_ID_FIELDS = ("container_id", "pod_sandbox_id")


def _known() -> dict[str, Method]:
    table = {}
    for service in api_pb2.DESCRIPTOR.services_by_name.values():
        for m in service.methods:
            path = f"/{service.full_name}/{m.name}"
            if m.client_streaming:
                shape = Shape.ANY
            elif m.server_streaming:
                shape = Shape.SERVER_STREAM
            else:
                shape = Shape.UNARY
            first = m.input_type.fields_by_number.get(1)
            id_field = first.name if first is not None and first.name in _ID_FIELDS else ""
            table[path] = Method(path, m.name, shape, m.name.startswith(_POLLING_PREFIXES), id_field)
    return table


# weft's own admin calls on the agent socket (JSON bodies; see shim.cri.verbs.admin).
ADMIN_STATUS = "/weft.agent.v1.Admin/Status"
ADMIN_EXPLAIN = "/weft.agent.v1.Admin/Explain"
ADMIN_DRAIN = "/weft.agent.v1.Admin/Drain"

KNOWN: dict[str, Method] = {
    **_known(),
    ADMIN_STATUS: Method(ADMIN_STATUS, "WeftStatus", Shape.UNARY, True),
    ADMIN_EXPLAIN: Method(ADMIN_EXPLAIN, "WeftExplain", Shape.UNARY, True),
    ADMIN_DRAIN: Method(ADMIN_DRAIN, "WeftDrain", Shape.UNARY, False),
}
_V1_SERVICES = ("/runtime.v1.RuntimeService/", "/runtime.v1.ImageService/")


def lookup(path: str) -> Method:
    method = KNOWN.get(path)
    if method is not None:
        return method
    # Label cardinality stays bounded whatever paths a client invents.
    name = path.rsplit("/", 1)[-1] if path.startswith(_V1_SERVICES) else "other"
    return Method(path, name or "other", Shape.ANY, False)
