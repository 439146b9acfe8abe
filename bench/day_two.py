"""Day two on a cluster of real nodes, measured: a rolling upgrade and its rollback, a drain, two reboots.

``python -m bench.day_two [--json] [--output FILE]``, from a checkout after ``scripts/setup.sh`` with the test
cluster's components built (``WEFT_SETUP_KUBE=1 scripts/setup.sh``), as root. It runs the scenarios of
``integration/nodes/test_kube_day_one.py`` that do these things (the nodes booted under systemd-nspawn, weft
installed from its image and manifests, a two-stage pod with its CPU stage rerouted), so every figure comes
with the checks that the operation did what it must: no container restarted, one copy of the stage, its log
whole. The scenarios write their figures as values (``integration.harness.fixture.report``); this gathers them.
There is no other side to take turns with: each figure is a duration of one operation on this machine.
Exit codes as ``weft bench``: 0 measured, 1 a scenario failed (its output is printed), 130/143 stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from integration.harness.fixture import BENCH_FIGURES_ENV
from shim.bench.running import report

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = "integration/nodes/test_kube_day_one.py"
# The tests whose figures these are: upgrade and rollback, reboot of the stage's host and of the GPU node, drain.
SELECT = "upgrades_and_rolls_back or rebooted_cpu_host or kubectl_drain_of_the_stages_host"


def measure(say) -> tuple[int, dict | None]:
    with tempfile.TemporaryDirectory(prefix="weft-bench-day-two-") as tmp:
        out = Path(tmp) / "figures.jsonl"
        env = {**os.environ, BENCH_FIGURES_ENV: str(out)}
        started = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-q",
                              "-rA", SCENARIOS, "-k", SELECT], cwd=REPO, env=env, capture_output=True, text=True)
        took = time.monotonic() - started
        if run.returncode != 0:
            say(f"a scenario failed (pytest exit {run.returncode}):\n{run.stdout[-8000:]}\n{run.stderr[-2000:]}")
            return 1, None
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    figures: dict = {}
    for r in records:
        say(r["line"])
        figures.update(r["figures"])
    missing = {"upgrade", "rollback", "reboot", "drain"} - set(figures)
    if missing:
        say(f"the scenarios ran but reported no {', '.join(sorted(missing))}")
        return 1, None
    return 0, {"benchmark": "day-two", "when": time.strftime("%Y-%m-%d %H:%M"), "run_s": round(took, 1),
               **_rounded(figures)}


def _rounded(value):
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def _table(f: dict) -> str:
    rows = ["| figure | value |", "| --- | --- |"]
    for what in ("upgrade", "rollback"):
        roll = f[what]
        nodes = sorted((k.removeprefix("switched ") for k in roll if k.startswith("switched ")),
                       key=lambda n: roll[f"switched {n}"])  # in the order the DaemonSet took them
        rows.append(f"| {what}: the DaemonSet's rollout, all nodes | {roll['rollout']:.1f} s |")
        rows += [f"| {what}: {n}'s agent new, after the rollout began / its downtime | "
                 f"{roll[f'switched {n}']:.1f} s / {roll[f'agent down {n}']:.1f} s |" for n in nodes]
    rows += [
        f"| containers of the running pod restarted by upgrade and rollback | {f['containers restarted']} |",
        f"| copies of the rerouted stage, most at once ({f['stage copies sampled']} samples) | "
        f"{f['most stage copies']} |",
        f"| the stage's log lines lost or doubled (of {f['stage log lines']}) | "
        f"{f['stage log lines lost or doubled']} |",
        f"| a two-stage pod created during the upgrade: its CPU stage ran on | "
        f"{f['pod created during the upgrade, its stage on']} |",
    ]
    d = f["drain"]
    budget = d["stage budget gone after the workload's s"]
    rows += [
        f"| `kubectl drain {d['drained host']}`, the workload's budget gone to the stage budget gone | "
        f"{budget:.1f} s |",
        f"| `kubectl drain {d['drained host']}` (its reservation evicted) | {d['kubectl drain s']:.1f} s |",
        f"| drain done to the stage running on {d['stage moved to']} | "
        f"{d['stage running elsewhere after the drain s']:.1f} s |",
    ]
    r = f["reboot"]
    for node in (r["stage host"], "gpu-1"):
        rows.append(f"| reboot of {node}: clean poweroff to the node Ready / to the pod Ready | "
                    f"{r[f'{node} Ready']:.1f} s / {r[f'{node} pod Ready']:.1f} s |")
    rows.append(f"| copies of the stage across the reboots, most at once | {r['most stage copies']} |")
    return "\n".join(rows) + f"\n\nwhole run {f['run_s']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.day_two", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)

    def say(line: str) -> None:
        print(f"[day-two] {line}", file=sys.stderr, flush=True)

    try:
        code, figures = measure(say)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    if figures is None:
        return code
    return report(figures, args.json, args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
