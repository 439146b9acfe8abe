"""``weft bench broker``: Acquire latency over gRPC on a busy node, as the agent sees it.

The agent calls Acquire inside CreateContainer, so its latency lands directly
on a GPU container's start; what drives it is how many leases the broker
already holds (packing walks them all and every lease is a row in its SQLite
store). This starts a real ``weft broker`` with 8 simulated 80 GiB GPUs,
fills it with 64 live shared leases (5 GiB and 10 % compute each, pinned
8 to a device so the node is evenly busy), then times ``samples`` cycles of
one more 1 GiB / 10 % lease that may go on any device: its Acquire, its
Release, and a List of the 64 (what ``weft status`` and the agent's
reconcile pay). Each cycle uses a fresh key, so no Acquire is answered from
the idempotency lookup alone. Calls go through the generated stub, protobuf
work included, as the agent makes them.

It reports figures and whether they meet weft's target; it is a
measurement, not a test, so a missed target does not change the exit code.
"""

from __future__ import annotations

import gc
import os
import sys
import time
from pathlib import Path

import grpc
import psutil

from shim._pb import broker_pb2 as pb
from shim._pb import broker_pb2_grpc as pb_grpc
from shim.bench.running import labelled, run_in_scratch, summary, targets_met
from shim.errors import WeftError
from shim.localfabric.broker import BrokerProcess

LIMITS = {"acquire_p99_ms": 2.0}
DEVICES = "8x80GiB"
LIVE_LEASES = 64
LIVE_BYTES = 5 << 30
PROBE_BYTES = 1 << 30
COMPUTE_PERCENT = 10
RPC_TIMEOUT = 10.0
MB = 1024 * 1024
GI = 1 << 30


def _say(msg: str) -> None:
    # stdout is reserved for the figures (one JSON object with --json).
    print(f"weft bench broker: {msg}", file=sys.stderr, flush=True)


def _fill(stub: pb_grpc.BrokerStub) -> list[str]:
    """The 64 live leases, 8 pinned to each device; returns the devices' UUIDs."""
    uuids = [d.uuid for d in sorted(stub.Devices(pb.DevicesRequest(), timeout=RPC_TIMEOUT).devices,
                                    key=lambda d: d.index)]
    for i in range(LIVE_LEASES):
        stub.Acquire(pb.AcquireRequest(
            key=f"bench-broker/live/{i}", namespace="bench", pod=f"live-{i}", container="main",
            sandbox_id=f"bench-live-{i}", memory_bytes=LIVE_BYTES, compute_percent=COMPUTE_PERCENT,
            allowed_uuids=[uuids[i % len(uuids)]]), timeout=RPC_TIMEOUT)
    return uuids


def _cycles(stub: pb_grpc.BrokerStub, samples: int, warmup: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {"acquire": [], "release": [], "list": []}
    # A collection pause inside one timed call would be charged to the broker.
    gc.disable()
    try:
        for i in range(warmup + samples):
            request = pb.AcquireRequest(
                key=f"bench-broker/probe/{i}", namespace="bench", pod=f"probe-{i}", container="main",
                sandbox_id=f"bench-probe-{i}", memory_bytes=PROBE_BYTES, compute_percent=COMPUTE_PERCENT)
            t0 = time.perf_counter_ns()
            lease = stub.Acquire(request, timeout=RPC_TIMEOUT)
            t1 = time.perf_counter_ns()
            released = stub.Release(pb.ReleaseRequest(lease_id=lease.lease_id, reason="bench"), timeout=RPC_TIMEOUT)
            t2 = time.perf_counter_ns()
            listed = stub.List(pb.ListRequest(), timeout=RPC_TIMEOUT)
            t3 = time.perf_counter_ns()
            if not lease.shared or not released.released or len(listed.leases) != LIVE_LEASES:
                raise RuntimeError(f"cycle {i}: lease {lease.lease_id} shared={lease.shared}, "
                                   f"released={released.released}, List shows {len(listed.leases)} leases "
                                   f"(expected {LIVE_LEASES})")
            if i >= warmup:
                out["acquire"].append(t1 - t0)
                out["release"].append(t2 - t1)
                out["list"].append(t3 - t2)
            if i % 500 == 499:
                _say(f"{i + 1 - warmup if i >= warmup else 0} of {samples} cycles")
    finally:
        gc.enable()
    return out


def _measure(samples: int, warmup: int, workdir: Path) -> dict:
    broker = BrokerProcess(workdir / "broker", devices=DEVICES)
    try:
        broker.start()
        assert broker.proc is not None
        proc = psutil.Process(broker.proc.pid)
        rss_start = proc.memory_info().rss
        ch, stub = broker.stub()
        with ch:
            _say(f"filling the broker with {LIVE_LEASES} shared leases on {DEVICES}")
            _fill(stub)
            rss_filled = proc.memory_info().rss
            _say(f"{samples} Acquire/Release/List cycles after {warmup} warm-up")
            t0 = time.monotonic()
            times = _cycles(stub, samples, warmup)
            wall = time.monotonic() - t0
            rss_after = proc.memory_info().rss
            devices = stub.Devices(pb.DevicesRequest(), timeout=RPC_TIMEOUT).devices
        cpu = proc.cpu_times()
    finally:
        broker.stop()
    return {"times": times, "rss": (rss_start, rss_filled, rss_after), "wall": wall,
            "cpu_seconds": cpu.user + cpu.system, "devices": devices}


def _figures(raw: dict, samples: int, warmup: int, workdir: str) -> dict:
    acquire, release, listing = (summary(raw["times"][k]) for k in ("acquire", "release", "list"))
    listing["leases"] = LIVE_LEASES
    rss_start, rss_filled, rss_after = raw["rss"]
    targets = {"acquire_p99": acquire["p99_ms"] <= LIMITS["acquire_p99_ms"]}
    targets["all"] = all(targets.values())
    return {
        "acquire": acquire, "release": release, "list": listing,
        "broker": {"rss_start_mb": round(rss_start / MB, 2), "rss_filled_mb": round(rss_filled / MB, 2),
                   "rss_after_mb": round(rss_after / MB, 2), "cpu_seconds": round(raw["cpu_seconds"], 2),
                   "cycles_seconds": round(raw["wall"], 2)},
        "devices": [{"index": d.index, "leases": d.leases, "memory_leased_gib": round(d.memory_leased / GI, 2),
                     "compute_leased_percent": d.compute_leased} for d in raw["devices"]],
        "targets": targets, "limits": LIMITS,
        "environment": {
            "samples": samples, "warmup": warmup, "live_leases": LIVE_LEASES, "simulated_devices": DEVICES,
            "live_lease_bytes": LIVE_BYTES, "probe_lease_bytes": PROBE_BYTES, "compute_percent": COMPUTE_PERCENT,
            "cpu_count": os.cpu_count(), "python": sys.version.split()[0], "grpcio": grpc.__version__,
            "workdir": workdir,
        },
    }


# -- output --------------------------------------------------------------------
def _table(f: dict) -> str:
    ok = {True: "✓", False: "✗"}
    t, env, b = f["targets"], f["environment"], f["broker"]
    rows = [("call (gRPC, 64 live leases)", "p50 ms", "p99 ms", "max ms", "target", "")]
    rows.append(("Acquire 1 GiB / 10 %", f"{f['acquire']['p50_ms']:.3f}", f"{f['acquire']['p99_ms']:.3f}",
                 f"{f['acquire']['max_ms']:.3f}", f"p99 ≤ {LIMITS['acquire_p99_ms']:g} ms", ok[t["acquire_p99"]]))
    for label, key in (("Release", "release"), (f"List ({LIVE_LEASES} leases)", "list")):
        s = f[key]
        rows.append((label, f"{s['p50_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['max_ms']:.3f}", "reference", ""))
    lines = [f"weft bench broker: {env['samples']} cycles after {env['warmup']} warm-up, {LIVE_LEASES} live leases "
             f"on {env['simulated_devices']} (simulated), grpcio {env['grpcio']}, {env['cpu_count']} CPUs", ""]
    lines += labelled(rows)
    per_device = ", ".join(f"{d['leases']}" for d in f["devices"])
    lines += ["", f"leases per device at the end: {per_device}",
              f"broker RSS: {b['rss_start_mb']:.1f} MB at start, {b['rss_filled_mb']:.1f} MB with {LIVE_LEASES} "
              f"leases, {b['rss_after_mb']:.1f} MB after the run; {b['cpu_seconds']:.1f} s CPU in all",
              targets_met(t)]
    return "\n".join(lines)


def main(*, as_json: bool, samples: int = 2000, output: Path | None = None) -> int:
    if samples < 10:
        raise WeftError("need --samples >= 10")
    warmup = min(100, max(10, samples // 10))

    def measure(workdir: Path) -> dict:
        _say(f"broker and work files in {workdir}")
        return _figures(_measure(samples, warmup, workdir), samples, warmup, str(workdir))

    return run_in_scratch("weft-bench-broker-", _say, measure, as_json, output, _table)
