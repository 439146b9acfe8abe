"""``weft bench host-scale``: one real CPU host agent watched by N origins, at N = 10, 100 and 500.

The host is a ``weft agent`` subprocess (role cpu, the default Hello and
heartbeat intervals) in front of a harness containerd. The origins are
lightweight and live in this process: each a mesh client with a certificate
of its own (one cluster CA), as an origin's agent dials a host. Each holds a
Watch stream open, as an origin with a shadow there does, asking for the
idle heartbeat an origin's agent asks for, and says Hello at the agents'
interval only while that Watch has not brought the host's state (a host
that pushes it is not said Hello to, as an origin's agent does); ten shadows (``sleep``, made and started through
RunShadow) run on the host, spread over the first ten origins, each of which
watches its own.

For each N, after every origin has said Hello and opened its Watch, a quiet
window: the host agent's CPU (its own user + system time, % of one core), its
largest RSS, the TCP connections it holds open on its mesh port, and the
Hellos and Watch messages a second the origins sent and got. It is a
measurement, not a test: a missed target is printed, and the exit code says
only whether the run worked (:mod:`shim.bench.running`).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import threading
import time
from pathlib import Path

import grpc

from shim._pb import mesh_pb2 as pb
from shim.bench.mesh_scale import _cpu_s, _rss_mb, raise_fd_limit
from shim.bench.running import established, parse_counts, right_aligned, run_in_scratch
from shim.config import WATCH_IDLE_S, MeshConfig
from shim.errors import WeftError
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd
from shim.mesh.certs import MeshTls, generate_ca, issue_node_cert
from shim.mesh.client import PeerClient

DEFAULT_ORIGINS = (10, 100, 500)
QUICK_ORIGINS = (5, 20)
SHADOWS = 10
LIMITS = {"host_cpu_pct": 2.0, "host_rss_mb": 150.0}
HOST = "cpu-1"


def _say(msg: str) -> None:
    print(f"weft bench host-scale: {msg}", file=sys.stderr, flush=True)


def origin_name(i: int) -> str:
    return f"gpu-{i:04d}"


class Origin:
    """One origin's side of the mesh toward the host: Hello every interval, a Watch held open."""

    def __init__(self, name: str, address: str, tls: MeshTls) -> None:
        self.name = name
        self.client = PeerClient(HOST, address, tls)
        self.keys: list[str] = []
        self.watch = None
        self.heard = threading.Event()  # the Watch brought its first message
        self.pushing = False  # the Watch brought the host's state: no Hellos while it is open
        self.hellos = 0
        self.messages = 0
        self.failed = ""
        self._reader: threading.Thread | None = None

    def hello(self) -> None:
        if self.pushing:
            return
        self.hellos += 1
        try:
            self.client.hello(pb.PeerState(node=self.name, role="gpu", healthy=True))
        except WeftError as exc:
            self.failed = f"Hello: {exc.message}"

    def open_watch(self, heartbeat_s: float) -> None:
        self.watch = self.client.watch(self.name, self.keys, heartbeat_s, idle_heartbeat_s=WATCH_IDLE_S)
        self._reader = threading.Thread(target=self._read, name=f"bench-watch-{self.name}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for message in self.watch:
                self.messages += 1
                self.pushing = self.pushing or message.HasField("peer")
                self.heard.set()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.CANCELLED:
                self.failed = f"Watch: {exc.code().name} {exc.details()}"

    def close(self) -> None:
        if self.watch is not None:
            self.watch.cancel()
        if self._reader is not None:
            self._reader.join(5)
        self.client.close()


def _hellos(origins: list[Origin], interval: float, stop: threading.Event) -> None:
    """Every origin's Hello once per ``interval``, spread over it, as agents started at different moments."""
    gap = interval / max(1, len(origins))
    while not stop.is_set():
        for o in origins:
            if stop.is_set():
                return
            o.hello()
            stop.wait(gap)


def _shadow(containerd: Containerd, origin: Origin, i: int) -> None:
    key = f"bench-{i}/work/0"
    sandbox = pods.sandbox_config(f"bench-{i}", containerd.pod_log_dir, cgroup_parent=containerd.cgroup_root)
    config = pods.container_config("work", ["sleep", "3600"])
    res = config.linux.resources  # a host admits by limits: 0.1 core and container_config's memory
    res.cpu_period, res.cpu_quota = 100000, 10000
    origin.client.run_shadow(pb.RunShadowRequest(
        origin_node=origin.name, origin_sandbox_id=f"origin-sb-{i}", key=key, start=True,
        sandbox_config=sandbox.SerializeToString(), container_config=config.SerializeToString()))
    origin.keys.append(key)


def _connections(port: int) -> int:
    """Established TCP connections on the host's mesh port."""
    return established(lambda local: local.endswith(f":{port:04X}"))


def measure_one(n: int, containerd: Containerd, workdir: Path, ca: tuple[bytes, bytes], *, window: float) -> dict:
    certs = workdir / f"certs-{n}"
    certs.mkdir(parents=True)
    (certs / "ca.crt").write_bytes(ca[1])
    tls: dict[str, MeshTls] = {}
    for name in [HOST] + [origin_name(i) for i in range(n)]:
        key, cert = issue_node_cert(*ca, name)
        (certs / f"{name}.key").write_bytes(key)
        (certs / f"{name}.crt").write_bytes(cert)
        tls[name] = MeshTls(key, cert, ca[1])
    port = free_port()
    peers = workdir / f"peers-{n}.toml"
    listed = [(origin_name(i), free_port(), "gpu") for i in range(n)] + [(HOST, port, "cpu")]
    peers.write_text("".join(f'[[peer]]\nname = "{name}"\naddress = "127.0.0.1:{p}"\nrole = "{role}"\n\n'
                             for name, p, role in listed))
    config = workdir / f"weft-{n}.toml"
    config.write_text('[mesh]\nfixed_capacity = "8,32Gi"\n')  # RunShadow admits whatever this machine's load
    (workdir / f"host-{n}").mkdir()
    host = AgentProcess(containerd, workdir / f"host-{n}", name=HOST, extra_args=[
        "--node-name", HOST, "--role", "cpu", "--mesh-address", f"127.0.0.1:{port}", "--peers", str(peers),
        "--tls-dir", str(certs), "--config", str(config)])
    mesh = MeshConfig()
    origins: list[Origin] = []
    stop = threading.Event()
    hellos = threading.Thread(target=_hellos, args=(origins, mesh.hello_interval, stop), daemon=True)
    try:
        host.start(timeout=60)
        t0 = time.monotonic()
        origins.extend(Origin(origin_name(i), f"127.0.0.1:{port}", tls[origin_name(i)]) for i in range(n))
        for i in range(SHADOWS):
            _shadow(containerd, origins[i % n], i)
        for o in origins:
            o.hello()
            o.open_watch(mesh.heartbeat_interval)
        hellos.start()
        deadline = time.monotonic() + 120
        while not all(o.heard.is_set() for o in origins):
            failed = [f"{o.name}: {o.failed}" for o in origins if o.failed]
            if failed or time.monotonic() > deadline:
                silent = [o.name for o in origins if not o.heard.is_set()]
                raise RuntimeError(f"origins not watching: {failed or silent}")
            time.sleep(0.2)
        settled = time.monotonic() - t0
        time.sleep(2 * mesh.hello_interval)
        _say(f"N={n}: {n} origins watching, {SHADOWS} shadows running, in {settled:.1f} s; quiet window {window:g} s")
        pid = host.proc.pid
        hellos0, messages0 = sum(o.hellos for o in origins), sum(o.messages for o in origins)
        cpu0, w0 = _cpu_s(pid), time.monotonic()
        rss = _rss_mb(pid)
        while (left := window - (time.monotonic() - w0)) > 0:
            time.sleep(min(1.0, left))
            rss = max(rss, _rss_mb(pid))
        span = time.monotonic() - w0
        cpu = 100 * (_cpu_s(pid) - cpu0) / span
        hello_rate = (sum(o.hellos for o in origins) - hellos0) / span
        message_rate = (sum(o.messages for o in origins) - messages0) / span
        failed = [f"{o.name}: {o.failed}" for o in origins if o.failed]
        if failed:
            raise RuntimeError(f"origins failed during the window: {failed[:5]}")
        return {"origins": n, "shadows": SHADOWS, "seconds": round(span, 1), "host_cpu_pct": round(cpu, 3),
                "host_rss_mb": round(rss, 1), "connections": _connections(port), "settled_s": round(settled, 1),
                "hellos_per_s": round(hello_rate, 2), "watch_messages_per_s": round(message_rate, 2)}
    finally:
        stop.set()
        if hellos.is_alive():
            hellos.join(10)
        for o in origins:
            for key in o.keys:
                try:
                    o.client.remove_shadow(o.name, key)
                except WeftError as exc:
                    _say(f"removing {key}: {exc.message}")
            o.close()
        host.stop()


def _figures(runs: list[dict], window: float, fd: tuple[int, int]) -> dict:
    base, top = runs[0], runs[-1]
    ratios = {"host_cpu": round(top["host_cpu_pct"] / base["host_cpu_pct"], 3) if base["host_cpu_pct"] else None,
              "host_rss": round(top["host_rss_mb"] / base["host_rss_mb"], 3), "of": [base["origins"], top["origins"]]}
    targets = {"host_cpu_pct": top["host_cpu_pct"] <= LIMITS["host_cpu_pct"],
               "host_rss_mb": top["host_rss_mb"] <= LIMITS["host_rss_mb"]}
    targets["all"] = all(targets.values())
    mesh = MeshConfig()
    environment = {"window_s": window, "cpu_count": os.cpu_count(), "kernel": platform.release(),
                   "python": sys.version.split()[0], "hello_interval_s": mesh.hello_interval,
                   "heartbeat_interval_s": mesh.heartbeat_interval, "watch_idle_s": WATCH_IDLE_S,
                   "fd_limit": list(fd),
                   "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    return {"runs": runs, "ratios": ratios, "targets": targets, "limits": LIMITS, "environment": environment}


def _table(f: dict) -> str:
    met = {True: "target met", False: "missed"}
    rows = [("origins", "shadows", "host CPU %", "host RSS MB", "connections", "Hellos/s", "Watch msgs/s")]
    rows += [(str(r["origins"]), str(r["shadows"]), f"{r['host_cpu_pct']:.2f}", f"{r['host_rss_mb']:.0f}",
              str(r["connections"]), f"{r['hellos_per_s']:.1f}", f"{r['watch_messages_per_s']:.1f}")
             for r in f["runs"]]
    env = f["environment"]
    lines = [f"weft bench host-scale: one CPU host watched by N origins (Hello every {env['hello_interval_s']:g} s "
             f"until the Watch pushes the host's state, Watch heartbeat after {env['watch_idle_s']:g} s idle), "
             f"{env['cpu_count']} CPUs", ""]
    lines += right_aligned(rows)
    top, lim, t, ra = f["runs"][-1], f["limits"], f["targets"], f["ratios"]
    lines += ["", f"at {top['origins']} origins: host CPU {top['host_cpu_pct']:.2f} % of a core "
              f"(≤ {lim['host_cpu_pct']:g} %: {met[t['host_cpu_pct']]}), RSS {top['host_rss_mb']:.0f} MB "
              f"(≤ {lim['host_rss_mb']:g} MB: {met[t['host_rss_mb']]})",
              f"host CPU {ra['host_cpu']}x, RSS {ra['host_rss']}x ({ra['of'][1]} against {ra['of'][0]} origins)"]
    return "\n".join(lines)


def main(*, as_json: bool, origins: str | None, quick: bool, output: Path | None) -> int:
    ns = parse_counts("--origins", origins, QUICK_ORIGINS if quick else DEFAULT_ORIGINS)
    window = 6.0 if quick else 30.0

    def measure(workdir: Path) -> dict:
        fd = raise_fd_limit()
        ca = generate_ca()
        with Containerd() as containerd:
            runs = [measure_one(n, containerd, workdir, ca, window=window) for n in ns]
        return _figures(runs, window, fd)

    return run_in_scratch("weft-bench-host-scale-", _say, measure, as_json, output, _table)
