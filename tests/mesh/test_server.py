"""The mesh servicer without sockets: who is answered, what is recorded, and what a refusal looks like.

The same paths over real TLS are in ``integration/mesh/test_mesh_tls.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc
import pytest
from structlog.testing import capture_logs

from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.errors import ConfigError
from shim.mesh import certs, upload
from shim.mesh.capacity import CapacityProbe, FixedHost
from shim.mesh.client import PeerClient
from shim.mesh.hosting import ShadowHosting
from shim.mesh.identity import PeerPolicy
from shim.mesh.quotas import CALL, HELLO, STREAM, WATCH, MeshLimits, PeerBusy, PeerLimits
from shim.mesh.server import MeshServer, MeshServicer
from shim.mesh.wire import MAX_MESSAGE_BYTES, REQUEST_LIMITS

GI = 2**30


class Aborted(Exception):
    pass


class FakeContext:
    """What a grpc servicer context gives a handler: the peer's TLS names and abort()."""

    def __init__(self, node: str | None) -> None:
        self._auth = {"x509_common_name": [b"x"]}
        if node is not None:
            self._auth["peer_uri"] = [f"weft://node/{node}".encode()]
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def auth_context(self) -> dict[str, list[bytes]]:
        return self._auth

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5555"

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code, self.details = code, details
        raise Aborted(details)


def _servicer(role: str = "cpu", admit=None) -> MeshServicer:
    probe = CapacityProbe(role, 0.5, 0, host=FixedHost(cores=4, memory_total=8 * GI, memory_available=8 * GI))
    return MeshServicer("cpu-1", PeerPolicy({"gpu-1", "gpu-2"}), probe, admit)


def _hello(node: str, role: str = "gpu") -> pb.HelloRequest:
    return pb.HelloRequest(origin=pb.PeerState(node=node, role=role))


def test_hello_from_a_known_peer_is_answered_with_this_node_and_recorded() -> None:
    servicer = _servicer()
    answer = servicer.Hello(_hello("gpu-1"), FakeContext("gpu-1"))
    assert (answer.node, answer.role, answer.free.cpu_cores) == ("cpu-1", "cpu", 3.5)
    servicer.Hello(_hello("gpu-1", role="gpu,cpu"), FakeContext("gpu-1"))
    servicer.Hello(_hello("gpu-2"), FakeContext("gpu-2"))
    states = servicer.peer_states()
    assert {n: s.role for n, s in states.items()} == {"gpu-1": "gpu,cpu", "gpu-2": "gpu"}


@pytest.mark.parametrize(("cert_node", "claimed", "code", "details"), [
    pytest.param("gpu-9", "gpu-9", grpc.StatusCode.PERMISSION_DENIED, "'gpu-9' is not a known peer", id="unknown-node"),
    pytest.param("gpu-1", "gpu-2", grpc.StatusCode.PERMISSION_DENIED, "'gpu-1' claims to be 'gpu-2'",
                 id="peer-lies-about-its-node"),
    pytest.param(None, "gpu-1", grpc.StatusCode.PERMISSION_DENIED, "names no single weft node",
                 id="certificate-names-no-node"),
])
def test_refused_hello_records_nothing_and_is_logged(cert_node: str | None, claimed: str, code: grpc.StatusCode,
                                                     details: str) -> None:
    servicer, ctx = _servicer(), FakeContext(cert_node)
    with capture_logs() as logs, pytest.raises(Aborted):
        servicer.Hello(_hello(claimed), ctx)
    assert ctx.code == code and details in ctx.details
    assert servicer.peer_states() == {}
    assert [(e["event"], e["node"]) for e in logs] == [("peer.refused", cert_node)]


def test_admit_uses_the_given_decision_for_a_known_peer() -> None:
    seen: list[pb.AdmitRequest] = []

    def admit(req: pb.AdmitRequest) -> pb.AdmitResponse:
        seen.append(req)
        return pb.AdmitResponse(admitted=False, reason="unhealthy")

    request = pb.AdmitRequest(origin_node="gpu-1", key="sb/app/0", limits=pb.Resources(cpu_cores=1))
    with capture_logs() as logs:
        answer = _servicer(admit=admit).Admit(request, FakeContext("gpu-1"))
    assert (answer.reason, seen) == ("unhealthy", [request])
    assert [(e["event"], e["peer"], e["reason"]) for e in logs] == [("peer.admit", "gpu-1", "unhealthy")]


def test_admit_defaults_to_the_probe_and_a_gpu_only_node_refuses() -> None:
    request = pb.AdmitRequest(origin_node="gpu-1", key="sb/app/0", limits=pb.Resources(cpu_cores=1, memory_bytes=GI))
    assert _servicer("gpu").Admit(request, FakeContext("gpu-1")).reason == "not-a-cpu-host"
    assert _servicer("cpu").Admit(request, FakeContext("gpu-1")).admitted


def test_admit_on_behalf_of_another_node_is_refused() -> None:
    ctx = FakeContext("gpu-1")
    with pytest.raises(Aborted):
        _servicer().Admit(pb.AdmitRequest(origin_node="gpu-2", key="k"), ctx)
    assert ctx.code == grpc.StatusCode.PERMISSION_DENIED


def test_server_refuses_to_serve_a_certificate_of_another_node() -> None:
    ca = certs.generate_ca()
    key, cert = certs.issue_node_cert(*ca, "cpu-2")
    probe = CapacityProbe("cpu", host=FixedHost(1, GI, GI))
    with pytest.raises(ConfigError, match=r"names \['cpu-2'\], but this node is 'cpu-1'"):
        MeshServer("cpu-1", "127.0.0.1:0", (key, cert, ca[1]), PeerPolicy(set()), probe)


# -- limits: one peer's calls never take what the others' need --------------------------------------
def test_each_kind_of_call_is_capped_per_peer_and_in_all() -> None:
    limits = PeerLimits(MeshLimits(streams=3, streams_per_peer=2, calls=1, calls_per_peer=1))
    with limits.hold("gpu-1", STREAM, "StreamLog"), limits.hold("gpu-1", STREAM, "Stitch"):
        with pytest.raises(PeerBusy, match="gpu-1 has 2 stream calls open here"), \
                limits.hold("gpu-1", STREAM, "StreamLog"):
            pass
        # Another peer is not held back by gpu-1's streams, only by the node's cap.
        with limits.hold("gpu-2", STREAM, "StreamLog"), \
                pytest.raises(PeerBusy, match="this node serves 3 stream calls"), \
                limits.hold("gpu-3", STREAM, "StreamLog"):
            pass
        with limits.hold("gpu-1", CALL, "RunShadow"), limits.hold("gpu-1", HELLO, "Hello"):
            pass  # streams at their cap leave calls and Hellos their own
    assert limits.open_now() == {STREAM: 0, CALL: 0, HELLO: 0}


def test_the_pool_has_a_worker_for_every_call_the_limits_let_in() -> None:
    limits = MeshLimits()
    assert limits.workers == limits.streams + limits.calls + limits.hellos + limits.watches


def test_origins_watching_in_their_hundreds_leave_hellos_their_own_lane() -> None:
    limits = PeerLimits(MeshLimits(hellos=2, watches=500))
    with contextlib.ExitStack() as held:
        for i in range(500):  # a host serving the Watch of 500 origins
            held.enter_context(limits.hold(f"gpu-{i}", WATCH, "Watch"))
        with limits.hold("gpu-0", HELLO, "Hello"), limits.hold("gpu-1", HELLO, "Admit"):
            pass
        with pytest.raises(PeerBusy, match="this node serves 500 watch calls"), limits.hold("gpu-500", WATCH, "Watch"):
            pass


def test_a_peer_with_a_call_or_stream_open_is_in_contact() -> None:
    limits = PeerLimits(MeshLimits())
    assert not limits.active("gpu-1")
    with limits.hold("gpu-1", WATCH, "Watch"):
        assert limits.active("gpu-1") and not limits.active("gpu-2")
    assert not limits.active("gpu-1")


def test_a_call_over_its_peers_cap_is_resource_exhausted() -> None:
    servicer = MeshServicer("cpu-1", PeerPolicy({"gpu-1"}), CapacityProbe("cpu", 0.5, 0, host=FixedHost(
        cores=4, memory_total=8 * GI, memory_available=8 * GI)), limits=MeshLimits(hellos_per_peer=1))
    ctx = FakeContext("gpu-1")
    with servicer.limits.hold("gpu-1", HELLO, "Hello"), pytest.raises(Aborted):
        servicer.Hello(_hello("gpu-1"), ctx)
    assert ctx.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "1 hello calls open" in ctx.details
    assert servicer.Hello(_hello("gpu-1"), FakeContext("gpu-1")).node == "cpu-1"


# -- message sizes: nothing large is read before the peer is known -------------------------------------
class UploadHost:
    """A host that takes volume streams: what it was handed, read under the caps. Its one object plays every
    part of the mesh's ShadowHosting (``hosting``)."""

    def __init__(self) -> None:
        self.runs: list[pb.RunShadowRequest] = []
        self.in_contact = self.admit = self.room = None
        self.pulse = self
        self.hosting = ShadowHosting(fence=self, lifecycle=self, preparer=self, watcher=self, calls=self,
                                     capacity=self)

    def touch(self, origin: str) -> None:
        pass

    @contextlib.contextmanager
    def receiving(self, origin: str, key: str, parts, into) -> Iterator[None]:
        upload.receive(parts, into, upload.UploadCaps(max_bytes=8 << 20, max_files=16))
        yield

    def run(self, origin: str, req: pb.RunShadowRequest) -> pb.ShadowState:
        self.runs.append(req)
        return pb.ShadowState(key=req.key, shadow_container_id="c1")

    def sync_volumes(self, origin: str, req: pb.SyncVolumesRequest) -> pb.SyncVolumesResponse:
        return pb.SyncVolumesResponse(changed=len(req.volumes))


def _upload_servicer(host: UploadHost) -> MeshServicer:
    probe = CapacityProbe("cpu", 0.5, 0, host=FixedHost(cores=4, memory_total=8 * GI, memory_available=8 * GI))
    return MeshServicer("cpu-1", PeerPolicy({"gpu-1"}), probe, host=host.hosting)


def _counted(parts, pulled: list[int]):
    for p in parts:
        pulled[0] += 1
        yield p


def _with_volume(size: int, origin: str = "gpu-1") -> pb.RunShadowRequest:
    return pb.RunShadowRequest(origin_node=origin, key="sb/app/0", volumes=[
        pb.Volume(container_path="/etc/secret", files=[pb.VolumeFile(path="token", data=b"s" * size)])])


def test_a_stranger_is_refused_a_volume_stream_before_any_part_is_read() -> None:
    host, pulled, ctx = UploadHost(), [0], FakeContext("stranger")
    with capture_logs() as logs, pytest.raises(Aborted):
        _upload_servicer(host).RunShadowChunked(_counted(upload.run_parts(_with_volume(16 << 20)), pulled), ctx)
    assert (ctx.code, pulled, host.runs) == (grpc.StatusCode.PERMISSION_DENIED, [0], [])
    assert [e["event"] for e in logs] == ["peer.refused"]


def test_a_volume_stream_speaking_for_another_node_is_refused_after_its_first_part() -> None:
    host, pulled, ctx = UploadHost(), [0], FakeContext("gpu-1")
    with pytest.raises(Aborted):
        _upload_servicer(host).RunShadowChunked(_counted(upload.run_parts(_with_volume(4 << 20, "gpu-2")), pulled),
                                                ctx)
    assert (ctx.code, pulled, host.runs) == (grpc.StatusCode.PERMISSION_DENIED, [1], [])


def test_a_listed_peers_volume_stream_reaches_the_host_whole() -> None:
    host = UploadHost()
    answer = _upload_servicer(host).RunShadowChunked(upload.run_parts(_with_volume(3 << 20)), FakeContext("gpu-1"))
    assert answer.shadow_container_id == "c1" and host.runs == [_with_volume(3 << 20)]


def test_every_method_has_a_request_limit_none_over_the_mesh_message_limit() -> None:
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Mesh"].methods}
    assert set(REQUEST_LIMITS) == methods
    assert max(REQUEST_LIMITS.values()) == MAX_MESSAGE_BYTES <= 4 << 20


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[MeshServer, UploadHost, dict[str, tuple[bytes, bytes, bytes]]]]:
    """A real MeshServer on 127.0.0.1 over mutual TLS, gpu-1 listed, ``stranger`` signed by the same CA."""
    ca = certs.generate_ca()
    tls = {n: (*certs.issue_node_cert(*ca, n, ["127.0.0.1"]), ca[1]) for n in ("cpu-1", "gpu-1", "stranger")}
    host = UploadHost()
    probe = CapacityProbe("cpu", host=FixedHost(4, 8 * GI, 8 * GI))
    server = MeshServer("cpu-1", "127.0.0.1:0", tls["cpu-1"], PeerPolicy({"gpu-1"}), probe, host=host.hosting)
    server.start()
    yield server, host, tls
    server.stop(0)


def _channel(served, as_node: str) -> grpc.Channel:
    server, _, tls = served
    key, cert, ca = tls[as_node]
    return grpc.secure_channel(f"127.0.0.1:{server.port}", grpc.ssl_channel_credentials(ca, key, cert), options=[
        ("grpc.ssl_target_name_override", "cpu-1"), ("grpc.max_send_message_length", 64 << 20)])


def _unary(ch: grpc.Channel, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        ch.unary_unary(f"/weft.mesh.v1.Mesh/{method}")(request.SerializeToString(), timeout=30)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""


def test_the_transport_refuses_a_message_over_the_mesh_limit_from_its_length_alone(served) -> None:
    for who in ("stranger", "gpu-1"):
        with _channel(served, who) as ch:
            code, details = _unary(ch, "RunShadow", _with_volume(16 << 20, who))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and f"vs. {MAX_MESSAGE_BYTES}" in details, (who, details)
    assert served[1].runs == []


def test_a_request_over_its_methods_limit_is_refused_after_the_peer_check(served) -> None:
    hello = pb.HelloRequest(origin=pb.PeerState(node="gpu-1", health_detail="x" * (300 << 10)))
    with _channel(served, "stranger") as ch:
        assert _unary(ch, "Hello", hello)[0] is grpc.StatusCode.PERMISSION_DENIED
    with _channel(served, "gpu-1") as ch:
        code, details = _unary(ch, "Hello", hello)
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"Hello: a message of {hello.ByteSize()} bytes, over the {REQUEST_LIMITS['Hello']}" in details
        hello.origin.health_detail = "ok"
        assert _unary(ch, "Hello", hello)[0] is grpc.StatusCode.OK


def test_volumes_larger_than_a_message_reach_the_host_in_parts(served) -> None:
    server, host, tls = served
    with PeerClient("cpu-1", f"127.0.0.1:{server.port}", tls["gpu-1"]) as client:
        assert client.run_shadow(_with_volume(6 << 20)).shadow_container_id == "c1"
    assert host.runs[-1] == _with_volume(6 << 20)


def test_a_part_over_its_streams_limit_is_refused_as_it_comes(served) -> None:
    head = pb.VolumeUpload(sync=pb.SyncVolumesRequest(origin_node="gpu-1", key="sb/app/0"))
    volume = pb.VolumeUpload(volume=pb.Volume(container_path="/etc/app"))
    big = pb.VolumeUpload(file=pb.VolumeFile(path="f", data=b"x" * (2 << 20)))
    with _channel(served, "gpu-1") as ch:
        stub = pb_grpc.MeshStub(ch)
        assert stub.SyncVolumesChunked(iter([head, volume, pb.VolumeUpload(file=pb.VolumeFile(path="f"))]),
                                       timeout=30).changed == 1
        with pytest.raises(grpc.RpcError) as caught:
            stub.SyncVolumesChunked(iter([head, volume, big]), timeout=30)
    assert caught.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"SyncVolumesChunked: a message of {big.ByteSize()} bytes, over the " \
           f"{REQUEST_LIMITS['SyncVolumesChunked']}" in caught.value.details()
