"""Nothing a host keeps for its peers is readable by others on it, or grows without bound.

- the agent's state directory is root's alone (0700) and its database, which
  holds remote containers' full configs (environment values from Secrets
  included), 0600; the copied volumes of shadows sit under 0700 directories,
  each on a tmpfs of its own (as kubelet keeps a Secret), unmounted with the
  shadow;
- an origin cannot fill the host's disk with copied volumes: each container's
  are capped, and all of one origin's together.
"""

from __future__ import annotations

import stat
from pathlib import Path

import grpc

from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _ask(ch: grpc.Channel, method: str, request) -> tuple[grpc.StatusCode, str]:
    try:
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
