"""Day two on a cluster of real nodes, measured: a rolling upgrade and its rollback, a drain, two reboots.

``python -m bench.day_two [--rounds N] [--load CPUS] [--json] [--output FILE]``, from a checkout after
``scripts/setup.sh`` with the test cluster's components built (``WEFT_SETUP_KUBE=1 scripts/setup.sh``), as
root (``WEFT_KUBE=next``: on the newest Kubernetes release, ``components/next``). It runs the scenarios of
``integration/nodes/test_kube_day_one.py`` that do these things (the nodes booted under systemd-nspawn, weft
installed from its image and manifests, a two-stage pod with its CPU stage rerouted), so every figure comes
with the checks that the operation did what it must: no container restarted, one copy of the stage, its log
whole; and NVIDIA's toolkit installed after weft as the GPU Operator installs it, its containerd restart beside
weft's pods. The scenarios write their figures as values (``harness.fixture.report``); this gathers
them (``scenarios``). ``--rounds N`` upgrades and rolls back N times in a row in the one cluster;
``--load CPUS`` runs ``stress-ng --cpu CPUS`` beside the whole run, as a node busy with its pods is.
There is no other side to take turns with: each figure is a duration of one operation on this machine.
Exit codes as ``weft bench``: 0 measured, 1 a scenario failed (its output is printed), 130/143 stopped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness import binaries
from harness.fixture import ROUNDS_ENV
from shim.bench.checkout.scenarios import gather, run

SCENARIOS = "integration/nodes/test_kube_day_one.py"
# The tests whose figures these are: upgrade and rollback, reboot of the stage's host and of the GPU node, drain,
# and NVIDIA's toolkit installed after weft (its containerd restart beside weft's pods).
SELECT = ("upgrades_and_rolls_back or rebooted_cpu_host or kubectl_drain_of_the_stages_host "
          "or nvidia_s_toolkit_installed_after_weft")


def measure(say, rounds: int = 1, load: int = 0) -> tuple[int, dict | None]:
    os.environ[ROUNDS_ENV] = str(rounds)
    with Load(load) as busy:
        code, figures, took = gather(SCENARIOS, SELECT, {"upgrade", "rollback", "reboot", "drain", "toolkit"}, say)
    if figures is None:
        return code, None
    return 0, {"benchmark": "day-two", "when": time.strftime("%Y-%m-%d %H:%M"), "run_s": round(took, 1),
               "kubelet": _kubelet_version(), "load": {"stress-ng cpu workers": load, **busy.figures()},
               **figures}


def _kubelet_version() -> str:
    said = subprocess.run([binaries.binary("kubelet"), "--version"], capture_output=True, text=True)
    return said.stdout.strip().removeprefix("Kubernetes ")


class Load:
    """``stress-ng --cpu N`` beside the run (a node busy with its pods), and the machine's load average sampled."""

    def __init__(self, cpus: int) -> None:
        self.cpus, self.proc, self.samples = cpus, None, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(5):
            self.samples.append(os.getloadavg()[0])

    def figures(self) -> dict:
        return {"load average 1 min, least": min(self.samples, default=0.0),
                "load average 1 min, most": max(self.samples, default=0.0), "cpus": os.cpu_count()}

    def __enter__(self) -> Load:
        if self.cpus:
            if shutil.which("stress-ng") is None:
                raise SystemExit("--load needs stress-ng (apt-get install stress-ng)")
            self.proc = subprocess.Popen(["stress-ng", "--cpu", str(self.cpus), "--quiet"],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(30)


def _table(f: dict) -> str:
    rows = ["| figure | value |", "| --- | --- |", f"| kubelet and API server | {f['kubelet']} |"]
    busy = f["load"]
    if busy["stress-ng cpu workers"]:
        rows.append(f"| load beside the run: `stress-ng --cpu {busy['stress-ng cpu workers']}` on {busy['cpus']} "
                    f"CPUs, load average | {busy['load average 1 min, least']:.1f} to "
                    f"{busy['load average 1 min, most']:.1f} |")
    rows.append(f"| rounds of upgrade and roll-back | {f['rounds']} |")
    for what, most in f["agent down most"].items():
        rows.append(f"| {what}: each node's agent down, the longest of the rounds | "
                    + ", ".join(f"{n} {v:.1f} s" for n, v in sorted(most.items())) + " |")
    rows.append("| containers restarted / reservations replaced, all rounds | "
                f"{f['containers restarted']} / {f['reservations replaced']} |")
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
        rows.append(f"| reboot of {node}: its clean poweroff (systemd told to power off, to its end) | "
                    f"{r[f'{node} poweroff']:.1f} s |")
        rows.append(f"| reboot of {node}: clean poweroff to the node Ready / to the pod Ready | "
                    f"{r[f'{node} Ready']:.1f} s / {r[f'{node} pod Ready']:.1f} s |")
    rows.append(f"| copies of the stage across the reboots, most at once | {r['most stage copies']} |")
    t = f["toolkit"]
    rows.append(f"| NVIDIA's toolkit installed after weft: its installer on gpu-1 / cpu-1 | "
                f"{t['installer gpu-1 s']:.1f} s / {t['installer cpu-1 s']:.1f} s |")
    rows += [f"| NVIDIA's toolkit installed after weft: {k.removesuffix(' s')} | {v:.1f} s |"
             for k, v in sorted(t.items()) if k.startswith(("containerd down", "kubelet down"))]
    rows += [f"| NVIDIA's toolkit installed after weft: containers restarted | {t['containers restarted']} |",
             f"| a rewrite of containerd's config without weft's import, said on weft's pod after | "
             f"{t['rewrite said after s']:.1f} s |"]
    return "\n".join(rows) + f"\n\nwhole run {f['run_s']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.day_two", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=1, help="upgrade and roll-back rounds in a row (default 1)")
    ap.add_argument("--load", type=int, default=0, metavar="CPUS",
                    help="run stress-ng --cpu CPUS beside (default none)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    return run("day-two", lambda say: measure(say, args.rounds, args.load), args.json, args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
