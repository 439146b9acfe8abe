"""What the four list verbs share: a host's shadows hidden, an origin's remote containers shown.

A shadow sandbox or container (one this node runs for another node's pod) is
labelled ``weft.io/origin-node``, and marked by the host that made it
(``shim.crishared.mark``): only what bears this host's mark is hidden, so a pod
that carries the label itself stays in kubelet's view. kubelet would take it for an unknown pod and
kill it, so the agent leaves shadows out of what the four list verbs
(``list_pod_sandbox``, ``list_containers``, ``list_container_stats``,
``list_pod_sandbox_stats``) return. They are intercepted only while this node hosts shadows at all (``Fabric.
shadows.present``): on every other node they stay plain pass-through, at no
cost, which keeps kubelet's hottest polling path untouched.

The other way round, an origin's remote containers (ones it rerouted to a
host) belong to its kubelet's pods: ListContainers and ListContainerStats add
them, filtered as containerd filters its own, while the node has any.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim.cri.fabric import Fabric
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import stats_of
from shim.crishared.labels import ORIGIN_LABEL
from shim.crishared.mark import ShadowMark
from shim.crishared.remote import matches
from shim.errors import WeftError

# path -> (response type, repeated field, how to reach an item's labels, whether an item is a sandbox)
_VERBS: dict[str, tuple[Any, str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    "/runtime.v1.RuntimeService/ListPodSandbox": (
        cri.ListPodSandboxResponse, "items", lambda i: i.labels, lambda i: i.metadata.uid),
    "/runtime.v1.RuntimeService/ListContainers": (
        cri.ListContainersResponse, "containers", lambda i: i.labels, None),
    "/runtime.v1.RuntimeService/ListContainerStats": (
        cri.ListContainerStatsResponse, "stats", lambda i: i.attributes.labels, None),
    "/runtime.v1.RuntimeService/ListPodSandboxStats": (
        cri.ListPodSandboxStatsResponse, "stats", lambda i: i.attributes.labels, lambda i: i.attributes.metadata.uid),
}
PATHS = tuple(_VERBS)


def without_shadows(response: bytes, path: str, mark: ShadowMark | None = None) -> bytes:
    """The response with every shadow removed (pure): with ``mark``, what bears this host's mark; without,
    everything labelled as a shadow."""
    rtype, field, labels, uid = _VERBS[path]

    def shadow(item) -> bool:
        if ORIGIN_LABEL not in labels(item):
            return False
        if mark is None:
            return True
        return mark.is_sandbox(labels(item), uid(item)) if uid is not None else mark.is_container(labels(item))

    msg = rtype.FromString(response)
    items = getattr(msg, field)
    keep = [item for item in items if not shadow(item)]
    if len(keep) == len(items):
        return response
    kept = [type(item)() for item in keep]
    for dst, src in zip(kept, keep, strict=True):
        dst.CopyFrom(src)
    del items[:]
    items.extend(kept)
    return msg.SerializeToString()


_CONTAINERS = "/runtime.v1.RuntimeService/ListContainers"
_STATS = "/runtime.v1.RuntimeService/ListContainerStats"


def with_remotes(fabric: Fabric, path: str, request: bytes, response: bytes) -> bytes:
    """Add this node's remote containers that pass the request's filter (ListContainers and its stats)."""
    remotes = fabric.remotes.all()
    if not remotes or path not in (_CONTAINERS, _STATS):
        return response
    try:
        req = (cri.ListContainersRequest if path == _CONTAINERS else cri.ListContainerStatsRequest).FromString(request)
    except DecodeError:
        return response
    f = req.filter
    ids = fabric.remotes.resolve(f.id) if f.id else ()
    picked = [r for r in remotes if matches(r, f, ids)]
    if not picked:
        return response
    if path == _CONTAINERS:
        out = cri.ListContainersResponse.FromString(response)
        out.containers.extend(r.list_item() for r in picked)
    else:
        out = cri.ListContainerStatsResponse.FromString(response)
        for r in picked:
            try:
                out.stats.append(stats_of(fabric, r))
            except WeftError:  # a host away for a moment: its containers have no usage to show this time
                out.stats.add().attributes.CopyFrom(r.attributes())
    return out.SerializeToString()


def route_for(fabric: Fabric, path: str) -> Route:
    def hide(request: bytes, context: grpc.ServicerContext) -> bytes:
        response = fabric.upstream.unary(path, request, context)
        if fabric.shadows.present:
            response = without_shadows(response, path, fabric.shadows.mark)
        return with_remotes(fabric, path, request, response)

    return Route(hide, when=lambda: fabric.shadows.present or fabric.remotes.present)
