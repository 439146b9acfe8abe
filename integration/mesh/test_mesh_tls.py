"""The mesh over real mutual TLS on 127.0.0.1: who gets an answer, and how everyone else is turned away.

Each refusal is checked next to a connection that succeeds with one thing
changed, so a test passes because of the thing it names (the CA, the
certificate's node, the claimed node, the dialled name), not because the
server was down.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.mesh import certs
from shim.mesh.capacity import MIB, CapacityProbe, FixedHost
from shim.mesh.certs import MeshTls
from shim.mesh.client import PeerClient, PeerUnavailable
from shim.mesh.identity import PeerPolicy, PeerRefused, node_of_peer
from shim.mesh.server import MeshServer

GI = 2**30


@pytest.fixture(scope="module")
def cert_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mesh-certs")
    certs.write_mesh_certs(out, ["gpu-1", "cpu-1", "stranger"], {n: ["127.0.0.1"] for n in ("gpu-1", "cpu-1")})
    return out


@pytest.fixture(scope="module")
def tls(cert_dir: Path) -> dict[str, MeshTls]:
    return {n: certs.load_node_tls(cert_dir, n) for n in ("gpu-1", "cpu-1", "stranger")}


@pytest.fixture(scope="module")
def foreign_tls() -> MeshTls:
    """gpu-1's name, but signed by another cluster's CA."""
    ca_key, ca_pem = certs.generate_ca("another cluster")
    key, cert = certs.issue_node_cert(ca_key, ca_pem, "gpu-1", ["127.0.0.1"])
    return MeshTls(key, cert, ca_pem)


def _serve(node: str, tls: MeshTls, known: set[str], role: str) -> MeshServer:
    probe = CapacityProbe(role, reserve_cpu=0.5, reserve_memory=512 * MIB,
                          host=FixedHost(cores=4, memory_total=8 * GI, memory_available=6 * GI, busy=0.25))
    server = MeshServer(node, "127.0.0.1:0", tls, PeerPolicy(known), probe)
    server.start()
    return server


@pytest.fixture
def cpu_server(tls: dict[str, MeshTls]) -> Iterator[MeshServer]:
    server = _serve("cpu-1", tls["cpu-1"], {"gpu-1"}, "cpu")
    yield server
    server.stop()


@pytest.fixture
def gpu_server(tls: dict[str, MeshTls]) -> Iterator[MeshServer]:
    server = _serve("gpu-1", tls["gpu-1"], {"cpu-1"}, "gpu")
    yield server
    server.stop()


def _origin(node: str = "gpu-1") -> pb.PeerState:
    return pb.PeerState(node=node, role="gpu", healthy=True)


def _client(node: str, server: MeshServer, tls: MeshTls) -> PeerClient:
    return PeerClient(node, f"127.0.0.1:{server.port}", tls, hello_timeout=5, admit_timeout=5)


def test_known_peer_gets_the_servers_node_and_free_capacity(cpu_server: MeshServer,
                                                             tls: dict[str, MeshTls]) -> None:
    assert cpu_server.port
    with _client("cpu-1", cpu_server, tls["gpu-1"]) as client:
        state = client.hello(_origin())
    assert (state.node, state.role, state.healthy) == ("cpu-1", "cpu", True)
    # 4 cores 25% busy, 6 of 8 GiB available, less the 0.5-core / 512 MiB reserve.
    assert (state.free.cpu_cores, state.free.memory_bytes) == (2.5, 6 * GI - 512 * MIB)
    assert cpu_server.servicer.peer_states()["gpu-1"].role == "gpu"


def test_grpc_auth_context_carries_the_node_uri_where_identity_reads_it(tls: dict[str, MeshTls]) -> None:
    """Pins what grpcio really hands a server, including the fallback for versions without peer_uri."""
    seen: list[dict[str, list[bytes]]] = []

    def hello(request: pb.HelloRequest, context: grpc.ServicerContext) -> pb.PeerState:
        seen.append(dict(context.auth_context()))
        return pb.PeerState(node="cpu-1")

    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("weft.mesh.v1.Mesh", {
        "Hello": grpc.unary_unary_rpc_method_handler(hello, request_deserializer=pb.HelloRequest.FromString,
                                                     response_serializer=pb.PeerState.SerializeToString)}),))
    key, cert, ca = tls["cpu-1"]
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)], ca, True))
    server.start()
    try:
        with PeerClient("cpu-1", f"127.0.0.1:{port}", tls["gpu-1"], hello_timeout=5) as client:
            client.hello(_origin())
    finally:
        server.stop(None)
    [ctx] = seen
    assert b"weft://node/gpu-1" in ctx["x509_subject_alternative_name"]
    assert node_of_peer(ctx) == "gpu-1"
    assert node_of_peer({k: v for k, v in ctx.items() if k != "peer_uri"}) == "gpu-1"


def test_a_certificate_from_another_ca_is_refused_at_the_tls_layer(cpu_server: MeshServer, tls: dict[str, MeshTls],
                                                                   foreign_tls: MeshTls) -> None:
    # The client trusts our CA (so it accepts the server) but presents gpu-1's name signed by another CA.
    crossed = MeshTls(foreign_tls.key_pem, foreign_tls.cert_pem, tls["gpu-1"].ca_pem)
    with _client("cpu-1", cpu_server, crossed) as client, pytest.raises(PeerUnavailable) as err:
        client.hello(_origin())
    assert err.value.status == grpc.StatusCode.UNAVAILABLE
    assert cpu_server.servicer.peer_states() == {}


def test_a_client_without_a_certificate_is_refused_at_the_tls_layer(cpu_server: MeshServer,
                                                                    tls: dict[str, MeshTls]) -> None:
    channel = grpc.secure_channel(f"127.0.0.1:{cpu_server.port}", grpc.ssl_channel_credentials(tls["gpu-1"].ca_pem),
                                  options=[("grpc.ssl_target_name_override", "cpu-1")])
    with channel, pytest.raises(grpc.RpcError) as err:
        pb_grpc.MeshStub(channel).Hello(pb.HelloRequest(origin=_origin()), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_node_the_server_does_not_know_is_denied_by_name(cpu_server: MeshServer, tls: dict[str, MeshTls]) -> None:
    with _client("cpu-1", cpu_server, tls["stranger"]) as client, pytest.raises(PeerRefused) as err:
        client.hello(_origin("stranger"))
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert "'stranger' is not a known peer" in err.value.message
    assert cpu_server.servicer.peer_states() == {}


def test_a_peer_claiming_another_node_than_its_certificate_is_refused(cpu_server: MeshServer,
                                                                      tls: dict[str, MeshTls]) -> None:
    with _client("cpu-1", cpu_server, tls["gpu-1"]) as client:
        with pytest.raises(PeerRefused, match="'gpu-1' claims to be 'stranger'") as err:
            client.hello(_origin("stranger"))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(PeerRefused, match="'gpu-1' claims to be 'cpu-9' in Admit"):
            client.admit(pb.AdmitRequest(origin_node="cpu-9", key="sb/app/0"))
        assert cpu_server.servicer.peer_states() == {}
        client.hello(_origin("gpu-1"))
    assert list(cpu_server.servicer.peer_states()) == ["gpu-1"]


def test_dialling_one_node_and_reaching_another_fails(cpu_server: MeshServer, tls: dict[str, MeshTls]) -> None:
    address = f"127.0.0.1:{cpu_server.port}"
    with PeerClient("gpu-1", address, tls["gpu-1"], hello_timeout=5) as wrong, pytest.raises(PeerUnavailable) as err:
        wrong.hello(_origin())
    assert err.value.status == grpc.StatusCode.UNAVAILABLE and err.value.node == "gpu-1"
    assert cpu_server.servicer.peer_states() == {}
    with PeerClient("cpu-1", address, tls["gpu-1"], hello_timeout=5) as right:
        assert right.hello(_origin()).node == "cpu-1"


def test_a_gpu_only_node_refuses_to_host_cpu_work(gpu_server: MeshServer, cpu_server: MeshServer,
                                                  tls: dict[str, MeshTls]) -> None:
    ask = pb.AdmitRequest(origin_node="cpu-1", key="sb/app/0", limits=pb.Resources(cpu_cores=1, memory_bytes=GI))
    with _client("gpu-1", gpu_server, tls["cpu-1"]) as client:
        answer = client.admit(ask)
    assert (answer.admitted, answer.reason) == (False, "not-a-cpu-host")
    ask.origin_node = "gpu-1"
    with _client("cpu-1", cpu_server, tls["gpu-1"]) as client:
        answer = client.admit(ask)
    assert (answer.admitted, answer.reason) == (True, "admitted")
    assert (answer.free_after.cpu_cores, answer.free_after.memory_bytes) == (1.5, 5 * GI - 512 * MIB)


def test_a_stopped_peer_is_unavailable_within_the_deadline(tls: dict[str, MeshTls]) -> None:
    server = _serve("cpu-1", tls["cpu-1"], {"gpu-1"}, "cpu")
    server.stop()
    started = time.monotonic()
    client = PeerClient("cpu-1", f"127.0.0.1:{server.port}", tls["gpu-1"], hello_timeout=1)
    with client, pytest.raises(PeerUnavailable) as err:
        client.hello(_origin())
    assert time.monotonic() - started < 3
    assert err.value.status in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
