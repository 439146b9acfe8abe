"""GetContainerEvents: containerd's stream, a host's shadows left out, an origin's remote containers put in.

kubelet's evented PLEG holds this stream open and takes each event's pod
status as the whole truth about that pod: its containers are the event's
``containers_statuses`` and nothing else. So weft:

- passes containerd's events on, except those of this host's shadows
  (kubelet would take them for pods of its own);
- adds a pod's remote containers to every event of that pod, which
  containerd sends without them (kubelet would start them again);
- writes the events of remote containers themselves, created, started,
  stopped (exited, or lost with their host) and deleted, as containerd
  writes its own: the sandbox's status from containerd, every container of
  the pod, the time of the change;
- keeps each pod's event times rising in the order they are sent
  (``Rising``): kubelet drops an event older than the pod's last.

The stream lives as long as kubelet does, so whether it is weft's is decided
when kubelet opens it: on every node with a mesh (the only nodes that can
have remote containers or shadows); elsewhere it passes through untouched.
containerd's own error (UNIMPLEMENTED on 1.6) ends it as it would without
weft, and kubelet falls back to relisting.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import DecodeError

from shim import log
from shim.cri.fabric import Fabric
from shim.cri.passthrough import Within
from shim.cri.route import Route
from shim.cri.verbs.remote_calls import with_remote_statuses
from shim.crishared.labels import ORIGIN_LABEL
from shim.crishared.remote import Remote
from shim.errors import UpstreamError, WeftError

PATH = "/runtime.v1.RuntimeService/GetContainerEvents"
_SANDBOX_STATUS = "/runtime.v1.RuntimeService/PodSandboxStatus"
_LIST = "/runtime.v1.RuntimeService/ListContainers"
_STATUS = "/runtime.v1.RuntimeService/ContainerStatus"
STATUS_TIMEOUT_S = 5.0
_END = object()
_log = log.get("weft.cri")


def route(fabric: Fabric) -> Route:
    return Route(None, when=lambda: fabric.mesh is not None, stream=lambda req, ctx, emit: events(fabric, req, ctx,
                                                                                                     emit))


def events(fabric: Fabric, request: bytes, context, emit: Callable[[bytes], None]) -> None:
    q: queue.SimpleQueue = queue.SimpleQueue()
    stamps = Rising()
    stop_listening = upstream = None
    try:
        stop_listening = fabric.remotes.listen(lambda r, kind: q.put((r, kind, time.time_ns())))
        upstream = fabric.upstream.server_stream(PATH, request, context)
        if not context.add_callback(lambda: q.put(_END)):
            return  # kubelet went away before the stream began

        def read() -> None:
            try:
                for message in upstream:
                    q.put(message)
                q.put(_END)
            except WeftError as exc:
                q.put(exc)
            except Exception as exc:  # noqa: BLE001 - the stream ends with the error, not silently
                q.put(WeftError(f"weft: containerd's container events failed: {exc!r}"))

        threading.Thread(target=read, name="weft-cri-events-upstream", daemon=True).start()
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, WeftError):
                raise item
            if isinstance(item, bytes):
                out = passed_on(fabric, item, stamps)
            else:
                out = remote_event(fabric, *item, stamps=stamps)
            if out is not None:
                emit(out)
    finally:
        if stop_listening is not None:
            stop_listening()
        if upstream is not None:
            upstream.cancel()


class Rising:
    """Each pod's events leave with rising times, in the order they are sent.

    kubelet keeps a pod's newest status and drops an event older than it,
    with the lifecycle event it would have raised; weft's events are stamped
    by this agent when a remote container changes, containerd's by containerd
    when it writes them, so one may be sent after a newer one. Such an event
    is sent a nanosecond after the pod's last (its status is as fresh: the
    remote containers in it are read as it is sent). The pods seen last are
    kept, a bounded number.
    """

    LIMIT = 4096

    def __init__(self) -> None:
        self._last: OrderedDict[str, int] = OrderedDict()

    def keep(self, event: cri.ContainerEventResponse) -> bool:
        """Stamp ``event`` after its pod's last event if it is older; whether it changed."""
        pod = event.pod_sandbox_status.metadata.uid
        if not pod:
            return False
        last = self._last.pop(pod, 0)
        changed = event.created_at < last
        if changed:
            event.created_at = last + 1
        self._last[pod] = event.created_at
        if len(self._last) > self.LIMIT:
            self._last.popitem(last=False)
        return changed


def is_shadow(fabric: Fabric, sandbox: cri.PodSandboxStatus) -> bool:
    """Whether this host made the sandbox as a shadow (as the list verbs hide them)."""
    if ORIGIN_LABEL not in sandbox.labels:
        return False
    mark = fabric.shadows.mark
    return mark is None or mark.is_sandbox(sandbox.labels, sandbox.metadata.uid)


def passed_on(fabric: Fabric, message: bytes, stamps: Rising) -> bytes | None:
    """containerd's event as kubelet gets it: None for a shadow's, with the pod's remote containers added
    (byte for byte where weft adds nothing)."""
    try:
        event = cri.ContainerEventResponse.FromString(message)
    except DecodeError:
        return message
    sandbox = event.pod_sandbox_status
    if fabric.shadows.present and is_shadow(fabric, sandbox):
        return None
    added = fabric.remotes.present and with_remote_statuses(fabric, sandbox.id, event.containers_statuses)
    restamped = stamps.keep(event)
    return event.SerializeToString() if added or restamped else message


def remote_event(fabric: Fabric, r: Remote, kind: int, at_ns: int, *, stamps: Rising) -> bytes | None:
    """The event containerd would send for this change of a remote container; None once its pod is gone."""
    try:
        sandbox = cri.PodSandboxStatusResponse.FromString(fabric.upstream.unary(
            _SANDBOX_STATUS, cri.PodSandboxStatusRequest(pod_sandbox_id=r.sandbox_id).SerializeToString(),
            Within(STATUS_TIMEOUT_S)))
        event = cri.ContainerEventResponse(container_id=r.id, container_event_type=kind, created_at=at_ns)
        event.pod_sandbox_status.CopyFrom(sandbox.status)
        # containerd's PodSandboxStatus leaves the pod's containers out (its events list them): ask for each.
        event.containers_statuses.extend(local_statuses(fabric, r.sandbox_id))
    except UpstreamError as exc:
        _log.debug("events.remote_skipped", container_id=r.id, sandbox_id=r.sandbox_id, error=exc.message)
        return None
    with_remote_statuses(fabric, r.sandbox_id, event.containers_statuses)
    stamps.keep(event)
    return event.SerializeToString()


def local_statuses(fabric: Fabric, sandbox_id: str) -> list[cri.ContainerStatus]:
    listed = cri.ListContainersResponse.FromString(fabric.upstream.unary(
        _LIST, cri.ListContainersRequest(filter=cri.ContainerFilter(pod_sandbox_id=sandbox_id)).SerializeToString(),
        Within(STATUS_TIMEOUT_S)))
    out = []
    for c in listed.containers:
        try:
            out.append(cri.ContainerStatusResponse.FromString(fabric.upstream.unary(
                _STATUS, cri.ContainerStatusRequest(container_id=c.id).SerializeToString(),
                Within(STATUS_TIMEOUT_S))).status)
        except UpstreamError:  # removed meanwhile
            continue
    return out
