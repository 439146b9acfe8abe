"""A cluster of real nodes: the control plane on this machine, nodes booted with systemd (``nspawn``) and laid
out as kubeadm lays out workers (``kubeadm``), and a registry on the nodes' bridge that their containerd
pulls every image from, by tag, as a cluster's nodes pull from theirs.

Bring-up is bounded and reported (:attr:`Cluster.timings`); :meth:`Cluster.down` removes everything,
also after a failure half-way, and puts back the kernel settings the nodes' kubelets change.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness import binaries
from harness.controlplane import ControlPlane
from harness.kubelet import KernelSettings
from harness.nodes import kubeadm, nspawn
from harness.nodes.kubeadm import NodeSpec
from shim.localfabric import daemon, images
from shim.localfabric.containerd import bin_dir

# Apart from integration/nodes/test_nodes.py's bridges (10.244.250.0/24, and the next /24 for its killed-owner
# test), so both can run at once on two workers; pod subnets
# (NodeSpec.pod_subnet) are 10.245.<i>.0/24, apart from the local fabric's 10.244.<slot>.0/24.
BRIDGE, SUBNET = "weftc0", "10.244.253.0/24"
REGISTRY_PORT = 5000
# What a cluster runs that weft's manifests rely on: DaemonSet and Deployment rollouts, the mesh Service's
# EndpointSlices, the signer's PodDisruptionBudget, a namespace's kube-root-ca.crt and its deletion.
CONTROLLERS = ("daemonset-controller", "deployment-controller", "replicaset-controller", "namespace-controller",
               "garbage-collector-controller", "endpointslice-controller", "root-ca-certificate-publisher-controller",
               "serviceaccount-controller", "disruption-controller", "pod-garbage-collector-controller",
               "certificatesigningrequest-cleaner-controller")


@dataclass
class Registry:
    """Debian's docker-registry on the bridge's address, no authentication: what the nodes pull from."""

    workdir: Path
    address: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return f"{self.address}:{REGISTRY_PORT}"

    def start(self, timeout: float = 30) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "config.yml"
        config.write_text(json.dumps({"version": 0.1, "log": {"level": "warn"},
                                      "storage": {"filesystem": {"rootdirectory": str(self.workdir / "data")}},
                                      "http": {"addr": self.host}}))
        with open(self.workdir / "registry.log", "wb") as log:  # the process keeps its own copy
            self.proc = subprocess.Popen(["docker-registry", "serve", str(config)], stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection((self.address, REGISTRY_PORT), 1):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry on {self.host} did not start: "
                                   f"{(self.workdir / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.2)

    def push(self, archive: Path, name: str) -> str:
        ref = f"{self.host}/{name}"
        res = subprocess.run(["skopeo", "copy", "--quiet", "--dest-tls-verify=false", f"oci-archive:{archive}",
                              f"docker://{ref}"], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise RuntimeError(f"skopeo copy {archive} -> {ref}: {res.stderr}")
        return ref

    def stop(self) -> None:
        if self.proc is not None:
            daemon.stop(self.proc, timeout=10)


@dataclass
class Cluster:
    workdir: Path
    specs: list[NodeSpec]
    bridge: nspawn.Bridge | None = None
    control: ControlPlane | None = None
    registry: Registry | None = None
    nodes: dict[str, nspawn.Node] = field(default_factory=dict)
    kernel: KernelSettings = field(default_factory=KernelSettings)
    timings: dict[str, float] = field(default_factory=dict)

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        assert self.control is not None
        return self.control.kubectl(*args, stdin=stdin, check=check, timeout=timeout)

    def up(self, timeout: float = 300) -> None:
        """Control plane, registry with the test images, nodes booted, laid out and Ready."""
        started = time.monotonic()
        nspawn.sweep_stale()
        t = time.monotonic()
        root = nspawn.build_root()
        self.timings["root filesystem"] = time.monotonic() - t
        self.bridge = nspawn.Bridge(BRIDGE, SUBNET)
        self.bridge.up()
        gateway = str(self.bridge.gateway)
        self.control = ControlPlane(self.workdir / "control-plane", gateway, [], runtime_class=False)
        self.control.start()
        self.control.start_controller_manager(list(CONTROLLERS))
        self.registry = Registry(self.workdir / "registry", gateway)
        self.registry.start()
        for spec, name in ((images.IMAGES[1], kubeadm.PAUSE), (images.IMAGES[0], "weft-test/busybox:1")):
            archive = self.workdir / f"{name.replace('/', '_').replace(':', '_')}.tar"  # skopeo reads ':' as a tag
            self.registry.push(images.build_archive(spec, archive), name)
        self.kernel.save()
        t = time.monotonic()
        for spec in self.specs:
            self.nodes[spec.name] = nspawn.boot(spec.name, root, self.workdir / "nodes", self.bridge)
        self.timings["nodes booted"] = time.monotonic() - t
        addresses = {n: node.address for n, node in self.nodes.items()}
        for spec in self.specs:  # the control plane's machine is on the pod network too (go with the bridge)
            subprocess.run(["ip", "route", "replace", spec.pod_subnet, "via", addresses[spec.name], "dev", BRIDGE],
                           check=True, capture_output=True)
        assert self.control.pki is not None
        for spec in self.specs:
            node = self.nodes[spec.name]
            others = [(addresses[s.name], s.pod_subnet) for s in self.specs if s.name != spec.name]
            ctrd = None if spec.containerd == "1.6" else bin_dir(spec.containerd)
            kubeadm.lay_out(node, spec, pki=self.control.pki, server=self.control.server,
                            registry=self.registry.host, kubelet=Path(binaries.binary("kubelet")),
                            containerd_bin=ctrd, others=others, crictl=Path(binaries.binary("crictl")))
            kubeadm.start(node)
        self.wait_ready(list(self.nodes), timeout)
        self.timings["nodes Ready"] = time.monotonic() - t
        self.timings["bring-up"] = time.monotonic() - started

    def ready(self) -> dict[str, bool]:
        doc = json.loads(self.kubectl("get", "nodes", "-o", "json").stdout)
        return {n["metadata"]["name"]: any(c["type"] == "Ready" and c["status"] == "True"
                                           for c in n["status"].get("conditions", [])) for n in doc["items"]}

    def wait_ready(self, names: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            ready = self.ready()
            if all(ready.get(n) for n in names):
                return
            if time.monotonic() > deadline:
                logs = {n: self.nodes[n].run(["journalctl", "-u", "kubelet", "-n", "30", "--no-pager"],
                                             check=False).stdout for n in names if not ready.get(n)}
                raise RuntimeError(f"nodes not Ready within {timeout:g}s: {ready}\n{logs}")
            time.sleep(1)

    def down(self) -> list[str]:
        """Everything removed; returns what could not be."""
        problems: list[str] = []
        for node in self.nodes.values():
            try:
                node.cleanup()
            except Exception as exc:  # noqa: BLE001  (every node is still torn down)
                problems.append(f"node {node.name}: {exc}")
        if self.registry is not None:
            self.registry.stop()
        if self.control is not None:
            self.control.stop()
        if self.bridge is not None:
            self.bridge.down()
        problems += [f"kernel setting {k} not restored" for k in self.kernel.restore()]
        for node in self.nodes.values():
            problems += [f"node {node.name}: {left}" for left in node.leftovers()]
        shutil.rmtree(self.workdir / "nodes", ignore_errors=True)
        return problems
