"""A hosted stage's CPU rate under contention from the host's own pods: before, after, and as a local pod.

The kernel's CPU scheduler, on a cgroup tree laid out as kubelet lays out a
node: ``kubepods`` weighs the node's allocatable CPU, a pod of the host's own
inside it requests the rest of the node and keeps every CPU busy. Beside
``kubepods`` sits the cgroup every shadow shares. The stage (one busy process
per CPU, requesting ``--stage-millis``) runs three ways, interleaved, each for
a few seconds while the host's pod competes:

- ``local``: as a pod of that request inside ``kubepods`` (what it would get
  on a node of its own, the yardstick);
- ``before``: as a shadow was made before reservations, at the lowest weight
  (cpu.shares 2) in the shadows' cgroup left at the default weight;
- ``after``: at the weight of its request, in the shadows' cgroup weighed by
  ``shim.core.reservation.group_shares`` (as the host agent writes it).

What is measured is the CPU time the stage's processes got (/proc), as
cores. Needs root and a cgroup hierarchy with the CPU
controller; the scratch cgroups are removed at the end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from shim.bench.running import run
from shim.core.reservation import cpu_shares, group_shares, weight_of_shares
from shim.core.stats import percentile

ROOT = Path("/sys/fs/cgroup")
BURN = "while :; do :; done"


class Tree:
    """Scratch cgroups under the CPU controller (v1 ``cpu,cpuacct``, or v2 with ``+cpu`` delegated)."""

    def __init__(self, name: str) -> None:
        self.v2 = (ROOT / "cgroup.controllers").exists()
        self.base = (ROOT if self.v2 else ROOT / "cpu") / name
        self.made: list[Path] = []
        self.procs: list[tuple[subprocess.Popen, Path]] = []

    def make(self, rel: str, shares: int | None = None) -> Path:
        d = self.base.parent
        for part in (self.base.name, *Path(rel).parts):
            if self.v2:  # the CPU controller down to the new cgroup (none of these holds a process)
                (d / "cgroup.subtree_control").write_text("+cpu")
            d = d / part
            if not d.exists():
                d.mkdir()
                self.made.append(d)
        if shares is not None:
            self.weigh(d, shares)
        return d

    def weigh(self, d: Path, shares: int) -> None:
        if self.v2:
            (d / "cpu.weight").write_text(str(weight_of_shares(shares)))
        else:
            (d / "cpu.shares").write_text(str(shares))

    def burn(self, d: Path, n: int) -> None:
        for _ in range(n):
            p = subprocess.Popen(["sh", "-c", BURN], start_new_session=True)
            (d / "cgroup.procs").write_text(str(p.pid))
            self.procs.append((p, d))

    def stop(self, d: Path | None = None) -> None:
        for p, where in list(self.procs):
            if d is None or where == d:
                p.send_signal(signal.SIGKILL)
                p.wait()
                self.procs.remove((p, where))

    def usage_ns(self, d: Path) -> int:
        """CPU time of the busy processes in ``d``, from /proc (whatever the controllers' layout)."""
        total = 0
        for p, where in self.procs:
            if where == d:
                fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
        return total * 1_000_000_000 // os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        self.stop()
        for d in reversed(self.made):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)


def measure(seconds: float = 4.0, rounds: int = 2, stage_millis: int = 500) -> dict:
    cpus = os.cpu_count() or 1
    allocatable = cpus * 1000
    pod_millis = max(allocatable - stage_millis, 100)
    rates: dict[str, list[float]] = {"local": [], "before": [], "after": []}
    with ExitStack() as stack:
        tree = Tree(f"weft-bench-hosted-cpu-{os.getpid()}")
        stack.callback(tree.close)
        tree.make("kubepods", cpu_shares(allocatable))
        host_pod = tree.make("kubepods/pod-host", cpu_shares(pod_millis))
        local = tree.make("kubepods/pod-stage", cpu_shares(stage_millis))
        shadows = tree.make("shadows")
        shadow = tree.make("shadows/stage")
        tree.burn(host_pod, cpus)  # the host's own pod keeps every CPU busy throughout
        for _ in range(rounds):
            for mode in rates:
                if mode == "local":
                    where = local
                else:
                    where = shadow
                    if mode == "before":
                        tree.weigh(shadows, 1024)  # the default weight: nothing wrote it
                        tree.weigh(shadow, 2)
                    else:
                        tree.weigh(shadow, cpu_shares(stage_millis))
                        tree.weigh(shadows, group_shares([cpu_shares(stage_millis)]))
                tree.burn(where, cpus)
                time.sleep(0.5)  # let the scheduler settle
                used, began = tree.usage_ns(where), time.monotonic()
                time.sleep(seconds)
                rates[mode].append((tree.usage_ns(where) - used) / 1e9 / (time.monotonic() - began))
                tree.stop(where)
        v2 = tree.v2
    cores = {mode: round(percentile(v, 50) or 0.0, 3) for mode, v in rates.items()}
    return {
        "cpus": cpus, "stage_millis": stage_millis, "host_pod_millis": pod_millis, "seconds": seconds,
        "rounds": rounds, "cgroup": "v2" if v2 else "v1", "cores": cores,
        "after_over_local": round(cores["after"] / cores["local"], 3) if cores["local"] else None,
        "before_over_local": round(cores["before"] / cores["local"], 3) if cores["local"] else None,
    }


def _table(f: dict) -> str:
    c = f["cores"]
    return "\n".join([
        f"hosted stage requesting {f['stage_millis']}m on {f['cpus']} CPUs, the host's pod requesting "
        f"{f['host_pod_millis']}m and busy ({f['cgroup']}, {f['rounds']} x {f['seconds']:g} s each):",
        f"  as a local pod  {c['local']:.3f} cores",
        f"  before          {c['before']:.3f} cores  ({f['before_over_local']}x local)",
        f"  after           {c['after']:.3f} cores  ({f['after_over_local']}x local)",
    ])


def main(as_json: bool = False, quick: bool = False, stage_millis: int = 500, output: Path | None = None) -> int:
    return run(lambda m: print(m, file=sys.stderr),
               lambda: measure(seconds=1.5 if quick else 4.0, rounds=1 if quick else 2, stage_millis=stage_millis),
               as_json, output, _table)
