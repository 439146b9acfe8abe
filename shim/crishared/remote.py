"""Remote containers as kubelet sees them: virtual IDs, answered from what the hosts push.

A CPU container the origin rerouted runs on a host as a shadow; kubelet knows
it only by the container ID the origin made up for it (``new_id``). This
module keeps those containers in memory (loaded from the state store, which
holds each one's kubelet config and the host's last status) and turns the
host's view into kubelet's: the shadow's state, exit code and timestamps,
with the labels, annotations, mounts and log path kubelet gave, the origin's
sandbox ID and the virtual container ID. ContainerStatus and ListContainers
of a remote container are answered from here, without a call to the host.

A container whose host has been silent for the loss timeout is reported
exited with reason ``WeftPeerLost`` (``mark_lost``); that verdict is final,
so kubelet restarts it per the pod's restartPolicy and the new attempt is
placed afresh.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cri_api.v1 import api_pb2 as cri

from shim.core.placement import PlacementState
from shim.errors import HostUnavailable
from shim.state.agent import AgentStore, PlacementRecord

if TYPE_CHECKING:
    from shim.mesh.client import PeerClient
    from shim.mesh.node import MeshNode

LOST_REASON = "WeftPeerLost"
# What a lost container's exit code is: the host's SIGKILL (by its fence), as far as the origin can tell.
LOST_EXIT_CODE = 137
REMOTE_PREFIX = "remote:"
# Images kubelet pulled, remembered for hosts' pulls (shim.cri.verbs.pull_image).
MAX_IMAGES = 512


def new_id() -> str:
    """A container ID in containerd's shape (64 hex digits) that no containerd will ever hand out."""
    return secrets.token_hex(32)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


@dataclass
class Remote:
    id: str  # the virtual ID kubelet knows
    key: str  # "<sandbox>/<name>/<attempt>": the shadow's key on the host
    node: str
    sandbox_id: str  # the origin's sandbox
    config: cri.ContainerConfig  # as kubelet gave it, with weft's placement annotations
    log_path: str  # kubelet's log file for it ("" when kubelet gave none)
    created_at: float
    status: cri.ContainerStatus | None = None  # the host's last, or the origin's verdict once lost
    shadow_sandbox_id: str = ""
    # Guards status changes against the threads that push them.
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def state(self) -> int:
        return self.status.state if self.status is not None else cri.CONTAINER_CREATED

    @property
    def lost(self) -> bool:
        """The origin's verdict (``mark_lost``), kept in the status it reports: containerd never gives this reason."""
        return self.status is not None and self.status.reason == LOST_REASON

    @property
    def exited(self) -> bool:
        return self.state == cri.CONTAINER_EXITED

    @classmethod
    def from_record(cls, rec: PlacementRecord) -> Remote:
        status = cri.ContainerStatus.FromString(rec.status) if rec.status else None
        return cls(id=rec.container_id or "", key=rec.key, node=rec.remote_node, sandbox_id=rec.sandbox_id,
                   config=cri.ContainerConfig.FromString(rec.config or b""), log_path=rec.log_path,
                   created_at=rec.created_at, status=status, shadow_sandbox_id=rec.sandbox_id_remote)

    # -- kubelet's view --------------------------------------------------------------
    def kubelet_status(self) -> cri.ContainerStatus:
        """ContainerStatus as containerd would give it for this container on the origin."""
        out = cri.ContainerStatus()
        host = self.status
        if host is not None:
            out.state = host.state
            out.created_at, out.started_at, out.finished_at = host.created_at, host.started_at, host.finished_at
            out.exit_code, out.reason, out.message = host.exit_code, host.reason, host.message
            out.image_ref = host.image_ref
            out.image_id = host.image_id
            if host.HasField("resources"):
                out.resources.CopyFrom(host.resources)
            if host.HasField("user"):
                out.user.CopyFrom(host.user)
        else:
            out.state = cri.CONTAINER_CREATED
            out.created_at = _ns(self.created_at)
        out.id = self.id
        out.metadata.CopyFrom(self.config.metadata)
        out.image.CopyFrom(self.config.image)
        out.labels.update(self.config.labels)
        out.annotations.update(self.config.annotations)
        out.mounts.extend(self.config.mounts)
        out.log_path = self.log_path
        return out

    def list_item(self) -> cri.Container:
        host = self.status
        item = cri.Container(id=self.id, pod_sandbox_id=self.sandbox_id, state=self.state,
                             created_at=host.created_at if host is not None else _ns(self.created_at),
                             image_ref=host.image_ref if host is not None else "")
        item.metadata.CopyFrom(self.config.metadata)
        item.image.CopyFrom(self.config.image)
        item.labels.update(self.config.labels)
        item.annotations.update(self.config.annotations)
        return item

    def attributes(self) -> cri.ContainerAttributes:
        attrs = cri.ContainerAttributes(id=self.id)
        attrs.metadata.CopyFrom(self.config.metadata)
        attrs.labels.update(self.config.labels)
        attrs.annotations.update(self.config.annotations)
        return attrs


def matches(r: Remote, f: cri.ContainerFilter | cri.ContainerStatsFilter, ids: Iterable[str] = ()) -> bool:
    """Whether ``r`` passes a ListContainers/ListContainerStats filter, as containerd applies it.

    containerd resolves an ID or sandbox ID filter that is a unique prefix
    first; ``ids`` are the full IDs the filter's ``id`` resolved to.
    """
    if f.id and r.id not in ids:
        return False
    if f.pod_sandbox_id and not r.sandbox_id.startswith(f.pod_sandbox_id):
        return False
    if isinstance(f, cri.ContainerFilter) and f.HasField("state") and f.state.state != r.state:
        return False
    return all(r.config.labels.get(k) == v for k, v in f.label_selector.items())


# What a remote container's change means to kubelet's evented PLEG (GetContainerEvents).
Listener = Callable[[Remote, int], None]  # (the container, a cri.ContainerEventType)


class RemoteContainers:
    """The origin's remote containers by virtual ID; safe to use from the CRI and supervisor threads.

    Each change kubelet would see as a container event, as containerd sends
    one (created, started, stopped, deleted), is told to the listeners
    (``listen``): the GetContainerEvents streams kubelet holds open.
    """

    def __init__(self, store: AgentStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._by_id: dict[str, Remote] = {}
        self._listeners: list[Listener] = []
        for rec in store.remote_placements():
            if rec.state is PlacementState.CREATED and rec.container_id:
                self._by_id[rec.container_id] = Remote.from_record(rec)

    @property
    def present(self) -> bool:
        return bool(self._by_id)

    def all(self) -> list[Remote]:
        with self._lock:
            return list(self._by_id.values())

    def get(self, container_id: str) -> Remote | None:
        """By full ID, or by a unique prefix of one (as containerd and crictl accept)."""
        if not container_id:
            return None
        r = self._by_id.get(container_id)
        if r is not None:
            return r
        with self._lock:
            found = [r for cid, r in self._by_id.items() if cid.startswith(container_id)]
        return found[0] if len(found) == 1 else None

    def resolve(self, prefix: str) -> list[str]:
        with self._lock:
            return [cid for cid in self._by_id if cid.startswith(prefix)]

    def listen(self, fn: Listener) -> Callable[[], None]:
        """Tell ``fn`` of every change from now on (on the thread that made it); returns how to stop."""
        with self._lock:
            self._listeners.append(fn)

        def stop() -> None:
            with self._lock:
                if fn in self._listeners:
                    self._listeners.remove(fn)

        return stop

    def _tell(self, r: Remote, event: int) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn(r, event)

    def add(self, r: Remote) -> None:
        with self._lock:
            self._by_id[r.id] = r
        self._tell(r, cri.CONTAINER_CREATED_EVENT)

    def drop(self, container_id: str) -> Remote | None:
        with self._lock:
            r = self._by_id.pop(container_id, None)
        if r is not None:
            self._tell(r, cri.CONTAINER_DELETED_EVENT)
        return r

    def on_node(self, node: str) -> list[Remote]:
        with self._lock:
            return [r for r in self._by_id.values() if r.node == node]

    def in_sandbox(self, sandbox_id: str) -> list[Remote]:
        with self._lock:
            return [r for r in self._by_id.values() if r.sandbox_id == sandbox_id]

    def by_key(self, node: str, key: str) -> Remote | None:
        with self._lock:
            return next((r for r in self._by_id.values() if r.node == node and r.key == key), None)

    # -- what the hosts push -----------------------------------------------------------
    def update(self, r: Remote, status: cri.ContainerStatus) -> bool:
        """Take the host's status; False (and nothing kept) once the origin declared the container lost."""
        with r.lock:
            if r.lost:
                return False
            old = r.status
            r.status = status
            changed = old is None or (old.state, old.exit_code, old.finished_at, old.started_at) != (
                status.state, status.exit_code, status.finished_at, status.started_at)
        if changed:
            self.store.set_status(r.id, status.SerializeToString())
        was = old.state if old is not None else cri.CONTAINER_CREATED
        if status.state != was and status.state == cri.CONTAINER_RUNNING:
            self._tell(r, cri.CONTAINER_STARTED_EVENT)
        elif status.state != was and status.state == cri.CONTAINER_EXITED:
            self._tell(r, cri.CONTAINER_STOPPED_EVENT)
        return True

    def mark_lost(self, r: Remote, silent_s: float, why: str = "") -> bool:
        """Report ``r`` exited with reason WeftPeerLost; False if it had exited or was lost already."""
        with r.lock:
            if r.lost or r.exited:
                return False
            status = cri.ContainerStatus()
            if r.status is not None:
                status.CopyFrom(r.status)
            else:
                status.created_at = _ns(r.created_at)
            status.state = cri.CONTAINER_EXITED
            status.exit_code = LOST_EXIT_CODE
            status.reason = LOST_REASON
            status.message = (f"weft: {why or f'host {r.node} has not been heard from for {silent_s:.0f} s'}; "
                              "the container was fenced there and is placed afresh when restarted")
            status.finished_at = _ns(time.time())
            r.status = status
        self.store.set_status(r.id, status.SerializeToString())
        self._tell(r, cri.CONTAINER_STOPPED_EVENT)
        return True


class PulledImages:
    """Image name and ID -> (a name a host can pull, the credentials kubelet used)."""

    def __init__(self, limit: int = MAX_IMAGES) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._by_ref: OrderedDict[str, tuple[str, cri.AuthConfig | None]] = OrderedDict()

    def remember(self, name: str, image_ref: str, auth: cri.AuthConfig | None) -> None:
        with self._lock:
            for ref in filter(None, (name, image_ref)):
                self._by_ref[ref] = (name, auth)
                self._by_ref.move_to_end(ref)
            while len(self._by_ref) > self._limit:
                self._by_ref.popitem(last=False)

    def lookup(self, ref: str) -> tuple[str, cri.AuthConfig | None] | None:
        with self._lock:
            return self._by_ref.get(ref)


def host_client(mesh: MeshNode | None, r: Remote) -> PeerClient:
    """The mesh client of the node that runs ``r``; HostUnavailable when that node is not a peer now."""
    client = mesh.client(r.node) if mesh is not None else None
    if client is None:
        raise HostUnavailable(f"weft: container {r.id[:13]} runs on {r.node}, which is not a peer of this node now")
    return client


class HostStream:
    """A thread's hold on one stream from a remote container's host (the origin's log copy, its stitch link).

    ``stop`` ends the thread's loop and cancels the stream in flight, so the
    thread sees it at once rather than at the stream's next message.
    """

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._call: Any = None  # the stream in flight, set by the thread

    def stop(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()


RemoteListener = Callable[[Remote], None]


@dataclass
class RemoteEvents:
    """Told when a remote container starts, when kubelet rotates its log and when it is removed: the supervisor
    copies its log from the host."""

    started: list[RemoteListener] = field(default_factory=list)
    reopened: list[RemoteListener] = field(default_factory=list)
    removed: list[RemoteListener] = field(default_factory=list)
