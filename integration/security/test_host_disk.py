"""Nothing a host keeps for its peers is readable by others on it, or grows without bound.

- the agent's state directory is root's alone (0700) and its database, which
  holds remote containers' full configs (environment values from Secrets
  included), 0600; the copied volumes of shadows sit under 0700 directories,
  each on a tmpfs of its own (as kubelet keeps a Secret), unmounted with the
  shadow;
- an origin cannot fill the host's disk with copied volumes: each container's
  are capped, and all of one origin's together, as the parts arrive (a peer
  sending more is refused at the part over, and nothing of it is left: no
  tmpfs, no file, no shadow); nor through an emptyDir, held to its sizeLimit
  as kubelet holds one (the shadow stopped, ``Evicted``).
"""

from __future__ import annotations

import contextlib
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.localfabric.waiting import wait_for
from shim.mesh import upload

_HELLO = pb.HelloRequest(origin=pb.PeerState(node="gpu-1", role="gpu", healthy=True)).SerializeToString()


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ask(ch: grpc.Channel, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
        if method == "RunShadow" and request.volumes:  # as an origin sends them: in parts
            pb_grpc.MeshStub(ch).RunShadowChunked(upload.run_parts(request), timeout=300)
        else:
            ch.unary_unary(MESH + method)(request.SerializeToString(), timeout=300)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        return e.code(), e.details() or ""


def _with_volume(mesh: MeshHost, key: str, size: int) -> pb.RunShadowRequest:
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox=key.split("/")[0])
    req.volumes.add(container_path="/etc/secret", files=[pb.VolumeFile(path="token", data=b"s" * size, mode=0o644)])
    return req


def test_state_and_copied_secrets_are_roots_alone(mesh: MeshHost) -> None:
    key = "origin-sb-disk/tokenize/0"
    with mesh.channel("gpu-1") as ch:
        code, details = _ask(ch, "RunShadow", _with_volume(mesh, key, 16))
        try:
            assert code is grpc.StatusCode.OK, details
            state = mesh.agent.state_dir
            assert _mode(state) == 0o700
            assert [(f.name, _mode(f)) for f in sorted(state.glob("agent.db*"))] == [
                (f.name, 0o600) for f in sorted(state.glob("agent.db*"))]
            assert _mode(state / "agent.db") == 0o600
            volumes = state / "shadow-volumes"
            assert _mode(volumes) == 0o700 and _mode(volumes / "gpu-1") == 0o700
        finally:
            _ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))


def _filesystems_under(base: Path) -> dict[Path, str]:
    """Mount point -> filesystem type, for the mounts at or under ``base``."""
    out = {}
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        point = Path(fields[4].replace("\\040", " "))
        if point == base or base in point.parents:
            out[point] = fields[fields.index("-") + 1]
    return out


def test_a_copied_secret_is_kept_in_memory_never_on_the_hosts_disk(mesh: MeshHost) -> None:
    key = "origin-sb-tmpfs/tokenize/0"
    volumes = mesh.agent.state_dir / "shadow-volumes"
    with mesh.channel("gpu-1") as ch:
        code, details = _ask(ch, "RunShadow", _with_volume(mesh, key, 16))
        try:
            assert code is grpc.StatusCode.OK, details
            (token,) = volumes.glob("gpu-1/*/0/token")
            assert token.read_bytes() == b"s" * 16
            assert _filesystems_under(volumes) == {token.parent: "tmpfs"}
        finally:
            _ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))
    assert _filesystems_under(volumes) == {} and not list(volumes.glob("gpu-1/*"))


def test_an_origin_cannot_fill_the_hosts_disk_with_copied_volumes(mesh: MeshHost) -> None:
    keys = [f"origin-sb-fill{i}/tokenize/0" for i in range(5)]
    answers = []
    with mesh.channel("gpu-1") as ch:
        try:
            for key in keys:  # 60 MiB each, under the per-container cap: the fifth takes the origin past 256 MiB
                answers.append(_ask(ch, "RunShadow", _with_volume(mesh, key, 60 << 20)))
        finally:
            for key in keys:
                _ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))
    assert [code for code, _ in answers[:4]] == [grpc.StatusCode.OK] * 4, answers
    code, details = answers[4]
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and "origin's hosted containers' volumes" in details
    assert mesh.shadows()[1] == set()
    volumes = mesh.agent.state_dir / "shadow-volumes"
    assert _filesystems_under(volumes) == {} and not list(volumes.glob("gpu-1/*"))


def _endless(mesh: MeshHost, key: str, sent: list[int]):
    """A RunShadowChunked stream that never stops sending a MiB more of one file."""
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox=key.split("/")[0])
    yield pb.VolumeUpload(run=req)
    yield pb.VolumeUpload(volume=pb.Volume(container_path="/etc/secret"))
    yield pb.VolumeUpload(file=pb.VolumeFile(path="token"))
    while True:
        sent[0] += 1
        yield pb.VolumeUpload(data=b"s" * (1 << 20))


def test_a_peer_sending_past_a_containers_cap_is_refused_as_it_sends_and_nothing_is_left(mesh: MeshHost) -> None:
    key = "origin-sb-over/tokenize/0"
    sent = [0]
    with mesh.channel("gpu-1") as ch:
        try:
            pb_grpc.MeshStub(ch).RunShadowChunked(_endless(mesh, key, sent), timeout=300)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
        _ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "a hosted container's volumes may hold at most 64 MiB" in details and "/etc/secret" in details, details
    assert 64 < sent[0] < 96  # refused at the MiB over the cap, not after the peer stopped (it never does)
    volumes = mesh.agent.state_dir / "shadow-volumes"
    assert _filesystems_under(volumes) == {} and not list(volumes.glob("gpu-1/*"))
    assert mesh.shadows() == (set(), set())


def _filler(mesh: MeshHost, key: str, writes_mib: int, limit_mib: int) -> pb.RunShadowRequest:
    """A started shadow that writes ``writes_mib`` into an emptyDir at /scratch limited to ``limit_mib``."""
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox=key.split("/")[0])
    config = cri.ContainerConfig.FromString(req.container_config)
    config.command[:] = ["sh", "-c", f"dd if=/dev/zero of=/scratch/f bs=1M count={writes_mib} && exec sleep 3600"]
    req.container_config, req.start = config.SerializeToString(), True
    req.empty_dirs.add(container_path="/scratch", size_limit=limit_mib << 20)
    return req


def _status(ch: grpc.Channel, ref: pb.ShadowRef) -> cri.ContainerStatus:
    """The shadow's status, after a Hello: the origin is there, so nothing is fenced meanwhile."""
    ch.unary_unary(MESH + "Hello")(_HELLO, timeout=10)
    raw = ch.unary_unary(MESH + "ShadowStatus")(ref.SerializeToString(), timeout=30)
    return cri.ContainerStatus.FromString(pb.ShadowState.FromString(raw).status)


@contextlib.contextmanager
def _filling(mesh: MeshHost, key: str, *, writes_mib: int,
             limit_mib: int) -> Iterator[Callable[[], cri.ContainerStatus]]:
    """The filler shadow run (RunShadow must succeed) and removed on leaving; yields a reader of its status."""
    ref = pb.ShadowRef(origin_node="gpu-1", key=key)
    with mesh.channel("gpu-1") as ch:
        code, details = _ask(ch, "RunShadow", _filler(mesh, key, writes_mib=writes_mib, limit_mib=limit_mib))
        try:
            assert code is grpc.StatusCode.OK, details
            yield lambda: _status(ch, ref)
        finally:
            _ask(ch, "RemoveShadow", ref)


def test_an_empty_dir_past_its_size_limit_stops_the_shadow_as_kubelet_evicts(mesh: MeshHost) -> None:
    with _filling(mesh, "origin-sb-scratch/filler/0", writes_mib=4, limit_mib=1) as status_now:
        status = wait_for(lambda: (s := status_now()).state == cri.CONTAINER_EXITED and s, timeout=60,
                          what="the shadow stopped for its emptyDir", every=0.5)
        assert status.reason == "Evicted" and "/scratch" in status.message and "sizeLimit" in status.message


def test_an_empty_dir_within_its_size_limit_is_left_alone(mesh: MeshHost) -> None:
    with _filling(mesh, "origin-sb-scratch-ok/filler/0", writes_mib=1, limit_mib=4) as status_now:
        for _ in range(12):  # two rounds of the host's check, and more
            status_now()
            time.sleep(1)
        status = status_now()
        assert status.state == cri.CONTAINER_RUNNING, (status.reason, status.message, status.exit_code)
