"""A real kubelet on a test node, with the node's ``weft agent`` as its runtime and image endpoint.

It runs in the node's network namespace (``nsenter --net``, so cgroups stay visible) and in a mount
namespace of its own, where a tmpfs covers the paths kubelet keeps whatever ``--root-dir`` says:
``/var/log`` (``/var/log/pods``, ``/var/log/containers``) and ``/var/lib/kubelet`` (its
``device-plugins`` directory, whose files kubelet deletes at start), or ``/var/lib`` where the
machine has no ``/var/lib/kubelet`` to mount over. So two kubelets on one machine, and the
machine's own, never see each other's files.

Its root directory is outside those, in the node's work directory, and is a shared mount: the
volumes kubelet mounts under ``pods/`` (Secrets and projected tokens are tmpfs) propagate back to
the root namespace, where containerd (which bind-mounts them into containers) and the weft agent
(which copies ConfigMap and Secret volumes to a rerouted container's host; it makes its mount namespace
after the root directory is shared, so it holds a copy that receives them) look for them. Pod logs
go to ``<root>/pod-logs`` (``podLogsDir``), where containerd writes them.

kubelet rewrites a few kernel settings at start (``protectKernelDefaults: false``);
``KernelSettings`` reads them first and puts them back.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from harness.procs import Daemon, tail
from shim.localfabric.containerd import SLOT_DIR
from shim.localfabric.nodes import Node

# What kubelet sets when protectKernelDefaults is false (pkg/kubelet/cm/container_manager_linux.go).
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
SYSCTL_STATE = SLOT_DIR / "kube-sysctls.json"

# Run as `sh -c SCRIPT kubelet ARGS...` in the new mount namespace. A tmpfs mounted over a path whose
# mount is shared would propagate to the machine, hence the --make-private of that mount first.
_MOUNT_SCRIPT = r"""set -eu
cover() {
  mount --make-private "$(findmnt -n -o TARGET --target "$1")"
  mount -t tmpfs -o mode=0755 weft-kubelet "$1"
}
cover /var/log
mkdir -p /var/log/pods /var/log/containers
if [ -d /var/lib/kubelet ]; then cover /var/lib/kubelet; else cover /var/lib; fi
mkdir -p /var/lib/kubelet/device-plugins
exec "$@"
"""


def share_root_dir(root_dir: Path) -> None:
    """kubelet's root directory as a shared mount of its own (once): what kubelet mounts under it in its
    mount namespace then shows in the root namespace, and in every namespace copied from it later."""
    if root_dir.is_mount():
        return
    root_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "--bind", str(root_dir), str(root_dir)], check=True)
    subprocess.run(["mount", "--make-shared", str(root_dir)], check=True)


class KernelSettings:
    """The settings kubelet changes, read before the first kubelet starts and written back after the last stops.

    The first values are kept in a file under the harness's run directory until they are put back, so
    a run killed outright leaves them for the next one to restore.
    """

    def __init__(self) -> None:
        self.saved: dict[str, str] = {}

    def save(self) -> None:
        SYSCTL_STATE.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.saved = json.loads(SYSCTL_STATE.read_text())
        except (OSError, ValueError):
            self.saved = {k: (Path("/proc/sys") / k).read_text().strip() for k in KUBELET_SYSCTLS}
            SYSCTL_STATE.write_text(json.dumps(self.saved))

    def restore(self) -> list[str]:
        """Write the saved values back; returns the settings that could not be."""
        failed = []
        for key, value in self.saved.items():
            try:
                (Path("/proc/sys") / key).write_text(value)
            except OSError:
                failed.append(key)
        if self.saved and not failed:
            SYSCTL_STATE.unlink(missing_ok=True)
        return failed


@dataclass
class Kubelet:
    node: Node
    agent_socket: Path
    kubeconfig: Path
    role: str
    cgroup_root: str
    daemon: Daemon | None = None
    extra_config: dict = field(default_factory=dict)

    @property
    def root_dir(self) -> Path:
        return self.node.workdir / "kubelet"

    @property
    def pods_dir(self) -> Path:
        return self.root_dir / "pods"

    @property
    def pod_logs_dir(self) -> Path:
        return self.root_dir / "pod-logs"

    @property
    def log_path(self) -> Path:
        return self.node.workdir / "kubelet.log"

    def config(self) -> dict:
        endpoint = f"unix://{self.agent_socket}"
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": endpoint, "imageServiceEndpoint": endpoint,
            "cgroupDriver": "cgroupfs", "cgroupsPerQOS": False, "cgroupRoot": self.cgroup_root,
            "enforceNodeAllocatable": [], "failSwapOn": False, "resolvConf": "", "evictionHard": {},
            "localStorageCapacityIsolation": False, "protectKernelDefaults": False,
            "makeIPTablesUtilChains": False, "serializeImagePulls": False,
            "address": self.node.mesh_ip, "port": 10250, "readOnlyPort": 0,
            "healthzBindAddress": self.node.mesh_ip, "healthzPort": 10248,
            "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "podLogsDir": str(self.pod_logs_dir), "rotateCertificates": False,
            # Pods are synced (and their ConfigMap and Secret volumes refreshed) every 10 s rather than every minute.
            "syncFrequency": "10s",
            # These machines run cgroup v1, which kubelet refuses from v1.35 unless told (the newest-release smoke run).
            "failCgroupV1": False,
            **self.extra_config,
            # Without pod cgroups (cgroupsPerQOS false) kubelet v1.34's in-place resize dereferences a nil pod
            # cgroup config when a running container lacks its actuated-resources record, as when a pod is
            # deleted mid-sync under load, and kubelet exits (kubernetes/kubernetes#137999). No test resizes.
            # From v1.35 the gate is GA and locked on (the newest-release smoke run): kubelet refuses to set it,
            # and v1.36.3 still crashes that way; the test of it is marked pinned_kubelet.
            "featureGates": {**({} if binaries.next_release() else {"InPlacePodVerticalScaling": False}),
                             **self.extra_config.get("featureGates", {})},
        }

    def argv(self) -> list[str]:
        return [binaries.binary("kubelet"), f"--config={self.root_dir / 'config.json'}",
                f"--kubeconfig={self.kubeconfig}", f"--hostname-override={self.node.name}",
                f"--node-ip={self.node.mesh_ip}", f"--root-dir={self.root_dir}", f"--cert-dir={self.root_dir / 'pki'}",
                f"--node-labels=weft.io/role={self.role}", "--v=2"]

    def start(self, ready_timeout: float = 120.0) -> None:
        """Start kubelet; returns at once (the cluster waits for its Node to turn Ready)."""
        share_root_dir(self.root_dir)
        self.pod_logs_dir.mkdir(exist_ok=True)
        (self.root_dir / "config.json").write_text(json.dumps(self.config(), indent=1))
        argv = self.node.nsenter(["unshare", "--mount", "--propagation", "unchanged", "--",
                                  "sh", "-c", _MOUNT_SCRIPT, "kubelet", *self.argv()])
        self.daemon = Daemon(f"kubelet on {self.node.name}", argv, self.log_path)
        self.daemon.start(lambda: True, ready_timeout)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    @property
    def running(self) -> bool:
        return self.daemon is not None and self.daemon.running

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def unmount(self) -> None:
        """Unmount the root directory and everything kubelet mounted under it (after its pods are gone)."""
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split()[4].replace("\\040", " ") for line in f]
        root = str(self.root_dir)
        for mnt in sorted((m for m in mounts if m == root or m.startswith(root + "/")), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
