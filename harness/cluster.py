"""A real Kubernetes cluster on the local fabric's test nodes, for the integration tests.

``KubeCluster(workdir, [NodeSpec("gpu-1", "gpu"), NodeSpec("cpu-1", "cpu")])`` brings up, in order:

1. the nodes: a ``shim.localfabric.nodes.Cluster`` (a network namespace, containerd and CNI bridge per
   node, all on one bridge); a ``gpu`` node also gets the ``weft`` runtime handler and the GPU broker
   on simulated devices;
2. a ``weft agent`` per node in the node's namespace, meshed with the others (certificates from
   ``weft mesh-certs``, a static peers file), reading volumes from its kubelet's pods directory;
3. the control plane (``controlplane.ControlPlane``) on the bridge's root-namespace address;
4. a kubelet per node (``kubelet.Kubelet``) with the node's agent as its runtime and image endpoint,
   and waits until every Node is Ready.

Each step is bounded and timed (``timings``, ``report()``). ``close()`` runs whether or not ``open()``
finished and takes everything down in reverse: kubelets, agents, the kubelets' mounts, the nodes
(their pods removed through containerd, mounts, cgroups, namespaces), the broker, the control plane,
and the kernel settings kubelet changed. A run killed outright leaves its processes and mounts to the
next one to claim its mesh slot (``reap_stale_mounts`` and the local fabric's own reaping).
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness.controlplane import ControlPlane
from harness.kubelet import KernelSettings, Kubelet, share_root_dir
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.broker import BrokerProcess, weft_handler
from shim.localfabric.containerd import lock_held
from shim.localfabric.daemon import Opened
from shim.localfabric.images import PAUSE_IMAGE
from shim.localfabric.nodes import Cluster, Node
from shim.localfabric.waiting import wait_for

MESH_PORT = 7443
HOST_CORES = 4
HOST_MEMORY = "8Gi"


@dataclass(frozen=True)
class NodeSpec:
    name: str
    role: str  # "gpu": the origin, with the weft handler and the broker; "cpu": a host for rerouted containers


@dataclass
class KubeCluster(Opened):
    workdir: Path
    specs: Sequence[NodeSpec]
    hello_s: float = 0.5
    fence_s: float = 8.0
    loss_s: float = 16.0
    timings: dict[str, float] = field(default_factory=dict)
    nodes: Cluster | None = None
    broker: BrokerProcess | None = None
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    kubelets: dict[str, Kubelet] = field(default_factory=dict)
    control: ControlPlane | None = None
    kernel: KernelSettings = field(default_factory=KernelSettings)
    # Give the agents the Kubernetes API as weft's own service account (the shipped namespace, account and
    # RBAC applied first): reservation pods on hosts, the pod cache on origins.
    agent_api: bool = False
    # The containerd release line the nodes run (None: WEFT_CONTAINERD's), and settings every kubelet gets
    # over the harness's own (KubeletConfiguration fields, e.g. featureGates).
    containerd_line: str | None = None
    kubelet_config: dict = field(default_factory=dict)
    # Environment every agent gets over the test's own (e.g. WEFT_FAILPOINT_DELAYS).
    agent_env: dict[str, str] = field(default_factory=dict)
    # [kubernetes] settings of one node's agent, by node name (with agent_api), e.g. {"reservation_stop_hook": False}.
    agent_kubernetes: dict[str, dict[str, object]] = field(default_factory=dict)

    # -- bring-up -------------------------------------------------------------------------
    def open(self) -> None:
        t0 = time.monotonic()
        reap_stale_mounts()
        self.workdir.mkdir(parents=True, exist_ok=True)
        names = [s.name for s in self.specs]
        gpu = any(s.role == "gpu" for s in self.specs)
        if gpu:
            self.broker = BrokerProcess(self.workdir / "broker").start()
        broker = self.broker

        def handlers(i: int, d: Path):
            return [weft_handler(d, broker.socket)] if self.specs[i].role == "gpu" and broker else None

        self.nodes = Cluster(n=len(self.specs), names=names, handlers_for=handlers,
                             containerd_line=self.containerd_line)
        self.nodes.open()
        for node in self.nodes.nodes:
            # A shared mount, so that kubelet's own mount namespace (kubelet.py) and the agents see the volumes
            # kubelet mounts under it.
            share_root_dir(node.workdir / "kubelet")
        self._start_agents()
        self.timings["nodes and agents up"] = time.monotonic() - t0

        t = time.monotonic()
        assert self.nodes.workdir is not None
        self.control = ControlPlane(self.nodes.workdir / "control-plane", self.nodes.bridge_ip, names)
        self.control.start()
        self.timings.update(self.control.timings)
        if self.agent_api:
            self._agent_api()
        self.timings["control plane up"] = time.monotonic() - t

        t = time.monotonic()
        self.kernel.save()
        for spec in self.specs:
            node = self.node(spec.name)
            self.kubelets[spec.name] = Kubelet(node, self.agents[spec.name].socket,
                                               self.control.kubeconfig(spec.name), spec.role,
                                               f"{node.containerd.cgroup_root}/kubepods",
                                               extra_config=self.kubelet_config)
            self.kubelets[spec.name].start()
        for name in names:
            self.wait_node_ready(name, timeout=180)
            self.timings[f"kubelet {name} Ready"] = time.monotonic() - t
        self.timings["cluster up"] = time.monotonic() - t0

    def _start_agents(self) -> None:
        assert self.nodes is not None
        certs = self.workdir / "certs"
        names = [s.name for s in self.specs]
        subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(certs), "--nodes", ",".join(names)],
                       check=True, capture_output=True)
        peers = self.workdir / "peers.toml"
        peers.write_text("".join(f'[[peer]]\nname = "{n.name}"\naddress = "{n.mesh_ip}:{MESH_PORT}"\n'
                                 f'role = "{self.spec(n.name).role}"\n\n' for n in self.nodes.nodes))
        for node in self.nodes.nodes:
            role = self.spec(node.name).role
            conf = self.workdir / f"{node.name}.toml"
            conf.write_text(
                f"[mesh]\nhello_interval = {self.hello_s}\nheartbeat_interval = {min(self.hello_s, 1.0)}\n"
                f"fence_timeout = {self.fence_s}\nloss_timeout = {self.loss_s}\n"
                f'kubelet_pods_dir = "{node.workdir / "kubelet" / "pods"}"\nvolume_sync_interval = 0.5\n'
                f'fixed_capacity = "{HOST_CORES},{HOST_MEMORY}"\n'
                f'shadow_cgroup_parent = "{node.containerd.cgroup_root}/shadows"\n'
                # The node's own pause image, imported with the others: reservation pods run it.
                + (f'[kubernetes]\nreservation_image = "{PAUSE_IMAGE}"\n' + "".join(
                    f"{k} = {json.dumps(v)}\n" for k, v in self.agent_kubernetes.get(node.name, {}).items())
                   if self.agent_api else ""))
            extra = ["--config", str(conf), "--node-name", node.name, "--role", role,
                     "--mesh-address", f"{node.mesh_ip}:{MESH_PORT}", "--peers", str(peers), "--tls-dir", str(certs),
                     "--log-level", "debug"]
            if role == "gpu" and self.broker is not None:
                extra += ["--broker-socket", str(self.broker.socket)]
            if self.agent_api:
                extra += ["--kubeconfig", str(self.agent_kubeconfig)]
            self.agents[node.name] = AgentProcess(node.containerd, self.workdir / node.name, name=node.name,
                                                  extra_args=extra, netns=node.netns, metrics_host=node.mesh_ip,
                                                  metrics_port=free_port(), env=dict(self.agent_env))
        for agent in self.agents.values():
            agent.start(timeout=60)
        if len(self.specs) > 1:
            wait_for(self._meshed, timeout=60, what="every agent to see its peers healthy", every=0.2)

    @property
    def agent_kubeconfig(self) -> Path:
        return self.workdir / "agent-api" / "kubeconfig"

    def _agent_api(self) -> None:
        """weft's namespace, account and RBAC as shipped, and the agents' kubeconfig as that account: the
        agents started before it existed, and read it once it is written (as from the DaemonSet's keeper)."""
        assert self.control is not None
        manifests = Path(__file__).resolve().parents[1] / "nodeimage" / "manifests"
        for name in ("namespace.yaml", "serviceaccount.yaml", "rbac.yaml"):
            self.control.kubectl("apply", "-f", str(manifests / name))
        # No controller-manager: the default account of weft's namespace, which reservation pods run as.
        self.control.kubectl("create", "serviceaccount", "default", "-n", "weft-system", check=False)
        token = self.control.kubectl("create", "token", "weft", "-n", "weft-system", "--duration", "2h").stdout
        doc = json.loads(self.control.kubeconfig("admin").read_text())
        doc["users"] = [{"name": "weft", "user": {"token": token.strip()}}]
        doc["contexts"][0]["context"]["user"] = "weft"
        self.agent_kubeconfig.parent.mkdir(parents=True, exist_ok=True)
        self.agent_kubeconfig.write_text(json.dumps(doc))
        self.agent_kubeconfig.chmod(0o600)

    def _meshed(self) -> bool:
        for name in self.agents:
            with contextlib.suppress(grpc.RpcError, ValueError):
                peers = self.agent_status(name).get("peers", [])
                if len(peers) == len(self.specs) - 1 and all(p["healthy"] for p in peers):
                    continue
            return False
        return True

    # -- teardown -----------------------------------------------------------------------------
    def close(self) -> None:
        t = time.monotonic()
        errors: list[str] = []
        for kubelet in self.kubelets.values():
            kubelet.stop()
        for agent in self.agents.values():
            with contextlib.suppress(Exception):
                agent.stop()
                agent.release_mounts()
        for kubelet in self.kubelets.values():
            kubelet.unmount()
        if self.nodes is not None:
            try:
                self.nodes.close()
            except Exception as exc:  # noqa: BLE001 - the rest still needs closing
                errors.append(str(exc))
        if self.broker is not None:
            self.broker.stop()
        if self.control is not None:
            self.control.stop()
        failed = self.kernel.restore()
        if failed:
            errors.append(f"kernel settings not restored: {failed}")
        self.timings["teardown"] = time.monotonic() - t
        if errors:
            raise RuntimeError("; ".join(errors))

    # -- views --------------------------------------------------------------------------------------
    def spec(self, name: str) -> NodeSpec:
        return next(s for s in self.specs if s.name == name)

    def node(self, name: str) -> Node:
        assert self.nodes is not None
        return next(n for n in self.nodes.nodes if n.name == name)

    def report(self) -> str:
        parts = [f"{k} {v:.1f} s" for k, v in self.timings.items()]
        return "kube cluster (" + ", ".join(s.name for s in self.specs) + "): " + "; ".join(parts)

    def agent_status(self, name: str) -> dict:
        with self.agents[name].channel() as ch:
            return json.loads(ch.unary_unary("/weft.agent.v1.Admin/Status")(b"", timeout=10))

    @property
    def kubectl(self):
        assert self.control is not None
        return self.control.kubectl

    def api(self, path: str) -> dict:
        assert self.control is not None
        status, body = self.control.get(path)
        if status != 200:
            raise AssertionError(f"GET {path}: {status} {body[:500]}")
        return json.loads(body)

    def node_ready(self, name: str) -> bool | None:
        """The Node's Ready condition (None before it registered)."""
        assert self.control is not None
        status, body = self.control.get(f"/api/v1/nodes/{name}")
        if status != 200:
            return None
        for cond in json.loads(body).get("status", {}).get("conditions", []):
            if cond["type"] == "Ready":
                return cond["status"] == "True"
        return None

    def wait_node_ready(self, name: str, timeout: float = 120.0, ready: bool = True) -> None:
        def check() -> bool:
            if not self.kubelets[name].running:
                raise RuntimeError(f"kubelet on {name} exited:\n{self.kubelets[name].log_tail()}")
            return self.node_ready(name) is ready

        try:
            wait_for(check, timeout=timeout, what=f"node {name} Ready={ready}", every=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nkubelet log:\n{self.kubelets[name].log_tail()}") from None

    def containerd(self, name: str) -> tuple[grpc.Channel, cri_grpc.RuntimeServiceStub]:
        """Node ``name``'s containerd, without weft in between."""
        ch = self.node(name).containerd.channel()
        return ch, cri_grpc.RuntimeServiceStub(ch)

    def sandboxes(self, name: str) -> list[cri.PodSandbox]:
        ch, rt = self.containerd(name)
        with ch:
            return list(rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30).items)

    def containers(self, name: str) -> list[cri.Container]:
        ch, rt = self.containerd(name)
        with ch:
            return list(rt.ListContainers(cri.ListContainersRequest(), timeout=30).containers)


def reap_stale_mounts() -> None:
    """Unmount kubelet root directories that a killed run left under a mesh work directory nobody holds."""
    pattern = re.compile(re.escape(tempfile.gettempdir()) + r"/weft-mesh(\d+)-[^/]+/")
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4].replace("\\040", " ") for line in f]
    for mnt in sorted(mounts, key=len, reverse=True):
        m = pattern.match(mnt)
        if m and not lock_held(f"mesh{int(m.group(1))}"):
            subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
