"""Copied volumes in parts: split small on the origin, put together on the host, refused at the part over a cap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from shim._pb import mesh_pb2 as pb
from shim.mesh import upload
from shim.mesh.upload import UploadCaps, UploadRefused, UploadTooLarge

MIB = 1 << 20
CAPS = UploadCaps(max_bytes=64 * MIB, max_files=4096)


def _volumes() -> list[pb.Volume]:
    return [pb.Volume(container_path="/etc/app", files=[
                pb.VolumeFile(path="big.bin", data=bytes(range(256)) * (10 * 4096 + 7), mode=0o600),  # 10 MiB odd
                pb.VolumeFile(path="empty", data=b""),
                pb.VolumeFile(path="sub/small.conf", data=b"level=info\n", mode=0o644)]),
            pb.Volume(container_path="/etc/hosts", single_file=True, files=[pb.VolumeFile(data=b"127.0.0.1 x\n")]),
            pb.Volume(container_path="/etc/none")]


def _request() -> pb.RunShadowRequest:
    return pb.RunShadowRequest(origin_node="gpu-1", key="sb/app/0", container_config=b"cfg", volumes=_volumes())


def _received(stream: Iterator[pb.VolumeUpload], kind: str = "run", caps: UploadCaps = CAPS, take=lambda n: None):
    head = getattr(upload.first(stream, kind), kind)
    upload.receive(stream, head.volumes, caps, take)
    return head


def test_a_request_with_volumes_arrives_whole_from_parts_none_over_a_mib() -> None:
    sent = list(upload.run_parts(_request()))
    assert sent[0].WhichOneof("part") == "run" and not sent[0].run.volumes
    assert max(len(p.data) + len(p.file.data) for p in sent) == MIB
    assert max(p.ByteSize() for p in sent[1:]) < MIB + 64
    assert [p.WhichOneof("part") for p in sent[:4]] == ["run", "volume", "file", "data"]
    assert _received(iter(sent)) == _request()


def test_sync_volumes_arrive_whole_from_parts() -> None:
    head = _received(upload.sync_parts("gpu-1", "sb/app/0", _volumes()), "sync")
    assert head == pb.SyncVolumesRequest(origin_node="gpu-1", key="sb/app/0", volumes=_volumes())


def _endless(first: pb.VolumeUpload, pulled: list[int]) -> Iterator[pb.VolumeUpload]:
    """A peer that never stops sending a MiB more; ``pulled`` counts the parts read."""
    for p in (first, pb.VolumeUpload(volume=pb.Volume(container_path="/etc/secret")),
              pb.VolumeUpload(file=pb.VolumeFile(path="token"))):
        pulled[0] += 1
        yield p
    while True:
        pulled[0] += 1
        yield pb.VolumeUpload(data=b"s" * MIB)


def test_a_peer_sending_past_a_containers_cap_is_refused_at_that_part_and_not_read_further() -> None:
    pulled = [0]
    with pytest.raises(UploadTooLarge, match=r"at most 64 MiB; these hold more \(68157440 bytes so far, at "
                                             r"/etc/secret, file 'token'\)"):
        _received(_endless(pb.VolumeUpload(run=pb.RunShadowRequest(key="k")), pulled))
    assert pulled[0] == 3 + 65  # the request, the volume, the file, 64 MiB, and the MiB that took it past


def test_the_origins_cap_is_asked_for_every_part_before_it_is_kept() -> None:
    taken: list[int] = []

    def take(n: int) -> None:
        if sum(taken) + n > 3 * MIB:
            raise UploadTooLarge("the origin's cap")
        taken.append(n)

    pulled = [0]
    with pytest.raises(UploadTooLarge, match="the origin's cap"):
        _received(_endless(pb.VolumeUpload(run=pb.RunShadowRequest(key="k")), pulled), take=take)
    assert taken == [0, MIB, MIB, MIB] and pulled[0] == 3 + 4


def test_too_many_files_are_refused_at_the_one_over() -> None:
    many = [pb.Volume(container_path="/v", files=[pb.VolumeFile(path=f"f{i}") for i in range(5)])]
    with pytest.raises(UploadTooLarge, match="at most 4 files; these hold more"):
        _received(upload.parts(pb.VolumeUpload(run=pb.RunShadowRequest()), many), caps=UploadCaps(64 * MIB, 4))


def test_a_part_with_more_than_a_chunk_of_data_is_refused() -> None:
    stream = upload.parts(pb.VolumeUpload(run=pb.RunShadowRequest()), _volumes(), chunk=2 * MIB)
    with pytest.raises(UploadTooLarge, match=r"at most 1048576 bytes of data; one for /etc/app, file 'big.bin' "
                                             r"carries 2097152"):
        _received(stream)


@pytest.mark.parametrize(("parts", "message"), [
    pytest.param([], "must begin with its request (run), not nothing", id="empty-stream"),
    pytest.param([pb.VolumeUpload(volume=pb.Volume(container_path="/v"))], "must begin with its request (run), "
                 "not volume", id="no-request-first"),
    pytest.param([pb.VolumeUpload(run=pb.RunShadowRequest(volumes=[pb.Volume(container_path="/v")]))],
                 "carries no volumes; they follow in parts", id="volumes-in-the-request"),
    pytest.param([pb.VolumeUpload(run=pb.RunShadowRequest()), pb.VolumeUpload(file=pb.VolumeFile(path="a"))],
                 "a file part came before any volume part", id="file-before-volume"),
    pytest.param([pb.VolumeUpload(run=pb.RunShadowRequest()), pb.VolumeUpload(volume=pb.Volume(container_path="/v")),
                  pb.VolumeUpload(data=b"x")], "a data part came before any file part", id="data-before-file"),
    pytest.param([pb.VolumeUpload(run=pb.RunShadowRequest()), pb.VolumeUpload(run=pb.RunShadowRequest())],
                 "one request, first; a run part came after", id="a-second-request"),
    pytest.param([pb.VolumeUpload(run=pb.RunShadowRequest()), pb.VolumeUpload(volume=pb.Volume(
        container_path="/v", files=[pb.VolumeFile(path="a")]))], "carries files; they follow", id="files-in-a-volume"),
])
def test_a_stream_out_of_order_is_refused(parts: list[pb.VolumeUpload], message: str) -> None:
    with pytest.raises(UploadRefused) as caught:
        _received(iter(parts))
    assert message in caught.value.message and type(caught.value) is UploadRefused
