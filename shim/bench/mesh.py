"""``weft bench mesh``: rerouted containers against local ones, on the local three-node fabric.

One :class:`shim.localfabric.fabric.Fabric3` (``gpu-1`` origin, ``cpu-1`` and
``cpu-2`` hosts) with the fence and loss timeouts a user gets
(``shim.config.MeshConfig``'s defaults), every call through the origin's CRI
socket as kubelet makes it. Three figures:

1. remote container start against local: CreateContainer + StartContainer,
   then ContainerStatus until it says RUNNING, of the same CPU-stage container
   (limits declared, the image already on every node) in three opted-in pods:
   one lets it reroute to a host that already runs the pod's shadow sandbox
   (another container of the pod keeps it there, as when kubelet restarts a
   container), one lets it reroute as the pod's only container there (the host
   runs RunPodSandbox first: reported, not the target's figure), and one pins
   it here with the pod annotation ``weft.io/stage.<name>: local`` (so it runs
   under the ``weft`` runtime handler, OCI hook included, as it would if weft
   kept it). Samples take turns, rotated, so drift in load hits all alike;
   each container is stopped and removed, untimed, before the next;
2. ContainerStatus of a running remote container against a running local
   one, interleaved call by call;
3. a host dying under a remote container (its agent and containerd killed):
   seconds until the origin reports the container exited (``WeftPeerLost``),
   then until kubelet's restart (RemoveContainer, CreateContainer with the
   next attempt, StartContainer) is placed and running on the other host.
   kubelet's own relist period and back-off are not counted.

It is a measurement, not a test: a missed target is printed, and the exit
code says only whether the run worked (:mod:`shim.bench.running`).
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.bench.running import ms, run_in_scratch, summary, targets_met
from shim.config import MeshConfig
from shim.core.stats import percentile
from shim.errors import WeftError
from shim.localfabric import pods
from shim.localfabric.fabric import HELLO_S, Fabric3

LIMITS = {"remote_start_ratio": 1.5, "status_p50_ratio": 1.2, "replaced_s": 30.0}
ORIGIN = "gpu-1"
HOSTS = ("cpu-1", "cpu-2")
CONTAINER = "tokenize"
PLACEMENT = "weft.io/placement"
REMOTE = "remote:"
RPC_TIMEOUT = 30.0
RUNNING_TIMEOUT = 30.0


def _say(msg: str) -> None:
    # stdout is reserved for the figures (one JSON object with --json).
    print(f"weft bench mesh: {msg}", file=sys.stderr, flush=True)


# -- the fabric and its pods (shared with shim.bench.e2e) ---------------------------
def open_fabric(workdir: Path, *, cpusets: bool = False) -> Fabric3:
    """The three-node fabric with the fence and loss timeouts a user gets by default, open (with ``cpusets``, the
    origin and the hosts on CPUs of their own)."""
    defaults = MeshConfig()
    fabric = Fabric3(workdir, fence_s=defaults.fence_timeout, loss_s=defaults.loss_timeout, cpusets=cpusets)
    fabric.__enter__()
    return fabric


def origin(fabric: Fabric3, name: str = ORIGIN) -> tuple[grpc.Channel, cri_grpc.RuntimeServiceStub]:
    """kubelet's view of the origin, over a channel that sends no BDP pings.

    The relay forwards a client's PINGs to containerd; calls weft answers
    itself make grpcio ping after their DATA while containerd sent none, and
    containerd (grpc-go) closes the connection after three such pings
    (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"), failing the pass-through
    calls in flight on it with UNAVAILABLE. Reported as a weft bug; the
    benchmark turns the pings off so that it measures starts, not reconnects.
    """
    ch = grpc.insecure_channel(fabric.agents[name].address, options=[("grpc.http2.bdp_probe", 0)])
    return ch, cri_grpc.RuntimeServiceStub(ch)


def fabric_facts(fabric: Fabric3) -> dict:
    return {"fence_timeout_s": fabric.fence_s, "loss_timeout_s": fabric.loss_s, "hello_interval_s": HELLO_S,
            "default_hello_interval_s": MeshConfig().hello_interval,
            "cpus": {name: agent.cpus or "all" for name, agent in fabric.agents.items()}}


# Ends on SIGTERM as a well-behaved app does (a bare ``sleep`` as PID 1 ignores it and waits out the grace period).
SLEEPER = ["sh", "-c", 'trap "exit 0" TERM; while :; do sleep 3600 & wait; done']


def cpu_container(name: str, attempt: int = 0, *, cpu: float = 0.5, memory: int = 64 << 20) -> cri.ContainerConfig:
    """A CPU-stage container with limits declared, so an opted-in pod may reroute it."""
    config = pods.container_config(name, SLEEPER, attempt=attempt)
    res = config.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, int(cpu * 100000), memory
    return config


@dataclass(frozen=True)
class Pod:
    id: str
    config: cri.PodSandboxConfig


def run_pod(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, name: str, *, handler: str = "weft",
            annotations: dict[str, str] | None = None) -> Pod:
    node = fabric.node(ORIGIN)
    config = pods.sandbox_config(name, node.containerd.pod_log_dir, cgroup_parent=node.containerd.cgroup_root,
                                 annotations=annotations)
    sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler=handler),
                           timeout=RPC_TIMEOUT).pod_sandbox_id
    return Pod(sid, config)


def remove_pod(rt: cri_grpc.RuntimeServiceStub, sid: str) -> None:
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)


def wait_running(rt: cri_grpc.RuntimeServiceStub, cid: str, every: float = 0.0) -> cri.ContainerStatus:
    """ContainerStatus until RUNNING (as kubelet would see it), without sleeping unless ``every`` says so."""
    deadline = time.monotonic() + RUNNING_TIMEOUT
    while True:
        status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT).status
        if status.state == cri.CONTAINER_RUNNING:
            return status
        if status.state == cri.CONTAINER_EXITED or time.monotonic() > deadline:
            raise RuntimeError(f"container {cid[:13]} did not run: {cri.ContainerState.Name(status.state)} "
                               f"{status.reason} {status.message}")
        if every:
            time.sleep(every)


def start_container(rt: cri_grpc.RuntimeServiceStub, pod: Pod,
                    config: cri.ContainerConfig) -> tuple[str, int, cri.ContainerStatus]:
    """Create + Start + ContainerStatus until RUNNING: (container ID, nanoseconds, its status)."""
    t0 = time.perf_counter_ns()
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=config,
                                                        sandbox_config=pod.config), timeout=RPC_TIMEOUT).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    status = wait_running(rt, cid)
    return cid, time.perf_counter_ns() - t0, status


def remove_container(rt: cri_grpc.RuntimeServiceStub, cid: str) -> None:
    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0), timeout=RPC_TIMEOUT)
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)


def interleaved(calls: dict[str, Callable[[], object]], samples: int, warmup: int) -> dict[str, list[int]]:
    """Nanoseconds per call of each target, the targets called in turn (rotated, so none always goes first)."""
    out: dict[str, list[int]] = {name: [] for name in calls}
    order = list(calls.items())
    gc.disable()  # a collection pause would land on whichever path happened to run
    try:
        for i in range(warmup + samples):
            k = i % len(order)
            for name, call in order[k:] + order[:k]:
                t0 = time.perf_counter_ns()
                call()
                dt = time.perf_counter_ns() - t0
                if i >= warmup:
                    out[name].append(dt)
    finally:
        gc.enable()
    return out


def p50_p95(ns: list[int]) -> dict[str, float | int]:
    """Median and 95th percentile in ms (``summary``'s p99 and max too, for many samples)."""
    out: dict[str, float | int] = {"p50_ms": ms(percentile(ns, 50) or 0, 2), "n": len(ns)}
    if len(ns) >= 2:
        out["p95_ms"] = ms(percentile(ns, 95) or 0, 2)
        out.update({k: v for k, v in summary(ns, 2).items() if k in ("p99_ms", "max_ms")})
    else:
        out["p95_ms"] = out["max_ms"] = out["p99_ms"] = out["p50_ms"]
    return out


@dataclass
class StartPods:
    """Three opted-in pods for one container name: one keeps its shadow sandboxes, one does not, one pins it here."""

    warm: Pod  # keepers hold a shadow sandbox on each host, so a start there finds its sandbox
    cold: Pod  # its only container: the host makes and removes the shadow sandbox with every sample
    local: Pod  # weft.io/stage.<name>: local
    keepers: dict[str, str]  # host -> keeper container ID in ``warm``


def start_pods(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, name: str = CONTAINER) -> StartPods:
    warm = run_pod(fabric, rt, "bench-warm")
    pair = StartPods(warm, run_pod(fabric, rt, "bench-cold"),
                     run_pod(fabric, rt, "bench-local", annotations={f"weft.io/stage.{name}": "local"}), {})
    # A small keeper per host; each takes capacity from the host it lands on, so the next goes elsewhere.
    for attempt in range(4 * len(HOSTS)):
        cid, _, status = start_container(rt, warm, cpu_container("keeper", attempt, cpu=0.1, memory=16 << 20))
        host = status.annotations.get(PLACEMENT, "").removeprefix(REMOTE)
        if host in pair.keepers or host not in HOSTS:
            remove_container(rt, cid)
        else:
            pair.keepers[host] = cid
        if len(pair.keepers) == len(HOSTS):
            break
    return pair


SIDES = ("warm", "cold", "local")


def remote_vs_local_start(rt: cri_grpc.RuntimeServiceStub, pair: StartPods, n: int, warmup: int = 2,
                          first_attempt: int = 0) -> dict:
    """Container starts of each side in turn (rotated); the raw samples and where the remote ones ran."""
    out: dict[str, list[int]] = {side: [] for side in SIDES}
    hosts: dict[str, dict[str, int]] = {"warm": {}, "cold": {}}
    for i in range(warmup + n):
        k = i % len(SIDES)
        for side in SIDES[k:] + SIDES[:k]:
            cid, dt, status = start_container(rt, getattr(pair, side), cpu_container(CONTAINER, first_attempt + i))
            placed = status.annotations.get(PLACEMENT, "")
            try:
                if side != "local" and not placed.startswith(REMOTE):
                    raise RuntimeError(f"the container meant to reroute ran here ({placed}: "
                                       f"{status.annotations.get('weft.io/placement-reason')})")
                if side == "local" and placed != "local":
                    raise RuntimeError(f"the container pinned local was placed {placed!r}")
            finally:
                remove_container(rt, cid)
            if i >= warmup:
                out[side].append(dt)
                if side != "local":
                    host = placed.removeprefix(REMOTE)
                    hosts[side][host] = hosts[side].get(host, 0) + 1
    return {"ns": out, "hosts": hosts, "warmup": warmup, "keeper_hosts": sorted(pair.keepers)}


def start_figure(raw: dict) -> dict:
    """Remote (shadow sandbox present: the target's figure) and cold remote starts against local ones."""
    warm, cold, local = (p50_p95(raw["ns"][side]) for side in SIDES)
    return {"remote": warm, "remote_cold": cold, "local": local,
            "ratio_p50": round(warm["p50_ms"] / local["p50_ms"], 3),
            "ratio_p95": round(warm["p95_ms"] / local["p95_ms"], 3),
            "cold_ratio_p50": round(cold["p50_ms"] / local["p50_ms"], 3),
            "remote_hosts": raw["hosts"]["warm"], "remote_cold_hosts": raw["hosts"]["cold"],
            "keeper_hosts": raw["keeper_hosts"], "warmup": raw["warmup"]}


# -- phase 2: ContainerStatus ----------------------------------------------------
def status_latency(channel: grpc.Channel, remote_id: str, local_id: str, samples: int) -> dict[str, list[int]]:
    path = "/runtime.v1.RuntimeService/ContainerStatus"
    call = channel.unary_unary(path)  # raw bytes: client-side protobuf work is the same for both

    def of(cid: str) -> Callable[[], object]:
        request = cri.ContainerStatusRequest(container_id=cid).SerializeToString()
        return lambda: call(request, timeout=RPC_TIMEOUT)

    return interleaved({"remote": of(remote_id), "local": of(local_id)}, samples, min(200, max(10, samples // 10)))


# -- phase 3: a host dies -----------------------------------------------------------
def loss_replacement(fabric: Fabric3, rt: cri_grpc.RuntimeServiceStub, pod: Pod, attempt: int) -> dict:
    config = cpu_container(CONTAINER, attempt)
    cid, _, status = start_container(rt, pod, config)
    host = status.annotations[PLACEMENT].removeprefix(REMOTE)
    i = [n.name for n in fabric.cluster.nodes].index(host)
    _say(f"loss: killing {host} (its agent, then its containerd) under container {cid[:13]}")
    died = time.monotonic()
    fabric.agents[host].stop(9)
    fabric.cluster.kill_node(i)
    deadline = died + 120
    while True:
        status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT).status
        if status.state == cri.CONTAINER_EXITED:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the container on dead host {host} was not reported exited in 120 s")
        time.sleep(0.1)
    lost = time.monotonic()
    # What kubelet does next: remove the dead attempt, create the next, start it.
    rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    cid2 = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=pod.id, config=cpu_container(
        CONTAINER, attempt + 1), sandbox_config=pod.config), timeout=RPC_TIMEOUT).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid2), timeout=RPC_TIMEOUT)
    replaced = wait_running(rt, cid2, every=0.01)
    done = time.monotonic()
    return {"host_killed": host, "reason": status.reason, "exit_code": status.exit_code,
            "reported_lost_s": round(lost - died, 2), "replaced_s": round(done - died, 2),
            "replacement_placement": replaced.annotations.get(PLACEMENT, "")}


# -- the run -----------------------------------------------------------------------
def _measure(starts: int, samples: int, workdir: Path) -> dict:
    load_before = [round(x, 2) for x in os.getloadavg()]
    fabric = open_fabric(workdir / "fabric")
    try:
        _say(f"fabric up (fence {fabric.fence_s:g} s, loss {fabric.loss_s:g} s)")
        ch, rt = origin(fabric)
        with ch:
            version = rt.Version(cri.VersionRequest(), timeout=RPC_TIMEOUT)
            pair = start_pods(fabric, rt)
            _say(f"start: {starts} container starts each: remote, remote with a new shadow sandbox, local; "
                 "interleaved")
            start = remote_vs_local_start(rt, pair, starts)
            attempt = start["warmup"] + starts
            remote_id, _, _ = start_container(rt, pair.warm, cpu_container(CONTAINER, attempt))
            local_id, _, _ = start_container(rt, pair.local, cpu_container(CONTAINER, attempt))
            _say(f"status: {samples} ContainerStatus calls each, remote and local, interleaved")
            status = status_latency(ch, remote_id, local_id, samples)
            for cid in (remote_id, local_id):
                remove_container(rt, cid)
            # In the cold pod: a pod's replacement lands on a host that has no shadow sandbox for it yet.
            loss = loss_replacement(fabric, rt, pair.cold, attempt + 1)
        return {"start": start, "status": status, "loss": loss, "containerd": version.runtime_version,
                "fabric": fabric_facts(fabric), "load_before": load_before}
    finally:
        fabric.close()


def _figures(raw: dict, starts: int, samples: int) -> dict:
    start = start_figure(raw["start"])
    remote = summary(raw["status"]["remote"])
    local = summary(raw["status"]["local"])
    status = {"remote": remote, "local": local, "ratio_p50": round(remote["p50_ms"] / local["p50_ms"], 3)}
    loss = raw["loss"]
    targets = {"remote_start_ratio": start["ratio_p50"] <= LIMITS["remote_start_ratio"],
               "status_p50_ratio": status["ratio_p50"] <= LIMITS["status_p50_ratio"],
               "replaced_s": loss["replaced_s"] <= LIMITS["replaced_s"]
               and loss["replacement_placement"].startswith(REMOTE)}
    targets["all"] = all(targets.values())
    environment = {"starts": starts, "samples": samples, "cpu_count": os.cpu_count(), "kernel": platform.release(),
                   "containerd_version": raw["containerd"], "python": sys.version.split()[0],
                   "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   "load_average_before": raw["load_before"], **raw["fabric"]}
    return {"start": start, "status": status, "loss": loss, "targets": targets, "limits": LIMITS,
            "environment": environment}


def _table(f: dict) -> str:
    met = {True: "target met", False: "missed"}
    s, st, loss, t = f["start"], f["status"], f["loss"], f["targets"]
    rows = [("", "remote", "local", "ratio", "target", ""),
            (f"container start p50 (ms, n={s['remote']['n']})", f"{s['remote']['p50_ms']:.1f}",
             f"{s['local']['p50_ms']:.1f}", f"{s['ratio_p50']:.2f}x", f"≤ {LIMITS['remote_start_ratio']:g}x",
             met[t["remote_start_ratio"]]),
            ("container start p95 (ms)", f"{s['remote']['p95_ms']:.1f}", f"{s['local']['p95_ms']:.1f}",
             f"{s['ratio_p95']:.2f}x", "", ""),
            ("start with a new shadow sandbox p50 (ms)", f"{s['remote_cold']['p50_ms']:.1f}",
             f"{s['local']['p50_ms']:.1f}", f"{s['cold_ratio_p50']:.2f}x", "reference", ""),
            (f"ContainerStatus p50 (ms, n={st['remote']['n']})", f"{st['remote']['p50_ms']:.3f}",
             f"{st['local']['p50_ms']:.3f}", f"{st['ratio_p50']:.2f}x", f"≤ {LIMITS['status_p50_ratio']:g}x",
             met[t["status_p50_ratio"]]),
            ("ContainerStatus p99 (ms)", f"{st['remote']['p99_ms']:.3f}", f"{st['local']['p99_ms']:.3f}", "", "", ""),
            (f"host killed: reported {loss['reason']} (s)", f"{loss['reported_lost_s']:.1f}", "", "", "", ""),
            ("host killed: restart running again (s)", f"{loss['replaced_s']:.1f}", "", "",
             f"≤ {LIMITS['replaced_s']:g} s", met[t["replaced_s"]])]
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    env = f["environment"]
    lines = [f"weft bench mesh: three-node fabric, fence {env['fence_timeout_s']:g} s, loss {env['loss_timeout_s']:g} s"
             f", containerd {env['containerd_version']}, {env['cpu_count']} CPUs", ""]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:5], widths[1:5], strict=True)] + [r[5]]
        lines.append("  ".join(cells).rstrip())
    hosts = ", ".join(f"{h}: {n}" for h, n in sorted(s["remote_hosts"].items()))
    lines += ["", "remote: the pod's shadow sandbox already on the host (kept there by another container), "
              "as for a restart;", "a new shadow sandbox: the pod's only container there, so the host runs "
              "RunPodSandbox first and removes it with the container",
              f"remote starts ran on {hosts}; the restart after {loss['host_killed']} died ran "
              f"{loss['replacement_placement']}",
              targets_met(t)]
    return "\n".join(lines)


def main(*, as_json: bool, starts: int, samples: int, output: Path | None) -> int:
    if starts < 1 or samples < 10:
        raise WeftError("need --starts >= 1 and --samples >= 10")
    return run_in_scratch("weft-bench-mesh-", _say,
                          lambda workdir: _figures(_measure(starts, samples, workdir), starts, samples),
                          as_json, output, _table)
