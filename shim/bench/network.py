"""``weft bench network``: the stitched pod network and the exec relay against direct paths.

One :class:`shim.localfabric.fabric.Fabric3`; one opted-in pod on ``gpu-1`` whose
CPU container is rerouted to a host. The bench's own servers (a sink and an
echo, Python, 1 MiB buffers) listen in the *shadow* sandbox's network
namespace; its clients run in the *origin* sandbox's. So the two paths
compared, in one run and interleaved, join the same two namespaces:

- **direct**: the shadow's pod IP, across the nodes' flat pod network (the
  kernel only);
- **stitched**: 127.0.0.1 in the origin pod, carried as the agents chose
  (``stitched_path``): by the kernel straight to the shadow's pod IP where
  the pod network reaches it (nftables rules in the origin pod's namespace),
  else the origin agent's mirror listener, a tunnel to the host agent (TLS
  unless ``mesh.tunnel_tls`` is off),
  127.0.0.1 in the shadow;
- **tunnel**: [::1] in the origin pod, which the user-space tunnel always
  carries: the path the kernel one replaced, measured beside it (where the
  pod has IPv6).

Figures: throughput (``--gib`` GiB per round, 3 rounds each, the median),
request/response latency (one byte each way on an open connection, p50 and
p99, and what the stitch adds), the CPU seconds each agent spent per GiB
(where the time goes), and the exec round trip: one character typed into
``sh`` through a TTY until its echo comes back, on the rerouted container
against a local one, over the WebSocket streaming protocol; and the same on
the shadow through its host's containerd directly, which no relay touches,
so that what the two agents' relays add is shown apart from the rest. The
relays busy-poll after a keystroke (``agent.stream_busy_poll_us``, the
agents' default unless ``--stream-busy-poll-us`` says otherwise; 0 runs the
bench without), and the CPU the two agents spend a keystroke is shown with
it (session setup included).

It is a measurement, not a test: a missed target is printed, and the exit
code says only whether the run worked.
"""

from __future__ import annotations

import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri

from shim.bench.running import report
from shim.config import AgentConfig
from shim.core.stats import percentile
from shim.crishared.netns import Netns, sandbox_netns
from shim.localfabric import pods
from shim.localfabric.fabric import Fabric3
from shim.localfabric.pods import PLACEMENT, cpu_container, create, run_pod, status
from shim.localfabric.streams import ChannelStream
from shim.localfabric.waiting import wait_for

SINK_PORT, ECHO_PORT = 7500, 7501
BUF = 1 << 20
TARGETS = {"throughput_ratio": 0.5, "throughput_ratio_stretch": 0.9, "added_p50_ms": 0.3, "exec_ratio": 1.5,
           "kernel_throughput_ratio": 0.9, "kernel_added_p50_ms": 0.05}


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _serve(listener: socket.socket, handler) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


def _sink(conn: socket.socket) -> None:
    buf = bytearray(BUF)
    with conn:
        while conn.recv_into(buf):
            pass
        conn.sendall(b"k")


def _echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    with conn:
        while data := conn.recv(65536):
            conn.sendall(data)


def _throughput(ns: Netns, host: str, nbytes: int, port: int = SINK_PORT) -> float:
    s = ns.connect(host, port, 10)
    block = memoryview(bytes(BUF))
    t0 = time.perf_counter()
    sent = 0
    while sent < nbytes:
        s.sendall(block)
        sent += BUF
    s.shutdown(socket.SHUT_WR)
    assert s.recv(1) == b"k"
    elapsed = time.perf_counter() - t0
    s.close()
    return nbytes / elapsed / 1e9


def _rr(ns: Netns, host: str, samples: int, port: int = ECHO_PORT) -> list[float]:
    s = ns.connect(host, port, 10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        s.sendall(b"x")
        s.recv(1)
        out.append((time.perf_counter_ns() - t0) / 1e6)
    s.close()
    return out


def _paths_chosen(f: Fabric3) -> dict[str, str] | None:
    """Port -> "kernel" or "tunnel (<reason>)", as the origin agent last logged it, once both ports have one."""
    out: dict[str, str] = {}
    for e in f.agents["gpu-1"].events():
        if e.get("event") == "stitch.path" and e.get("port") in (SINK_PORT, ECHO_PORT):
            out[str(e["port"])] = e["path"] if e["path"] == "kernel" else f"{e['path']} ({e['reason']})"
    return out if len(out) == 2 else None


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q * 100) or 0.0


def _p50_p99(values: list[float], digits: int = 4) -> dict[str, float]:
    return {"p50": round(_pct(values, 0.5), digits), "p99": round(_pct(values, 0.99), digits)}


def _added(rr: dict[str, list[float]], path: str, base: str, q: float) -> float:
    """What ``path`` adds over ``base`` at quantile ``q`` of their round trips (ms)."""
    return round(_pct(rr[path], q) - _pct(rr[base], q), 4)


def _per_gib(cpu_s: dict[str, float], nbytes: int) -> dict[str, float]:
    """CPU seconds per GiB moved, each of the three rounds having moved ``nbytes``."""
    return {k: round(v / (3 * nbytes / (1 << 30)), 3) for k, v in cpu_s.items()}


def _cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _exec_rtt(f: Fabric3, cid: str, samples: int, *, node: str = "gpu-1", direct: bool = False) -> list[float]:
    """Keystroke echo times through ``node``'s weft socket (or its containerd's own, ``direct``)."""
    ch, rt = f.direct(node) if direct else f.runtime(node)
    with ch:
        url = rt.Exec(cri.ExecRequest(container_id=cid, cmd=["sh"], tty=True, stdin=True, stdout=True)).url
    s = ChannelStream(url, str(f.node(node).containerd.netns_path))
    try:
        s.send(0, b"stty -echo 2>/dev/null; stty echo; echo ready\n")
        s.read_until(1, b"ready\r\n")
        out = []
        for i in range(samples):
            ch_ = b"abcdefghij"[i % 10:i % 10 + 1]
            s.out[1] = b""
            t0 = time.perf_counter_ns()
            s.send(0, ch_)
            s.read_until(1, ch_)
            out.append((time.perf_counter_ns() - t0) / 1e6)
        s.send(0, b"\x03exit\n")
    finally:
        s.close()
    return out


def main(*, as_json: bool, gib: float = 1.0, samples: int = 3000, output: Path | None = None,
         busy_poll_us: int | None = None) -> int:
    nbytes = int(gib * (1 << 30)) // BUF * BUF
    with tempfile.TemporaryDirectory(prefix="weft-bench-network-") as tmp, \
            Fabric3(Path(tmp) / "fabric", fence_s=30.0, loss_s=60.0, stream_busy_poll_us=busy_poll_us) as f:
        _say("fabric up; starting the pod")
        sid, sandbox = run_pod(f, "bench")
        remote = create(f, sid, sandbox, cpu_container("cpu", ["sleep", "3600"], memory=128 << 20))
        local = create(f, sid, sandbox, pods.container_config("gpu", ["sleep", "3600"],
                                                            envs={"NVIDIA_VISIBLE_DEVICES": "all"}))
        for cid in (remote, local):
            wait_for(lambda c=cid: status(f, c).state == cri.CONTAINER_RUNNING, what="running")
        host = status(f, remote).annotations[PLACEMENT].removeprefix("remote:")

        def netns_of(node: str, sandbox_id: str) -> str:
            ch, _ = f.direct(node)
            with ch:
                return sandbox_netns(lambda p, r, t: t.FromString(ch.unary_unary(p)(r.SerializeToString(),
                                                                                    timeout=10)), sandbox_id)

        shadow_sid = f.shadows(host)[0].pod_sandbox_id
        ch, rt = f.direct(host)
        with ch:
            shadow_ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=shadow_sid)).status.network.ip
        shadow_ns, origin_ns = Netns(netns_of(host, shadow_sid)), Netns(netns_of("gpu-1", sid), workers=1)
        listeners = [shadow_ns.listen("0.0.0.0", SINK_PORT), shadow_ns.listen("0.0.0.0", ECHO_PORT)]
        for lst, handler in zip(listeners, (_sink, _echo), strict=True):
            threading.Thread(target=_serve, args=(lst, handler), daemon=True).start()
        wait_for(lambda: {SINK_PORT, ECHO_PORT} <= set(origin_ns.listening()), timeout=20,
                 what="the shadow's ports mirrored into the origin pod")
        chosen = wait_for(lambda: _paths_chosen(f), timeout=20, what="the data path of both ports chosen")
        paths = {"direct": shadow_ip, "stitched": "127.0.0.1"}
        try:
            origin_ns.connect("::1", ECHO_PORT, 2).close()
            paths["tunnel"] = "::1"
        except OSError:
            _say("no IPv6 in the origin pod: the tunnel is not measured beside the kernel path")
        agents = {"origin": f.agents["gpu-1"].pid, "host": f.agents[host].pid}

        _say(f"throughput: {3 * len(paths)} rounds of {nbytes / (1 << 30):.2f} GiB")
        tput: dict[str, list[float]] = {p: [] for p in paths}
        cpu = {a: 0.0 for a in agents}
        tunnel_cpu = {a: 0.0 for a in agents}
        _throughput(origin_ns, paths["stitched"], 64 * BUF)  # warm up
        for _ in range(3):
            for name, addr in paths.items():
                before = {a: _cpu(pid) for a, pid in agents.items()}
                tput[name].append(_throughput(origin_ns, addr, nbytes))
                if name in ("stitched", "tunnel"):
                    for a, pid in agents.items():
                        (cpu if name == "stitched" else tunnel_cpu)[a] += _cpu(pid) - before[a]
        _say(f"request/response: {samples} round trips per path, interleaved in blocks of 500")
        rr: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(max(1, samples // 500)):
            for name, addr in paths.items():
                rr[name] += _rr(origin_ns, addr, 500)
        _say("exec round trip through a TTY: rerouted, local, and the shadow on its host's containerd directly "
             "(no relay: what the two agents' relays add is the difference); 200 keystrokes each, twice")
        ch, rt = f.direct(host)
        with ch:
            shadow_cid = rt.ListContainers(cri.ListContainersRequest(
                filter=cri.ContainerFilter(pod_sandbox_id=shadow_sid))).containers[0].id
        ex: dict[str, list[float]] = {"remote": [], "local": [], "shadow_on_host": []}
        exec_cpu = 0.0
        for _ in range(2):
            before = {a: _cpu(pid) for a, pid in agents.items()}
            ex["remote"] += _exec_rtt(f, remote, 200)
            exec_cpu += sum(_cpu(pid) - before[a] for a, pid in agents.items())
            ex["local"] += _exec_rtt(f, local, 200)
            ex["shadow_on_host"] += _exec_rtt(f, shadow_cid, 200, node=host, direct=True)
        for lst in listeners:
            lst.close()
        shadow_ns.close()
        origin_ns.close()

    med = {p: statistics.median(v) for p, v in tput.items()}
    figures = {
        "throughput_gbytes_s": {p: round(v, 3) for p, v in med.items()},
        "throughput_ratio": round(med["stitched"] / med["direct"], 3),
        "rr_ms": {p: _p50_p99(v) for p, v in rr.items()},
        "added_p50_ms": _added(rr, "stitched", "direct", 0.5),
        "added_p99_ms": _added(rr, "stitched", "direct", 0.99),
        "agent_cpu_s_per_gib": _per_gib(cpu, nbytes),
        "exec_rtt_ms": {k: _p50_p99(v, 3) for k, v in ex.items()},
        "exec_ratio": round(_pct(ex["remote"], 0.5) / _pct(ex["local"], 0.5), 3),
        "exec_added_by_relays_ms": round(_pct(ex["remote"], 0.5) - _pct(ex["shadow_on_host"], 0.5), 3),
        "exec_agent_cpu_ms_per_keystroke": round(exec_cpu / len(ex["remote"]) * 1e3, 3),
        "stream_busy_poll_us": AgentConfig().stream_busy_poll_us if busy_poll_us is None else busy_poll_us,
        "targets": TARGETS,
        "stitched_path": chosen,
    }
    if "tunnel" in med:
        figures.update({
            "tunnel_throughput_ratio": round(med["tunnel"] / med["direct"], 3),
            "tunnel_added_p50_ms": _added(rr, "tunnel", "direct", 0.5),
            "agent_cpu_s_per_gib_tunnel": _per_gib(tunnel_cpu, nbytes),
        })

    def table(figures: dict) -> str:
        lines = [f"throughput: direct {med['direct']:.2f} GB/s, stitched {med['stitched']:.2f} GB/s "
                 f"({figures['throughput_ratio']:.0%} of direct; target >= 50%, stretch >= 90%)",
                 f"request/response p50: direct {figures['rr_ms']['direct']['p50']:.3f} ms, stitched "
                 f"{figures['rr_ms']['stitched']['p50']:.3f} ms, added {figures['added_p50_ms']:.3f} ms "
                 f"(target <= 0.3); p99 added {figures['added_p99_ms']:.3f} ms",
                 f"agent CPU per GiB stitched: {figures['agent_cpu_s_per_gib']}",
                 f"stitched path per port: {chosen}; kernel path targets: throughput >= 90% of direct, added p50 <= "
                 f"0.05 ms"]
        if "tunnel" in med:
            lines.append(f"tunnel ([::1], the user-space path) beside it: {med['tunnel']:.2f} GB/s "
                         f"({figures['tunnel_throughput_ratio']:.0%} of direct), added p50 "
                         f"{figures['tunnel_added_p50_ms']:.3f} ms, agent CPU per GiB "
                         f"{figures['agent_cpu_s_per_gib_tunnel']}")
        lines.append(f"exec echo through a TTY p50: rerouted {figures['exec_rtt_ms']['remote']['p50']:.2f} ms, local "
                     f"{figures['exec_rtt_ms']['local']['p50']:.2f} ms ({figures['exec_ratio']:.2f}x; target <= 1.5x); "
                     f"the shadow on its host's containerd directly "
                     f"{figures['exec_rtt_ms']['shadow_on_host']['p50']:.2f} ms "
                     f"(the two relays add {figures['exec_added_by_relays_ms']:.2f} ms); both agents' CPU "
                     f"{figures['exec_agent_cpu_ms_per_keystroke']:.2f} ms a keystroke, busy-polling "
                     f"{figures['stream_busy_poll_us']} us")
        return "\n".join(lines)

    return report(figures, as_json, output, table)
