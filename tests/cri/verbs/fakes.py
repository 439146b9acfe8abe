"""What the verb tests stand the verbs on: a recording containerd, a host behind a fake mesh, and kubelet's objects.

- ``RecordingContainerd`` is a real gRPC server on a unix socket that records
  every call (method, exact request bytes, metadata) and answers as a test
  scripts it, an empty message by default. The verbs reach it through the
  real ``shim.cri.passthrough.Upstream`` (the one the agent uses, which some
  verbs also use through its raw channel), so "passed to containerd
  unchanged" is checked on the bytes that crossed a socket.
- ``FakeHost`` is one peer node as the ``shim.mesh.client.PeerClient``
  interface shows it (``test_remote_calls`` keeps the two in step); ``FakeMesh``
  is this node's mesh with those hosts. The host's own side has its tests in
  ``tests/shadowhost``; here only what the origin makes of its answers counts.
- ``add_remote`` records a container rerouted to a host the way placement
  does (a created remote placement in the real state store) and loads it
  back as a restarted agent would.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from cri_api.v1 import api_pb2 as cri
from google.protobuf.message import Message

from shim._pb import mesh_pb2 as mpb
from shim.core.placement import PlacementState
from shim.core.reroute import PeerView, Resources
from shim.cri.fabric import Fabric
from shim.cri.relay.context import RelayContext
from shim.crishared.labels import ORIGIN_LABEL
from shim.crishared.remote import Remote, new_id
from shim.state.agent import PlacementRecord, SandboxRecord

ORIGIN = "gpu-1"  # this node
HOST = "cpu-1"  # the peer that hosts its remote containers
SANDBOX = "5b" * 32  # an opted-in pod's sandbox, as containerd names it
LOCAL_ID = "1c" * 32  # a container weft does not know: containerd's own
OTHER_SANDBOX = "07" * 32  # another pod's sandbox: not the opted-in SANDBOX
STREAMING_VERBS = frozenset({"GetContainerEvents"})
StreamEnd = object()  # put in ``RecordingContainerd.streamed[verb]``: containerd ends that call with OK
IMAGE_SERVICE_VERBS = frozenset({"PullImage", "ListImages", "ImageStatus", "RemoveImage", "ImageFsInfo"})
GI = 1 << 30


def path_of(verb: str) -> str:
    service = "ImageService" if verb in IMAGE_SERVICE_VERBS else "RuntimeService"
    return f"/runtime.v1.{service}/{verb}"


def ctx(*metadata: tuple[str, str]) -> RelayContext:
    """The servicer context the relay gives an intercepted handler (no deadline unless a test sets one)."""
    return RelayContext(list(metadata), None)


# -- containerd ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    verb: str  # "RunPodSandbox"
    path: str  # "/runtime.v1.RuntimeService/RunPodSandbox"
    request: bytes  # exactly what arrived
    metadata: dict[str, str | bytes]


@dataclass(frozen=True)
class Refusal:
    code: grpc.StatusCode
    details: str


Answer = bytes | Message | Refusal | Callable[[bytes], "bytes | Message | Refusal"]


class RecordingContainerd:
    """containerd as the verbs see it: a gRPC server on a unix socket that records each call and answers as told."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.calls: list[Call] = []
        self._answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        # A streaming verb's messages, as a test puts them (``StreamEnd`` or a ``Refusal`` ends the call).
        self.streamed: dict[str, queue.Queue] = {v: queue.Queue() for v in STREAMING_VERBS}
        self.streams_open: dict[str, int] = dict.fromkeys(STREAMING_VERBS, 0)
        outer = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
                method = details.method  # type: ignore[attr-defined]
                if method.rsplit("/", 1)[-1] in STREAMING_VERBS:
                    return grpc.unary_stream_rpc_method_handler(lambda req, c: outer._stream(method, req, c))
                return grpc.unary_unary_rpc_method_handler(lambda req, c: outer._unary(method, req, c))

        self._pool = ThreadPoolExecutor(4, thread_name_prefix="fake-containerd")
        self._server = grpc.server(self._pool, handlers=[Handler()])
        self._server.add_insecure_port(f"unix:{socket}")
        self._server.start()

    def close(self) -> None:
        self._server.stop(0).wait()
        self._pool.shutdown(wait=True)

    # -- scripting ----------------------------------------------------------------------------
    def answer(self, verb: str, response: Answer) -> None:
        """What containerd answers ``verb`` from now on: a message, bytes, a refusal, or a function of the request."""
        with self._lock:
            self._answers[verb] = response

    def refuse(self, verb: str, code: grpc.StatusCode, details: str = "containerd says no") -> None:
        self.answer(verb, Refusal(code, details))

    # -- what it saw --------------------------------------------------------------------------
    def verbs(self) -> list[str]:
        with self._lock:
            return [c.verb for c in self.calls]

    def requests(self, verb: str) -> list[bytes]:
        with self._lock:
            return [c.request for c in self.calls if c.verb == verb]

    def only_request(self, verb: str) -> bytes:
        """The one request containerd got, which must be a ``verb``."""
        assert self.verbs() == [verb], f"containerd got {self.verbs()}, not one {verb}"
        return self.calls[0].request

    def _stream(self, path: str, request: bytes, context: grpc.ServicerContext):
        verb = path.rsplit("/", 1)[-1]
        with self._lock:
            self.calls.append(Call(verb, path, request, dict(context.invocation_metadata())))
            self.streams_open[verb] += 1
        source = self.streamed[verb]
        try:
            while context.is_active():
                try:
                    item = source.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is StreamEnd:
                    return
                if isinstance(item, Refusal):
                    context.abort(item.code, item.details)
                yield item.SerializeToString() if isinstance(item, Message) else item
        finally:
            with self._lock:
                self.streams_open[verb] -= 1

    def _unary(self, path: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        verb = path.rsplit("/", 1)[-1]
        with self._lock:
            self.calls.append(Call(verb, path, request, dict(context.invocation_metadata())))
            answer = self._answers.get(verb, b"")
        if callable(answer) and not isinstance(answer, Message):
            answer = answer(request)
        if isinstance(answer, Refusal):
            context.abort(answer.code, answer.details)
        return answer.SerializeToString() if isinstance(answer, Message) else answer


# -- the mesh -----------------------------------------------------------------------------------
class FakeHost:
    """One peer as ``PeerClient`` shows it: records each call and answers as scripted.

    ``answers`` maps a method (``StartShadow``, ``ShadowStatus``,
    ``RemoveShadow``, ``Admit``, ``RunShadow``, or a ShadowCall method such as
    ``ExecSync``) to its answer, or to a ``WeftError`` to raise.
    """

    def __init__(self, node: str = HOST) -> None:
        self.node = node
        self.address = f"{node}.example:7443"
        self.calls: list[tuple[str, str, str]] = []  # (method, origin, key)
        self.requests: dict[str, list[bytes]] = {}  # ShadowCall method -> request bytes the host got
        self.timeouts: dict[str, list[float]] = {}
        self.answers: dict[str, Any] = {}
        # What the host's containerd holds for the shadow now (StartShadow and ShadowStatus answer it).
        self.status = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_RUNNING)

    def methods(self) -> list[str]:
        return [m for m, _, _ in self.calls]

    def _answer(self, method: str, default: Any) -> Any:
        answer = self.answers.get(method, default)
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _state(self, key: str) -> mpb.ShadowState:
        return mpb.ShadowState(key=key, shadow_sandbox_id="shadow-sb", shadow_container_id=self.status.id,
                               status=self.status.SerializeToString())

    # The PeerClient interface -------------------------------------------------------------------
    def start_shadow(self, origin: str, key: str) -> mpb.ShadowState:
        self.calls.append(("StartShadow", origin, key))
        return self._answer("StartShadow", None) or self._state(key)

    def shadow_status(self, origin: str, key: str) -> mpb.ShadowState:
        self.calls.append(("ShadowStatus", origin, key))
        return self._answer("ShadowStatus", None) or self._state(key)

    def remove_shadow(self, origin: str, key: str) -> bool:
        self.calls.append(("RemoveShadow", origin, key))
        return self._answer("RemoveShadow", True)

    def call(self, origin: str, key: str, method: str, request: bytes, timeout: float) -> bytes:
        self.calls.append((method, origin, key))
        self.requests.setdefault(method, []).append(request)
        self.timeouts.setdefault(method, []).append(timeout)
        answer = self._answer(method, b"")
        return answer.SerializeToString() if isinstance(answer, Message) else answer

    def admit(self, request: mpb.AdmitRequest) -> mpb.AdmitResponse:
        self.calls.append(("Admit", request.origin_node, ""))
        return self._answer("Admit", mpb.AdmitResponse(admitted=True, reason="admitted"))

    def run_shadow(self, request: mpb.RunShadowRequest, timeout: float = 300.0) -> mpb.ShadowState:
        self.calls.append(("RunShadow", request.origin_node, request.key))
        created = cri.ContainerStatus(id="shadow-ctr", state=cri.CONTAINER_CREATED)
        return self._answer("RunShadow", mpb.ShadowState(
            key=request.key, shadow_sandbox_id="shadow-sb", shadow_container_id="shadow-ctr",
            status=created.SerializeToString()))


@dataclass
class FakeMeshServer:
    address: str = "10.0.0.1:7443"


@dataclass
class FakeMesh:
    """This node's mesh (``shim.mesh.node.MeshNode`` as the verbs use it), with scripted hosts."""

    hosts: dict[str, FakeHost] = field(default_factory=lambda: {HOST: FakeHost(HOST)})
    node: str = ORIGIN
    role: str = "gpu"
    draining: bool = False
    server: FakeMeshServer = field(default_factory=FakeMeshServer)

    def client(self, node: str) -> FakeHost | None:
        return self.hosts.get(node)

    def set_draining(self, on: bool) -> None:
        self.draining = on

    def status(self) -> list[dict[str, Any]]:
        return [{"node": n, "address": h.address, "role": "cpu", "healthy": True} for n, h in self.hosts.items()]

    def spread(self, pod: str) -> str:
        return ""  # a small fleet: ranked by room alone

    def unreachable(self, node: str, error: str) -> None:
        self.__dict__.setdefault("silent", []).append(node)

    def views(self) -> list[PeerView]:
        return [PeerView(n, True, True, Resources(4.0, 8 * GI), 0.1) for n in self.hosts]


class FakeStreams:
    """The origin's streaming relay: hands out its own URL for a session the host serves."""

    def __init__(self) -> None:
        self.sessions: list[tuple[str, str, str]] = []  # (kind, container id, host URL)

    def url(self, kind: str, r: Remote, host_url: str) -> str:
        self.sessions.append((kind, r.id, host_url))
        return f"http://10.0.0.1:10010/{kind}/token{len(self.sessions)}"


# -- kubelet's objects ----------------------------------------------------------------------------
def opt_in(fabric: Fabric, sandbox_id: str = SANDBOX, name: str = "infer", annotations: dict | None = None
           ) -> SandboxRecord:
    """A sandbox RunPodSandbox recorded as opted in (runtime handler ``weft``)."""
    rec = SandboxRecord(sandbox_id, name, "default", f"uid-{name}", "weft", True, dict(annotations or {}), time.time())
    fabric.remember(rec)
    return rec


def kubelet_config(name: str = "tokenize", attempt: int = 0, labels: dict | None = None) -> cri.ContainerConfig:
    return cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=attempt), image=cri.ImageSpec(image="busybox:1.36"),
        labels={"io.kubernetes.container.name": name, "io.kubernetes.pod.name": "infer", **(labels or {})},
        annotations={"io.kubernetes.container.restartCount": str(attempt),
                     "weft.io/placement": f"remote:{HOST}", "weft.io/placement-reason": "rerouted"},
        log_path=f"{name}/{attempt}.log")


def shadow_status(state: int = cri.CONTAINER_RUNNING, exit_code: int = 0) -> cri.ContainerStatus:
    """What the host's containerd says of a shadow: its own ID, labels and names, which kubelet must never see."""
    return cri.ContainerStatus(
        id="shadow-ctr", state=state, created_at=1_000, started_at=2_000 if state != cri.CONTAINER_CREATED else 0,
        finished_at=3_000 if state == cri.CONTAINER_EXITED else 0, exit_code=exit_code,
        metadata=cri.ContainerMetadata(name="gpu-1_tokenize"), labels={ORIGIN_LABEL: ORIGIN},
        image_ref="docker.io/library/busybox@sha256:" + "ab" * 32, log_path="/var/log/weft/shadow.log")


def add_remote(fabric: Fabric, name: str = "tokenize", *, sandbox_id: str = SANDBOX, node: str = HOST,
               state: int = cri.CONTAINER_RUNNING, labels: dict | None = None) -> Remote:
    """A container of an opted-in pod that runs on ``node`` under a virtual ID, as placement leaves it."""
    if sandbox_id not in fabric.opted_in:
        opt_in(fabric, sandbox_id)
    config = kubelet_config(name, labels=labels)
    vid = new_id()
    key = f"{sandbox_id}/{name}/0"
    fabric.store.add_pending(PlacementRecord(
        key=key, container_id=vid, sandbox_id=sandbox_id, name=name, attempt=0, stage="cpu",
        stage_reason="no-gpu-request", stage_detail="no GPU", placement=f"remote:{node}", reason="rerouted",
        detail="", lease_id="", state=PlacementState.PENDING, created_at=time.time(), remote_node=node,
        config=config.SerializeToString(), log_path=f"/var/log/pods/infer/{name}/0.log"))
    fabric.store.mark_created(key, vid, sandbox_id_remote="shadow-sb", status=shadow_status(state).SerializeToString())
    record = fabric.store.placement(vid)
    assert record is not None
    remote = Remote.from_record(record)  # as a restarted agent loads it
    fabric.remotes.add(remote)
    return remote


def placed_local(fabric: Fabric, container_id: str, *, sandbox_id: str = SANDBOX, name: str = "app",
                 lease_id: str = "") -> PlacementRecord:
    """A container of an opted-in pod that weft placed on this node (CreateContainer finished)."""
    if sandbox_id not in fabric.opted_in:
        opt_in(fabric, sandbox_id)
    key = f"{sandbox_id}/{name}/0"
    gpu = bool(lease_id)
    fabric.store.add_pending(PlacementRecord(
        key=key, container_id=None, sandbox_id=sandbox_id, name=name, attempt=0, stage="gpu" if gpu else "cpu",
        stage_reason="gpu-device" if gpu else "no-gpu-request", stage_detail="", placement="local",
        reason="gpu-leased" if gpu else "no-mesh", detail="", lease_id=lease_id, state=PlacementState.PENDING,
        created_at=time.time()))
    fabric.store.mark_created(key, container_id)
    record = fabric.store.placement(container_id)
    assert record is not None
    return record


def lease_for(broker, sandbox_id: str = SANDBOX, name: str = "app") -> str:
    """A whole-GPU lease the real broker granted for a container of the pod; its ID."""
    return broker.acquire(key=f"{sandbox_id}/{name}/0", namespace="default", pod="infer", pod_uid="uid-infer",
                          container=name, sandbox_id=sandbox_id, memory_bytes=0, compute_percent=0, count=0,
                          allowed=()).lease_id
