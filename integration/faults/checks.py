"""What every fault test shares: kubelet's side of the origin, the fabric's invariants, and repair.

``Kubelet`` drives ``gpu-1`` through its agent's CRI socket and remembers
every container it was handed, as kubelet would. ``problems`` lists what is
wrong with the fabric right now, against these invariants (DESIGN 2.3, 2.4):

- nothing silently vanished: every container kubelet was given is still
  known to the origin (ContainerStatus and ListContainers), created, running
  or exited, and an exited one says why (a reason);
- no leaked lease: the broker's leases are exactly the GPU containers of the
  origin that are created or running (an exited one released its lease);
- no leaked record: a local placement names a container containerd has, and
  no placement is left pending;
- no leaked shadow: the shadows on the hosts are exactly the origin's remote
  placements, one each, on the host the placement names, and no shadow
  sandbox is left without a container (once the hosts' TTL for those has
  passed: a sandbox prepared for a pod whose container a fault kept away is
  removed by its host then, 5 s in these tests);
- the origin and its hosts agree: a remote container the origin reports
  running runs on its host, and one it reports exited does not;
- at most one live copy: per pod and container name, at most one running
  container across the origin's containerd and every host.

``settled`` polls ``problems`` until the list is empty (things take a few
heartbeats to settle after a fault) and fails with the last list.
``LiveCopies`` checks the last invariant continuously while a fault lasts,
and also that the origin never reports a container exited while its host
still runs it (kubelet would start a second copy).
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.waiting import wait_for

ORIGIN = "gpu-1"
HOSTS = ("cpu-1", "cpu-2")
WEFT = "weft"
GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all"}
PLACEMENT = "weft.io/placement"
ORIGIN_LABEL = "weft.io/origin-node"
SANDBOX_LABEL = "weft.io/origin-sandbox"
KEY_ANNOTATION = "weft.io/origin-key-full"
LOST = "WeftPeerLost"
_STATE = {cri.CONTAINER_CREATED: "created", cri.CONTAINER_RUNNING: "running", cri.CONTAINER_EXITED: "exited",
          cri.CONTAINER_UNKNOWN: "unknown"}


def cpu_config(name: str, command: tuple[str, ...] = ("sleep", "3600"), *, attempt: int = 0) -> cri.ContainerConfig:
    """A CPU container safe to reroute (limits declared)."""
    config = pods.container_config(name, list(command), attempt=attempt)
    res = config.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, 50000, 64 << 20
    return config


def gpu_config(name: str, *, attempt: int = 0) -> cri.ContainerConfig:
    return pods.container_config(name, ["sleep", "3600"], envs=GPU_ENV, attempt=attempt)


def gpu_share(*names: str) -> dict[str, str]:
    """Pod annotations for a 10 GiB share per GPU container, so several fit on the two simulated devices."""
    return {f"weft.io/gpu-memory.{n}": "10Gi" for n in names}


def every_state(kube: Kubelet, pod: str) -> dict[str, int]:
    """A pod with local GPU and remote CPU containers, each created, running and exited; their states by ID."""
    sid = kube.run_pod(pod, gpu_share("g-created", "g-running", "g-exited"))
    made = {
        kube.create(sid, gpu_config("g-created"), start=False): cri.CONTAINER_CREATED,
        kube.create(sid, gpu_config("g-running")): cri.CONTAINER_RUNNING,
        kube.create(sid, gpu_config("g-exited")): cri.CONTAINER_EXITED,
        kube.create(sid, cpu_config("c-created"), start=False): cri.CONTAINER_CREATED,
        kube.create(sid, cpu_config("c-running")): cri.CONTAINER_RUNNING,
        kube.create(sid, cpu_config("c-exited", ("sh", "-c", "exit 3"))): cri.CONTAINER_EXITED,
    }
    for cid, state in made.items():
        if state == cri.CONTAINER_EXITED and kube.host_of(cid) == ORIGIN:
            kube.stop(cid)
    for cid, state in made.items():
        kube.wait_state(cid, state)
    assert {kube.host_of(c) for c in made if kube.known[c][1].metadata.name.startswith("c-")} <= set(HOSTS)
    return made


@dataclass
class Kubelet:
    """kubelet on the origin: CRI through its agent, and the containers it was handed."""

    f: Fabric3
    sandboxes: dict[str, cri.PodSandboxConfig] = field(default_factory=dict)
    # Every container ID CreateContainer returned and the test did not remove: (sandbox, config).
    known: dict[str, tuple[str, cri.ContainerConfig]] = field(default_factory=dict)

    def call(self, method: str, request, timeout: float = 60.0):
        ch, rt = self.f.runtime(ORIGIN)
        with ch:
            return getattr(rt, method)(request, timeout=timeout)

    def retry(self, method: str, request, timeout: float = 10.0):
        """As kubelet does: a call that met UNAVAILABLE (a daemon just back) is tried again after a backoff."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.call(method, request)
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def run_pod(self, name: str, annotations: dict[str, str] | None = None) -> str:
        node = self.f.node(ORIGIN)
        cfg = pods.sandbox_config(name, node.containerd.pod_log_dir, cgroup_parent=node.containerd.cgroup_root,
                                  annotations=annotations)
        sid = self.call("RunPodSandbox", cri.RunPodSandboxRequest(config=cfg, runtime_handler=WEFT)).pod_sandbox_id
        self.sandboxes[sid] = cfg
        return sid

    def run_one(self, pod: str) -> str:
        """A pod of one CPU container (``tokenize``), created and running (on a host, as placement has it)."""
        cid = self.create(self.run_pod(pod), cpu_config("tokenize"))
        self.wait_state(cid, cri.CONTAINER_RUNNING)
        return cid

    def create(self, sid: str, config: cri.ContainerConfig, *, start: bool = True) -> str:
        cid = self.call("CreateContainer", cri.CreateContainerRequest(
            pod_sandbox_id=sid, config=config, sandbox_config=self.sandboxes[sid])).container_id
        self.known[cid] = (sid, config)
        if start:
            self.start(cid)
        return cid

    def start(self, cid: str) -> None:
        self.call("StartContainer", cri.StartContainerRequest(container_id=cid))

    def stop(self, cid: str, timeout: int = 0) -> None:
        self.call("StopContainer", cri.StopContainerRequest(container_id=cid, timeout=timeout))

    def remove(self, cid: str) -> None:
        self.call("RemoveContainer", cri.RemoveContainerRequest(container_id=cid))
        self.known.pop(cid, None)

    def restart(self, cid: str) -> str:
        """What kubelet does with an exited container of a restartPolicy=Always pod: the next attempt."""
        sid, config = self.known[cid]
        again = cri.ContainerConfig()
        again.CopyFrom(config)
        again.metadata.attempt = config.metadata.attempt + 1
        again.log_path = f"{config.metadata.name}/{again.metadata.attempt}.log"
        return self.create(sid, again)

    def status(self, cid: str) -> cri.ContainerStatus:
        return self.call("ContainerStatus", cri.ContainerStatusRequest(container_id=cid), timeout=10).status

    def state(self, cid: str) -> int:
        return self.status(cid).state

    def wait_state(self, cid: str, state: int, timeout: float = 20.0) -> cri.ContainerStatus:
        return wait_for(lambda: (s := self.status(cid)).state == state and s, timeout=timeout,
                        what=f"{cid[:12]} {_STATE[state]} on the origin")

    def host_of(self, cid: str) -> str:
        """The node a container runs on: a host's name, or the origin's for a local one."""
        placement = self.status(cid).annotations.get(PLACEMENT, "local")
        return placement.removeprefix("remote:") if placement.startswith("remote:") else ORIGIN

    def cleanup(self) -> None:
        """Remove every pod this kubelet made (as the API server deleting them would)."""
        for sid in list(self.sandboxes):
            # Stopped at once first: ``sleep`` as PID 1 ignores SIGTERM, and each stop would wait out its grace.
            with contextlib.suppress(grpc.RpcError):
                for c in self.call("ListContainers", cri.ListContainersRequest(
                        filter=cri.ContainerFilter(pod_sandbox_id=sid))).containers:
                    if c.state != cri.CONTAINER_EXITED:
                        self.stop(c.id)
            with contextlib.suppress(grpc.RpcError):
                self.call("StopPodSandbox", cri.StopPodSandboxRequest(pod_sandbox_id=sid))
            try:
                self.call("RemovePodSandbox", cri.RemovePodSandboxRequest(pod_sandbox_id=sid))
            except grpc.RpcError as exc:
                if exc.code() is not grpc.StatusCode.NOT_FOUND:
                    raise
            self.sandboxes.pop(sid)
        self.known.clear()


# -- what is where ------------------------------------------------------------------------------
def _direct_containers(f: Fabric3, node: str, labels: dict[str, str] | None = None) -> list[cri.Container]:
    ch, rt = f.direct(node)
    with ch:
        return list(rt.ListContainers(cri.ListContainersRequest(filter=cri.ContainerFilter(
            label_selector=labels or {})), timeout=10).containers)


def _shadow_sandboxes(f: Fabric3, node: str) -> list[cri.PodSandbox]:
    ch, rt = f.direct(node)
    with ch:
        return list(rt.ListPodSandbox(cri.ListPodSandboxRequest(filter=cri.PodSandboxFilter(
            label_selector={ORIGIN_LABEL: ORIGIN})), timeout=10).items)


def key_of(p: dict) -> str:
    return f"{p['sandbox_id']}/{p['name']}/{p['attempt']}"


def running_copies(f: Fabric3) -> Counter[tuple[str, str]]:
    """How many running containers each (origin sandbox, container name) has across the fabric."""
    seen: Counter[tuple[str, str]] = Counter()
    for c in _direct_containers(f, ORIGIN):
        if c.state == cri.CONTAINER_RUNNING:
            seen[(c.pod_sandbox_id, c.metadata.name)] += 1
    for host in HOSTS:
        for c in _direct_containers(f, host, {ORIGIN_LABEL: ORIGIN}):
            if c.state == cri.CONTAINER_RUNNING:
                seen[(c.labels.get(SANDBOX_LABEL, "?"), c.metadata.name)] += 1
    return seen


def problems(f: Fabric3, kube: Kubelet) -> list[str]:
    """Every invariant of the module docstring that does not hold right now."""
    out: list[str] = []
    doc = f.status(ORIGIN)
    placements = doc["placements"]
    by_cid = {p["container_id"]: p for p in placements if p["container_id"]}
    local = {c.id: c for c in _direct_containers(f, ORIGIN)}

    # Nothing kubelet was given silently vanished.
    listed = {c.id for c in kube.call("ListContainers", cri.ListContainersRequest(), timeout=10).containers}
    origin_view: dict[str, cri.ContainerStatus] = {}
    for cid in kube.known:
        try:
            st = kube.status(cid)
        except grpc.RpcError as exc:
            out.append(f"{cid[:12]} vanished: ContainerStatus {exc.code().name} {exc.details()}")
            continue
        origin_view[cid] = st
        if st.state not in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING, cri.CONTAINER_EXITED):
            out.append(f"{cid[:12]} is in state {_STATE.get(st.state, st.state)}")
        if st.state == cri.CONTAINER_EXITED and not st.reason:
            out.append(f"{cid[:12]} exited without a reason")
        if cid not in listed:
            out.append(f"{cid[:12]} missing from ListContainers")
        if cid not in by_cid:
            out.append(f"{cid[:12]} has no placement in weft status")

    # Records and leases.
    for p in placements:
        if p["state"] != "created":
            out.append(f"placement {key_of(p)} left {p['state']}")
        elif not p["placement"].startswith("remote:") and p["container_id"] not in local:
            out.append(f"placement {key_of(p)} names {p['container_id'][:12]}, which containerd does not have")
    alive_gpu = {key_of(p) for p in placements if p["stage"] == "gpu" and p["container_id"] in local
                 and local[p["container_id"]].state in (cri.CONTAINER_CREATED, cri.CONTAINER_RUNNING)}
    assert f.broker is not None
    leases = {lease.key: lease for lease in f.broker.leases()}
    for key in sorted(set(leases) - alive_gpu):
        out.append(f"leaked lease {leases[key].lease_id} ({key}, {leases[key].state})")
    for key in sorted(alive_gpu - set(leases)):
        out.append(f"GPU container {key} alive without a lease")

    # Shadows: exactly the remote placements, on their hosts, one each.
    expected = {key_of(p): p["placement"].removeprefix("remote:") for p in placements
                if p["placement"].startswith("remote:")}
    shadows: dict[str, list[tuple[str, cri.Container]]] = {}
    for host in HOSTS:
        found = _direct_containers(f, host, {ORIGIN_LABEL: ORIGIN})
        for c in found:
            shadows.setdefault(c.annotations.get(KEY_ANNOTATION, "?"), []).append((host, c))
        with_containers = {c.pod_sandbox_id for c in found}
        for sb in _shadow_sandboxes(f, host):
            if sb.id not in with_containers:
                out.append(f"shadow sandbox {sb.id[:12]} on {host} left without a container")
    for key, copies in sorted(shadows.items()):
        where = [h for h, _ in copies]
        if key not in expected:
            out.append(f"orphan shadow {key} on {', '.join(where)}")
        elif where != [expected[key]]:
            out.append(f"shadow {key} on {where}, the origin says {expected[key]}")
    for key in sorted(set(expected) - set(shadows)):
        out.append(f"remote placement {key} on {expected[key]} has no shadow there")

    # Origin and hosts agree on remote containers.
    for cid, st in origin_view.items():
        p = by_cid.get(cid)
        if p is None or not p["placement"].startswith("remote:"):
            continue
        copies = shadows.get(key_of(p), [])
        running_there = any(c.state == cri.CONTAINER_RUNNING for _, c in copies)
        if st.state == cri.CONTAINER_RUNNING and not running_there:
            out.append(f"{cid[:12]} running on the origin, not on {p['placement']}")
        if st.state == cri.CONTAINER_EXITED and running_there:
            out.append(f"{cid[:12]} exited ({st.reason}) on the origin, still running on {p['placement']}")

    for (sid, name), n in running_copies(f).items():
        if n > 1:
            out.append(f"{n} live copies of {sid[:12]}/{name}")
    return out


def settled(f: Fabric3, kube: Kubelet, timeout: float = 20.0) -> None:
    """Wait until every invariant holds; fail listing what still does not."""
    deadline = time.monotonic() + timeout
    last: list[str] = []
    while True:
        try:
            last = problems(f, kube)
        except grpc.RpcError as exc:  # a daemon still coming back
            last = [f"cannot check yet: {exc.code().name} {exc.details()}"]
        if not last:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(f"after {timeout:g}s the fabric still has problems:\n  " + "\n  ".join(last))
        time.sleep(0.25)


class LiveCopies:
    """While in the block, watch that no container runs twice and the origin never gives up on a live copy.

    Polls every ``every`` seconds; a node that cannot be asked (its
    containerd or agent is the fault) is skipped for that round. Raises on
    exit with the first violations seen.
    """

    def __init__(self, f: Fabric3, kube: Kubelet, every: float = 0.2) -> None:
        self.f, self.kube, self.every = f, kube, every
        self.violations: list[str] = []
        self.errors: list[str] = []
        self.rounds = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-copies", daemon=True)

    def __enter__(self) -> LiveCopies:
        self._thread.start()
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        if exc_type is None:
            assert not self.violations, "at most one live copy broken:\n  " + "\n  ".join(self.violations[:10])
            assert not self.errors, f"the live-copy watch itself failed: {self.errors[:3]}"
            assert self.rounds > 0, "the live-copy watch never completed a round"

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                with contextlib.suppress(grpc.RpcError):  # a node that is the fault: skipped this round
                    for (sid, name), n in running_copies(self.f).items():
                        if n > 1:
                            self.violations.append(f"{n} live copies of {sid[:12]}/{name}")
                with contextlib.suppress(grpc.RpcError):
                    self._origin_gave_up_on_a_live_copy()
            except Exception as exc:  # noqa: BLE001 - a broken watch must fail the test, not pass it vacuously
                self.errors.append(repr(exc))
            self.rounds += 1

    def _origin_gave_up_on_a_live_copy(self) -> None:
        # The origin first, then the hosts: a stop that lands between the two reads then shows the host's copy
        # stopped too (read the other way round, a host's copy seen running just before an orderly stop and the
        # origin's answer just after it would look like a violation that never happened).
        exited = {}
        for cid, (sid, config) in list(self.kube.known.items()):
            try:
                st = self.kube.status(cid)
            except grpc.RpcError:  # removed since, or the origin is the fault: nothing it reports
                continue
            if st.state == cri.CONTAINER_EXITED:
                exited[f"{sid}/{config.metadata.name}/{config.metadata.attempt}"] = (cid, st)
        running = {}
        for host in HOSTS:
            with contextlib.suppress(grpc.RpcError):
                for c in _direct_containers(self.f, host, {ORIGIN_LABEL: ORIGIN}):
                    if c.state == cri.CONTAINER_RUNNING:
                        running[c.annotations.get(KEY_ANNOTATION, "")] = host
        for key, (cid, st) in exited.items():
            if key in running:
                self.violations.append(f"origin reports {cid[:12]} exited ({st.reason}) while "
                                       f"{running[key]} still runs it")


def explain(f: Fabric3, cid: str) -> str:
    """``weft explain`` of a container on the origin (for failure messages)."""
    with f.agents[ORIGIN].channel() as ch:
        return ch.unary_unary("/weft.agent.v1.Admin/Explain")(cid.encode(), timeout=10).decode()


# -- faults and repair --------------------------------------------------------------------------
def restart_agent(f: Fabric3, name: str, env: dict[str, str] | None = None, sig: int = 9) -> None:
    agent = f.agents[name]
    agent.stop(sig)
    agent.env = env or {}
    agent.start()


def node_index(f: Fabric3, name: str) -> int:
    assert f.cluster is not None
    return [n.name for n in f.cluster.nodes].index(name)


LOSS_MARK = "weft-fault-loss"


def add_loss(f: Fabric3, name: str, percent: int) -> str:
    """Drop ``percent`` % of the packets each way on node ``name``'s link; returns how (netem or iptables).

    tc netem on both ends of the veth when the kernel has it; otherwise the
    same loss with iptables' statistic match inside the node (in and out of
    ``eth-mesh``), which drops packets at random just as netem's loss does.
    """
    assert f.cluster is not None
    node = f.node(name)
    veth = f.cluster.veth(node_index(f, name))
    netem = [("tc", "qdisc", "replace", "dev", veth, "root", "netem", "loss", f"{percent}%"),
             ("nsenter", f"--net={node.netns_path}", "tc", "qdisc", "replace", "dev", "eth-mesh", "root", "netem",
              "loss", f"{percent}%")]
    first = subprocess.run(netem[0], capture_output=True, text=True)
    if first.returncode == 0:
        subprocess.run(netem[1], capture_output=True, text=True, check=True)
        return "netem"
    p = f"{percent / 100:.2f}"
    for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
        res = node.run("iptables", "-I", chain, flag, "eth-mesh", "-m", "statistic", "--mode", "random",
                       "--probability", p, "-m", "comment", "--comment", LOSS_MARK, "-j", "DROP", check=False)
        if res.returncode != 0:
            raise AssertionError(f"cannot inject packet loss: tc netem failed ({first.stderr.strip()}; the kernel "
                                 f"lacks sch_netem?) and iptables statistic failed ({res.stderr.strip()})")
    return f"iptables statistic (tc netem unavailable: {first.stderr.strip()})"


def dropped(f: Fabric3, name: str) -> int:
    """Packets the iptables loss rules on node ``name`` dropped so far (0 with netem or no rules)."""
    out = f.node(name).run("iptables", "-L", "-v", "-n", "-x", check=False).stdout
    return sum(int(line.split()[0]) for line in out.splitlines() if LOSS_MARK in line)


def clear_loss(f: Fabric3, name: str) -> None:
    assert f.cluster is not None
    node = f.node(name)
    subprocess.run(["tc", "qdisc", "del", "dev", f.cluster.veth(node_index(f, name)), "root"], capture_output=True)
    node.run("tc", "qdisc", "del", "dev", "eth-mesh", "root", check=False)
    for chain, flag in (("INPUT", "-i"), ("OUTPUT", "-o")):
        while node.run("iptables", "-D", chain, flag, "eth-mesh", "-m", "statistic", "--mode", "random",
                       "--probability", "0.30", "-m", "comment", "--comment", LOSS_MARK, "-j", "DROP",
                       check=False).returncode == 0:
            pass


def power_off(f: Fabric3, name: str) -> None:
    """A host goes down hard: agent, containerd, shims and containers killed, its network namespace torn down.

    What a reboot keeps is kept: containerd's root (its metadata: the
    shadows are there, and read as exited once it is back) and the agent's
    state directory.
    """
    assert f.cluster is not None
    ctrd = f.node(name).containerd
    f.agents[name].stop(9)
    f.cluster.kill_node(node_index(f, name))
    ctrd._kill_leftovers()  # the shims and every container process
    subprocess.run(["ip", "netns", "delete", ctrd.netns], capture_output=True, check=False)
    # The kernel tears a namespace down in the background; its end of the link goes with it.
    veth = Path(f"/sys/class/net/{f.cluster.veth(node_index(f, name))}")
    wait_for(lambda: not veth.exists(), what=f"{name}'s namespace and link gone")


def power_on(f: Fabric3, name: str) -> None:
    """The host boots: a new namespace attached to the mesh bridge, routes, containerd, then the agent."""
    assert f.cluster is not None
    node = f.node(name)
    node.containerd._make_netns()
    f.cluster._attach(node)
    for peer in f.cluster.nodes:
        if peer is not node:
            subprocess.run(["ip", "-n", node.netns, "route", "replace", peer.pod_subnet, "via", peer.mesh_ip],
                           capture_output=True, check=True)
    node.containerd.start()
    f.agents[name].start()


def repair(f: Fabric3) -> None:
    """Undo whatever a test left broken: links up and clean, every containerd and agent running, meshed."""
    assert f.cluster is not None
    for name in (ORIGIN, *HOSTS):
        i = node_index(f, name)
        if Path(f"/sys/class/net/{f.cluster.veth(i)}").exists():
            clear_loss(f, name)
            f.cluster.heal(i)
        ctrd = f.node(name).containerd
        if not ctrd.running:
            ctrd.start()
        agent = f.agents[name]
        if agent.proc is None or agent.proc.poll() is not None or agent.env:
            agent.stop(9)
            agent.env = {}
            agent.start()
    assert f.broker is not None
    if f.broker.proc is None or f.broker.proc.poll() is not None or f.broker.extra_env:
        f.broker.stop(9)
        f.broker.extra_env = {}
        f.broker.start()
    f.wait_meshed()
