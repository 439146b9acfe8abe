"""CRI request builders shared by the tests, the demo and the benchmarks.

They produce what kubelet would send for a plain pod: metadata, labels and
annotations kubelet sets, a log directory, Linux security context defaults and,
when the caller names a root for it, a pod cgroup parent. The last few run an
opted-in pod on a :class:`~shim.localfabric.fabric.Fabric3`'s origin through
its weft socket, as kubelet would.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from cri_api.v1 import api_pb2 as cri

from shim.localfabric import images

if TYPE_CHECKING:
    from shim.localfabric.fabric import Fabric3

WEFT = "weft"  # the RuntimeClass handler of opted-in pods
PLACEMENT = "weft.io/placement"


def sandbox_config(name: str, log_dir: Path, namespace: str = "default", *,
                   labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None, cgroup_parent: str = "",
                   host_network: bool = False, host_pid: bool = False) -> cri.PodSandboxConfig:
    """A pod as kubelet asks for it; ``cgroup_parent`` is the root under which kubelet would put ``pod<uid>``.

    Without one containerd 1.6 cannot answer ListPodSandboxStats ("cgroupPath is
    empty"); kubelet always sets one. ``host_network`` and ``host_pid`` are a
    pod's ``hostNetwork`` and ``hostPID``.
    """
    uid = str(uuid.uuid4())
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
        hostname="" if host_network else name,  # as kubelet: the node's own name is the pod's
        log_directory=str(log_dir / f"{namespace}_{name}_{uid}"),
        labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid, **(labels or {})},
        annotations={"kubernetes.io/config.source": "api", **(annotations or {})},
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{cgroup_parent}/pod{uid}" if cgroup_parent else "",
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE if host_network else cri.POD,
                                                      pid=cri.NODE if host_pid else cri.CONTAINER, ipc=cri.POD),
            ),
        ),
    )


def container_config(name: str, command: list[str], *, image: str = images.BUSYBOX_IMAGE,
                     labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                     envs: dict[str, str] | None = None, attempt: int = 0, host_network: bool = False,
                     host_pid: bool = False) -> cri.ContainerConfig:
    """A container as kubelet asks for it; ``host_network`` and ``host_pid`` as its pod's."""
    return cri.ContainerConfig(
        metadata=cri.ContainerMetadata(name=name, attempt=attempt),
        image=cri.ImageSpec(image=image),
        command=command,
        envs=[cri.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
        labels={"io.kubernetes.container.name": name, **(labels or {})},
        annotations={"io.kubernetes.container.restartCount": str(attempt), **(annotations or {})},
        log_path=f"{name}/{attempt}.log",
        linux=cri.LinuxContainerConfig(
            resources=cri.LinuxContainerResources(cpu_shares=2, memory_limit_in_bytes=64 << 20),
            security_context=cri.LinuxContainerSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.NODE if host_network else cri.POD,
                                                      pid=cri.NODE if host_pid else cri.CONTAINER, ipc=cri.POD),
            ),
        ),
    )


def cpu_container(name: str, command: list[str], *, cpu: float = 0.5, memory: int = 64 << 20,
                  attempt: int = 0) -> cri.ContainerConfig:
    config = container_config(name, command, attempt=attempt)
    res = config.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, int(cpu * 100000), memory
    return config


def run_pod(f: Fabric3, name: str = "infer", privileged: bool = False,
            annotations: dict[str, str] | None = None) -> tuple[str, cri.PodSandboxConfig]:
    node = f.node("gpu-1")
    sandbox = sandbox_config(name, node.containerd.pod_log_dir, cgroup_parent=node.containerd.cgroup_root)
    sandbox.linux.security_context.privileged = privileged
    sandbox.annotations.update(annotations or {})
    ch, rt = f.runtime("gpu-1")
    with ch:
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox, runtime_handler=WEFT)).pod_sandbox_id
    return sid, sandbox


def create(f: Fabric3, sid: str, sandbox: cri.PodSandboxConfig, config: cri.ContainerConfig, start: bool = True) -> str:
    ch, rt = f.runtime("gpu-1")
    with ch:
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                            sandbox_config=sandbox)).container_id
        if start:
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    return cid


def status(f: Fabric3, cid: str) -> cri.ContainerStatus:
    ch, rt = f.runtime("gpu-1")
    with ch:
        return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status
