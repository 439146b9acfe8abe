"""ListPodSandbox, ListContainers and their stats: a host's shadows are not its kubelet's business.

A shadow sandbox or container (one this node runs for another node's pod) is
labelled ``weft.io/origin-node``. kubelet would take it for an unknown pod and
kill it, so the agent leaves shadows out of what these four verbs return. They
are intercepted only while this node hosts shadows at all (``Fabric.
shadows_present``): on every other node they stay plain pass-through, at no
cost, which keeps kubelet's hottest polling path untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri

from shim.cri.fabric import Fabric

ORIGIN_LABEL = "weft.io/origin-node"

# path -> (response type, repeated field, how to reach an item's labels)
_VERBS: dict[str, tuple[Any, str, Callable[[Any], Any]]] = {
    "/runtime.v1.RuntimeService/ListPodSandbox": (cri.ListPodSandboxResponse, "items", lambda i: i.labels),
    "/runtime.v1.RuntimeService/ListContainers": (cri.ListContainersResponse, "containers", lambda i: i.labels),
    "/runtime.v1.RuntimeService/ListContainerStats": (
        cri.ListContainerStatsResponse, "stats", lambda i: i.attributes.labels),
    "/runtime.v1.RuntimeService/ListPodSandboxStats": (
        cri.ListPodSandboxStatsResponse, "stats", lambda i: i.attributes.labels),
}
PATHS = tuple(_VERBS)


def without_shadows(response: bytes, path: str) -> bytes:
    """The response with every item labelled as a shadow removed (pure)."""
    rtype, field, labels = _VERBS[path]
    msg = rtype.FromString(response)
    items = getattr(msg, field)
    keep = [item for item in items if ORIGIN_LABEL not in labels(item)]
    if len(keep) == len(items):
        return response
    kept = [type(item)() for item in keep]
    for dst, src in zip(kept, keep, strict=True):
        dst.CopyFrom(src)
    del items[:]
    items.extend(kept)
    return msg.SerializeToString()


def handlers(fabric: Fabric) -> dict[str, Callable[..., bytes]]:
    def make(path: str) -> Callable[..., bytes]:
        def hide(request: bytes, context: grpc.ServicerContext) -> bytes:
            return without_shadows(fabric.upstream.unary(path, request, context), path)

        hide.when = lambda: fabric.shadows_present  # type: ignore[attr-defined]
        return hide

    return {path: make(path) for path in PATHS}
