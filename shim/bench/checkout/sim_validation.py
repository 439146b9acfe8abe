"""``weft simulate mesh`` against the real agents, at a size the local fabric runs: the same bursts, side by side.

``python -m bench.sim_validation [--origins 2] [--hosts 4,17] [--placements 12] [--rounds 3] [--seeds 20]
[--scenario NAME ...] [--json] [--output FILE]``, from a checkout, as root (the local fabric: real containerd and
runc in network namespaces).

For each fleet size, ``--origins`` GPU nodes and ``--hosts`` CPU hosts, each a real containerd with a real
``weft agent`` in a network namespace of its own, meshed over TLS as ``weft bench mesh``'s fabric is, at the
agents' default Hello interval (2 s) and with the node names the simulation gives (``gpu-0``, ``cpu-00``...).
Every host advertises 4 CPUs and 8 GiB (``mesh.fixed_capacity``) and runs one pod of its own, straight on its
containerd as kubelet would run one, whose CPU weight and memory limit are the fill the scenario gives the host
(its own requests to the agent), so its room is an exact number of stages. The scenarios, fixed before any run:

- ``burst``: hosts with room for 4, 3 and 2 stages in turn, the placements all at once;
- ``full``: room for two thirds of the placements, one stage at a time over the hosts in turn, all at once;
- ``spread``: as ``burst``, the placements at random moments within three Hello intervals.

A placement is an opted-in pod's CPU stage (limits 0.5 CPU, 64 MiB) created and started through its origin's
CRI socket, as kubelet does, each from a thread of its own; placement i comes from origin i mod N. Before each
burst the origins' agents are restarted (the simulation's origins start afresh too); the prepared shadow sandbox
is off (``mesh.prepare_shadow_sandbox = false``: the simulation has none). From the real agents: the Admits each
placement cost (its key's ``peer.admit`` lines in the hosts' logs), where it ran (its ``weft.io/placement``) and
each host's room after the burst (its answer to a Hello). Each scenario runs ``--rounds`` real bursts; each burst
is then simulated by ``shim.sim.mesh`` as it was sent (the same hosts, fills, stage and Hello interval, the same
send times from the same origins, the warm-up its origins had) for ``--seeds`` seeds of its own. A real figure
agrees when every burst's lies within the range of the scenario's simulated runs, widened by ``TOLERANCE``. Exit
codes: 0 measured and agreeing, 3 measured and some figure disagreeing (the table says which), 1 failed, 130/143
stopped.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim._pb import mesh_pb2 as pb
from shim.bench.mesh import SLEEPER, cpu_container
from shim.bench.running import guarded, parse_counts, report, right_aligned
from shim.config import MeshConfig
from shim.core.reroute import Resources
from shim.core.stats import percentile
from shim.core.tracking import TRACKED_PEERS
from shim.errors import WeftError
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess, free_port, stop_all
from shim.localfabric.broker import BrokerProcess, weft_handler
from shim.localfabric.nodes import Cluster, Node
from shim.localfabric.waiting import wait_for
from shim.mesh.certs import load_node_tls
from shim.mesh.client import PeerClient
from shim.sim import mesh as sim

REPO = Path(__file__).resolve().parents[3]
MESH_PORT = 7443
GIB = 1 << 30
HOST_CPU = 4.0
HOST_MEMORY = 8 * GIB
STAGE = Resources(0.5, 64 << 20)
HELLO_S = MeshConfig().hello_interval
WARMUP_S = 10.0  # at least this long from the origins' start to the burst (five Hello rounds)
SCENARIOS = ("burst", "full", "spread")
ROOMS_BURST = (4, 3, 2)
SPREAD_S = 3 * HELLO_S
STAGE_NAME = "stage"
ORIGIN_LABEL = "weft.io/origin-node"  # what marks a host's shadows (shim.crishared.labels)
PLACEMENT_REASON = "weft.io/placement-reason"
RPC_TIMEOUT = 120.0
# A real figure agrees when it lies within the simulation's range over the seeds, widened by this much. Set before
# any run; the figures not listed are shown, not judged.
TOLERANCE = {"admits_mean": 0.15, "admits_p99": 1, "local": 1, "hosts_used": 1, "max_over_mean": 0.25,
             "fullest_share": 0.05, "hosts_overcommitted": 0}
FIGURES = (("admits_mean", "Admits/placement mean"), ("admits_p99", "Admits/placement p99"),
           ("local", "placements run locally"), ("local_while_room_at_end", "local, a host with room at the end"),
           ("hosts_used", "hosts used"), ("max_over_mean", "most on a host / mean"),
           ("fullest_share", "fullest host's share"), ("hosts_overcommitted", "hosts overcommitted"),
           ("slots_left", "stages' room left"), ("placement_p50_ms", "placement p50 ms"),
           ("placement_p99_ms", "placement p99 ms"))


def _say(msg: str) -> None:
    print(f"[sim-validation] {msg}", file=sys.stderr, flush=True)


# -- the scenarios: pure ---------------------------------------------------------------
def names(prefix: str, n: int) -> list[str]:
    """The simulation's node names (``shim.sim.mesh.Fleet``): ``cpu-00``... for 17 hosts, ``gpu-0``... for 2."""
    return [f"{prefix}-{i:0{len(str(n))}d}" for i in range(n)]


def rooms_for(scenario: str, hosts: int, placements: int) -> tuple[int, ...]:
    """Each host's room, in stages."""
    if scenario == "full":
        total = math.ceil(2 * placements / 3)
        return tuple(total // hosts + (1 if i < total % hosts else 0) for i in range(hosts))
    return tuple(ROOMS_BURST[i % len(ROOMS_BURST)] for i in range(hosts))


def fill_for(room: int) -> float:
    """The fill that leaves a host room for ``room`` stages and half a stage over (never at the edge of a fit)."""
    own = HOST_CPU - sim.RESERVE.cpu_cores - STAGE.cpu_cores * (room + 0.5)
    if own < 0:
        raise ValueError(f"a host of {HOST_CPU:g} CPUs has no room for {room} stages of {STAGE.cpu_cores:g}")
    return own / HOST_CPU


def own_requests(fill: float) -> tuple[int, int]:
    """(CPU weight, memory limit) of the pod that takes ``fill`` of a host: the agent counts weight / 1024."""
    return round(fill * HOST_CPU * 1024), int(HOST_MEMORY * fill)


def planned_offsets(scenario: str, placements: int) -> list[float]:
    """When each placement is sent, seconds after the burst's start (the same every run)."""
    if scenario != "spread":
        return [0.0] * placements
    rng = random.Random(1)
    return sorted(round(rng.uniform(0, SPREAD_S), 3) for _ in range(placements))


def summarize(admits: list[int], hosted: dict[str, int], local: int, slots_left: int, overcommitted: int,
              latency_s: list[float]) -> dict:
    """The compared figures, computed alike for the real agents and for each simulated run."""
    total = sum(hosted.values())
    used = len(hosted)
    top = max(hosted.values(), default=0)
    return {
        "placements": len(admits), "remote": total, "local": local,
        "local_while_room_at_end": local if slots_left else 0,
        "admits_mean": round(sum(admits) / len(admits), 3) if admits else 0.0,
        "admits_p99": percentile(admits, 99, observed=True) or 0,
        "hosts_used": used, "max_over_mean": round(top * used / total, 2) if total else 0.0,
        "fullest_share": round(top / total, 4) if total else 0.0,
        "hosts_overcommitted": overcommitted, "slots_left": slots_left,
        "placement_p50_ms": round((percentile(latency_s, 50, observed=True) or 0.0) * 1e3, 1),
        "placement_p99_ms": round((percentile(latency_s, 99, observed=True) or 0.0) * 1e3, 1),
        "by_host": dict(sorted(hosted.items())),
    }


def scenario_of(name: str, rooms: tuple[int, ...], origins: int, sent: list[tuple[float, int]],
                warmup_s: float) -> sim.Scenario:
    """The simulation's scenario for what the real fleet did: its hosts, fills, stage, clocks and arrivals."""
    return sim.Scenario(name, hosts=len(rooms), origins=origins, fill=0.0, fill_spread=0.0, host_cpu=HOST_CPU,
                        host_memory=HOST_MEMORY, stage=STAGE, placements=len(sent),
                        window_s=max((at for at, _ in sent), default=0.0), warmup_s=warmup_s,
                        hello_interval=HELLO_S, fills=tuple(fill_for(r) for r in rooms), arrivals=tuple(sent),
                        keys_by_seed=True)


def simulate(s: sim.Scenario, seeds: range) -> list[dict]:
    out = []
    for seed in seeds:
        fleet = sim.Fleet(s, seed)
        fleet.run()
        t = fleet.tally
        over = sum(1 for h in fleet.hosts.values() if h.over > 1e-9)
        out.append(summarize(t.admits, fleet.hosted(), t.local, fleet.slots_left(), over, t.latency_s))
    return out


def judge(reals: list[dict], runs: list[dict]) -> dict:
    """Each figure: the real value of each round, the simulation's mean and range over every seed of every round
    (each round's burst simulated as it was sent), and whether every round lies within that range, widened by
    ``TOLERANCE``."""
    out = {}
    for key, _ in FIGURES:
        values = [r[key] for r in runs]
        lo, hi = min(values), max(values)
        real = [r[key] for r in reals]
        mean = sum(values) / len(values)
        # Of the simulated runs, the share at least as far from their mean as the real burst furthest from it: how
        # rare the simulation finds what the real agents did (shown, not judged).
        far = max(abs(v - mean) for v in real)
        row = {"real": real, "real_mean": round(sum(real) / len(real), 3), "sim_mean": round(mean, 3),
               "sim_min": lo, "sim_max": hi,
               "sims_as_far": round(sum(1 for x in values if abs(x - mean) >= far - 1e-9) / len(values), 3)}
        if key in TOLERANCE:
            tol = TOLERANCE[key]
            row["agree"] = all(lo - tol - 1e-9 <= v <= hi + tol + 1e-9 for v in real)
        out[key] = row
    return out


# -- the real fleet ----------------------------------------------------------------------
@dataclass(frozen=True)
class Pod:
    origin: str
    id: str
    config: cri.PodSandboxConfig


@dataclass
class Placed:
    pod: Pod
    container_id: str
    sent_s: float  # after the burst's start
    create_s: float
    placement: str
    reason: str


@dataclass
class LocalFleet:
    """Origins and CPU hosts on the local fabric, as ``Fabric3`` makes its three, at any small number."""

    workdir: Path
    origins: list[str]
    hosts: list[str]
    cluster: Cluster | None = None
    brokers: dict[str, BrokerProcess] = field(default_factory=dict)
    agents: dict[str, AgentProcess] = field(default_factory=dict)
    fillers: dict[str, str] = field(default_factory=dict)  # host -> its own pod's sandbox ID
    certs: Path | None = None

    def node(self, name: str) -> Node:
        assert self.cluster is not None
        return next(n for n in self.cluster.nodes if n.name == name)

    def open(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        pods_dir = self.workdir / "kubelet" / "pods"
        pods_dir.mkdir(parents=True, exist_ok=True)
        for o in self.origins:
            self.brokers[o] = BrokerProcess(self.workdir / f"broker-{o}").start()
        everyone = self.origins + self.hosts
        self.cluster = Cluster(n=len(everyone), names=everyone, handlers_for=lambda i, d: (
            [weft_handler(d, self.brokers[everyone[i]].socket)] if i < len(self.origins) else None))
        self.cluster.open()
        self.certs = self.workdir / "certs"
        subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(self.certs), "--nodes",
                        ",".join(everyone)], check=True, capture_output=True)
        peers = self.workdir / "peers.toml"
        peers.write_text("".join(f'[[peer]]\nname = "{n.name}"\naddress = "{n.mesh_ip}:{MESH_PORT}"\n'
                                 f'role = "{"gpu" if n.name in self.origins else "cpu"}"\n\n'
                                 for n in self.cluster.nodes))
        common = (f'[mesh]\nkubelet_pods_dir = "{pods_dir}"\n'
                  f'fixed_capacity = "{HOST_CPU:g},{HOST_MEMORY // GIB}Gi"\nprepare_shadow_sandbox = false\n')
        for node in self.cluster.nodes:
            conf = self.workdir / f"{node.name}.toml"
            conf.write_text(common + f'shadow_cgroup_parent = "{node.containerd.cgroup_root}/shadows"\n')
            origin = node.name in self.origins
            extra = ["--config", str(conf), "--node-name", node.name, "--role", "gpu" if origin else "cpu",
                     "--mesh-address", f"{node.mesh_ip}:{MESH_PORT}", "--peers", str(peers), "--tls-dir",
                     str(self.certs), "--log-level", "info"]
            if origin:
                extra += ["--broker-socket", str(self.brokers[node.name].socket)]
            self.agents[node.name] = AgentProcess(node.containerd, self.workdir / node.name, name=node.name,
                                                  extra_args=extra, netns=node.netns, metrics_host=node.mesh_ip,
                                                  metrics_port=free_port())
        for h in self.hosts:
            self.agents[h].start(timeout=120)

    def close(self) -> None:
        stop_all(self.agents.values())
        if self.cluster is not None:
            self.cluster.close()
        for broker in self.brokers.values():
            broker.stop()

    # -- the hosts' own pods ------------------------------------------------------------
    def set_fill(self, host: str, fill: float) -> None:
        """Replace ``host``'s own pod by one whose CPU weight and memory limit are ``fill`` of the host."""
        ctrd = self.node(host).containerd
        with ctrd.channel() as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            old = self.fillers.pop(host, None)
            if old is not None:
                rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=old), timeout=RPC_TIMEOUT)
                rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=old), timeout=RPC_TIMEOUT)
            sandbox = pods.sandbox_config(f"own-{host}", ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root)
            sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox), timeout=RPC_TIMEOUT).pod_sandbox_id
            config = pods.container_config("own", SLEEPER)
            shares, memory = own_requests(fill)
            config.linux.resources.cpu_shares, config.linux.resources.memory_limit_in_bytes = shares, memory
            cid = rt.CreateContainer(cri.CreateContainerRequest(
                pod_sandbox_id=sid, config=config, sandbox_config=sandbox), timeout=RPC_TIMEOUT).container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
            self.fillers[host] = sid

    def hello(self, host: str) -> pb.PeerState:
        """The host's answer to a Hello, asked from here with the first origin's certificate."""
        assert self.certs is not None
        client = PeerClient(host, f"{self.node(host).mesh_ip}:{MESH_PORT}", load_node_tls(self.certs, self.origins[0]))
        try:
            return client.hello(pb.PeerState(node=self.origins[0], role="gpu", healthy=True))
        finally:
            client.close()

    def wait_rooms(self, rooms: dict[str, int]) -> None:
        """Until every host says the room its fill leaves (its own pod counted, no shadow)."""
        want = {h: HOST_CPU - sim.RESERVE.cpu_cores - HOST_CPU * fill_for(r) for h, r in rooms.items()}

        def right() -> bool:
            try:
                return all(abs(self.hello(h).free.cpu_cores - want[h]) < 1e-6 for h in rooms)
            except WeftError:
                return False

        wait_for(right, timeout=60, what="every host to say the room its fill leaves", every=0.5)

    def shadows(self, host: str) -> int:
        with self.node(host).containerd.channel() as ch:
            found = cri_grpc.RuntimeServiceStub(ch).ListContainers(cri.ListContainersRequest(), timeout=RPC_TIMEOUT)
        return sum(1 for c in found.containers if ORIGIN_LABEL in c.labels)

    # -- the origins ------------------------------------------------------------------------
    def restart_origins(self) -> float:
        """Stop the origins' agents and start them afresh; when the first started (monotonic)."""
        for o in self.origins:
            self.agents[o].stop()
        started = time.monotonic()
        for o in self.origins:
            self.agents[o].start(timeout=120)
        return started

    def channel(self, origin: str) -> grpc.Channel:
        # No BDP pings: containerd closes a connection that pings more than it sends (see shim.bench.mesh.origin).
        return grpc.insecure_channel(self.agents[origin].address, options=[("grpc.http2.bdp_probe", 0)])

    def run_pods(self, n: int, tag: str) -> list[Pod]:
        out = []
        for i in range(n):
            origin = self.origins[i % len(self.origins)]
            node = self.node(origin)
            config = pods.sandbox_config(f"{tag}-{i}", node.containerd.pod_log_dir,
                                         cgroup_parent=node.containerd.cgroup_root)
            with self.channel(origin) as ch:
                sid = cri_grpc.RuntimeServiceStub(ch).RunPodSandbox(cri.RunPodSandboxRequest(
                    config=config, runtime_handler=pods.WEFT), timeout=RPC_TIMEOUT).pod_sandbox_id
            out.append(Pod(origin, sid, config))
        return out

    def burst(self, placements: list[Pod], offsets: list[float]) -> list[Placed]:
        """Each pod's CPU stage created and started through its origin, each from a thread, at its offset."""
        channels = {o: self.channel(o) for o in self.origins}
        stubs = {o: cri_grpc.RuntimeServiceStub(ch) for o, ch in channels.items()}
        start: list[float] = []
        gate = threading.Barrier(len(placements), action=lambda: start.append(time.monotonic()))
        out: list[Placed | None] = [None] * len(placements)
        errors: list[str] = []

        def one(i: int) -> None:
            pod, rt = placements[i], stubs[placements[i].origin]
            gate.wait()
            time.sleep(max(0.0, start[0] + offsets[i] - time.monotonic()))
            sent = time.monotonic()
            try:
                cid = rt.CreateContainer(cri.CreateContainerRequest(
                    pod_sandbox_id=pod.id, config=cpu_container(STAGE_NAME, cpu=STAGE.cpu_cores,
                                                                memory=STAGE.memory_bytes),
                    sandbox_config=pod.config), timeout=RPC_TIMEOUT).container_id
                took = time.monotonic() - sent
                rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
                status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT).status
            except grpc.RpcError as exc:
                errors.append(f"{pod.origin} pod {i}: {exc.code().name} {exc.details()}")
                return
            out[i] = Placed(pod, cid, round(sent - start[0], 4), took, status.annotations.get(pods.PLACEMENT, ""),
                            status.annotations.get(PLACEMENT_REASON, ""))

        threads = [threading.Thread(target=one, args=(i,), name=f"burst-{i}") for i in range(len(placements))]
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            for ch in channels.values():
                ch.close()
        if errors:
            raise RuntimeError(f"placements failed: {errors}")
        return [p for p in out if p is not None]

    def admits(self, placed: list[Placed]) -> list[int]:
        """Each placement's Admits: the ``peer.admit`` lines of its key in every host's log."""
        counts = {p.pod.id: 0 for p in placed}
        for h in self.hosts:
            for e in self.agents[h].events():
                if e.get("event") == "peer.admit":
                    sid = str(e.get("key", "")).split("/", 1)[0]
                    if sid in counts:
                        counts[sid] += 1
        return [counts[p.pod.id] for p in placed]

    def clean(self, made: list[Pod], placed: list[Placed]) -> None:
        """Every container and pod of the scenario removed through its origin; until the hosts hold no shadow."""
        channels = {o: self.channel(o) for o in self.origins}
        stubs = {o: cri_grpc.RuntimeServiceStub(ch) for o, ch in channels.items()}

        def remove(pod: Pod) -> None:
            rt = stubs[pod.origin]
            for p in placed:
                if p.pod is pod:
                    rt.StopContainer(cri.StopContainerRequest(container_id=p.container_id, timeout=0),
                                     timeout=RPC_TIMEOUT)
                    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=p.container_id), timeout=RPC_TIMEOUT)
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod.id), timeout=RPC_TIMEOUT)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod.id), timeout=RPC_TIMEOUT)

        try:
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                list(pool.map(remove, made))
        finally:
            for ch in channels.values():
                ch.close()
        wait_for(lambda: all(self.shadows(h) == 0 for h in self.hosts), timeout=90,
                 what="the hosts to hold no shadow", every=0.5)


def run_round(fleet: LocalFleet, name: str, rooms: dict[str, int], placements: int, seeds: range) -> dict:
    """One burst on the real fleet, its figures, and the simulation of the same burst for each seed."""
    started = fleet.restart_origins()
    made = fleet.run_pods(placements, name)
    time.sleep(max(0.0, started + WARMUP_S - time.monotonic()))
    offsets = planned_offsets(name, placements)
    placed: list[Placed] = []
    t0 = time.monotonic()
    try:
        placed = fleet.burst(made, offsets)
        burst_s = time.monotonic() - t0
        warmup = round(t0 - started, 2)
        time.sleep(HELLO_S + 0.5)  # the hosts' books settled, their logs written
        admits = fleet.admits(placed)
        states = {h: fleet.hello(h) for h in fleet.hosts}
    finally:
        fleet.clean(made, placed)
    hosted: dict[str, int] = {}
    for p in placed:
        if p.placement.startswith("remote:"):
            host = p.placement.removeprefix("remote:")
            hosted[host] = hosted.get(host, 0) + 1
    slots = sum(max(0, min(int((s.free.cpu_cores + 1e-9) // STAGE.cpu_cores),
                           s.free.memory_bytes // STAGE.memory_bytes)) for s in states.values())
    over = sum(1 for s in states.values() if s.own_requests.cpu_cores + s.hosted_limits.cpu_cores
               + sim.RESERVE.cpu_cores > s.allocatable.cpu_cores + 1e-9)
    remote = [p.placement.startswith("remote:") for p in placed]
    real = summarize(admits, hosted, remote.count(False), slots, over,
                     [p.create_s for p, r in zip(placed, remote, strict=True) if r])
    real["local_reasons"] = sorted({p.reason for p, r in zip(placed, remote, strict=True) if not r})
    real["each"] = [{"sent_s": p.sent_s, "origin": p.pod.origin, "placement": p.placement, "admits": a,
                     "create_ms": round(p.create_s * 1e3, 1)} for p, a in zip(placed, admits, strict=True)]
    sent = [(p.sent_s, fleet.origins.index(p.pod.origin)) for p in placed]
    runs = simulate(scenario_of(name, tuple(rooms.values()), len(fleet.origins), sent, warmup), seeds)
    _say(f"{len(fleet.hosts)} hosts, {name}: real {real['admits_mean']} Admits/placement, {real['local']} local, "
         f"{real['hosts_used']} hosts used, burst {burst_s:.1f} s; simulated "
         f"{sum(r['admits_mean'] for r in runs) / len(runs):.3f} Admits/placement")
    # What the simulation was given is in ``each``: every placement's send time and origin.
    return {"warmup_s": warmup, "burst_s": round(burst_s, 2), "real": real, "sim_runs": runs}


def run_scenario(fleet: LocalFleet, name: str, placements: int, seeds: int, rounds: int) -> dict:
    rooms = dict(zip(fleet.hosts, rooms_for(name, len(fleet.hosts), placements), strict=True))
    for h, r in rooms.items():
        fleet.set_fill(h, fill_for(r))
    fleet.wait_rooms(rooms)
    # Seeds of their own for each round: its burst is sent much as the last, and the same seeds would draw the same.
    done = [run_round(fleet, name, rooms, placements, range(1 + k * seeds, 1 + (k + 1) * seeds))
            for k in range(rounds)]
    figures = judge([r["real"] for r in done], [run for r in done for run in r["sim_runs"]])
    for r in done:
        r["sim"] = simulated(r.pop("sim_runs"))
    return {"rooms": list(rooms.values()), "rounds": done, "figures": figures}


def simulated(runs: list[dict]) -> dict:
    """A round's simulated runs in short: each figure's mean, least and most over the seeds."""
    out = {}
    for key, _ in FIGURES:
        values = [r[key] for r in runs]
        out[key] = {"mean": round(sum(values) / len(values), 3), "min": min(values), "max": max(values)}
    return out


def measure_fleet(origins: int, hosts: int, placements: int, seeds: int, rounds: int, workdir: Path,
                  scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    fleet = LocalFleet(workdir, names("gpu", origins), names("cpu", hosts))
    t0 = time.monotonic()
    try:
        fleet.open()
        _say(f"{origins} origins and {hosts} hosts up in {time.monotonic() - t0:.0f} s")
        done = {name: run_scenario(fleet, name, placements, seeds, rounds) for name in scenarios}
    finally:
        fleet.close()
    # Within the bound, every origin says Hello to every peer and ranks by room alone. An agent counts every
    # peer it knows (the other origins too); the simulation's origins know the hosts only.
    return {"origins": origins, "hosts": hosts, "placements": placements,
            "small_fleet": hosts + origins - 1 <= TRACKED_PEERS, "small_fleet_sim": hosts <= TRACKED_PEERS,
            "scenarios": done}


def _source() -> str:
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    return os.environ.get("WEFT_SOURCE", "")


def measure(origins: int, sizes: list[int], placements: int, seeds: int, rounds: int,
            scenarios: tuple[str, ...] = SCENARIOS) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="weft-bench-sim-validation-"))
    started = time.monotonic()
    try:
        fleets = [measure_fleet(origins, h, placements, seeds, rounds, workdir / f"hosts-{h}", scenarios)
                  for h in sizes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    agree = all(row.get("agree", True) for f in fleets for s in f["scenarios"].values()
                for row in s["figures"].values())
    return {"benchmark": "sim-validation", "agree": agree, "tolerance": TOLERANCE, "fleets": fleets,
            "environment": {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                            "source": _source(), "cpu_count": os.cpu_count(), "kernel": platform.release(),
                            "python": sys.version.split()[0], "hello_interval_s": HELLO_S,
                            "host": f"{HOST_CPU:g} CPUs, {HOST_MEMORY // GIB} GiB (fixed_capacity)",
                            "stage": f"{STAGE.cpu_cores:g} CPU, {STAGE.memory_bytes >> 20} MiB",
                            "seeds": seeds, "rounds": rounds, "run_s": round(time.monotonic() - started, 1),
                            "sim_delays": str(sim.Delays()), "sim_create_s": sim.Scenario("x").create_s}}


def _cell(value: object) -> str:
    return f"{value:g}" if isinstance(value, float | int) else str(value)


def _table(f: dict) -> str:
    env = f["environment"]
    lines = [f"weft simulate mesh against the real agents: {env['rounds']} real bursts of each scenario, "
             f"{env['seeds']} seeds each; hosts of {env['host']}, stages of {env['stage']}",
             f"tolerance (beyond the simulation's range): {f['tolerance']}"]
    for fleet in f["fleets"]:
        kind = "small fleet: ranked by room" if fleet["small_fleet"] else "large fleet: two choices, probes, refresh"
        for name, s in fleet["scenarios"].items():
            warm = sorted(r["warmup_s"] for r in s["rounds"])
            lines += ["", f"{fleet['origins']} origins, {fleet['hosts']} hosts ({kind}), {name}: "
                      f"{fleet['placements']} placements, rooms {s['rooms']}, warm-up {warm[0]:g}-{warm[-1]:g} s"]
            rows = [("figure", "real, each burst", "sim mean", "sim min-max", "real - sim", "sims as far", "agrees")]
            for key, title in FIGURES:
                r = s["figures"][key]
                agree = {True: "yes", False: "NO"}.get(r.get("agree"), "(shown)")
                rows.append((title, " / ".join(_cell(v) for v in r["real"]), _cell(r["sim_mean"]),
                             f"{_cell(r['sim_min'])}-{_cell(r['sim_max'])}",
                             _cell(round(r["real_mean"] - r["sim_mean"], 3)), f"{r['sims_as_far']:.0%}", agree))
            lines += right_aligned(rows)
            for i, rnd in enumerate(s["rounds"], 1):
                real = rnd["real"]
                lines.append(f"burst {i}, stages by host: " + (", ".join(
                    f"{h} {n}" for h, n in real["by_host"].items()) or "none") + (
                    f"; local because {', '.join(real['local_reasons'])}" if real["local_reasons"] else ""))
    lines += ["", "all judged figures agree" if f["agree"] else "some figures DISAGREE (NO above)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_validation", description=__doc__.splitlines()[0])
    ap.add_argument("--origins", type=int, default=2, help="GPU nodes (default 2)")
    ap.add_argument("--hosts", default="4,17", help="CPU hosts, or sizes to run in turn: N or N,N (default 4,17: "
                    "one fleet within the agents' tracking bound of 16 peers and one past it)")
    ap.add_argument("--placements", type=int, default=12, help="placements in each scenario (default 12)")
    ap.add_argument("--rounds", type=int, default=3, help="real bursts of each scenario (default 3)")
    ap.add_argument("--seeds", type=int, default=20, help="simulated runs of each real burst (default 20)")
    ap.add_argument("--scenario", action="append", choices=SCENARIOS,
                    help="run only this scenario (repeatable; default all)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    try:
        sizes = parse_counts("--hosts", args.hosts, (4, 17))
    except WeftError as exc:
        ap.error(exc.message)
    if min(args.origins, args.placements, args.seeds, args.rounds) < 1:
        ap.error("--origins, --placements, --rounds and --seeds: at least 1")
    if max(sizes) + args.origins > 250:
        ap.error("a local fabric holds at most 250 nodes")
    chosen = tuple(n for n in SCENARIOS if n in (args.scenario or SCENARIOS))
    code, figures = guarded(_say, lambda: measure(args.origins, sizes, args.placements, args.seeds, args.rounds,
                                                  chosen))
    if figures is None:
        return code
    report(figures, args.json, args.output, _table)
    return 0 if figures["agree"] else 3


if __name__ == "__main__":
    sys.exit(main())
