"""weft beneath Kueue, measured: an opted-in Job beside the same Job not opted in, a preemption, a gang of two.

``python -m bench.kueue [--json] [--output FILE]``, from a checkout after ``scripts/setup.sh`` with the test
cluster's components and Kueue built (``WEFT_SETUP_KUBE=1 scripts/setup.sh``), as root. It runs the scenarios of
``integration/kube/test_kube_kueue.py`` (Kueue's controller manager against a real API server, a GPU node and a
CPU node), so every figure comes with its checks: Kueue books the opted-in Job as the plain one, the shadow is
stopped before the preemptor runs, one workload admits both pods of the gang. The two Jobs are created one after
the other in the same cluster, the ratio between them is of one run. Exit codes as ``weft bench``: 0 measured,
1 a scenario failed (its output is printed), 130 stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shim.bench.checkout.scenarios import gather, run

SCENARIOS = "integration/kube/test_kube_kueue.py"


def measure(say) -> tuple[int, dict | None]:
    code, figures, took = gather(SCENARIOS, None, {"admission", "preemption", "gang"}, say)
    if figures is None:
        return code, None
    a = figures["admission"]
    ratio = round(a["opted in s"] / a["not opted in s"], 2) if a["not opted in s"] else None
    return 0, {"benchmark": "kueue", "when": time.strftime("%Y-%m-%d %H:%M"), "run_s": round(took, 1),
               **figures, "admission_ratio_opted_in_vs_not": ratio}


def _table(f: dict) -> str:
    a, p, g = f["admission"], f["preemption"], f["gang"]
    rows = ["| figure | value |", "| --- | --- |",
            f"| Job created to its CPU stage running: opted in (stage rerouted) / not opted in | "
            f"{a['opted in s']:.1f} s / {a['not opted in s']:.1f} s ({f['admission_ratio_opted_in_vs_not']}x) |",
            f"| Kueue's books for the opted-in Job the same as for the plain one | "
            f"{'yes' if a['booked as without weft'] else 'no'} |",
            f"| preemption: samples with the shadow and the preemptor both running | "
            f"{p['samples overlapping']} of {p['samples']} |",
            f"| preemption: the preemptor running after it was queued | {p['preemptor running after s']:.1f} s |",
            f"| gang: pods / workloads / both stages rerouted and running after | "
            f"{g['pods']} / {g['workloads']} / {g['both stages running after s']:.1f} s |"]
    return "\n".join(rows) + f"\n\nwhole run {f['run_s']:.0f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kueue", description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--output", type=Path, help="also write the JSON here")
    args = ap.parse_args(argv)
    return run("kueue", lambda say: measure(say), args.json, args.output, _table)


if __name__ == "__main__":
    sys.exit(main())
