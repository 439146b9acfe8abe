"""``weft bench proxy``: what the agent costs kubelet, measured against containerd itself.

The machines this runs on are noisy, so every comparison is made within one
run and interleaved call by call (direct, agent, direct, agent, ...) rather
than in separate passes: drift in load, frequency or cache state then hits
both paths alike. Phases, all against one throwaway containerd with ``pods``
busybox pods running, each under a pod cgroup parent as kubelet sets one:

1. per-call latency of the pass-through verbs kubelet polls most, direct and
   through the agent, plus Version through the three :mod:`shim.bench.floor` modes:
   a grpcio server that only echoes (what any Python grpcio server adds), a
   bare grpcio forwarder to containerd (what any grpcio forwarder adds: the
   design the agent's relay replaced), and a plain asyncio byte pipe (the
   least any Python relay adds), so the agent's overhead reads against them;
2. whole pod starts (RunPodSandbox + CreateContainer + StartContainer), as
   many through each path as there are pods, at most 30 and at least 3;
3. a kubelet-like polling load through the agent, for the agent's CPU and RSS.

It reports figures and whether they meet weft's targets; it is a
measurement, not a test, so missed targets do not change the exit code. The
containerd is the harness's, so ``WEFT_CONTAINERD`` (1.6, 1.7, 2) chooses the
release measured; the figures name it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import psutil
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.bench.running import labelled, ms, run, targets_met
from shim.core.stats import percentile
from shim.errors import WeftError
from shim.localfabric import daemon
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd
from shim.localfabric.pods import container_config, sandbox_config

RUNTIME = "/runtime.v1.RuntimeService/"
IMAGE = "/runtime.v1.ImageService/"
LIMITS = {"added_p50_ms": 0.2, "added_p99_ms": 1.0, "pod_start_ratio": 1.03, "rss_mb": 80.0,
          "cpu_percent_one_core": 2.0}
POD_STARTS = 30  # at 10 the median ratio moved by ±5 % from run to run
RPC_TIMEOUT = 30.0
MB = 1024 * 1024

# method -> (request bytes, target -> raw-bytes multicallable)
Cases = dict[str, tuple[bytes, dict[str, Callable[..., bytes]]]]


def _say(msg: str) -> None:
    # stdout is reserved for the figures (one JSON object with --json).
    print(f"weft bench proxy: {msg}", file=sys.stderr, flush=True)


def _p50_p99(ns: list[int]) -> tuple[float, float]:
    return ms(percentile(ns, 50) or 0), ms(percentile(ns, 99) or 0)


# -- pods --------------------------------------------------------------------
def _start_pod(rt: cri_grpc.RuntimeServiceStub, sb_cfg: cri.PodSandboxConfig, c_cfg: cri.ContainerConfig) -> str:
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb_cfg), timeout=RPC_TIMEOUT).pod_sandbox_id
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=c_cfg, sandbox_config=sb_cfg),
                             timeout=RPC_TIMEOUT).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
    return sb


def _remove_pod(rt: cri_grpc.RuntimeServiceStub, sandbox_id: str) -> None:
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=RPC_TIMEOUT)


def _pod(name: str, ctrd: Containerd) -> tuple[cri.PodSandboxConfig, cri.ContainerConfig]:
    # A real cgroup parent: without one containerd 1.6 fails ListPodSandboxStats,
    # and the load phase would time an error path kubelet never takes.
    return (sandbox_config(name, ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root),
            container_config("sleeper", ["sleep", "3600"]))


def _start_pods(rt: cri_grpc.RuntimeServiceStub, ctrd: Containerd, count: int) -> None:
    # Setup is not timed; a few at once keeps a 50-pod run short.
    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(lambda i: _start_pod(rt, *_pod(f"bench-{i}", ctrd)), range(count)))


# -- the grpcio floors ---------------------------------------------------------
@contextlib.contextmanager
def _floor(socket: Path, *args: str) -> Iterator[str]:
    """A :mod:`shim.bench.floor` server on ``socket``; ``args`` pick its mode."""
    proc = subprocess.Popen([sys.executable, "-m", "shim.bench.floor", str(socket), *args],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        address = f"unix://{socket}"
        with grpc.insecure_channel(address) as ch:
            try:
                grpc.channel_ready_future(ch).result(timeout=20)
            except grpc.FutureTimeoutError:
                raise RuntimeError(f"shim.bench.floor did not answer on {socket} (exit code {proc.poll()})") from None
        yield address
    finally:
        daemon.stop(proc, timeout=5)


# -- phase 1: per-call latency ---------------------------------------------------
def _latency(cases: Cases, samples: int, warmup: int) -> dict[str, dict[str, list[int]]]:
    """Nanoseconds per call, per method and target, every target called in turn."""
    out = {name: {target: [] for target in calls} for name, (_, calls) in cases.items()}
    # A collection pause inside one timed call would land on whichever path
    # happened to be running; nothing here makes cycles.
    gc.disable()
    try:
        for i in range(warmup + samples):
            for name, (request, calls) in cases.items():
                order = list(calls.items())
                k = i % len(order)  # rotate, so no path always goes first
                for target, call in order[k:] + order[:k]:
                    t0 = time.perf_counter_ns()
                    call(request, timeout=RPC_TIMEOUT)
                    dt = time.perf_counter_ns() - t0
                    if i >= warmup:
                        out[name][target].append(dt)
    finally:
        gc.enable()
    return out


# -- phase 2: pod start ----------------------------------------------------------
def _pod_start(direct: grpc.Channel, agent: grpc.Channel, ctrd: Containerd, n: int) -> dict[str, list[int]]:
    stubs = {"direct": cri_grpc.RuntimeServiceStub(direct), "agent": cri_grpc.RuntimeServiceStub(agent)}
    cleanup = stubs["direct"]
    out: dict[str, list[int]] = {"direct": [], "agent": []}
    for i in range(n):
        for target in ("direct", "agent") if i % 2 == 0 else ("agent", "direct"):
            sb_cfg, c_cfg = _pod(f"start-{target}-{i}", ctrd)
            t0 = time.perf_counter_ns()
            sandbox = _start_pod(stubs[target], sb_cfg, c_cfg)
            out[target].append(time.perf_counter_ns() - t0)
            # Removed at once, so every start sees the same number of running pods.
            _remove_pod(cleanup, sandbox)
    return out


# -- phase 3: kubelet-like load ----------------------------------------------------
def _cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()  # the whole process: every thread's time is in it
    return t.user + t.system


def _load(channel: grpc.Channel, proc: psutil.Process, seconds: float) -> dict[str, float | int]:
    def calls_of(*paths: tuple[str, object]) -> list[tuple[Callable[..., bytes], bytes, str]]:
        return [(channel.unary_unary(p), req.SerializeToString(), p.rsplit("/", 1)[1])  # type: ignore[attr-defined]
                for p, req in paths]

    relist = calls_of((RUNTIME + "ListPodSandbox", cri.ListPodSandboxRequest()),
                      (RUNTIME + "ListContainers", cri.ListContainersRequest()))
    stats = calls_of((RUNTIME + "ListContainerStats", cri.ListContainerStatsRequest()),
                     (RUNTIME + "ListPodSandboxStats", cri.ListPodSandboxStatsRequest()),
                     (IMAGE + "ImageFsInfo", cri.ImageFsInfoRequest()))
    calls = errors = 0
    failed: set[str] = set()
    rss: list[int] = []
    cpu0, start = _cpu_seconds(proc), time.monotonic()
    next_relist = next_stats = start
    end = start + seconds
    while (now := time.monotonic()) < end:
        due: list[tuple[Callable[..., bytes], bytes, str]] = []
        if now >= next_stats:  # kubelet's stats provider, every 10 s
            due += stats
            next_stats += 10.0
        if now >= next_relist:  # PLEG relist, every second
            due += relist
            next_relist += 1.0
            rss.append(proc.memory_info().rss)
        for call, request, name in due:
            calls += 1
            try:
                call(request, timeout=RPC_TIMEOUT)
            except grpc.RpcError as exc:
                # containerd fails some stats verbs for kubelet too; the agent
                # did its work either way, so count it and keep the load going.
                errors += 1
                if name not in failed:
                    failed.add(name)
                    _say(f"load: {name} failed: {exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
        time.sleep(max(0.0, min(next_relist, next_stats, end) - time.monotonic()))
    wall = time.monotonic() - start
    cpu = _cpu_seconds(proc) - cpu0
    return {"cpu_percent": round(100.0 * cpu / wall, 3) if wall > 0 else 0.0, "rss_max": max(rss, default=0),
            "calls": calls, "errors": errors, "wall": wall}


def _idle(proc: psutil.Process, seconds: float) -> tuple[float, int]:
    """CPU percent and RSS of the agent over a window with no calls at all.

    CPU times come in 10 ms ticks: over 3 s one tick reads as 0.33 %, over 10 s as 0.1 %.
    """
    cpu0, start = _cpu_seconds(proc), time.monotonic()
    time.sleep(seconds)
    return 100.0 * (_cpu_seconds(proc) - cpu0) / (time.monotonic() - start), proc.memory_info().rss


# -- the run -------------------------------------------------------------------
def _cases(channels: dict[str, grpc.Channel], container_id: str) -> Cases:
    # Raw bytes both ways: client-side protobuf work is identical on every
    # path and as small as it can be, so differences belong to the servers.
    requests = {"Version": cri.VersionRequest(), "ListPodSandbox": cri.ListPodSandboxRequest(),
                "ListContainers": cri.ListContainersRequest(),
                "ContainerStatus": cri.ContainerStatusRequest(container_id=container_id)}
    cases: Cases = {}
    for name, req in requests.items():
        targets = ("direct", "agent", "echo", "forward", "splice") if name == "Version" else ("direct", "agent")
        cases[name] = (req.SerializeToString(), {t: channels[t].unary_unary(RUNTIME + name) for t in targets})
    return cases


@dataclass
class _Raw:
    """What the run observed, before any statistics."""

    latency_ns: dict[str, dict[str, list[int]]]
    pod_start_ns: dict[str, list[int]]
    version: cri.VersionResponse
    rss_start: int
    rss_idle: int
    cpu_idle: float
    idle_s: float
    load: dict[str, float | int]
    netns: str
    workdir: str
    line: str


def _measure(pods: int, samples: int, load_seconds: float) -> _Raw:
    with Containerd() as ctrd, ctrd.channel() as direct:
        assert ctrd.workdir is not None
        _say(f"containerd {ctrd.line} up in netns {ctrd.netns}; starting {pods} pods")
        direct_rt = cri_grpc.RuntimeServiceStub(direct)
        _start_pods(direct_rt, ctrd, pods)
        version_raw = direct.unary_unary(RUNTIME + "Version")(cri.VersionRequest().SerializeToString(), timeout=5)
        containers = direct_rt.ListContainers(cri.ListContainersRequest(), timeout=RPC_TIMEOUT).containers
        running = [c.id for c in containers if c.state == cri.CONTAINER_RUNNING]
        if len(running) != pods:
            raise RuntimeError(f"expected {pods} running containers, containerd lists {len(running)}")

        agent = AgentProcess(ctrd, ctrd.workdir / "agent")
        try:  # not ``with``: __enter__ would leave a half-started agent running
            agent.start()
            proc = psutil.Process(agent.pid)
            rss_start = proc.memory_info().rss
            with agent.channel() as agent_ch:
                warmup = min(200, max(20, samples // 10))
                with _floor(ctrd.workdir / "echo.sock", version_raw.hex()) as echo, \
                        _floor(ctrd.workdir / "forward.sock", "--forward", str(ctrd.socket)) as forward, \
                        _floor(ctrd.workdir / "splice.sock", "--splice", str(ctrd.socket)) as spliced, \
                        grpc.insecure_channel(echo) as echo_ch, grpc.insecure_channel(forward) as forward_ch, \
                        grpc.insecure_channel(spliced) as splice_ch:
                    _say(f"latency: {samples} calls per method and path after {warmup} warm-up, interleaved")
                    channels = {"direct": direct, "agent": agent_ch, "echo": echo_ch, "forward": forward_ch,
                                "splice": splice_ch}
                    lat = _latency(_cases(channels, running[0]), samples, warmup)
                n_starts = max(3, min(POD_STARTS, pods))
                _say(f"pod start: {n_starts} direct and {n_starts} through the agent, interleaved")
                starts = _pod_start(direct, agent_ch, ctrd, n_starts)
                idle_s = min(10.0, max(3.0, load_seconds / 6))
                _say(f"idle: {idle_s:g} s without calls")
                cpu_idle, rss_idle = _idle(proc, idle_s)
                _say(f"load: kubelet-like polling through the agent for {load_seconds:g} s")
                load = _load(agent_ch, proc, load_seconds)
        finally:
            agent.stop()
        return _Raw(lat, starts, cri.VersionResponse.FromString(version_raw), rss_start, rss_idle, cpu_idle, idle_s,
                    load, ctrd.netns, str(ctrd.workdir), ctrd.line)


def _figures(raw: _Raw, pods: int, samples: int, load_seconds: float) -> dict:
    calls = {}
    for method, by_target in raw.latency_ns.items():
        d50, d99 = _p50_p99(by_target["direct"])
        a50, a99 = _p50_p99(by_target["agent"])
        calls[method] = {"direct_p50_ms": d50, "direct_p99_ms": d99, "agent_p50_ms": a50, "agent_p99_ms": a99,
                         "added_p50_ms": round(a50 - d50, 4), "added_p99_ms": round(a99 - d99, 4)}
    e50, e99 = _p50_p99(raw.latency_ns["Version"]["echo"])
    f50, f99 = _p50_p99(raw.latency_ns["Version"]["forward"])
    version = calls["Version"]
    # added_* (no prefix) is the echo floor's, as before the forwarder existed.
    floor = {"echo_p50_ms": e50, "echo_p99_ms": e99, "added_p50_ms": round(e50 - version["direct_p50_ms"], 4),
             "added_p99_ms": round(e99 - version["direct_p99_ms"], 4),
             "forward_p50_ms": f50, "forward_p99_ms": f99,
             "forward_added_p50_ms": round(f50 - version["direct_p50_ms"], 4),
             "forward_added_p99_ms": round(f99 - version["direct_p99_ms"], 4)}
    floor["agent_over_forward_p50_ms"] = round(version["added_p50_ms"] - floor["forward_added_p50_ms"], 4)
    s50, s99 = _p50_p99(raw.latency_ns["Version"]["splice"])
    floor.update({"splice_p50_ms": s50, "splice_p99_ms": s99,
                  "splice_added_p50_ms": round(s50 - version["direct_p50_ms"], 4),
                  "splice_added_p99_ms": round(s99 - version["direct_p99_ms"], 4)})
    floor["agent_over_splice_p50_ms"] = round(version["added_p50_ms"] - floor["splice_added_p50_ms"], 4)
    d_med = ms(statistics.median(raw.pod_start_ns["direct"]))
    a_med = ms(statistics.median(raw.pod_start_ns["agent"]))
    pod_start = {"direct_median_ms": d_med, "agent_median_ms": a_med, "ratio": round(a_med / d_med, 4),
                 "n": len(raw.pod_start_ns["direct"])}
    load = raw.load
    rss_max = max(raw.rss_start, raw.rss_idle, load["rss_max"])
    agent = {"rss_start_mb": round(raw.rss_start / MB, 2), "rss_idle_mb": round(raw.rss_idle / MB, 2),
             "rss_max_mb": round(rss_max / MB, 2), "idle_seconds": round(raw.idle_s, 2),
             "cpu_percent_idle": round(raw.cpu_idle, 3),
             "cpu_percent_one_core": load["cpu_percent"], "load_seconds": round(load["wall"], 2),
             "load_calls": load["calls"], "load_errors": load["errors"]}
    targets = {}
    for method, c in calls.items():
        targets[f"{method}.added_p50"] = c["added_p50_ms"] <= LIMITS["added_p50_ms"]
        targets[f"{method}.added_p99"] = c["added_p99_ms"] <= LIMITS["added_p99_ms"]
    targets["pod_start_ratio"] = pod_start["ratio"] <= LIMITS["pod_start_ratio"]
    targets["agent_rss"] = agent["rss_max_mb"] <= LIMITS["rss_mb"]
    targets["agent_cpu"] = agent["cpu_percent_one_core"] <= LIMITS["cpu_percent_one_core"]
    targets["all"] = all(targets.values())
    environment = {"pods": pods, "samples": samples, "load_seconds_requested": load_seconds,
                   "cpu_count": os.cpu_count(), "containerd_version": raw.version.runtime_version,
                   "containerd_line": raw.line,
                   "python": sys.version.split()[0], "grpcio": grpc.__version__,
                   "netns": raw.netns, "workdir": raw.workdir}
    return {"calls": calls, "floor": floor, "pod_start": pod_start, "agent": agent, "targets": targets,
            "limits": LIMITS, "environment": environment}


# -- output --------------------------------------------------------------------
def _table(f: dict) -> str:
    ok = {True: "✓", False: "✗"}
    t, env = f["targets"], f["environment"]
    rows = [("", "direct", "via agent", "added", "target", "")]
    for method, c in f["calls"].items():
        for q in ("p50", "p99"):
            rows.append((f"{method} {q} (ms)", f"{c[f'direct_{q}_ms']:.3f}", f"{c[f'agent_{q}_ms']:.3f}",
                         f"{c[f'added_{q}_ms']:+.3f}", f"≤ {LIMITS[f'added_{q}_ms']:g} ms",
                         ok[t[f"{method}.added_{q}"]]))
    fl, v = f["floor"], f["calls"]["Version"]
    for q in ("p50", "p99"):
        rows.append((f"grpcio floor: Version echo {q} (ms)", f"{v[f'direct_{q}_ms']:.3f}", f"{fl[f'echo_{q}_ms']:.3f}",
                     f"{fl[f'added_{q}_ms']:+.3f}", "reference", ""))
    for q in ("p50", "p99"):
        rows.append((f"grpcio floor: Version forward {q} (ms)", f"{v[f'direct_{q}_ms']:.3f}",
                     f"{fl[f'forward_{q}_ms']:.3f}", f"{fl[f'forward_added_{q}_ms']:+.3f}", "reference", ""))
    for q in ("p50", "p99"):
        rows.append((f"relay floor: Version byte splice {q} (ms)", f"{v[f'direct_{q}_ms']:.3f}",
                     f"{fl[f'splice_{q}_ms']:.3f}", f"{fl[f'splice_added_{q}_ms']:+.3f}", "reference", ""))
    rows.append(("weft's own: Version agent - splice p50 (ms)", "", "", f"{fl['agent_over_splice_p50_ms']:+.3f}",
                 "", ""))
    ps, ag = f["pod_start"], f["agent"]
    rows.append((f"pod start, median of {ps['n']} (ms)", f"{ps['direct_median_ms']:.1f}",
                 f"{ps['agent_median_ms']:.1f}", f"{ps['ratio']:.3f}x", f"≤ {LIMITS['pod_start_ratio']:g}x",
                 ok[t["pod_start_ratio"]]))
    rows.append(("agent RSS idle / max (MB)", "", f"{ag['rss_idle_mb']:.1f} / {ag['rss_max_mb']:.1f}", "",
                 f"≤ {LIMITS['rss_mb']:g} MB", ok[t["agent_rss"]]))
    rows.append((f"agent CPU, {ag['load_seconds']:g} s kubelet load (% core)", "",
                 f"{ag['cpu_percent_one_core']:.2f}", "", f"≤ {LIMITS['cpu_percent_one_core']:g} %",
                 ok[t["agent_cpu"]]))
    rows.append((f"agent CPU, {ag['idle_seconds']:g} s idle (% core)", "", f"{ag['cpu_percent_idle']:.2f}", "", "", ""))
    lines = [f"weft bench proxy: {env['pods']} pods, {env['samples']} samples per call and path, "
             f"containerd {env['containerd_line']} ({env['containerd_version']}), {env['cpu_count']} CPUs", ""]
    lines += labelled(rows)
    lines += ["", "floor: echo = a Python grpcio server alone; forward = a grpcio server plus a grpcio client hop "
              "(the least any grpcio forwarder can add);",
              "       splice = an asyncio byte pipe, no gRPC (the least a Python relay can add); "
              "agent - splice = what weft's relay adds over a plain pipe",
              targets_met(t)]
    if ag["load_errors"]:
        lines.append(f"note: {ag['load_errors']} of {ag['load_calls']} load calls failed (see messages above)")
    return "\n".join(lines)


def main(*, as_json: bool, pods: int, samples: int, load_seconds: float, output: Path | None) -> int:
    if pods < 1 or samples < 10 or load_seconds < 0:
        raise WeftError("need --pods >= 1, --samples >= 10 and --load-seconds >= 0")
    return run(_say, lambda: _figures(_measure(pods, samples, load_seconds), pods, samples, load_seconds),
               as_json, output, _table)
