"""The mesh's server end: every agent answers its peers' Hello and Admit over mutual TLS.

TLS (``require_client_auth``) keeps out anyone without a certificate from the
cluster CA; ``PeerPolicy`` then keeps out CA-signed nodes this agent does not
know, and a peer that claims to speak for another node than its certificate
names. Only then is a Hello recorded (the last ``PeerState`` per node, which
placement reads) or an Admit answered. weft's typed errors become gRPC
statuses here, as in the broker's server.

Workers: a server stream holds a worker thread for its life (a host keeps a
log stream and a stitch stream per hosted container, and a Watch per
origin). ``MeshLimits`` caps each kind of call, per peer and in all, and the
pool has a worker for every call the caps let in: streams, however many,
never take the workers Hello, Admit and Watch need, and one peer cannot take
another's. A call over its cap is RESOURCE_EXHAUSTED at once (``PeerBusy``).
A host counts an origin as heard from while any call or stream of it is open
here (the connection's keepalive ends them within seconds of a cut), not only
when one of its calls starts.

Message sizes: gRPC reads a request message whole before a handler runs, so
whatever a unary request may hold is read before the peer-list check. The
transport refuses a message over ``MAX_MESSAGE_BYTES`` from its length
prefix, without reading it (and with BDP probing off, its flow-control window
does not grow for one); each method then has a limit of its own
(``REQUEST_LIMITS``), checked before the request is parsed. Copied volumes,
the one thing that may be large, come in client streams of small parts
(``shim.mesh.upload``), whose handler checks the peer before reading any.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from shim import log
from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.config import STREAM_KEEPALIVE_S
from shim.errors import ConfigError, WeftError
from shim.mesh import upload
from shim.mesh.capacity import CapacityProbe
from shim.mesh.certs import MeshTls, cert_nodes
from shim.mesh.identity import PeerPolicy, PeerRefused
from shim.mesh.tlsreload import NodeTls, server_credentials

_log = log.get("weft.mesh")

Admit = Callable[[pb.AdmitRequest], pb.AdmitResponse]


class MessageTooLarge(WeftError):
    """A request larger than its method takes (``REQUEST_LIMITS``)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class PeerBusy(WeftError):
    """A peer has as many calls of a kind open here as it may, or this node serves all it can."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


# The kinds of call, each with its own caps and workers: Hello and Admit (quick, the liveness and placement
# path), Watch (one stream per origin with shadows here, held open: a host may serve hundreds of origins), the
# other unary calls (RunShadow may pull an image for minutes) and the per-container streams (StreamLog, Stitch).
HELLO, WATCH, CALL, STREAM = "hello", "watch", "call", "stream"


@dataclass(frozen=True)
class MeshLimits:
    """Concurrent calls of each kind: per peer, and in all (the pool has a worker for each)."""

    streams: int = 1024
    streams_per_peer: int = 768
    calls: int = 192
    calls_per_peer: int = 32
    hellos: int = 128  # Hello and Admit
    hellos_per_peer: int = 4
    watches: int = 2048  # origins whose Watch a host serves at once
    watches_per_peer: int = 2

    def per_peer(self, kind: str) -> int:
        return {HELLO: self.hellos_per_peer, WATCH: self.watches_per_peer, CALL: self.calls_per_peer,
                STREAM: self.streams_per_peer}[kind]

    def total(self, kind: str) -> int:
        return {HELLO: self.hellos, WATCH: self.watches, CALL: self.calls, STREAM: self.streams}[kind]

    @property
    def workers(self) -> int:
        return self.streams + self.calls + self.hellos + self.watches


class PeerLimits:
    """What each peer has open now, held against ``MeshLimits``; which peers have anything open."""

    def __init__(self, limits: MeshLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open: Counter[tuple[str, str]] = Counter()  # (node or "", kind) -> open now; "" counts all
        self._active: Counter[str] = Counter()  # node -> its calls and streams open now

    @contextlib.contextmanager
    def hold(self, node: str, kind: str, method: str) -> Iterator[None]:
        pool = kind
        with self._lock:
            if self._open[(node, kind)] >= self.limits.per_peer(kind):
                raise PeerBusy(f"{node} has {self._open[(node, kind)]} {kind} calls open here, the most a peer "
                               f"may; {method} refused")
            if self._open[("", pool)] >= self.limits.total(kind):
                raise PeerBusy(f"this node serves {self._open[('', pool)]} {pool} calls, the most it may; "
                               f"{method} from {node} refused")
            self._open[(node, kind)] += 1
            self._open[("", pool)] += 1
            self._active[node] += 1
        try:
            yield
        finally:
            with self._lock:
                self._open[(node, kind)] -= 1
                self._open[("", pool)] -= 1
                self._active[node] -= 1

    def active(self, node: str) -> bool:
        """Whether ``node`` has a call or stream open here: its connection is alive (keepalive ends them
        otherwise)."""
        with self._lock:
            return self._active[node] > 0

    def open_now(self) -> dict[str, int]:
        with self._lock:
            return {kind: n for (node, kind), n in self._open.items() if not node}


@dataclass(frozen=True)
class Oversized:
    """What a request over its method's limit is handed to the handler as, unparsed: refused after the peer's
    checks, so a stranger is told it is a stranger."""

    method: str
    size: int
    limit: int

    def refuse(self) -> MessageTooLarge:
        return MessageTooLarge(f"{self.method}: a message of {self.size} bytes, over the {self.limit} this host "
                               f"takes for it")


def _checked(request: Any) -> Any:
    if isinstance(request, Oversized):
        raise request.refuse()
    return request


def _parts(requests: Iterator[Any]) -> Iterator[Any]:
    """A client stream's messages, a message over its method's limit refused as it comes."""
    for request in requests:
        yield _checked(request)


def _abort(method: str, exc: WeftError, context) -> None:
    """weft's typed error as the call's gRPC status; a refused peer is also logged."""
    if isinstance(exc, PeerRefused):
        _log.warning("peer.refused", method=method, peer=context.peer(), node=exc.node, detail=exc.message)
    context.abort(exc.code, exc.message)


def _mapped(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(self, request, context):
            try:
                node = self.policy.check(context.auth_context())  # who it is, before anything else
                with self.limits.hold(node, kind, fn.__name__):
                    return fn(self, _checked(request), context)
            except WeftError as exc:
                _abort(fn.__name__, exc, context)

        handler.__name__ = fn.__name__
        return handler

    return wrap


def _mapped_upload(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A client stream: gRPC calls the handler before reading any message, so the peer is checked (and
    its call counted) before the first part is read."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(self, requests, context):
            try:
                node = self.policy.check(context.auth_context())
                with self.limits.hold(node, kind, fn.__name__):
                    return fn(self, _parts(requests), context)
            except WeftError as exc:
                _abort(fn.__name__, exc, context)

        handler.__name__ = fn.__name__
        return handler

    return wrap


def _mapped_stream(kind: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def handler(self, request, context):
            try:
                node = self.policy.check(context.auth_context())
                with self.limits.hold(node, kind, fn.__name__):
                    yield from fn(self, _checked(request), context)
            except WeftError as exc:
                _abort(fn.__name__, exc, context)

        handler.__name__ = fn.__name__
        return handler

    return wrap


class MeshServicer(pb_grpc.MeshServicer):
    def __init__(self, node: str, policy: PeerPolicy, probe: CapacityProbe, admit: Admit | None = None,
                 host: Any = None, limits: MeshLimits | None = None) -> None:
        # ``host`` runs shadows (``shim.cri.host.shadows.ShadowHost``); None on a node that hosts nothing.
        self.host = host
        self.node = node
        self.policy = policy
        self.probe = probe
        self._admit = admit or probe.admit
        self._lock = threading.Lock()
        self._peers: dict[str, pb.PeerState] = {}
        self.limits = PeerLimits(limits or MeshLimits())
        if host is not None:
            host.in_contact = self.limits.active  # an origin with a call or stream open is heard from
            host.admit = self._admit  # RunShadow admits again, whatever the origin was told

    def peer_states(self) -> dict[str, pb.PeerState]:
        """The last state each peer reported in its Hello (copies)."""
        with self._lock:
            return {node: _copy(state) for node, state in self._peers.items()}

    @_mapped(HELLO)
    def Hello(self, request, context):  # noqa: N802 - gRPC method names
        node = self.policy.check(context.auth_context())
        self.policy.check_claim(node, request.origin.node, "Hello")
        with self._lock:
            known = node in self._peers
            self._peers[node] = _copy(request.origin)
        if self.host is not None:
            self.host.touch(node)  # an origin that says Hello keeps its shadows from being fenced
        if not known:
            _log.info("peer.hello", peer=node, role=request.origin.role)
        state = self.probe.sample()
        state.node = self.node
        return state

    def _host(self, context, claimed: str, method: str):
        node = self.policy.check(context.auth_context())
        self.policy.check_claim(node, claimed, method)
        if self.host is None:
            raise PeerRefused(f"node {self.node} does not host containers", node=node)
        self.host.touch(node)
        return node

    @_mapped(CALL)
    def RunShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "RunShadow")
        return self.host.run(node, request)

    @_mapped_upload(CALL)
    def RunShadowChunked(self, requests, context):  # noqa: N802
        req = upload.first(requests, "run").run
        node = self._host(context, req.origin_node, "RunShadowChunked")
        return self.host.run_chunked(node, req, requests)

    @_mapped(CALL)
    def StartShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "StartShadow")
        return self.host.start(node, request.key)

    @_mapped(CALL)
    def ShadowStatus(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "ShadowStatus")
        return self.host.status(node, request.key)

    @_mapped(CALL)
    def RemoveShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "RemoveShadow")
        return pb.RemoveShadowResponse(removed=self.host.remove(node, request.key))

    @_mapped(CALL)
    def ShadowCall(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "ShadowCall")
        return self.host.call(node, request)

    @_mapped(CALL)
    def SyncVolumes(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "SyncVolumes")
        return self.host.sync_volumes(node, request)

    @_mapped_upload(CALL)
    def SyncVolumesChunked(self, requests, context):  # noqa: N802
        req = upload.first(requests, "sync").sync
        node = self._host(context, req.origin_node, "SyncVolumesChunked")
        return self.host.sync_volumes_chunked(node, req, requests)

    # The two streams: the checks run before the first message, and an error
    # after that ends the stream with its status as the unary calls do.
    @_mapped_stream(WATCH)
    def Watch(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "Watch")
        return self.host.watch(node, request, context)

    @_mapped_stream(STREAM)
    def StreamLog(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "StreamLog")
        return self.host.stream_log(node, request, context)

    @_mapped(CALL)
    def OpenTunnel(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "OpenTunnel")
        return self.host.open_tunnel(node, request)

    @_mapped_stream(STREAM)
    def Stitch(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "Stitch")
        return self.host.stitch(node, request, context)

    @_mapped(HELLO)
    def Admit(self, request, context):  # noqa: N802
        node = self.policy.check(context.auth_context())
        self.policy.check_claim(node, request.origin_node, "Admit")
        answer = self._admit(request)
        _log.info("peer.admit", peer=node, key=request.key, admitted=answer.admitted, reason=answer.reason,
                  cpu_limit=request.limits.cpu_cores, memory_limit=request.limits.memory_bytes)
        return answer


class MeshServer:
    """Serves the mesh on ``address`` (``HOST:PORT``; port 0 picks one, read ``.port`` after ``start``)."""

    def __init__(
        self,
        node: str,
        address: str,
        tls: MeshTls | NodeTls | tuple[bytes, bytes, bytes],
        policy: PeerPolicy,
        probe: CapacityProbe,
        admit: Admit | None = None,
        *,
        limits: MeshLimits | None = None,
        host: Any = None,
    ) -> None:
        _key, cert_pem, _ca = tls
        # Peers dial us by node name and check that our certificate names it;
        # serving another node's certificate would only fail there, obscurely.
        if node not in cert_nodes(cert_pem):
            raise ConfigError(f"mesh certificate names {cert_nodes(cert_pem)}, but this node is {node!r}")
        self.node = node
        self.address = address
        self.port: int | None = None
        limits = limits or MeshLimits()
        self.servicer = MeshServicer(node, policy, probe, admit, host=host, limits=limits)
        # A NodeTls hands a renewed certificate to every new connection (shim.mesh.tlsreload).
        self._credentials = server_credentials(tls)
        # A worker for every call the limits let in (threads start as calls need them), so that a call
        # admitted is never queued behind streams.
        self._server = grpc.server(ThreadPoolExecutor(max_workers=limits.workers, thread_name_prefix="weft-mesh"),
                                   options=(*KEEPALIVE_OPTIONS,
                                            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                            ("grpc.max_send_message_length", MAX_RESPONSE_BYTES),
                                            # BDP probing widens a connection's window while a large message
                                            # comes in, so the transport buffers megabytes of a message it will
                                            # refuse; the window then stays what a message under the limit needs.
                                            ("grpc.http2.bdp_probe", 0)))
        self._server.add_generic_rpc_handlers((handlers(self.servicer),))

    def start(self) -> None:
        try:
            port = self._server.add_secure_port(self.address, self._credentials)
        except RuntimeError as exc:
            raise WeftError(f"could not bind the mesh address {self.address}: {exc}") from exc
        if port == 0:
            raise WeftError(f"could not bind the mesh address {self.address}")
        self.port = port
        self._server.start()
        _log.info("mesh.serving", node=self.node, address=self.address, port=port)

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait()

    def __enter__(self) -> MeshServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# The largest request the mesh reads. The largest unary request is a RunShadow without volumes: kubelet's
# sandbox and container configs, whose environment and arguments must fit the kernel's ARG_MAX (2 MiB with the
# default stack) for the container to start at all, and whose annotations the API server holds to 256 KiB.
# Copied volumes, which may be larger, come in parts (shim.mesh.upload).
MAX_MESSAGE_BYTES = 4 << 20
# The largest answer: a ShadowCall carries the host's containerd's response, which containerd sends up to
# 16 MiB (its default max_send_message_size, and kubelet's CRI client reads no more), in a small wrapper.
MAX_RESPONSE_BYTES = (16 << 20) + (64 << 10)
# Requests that are small by nature are held to less than MAX_MESSAGE_BYTES: a Watch lists the keys of an
# origin's shadows here, a Stitch a pod's ports.
SMALL_REQUEST_BYTES = 256 << 10
REQUEST_LIMITS = {
    "Hello": SMALL_REQUEST_BYTES,
    "Admit": SMALL_REQUEST_BYTES,
    "RunShadow": MAX_MESSAGE_BYTES,
    "RunShadowChunked": MAX_MESSAGE_BYTES,  # the first part is a RunShadow; the rest hold 1 MiB of data each
    "StartShadow": SMALL_REQUEST_BYTES,
    "ShadowStatus": SMALL_REQUEST_BYTES,
    "RemoveShadow": SMALL_REQUEST_BYTES,
    "Watch": 1 << 20,
    "ShadowCall": MAX_MESSAGE_BYTES,  # kubelet's request: an ExecSync's command, an update's resources
    "StreamLog": SMALL_REQUEST_BYTES,
    "SyncVolumes": MAX_MESSAGE_BYTES,  # with volumes from an older origin only
    "SyncVolumesChunked": (1 << 20) + SMALL_REQUEST_BYTES,
    "OpenTunnel": SMALL_REQUEST_BYTES,
    "Stitch": 1 << 20,
}


def _deserializer(method: str, message: Any, limit: int) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        return Oversized(method, len(data), limit) if len(data) > limit else message.FromString(data)

    return parse


def handlers(servicer: MeshServicer) -> grpc.GenericRpcHandler:
    """The Mesh service's methods (as the generated ``add_MeshServicer_to_server`` makes them), each request
    held to its method's limit in ``REQUEST_LIMITS``."""
    service = pb.DESCRIPTOR.services_by_name["Mesh"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    table = {}
    for m in service.methods:
        make = kinds[(m.client_streaming, m.server_streaming)]
        table[m.name] = make(getattr(servicer, m.name),
                             request_deserializer=_deserializer(m.name, getattr(pb, m.input_type.name),
                                                                REQUEST_LIMITS[m.name]),
                             response_serializer=lambda answer: answer.SerializeToString())
    return grpc.method_handlers_generic_handler(service.full_name, table)

# A cut link must end the streams on both sides within seconds, not after TCP's own timeouts. Pings go only
# while a call or stream is open: an idle connection (a candidate host between Hellos, of thousands) costs
# nothing, and a call on one that died fails by its deadline.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", int(STREAM_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(STREAM_KEEPALIVE_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_pings_without_data", 0),
)


def _copy(state: pb.PeerState) -> pb.PeerState:
    out = pb.PeerState()
    out.CopyFrom(state)
    return out
