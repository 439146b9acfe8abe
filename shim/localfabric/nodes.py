"""Several simulated Kubernetes nodes on one machine, wired into one L2 network.

The mesh is about agents on different nodes talking to each other and to pods
on their peers, so a single throwaway containerd is not enough: the tests need
several nodes whose network a test can break. Each node here is a harness
``Containerd`` (its own network namespace ``weftnode<slot>``, containerd, CNI
bridge and pod subnet ``10.244.<slot>.0/24``), and a ``Cluster`` joins them:

- a bridge ``weftmesh<K>`` in the root namespace holding ``10.250.<K>.254/24``,
  so the test process itself reaches every node;
- per node a veth pair, ``wm<K>n<i>`` on the bridge and ``eth-mesh`` in the
  node, with the node's mesh address ``10.250.<K>.<i+1>/24``;
- routes in every node (and in the root namespace) to each other node's pod
  subnet via that node's mesh address, and IP forwarding inside each node, so
  pod IPs work across nodes the way a flat pod network does on a real cluster.

``K`` is a mesh slot held by an flock under the harness's slot directory, so
parallel sessions never share a bridge or a subnet; an instance killed
outright leaves its bridge behind, and the next one to claim ``K`` removes it.

The link of a node can be cut and healed (the bridge side of its veth goes
down and up, as a flapping switch port would), and a node can be killed. Every
process started with ``Node.popen`` runs inside the node's namespace through
``nsenter --net`` (``ip netns exec`` would also hide the cgroup mounts) and is
killed when the node is killed or the cluster closed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shim.localfabric.containerd import Containerd, RuntimeHandler, claim_slot
from shim.localfabric.daemon import Opened

MAX_MESH_SLOTS = 255
BRIDGE_HOST = 254  # the root namespace's address on every mesh subnet
MESH_IFACE = "eth-mesh"

HandlersFor = Callable[[int, Path], list[RuntimeHandler] | None]


def _ip(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(argv)}: {res.stderr.strip()}")
    return res


def _kill_group(proc: subprocess.Popen[Any], timeout: float = 5.0) -> None:
    """SIGTERM the process group (so children of a shell go too), then SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout)
    # The leader may be gone while children it left in the group live on.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


@dataclass
class Node:
    """One simulated node: a harness containerd in its own namespace plus its place on the mesh."""

    name: str
    index: int
    mesh_ip: str
    workdir: Path  # for the node's own files (hook specs, agent state); not containerd's work directory
    containerd: Containerd
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def netns(self) -> str:
        return self.containerd.netns

    @property
    def netns_path(self) -> Path:
        return self.containerd.netns_path

    @property
    def pod_subnet(self) -> str:
        return self.containerd.subnet

    def nsenter(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside this node's network namespace (and nothing else: mounts, cgroups, env stay)."""
        return ["nsenter", f"--net={self.netns_path}", *argv]

    def run(self, *argv: str, check: bool = True, timeout: float = 60.0,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a short command inside the node and return its output as text."""
        return subprocess.run(self.nsenter(argv), check=check, timeout=timeout, capture_output=True, text=True, **kw)

    def popen(self, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start a long-running process inside the node; it dies with the node (``kill_node``) or the cluster.

        It leads a process group of its own, so whatever it forks goes with it.
        """
        proc = subprocess.Popen(self.nsenter(argv), start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def kill_processes(self) -> None:
        while self.procs:
            _kill_group(self.procs.pop())


@dataclass
class Cluster(Opened):
    """``n`` nodes on one bridge. Use as a context manager; ``close()`` also runs when the block raises.

    ``handlers_for(i, node_workdir)`` may give node ``i`` extra CRI runtime
    handlers (for example weft's, with a base spec written into
    ``node_workdir``); ``names`` overrides the default ``node0``, ``node1``...
    """

    n: int = 3
    handlers_for: HandlersFor | None = None
    names: Sequence[str] | None = None
    nodes: list[Node] = field(default_factory=list)
    mesh: int = 0  # the mesh slot K; 0 picks the lowest free one
    # The containerd release line every node runs (containerd.LINES); None: what WEFT_CONTAINERD asks for.
    containerd_line: str | None = None
    # The CPUs node ``i`` runs on (``shim.localfabric.cpuset``); None: every node on all of them.
    cpus_for: Callable[[int], str] | None = None
    workdir: Path | None = None
    _lock_fd: int | None = None

    # -- names and addresses ---------------------------------------------------
    @property
    def bridge(self) -> str:
        return f"weftmesh{self.mesh}"

    @property
    def subnet(self) -> str:
        return f"10.250.{self.mesh}.0/24"

    @property
    def bridge_ip(self) -> str:
        return f"10.250.{self.mesh}.{BRIDGE_HOST}"

    def veth(self, i: int) -> str:
        """The root-namespace end of node ``i``'s link, the port ``cut`` and ``heal`` act on."""
        return f"wm{self.mesh}n{i}"

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    # -- lifecycle ---------------------------------------------------------------
    def open(self) -> None:
        names = list(self.names) if self.names is not None else [f"node{i}" for i in range(self.n)]
        if len(names) != self.n or len(set(names)) != self.n:
            raise ValueError(f"want {self.n} distinct node names, got {names}")
        if not 1 <= self.n < BRIDGE_HOST:
            raise ValueError(f"a mesh subnet holds 1..{BRIDGE_HOST - 1} nodes, not {self.n}")
        self._claim_mesh()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"weft-mesh{self.mesh}-"))
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self._allow_forwarding(True)
        for i, name in enumerate(names):
            node_dir = self.workdir / name
            node_dir.mkdir()
            handlers = (self.handlers_for(i, node_dir) if self.handlers_for else None) or []
            ctrd = Containerd(handlers=handlers, cpus=self.cpus_for(i) if self.cpus_for else "",
                              **({"line": self.containerd_line} if self.containerd_line else {}))
            # Listed before it opens: close() must clean up a node that failed half-way.
            node = Node(name, i, f"10.250.{self.mesh}.{i + 1}", node_dir, ctrd)
            self.nodes.append(node)
            ctrd.open()
            self._attach(node)
        for node in self.nodes:
            for peer in self.nodes:
                if peer is not node:
                    _ip("-n", node.netns, "route", "replace", peer.pod_subnet, "via", peer.mesh_ip)
            # replace, not add: a bridge a killed cluster left may still route this slot's subnet.
            _ip("route", "replace", node.pod_subnet, "via", node.mesh_ip, "dev", self.bridge)

    def _allow_forwarding(self, on: bool) -> None:
        """Bridged traffic may pass the root namespace's FORWARD chain (br_netfilter); a host whose
        policy is DROP (a Docker engine sets that) would silently cut the mesh, so accept ours explicitly. A
        machine without iptables (the GPU proof's) has no such policy to get past."""
        if shutil.which("iptables") is None:
            return
        for direction in ("-i", "-o"):
            rule = ["FORWARD", direction, self.bridge, "-j", "ACCEPT"]
            present = subprocess.run(["iptables", "-C", *rule], capture_output=True).returncode == 0
            if on and not present:
                subprocess.run(["iptables", "-I", *rule], capture_output=True, check=False)
            elif not on and present:
                subprocess.run(["iptables", "-D", *rule], capture_output=True, check=False)

    def _claim_mesh(self) -> None:
        self.mesh, self._lock_fd = claim_slot("mesh", self.mesh, MAX_MESH_SLOTS)
        self._reap_previous()

    def _reap_previous(self) -> None:
        """Remove what an earlier holder of this mesh slot left when it was killed outright.

        Its nodes' containerds are reaped by the harness when their slots are
        claimed again; what is the cluster's own is its processes, its work
        directory and its bridge (its veths died with the node namespaces, or
        go with the bridge's ports below).
        """
        for old in Path(tempfile.gettempdir()).glob(f"weft-mesh{self.mesh}-*"):
            Containerd._kill_processes_mentioning(str(old))
            shutil.rmtree(old, ignore_errors=True)
        for i in range(BRIDGE_HOST):
            if Path(f"/sys/class/net/{self.veth(i)}").exists():
                _ip("link", "delete", self.veth(i), check=False)
        _ip("link", "delete", self.bridge, check=False)
        self._allow_forwarding(False)

    def _attach(self, node: Node) -> None:
        veth = self.veth(node.index)
        _ip("link", "add", veth, "type", "veth", "peer", "name", MESH_IFACE, "netns", node.netns)
        _ip("link", "set", veth, "master", self.bridge, "up")
        _ip("-n", node.netns, "addr", "add", f"{node.mesh_ip}/24", "dev", MESH_IFACE)
        _ip("-n", node.netns, "link", "set", MESH_IFACE, "up")
        # A new namespace starts with forwarding off. The CNI bridge plugin turns it on with a node's first
        # pod; a node must route its peers' traffic to its pods from the start, not from that moment.
        node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")

    # -- faults ------------------------------------------------------------------
    def cut(self, i: int) -> None:
        """Take node ``i``'s switch port down: its peers' packets to it, and its own, go nowhere."""
        _ip("link", "set", self.veth(i), "down")

    def heal(self, i: int, timeout: float = 5.0) -> None:
        """Bring node ``i``'s port back up and wait until the bridge forwards through it again."""
        _ip("link", "set", self.veth(i), "up")
        state = Path(f"/sys/class/net/{self.veth(i)}/brport/state")
        deadline = time.monotonic() + timeout
        while state.read_text().strip() != "3":  # BR_STATE_FORWARDING
            if time.monotonic() >= deadline:
                raise RuntimeError(f"{self.veth(i)} is not forwarding {timeout}s after heal")
            time.sleep(0.02)

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``'s containerd and every process started in it with ``popen``.

        Its link stays up and its pods (their shims outlive containerd, as on a
        real node) go on: peers see refused connections, not silence. Add
        ``cut(i)`` for a node that is gone from the network too, and
        ``nodes[i].containerd.start()`` to bring containerd back.
        """
        node = self.nodes[i]
        node.kill_processes()
        node.containerd.stop(signal.SIGKILL)

    # -- teardown ----------------------------------------------------------------
    def close(self) -> None:
        """Remove every node, veth and the bridge. Safe to call more than once."""
        if self._lock_fd is None:
            return
        errors: list[str] = []
        for node in self.nodes:
            node.kill_processes()
            try:
                node.containerd.close()
            except Exception as exc:  # noqa: BLE001 - the other nodes still need closing
                errors.append(f"{node.name}: {exc}")
            _ip("link", "delete", self.veth(node.index), check=False)
        _ip("link", "delete", self.bridge, check=False)
        self._allow_forwarding(False)
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
        os.close(self._lock_fd)
        self._lock_fd = None
        if errors:
            raise RuntimeError("; ".join(errors))
