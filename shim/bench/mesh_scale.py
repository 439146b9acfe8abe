"""``weft bench mesh-scale``: one real agent among N peers, at N = 100, 1,000 and 5,000.

The agent is a ``weft agent`` subprocess (role gpu, the default Hello
interval) in front of a harness containerd, with a static peers file of N
CPU hosts. The peers are lightweight and live in this process: one gRPC
server with a port per peer, each port serving that peer's own certificate
(``shim.mesh.certs``, one cluster CA), so the agent's TLS checks each peer as
it would a real one. A peer answers Hello and Admit with fixed room, makes a
shadow at RunShadow without running anything, and heartbeats a Watch.

For each N, after the mesh has settled:

1. a quiet window: the agent's CPU (its own user + system time, % of one
   core) and RSS (the largest seen), and what reaches the peers: calls per
   second and control-plane bytes per second (each request and answer's
   protobuf size, counted at the peers; HTTP/2 and TLS framing and keepalive
   pings are not in it), and the connections the agent holds open to them;
2. placement: CreateContainer of a CPU container in an opted-in pod through
   the agent's CRI socket, as kubelet makes it (the agent decides over its
   peer views, asks a peer to Admit and to make the shadow), then
   RemoveContainer, untimed; each sample checks that the container went to
   a peer.

Ratios compare every N with the smallest of the run. It is a measurement, not
a test: a missed target is printed, and the exit code says only whether the
run worked (:mod:`shim.bench.running`).
"""

from __future__ import annotations

import datetime
import os
import platform
import resource
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim._pb import mesh_pb2 as pb
from shim._pb import mesh_pb2_grpc as pb_grpc
from shim.bench.running import established, ms, parse_counts, right_aligned, run_in_scratch, targets_met
from shim.config import MeshConfig
from shim.core.stats import percentile
from shim.errors import WeftError
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd, RuntimeHandler
from shim.mesh.certs import generate_ca, issue_node_cert
from shim.mesh.wire import KEEPALIVE_OPTIONS
from shim.status import from_agent

DEFAULT_PEERS = (100, 1000, 5000)
QUICK_PEERS = (20, 60)
LIMITS = {"agent_cpu_pct": 1.0, "agent_rss_mb": 100.0, "placement_p50_ratio": 1.2}
ORIGIN = "gpu-1"
RPC_TIMEOUT = 30.0
# Each peer's room: plenty, so that every placement is admitted.
FREE = pb.Resources(cpu_cores=8.0, memory_bytes=32 << 30)
ALLOCATABLE = pb.Resources(cpu_cores=16.0, memory_bytes=64 << 30)
# File descriptors to have per peer (its listening socket, with room for the connections made to it).
FDS_PER_PEER = 2


def _say(msg: str) -> None:
    print(f"weft bench mesh-scale: {msg}", file=sys.stderr, flush=True)


def peer_name(i: int) -> str:
    return f"cpu-{i:05d}"


# -- the peers --------------------------------------------------------------------
class Peers(pb_grpc.MeshServicer):
    """N mesh peers in one gRPC server: a port and a certificate each; counts what reaches them."""

    def __init__(self, n: int, ca: tuple[bytes, bytes], workdir: Path) -> None:
        self.n = n
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.bytes = 0
        self._stop = threading.Event()
        # A worker for each peer's Watch besides the quick calls, as each real host serves its own (threads
        # start only as calls need them).
        self._server = grpc.server(ThreadPoolExecutor(max_workers=n + 64, thread_name_prefix="bench-peer"),
                                   options=KEEPALIVE_OPTIONS)  # as every agent's mesh server
        pb_grpc.add_MeshServicer_to_server(self, self._server)
        ca_key, ca_cert = ca
        self.ports: list[int] = []
        for i in range(n):
            key, cert = issue_node_cert(ca_key, ca_cert, peer_name(i))
            creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca_cert, require_client_auth=True)
            port = self._server.add_secure_port("127.0.0.1:0", creds)
            if not port:
                raise WeftError(f"could not listen for peer {i} (file descriptors: {_fd_limit()})")
            self.ports.append(port)

    def start(self) -> None:
        self._server.start()

    def stop(self) -> None:
        self._stop.set()
        self._server.stop(0.5).wait()

    def peers_file(self, path: Path) -> None:
        path.write_text("".join(f'[[peer]]\nname = "{peer_name(i)}"\naddress = "127.0.0.1:{p}"\nrole = "cpu"\n\n'
                                for i, p in enumerate(self.ports)))

    def snapshot(self) -> tuple[Counter[str], int]:
        with self._lock:
            return Counter(self.calls), self.bytes

    def _count(self, method: str, *messages) -> None:
        size = sum(m.ByteSize() for m in messages)
        with self._lock:
            self.calls[method] += 1
            self.bytes += size

    def connections(self) -> int:
        """Established TCP connections to the peers' addresses (the agent's, as the peers see them): their
        127.0.0.1 and port, not the port alone, which another process's socket on another address may have."""
        # 127.0.0.1:<port> as /proc/net/tcp writes it, and as tcp6 writes it IPv4-mapped (gRPC's dual-stack socket).
        local = {f"{addr}:{port:04X}" for port in self.ports
                 for addr in ("0100007F", "0000000000000000FFFF00000100007F")}
        return established(local.__contains__)

    # The peer's side of the protocol, just enough for the agent.
    def Hello(self, request, context):  # noqa: N802 - gRPC method names
        answer = pb.PeerState(role="cpu", allocatable=ALLOCATABLE, free=FREE, healthy=True, sampled_at=time.time())
        self._count("Hello", request, answer)
        return answer

    def Admit(self, request, context):  # noqa: N802
        answer = pb.AdmitResponse(admitted=True, reason="admitted", free_after=FREE)
        self._count("Admit", request, answer)
        return answer

    def RunShadow(self, request, context):  # noqa: N802
        status = b"" if request.sandbox_only else cri.ContainerStatus(
            id=f"shadow-{request.key}", state=cri.CONTAINER_CREATED, created_at=time.time_ns()).SerializeToString()
        answer = pb.ShadowState(key=request.key, shadow_sandbox_id=f"sb-{request.origin_sandbox_id}",
                                shadow_container_id="" if request.sandbox_only else f"shadow-{request.key}",
                                status=status)
        self._count("RunShadow", request, answer)
        return answer

    def RemoveShadow(self, request, context):  # noqa: N802
        answer = pb.RemoveShadowResponse(removed=True)
        self._count("RemoveShadow", request, answer)
        return answer

    def Watch(self, request, context):  # noqa: N802
        self._count("Watch", request)
        beat = pb.ShadowState(heartbeat=True)
        while context.is_active() and not self._stop.is_set():
            self._count("Watch", beat)
            yield beat
            self._stop.wait(max(0.1, request.heartbeat_s or 1.0))


# -- the agent ------------------------------------------------------------------------
def _fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def raise_fd_limit() -> tuple[int, int]:
    """The soft limit on open files raised to the hard one (inherited by the agent); (soft, hard) after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _status(agent: AgentProcess) -> dict:
    return from_agent(agent.socket)  # what `weft status --json` prints


def _settle(agent: AgentProcess, n: int, timeout: float) -> float:
    """Seconds until the agent sees as many healthy peers as it keeps (all of a small fleet)."""
    t0 = time.monotonic()
    want = min(n, 16)
    while True:
        try:
            healthy = sum(1 for p in _status(agent).get("peers", []) if p.get("healthy"))
        except (grpc.RpcError, WeftError, OSError, ValueError):
            healthy = 0
        if healthy >= want:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"the agent saw {healthy} healthy peers of the {want} it keeps after {timeout:g} s")
        time.sleep(0.5)


def quiet_window(agent: AgentProcess, peers: Peers, seconds: float) -> dict:
    pid = agent.proc.pid
    calls0, bytes0 = peers.snapshot()
    cpu0, t0 = _cpu_s(pid), time.monotonic()
    rss = _rss_mb(pid)
    while (left := seconds - (time.monotonic() - t0)) > 0:
        time.sleep(min(1.0, left))
        rss = max(rss, _rss_mb(pid))
    cpu1, t1 = _cpu_s(pid), time.monotonic()
    calls1, bytes1 = peers.snapshot()
    span = t1 - t0
    calls = {m: round((calls1[m] - calls0[m]) / span, 2) for m in sorted(calls1) if calls1[m] > calls0[m]}
    return {"seconds": round(span, 1), "agent_cpu_pct": round(100 * (cpu1 - cpu0) / span, 3),
            "agent_rss_mb": round(rss, 1), "control_bytes_per_s": round((bytes1 - bytes0) / span, 1),
            "calls_per_s": calls, "connections": peers.connections()}


def placements(agent: AgentProcess, containerd: Containerd, samples: int) -> dict:
    """CreateContainer of a reroutable container through the agent, as kubelet makes it: ns per sample."""
    with grpc.insecure_channel(agent.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        config = pods.sandbox_config("bench-scale", containerd.pod_log_dir, cgroup_parent=containerd.cgroup_root)
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=config, runtime_handler="weft"),
                               timeout=RPC_TIMEOUT).pod_sandbox_id
        out: list[int] = []
        hosts: Counter[str] = Counter()
        try:
            for i in range(samples + 2):  # two to warm up
                c = pods.container_config("tokenize", ["sleep", "3600"], attempt=i)
                res = c.linux.resources
                res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, 50000, 64 << 20
                t0 = time.perf_counter_ns()
                req = cri.CreateContainerRequest(pod_sandbox_id=sid, config=c, sandbox_config=config)
                cid = rt.CreateContainer(req, timeout=RPC_TIMEOUT).container_id
                dt = time.perf_counter_ns() - t0
                status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT).status
                placed = status.annotations.get("weft.io/placement", "")
                rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid), timeout=RPC_TIMEOUT)
                if not placed.startswith("remote:"):
                    raise RuntimeError(f"the container was placed {placed!r}, not on a peer: "
                                       f"{status.annotations.get('weft.io/placement-reason', '')}")
                if i >= 2:
                    out.append(dt)
                    hosts[placed.removeprefix("remote:")] += 1
        finally:
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=RPC_TIMEOUT)
    return {"ns": out, "hosts": len(hosts)}


def _latency(ns: list[int]) -> dict:
    out = {"p50_ms": ms(percentile(ns, 50) or 0, 2), "n": len(ns), "p95_ms": ms(percentile(ns, 95) or 0, 2)}
    return out


def measure_one(n: int, containerd: Containerd, workdir: Path, ca: tuple[bytes, bytes], *, window: float,
                samples: int) -> dict:
    t0 = time.monotonic()
    peers = Peers(n, ca, workdir)
    made = time.monotonic() - t0
    peers.start()
    peers_file = workdir / f"peers-{n}.toml"
    peers.peers_file(peers_file)
    agent = AgentProcess(containerd, workdir / f"agent-{n}", name=ORIGIN, extra_args=[
        "--node-name", ORIGIN, "--role", "gpu", "--mesh-address", f"127.0.0.1:{free_port()}",
        "--peers", str(peers_file), "--tls-dir", str(workdir / "certs")])
    (workdir / f"agent-{n}").mkdir(parents=True, exist_ok=True)
    try:
        agent.start(timeout=60)
        settled = _settle(agent, n, timeout=120)
        time.sleep(2 * MeshConfig().hello_interval)  # a round or two past the first
        _say(f"N={n}: {n} peers up in {made:.1f} s, agent settled in {settled:.1f} s; quiet window {window:g} s")
        quiet = quiet_window(agent, peers, window)
        _say(f"N={n}: agent {quiet['agent_cpu_pct']:.2f} % of a core, {quiet['agent_rss_mb']:.0f} MB; "
             f"{samples} placements")
        placed = placements(agent, containerd, samples)
        return {"peers": n, **quiet, "placement": _latency(placed["ns"]), "placement_hosts": placed["hosts"],
                "settled_s": round(settled, 1)}
    finally:
        agent.stop()
        peers.stop()


def _measure(ns: list[int], window: float, samples: int, workdir: Path) -> dict:
    soft, hard = raise_fd_limit()
    need = max(ns) * FDS_PER_PEER + 1024
    if soft < need:
        _say(f"open files limited to {soft} (hard {hard}); {max(ns)} peers need about {need}")
    load_before = [round(x, 2) for x in os.getloadavg()]
    ca = generate_ca()
    certs = workdir / "certs"
    certs.mkdir(parents=True)
    key, cert = issue_node_cert(*ca, ORIGIN)
    (certs / "ca.crt").write_bytes(ca[1])
    (certs / f"{ORIGIN}.key").write_bytes(key)
    (certs / f"{ORIGIN}.crt").write_bytes(cert)
    with Containerd(handlers=[RuntimeHandler("weft", pod_annotations=("weft.io/*",),
                                             container_annotations=("weft.io/*",))]) as containerd:
        runs = [measure_one(n, containerd, workdir, ca, window=window, samples=samples) for n in ns]
    return {"runs": runs, "fd_limit": [soft, hard], "load_before": load_before}


def _figures(raw: dict, window: float, samples: int) -> dict:
    runs = raw["runs"]
    base, top = runs[0], runs[-1]
    ratios = {"placement_p50": round(top["placement"]["p50_ms"] / base["placement"]["p50_ms"], 3),
              "agent_cpu": round(top["agent_cpu_pct"] / base["agent_cpu_pct"], 3) if base["agent_cpu_pct"] else None,
              "agent_rss": round(top["agent_rss_mb"] / base["agent_rss_mb"], 3),
              "control_bytes": (round(top["control_bytes_per_s"] / base["control_bytes_per_s"], 3)
                                if base["control_bytes_per_s"] else None),
              "of": [base["peers"], top["peers"]]}
    targets = {"agent_cpu_pct": top["agent_cpu_pct"] <= LIMITS["agent_cpu_pct"],
               "agent_rss_mb": top["agent_rss_mb"] <= LIMITS["agent_rss_mb"],
               "placement_p50_ratio": ratios["placement_p50"] <= LIMITS["placement_p50_ratio"]}
    targets["all"] = all(targets.values())
    environment = {"window_s": window, "placements": samples, "cpu_count": os.cpu_count(),
                   "kernel": platform.release(), "python": sys.version.split()[0],
                   "hello_interval_s": MeshConfig().hello_interval, "fd_limit": raw["fd_limit"],
                   "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   "load_average_before": raw["load_before"]}
    return {"runs": runs, "ratios": ratios, "targets": targets, "limits": LIMITS, "environment": environment}


def _table(f: dict) -> str:
    met = {True: "target met", False: "missed"}
    rows = [("peers", "agent CPU %", "agent RSS MB", "control B/s", "calls/s", "connections", "placement p50 ms",
             "p95 ms")]
    for r in f["runs"]:
        rows.append((str(r["peers"]), f"{r['agent_cpu_pct']:.2f}", f"{r['agent_rss_mb']:.0f}",
                     f"{r['control_bytes_per_s']:.0f}", f"{sum(r['calls_per_s'].values()):.1f}", str(r["connections"]),
                     f"{r['placement']['p50_ms']:.2f}", f"{r['placement']['p95_ms']:.2f}"))
    lines = [f"weft bench mesh-scale: one agent among N peers, Hello every {f['environment']['hello_interval_s']:g} s, "
             f"{f['environment']['cpu_count']} CPUs", ""]
    lines += right_aligned(rows)
    ra, t, lim = f["ratios"], f["targets"], f["limits"]
    top = f["runs"][-1]
    lines += ["", f"at {top['peers']} peers: agent CPU {top['agent_cpu_pct']:.2f} % of a core "
              f"(≤ {lim['agent_cpu_pct']:g} %: "
              f"{met[t['agent_cpu_pct']]}), RSS {top['agent_rss_mb']:.0f} MB (≤ {lim['agent_rss_mb']:g} MB: "
              f"{met[t['agent_rss_mb']]})",
              f"placement p50 at {ra['of'][1]} / at {ra['of'][0]} peers: {ra['placement_p50']:.2f}x "
              f"(≤ {lim['placement_p50_ratio']:g}x: {met[t['placement_p50_ratio']]})",
              f"agent CPU {ra['agent_cpu']}x, RSS {ra['agent_rss']}x, control bytes {ra['control_bytes']}x "
              f"({ra['of'][1]} against {ra['of'][0]} peers)",
              targets_met(t)]
    return "\n".join(lines)


def main(*, as_json: bool, peers: str | None, quick: bool, output: Path | None) -> int:
    ns = parse_counts("--peers", peers, QUICK_PEERS if quick else DEFAULT_PEERS)
    window, samples = (4.0, 5) if quick else (30.0, 40)
    return run_in_scratch("weft-bench-mesh-scale-", _say,
                          lambda workdir: _figures(_measure(ns, window, samples, workdir), window, samples),
                          as_json, output, _table)
