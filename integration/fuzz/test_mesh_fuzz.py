"""Bad input on every mesh RPC, from a known peer over real mutual TLS, to a real host agent.

Each method (read from the mesh's descriptor, so a new RPC is covered as soon
as it exists) gets random bytes, corrupted and unknown-field variants of a
valid request, invalid UTF-8 and huge strings, as gpu-1. After each call: the
status is a clear one, the agent still serves its mesh and its CRI socket,
and a shadow that a RunShadow made is removed by the origin's own
RemoveShadow, leaving the host's containerd as it was. Who may ask at all
(certificates, node list, claims) is in ``integration/security/test_boundaries.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc
from hypothesis import event, given

from integration.fuzz import wire
from integration.fuzz.agent_fixture import Outcome, assert_clear
from integration.fuzz.mesh_fixture import MESH, MeshHost, mesh_host, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim.localfabric import images
from shim.localfabric.containerd import Containerd

_SERVICE = pb.DESCRIPTOR.services_by_name["Mesh"]
METHODS = {m.name: m for m in _SERVICE.methods}


@pytest.fixture(scope="module")
def host(containerd_session: Containerd, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MeshHost]:
    yield from mesh_host(containerd_session, tmp_path_factory.mktemp("mesh-fuzz"))


def _valid(host: MeshHost, name: str) -> bytes:
    key = "origin-sb-1/tokenize/0"
    known = {
        "Hello": pb.HelloRequest(origin=pb.PeerState(node="gpu-1", role="gpu", healthy=True)),
        "Admit": pb.AdmitRequest(origin_node="gpu-1", key=key, limits=pb.Resources(cpu_cores=0.1,
                                                                                   memory_bytes=64 << 20),
                                 image=images.BUSYBOX_IMAGE),
        "RunShadow": run_shadow_request(host.containerd, "gpu-1", key),
        # A volume stream's first part, alone: the request (the fuzzed bytes go as that one part).
        "RunShadowChunked": pb.VolumeUpload(run=run_shadow_request(host.containerd, "gpu-1", key)),
        "SyncVolumesChunked": pb.VolumeUpload(sync=pb.SyncVolumesRequest(origin_node="gpu-1", key=key)),
    }
    if name in known:
        return known[name].SerializeToString()
    # Any other request: the origin and the key are what every shadow RPC carries.
    message = _request_type(name)()
    for field, value in (("origin_node", "gpu-1"), ("key", key), ("method", "ContainerStatus"),
                         ("heartbeat_s", 1.0)):
        if field in message.DESCRIPTOR.fields_by_name:
            setattr(message, field, value)
    return message.SerializeToString()


def _request_type(name: str):
    return getattr(pb, METHODS[name].input_type.name)


def _strings(name: str) -> list[list[int]]:
    from google.protobuf.descriptor import FieldDescriptor

    def walk(desc, prefix: list[int], depth: int) -> list[list[int]]:
        out = []
        for f in desc.fields:
            if f.type == FieldDescriptor.TYPE_STRING:
                out.append([*prefix, f.number])
            elif f.type == FieldDescriptor.TYPE_MESSAGE and depth < 2:
                out += walk(f.message_type, [*prefix, f.number], depth + 1)
        return out

    return walk(METHODS[name].input_type, [], 0)


def _call(ch: grpc.Channel, name: str, raw: bytes) -> Outcome:
    method = METHODS[name]
    try:
        if method.server_streaming:
            # A stream answers at once (a snapshot, a log chunk) or fails; one message is enough to know.
            stream = ch.unary_stream(MESH + name)(raw, timeout=30)
            try:
                first = next(stream, b"")
            finally:
                stream.cancel()
            return Outcome(grpc.StatusCode.OK, "", first)
        return Outcome(grpc.StatusCode.OK, "", ch.unary_unary(MESH + name)(raw, timeout=60))
    except grpc.RpcError as e:
        if e.code() is grpc.StatusCode.CANCELLED and method.server_streaming:
            return Outcome(grpc.StatusCode.OK, "", b"")
        return Outcome(e.code(), e.details() or "", None)


_RUNS = ("RunShadow", "RunShadowChunked")  # what may make a shadow, removed after each call
CASES = [pytest.param(name, kind, id=f"{name}-{kind}") for name in METHODS
         for kind in ("random", "mutated", "unknown-fields", "invalid-utf8-string", "huge-string")]


@pytest.mark.parametrize(("name", "kind"), CASES)
def test_bad_mesh_requests_get_a_clear_status_and_leave_nothing_behind(host: MeshHost, name: str,
                                                                       kind: str) -> None:
    baseline = host.shadows()
    strategies = wire.bad_inputs(_valid(host, name), [], _strings(name))
    if kind not in strategies:
        pytest.fail(f"{name} has no string field to corrupt")
    examples = 3 if name in _RUNS else 5
    with host.channel("gpu-1") as ch, host.agent.channel() as kubelet:

        @wire.fuzz_settings(examples * (3 if kind == "mutated" else 1))
        @given(raw=strategies[kind])
        def check(raw: wire.Raw) -> None:
            what = (name, wire.describe(kind, raw.data))
            out = _call(ch, name, raw.data)
            event(f"{out.code.name}")
            assert_clear(out, what)
            if name in _RUNS and out.response:
                state = pb.ShadowState.FromString(out.response)
                ch.unary_unary(MESH + "RemoveShadow")(
                    pb.ShadowRef(origin_node="gpu-1", key=state.key).SerializeToString(), timeout=60)
            assert host.agent.proc is not None and host.agent.proc.poll() is None, "the host agent exited"
            cri_grpc.RuntimeServiceStub(kubelet).Version(cri.VersionRequest(), timeout=10)
            hello = pb.HelloRequest(origin=pb.PeerState(node="gpu-1", role="gpu", healthy=True))
            assert pb.PeerState.FromString(ch.unary_unary(MESH + "Hello")(
                hello.SerializeToString(), timeout=10)).node == "cpu-1"
            assert host.shadows() == baseline, f"the host's containerd changed after {what}"

        check()
