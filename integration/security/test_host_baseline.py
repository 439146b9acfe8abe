"""A host runs for a peer only what a baseline pod may run, whatever the peer asks.

The attacks are RunShadow requests a node holding a valid mesh certificate
can send: capabilities beyond the baseline set, seccomp and AppArmor
unconfined (in the profile fields and the deprecated path fields), the
masked and read-only ``/proc`` paths replaced, SELinux options, unsafe
sysctls, another container's namespace by its ID, an
OOM score that makes the shadow the last the kernel kills, and annotations
the runtime interprets. Each is refused (PERMISSION_DENIED, and nothing runs)
or, for the fields a host sets itself, has no effect inside the container.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration.fuzz.mesh_fixture import MeshHost, ask, run_shadow_request, running_shadow
from shim._pb import mesh_pb2 as pb

UNCONFINED = cri.SecurityProfile(profile_type=cri.SecurityProfile.Unconfined)
# CapEff of a container with the runtime's default capabilities (containerd's default set).
DEFAULT_CAPS = 0x00000000A80425FB


def _request(mesh: MeshHost, name: str) -> tuple[pb.RunShadowRequest, cri.PodSandboxConfig, cri.ContainerConfig]:
    req = run_shadow_request(mesh.containerd, "gpu-1", f"origin-sb-1/{name}/0")
    return req, cri.PodSandboxConfig.FromString(req.sandbox_config), cri.ContainerConfig.FromString(
        req.container_config)


def _beyond(field: str, mesh: MeshHost) -> pb.RunShadowRequest:
    req, sandbox, config = _request(mesh, field)
    sc, psc = config.linux.security_context, sandbox.linux.security_context
    match field:
        case "cap-all":
            sc.capabilities.add_capabilities.append("ALL")
        case "cap-sys-admin":
            sc.capabilities.add_capabilities.append("CAP_SYS_ADMIN")
        case "ambient-net-admin":
            sc.capabilities.add_ambient_capabilities.append("NET_ADMIN")
        case "selinux-spc":
            sc.selinux_options.type = "spc_t"
        case "sandbox-selinux-user":
            psc.selinux_options.user = "system_u"
        case "unsafe-sysctl":
            sandbox.linux.sysctls["kernel.msgmax"] = "65536"
        case "target-pid":
            sc.namespace_options.pid = cri.TARGET
            sc.namespace_options.target_id = "0" * 64
    req.sandbox_config, req.container_config = sandbox.SerializeToString(), config.SerializeToString()
    return req


@pytest.mark.parametrize("field", ["cap-all", "cap-sys-admin", "ambient-net-admin", "selinux-spc",
                                   "sandbox-selinux-user", "unsafe-sysctl", "target-pid"])
def test_a_host_refuses_what_a_baseline_pod_may_not_do(mesh: MeshHost, field: str) -> None:
    with mesh.channel("gpu-1") as ch:
        code, details, _ = ask(ch, "RunShadow", _beyond(field, mesh))
        if code is grpc.StatusCode.OK:
            ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=f"origin-sb-1/{field}/0"))
    assert code is grpc.StatusCode.PERMISSION_DENIED, (code, details)
    assert "never runs a rerouted container with what a baseline pod may not do" in details
    assert mesh.shadows() == (set(), set())


@pytest.fixture
def unconfined_shadow(mesh: MeshHost) -> Iterator[tuple[str, cri.ContainerStatus]]:
    """A running shadow whose request asked for everything a host sets itself to be loosened."""
    req, sandbox, config = _request(mesh, "unconfined")
    for sc in (config.linux.security_context, sandbox.linux.security_context):
        sc.seccomp.CopyFrom(UNCONFINED)
        sc.apparmor.CopyFrom(UNCONFINED)
        sc.seccomp_profile_path = "unconfined"
    sc = config.linux.security_context
    sc.apparmor_profile = "unconfined"
    sc.masked_paths[:] = ["/weft-nothing"]
    sc.readonly_paths[:] = ["/weft-nothing"]
    config.linux.resources.oom_score_adj = -1000
    config.annotations["cdi.k8s.io/weft-test"] = "vendor.com/device=all"
    sandbox.annotations["io.kubernetes.cri.untrusted-workload"] = "false"
    config.labels["weft.io/origin-node"] = "someone-else"
    req.sandbox_config, req.container_config = sandbox.SerializeToString(), config.SerializeToString()
    req.start = True
    with running_shadow(mesh, req) as state:
        yield state.shadow_container_id, cri.ContainerStatus.FromString(state.status)


def _exec(mesh: MeshHost, container_id: str, script: str) -> tuple[int, str]:
    with mesh.containerd.channel() as ch:
        got = cri_grpc.RuntimeServiceStub(ch).ExecSync(cri.ExecSyncRequest(
            container_id=container_id, cmd=["sh", "-c", script], timeout=30), timeout=60)
    return got.exit_code, (got.stdout + got.stderr).decode(errors="replace")


def test_a_shadow_is_confined_whatever_its_request_loosened(mesh: MeshHost, unconfined_shadow) -> None:
    cid, status = unconfined_shadow
    _, proc_status = _exec(mesh, cid, "cat /proc/self/status")
    fields = dict(line.split(":\t", 1) for line in proc_status.splitlines() if ":\t" in line)
    assert fields["Seccomp"].strip() == "2", proc_status  # filtered by the runtime's default profile
    assert int(fields["CapEff"].strip(), 16) == DEFAULT_CAPS
    # /proc/sys read-only (no global kernel setting such as core_pattern can be written), /proc/keys masked.
    _, mounts = _exec(mesh, cid, "cat /proc/mounts")
    proc_sys = [line.split() for line in mounts.splitlines() if line.split()[1:2] == ["/proc/sys"]]
    assert proc_sys and "ro" in proc_sys[-1][3].split(","), mounts
    assert [line for line in mounts.splitlines() if line.split()[1:2] == ["/proc/keys"]], mounts
    code, out = _exec(mesh, cid, "mkdir -p /m && mount -t tmpfs none /m")
    assert code != 0, out
    _, score = _exec(mesh, cid, "cat /proc/self/oom_score_adj")
    assert score.strip() == "1000"
    assert "cdi.k8s.io/weft-test" not in status.annotations
    assert status.labels["weft.io/origin-node"] == "gpu-1"


def test_a_restricted_pods_shadow_keeps_everything_its_pod_narrowed(mesh: MeshHost) -> None:
    """What kubelet asks for a container of a pod that meets "restricted" is what the host runs: the host builds
    the container from an allowlist but keeps every narrowing (capabilities dropped, a non-root user and group,
    no_new_privs, a read-only root)."""
    req, _, config = _request(mesh, "restricted")
    sc = config.linux.security_context
    sc.capabilities.drop_capabilities[:] = ["ALL"]
    sc.capabilities.add_capabilities[:] = ["NET_BIND_SERVICE"]
    sc.run_as_user.value = 1000
    sc.run_as_group.value = 1000
    sc.no_new_privs = True
    sc.readonly_rootfs = True
    sc.seccomp.CopyFrom(cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault))
    req.container_config = config.SerializeToString()
    req.start = True
    with running_shadow(mesh, req) as state:
        cid = state.shadow_container_id
        _, proc_status = _exec(mesh, cid, "cat /proc/self/status")
        fields = {k: v.strip() for k, v in (line.split(":\t", 1) for line in proc_status.splitlines()
                                             if ":\t" in line)}
        assert fields["Uid"].split()[:2] == ["1000", "1000"] and fields["Gid"].split()[:2] == ["1000", "1000"]
        assert int(fields["CapBnd"], 16) == 1 << 10, proc_status  # CAP_NET_BIND_SERVICE alone
        assert int(fields["CapEff"], 16) == 0
        assert fields["NoNewPrivs"] == "1" and fields["Seccomp"] == "2", proc_status
        code_w, out = _exec(mesh, cid, "touch /weft-written")
        assert code_w != 0 and "Read-only file system" in out, out
