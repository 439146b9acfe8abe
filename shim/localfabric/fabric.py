"""The three-node fabric: a GPU origin and two CPU hosts, each a real containerd and weft agent in its own netns.

``gpu-1`` has a GPU broker on simulated devices and the ``weft`` runtime
handler; ``cpu-1`` and ``cpu-2`` host rerouted containers. The agents run
inside their nodes' network namespaces (``nsenter --net``), mesh over the
cluster bridge with certificates from ``weft mesh-certs`` and a static peers
file, and serve their CRI sockets in the fabric's work directory. Timeouts are
short so that fencing and loss happen within a test: ``FENCE_S`` on the hosts,
``LOSS_S`` on the origin.

Used by the mesh integration tests, ``weft bench mesh`` and ``weft demo``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import cpuset
from shim.localfabric.agent import AgentProcess, free_port, stop_all
from shim.localfabric.broker import BrokerProcess, weft_handler
from shim.localfabric.containerd import Containerd
from shim.localfabric.daemon import Opened
from shim.localfabric.nodes import Cluster, Node
from shim.localfabric.waiting import wait_for
from shim.shadowhost.volumes import unmount_under

NAMES = ("gpu-1", "cpu-1", "cpu-2")
ROLES = {"gpu-1": "gpu", "cpu-1": "cpu", "cpu-2": "cpu"}
MESH_PORT = 7443
HELLO_S = 0.5
FENCE_S = 3.0
LOSS_S = 10.0  # fence + mesh.loss_timeout's least margin at the fabric's heartbeat
# Each node advertises this instead of measuring the one machine they all share.
HOST_CORES = 4
HOST_MEMORY = "8Gi"


@dataclass
class Fabric3(Opened):
    workdir: Path
    fence_s: float = FENCE_S
    loss_s: float = LOSS_S
    hello_s: float = HELLO_S
    stream_busy_poll_us: int | None = None  # agent.stream_busy_poll_us on every node; None: the default
    mesh_config: str = ""  # more [mesh] lines for every node ("key = value" TOML lines)
    # The origin (with its broker) on half of this machine's CPUs and the hosts on the other half, as on
    # separate machines (``shim.localfabric.cpuset``); False: every process on every CPU.
    cpusets: bool = False
    # A broker the caller runs (one on NVML, as ``bench.gpu_value`` does), instead of one on simulated GPUs.
    broker_socket: Path | None = None
    # The containerd release line every node runs (``containerd.LINES``; "2" for CDI); None: ``WEFT_CONTAINERD``.
    containerd_line: str | None = None
    cluster: Cluster | None = None
    broker: BrokerProcess | None = None
    agents: dict[str, AgentProcess] = field(default_factory=dict)

    @property
    def pods_dir(self) -> Path:
        """Where the test's "kubelet" keeps pods' volumes (the origin's kubelet_pods_dir)."""
        return self.workdir / "kubelet" / "pods"

    def node(self, name: str) -> Node:
        assert self.cluster is not None
        return next(n for n in self.cluster.nodes if n.name == name)

    def open(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        origin_cpus, host_cpus = cpuset.split() if self.cpusets else ("", "")
        cpus = {name: origin_cpus if ROLES[name] == "gpu" else host_cpus for name in NAMES}
        if self.broker_socket is None:
            self.broker = BrokerProcess(self.workdir / "broker", cpus=origin_cpus).start()
        socket = self.broker_socket or self.broker.socket
        self.cluster = Cluster(n=3, names=list(NAMES),
                               handlers_for=lambda i, d: [weft_handler(d, socket)] if i == 0 else None,
                               cpus_for=lambda i: cpus[NAMES[i]], containerd_line=self.containerd_line)
        self.cluster.open()
        certs = self.workdir / "certs"
        subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(certs), "--nodes",
                        ",".join(NAMES)], check=True, capture_output=True)
        peers = self.workdir / "peers.toml"
        peers.write_text("".join(f'[[peer]]\nname = "{n.name}"\naddress = "{n.mesh_ip}:{MESH_PORT}"\n'
                                 f'role = "{ROLES[n.name]}"\n\n' for n in self.cluster.nodes))
        common = (f"[mesh]\nhello_interval = {self.hello_s}\nheartbeat_interval = {min(self.hello_s, 1.0)}\n"
                  f"fence_timeout = {self.fence_s}\nloss_timeout = {self.loss_s}\n"
                  f'kubelet_pods_dir = "{self.pods_dir}"\nvolume_sync_interval = 0.5\n'
                  f'fixed_capacity = "{HOST_CORES},{HOST_MEMORY}"\n' + self.mesh_config)
        for node in self.cluster.nodes:
            # Shadows under the node's own cgroup root, which its harness removes at the end.
            conf = self.workdir / f"{node.name}.toml"
            conf.write_text(common + f'shadow_cgroup_parent = "{node.containerd.cgroup_root}/shadows"\n' + (
                f"[agent]\nstream_busy_poll_us = {self.stream_busy_poll_us}\n"
                if self.stream_busy_poll_us is not None else ""))
            extra = ["--config", str(conf), "--node-name", node.name, "--role", ROLES[node.name],
                     "--mesh-address", f"{node.mesh_ip}:{MESH_PORT}", "--peers", str(peers), "--tls-dir", str(certs),
                     "--log-level", "debug"]
            if node.name == "gpu-1":
                extra += ["--broker-socket", str(socket)]
            self.agents[node.name] = AgentProcess(node.containerd, self.workdir / node.name, name=node.name,
                                                  extra_args=extra, netns=node.netns, metrics_host=node.mesh_ip,
                                                  metrics_port=free_port(), cpus=cpus[node.name])
        for agent in self.agents.values():
            agent.start()
        self.wait_meshed()

    def wait_meshed(self, timeout: float = 30.0) -> None:
        """Until the origin sees both hosts healthy (placement needs fresh Hellos)."""
        def healthy() -> bool:
            with contextlib.suppress(grpc.RpcError, ValueError):
                peers = self.status("gpu-1").get("peers", [])
                return len(peers) == 2 and all(p["healthy"] for p in peers)
            return False

        wait_for(healthy, timeout=timeout, what="gpu-1 to see cpu-1 and cpu-2 healthy")

    def status(self, name: str) -> dict:
        import json

        with self.agents[name].channel() as ch:
            raw = ch.unary_unary("/weft.agent.v1.Admin/Status")(b"", timeout=10)
        return json.loads(raw)

    def runtime(self, name: str) -> tuple[grpc.Channel, cri_grpc.RuntimeServiceStub]:
        """kubelet's view of node ``name``: CRI through its agent."""
        ch = self.agents[name].channel()
        return ch, cri_grpc.RuntimeServiceStub(ch)

    def direct(self, name: str) -> tuple[grpc.Channel, cri_grpc.RuntimeServiceStub]:
        """containerd of node ``name`` without weft."""
        ch = self.node(name).containerd.channel()
        return ch, cri_grpc.RuntimeServiceStub(ch)

    def shadows(self, name: str, running_only: bool = False) -> list[cri.Container]:
        ch, rt = self.direct(name)
        with ch:
            found = rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(
                label_selector={"weft.io/origin-node": "gpu-1"}))).containers
        return [c for c in found if not running_only or c.state == cri.CONTAINER_RUNNING]

    def detach_info(self) -> dict:
        """What a fresh process needs to remove this fabric should this one die (``remove_detached``)."""
        assert self.cluster is not None
        return {"workdir": str(self.workdir), "mesh_slot": self.cluster.mesh,
                "cluster_workdir": str(self.cluster.workdir),
                "nodes": [{"name": n.name, "slot": n.containerd.slot, "containerd_workdir": str(n.containerd.workdir),
                           "line": n.containerd.line} for n in self.cluster.nodes]}

    @staticmethod
    def remove_detached(info: dict) -> list[str]:
        """Remove a fabric whose holder is gone, from its ``detach_info``; returns what could not be removed.

        Its processes (agents and broker name the fabric's work directory,
        containerd and shims their own) are killed; then each slot is claimed
        again, which reaps what its last holder left (``Containerd._reap_previous``,
        ``Cluster._reap_previous``: runc containers, mounts, cgroups, the
        bridge), and the node namespaces go. A slot someone else holds by now
        is theirs, and left alone: claiming it, they reaped what was left in it
        (the old work directory, outside any slot's reach once reaped, goes here).
        """
        left: list[str] = []
        Containerd._kill_processes_mentioning(info["workdir"])
        for node in info["nodes"]:
            Containerd._kill_processes_mentioning(node["containerd_workdir"])
            try:
                # The containerd it ran (WEFT_CONTAINERD then), whatever this process's environment says now.
                ctrd = Containerd(slot=node["slot"], **({"line": node["line"]} if node.get("line") else {}))
                ctrd._claim_slot()
            except RuntimeError:
                shutil.rmtree(node["containerd_workdir"], ignore_errors=True)
                continue
            try:
                subprocess.run(["ip", "netns", "delete", ctrd.netns], capture_output=True, check=False)
                shutil.rmtree(node["containerd_workdir"], ignore_errors=True)
            finally:
                assert ctrd._lock_fd is not None
                os.close(ctrd._lock_fd)
        try:
            cluster = Cluster(mesh=info["mesh_slot"])
            cluster._claim_mesh()
        except RuntimeError:
            pass  # held by another process now, which reaped the bridge and links when it claimed the slot
        else:
            assert cluster._lock_fd is not None
            os.close(cluster._lock_fd)
        shutil.rmtree(info["cluster_workdir"], ignore_errors=True)
        unmount_under(Path(info["workdir"]))  # the agents' copied volumes (tmpfs)
        shutil.rmtree(info["workdir"], ignore_errors=True)
        for path in (info["workdir"], info["cluster_workdir"], *(n["containerd_workdir"] for n in info["nodes"])):
            if os.path.exists(path):
                left.append(f"{path} could not be removed")
        return left

    def close(self) -> None:
        stop_all(self.agents.values())
        if self.cluster is not None:
            self.cluster.close()
        if self.broker is not None:
            self.broker.stop()
