"""A hosted stage preempted, with the reservation's preStop hook and without it, side by side in one run.

``python -m bench.preemption [--rounds 10] [--watch-late S] [--json] [--output FILE]``, from a checkout after
``scripts/setup.sh`` with the test cluster's Kubernetes components built (``WEFT_SETUP_KUBE=1
scripts/setup.sh``), as root. One real cluster (``harness``): an origin ``gpu-1`` and two CPU hosts,
``cpu-1`` whose reservations carry the preStop hook (the default) and ``cpu-2`` whose agent has
``kubernetes.reservation_stop_hook = false``. Each round preempts the stage once on each host, taking turns
(the other host cordoned, so the stage can go only there), with the steps and samples of the test that says
what preemption must do (``harness.preemption``): the preemptor's creation to its container running,
and how long it ran beside the shadow. Exit codes as ``weft bench``: 0 measured, 1 failed, 130/143 stopped.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from harness import preemption
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import apply
from shim.bench.running import guarded, report
from shim.core.stats import percentile
from shim.localfabric.waiting import wait_for

ORIGIN = "gpu-1"
SIDES = {"hook": "cpu-1", "no hook": "cpu-2"}


def _draining_seen(kube: KubeCluster, want: dict[str, bool]) -> bool:
    peers = {p.get("node"): p for p in kube.agent_status(ORIGIN).get("peers", [])}
    return all(n in peers and peers[n].get("healthy") and bool(peers[n].get("draining")) is on
               for n, on in want.items())


def _only(kube: KubeCluster, host: str) -> None:
    """Make ``host`` the only CPU host that takes stages: the other cordoned, and the origin seeing both so."""
    for side_host in SIDES.values():
        kube.kubectl("uncordon" if side_host == host else "cordon", side_host)
    want = {h: h != host for h in SIDES.values()}
    wait_for(lambda: _draining_seen(kube, want), timeout=60, what=f"{ORIGIN} to see only {host} taking stages",
             every=0.2)


def measure(rounds: int, watch_late: float, say) -> dict:
    seen: dict[str, list[preemption.Preemption]] = {side: [] for side in SIDES}
    specs = [NodeSpec(ORIGIN, "gpu"), *(NodeSpec(h, "cpu") for h in SIDES.values())]
    # A host whose watch of its reservations acts late, as a loaded one may: what the hook is for.
    env = {"WEFT_FAILPOINT_DELAYS": f"reservation.lost_seen={watch_late:g}"} if watch_late else {}
    with tempfile.TemporaryDirectory(prefix="weft-bench-preemption-") as tmp, \
            KubeCluster(Path(tmp), specs, agent_api=True, agent_env=env,
                        agent_kubernetes={SIDES["no hook"]: {"reservation_stop_hook": False}}) as kube:
        say(kube.report())
        apply(kube, *preemption.PRIORITY_CLASSES)
        for i in range(rounds):
            order = list(SIDES) if i % 2 == 0 else list(reversed(SIDES))
            for side in order:
                host = SIDES[side]
                _only(kube, host)
                p = preemption.preempt(kube, ORIGIN, host, i)
                seen[side].append(p)
                say(f"round {i + 1} {side}: preemptor running after {p.wait_s:.2f} s, beside the shadow "
                    f"{p.overlap_s * 1000:.0f} ms ({p.overlap_samples} samples), reason {p.reason or '-'}")
    return _figures(seen, rounds, watch_late)


def _figures(seen: dict[str, list[preemption.Preemption]], rounds: int, watch_late: float) -> dict:
    sides = {}
    for side, runs in seen.items():
        waits = [p.wait_s for p in runs]
        overlaps = [p.overlap_s for p in runs]
        sides[side] = {
            "host": SIDES[side],
            "preemptions": len(runs),
            "stop_hook_on_reservation": sum(p.stop_hook for p in runs),
            "wait_p50_s": round(percentile(waits, 50) or 0, 3),
            "wait_max_s": round(max(waits), 3),
            "overlapping_preemptions": sum(p.overlap_samples > 0 for p in runs),
            "overlap_total_ms": round(sum(overlaps) * 1000),
            "overlap_max_ms": round(max(overlaps) * 1000),
            "shadow_stopped_first": sum(p.shadow_stopped_first for p in runs),
            "most_live_copies": max(p.most_copies for p in runs),
            "reasons": sorted({p.reason for p in runs}),
            "runs": [{k: v for k, v in asdict(p).items() if k != "placed_again"} for p in runs],
        }
    hook, bare = sides["hook"], sides["no hook"]
    return {"benchmark": "preemption", "when": time.strftime("%Y-%m-%d %H:%M"), "rounds": rounds,
            "host_watch_late_s": watch_late, "sides": sides,
            "wait_p50_ratio_hook_vs_none": round(hook["wait_p50_s"] / bare["wait_p50_s"], 2)
            if bare["wait_p50_s"] else None}


def _table(f: dict) -> str:
    rows = ["| figure | with the preStop hook | without |",
            "| --- | --- | --- |"]
    h, n = f["sides"]["hook"], f["sides"]["no hook"]
    rows += [
        f"| preemptions | {h['preemptions']} | {n['preemptions']} |",
        f"| preemptor created to its container running, p50 / max | {h['wait_p50_s']:.2f} / {h['wait_max_s']:.2f} s"
        f" | {n['wait_p50_s']:.2f} / {n['wait_max_s']:.2f} s |",
        f"| preemptions where the preemptor ran beside the shadow | {h['overlapping_preemptions']} "
        f"| {n['overlapping_preemptions']} |",
        f"| time beside the shadow, total / longest | {h['overlap_total_ms']} / {h['overlap_max_ms']} ms "
        f"| {n['overlap_total_ms']} / {n['overlap_max_ms']} ms |",
        f"| shadow seen stopped before the preemptor ran | {h['shadow_stopped_first']} "
        f"| {n['shadow_stopped_first']} |",
        f"| most live copies of the stage | {h['most_live_copies']} | {n['most_live_copies']} |",
        f"| the stage's reason on its origin | {', '.join(h['reasons'])} | {', '.join(n['reasons'])} |",
    ]
    ratio = f["wait_p50_ratio_hook_vs_none"]
    target = "0 ms beside the shadow with the hook: " + ("met" if h["overlap_total_ms"] == 0 else "missed")
    return "\n".join(rows) + f"\n\np50 wait with the hook / without: {ratio}x; {target}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.preemption", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="preemptions on each side (default 10)")
    ap.add_argument("--watch-late", type=float, default=0.0, metavar="S",
                    help="the hosts' watch acts on a lost reservation S seconds late, as a loaded host's may "
                         "(a failpoint delay; default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds: at least 1")
    if args.watch_late < 0:
        ap.error("--watch-late: not negative")

    def say(line: str) -> None:
        print(f"[preemption] {line}", file=sys.stderr, flush=True)

    code, figures = guarded(say, lambda: measure(args.rounds, args.watch_late, say))
    if figures is None:
        return code
    return report(figures, args.json, args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
