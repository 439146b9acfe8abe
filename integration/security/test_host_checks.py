"""A host checks what a peer asks of it, and keeps what it admitted.

Attacks a node with a valid mesh certificate can make on a CPU host:

- a pod UID that climbs out of the host's shadow cgroup parent
  (``../../../x``), with RunShadow and with a sandbox prepared ahead;
- a sandbox cgroup parent spelled as a systemd slice sent to a host whose
  containerd runs cgroupfs: the host spells the shadow's cgroup its own way;
- RunShadow without Admit, for a container with no CPU limit or with more
  than the host has: it would have run unlimited;
- UpdateContainerResources through ShadowCall lifting a shadow past what the
  host can admit (or to unlimited), or setting its OOM score so the kernel
  kills the host's own pods first.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from integration.fuzz.mesh_fixture import MeshHost, ask, run_shadow_request, running_shadow
from shim._pb import mesh_pb2 as pb

# Where "/weft-shadows/pod" + "../../../x" + "-shadow" lands: the cgroup root itself.
ESCAPED = [Path(f"/sys/fs/cgroup/{c}/x-shadow") for c in ("cpu", "memory", "pids")]


@pytest.mark.parametrize("sandbox_only", [False, True], ids=["run-shadow", "prepared-sandbox"])
def test_a_pod_uid_cannot_put_a_shadow_outside_the_hosts_cgroup_parent(mesh: MeshHost, sandbox_only: bool) -> None:
    before = {p for p in ESCAPED if p.exists()}
    req = run_shadow_request(mesh.containerd, "gpu-1", "origin-sb-uid/tokenize/0", sandbox="origin-sb-uid")
    sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
    sandbox.metadata.uid = "../../../x"
    req.sandbox_config = sandbox.SerializeToString()
    req.start = True
    req.sandbox_only = sandbox_only
    with mesh.channel("gpu-1") as ch:
        code, details, _ = ask(ch, "RunShadow", req)
        escaped = [p for p in ESCAPED if p.exists() and p not in before]
        ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=req.key))
        leftover = mesh.shadows()
    assert code is grpc.StatusCode.PERMISSION_DENIED, (code, details, escaped)
    assert "is not a UID" in details
    assert escaped == [] and leftover == (set(), set())


def test_an_origins_slice_parent_does_not_choose_how_the_host_spells_the_shadows_cgroup(mesh: MeshHost) -> None:
    slices = {c: set(Path(f"/sys/fs/cgroup/{c}").glob("*.slice")) for c in ("cpu", "memory", "pids")}
    req = run_shadow_request(mesh.containerd, "gpu-1", "origin-sb-slice/tokenize/0", sandbox="origin-sb-slice")
    sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
    sandbox.linux.cgroup_parent = "kubepods-besteffort.slice"
    req.sandbox_config = sandbox.SerializeToString()
    req.start = True
    with running_shadow(mesh, req) as state:
        cid = state.shadow_container_id
        # Under the host's own parent in every hierarchy, where the shadows' group weight counts.
        for controller, name in (("cpu", "cpu.shares"), ("memory", "memory.limit_in_bytes"), ("pids", "pids.max")):
            found = list(Path(f"/sys/fs/cgroup/{controller}/weft-shadows").glob(f"pod*/{cid}/{name}"))
            assert found, (controller, cid)
        made = {c: set(Path(f"/sys/fs/cgroup/{c}").glob("*.slice")) - slices[c] for c in slices}
        assert made == {c: set() for c in slices}


def _limits(req: pb.RunShadowRequest, cpu_quota: int, memory: int) -> pb.RunShadowRequest:
    config = cri.ContainerConfig.FromString(req.container_config)
    config.linux.resources.cpu_period, config.linux.resources.cpu_quota = 100000, cpu_quota
    config.linux.resources.memory_limit_in_bytes = memory
    req.container_config = config.SerializeToString()
    return req


@pytest.mark.parametrize(("cpu_quota", "memory", "reason"), [
    (0, 64 << 20, "no-limits"),
    (0, 0, "no-limits"),
    (64 * 100000, 64 << 20, "insufficient-cpu"),
    (10000, 1 << 50, "insufficient-memory"),
], ids=["no-cpu-limit", "no-limits", "more-cpu-than-the-host", "more-memory-than-the-host"])
def test_run_shadow_admits_again_whatever_the_origin_skipped(mesh: MeshHost, cpu_quota: int, memory: int,
                                                              reason: str) -> None:
    req = _limits(run_shadow_request(mesh.containerd, "gpu-1", "origin-sb-adm/tokenize/0", sandbox="origin-sb-adm"),
                  cpu_quota, memory)
    req.start = True
    with mesh.channel("gpu-1") as ch:
        code, details, _ = ask(ch, "RunShadow", req)
        ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=req.key))
        leftover = mesh.shadows()
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
    assert f"does not admit it now ({reason}" in details
    assert leftover[1] == set()


@pytest.fixture
def admitted(mesh: MeshHost) -> Iterator[tuple[grpc.Channel, str, str]]:
    """A running shadow admitted with 0.1 core and 64 MiB (the fixture's request)."""
    key = "origin-sb-upd/tokenize/0"
    req = run_shadow_request(mesh.containerd, "gpu-1", key, sandbox="origin-sb-upd")
    req.start = True
    with mesh.channel("gpu-1") as ch:
        code, details, raw = ask(ch, "RunShadow", req)
        assert code is grpc.StatusCode.OK, details
        try:
            yield ch, key, pb.ShadowState.FromString(raw).shadow_container_id
        finally:
            ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=key))


def _cgroup(container_id: str, controller: str, name: str) -> int:
    found = list(Path(f"/sys/fs/cgroup/{controller}/weft-shadows").glob(f"*/{container_id}/{name}"))
    assert found, (controller, container_id)
    return int(found[0].read_text().split()[0])


# The fixture's host has 8 cores and 32 GiB: "larger" cannot be admitted and leaves the shadow as admitted;
# a resize that can be (kubelet resizing a pod in place) is applied.
@pytest.mark.parametrize(("cpu_quota", "memory", "expected"), [
    (0, 0, (10000, 64 << 20)),
    (64 * 100000, 1 << 40, (10000, 64 << 20)),
    (20000, 96 << 20, (20000, 96 << 20)),
], ids=["unlimited", "larger-than-the-host", "admitted-resize"])
def test_update_container_resources_cannot_lift_a_shadow_past_what_the_host_admits(
        admitted, cpu_quota: int, memory: int, expected: tuple[int, int]) -> None:
    ch, key, cid = admitted
    update = cri.UpdateContainerResourcesRequest(linux=cri.LinuxContainerResources(
        cpu_period=100000, cpu_quota=cpu_quota, memory_limit_in_bytes=memory, cpu_shares=1024, oom_score_adj=-1000))
    code, details, _ = ask(ch, "ShadowCall", pb.ShadowCallRequest(
        origin_node="gpu-1", key=key, method="UpdateContainerResources", request=update.SerializeToString()))
    assert code is grpc.StatusCode.OK, details
    got = (_cgroup(cid, "cpu", "cpu.cfs_quota_us"), _cgroup(cid, "memory", "memory.limit_in_bytes"))
    assert got == expected
    assert _cgroup(cid, "cpu", "cpu.shares") == 2
