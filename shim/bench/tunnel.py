"""``weft bench tunnel``: what TLS costs the stitched network's user-space tunnel, against plaintext.

The data path of a tunnelled port, with weft's own code at both relays: a
client connects to the *origin* relay's mirror listener, which asks the
*host* relay for a grant, dials its tunnel port (``shim.mesh.tunnel.dial``,
TLS with mesh certificates made for the run, or plain) and joins the two
(``Pipe``); the host's ``TunnelServer`` checks the token and joins the
connection to the target. The two relays are processes of their own, as the
two agents are; the clients and the targets (a sink and an echo, as in
``weft bench network``) are this process. Everything is on loopback, so the
figures are the relays' own cost, not a network's.

Each round runs plaintext and TLS one after the other (throughput: ``--gib``
GiB per round, 3 rounds, the median; request/response: one byte each way on
an open connection, interleaved in blocks of 500), with the CPU seconds each
relay spent per GiB. The grant is asked for over a pipe between the relays
instead of the mesh's gRPC: it is paid once per connection, outside what is
timed.

It is a measurement, not a test: the exit code says only whether the run worked.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from shim.bench.network import BUF, _added, _cpu, _echo, _p50_p99, _per_gib, _rr, _serve, _sink, _throughput
from shim.bench.running import report

MODES = ("plain", "tls")


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class _Here:
    """The client side of ``weft bench network``'s measurements, without a namespace."""

    @staticmethod
    def connect(host: str, port: int, timeout: float) -> socket.socket:
        return socket.create_connection((host, port), timeout)


def _host_relay(tls_dir: str, out: Connection, grants: Connection) -> None:
    """The host agent's half: its tunnel port, granting tokens to the origin's requests."""
    from shim import log
    from shim.mesh.tunnel import CONNECT_TIMEOUT_S, TunnelServer

    log.configure("warning")  # on stderr: stdout is the bench's figures

    server = TunnelServer("127.0.0.1", tls_dir, "host")
    server.start()
    out.send((os.getpid(), server.address))
    while True:
        try:
            tls, port = grants.recv()
        except EOFError:
            break
        grants.send(server.grants.add(
            "origin", lambda p=port: socket.create_connection(("127.0.0.1", p), CONNECT_TIMEOUT_S), tls=tls,
            what=f"bench :{port}"))
    server.stop()


def _origin_relay(tls_dir: str, address: str, targets: list[int], out: Connection, grants: Connection) -> None:
    """The origin agent's half: a mirror listener per mode and target, each connection a tunnel to the host."""
    from shim import log
    from shim.mesh.tunnel import Pipe, SocketEnd, contexts, dial, tune

    log.configure("warning")

    client = contexts(tls_dir, "origin")[1]
    lock = threading.Lock()

    def accept(listener: socket.socket, tls: bool, port: int) -> None:
        while True:
            conn, _ = listener.accept()
            tune(conn, tunnel=False)
            with lock:
                grants.send((tls, port))
                token = grants.recv()
            end = dial(address, token, tls=client if tls else None, node="host")
            Pipe(SocketEnd(conn), end, f"bench:{port}").start()

    mirrors: dict[tuple[str, int], int] = {}
    for mode in MODES:
        for port in targets:
            listener = socket.create_server(("127.0.0.1", 0), backlog=64)
            mirrors[(mode, port)] = listener.getsockname()[1]
            threading.Thread(target=accept, args=(listener, mode == "tls", port), daemon=True).start()
    out.send((os.getpid(), mirrors))
    out.recv()  # until the bench is done


def main(*, as_json: bool, gib: float = 1.0, samples: int = 3000, output: Path | None = None) -> int:
    from shim.mesh.certs import write_mesh_certs

    nbytes = int(gib * (1 << 30)) // BUF * BUF
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="weft-bench-tunnel-") as tmp:
        write_mesh_certs(Path(tmp), ["origin", "host"])
        targets = {}
        for name, handler in (("sink", _sink), ("echo", _echo)):
            listener = socket.create_server(("127.0.0.1", 0), backlog=64)
            targets[name] = listener.getsockname()[1]
            threading.Thread(target=_serve, args=(listener, handler), daemon=True).start()
        host_out, host_in = ctx.Pipe()
        origin_out, origin_in = ctx.Pipe()
        grants_host, grants_origin = ctx.Pipe()
        host = ctx.Process(target=_host_relay, args=(tmp, host_in, grants_host), daemon=True)
        host.start()
        host_pid, address = host_out.recv()
        origin = ctx.Process(target=_origin_relay, args=(tmp, address, list(targets.values()), origin_in,
                                                         grants_origin), daemon=True)
        origin.start()
        origin_pid, mirrors = origin_out.recv()
        relays = {"origin": origin_pid, "host": host_pid}
        try:
            _say(f"throughput: 3 rounds of {nbytes / (1 << 30):.2f} GiB per mode, plaintext and TLS in turn")
            tput: dict[str, list[float]] = {m: [] for m in MODES}
            cpu = {m: {r: 0.0 for r in relays} for m in MODES}
            for m in MODES:  # warm up
                _throughput(_Here(), "127.0.0.1", 64 * BUF, port=mirrors[(m, targets["sink"])])
            for _ in range(3):
                for m in MODES:
                    before = {r: _cpu(pid) for r, pid in relays.items()}
                    tput[m].append(_throughput(_Here(), "127.0.0.1", nbytes, port=mirrors[(m, targets["sink"])]))
                    for r, pid in relays.items():
                        cpu[m][r] += _cpu(pid) - before[r]
            _say(f"request/response: {samples} round trips per mode, interleaved in blocks of 500")
            rr: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(max(1, samples // 500)):
                for m in MODES:
                    rr[m] += _rr(_Here(), "127.0.0.1", 500, port=mirrors[(m, targets["echo"])])
        finally:
            origin_out.send("done")
            grants_origin.close()
            grants_host.close()
            for p in (origin, host):
                p.join(5)
                if p.is_alive():
                    p.kill()

    med = {m: statistics.median(v) for m, v in tput.items()}
    figures = {
        "throughput_gbytes_s": {m: round(v, 3) for m, v in med.items()},
        "tls_throughput_ratio": round(med["tls"] / med["plain"], 3),
        "rr_ms": {m: _p50_p99(v) for m, v in rr.items()},
        "tls_added_p50_ms": _added(rr, "tls", "plain", 0.5),
        "relay_cpu_s_per_gib": {m: _per_gib(c, nbytes) for m, c in cpu.items()},
        "gib_per_round": round(nbytes / (1 << 30), 3),
        "round_trips": len(rr["plain"]),
        "load_average": round(os.getloadavg()[0], 2),
    }
    return report(figures, as_json, output, lambda figures: "\n".join([
        f"throughput: plaintext {med['plain']:.2f} GB/s, TLS {med['tls']:.2f} GB/s "
        f"({figures['tls_throughput_ratio']:.0%} of plaintext)",
        f"request/response p50: plaintext {figures['rr_ms']['plain']['p50']:.3f} ms, TLS "
        f"{figures['rr_ms']['tls']['p50']:.3f} ms (TLS adds {figures['tls_added_p50_ms']:.3f} ms); p99 "
        f"{figures['rr_ms']['plain']['p99']:.3f} / {figures['rr_ms']['tls']['p99']:.3f} ms",
        f"relay CPU per GiB: {figures['relay_cpu_s_per_gib']}"]))
