"""The mesh client's volume calls to a host from before volume streams: the old way while it fits, else refused."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from shim._pb import mesh_pb2 as pb
from shim.mesh import certs
from shim.mesh.client import PeerClient, PeerTooOld
from shim.mesh.tlsreload import server_credentials
from shim.mesh.wire import MAX_MESSAGE_BYTES


class OldHost:
    """The Mesh service as a weft before RunShadowChunked served it: volumes only inside the request."""

    def __init__(self) -> None:
        self.got: list[object] = []

    def run_shadow(self, request: bytes, context) -> bytes:
        self.got.append(pb.RunShadowRequest.FromString(request))
        return pb.ShadowState(key="k", shadow_container_id="c1").SerializeToString()

    def sync_volumes(self, request: bytes, context) -> bytes:
        self.got.append(pb.SyncVolumesRequest.FromString(request))
        return pb.SyncVolumesResponse(changed=1).SerializeToString()


@pytest.fixture(scope="module")
def old_host() -> Iterator[tuple[OldHost, str, tuple[bytes, bytes, bytes]]]:
    ca = certs.generate_ca()
    host_tls = (*certs.issue_node_cert(*ca, "cpu-1", ["127.0.0.1"]), ca[1])
    origin_tls = (*certs.issue_node_cert(*ca, "gpu-1", ["127.0.0.1"]), ca[1])
    host = OldHost()
    server = grpc.server(ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 80 << 20)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("weft.mesh.v1.Mesh", {
        "RunShadow": grpc.unary_unary_rpc_method_handler(host.run_shadow),
        "SyncVolumes": grpc.unary_unary_rpc_method_handler(host.sync_volumes)}),))
    port = server.add_secure_port("127.0.0.1:0", server_credentials(host_tls))
    server.start()
    yield host, f"127.0.0.1:{port}", origin_tls
    server.stop(0)


def _volumes(size: int) -> list[pb.Volume]:
    return [pb.Volume(container_path="/etc/app", files=[pb.VolumeFile(path="settings", data=b"v" * size)])]


def test_an_old_host_gets_volumes_inside_the_request_while_they_fit_a_message(old_host) -> None:
    host, address, tls = old_host
    req = pb.RunShadowRequest(origin_node="gpu-1", key="k", volumes=_volumes(1 << 20))
    with PeerClient("cpu-1", address, tls) as client:
        assert client.run_shadow(req).shadow_container_id == "c1"
        assert client.sync_volumes("gpu-1", "k", _volumes(2 << 20)) == 1
    assert host.got == [req, pb.SyncVolumesRequest(origin_node="gpu-1", key="k", volumes=_volumes(2 << 20))]


def test_volumes_over_a_message_for_an_old_host_are_refused_saying_so(old_host) -> None:
    host, address, tls = old_host
    before = len(host.got)
    with PeerClient("cpu-1", address, tls) as client:
        with pytest.raises(PeerTooOld, match=rf"takes copied volumes only in one RunShadow message, and this one "
                                             rf"would hold \d+ bytes, over the mesh's {MAX_MESSAGE_BYTES}"):
            client.run_shadow(pb.RunShadowRequest(origin_node="gpu-1", key="k", volumes=_volumes(5 << 20)))
        with pytest.raises(PeerTooOld, match="only in one SyncVolumes message"):
            client.sync_volumes("gpu-1", "k", _volumes(5 << 20))
    assert len(host.got) == before
