"""CRI request builders shared by the tests, the demo and the benchmarks.

They produce what kubelet would send for a plain pod: metadata, labels and
annotations kubelet sets, a log directory, Linux security context defaults and,
when the caller names a root for it, a pod cgroup parent.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from cri_api.v1 import api_pb2 as cri

from integration import images


def sandbox_config(name: str, log_dir: Path, namespace: str = "default", *,
                   labels: dict[str, str] | None = None,
                   annotations: dict[str, str] | None = None, cgroup_parent: str = "") -> cri.PodSandboxConfig:
    """A pod as kubelet asks for it; ``cgroup_parent`` is the root under which kubelet would put ``pod<uid>``.

    Without one containerd 1.6 cannot answer ListPodSandboxStats ("cgroupPath is
    empty"); kubelet always sets one.
    """
    uid = str(uuid.uuid4())
    return cri.PodSandboxConfig(
        metadata=cri.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
        hostname=name,
        log_directory=str(log_dir / f"{namespace}_{name}_{uid}"),
        labels={"io.kubernetes.pod.name": name, "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid, **(labels or {})},
        annotations={"kubernetes.io/config.source": "api", **(annotations or {})},
        linux=cri.LinuxPodSandboxConfig(
            cgroup_parent=f"{cgroup_parent}/pod{uid}" if cgroup_parent else "",
            security_context=cri.LinuxSandboxSecurityContext(
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD),
            ),
        ),
    )


def container_config(name: str, command: list[str], *, image: str = images.BUSYBOX_IMAGE,
                     labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
                     envs: dict[str, str] | None = None, attempt: int = 0) -> cri.ContainerConfig:
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
                namespace_options=cri.NamespaceOption(network=cri.POD, pid=cri.CONTAINER, ipc=cri.POD),
            ),
        ),
    )
