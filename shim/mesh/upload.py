"""Copied volumes over the mesh in small parts: split on the origin, put together on the host under its caps.

A container's copied volumes may hold tens of MiB, and a gRPC message is
read whole before a handler sees it, so a large message would be in the
host's memory before the host knew who sent it. They travel instead in
``RunShadowChunked`` and ``SyncVolumesChunked``, client streams whose handler
runs before any message is read: the peer is checked first, then each part
(``VolumeUpload``) is read, and its bytes are counted against the host's caps
as it arrives. The stream, in order::

    run | sync            the request, its volumes empty
    volume                a volume begins: container_path, single_file
      file                a file of it begins: path, mode, its first bytes
        data ...          the rest of that file's bytes
      file ...
    volume ...

``parts`` makes that sequence (pure); ``receive`` reads it into the
request's volumes, raising ``UploadRefused`` at the first part that breaks
the order and ``UploadTooLarge`` at the first part that takes the volumes
past a cap; it stops reading there, so a peer that sends more is not read
further. What the host does with the volumes (the path checks, writing them)
is ``shim.shadowhost.volumes``'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import grpc

from shim._pb import mesh_pb2 as pb
from shim.errors import WeftError

# The most bytes of file data one part carries: every message of a volume stream stays small.
CHUNK_BYTES = 1 << 20


class UploadRefused(WeftError):
    """A volume stream out of order: a file before its volume, data before its file, a second request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UploadTooLarge(UploadRefused):
    """A volume stream that takes a container's volumes past what the host keeps for one."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


@dataclass(frozen=True)
class UploadCaps:
    """What one container's copied volumes may hold, as the host counts them while they arrive."""

    max_bytes: int
    max_files: int
    chunk_bytes: int = CHUNK_BYTES


def parts(head: pb.VolumeUpload, volumes: Iterable[pb.Volume], chunk: int = CHUNK_BYTES) -> Iterator[pb.VolumeUpload]:
    """``head`` (the request, its volumes empty), then ``volumes`` in parts of at most ``chunk`` bytes of data."""
    yield head
    for v in volumes:
        yield pb.VolumeUpload(volume=pb.Volume(container_path=v.container_path, single_file=v.single_file))
        for f in v.files:
            data = f.data
            yield pb.VolumeUpload(file=pb.VolumeFile(path=f.path, mode=f.mode, data=data[:chunk]))
            for at in range(chunk, len(data), chunk):
                yield pb.VolumeUpload(data=data[at:at + chunk])


def run_parts(req: pb.RunShadowRequest, chunk: int = CHUNK_BYTES) -> Iterator[pb.VolumeUpload]:
    """RunShadowChunked's stream for ``req``: the request without its volumes, then the volumes."""
    head = pb.RunShadowRequest()
    head.CopyFrom(req)
    head.ClearField("volumes")
    return parts(pb.VolumeUpload(run=head), req.volumes, chunk)


def sync_parts(origin: str, key: str, volumes: Iterable[pb.Volume],
               chunk: int = CHUNK_BYTES) -> Iterator[pb.VolumeUpload]:
    """SyncVolumesChunked's stream."""
    return parts(pb.VolumeUpload(sync=pb.SyncVolumesRequest(origin_node=origin, key=key)), volumes, chunk)


def first(stream: Iterator[pb.VolumeUpload], kind: str) -> pb.VolumeUpload:
    """The stream's first part, which must be the request (``kind``: ``run`` or ``sync``) without volumes."""
    head = next(stream, None)
    if head is None or head.WhichOneof("part") != kind:
        got = "nothing" if head is None else head.WhichOneof("part")
        raise UploadRefused(f"a volume stream must begin with its request ({kind}), not {got}")
    if getattr(head, kind).volumes:
        raise UploadRefused(f"the first part ({kind}) of a volume stream carries no volumes; they follow in parts")
    return head


def receive(stream: Iterator[pb.VolumeUpload], into, caps: UploadCaps,
            take: Callable[[int], None] = lambda n: None) -> None:
    """Read the volume parts after the first into ``into`` (a request's repeated ``volumes``).

    ``take(n)`` is told of every ``n`` bytes before they are kept and raises
    to refuse them (the host's per-origin cap).
    """
    volume: pb.Volume | None = None
    file: pb.VolumeFile | None = None
    buf = bytearray()
    total = files = 0

    def add(data: bytes) -> None:
        nonlocal total
        if len(data) > caps.chunk_bytes:
            raise UploadTooLarge(f"a part of a volume stream carries at most {caps.chunk_bytes} bytes of data; "
                                 f"one for {_where(volume, file)} carries {len(data)}")
        total += len(data)
        if total > caps.max_bytes:
            raise UploadTooLarge(f"a hosted container's volumes may hold at most {caps.max_bytes >> 20} MiB; these "
                                 f"hold more ({total} bytes so far, at {_where(volume, file)})")
        take(len(data))
        buf.extend(data)

    def done() -> None:
        if file is not None:
            file.data = bytes(buf)
            buf.clear()

    for part in stream:
        kind = part.WhichOneof("part")
        if kind == "volume":
            done()
            if part.volume.files:
                raise UploadRefused(f"the volume part for {part.volume.container_path!r} carries files; they "
                                    "follow in file parts")
            volume, file = into.add(container_path=part.volume.container_path,
                                    single_file=part.volume.single_file), None
        elif kind == "file":
            if volume is None:
                raise UploadRefused("a file part came before any volume part")
            done()
            files += 1
            if files > caps.max_files:
                raise UploadTooLarge(f"a hosted container's volumes may hold at most {caps.max_files} files; "
                                     f"these hold more (at {volume.container_path})")
            file = volume.files.add(path=part.file.path, mode=part.file.mode)
            add(part.file.data)
        elif kind == "data":
            if file is None:
                raise UploadRefused("a data part came before any file part")
            add(part.data)
        else:
            raise UploadRefused(f"a volume stream carries one request, first; a {kind or 'empty'} part came after")
    done()


def _where(volume: pb.Volume | None, file: pb.VolumeFile | None) -> str:
    if volume is None:
        return "no volume"
    return f"{volume.container_path}" + (f", file {file.path!r}" if file is not None and file.path else "")
