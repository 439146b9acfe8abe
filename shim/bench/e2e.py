"""``weft bench e2e``: end-to-end figures, each a ratio of two sides measured in one run.

Everything runs on one local three-node fabric (:func:`shim.bench.mesh.open_fabric`:
``gpu-1`` origin with a GPU broker on simulated devices, ``cpu-1`` and
``cpu-2`` hosts, the default fence and loss timeouts), every call through the
origin's socket as kubelet makes it, and the two sides of each figure take
turns within the same loop, so drift in the machine's load hits both alike:

1. pod start, opted in (``runtime_handler="weft"``) against plain: the same
   pod (a CPU container with limits and a GPU container asking for 1 GiB of a
   device), RunPodSandbox + Create + Start of both until ContainerStatus says
   RUNNING. Opted in, the CPU container reroutes to a host and the GPU one is
   leased from the broker and bound by the OCI hook; plain, both run here. A
   third side opts in with the prepared shadow sandbox switched off by the
   pod's annotation, so its gain shows in the same run;
2. remote against local container start (:mod:`shim.bench.mesh`'s figure 1),
   and a pod's first container right after its RunPodSandbox, in fresh pods:
   rerouted (shadow sandbox prepared, or not) against pinned local;
3. CRI call overhead: Version, ListContainers and ContainerStatus through the
   origin's agent against its containerd directly, interleaved call by call,
   while the node has remote containers (so the verbs weft answers when it
   must are in play; ``weft bench proxy`` covers the pure pass-through);
4. agent (all three) and broker CPU and RSS over an idle window and over a
   churn of opted-in pods (started, stopped and removed through the origin,
   up to ``--pods`` alive at once, a few workers at a time);
5. stitched localhost throughput and latency against direct TCP to the pod
   IP: ``shim.bench.network`` where it exists, on a fabric of its own
   right after this one closes (skipped with ``--quick``).

Results go to ``--output DIR`` (default ``bench/results/``) as ``e2e.json``
and ``e2e.md``, with the machine's facts. A measurement, not a test: the exit
code says only whether the run worked (:mod:`shim.bench.running`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim import __version__
from shim.bench import mesh
from shim.bench.running import guarded, summary
from shim.core.prepare import PREPARE_ANNOTATION
from shim.errors import WeftError
from shim.localfabric import pods as podspec
from shim.localfabric.fabric import Fabric3

RESULTS = Path("bench") / "results"  # relative to where it runs: the checkout's bench/results/
RUNTIME = "/runtime.v1.RuntimeService/"
MB = 1024 * 1024
CHURN_WORKERS = 4
# Targets: an opted-in pod starts within 1.2x of the same pod plain (p50 and p95), and a rerouted container's
# first start in a fresh pod within 1.3x of a local one.
POD_START_RATIO = 1.2
FIRST_START_RATIO = 1.3
GPU_SHARE = "1Gi"


def _say(msg: str) -> None:
    print(f"weft bench e2e: {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    starts: int  # pod starts and container starts per side
    samples: int  # CRI calls per method and side
    idle_s: float
    churn_pods: int
    churn_s: float
    quick: bool
    cpusets: bool = False  # the origin and the hosts on CPUs of their own, as on separate machines

    @classmethod
    def of(cls, *, quick: bool, starts: int, samples: int, pods: int, churn_seconds: float,
           cpusets: bool = False) -> Plan:
        if quick:
            return cls(starts=3, samples=50, idle_s=2.0, churn_pods=5, churn_s=4.0, quick=True, cpusets=cpusets)
        return cls(starts=starts, samples=samples, idle_s=10.0, churn_pods=pods, churn_s=churn_seconds, quick=False,
                   cpusets=cpusets)


# -- 1. pod start ------------------------------------------------------------------
def _pod_containers(runtime_default: bool = False) -> list[cri.ContainerConfig]:
    """The two-stage pod's containers; ``runtime_default``: each asks for the runtime's default seccomp profile,
    as a pod under Pod Security "restricted" or a kubelet with seccompDefault does (a host always runs a
    rerouted container under it)."""
    gpu = podspec.container_config("model", mesh.SLEEPER, envs={"NVIDIA_VISIBLE_DEVICES": "all"})
    configs = [mesh.cpu_container("prep", cpu=0.1, memory=32 << 20), gpu]
    if runtime_default:
        for config in configs:
            config.linux.security_context.seccomp.profile_type = cri.SecurityProfile.RuntimeDefault
    return configs


@dataclass(frozen=True)
class Started:
    sandbox_id: str
    container_ids: list[str]
    placements: list[str]


def start_pod(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, name: str, handler: str,
              annotations: dict[str, str] | None = None, runtime_default: bool = False,
              steps: dict[str, float] | None = None) -> Started:
    """RunPodSandbox, then create and start both containers, until both run; ``steps`` gets each call's
    seconds ("RunPodSandbox", "Create <name>", "Start <name>")."""
    steps = {} if steps is None else steps
    t = time.perf_counter()
    pod = mesh.run_pod(fabric, rt, name, handler=handler,
                       annotations={"weft.io/gpu-memory.model": GPU_SHARE, **(annotations or {})})
    steps["RunPodSandbox"] = time.perf_counter() - t
    ids = []
    for config in _pod_containers(runtime_default):
        n = config.metadata.name
        t = time.perf_counter()
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=config,
                                                            sandbox_config=pod.config),
                                 timeout=mesh.RPC_TIMEOUT).container_id
        steps[f"Create {n}"] = time.perf_counter() - t
        t = time.perf_counter()
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=mesh.RPC_TIMEOUT)
        steps[f"Start {n}"] = time.perf_counter() - t
        ids.append(cid)
    return Started(pod.id, ids, [mesh.wait_running(rt, cid).annotations.get(mesh.PLACEMENT, "") for cid in ids])


def stop_pod(rt: cri_grpc.RuntimeServiceStub, pod: Started) -> None:
    """As kubelet removes a pod: StopContainer each container (with a grace period), then the sandbox.

    Not StopPodSandbox alone: through the origin it leaves the pod's remote
    containers running (reported as a weft bug), and RemovePodSandbox then
    waits out each shadow's 10 s grace period on its host.
    """
    for cid in pod.container_ids:
        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=10), timeout=mesh.RPC_TIMEOUT)
    mesh.remove_pod(rt, pod.sandbox_id)


# The pod start's sides: opted in (with its shadow sandbox prepared as RunPodSandbox arrives), opted in with
# that switched off by the pod's annotation (how it started before), and plain; then opted in and plain again
# with every container under the runtime's default seccomp profile, which a host applies to a rerouted container
# whatever it asked (runc compiling the filter is most of what a rerouted start adds to an unconfined one).
POD_SIDES = {"opted_in": ("weft", {}, False), "opted_in_unprepared": ("weft", {PREPARE_ANNOTATION: "false"}, False),
             "plain": ("", {}, False), "opted_in_runtime_default": ("weft", {}, True),
             "plain_runtime_default": ("", {}, True)}


def pod_starts(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, n: int, warmup: int = 1) -> dict:
    out: dict[str, list[int]] = {side: [] for side in POD_SIDES}
    placements: list[list[str]] = []
    order = list(POD_SIDES)
    for i in range(warmup + n):
        k = i % len(order)
        for side in order[k:] + order[:k]:
            handler, annotations, runtime_default = POD_SIDES[side]
            t0 = time.perf_counter_ns()
            started = start_pod(fabric, rt, f"start-{side.replace('_', '-')}-{i}", handler, annotations,
                                runtime_default)
            dt = time.perf_counter_ns() - t0
            stop_pod(rt, started)  # untimed; every start then sees the same pods running
            if i >= warmup:
                out[side].append(dt)
                if side == "opted_in":
                    placements.append(started.placements)
    opted, plain = mesh.p50_p95(out["opted_in"]), mesh.p50_p95(out["plain"])
    unprepared = mesh.p50_p95(out["opted_in_unprepared"])
    opted_rd, plain_rd = mesh.p50_p95(out["opted_in_runtime_default"]), mesh.p50_p95(out["plain_runtime_default"])
    return {"opted_in": opted, "plain": plain, "ratio_p50": round(opted["p50_ms"] / plain["p50_ms"], 3),
            "opted_in_placements": sorted({" + ".join(p) for p in placements}),
            "ratio_p95": round(opted["p95_ms"] / plain["p95_ms"], 3), "opted_in_unprepared": unprepared,
            "unprepared_ratio_p50": round(unprepared["p50_ms"] / plain["p50_ms"], 3),
            "unprepared_ratio_p95": round(unprepared["p95_ms"] / plain["p95_ms"], 3),
            "opted_in_runtime_default": opted_rd, "plain_runtime_default": plain_rd,
            "runtime_default_ratio_p50": round(opted_rd["p50_ms"] / plain_rd["p50_ms"], 3),
            "runtime_default_ratio_p95": round(opted_rd["p95_ms"] / plain_rd["p95_ms"], 3)}


def first_starts(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, n: int, warmup: int = 1) -> dict:
    """A pod's first container, Create + Start until RUNNING right after its RunPodSandbox: rerouted against
    pinned local, in fresh opted-in pods taking turns (the rerouted one's shadow sandbox is prepared as the
    pod's RunPodSandbox arrives, and made by its RunShadow when the pod opts out of that)."""
    sides = {"remote": {}, "remote_unprepared": {PREPARE_ANNOTATION: "false"},
             "local": {f"weft.io/stage.{mesh.CONTAINER}": "local"}}
    out: dict[str, list[int]] = {side: [] for side in sides}
    order = list(sides)
    for i in range(warmup + n):
        k = i % len(order)
        for side in order[k:] + order[:k]:
            pod = mesh.run_pod(fabric, rt, f"first-{side.replace('_', '-')}-{i}", annotations=sides[side])
            try:
                cid, dt, status = mesh.start_container(rt, pod, mesh.cpu_container(mesh.CONTAINER))
                placed = status.annotations.get(mesh.PLACEMENT, "")
                if placed.startswith(mesh.REMOTE) != (side != "local"):
                    raise RuntimeError(f"first start, side {side}: placed {placed!r} "
                                       f"({status.annotations.get('weft.io/placement-reason')})")
                rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=10), timeout=mesh.RPC_TIMEOUT)
            finally:
                mesh.remove_pod(rt, pod.id)
            if i >= warmup:
                out[side].append(dt)
    remote, unprepared, local = (mesh.p50_p95(out[side]) for side in sides)
    return {"remote": remote, "remote_unprepared": unprepared, "local": local,
            "ratio_p50": round(remote["p50_ms"] / local["p50_ms"], 3),
            "ratio_p95": round(remote["p95_ms"] / local["p95_ms"], 3),
            "unprepared_ratio_p50": round(unprepared["p50_ms"] / local["p50_ms"], 3)}


# -- 3. CRI call overhead ------------------------------------------------------------
def cri_overhead(agent: grpc.Channel, direct: grpc.Channel, container_id: str, samples: int) -> dict:
    requests = {"Version": cri.VersionRequest(), "ListContainers": cri.ListContainersRequest(),
                "ContainerStatus": cri.ContainerStatusRequest(container_id=container_id)}
    out = {}
    for method, request in requests.items():
        raw = request.SerializeToString()

        def call(ch: grpc.Channel, path: str = RUNTIME + method, raw: bytes = raw) -> Callable[[], object]:
            fn = ch.unary_unary(path)
            return lambda: fn(raw, timeout=mesh.RPC_TIMEOUT)

        ns = mesh.interleaved({"agent": call(agent), "direct": call(direct)}, samples,
                              min(200, max(10, samples // 10)))
        a, d = summary(ns["agent"]), summary(ns["direct"])
        out[method] = {"agent": a, "direct": d, "added_p50_ms": round(a["p50_ms"] - d["p50_ms"], 4),
                       "added_p99_ms": round(a["p99_ms"] - d["p99_ms"], 4),
                       "ratio_p50": round(a["p50_ms"] / d["p50_ms"], 3)}
    return out


# -- 4. CPU and RSS -----------------------------------------------------------------
def processes(fabric: Fabric3) -> dict[str, psutil.Process]:
    """The weft daemons by role: each agent's Python process (under ``nsenter --net``) and the broker."""
    out = {}
    for name, agent in fabric.agents.items():
        proc = psutil.Process(agent.pid)
        if "shim" not in proc.cmdline():  # a wrapper that forked instead of exec'ing
            proc = next(p for p in proc.children(recursive=True) if "shim" in p.cmdline())
        out[f"agent {name}"] = proc
    assert fabric.broker is not None and fabric.broker.proc is not None
    out["broker"] = psutil.Process(fabric.broker.proc.pid)
    return out


class Usage:
    """CPU (% of one core) and RSS of each process over a window, RSS sampled every half second."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self.procs = procs
        self._stop = threading.Event()
        self._rss: dict[str, list[int]] = {n: [] for n in procs}
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _cpu(self) -> dict[str, float]:
        return {n: (t := p.cpu_times()).user + t.system for n, p in self.procs.items()}

    def _sample(self) -> None:
        while True:
            for n, p in self.procs.items():
                with contextlib.suppress(psutil.Error):
                    self._rss[n].append(p.memory_info().rss)
            if self._stop.wait(0.5):
                return

    def __enter__(self) -> Usage:
        self._cpu0, self._t0 = self._cpu(), time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.monotonic() - self._t0
        cpu = self._cpu()
        self.figures = {n: {"cpu_percent": round(100.0 * (cpu[n] - self._cpu0[n]) / self.wall, 2),
                            "rss_mb": round(self._rss[n][-1] / MB, 1),
                            "rss_max_mb": round(max(self._rss[n]) / MB, 1)} for n in self.procs}


def churn(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, pods: int, seconds: float) -> dict:
    """Opted-in pods started, stopped and removed through the origin for ``seconds``, at most ``pods`` alive.

    Workers start pods until ``pods`` are alive, then each removes the oldest
    before starting another. What is alive at the end is removed afterwards,
    outside the window.
    """
    live: deque[Started] = deque()
    lock = threading.Lock()
    counts = {"started": 0, "removed": 0, "errors": 0, "max_alive": 0}
    starting = [0]
    errors: list[str] = []
    end = time.monotonic() + seconds

    def worker(w: int) -> None:
        i = 0
        while time.monotonic() < end:
            with lock:  # starts in flight count as alive, so no more than ``pods`` ever are
                full = len(live) + starting[0] >= pods
                victim = live.popleft() if full and live else None
                if full and victim is None:
                    wait = True
                else:
                    wait = False
                    starting[0] += 1
            if wait:
                time.sleep(0.05)
                continue
            step = "start"
            try:
                if victim is not None:
                    step = "remove"
                    stop_pod(rt, victim)
                    with lock:
                        counts["removed"] += 1
                step = "start"
                started = start_pod(fabric, rt, f"churn-{w}-{i}", "weft")
                with lock:
                    live.append(started)
                    counts["started"] += 1
                    counts["max_alive"] = max(counts["max_alive"], len(live))
            except (grpc.RpcError, RuntimeError) as exc:  # counted and shown; the churn goes on
                what = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError)  # type: ignore[attr-defined]
                        else str(exc))
                with lock:
                    counts["errors"] += 1
                    errors.append(f"{step}: {what}")
            finally:
                with lock:
                    starting[0] -= 1
            i += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(CHURN_WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**counts, "alive_at_end": list(live), "first_errors": errors[:3]}


# -- 5. stitched network ---------------------------------------------------------------
def network_figures(plan: Plan, workdir: Path) -> dict:
    """``shim.bench.network`` (its own fabric, after this one closed)."""
    if plan.quick or plan.cpusets:
        return {"available": False, "note": f"skipped with --{'quick' if plan.quick else 'cpusets'} (a fabric of its "
                "own: weft bench network)"}
    out = workdir / "network.json"
    gib, samples = 0.5, 3000
    _say(f"network: shim.bench.network, {gib:g} GiB per throughput round, {samples} round trips per path")
    try:
        from shim.bench import network

        with contextlib.redirect_stdout(sys.stderr):  # stdout is for this benchmark's figures
            code = network.main(as_json=True, gib=gib, samples=samples, output=out)
        n = json.loads(out.read_text())
        tput, rr = n["throughput_gbytes_s"], n["rr_ms"]
        rows = [("stitched localhost throughput vs direct TCP (pod IP)", f"{tput['stitched']:.3f} GB/s",
                 f"{tput['direct']:.3f} GB/s", f"{n['throughput_ratio']:.2f}x",
                 f">= {n['targets']['throughput_ratio']:g}x"),
                ("stitched localhost request/response p50 / p99 vs direct",
                 f"{rr['stitched']['p50']:.3f} / {rr['stitched']['p99']:.3f} ms",
                 f"{rr['direct']['p50']:.3f} / {rr['direct']['p99']:.3f} ms",
                 f"+{n['added_p50_ms']:.3f} ms p50", f"added p50 <= {n['targets']['added_p50_ms']:g} ms")]
    except Exception as exc:  # noqa: BLE001 - the network bench failing must not fail the rest: say, do not fail
        return {"available": False, "note": f"shim.bench.network failed: {type(exc).__name__}: {exc}"[:300]}
    return {"available": code == 0, "rows": rows, "figures": n, "gib": gib, "samples": samples,
            "note": "measured by shim.bench.network on a fabric of its own, right after this one"}


# -- the run ---------------------------------------------------------------------------
def _measure(plan: Plan, workdir: Path) -> dict:
    fabric = mesh.open_fabric(workdir / "fabric", cpusets=plan.cpusets)
    affinity = os.sched_getaffinity(0)
    if plan.cpusets:  # this process plays the origin's kubelet: on the origin's CPUs
        os.sched_setaffinity(0, {int(c) for c in fabric.agents[mesh.ORIGIN].cpus.split(",")})
    try:
        _say(f"fabric up (fence {fabric.fence_s:g} s, loss {fabric.loss_s:g} s)")
        ch, rt = mesh.origin(fabric)
        direct = grpc.insecure_channel(f"unix://{fabric.node(mesh.ORIGIN).containerd.socket}",
                                       options=[("grpc.http2.bdp_probe", 0)])
        with ch, direct:
            version = rt.Version(cri.VersionRequest(), timeout=mesh.RPC_TIMEOUT)
            procs = processes(fabric)
            _say(f"pod start: {plan.starts} opted-in and {plan.starts} plain pods, interleaved")
            pod_start = pod_starts(fabric, rt, plan.starts)
            _say(f"container start: {plan.starts} each remote, remote with a new shadow sandbox, local")
            pair = mesh.start_pods(fabric, rt)
            container_start = mesh.start_figure(mesh.remote_vs_local_start(rt, pair, plan.starts))
            _say(f"first container start: {plan.starts} each in fresh pods, remote (prepared or not) and local")
            container_start["first"] = first_starts(fabric, rt, plan.starts)
            # A plain pod's container for ContainerStatus; the keepers stay: the node has remote containers.
            plain = mesh.run_pod(fabric, rt, "bench-plain", handler="")
            cid, _, _ = mesh.start_container(rt, plain, podspec.container_config("sleeper", ["sleep", "3600"]))
            _say(f"CRI calls: {plan.samples} per method, through the agent and direct, interleaved")
            calls = cri_overhead(ch, direct, cid, plan.samples)
            _say(f"idle: {plan.idle_s:g} s without calls")
            with Usage(procs) as idle:
                time.sleep(plan.idle_s)
            _say(f"churn: opted-in pods, up to {plan.churn_pods} alive, {CHURN_WORKERS} workers, {plan.churn_s:g} s")
            with Usage(procs) as busy:
                churned = churn(fabric, rt, plan.churn_pods, plan.churn_s)
            for started in churned.pop("alive_at_end"):
                with contextlib.suppress(grpc.RpcError):
                    stop_pod(rt, started)
        resources = {n: {"idle": idle.figures[n], "churn": busy.figures[n]} for n in procs}
        return {"pod_start": pod_start, "container_start": container_start, "cri_calls": calls,
                "resources": resources, "idle_s": round(idle.wall, 2), "churn": {**churned,
                                                                                  "seconds": round(busy.wall, 2)},
                "containerd": version.runtime_version,
                "fabric": mesh.fabric_facts(fabric)}
    finally:
        os.sched_setaffinity(0, affinity)
        fabric.close()


def _figures(raw: dict, plan: Plan, argv: str, load_before: tuple[float, float, float]) -> dict:
    machine = {"cpu_count": os.cpu_count(), "kernel": platform.release(), "containerd_version": raw["containerd"],
               "python": sys.version.split()[0], "weft": __version__, "grpcio": grpc.__version__,
               "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               "load_average_before": [round(x, 2) for x in load_before]}
    return {"pod_start": raw["pod_start"], "container_start": raw["container_start"], "cri_calls": raw["cri_calls"],
            "resources": raw["resources"], "idle_seconds": raw["idle_s"], "churn": raw["churn"],
            "network": raw["network"], "targets": {"remote_start_ratio": mesh.LIMITS["remote_start_ratio"],
                                                   "pod_start_ratio": POD_START_RATIO,
                                                   "first_start_ratio": FIRST_START_RATIO},
            "plan": {"starts": plan.starts, "samples": plan.samples, "idle_s": plan.idle_s,
                     "churn_pods": plan.churn_pods, "churn_s": plan.churn_s, "quick": plan.quick,
                     "cpusets": plan.cpusets},
            "command": argv, "machine": machine, "fabric": raw["fabric"]}


# -- output ------------------------------------------------------------------------------
def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _new_start_rows(f: dict) -> list[tuple[str, ...]]:
    """The rows of the prepared shadow sandbox: the pod start's p50 and p95 ratios, and the first container."""
    ps, first = f["pod_start"], f["container_start"].get("first")
    rows: list[tuple[str, ...]] = []
    if "ratio_p95" in ps:
        limit = f["targets"].get("pod_start_ratio", POD_START_RATIO)
        rows += [("pod start p50 / p95 ratio, opted in vs plain", "", "",
                  f"{ps['ratio_p50']:.2f}x / {ps['ratio_p95']:.2f}x",
                  f"≤ {limit:g}x ({_met(max(ps['ratio_p50'], ps['ratio_p95']) <= limit)})"),
                 ("pod start p50 / p95, opted in without a prepared shadow sandbox vs plain",
                  f"{ps['opted_in_unprepared']['p50_ms']:.1f} / {ps['opted_in_unprepared']['p95_ms']:.1f} ms",
                  f"{ps['plain']['p50_ms']:.1f} / {ps['plain']['p95_ms']:.1f} ms",
                  f"{ps['unprepared_ratio_p50']:.2f}x / {ps['unprepared_ratio_p95']:.2f}x", "before")]
    if "runtime_default_ratio_p50" in ps:
        o, p = ps["opted_in_runtime_default"], ps["plain_runtime_default"]
        rows += [("pod start p50 / p95, both under the runtime's default seccomp profile, opted in vs plain",
                  f"{o['p50_ms']:.1f} / {o['p95_ms']:.1f} ms", f"{p['p50_ms']:.1f} / {p['p95_ms']:.1f} ms",
                  f"{ps['runtime_default_ratio_p50']:.2f}x / {ps['runtime_default_ratio_p95']:.2f}x",
                  "like for like")]
    if first:
        limit = f["targets"].get("first_start_ratio", FIRST_START_RATIO)
        rows += [("first container start p50 / p95 in a fresh pod, remote vs local",
                  f"{first['remote']['p50_ms']:.1f} / {first['remote']['p95_ms']:.1f} ms",
                  f"{first['local']['p50_ms']:.1f} / {first['local']['p95_ms']:.1f} ms",
                  f"{first['ratio_p50']:.2f}x / {first['ratio_p95']:.2f}x",
                  f"≤ {limit:g}x ({_met(first['ratio_p50'] <= limit)})"),
                 ("first container start p50 in a fresh pod, remote without a prepared sandbox vs local",
                  f"{first['remote_unprepared']['p50_ms']:.1f} ms", f"{first['local']['p50_ms']:.1f} ms",
                  f"{first['unprepared_ratio_p50']:.2f}x", "before")]
    return rows


def markdown(f: dict) -> str:
    m, ps, cs, ch = f["machine"], f["pod_start"], f["container_start"], f["churn"]
    limit = f["targets"]["remote_start_ratio"]
    met = "met" if cs["ratio_p50"] <= limit else "missed"
    rows = [("pod start p50, opted in vs plain (CPU + GPU container)", f"{ps['opted_in']['p50_ms']:.1f} ms",
             f"{ps['plain']['p50_ms']:.1f} ms", f"{ps['ratio_p50']:.2f}x", "—"),
            ("pod start p95, opted in vs plain", f"{ps['opted_in']['p95_ms']:.1f} ms",
             f"{ps['plain']['p95_ms']:.1f} ms", "", ""),
            ("container start p50, remote vs local", f"{cs['remote']['p50_ms']:.1f} ms",
             f"{cs['local']['p50_ms']:.1f} ms", f"{cs['ratio_p50']:.2f}x", f"≤ {limit:g}x ({met})"),
            ("container start p50, remote with a new shadow sandbox vs local", f"{cs['remote_cold']['p50_ms']:.1f} ms",
             f"{cs['local']['p50_ms']:.1f} ms", f"{cs['cold_ratio_p50']:.2f}x", "—")]
    rows += _new_start_rows(f)
    for method, c in f["cri_calls"].items():
        rows.append((f"{method} p50 / p99, agent vs containerd",
                     f"{c['agent']['p50_ms']:.3f} / {c['agent']['p99_ms']:.3f} ms",
                     f"{c['direct']['p50_ms']:.3f} / {c['direct']['p99_ms']:.3f} ms",
                     f"{c['ratio_p50']:.2f}x (+{c['added_p50_ms']:.3f} ms)", "—"))
    net = f["network"]
    if net.get("available"):
        rows += [tuple(row) for row in net["rows"]]
    else:
        rows.append(("stitched localhost throughput and latency vs direct TCP", "—", "—", "—", net["note"]))
    lines = ["# weft bench e2e", "",
             f"Measured {m['date']} on {m['cpu_count']} CPU cores, Linux {m['kernel']}, containerd "
             f"{m['containerd_version']}, Python {m['python']}, weft {m['weft']} (load average before the run: "
             f"{' '.join(str(x) for x in m['load_average_before'])}). Command: `{f['command']}`.", "",
             "Every figure compares two sides measured in the same run, taking turns, on the local three-node "
             "fabric (`shim/localfabric/fabric.py`: `gpu-1` origin with a broker on simulated GPUs, `cpu-1` and "
             "`cpu-2` "
             f"hosts, fence {f['fabric']['fence_timeout_s']:g} s, loss {f['fabric']['loss_timeout_s']:g} s). "
             + _cpus_note(f) + f"Raw figures: [{_stem(f)}.json]({_stem(f)}.json); the mesh figures: "
             "[mesh.json](mesh.json).", "",
             "| figure | weft | baseline | ratio | target |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(r)} |" for r in rows]
    lines += ["", f"Daemons' CPU (% of one core) and RSS: idle for {f['idle_seconds']:g} s (remote containers "
              f"running, no calls), and during {ch['seconds']:g} s of churn ({ch['started']} opted-in pods started "
              f"and {ch['removed']} removed through the origin, up to {ch['max_alive']} alive, {ch['errors']} "
              "errors).", "", "| process | idle CPU | idle RSS | churn CPU | churn RSS max |",
              "| --- | --- | --- | --- | --- |"]
    for name, r in f["resources"].items():
        i, c = r["idle"], r["churn"]
        lines.append(f"| {name} | {i['cpu_percent']:.2f} % | {i['rss_mb']:.1f} MB | {c['cpu_percent']:.1f} % | "
                     f"{c['rss_max_mb']:.1f} MB |")
    lines += ["", "Notes: local containers of opted-in pods run under the `weft` runtime handler (its OCI hook "
              "included); CRI calls are timed while the origin has remote containers, so ListContainers merges "
              "them and ContainerStatus looks the ID up before passing through (`weft bench proxy` times the "
              "pure pass-through). The fabric's Hello interval is "
              f"{f['fabric']['hello_interval_s']:g} s (default {f['fabric']['default_hello_interval_s']:g} s)."
              + (f" Stitched network rows: {net['note']} ({net['gib']:g} GiB per throughput round, "
                 f"{net['samples']} round trips per path)." if net.get("available") else ""), ""]
    return "\n".join(lines)


def _stem(f: dict) -> str:
    """The results' file name: e2e, or e2e-cpusets for a run with the nodes on CPUs of their own."""
    return "e2e-cpusets" if f["plan"].get("cpusets") else "e2e"


def _cpus_note(f: dict) -> str:
    cpus = f["fabric"].get("cpus", {})
    if not any(c != "all" for c in cpus.values()):
        return "Every node's processes share every CPU. "
    return ("Each node confined to CPUs of its own, as on separate machines (its containerd, shims, pods and "
            "agent; the broker and this benchmark, as kubelet, on the origin's): "
            + ", ".join(f"`{n}` on CPU {c}" for n, c in cpus.items()) + ". ")


def main(*, as_json: bool, quick: bool, starts: int, samples: int, pods: int, churn_seconds: float,
         output: Path | None, cpusets: bool = False) -> int:
    if starts < 1 or samples < 10 or pods < 1 or churn_seconds <= 0:
        raise WeftError("need --starts >= 1, --samples >= 10, --pods >= 1 and --churn-seconds > 0")
    plan = Plan.of(quick=quick, starts=starts, samples=samples, pods=pods, churn_seconds=churn_seconds,
                   cpusets=cpusets)
    argv = "weft bench e2e" + (" --quick" if quick else f" --starts {starts} --samples {samples} --pods {pods} "
                                                         f"--churn-seconds {churn_seconds:g}") + (
        " --cpusets" if cpusets else "")
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="weft-bench-e2e-"))
    try:
        code, figures = guarded(_say, lambda: _figures({**_measure(plan, workdir),
                                                         "network": network_figures(plan, workdir)},
                                                        plan, argv, load_before))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if figures is None:
        return code
    out = output if output is not None else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(figures, indent=2)
    stem = _stem(figures)
    (out / f"{stem}.json").write_text(text + "\n")
    table = markdown(figures)
    (out / f"{stem}.md").write_text(table)
    _say(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    print(text if as_json else table, flush=True)
    return 0
