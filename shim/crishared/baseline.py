"""A rerouted container as a host runs it: checked against the baseline Pod Security Standard and rebuilt.

``security_facts`` reads what ``shim.core.baseline`` judges from kubelet's
configs (the origin, before it reroutes; the host, on what it is asked).
``hosted_configs`` builds the sandbox and container configs a host gives its
containerd from an allowlist of fields, never by passing the request through:
a field this code does not know (a new CRI field, a deprecated profile path,
a cgroup ``unified`` key, a CDI device, a runtime-interpreted annotation) does
not reach the runtime. Seccomp and AppArmor are the runtime's defaults and
the default ``/proc`` paths are masked and read-only, whatever was asked
(AppArmor by leaving it unset, which containerd reads as its default);
``no_new_privs``, the users and groups, and a read-only root are kept.
"""

from __future__ import annotations

from cri_api.v1 import api_pb2 as cri

from shim.core.baseline import (
    DEFAULT_MASKED_PATHS,
    DEFAULT_READONLY_PATHS,
    SAFE_SYSCTLS,
    BaselineDecision,
    SecurityFacts,
    check_baseline,
)

# Annotations a host keeps: kubelet's own, which containerd copies into the OCI spec for tools to read and
# nothing interprets. Anything else (cdi.k8s.io/*, io.kubernetes.cri.*, runtime-specific keys, weft.io/*)
# could mean something to the host's runtime, hook or weft itself.
_KEPT_ANNOTATION_PREFIXES = ("io.kubernetes.container.", "io.kubernetes.pod.", "kubernetes.io/config.")
WEFT_PREFIX = "weft.io/"


def security_facts(config: cri.ContainerConfig, sandbox: cri.PodSandboxConfig) -> SecurityFacts:
    sc, psc = config.linux.security_context, sandbox.linux.security_context
    selinux = tuple((o.user, o.role, o.type) for o in (sc.selinux_options, psc.selinux_options))
    return SecurityFacts(
        added_capabilities=(*sc.capabilities.add_capabilities, *sc.capabilities.add_ambient_capabilities),
        selinux=selinux,
        sysctls=tuple(sandbox.linux.sysctls),
        target_namespace=any(o.pid == cri.TARGET or o.network == cri.TARGET or o.ipc == cri.TARGET
                             for o in (sc.namespace_options, psc.namespace_options)),
    )


def check(config: cri.ContainerConfig, sandbox: cri.PodSandboxConfig) -> BaselineDecision:
    return check_baseline(security_facts(config, sandbox))


def _kept(annotations) -> dict[str, str]:
    return {k: v for k, v in annotations.items() if k.startswith(_KEPT_ANNOTATION_PREFIXES)}


def _not_weft(labels) -> dict[str, str]:
    return {k: v for k, v in labels.items() if not k.startswith(WEFT_PREFIX)}


def _namespaces(src: cri.NamespaceOption) -> cri.NamespaceOption:
    # NODE and TARGET are refused before this; userns_options stay the runtime's default.
    return cri.NamespaceOption(network=src.network, pid=src.pid, ipc=src.ipc)


def _default_profile() -> cri.SecurityProfile:
    return cri.SecurityProfile(profile_type=cri.SecurityProfile.RuntimeDefault)


def _masked(asked, defaults: tuple[str, ...]) -> list[str]:
    # More masking only takes from the container; fewer is what the request may not ask.
    return list(dict.fromkeys((*defaults, *asked)))


def _kept_security(sc, osc) -> None:
    """What a sandbox's and a container's security contexts keep alike, copied from ``sc`` into ``osc``:
    namespaces, the SELinux type and level, the user and group, a read-only root and supplemental groups."""
    osc.namespace_options.CopyFrom(_namespaces(sc.namespace_options))
    if sc.selinux_options.type:
        osc.selinux_options.CopyFrom(cri.SELinuxOption(type=sc.selinux_options.type, level=sc.selinux_options.level))
    if sc.HasField("run_as_user"):
        osc.run_as_user.CopyFrom(sc.run_as_user)
    if sc.HasField("run_as_group"):
        osc.run_as_group.CopyFrom(sc.run_as_group)
    osc.readonly_rootfs = sc.readonly_rootfs
    osc.supplemental_groups.extend(sc.supplemental_groups)


def hosted_sandbox(src: cri.PodSandboxConfig) -> cri.PodSandboxConfig:
    """The sandbox config a host runs: log directory, cgroup parent and labels are the caller's to add."""
    psc = src.linux.security_context
    out = cri.PodSandboxConfig(
        hostname=src.hostname,
        labels=_not_weft(src.labels),
        annotations=_kept(src.annotations),
    )
    out.metadata.CopyFrom(src.metadata)
    if src.HasField("dns_config"):
        out.dns_config.CopyFrom(src.dns_config)
    osc = out.linux.security_context
    _kept_security(psc, osc)
    osc.seccomp.CopyFrom(_default_profile())
    # Checked against the safe set before this where a container comes with it; a sandbox made ahead of its
    # containers keeps only the safe ones.
    out.linux.sysctls.update({k: v for k, v in src.linux.sysctls.items() if k in SAFE_SYSCTLS})
    return out


def hosted_container(src: cri.ContainerConfig, oom_score_adj: int) -> cri.ContainerConfig:
    """The container config a host runs: mounts, labels and annotations of its own are the caller's to add."""
    sc = src.linux.security_context
    out = cri.ContainerConfig(
        command=src.command, args=src.args, working_dir=src.working_dir, envs=src.envs,
        labels=_not_weft(src.labels), annotations=_kept(src.annotations), log_path=src.log_path,
        stdin=src.stdin, stdin_once=src.stdin_once, tty=src.tty, stop_signal=src.stop_signal,
    )
    out.metadata.CopyFrom(src.metadata)
    out.image.image = src.image.image
    res, ores = src.linux.resources, out.linux.resources
    ores.cpu_period, ores.cpu_quota = res.cpu_period, res.cpu_quota
    ores.memory_limit_in_bytes = res.memory_limit_in_bytes
    ores.memory_swap_limit_in_bytes = res.memory_swap_limit_in_bytes
    ores.oom_score_adj = oom_score_adj
    osc = out.linux.security_context
    osc.capabilities.add_capabilities.extend(sc.capabilities.add_capabilities)
    osc.capabilities.drop_capabilities.extend(sc.capabilities.drop_capabilities)
    osc.capabilities.add_ambient_capabilities.extend(sc.capabilities.add_ambient_capabilities)
    _kept_security(sc, osc)
    osc.run_as_username = sc.run_as_username
    osc.no_new_privs = sc.no_new_privs
    osc.masked_paths.extend(_masked(sc.masked_paths, DEFAULT_MASKED_PATHS))
    osc.readonly_paths.extend(_masked(sc.readonly_paths, DEFAULT_READONLY_PATHS))
    osc.seccomp.CopyFrom(_default_profile())
    # AppArmor left unset: containerd applies its default profile where the host has AppArmor (an explicit
    # RuntimeDefault is an error where it has not), and neither the profile nor the old path field is copied.
    return out
