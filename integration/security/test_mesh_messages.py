"""A node with a CA-signed certificate but not in the host's peer list cannot make the host read a large message.

gRPC reads a unary request whole before the handler (and the peer-list
check) runs. So the host reads no message over the mesh's limit (the
transport refuses it from its length prefix), and copied volumes, the one
large thing, come in a client stream whose handler checks the peer before it
reads a part. The host's resident memory shows it: its peak is reset
(``/proc/<pid>/clear_refs``) before each attack, and what the attack sends
must not show up in it. A listed peer's large volumes still arrive.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.mesh import upload
from shim.mesh.wire import MAX_MESSAGE_BYTES

MIB = 1 << 20
ATTACK = 16 * MIB
# What the host may grow by while refusing an attack: far less than one attack's message.
SLACK = 6 * MIB


def _peak_rss(pid: int) -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())[1]) << 10


def _reset_peak(pid: int) -> int:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak resident set starts again from what is resident now
    return _peak_rss(pid)


def _with_volume(mesh: MeshHost, origin: str, key: str, size: int) -> pb.RunShadowRequest:
    req = run_shadow_request(mesh.containerd, origin, key, sandbox=key.split("/")[0])
    req.volumes.add(container_path="/etc/secret", files=[pb.VolumeFile(path="token", data=b"s" * size)])
    return req


def _counted(parts: Iterator[pb.VolumeUpload], sent: list[int]) -> Iterator[pb.VolumeUpload]:
    for p in parts:
        sent[0] += 1
        yield p


def _unary(ch: grpc.Channel, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        ch.unary_unary(MESH + method)(request.SerializeToString(), timeout=60)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _chunked(ch: grpc.Channel, method: str, parts: Iterator[pb.VolumeUpload]) -> tuple[grpc.StatusCode, str]:
    try:
        getattr(pb_grpc.MeshStub(ch), method)(parts, timeout=300)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def test_a_stranger_is_refused_a_large_message_without_the_host_reading_it(mesh: MeshHost) -> None:
    before = _reset_peak(mesh.agent.pid)
    answers = []
    with mesh.channel("stranger") as ch:
        for _ in range(4):  # as RunShadow with its volumes inside, the way it was sent before volume streams
            answers.append(_unary(ch, "RunShadow", _with_volume(mesh, "stranger", "sb-attack/tokenize/0", ATTACK)))
    grown = _peak_rss(mesh.agent.pid) - before
    for code, details in answers:
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, details
        assert f"vs. {MAX_MESSAGE_BYTES})" in details  # the transport's refusal, from the length prefix
    assert grown < SLACK, f"the host's peak memory grew by {grown >> 20} MiB refusing 16 MiB messages"
    assert mesh.shadows() == (set(), set())


@pytest.mark.parametrize("method", ["RunShadowChunked", "SyncVolumesChunked"])
def test_a_stranger_is_refused_a_volume_stream_before_the_host_reads_a_part(mesh: MeshHost, method: str) -> None:
    req = _with_volume(mesh, "stranger", "sb-attack/tokenize/0", ATTACK)
    parts = (upload.run_parts(req) if method == "RunShadowChunked"
             else upload.sync_parts("stranger", req.key, req.volumes))
    before = _reset_peak(mesh.agent.pid)
    with mesh.channel("stranger") as ch:
        code, details = _chunked(ch, method, parts)
    grown = _peak_rss(mesh.agent.pid) - before
    assert code is grpc.StatusCode.PERMISSION_DENIED and "'stranger' is not a known peer" in details
    assert grown < SLACK, f"the host's peak memory grew by {grown >> 20} MiB refusing a stranger's stream"
    assert mesh.shadows() == (set(), set())


@pytest.mark.parametrize("method", ["RunShadowChunked", "SyncVolumesChunked"])
def test_a_volume_stream_speaking_for_another_node_is_refused(mesh: MeshHost, method: str) -> None:
    req = _with_volume(mesh, "gpu-2", "sb-claim/tokenize/0", MIB)
    parts = (upload.run_parts(req) if method == "RunShadowChunked"
             else upload.sync_parts("gpu-2", req.key, req.volumes))
    with mesh.channel("gpu-1") as ch:
        code, details = _chunked(ch, method, parts)
    assert code is grpc.StatusCode.PERMISSION_DENIED and "'gpu-1' claims to be 'gpu-2'" in details
    assert mesh.shadows() == (set(), set())


def test_a_listed_peers_large_volumes_still_arrive_in_parts(mesh: MeshHost) -> None:
    key = "sb-listed/tokenize/0"
    sent = [0]
    with mesh.channel("gpu-1") as ch:
        code, details = _chunked(ch, "RunShadowChunked",
                                 _counted(upload.run_parts(_with_volume(mesh, "gpu-1", key, ATTACK)), sent))
        try:
            assert code is grpc.StatusCode.OK, details
            assert sent[0] == 1 + 1 + ATTACK // MIB  # the request, the volume, and a MiB a part
            (token,) = (mesh.agent.state_dir / "shadow-volumes").glob("gpu-1/*/0/token")
            assert token.stat().st_size == ATTACK
        finally:
            _unary(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))
    assert mesh.shadows() == (set(), set())
