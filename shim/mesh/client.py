"""The mesh's client end: one agent dialling one peer, by that peer's node name.

The channel verifies the server's certificate against the cluster CA *and*
against the node we meant to dial (``grpc.ssl_target_name_override``): an
address that now belongs to another node, or a stale entry in discovery, is a
failed connection rather than a conversation with the wrong peer. Calls carry
short deadlines because placement waits on them and running locally is always
a valid fallback: a slow peer is treated as an absent one.

gRPC failures become two typed errors: ``PeerUnavailable`` (no answer, TLS
failed, deadline passed; try the next peer) and ``PeerRefused`` (the peer
answered that it will not deal with us).

Copied volumes go in parts (``RunShadowChunked``, ``SyncVolumesChunked``;
``shim.mesh.upload``). A host of a weft from before those methods answers
UNIMPLEMENTED, and then gets the volumes in the request itself, as it used
to, while that fits the mesh's message limit.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import grpc

from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.errors import WeftError
from shim.mesh import upload
from shim.mesh.certs import MeshTls
from shim.mesh.identity import PeerRefused
from shim.mesh.tlsreload import generation_of
from shim.mesh.wire import KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES, MAX_RESPONSE_BYTES

HELLO_TIMEOUT_S = 2.0
ADMIT_TIMEOUT_S = 2.0

_REFUSALS = frozenset({grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED})

T = TypeVar("T")


class PeerUnavailable(WeftError):
    """The peer did not answer: unreachable, TLS handshake failed, or past the deadline."""

    code = grpc.StatusCode.UNAVAILABLE

    def __init__(self, message: str, *, node: str, status: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.node = node
        self.status = status


class PeerTooOld(WeftError):
    """The peer runs a weft from before what this call needs (copied volumes in parts), and the request does not
    fit the way it takes them."""

    code = grpc.StatusCode.FAILED_PRECONDITION


# Creating a shadow may pull an image: minutes, not the seconds of a Hello.
SHADOW_TIMEOUT_S = 300.0


class PeerClient:
    def __init__(
        self,
        node: str,
        address: str,
        tls: MeshTls | tuple[bytes, bytes, bytes],
        *,
        hello_timeout: float = HELLO_TIMEOUT_S,
        admit_timeout: float = ADMIT_TIMEOUT_S,
    ) -> None:
        self.node = node
        self.address = address
        self.hello_timeout = hello_timeout
        self.admit_timeout = admit_timeout
        self._tls = tls
        # The channel is made on first use and may be let go when idle (``release``): a node of a large fleet
        # holds connections only to the peers it has business with. The next call makes it again.
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub_: pb_grpc.MeshStub | None = None
        self._generation = 0  # of this node's TLS when the channel was opened (shim.mesh.tlsreload)
        self._closed = False
        self._calls = 0  # unary calls in flight
        self._streams = 0  # streams open (Watch included)
        self._business = 0  # streams open other than Watch
        self.last_used = time.monotonic()
        # Told of every Admit answered (request, answer): the mesh node learns a peer's room from it.
        self.on_admit: Callable[[str, pb.AdmitRequest, pb.AdmitResponse], None] | None = None

    def _open(self) -> pb_grpc.MeshStub:
        key_pem, cert_pem, ca_pem = self._tls
        self._generation = generation_of(self._tls)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)
        self._channel = grpc.secure_channel(self.address, credentials, options=[
            ("grpc.ssl_target_name_override", self.node),
            # A peer that restarts should be found again within a Hello period or two,
            # not after gRPC's default two-minute backoff.
            ("grpc.max_reconnect_backoff_ms", 5000),
            ("grpc.max_receive_message_length", MAX_RESPONSE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *KEEPALIVE_OPTIONS,
        ])
        return pb_grpc.MeshStub(self._channel)

    def _acquire(self, *, calls: int = 0, streams: int = 0, business: int = 0) -> pb_grpc.MeshStub:
        """The stub (the channel made if need be), counting what is about to use it, in one step: a
        ``release`` never closes a channel a call has been handed."""
        with self._lock:
            if self._closed:
                raise PeerUnavailable(f"the client of peer {self.node} is closed (no longer a peer)", node=self.node)
            if self._stub_ is not None and generation_of(self._tls) != self._generation:
                # This node's certificate was renewed: new calls go on a new channel, which presents it (a channel
                # reconnecting with the old one is refused once that expires). The old channel is closed if idle,
                # else left to finish the streams it carries (gRPC frees it with its last call).
                old, self._channel, self._stub_ = self._channel, None, None
                if old is not None and not (self._calls or self._streams):
                    old.close()
            if self._stub_ is None:
                self._stub_ = self._open()
            self._calls += calls
            self._streams += streams
            self._business += business
            self.last_used = time.monotonic()
            return self._stub_

    # -- what the mesh node reads to keep or let go of the connection ---------------------
    @property
    def connected(self) -> bool:
        return self._channel is not None

    @property
    def busy(self) -> bool:
        """A call in flight or a stream other than Watch open: the node has business with this peer."""
        with self._lock:
            return self._calls > 0 or self._business > 0

    def idle_for(self, now: float) -> float:
        """Seconds since the last use, 0 while anything (a Watch too) is open on the connection."""
        with self._lock:
            return 0.0 if self._calls or self._streams else now - self.last_used

    def release(self, idle_s: float) -> bool:
        """Close the connection if nothing has used it for ``idle_s`` (the next call opens it again); True when
        nothing is held now."""
        with self._lock:
            if self._calls or self._streams or time.monotonic() - self.last_used < idle_s:
                return False
            channel, self._channel, self._stub_ = self._channel, None, None
        if channel is not None:
            channel.close()
        return True

    def _stream(self, open_call: Callable[[pb_grpc.MeshStub], T], *, business: bool = True) -> T:
        stub = self._acquire(streams=1, business=int(business))
        try:
            call = open_call(stub)
        except BaseException:
            with self._lock:
                self._streams -= 1
                self._business -= int(business)
            raise

        def done(_call: object) -> None:
            with self._lock:
                self._streams -= 1
                self._business -= int(business)
                self.last_used = time.monotonic()

        call.add_done_callback(done)  # type: ignore[attr-defined]
        return call

    def hello(self, origin_state: pb.PeerState) -> pb.PeerState:
        """Tell the peer who we are; its answer is its own state."""
        return self._call("Hello", lambda s: s.Hello, pb.HelloRequest(origin=origin_state), self.hello_timeout)

    def admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        answer = self._call("Admit", lambda s: s.Admit, request, self.admit_timeout)
        if self.on_admit is not None:
            self.on_admit(self.node, request, answer)
        return answer

    def run_shadow(self, request: pb.RunShadowRequest, timeout: float = SHADOW_TIMEOUT_S) -> pb.ShadowState:
        """RunShadow; with volumes, RunShadowChunked (the volumes in parts)."""
        if not request.volumes:
            return self._call("RunShadow", lambda s: s.RunShadow, request, timeout)
        return self._chunked("RunShadow", lambda s: s.RunShadowChunked, lambda: upload.run_parts(request),
                             lambda s: s.RunShadow, request, timeout)

    def start_shadow(self, origin: str, key: str) -> pb.ShadowState:
        """Asked again once when the connection dropped under the call (on a lossy link the keepalive may end
        it): the host starts a shadow once and answers a started one as it is."""
        ref = pb.ShadowRef(origin_node=origin, key=key)
        try:
            return self._call("StartShadow", lambda s: s.StartShadow, ref, SHADOW_TIMEOUT_S)
        except PeerUnavailable as exc:
            if exc.status is not grpc.StatusCode.UNAVAILABLE:
                raise
            return self._call("StartShadow", lambda s: s.StartShadow, ref, SHADOW_TIMEOUT_S)

    def shadow_status(self, origin: str, key: str) -> pb.ShadowState:
        return self._call("ShadowStatus", lambda s: s.ShadowStatus, pb.ShadowRef(origin_node=origin, key=key),
                          self.hello_timeout)

    def remove_shadow(self, origin: str, key: str) -> bool:
        return self._call("RemoveShadow", lambda s: s.RemoveShadow, pb.ShadowRef(origin_node=origin, key=key),
                          SHADOW_TIMEOUT_S).removed

    def call(self, origin: str, key: str, method: str, request: bytes, timeout: float) -> bytes:
        """A CRI call on the shadow of ``key`` (ExecSync, ContainerStats, ...): the host's containerd answers."""
        req = pb.ShadowCallRequest(origin_node=origin, key=key, method=method, request=request)
        return self._call(method, lambda s: s.ShadowCall, req, timeout).response

    def sync_volumes(self, origin: str, key: str, volumes) -> int:
        """SyncVolumesChunked: the files of the shadow's volumes replaced with ``volumes``."""
        volumes = list(volumes)
        req = pb.SyncVolumesRequest(origin_node=origin, key=key)
        if not volumes:
            return self._call("SyncVolumes", lambda s: s.SyncVolumes, req, SHADOW_TIMEOUT_S).changed
        return self._chunked("SyncVolumes", lambda s: s.SyncVolumesChunked,
                             lambda: upload.sync_parts(origin, key, volumes), lambda s: s.SyncVolumes,
                             pb.SyncVolumesRequest(origin_node=origin, key=key, volumes=volumes),
                             SHADOW_TIMEOUT_S).changed

    def _chunked(self, method: str, fn: Callable[[pb_grpc.MeshStub], Callable[..., T]],
                 parts: Callable[[], object], old: Callable[[pb_grpc.MeshStub], Callable[..., T]],
                 whole: pb.RunShadowRequest | pb.SyncVolumesRequest, timeout: float) -> T:
        """A call with volumes in parts; to a host that predates that, the request ``whole`` as it was sent
        then, when it fits a mesh message."""
        try:
            return self._call(f"{method}Chunked", fn, parts(), timeout)
        except PeerUnavailable as exc:
            if exc.status is not grpc.StatusCode.UNIMPLEMENTED:
                raise
        size = whole.ByteSize()
        if size > MAX_MESSAGE_BYTES:
            raise PeerTooOld(f"peer {self.node} runs a weft that takes copied volumes only in one {method} message, "
                              f"and this one would hold {size} bytes, over the mesh's {MAX_MESSAGE_BYTES}; upgrade "
                             "the peer")
        return self._call(method, old, whole, timeout)

    def watch(self, origin: str, keys: list[str], heartbeat_s: float, idle_heartbeat_s: float = 0.0):
        """The host's pushed shadow states; a ``grpc`` call object (iterate it, ``cancel()`` it). With
        ``idle_heartbeat_s``, heartbeats only after that long without another message, and the host's own state
        pushed (``peer``) by a host that knows the field."""
        req = pb.WatchRequest(origin_node=origin, keys=keys, heartbeat_s=heartbeat_s, idle_heartbeat_s=idle_heartbeat_s)
        return self._stream(lambda s: s.Watch(req), business=False)

    def stream_log(self, origin: str, key: str, offset: int):
        """The shadow's log from ``offset``; a ``grpc`` call object (iterate it, ``cancel()`` it)."""
        req = pb.LogRequest(origin_node=origin, key=key, offset=offset)
        return self._stream(lambda s: s.StreamLog(req))

    def open_tunnel(self, origin: str, key: str, *, stream_url: str = "", port: int = 0) -> pb.TunnelGrant:
        """A one-time token for a tunnel to the shadow's stream URL or port (``shim.mesh.tunnel.dial`` it)."""
        req = pb.TunnelRequest(origin_node=origin, key=key)
        if stream_url:
            req.stream_url = stream_url
        else:
            req.port = port
        return self._call("OpenTunnel", lambda s: s.OpenTunnel, req, self.hello_timeout)

    def stitch(self, origin: str, key: str, ports, declared=None, origin_pod_ip: str = ""):
        """The shadow's stitched network; a ``grpc`` call object of StitchEvents (iterate it, ``cancel()`` it)."""
        req = pb.StitchRequest(origin_node=origin, key=key, ports=sorted(ports), declared=sorted(declared or ()),
                               has_declared=declared is not None, origin_pod_ip=origin_pod_ip)
        return self._stream(lambda s: s.Stitch(req))

    def unavailable(self, method: str, exc: grpc.RpcError) -> WeftError:
        """The typed error for a failed stream, as ``_call`` gives for unary calls."""
        code, details = exc.code(), exc.details() or ""
        if code in _REFUSALS:
            return PeerRefused(f"peer {self.node} at {self.address} refused {method}: {details}", node=self.node,
                               code=code)
        return PeerUnavailable(f"peer {self.node} at {self.address} did not answer {method} ({code.name}): "
                               f"{details}", node=self.node, status=code)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channel, self._channel, self._stub_ = self._channel, None, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, fn: Callable[[pb_grpc.MeshStub], Callable[..., T]], request: object,
              timeout: float) -> T:
        stub = self._acquire(calls=1)
        try:
            return fn(stub)(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.unavailable(method, exc) from exc
        except ValueError as exc:  # the channel was closed under the call (the peer left the mesh)
            raise PeerUnavailable(f"peer {self.node}: {exc}", node=self.node) from exc
        finally:
            with self._lock:
                self._calls -= 1
                self.last_used = time.monotonic()
