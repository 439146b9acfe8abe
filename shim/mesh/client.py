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
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import grpc

from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.errors import WeftError
from shim.mesh.certs import MeshTls
from shim.mesh.identity import PeerRefused
from shim.mesh.server import KEEPALIVE_OPTIONS, MAX_MESSAGE_BYTES
from shim.mesh.tlsreload import generation_of

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
        self._lock = threading.Lock()
        self._open()

    def _open(self) -> None:
        key_pem, cert_pem, ca_pem = self._tls
        self._generation = generation_of(self._tls)  # of this node's TLS (shim.mesh.tlsreload)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca_pem, private_key=key_pem, certificate_chain=cert_pem)
        self._channel = grpc.secure_channel(self.address, credentials, options=[
            ("grpc.ssl_target_name_override", self.node),
            # A peer that restarts should be found again within a Hello period or two,
            # not after gRPC's default two-minute backoff.
            ("grpc.max_reconnect_backoff_ms", 5000),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            *KEEPALIVE_OPTIONS,
        ])
        self._stub_ = pb_grpc.MeshStub(self._channel)

    @property
    def _stub(self) -> pb_grpc.MeshStub:
        """The stub; on a new channel once this node's certificate was renewed, which presents it (a channel
        reconnecting with the old one is refused once that expires). The old channel is left to finish the
        streams it carries (gRPC frees it with its last call)."""
        with self._lock:
            if generation_of(self._tls) != self._generation:
                self._open()
            return self._stub_

    def hello(self, origin_state: pb.PeerState) -> pb.PeerState:
        """Tell the peer who we are; its answer is its own state."""
        return self._call("Hello", self._stub.Hello, pb.HelloRequest(origin=origin_state), self.hello_timeout)

    def admit(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        return self._call("Admit", self._stub.Admit, request, self.admit_timeout)

    def run_shadow(self, request: pb.RunShadowRequest, timeout: float = SHADOW_TIMEOUT_S) -> pb.ShadowState:
        return self._call("RunShadow", self._stub.RunShadow, request, timeout)

    def start_shadow(self, origin: str, key: str) -> pb.ShadowState:
        return self._call("StartShadow", self._stub.StartShadow, pb.ShadowRef(origin_node=origin, key=key),
                          SHADOW_TIMEOUT_S)

    def shadow_status(self, origin: str, key: str) -> pb.ShadowState:
        return self._call("ShadowStatus", self._stub.ShadowStatus, pb.ShadowRef(origin_node=origin, key=key),
                          self.hello_timeout)

    def remove_shadow(self, origin: str, key: str) -> bool:
        return self._call("RemoveShadow", self._stub.RemoveShadow, pb.ShadowRef(origin_node=origin, key=key),
                          SHADOW_TIMEOUT_S).removed

    def call(self, origin: str, key: str, method: str, request: bytes, timeout: float) -> bytes:
        """A CRI call on the shadow of ``key`` (ExecSync, ContainerStats, ...): the host's containerd answers."""
        req = pb.ShadowCallRequest(origin_node=origin, key=key, method=method, request=request)
        return self._call(method, self._stub.ShadowCall, req, timeout).response

    def sync_volumes(self, origin: str, key: str, volumes) -> int:
        req = pb.SyncVolumesRequest(origin_node=origin, key=key, volumes=volumes)
        return self._call("SyncVolumes", self._stub.SyncVolumes, req, SHADOW_TIMEOUT_S).changed

    def watch(self, origin: str, keys: list[str], heartbeat_s: float):
        """The host's pushed shadow states; a ``grpc`` call object (iterate it, ``cancel()`` it)."""
        return self._stub.Watch(pb.WatchRequest(origin_node=origin, keys=keys, heartbeat_s=heartbeat_s))

    def stream_log(self, origin: str, key: str, offset: int):
        """The shadow's log from ``offset``; a ``grpc`` call object (iterate it, ``cancel()`` it)."""
        return self._stub.StreamLog(pb.LogRequest(origin_node=origin, key=key, offset=offset))

    def open_tunnel(self, origin: str, key: str, *, stream_url: str = "", port: int = 0) -> pb.TunnelGrant:
        """A one-time token for a tunnel to the shadow's stream URL or port (``shim.mesh.tunnel.dial`` it)."""
        req = pb.TunnelRequest(origin_node=origin, key=key)
        if stream_url:
            req.stream_url = stream_url
        else:
            req.port = port
        return self._call("OpenTunnel", self._stub.OpenTunnel, req, self.hello_timeout)

    def stitch(self, origin: str, key: str, ports, declared=None, origin_pod_ip: str = ""):
        """The shadow's stitched network; a ``grpc`` call object of StitchEvents (iterate it, ``cancel()`` it)."""
        req = pb.StitchRequest(origin_node=origin, key=key, ports=sorted(ports), declared=sorted(declared or ()),
                               has_declared=declared is not None, origin_pod_ip=origin_pod_ip)
        return self._stub.Stitch(req)

    def unavailable(self, method: str, exc: grpc.RpcError) -> WeftError:
        """The typed error for a failed stream, as ``_call`` gives for unary calls."""
        code, details = exc.code(), exc.details() or ""
        if code in _REFUSALS:
            return PeerRefused(f"peer {self.node} at {self.address} refused {method}: {details}", node=self.node,
                               code=code)
        return PeerUnavailable(f"peer {self.node} at {self.address} did not answer {method} ({code.name}): "
                               f"{details}", node=self.node, status=code)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, fn: Callable[..., T], request: object, timeout: float) -> T:
        try:
            return fn(request, timeout=timeout)
        except grpc.RpcError as exc:
            raise self.unavailable(method, exc) from exc
