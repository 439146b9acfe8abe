from cri_api.v1 import api_pb2 as cri

from shim.core.baseline import DEFAULT_MASKED_PATHS, DEFAULT_READONLY_PATHS
from shim.crishared.baseline import hosted_container, hosted_sandbox

UNCONFINED = cri.SecurityProfile(profile_type=cri.SecurityProfile.Unconfined)
DEFAULT = cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault)


def _hostile() -> tuple[cri.PodSandboxConfig, cri.ContainerConfig]:
    sandbox = cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name="p", uid="u", namespace="n"), hostname="p",
        labels={"app": "x", "weft.io/origin-node": "liar"},
        annotations={"kubernetes.io/config.source": "api", "cdi.k8s.io/x": "vendor.com/gpu=all",
                     "weft.io/lease": "l-1", "io.kubernetes.cri.untrusted-workload": "true"})
    psc = sandbox.linux.security_context
    psc.seccomp.CopyFrom(UNCONFINED)
    psc.apparmor.CopyFrom(UNCONFINED)
    psc.seccomp_profile_path = "unconfined"
    sandbox.linux.overhead.memory_limit_in_bytes = 1
    sandbox.port_mappings.add(container_port=80, host_port=80)
    config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="c"), image=cri.ImageSpec(image="busybox",
                                 runtime_handler="other"), command=["sh"], log_path="c/0.log",
                                 labels={"weft.io/origin-key": "k"},
                                 annotations={"io.kubernetes.container.hash": "1", "cdi.k8s.io/y": "z"})
    sc = config.linux.security_context
    sc.seccomp.CopyFrom(UNCONFINED)
    sc.apparmor.CopyFrom(UNCONFINED)
    sc.apparmor_profile = "unconfined"
    sc.seccomp_profile_path = "unconfined"
    sc.masked_paths[:] = ["/nothing"]
    sc.no_new_privs = True
    res = config.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes, res.oom_score_adj = 100000, 50000, 1 << 30, -1000
    res.unified["memory.max"] = "max"
    res.cpuset_cpus = "0"
    config.CDI_devices.add(name="vendor.com/gpu=all")
    return sandbox, config


def test_the_hosted_container_is_built_from_what_a_host_allows() -> None:
    _, config = _hostile()
    out = hosted_container(config, 1000)
    sc = out.linux.security_context
    assert sc.seccomp == DEFAULT and not sc.seccomp_profile_path
    assert not sc.HasField("apparmor") and not sc.apparmor_profile
    assert list(sc.masked_paths) == [*DEFAULT_MASKED_PATHS, "/nothing"]
    assert list(sc.readonly_paths) == list(DEFAULT_READONLY_PATHS)
    assert sc.no_new_privs
    assert dict(out.annotations) == {"io.kubernetes.container.hash": "1"} and dict(out.labels) == {}
    res = out.linux.resources
    assert (res.cpu_quota, res.memory_limit_in_bytes, res.oom_score_adj) == (50000, 1 << 30, 1000)
    assert not res.unified and not res.cpuset_cpus and not out.CDI_devices
    assert out.image == cri.ImageSpec(image="busybox") and list(out.command) == ["sh"]


def test_the_hosted_sandbox_is_built_from_what_a_host_allows() -> None:
    sandbox, _ = _hostile()
    out = hosted_sandbox(sandbox)
    psc = out.linux.security_context
    assert psc.seccomp == DEFAULT and not psc.HasField("apparmor") and not psc.seccomp_profile_path
    assert dict(out.labels) == {"app": "x"}
    assert dict(out.annotations) == {"kubernetes.io/config.source": "api"}
    assert not out.port_mappings and not out.linux.HasField("overhead")
    assert out.metadata == sandbox.metadata and out.hostname == "p"


def test_an_update_is_clamped_to_what_the_shadow_was_admitted_with() -> None:
    from shim.shadowhost.calls import clamped

    c = cri.Container(annotations={"weft.io/hosted-cpu-limit": "0.5", "weft.io/hosted-memory-limit": str(1 << 30)})
    asked = cri.LinuxContainerResources(cpu_period=100000, cpu_quota=400000, memory_limit_in_bytes=8 << 30,
                                        cpu_shares=1024, oom_score_adj=-1000, cpuset_cpus="0")
    asked.unified["memory.max"] = "max"
    out = clamped(asked, c)
    assert (out.cpu_quota, out.memory_limit_in_bytes, out.cpu_shares, out.oom_score_adj) == (50000, 1 << 30, 2, 1000)
    assert not out.unified and not out.cpuset_cpus
    smaller = clamped(cri.LinuxContainerResources(cpu_period=100000, cpu_quota=20000, memory_limit_in_bytes=1 << 20), c)
    assert (smaller.cpu_quota, smaller.memory_limit_in_bytes) == (20000, 1 << 20)
    unlimited = clamped(cri.LinuxContainerResources(), c)
    assert (unlimited.cpu_period, unlimited.cpu_quota, unlimited.memory_limit_in_bytes) == (100000, 50000, 1 << 30)


def test_an_update_keeps_a_reserved_shadow_s_weight_at_most_what_it_was_made_with() -> None:
    from shim.shadowhost.calls import clamped

    c = cri.Container(annotations={"weft.io/hosted-cpu-limit": "1", "weft.io/hosted-cpu-shares": "512"})
    assert clamped(cri.LinuxContainerResources(cpu_shares=4096), c).cpu_shares == 512  # never raised
    assert clamped(cri.LinuxContainerResources(cpu_shares=256), c).cpu_shares == 256  # a resize down lowers it
    assert clamped(cri.LinuxContainerResources(), c).cpu_shares == 512  # not said: kept
    assert clamped(cri.LinuxContainerResources(cpu_shares=1), c).cpu_shares == 2  # never under the floor


def test_only_what_bears_this_hosts_mark_is_a_shadow(tmp_path) -> None:
    from shim.crishared.mark import MARK_LABEL, ShadowMark

    mark = ShadowMark.load(tmp_path)
    assert (tmp_path / "shadow-mark.key").stat().st_mode & 0o777 == 0o600
    assert ShadowMark.load(tmp_path).sandbox("gpu-1", "u") == mark.sandbox("gpu-1", "u")  # the same key again
    real = {"weft.io/origin-node": "gpu-1", MARK_LABEL: mark.sandbox("gpu-1", "u-shadow")}
    assert mark.is_sandbox(real, "u-shadow")
    assert not mark.is_sandbox(real, "other-uid")  # a mark copied onto another pod
    assert not mark.is_sandbox({"weft.io/origin-node": "gpu-1", MARK_LABEL: "0" * 40}, "u-shadow")
    assert not mark.is_sandbox({MARK_LABEL: mark.sandbox("gpu-1", "u-shadow")}, "u-shadow")
    other = ShadowMark.load(tmp_path / "other-host")
    assert not other.is_sandbox(real, "u-shadow")
    c = {"weft.io/origin-node": "gpu-1", "weft.io/origin-key": "k", MARK_LABEL: mark.container("gpu-1", "k")}
    assert mark.is_container(c) and not mark.is_container({**c, "weft.io/origin-key": "k2"})
