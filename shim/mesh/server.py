"""The mesh's server end: every agent answers its peers' Hello and Admit over mutual TLS.

TLS (``require_client_auth``) keeps out anyone without a certificate from the
cluster CA; ``PeerPolicy`` then keeps out CA-signed nodes this agent does not
know, and a peer that claims to speak for another node than its certificate
names. Only then is a Hello recorded (the last ``PeerState`` per node, which
placement reads) or an Admit answered. weft's typed errors become gRPC
statuses here, as in the broker's server.

Workers and the caps on each kind of call: ``shim.mesh.quotas``. Message sizes, each method's
request limit and the connection's keepalive, which the client shares: ``shim.mesh.wire``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from shim import log
from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.errors import ConfigError, WeftError
from shim.mesh import upload
from shim.mesh.capacity import CapacityProbe
from shim.mesh.certs import MeshTls, cert_nodes
from shim.mesh.hosting import Admit, ShadowHosting
from shim.mesh.identity import PeerPolicy, PeerRefused
from shim.mesh.quotas import CALL, HELLO, STREAM, WATCH, MeshLimits, PeerLimits
from shim.mesh.tlsreload import NodeTls, server_credentials
from shim.mesh.wire import (
    KEEPALIVE_OPTIONS,
    MAX_MESSAGE_BYTES,
    MAX_RESPONSE_BYTES,
    REQUEST_LIMITS,
    Oversized,
    deserializer,
)

_log = log.get("weft.mesh")


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
                 host: ShadowHosting | None = None, limits: MeshLimits | None = None) -> None:
        # ``host``: the parts that run shadows, each request handed to the one that answers it; None on a node
        # that hosts nothing.
        self.host = host
        self.node = node
        self.policy = policy
        self.probe = probe
        self._admit = admit or probe.admit
        self._lock = threading.Lock()
        self._peers: dict[str, pb.PeerState] = {}
        self.limits = PeerLimits(limits or MeshLimits())
        if host is not None:
            host.fence.in_contact = self.limits.active  # an origin with a call or stream open is heard from
            # RunShadow admits again, whatever the origin was told; so does an update that asks for more.
            host.lifecycle.admit = host.calls.admit = self._admit
            host.watcher.pulse.room = self._state  # pushed on the Watches of origins that no longer say Hello

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
            self.host.fence.touch(node)  # an origin that says Hello keeps its shadows from being fenced
        if not known:
            _log.info("peer.hello", peer=node, role=request.origin.role)
        return self._state()

    def _state(self) -> pb.PeerState:
        """This node's state, as Hello answers it."""
        state = self.probe.sample()
        state.node = self.node
        return state

    def _host(self, context, claimed: str, method: str):
        node = self.policy.check(context.auth_context())
        self.policy.check_claim(node, claimed, method)
        if self.host is None:
            raise PeerRefused(f"node {self.node} does not host containers", node=node)
        self.host.fence.touch(node)
        return node

    def _run(self, node: str, req: pb.RunShadowRequest) -> pb.ShadowState:
        # A sandbox alone is made ahead of its containers (sandbox_only); a container is the lifecycle's.
        if req.sandbox_only:
            return self.host.preparer.prepare(node, req)
        return self.host.lifecycle.run(node, req)

    @_mapped(CALL)
    def RunShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "RunShadow")
        return self._run(node, request)

    @_mapped_upload(CALL)
    def RunShadowChunked(self, requests, context):  # noqa: N802
        req = upload.first(requests, "run").run
        node = self._host(context, req.origin_node, "RunShadowChunked")
        with self.host.lifecycle.receiving(node, req.key, requests, req.volumes):  # its volumes read first
            return self._run(node, req)

    @_mapped(CALL)
    def StartShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "StartShadow")
        return self.host.lifecycle.start(node, request.key)

    @_mapped(CALL)
    def ShadowStatus(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "ShadowStatus")
        return self.host.lifecycle.status(node, request.key)

    @_mapped(CALL)
    def RemoveShadow(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "RemoveShadow")
        return pb.RemoveShadowResponse(removed=self.host.lifecycle.remove(node, request.key))

    @_mapped(CALL)
    def ShadowCall(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "ShadowCall")
        return self.host.calls.call(node, request)

    @_mapped(CALL)
    def SyncVolumes(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "SyncVolumes")
        return self.host.lifecycle.sync_volumes(node, request)

    @_mapped_upload(CALL)
    def SyncVolumesChunked(self, requests, context):  # noqa: N802
        req = upload.first(requests, "sync").sync
        node = self._host(context, req.origin_node, "SyncVolumesChunked")
        with self.host.lifecycle.receiving(node, req.key, requests, req.volumes):
            return self.host.lifecycle.sync_volumes(node, req)

    # The two streams: the checks run before the first message, and an error
    # after that ends the stream with its status as the unary calls do.
    @_mapped_stream(WATCH)
    def Watch(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "Watch")
        return self.host.watcher.watch(node, request, context)

    @_mapped_stream(STREAM)
    def StreamLog(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "StreamLog")
        return self.host.watcher.stream_log(node, request, context)

    @_mapped(CALL)
    def OpenTunnel(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "OpenTunnel")
        return self.host.calls.open_tunnel(node, request)

    @_mapped_stream(STREAM)
    def Stitch(self, request, context):  # noqa: N802
        node = self._host(context, request.origin_node, "Stitch")
        return self.host.calls.stitch(node, request, context)

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
        host: ShadowHosting | None = None,
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
                             request_deserializer=deserializer(m.name, getattr(pb, m.input_type.name),
                                                                REQUEST_LIMITS[m.name]),
                             response_serializer=lambda answer: answer.SerializeToString())
    return grpc.method_handlers_generic_handler(service.full_name, table)

def _copy(state: pb.PeerState) -> pb.PeerState:
    out = pb.PeerState()
    out.CopyFrom(state)
    return out
