"""``weft bench hosted-cpu`` runs end to end in its reduced mode (``--quick``) and leaves no cgroup behind.

A measurement, so this checks that every figure is there and sane (each way
of running the stage got CPU time, no more than the machine has), never how
much: that is the benchmark's to report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CGROUPS = Path("/sys/fs/cgroup")

pytestmark = pytest.mark.slow


def _scratch() -> list[str]:
    base = CGROUPS if (CGROUPS / "cgroup.controllers").exists() else CGROUPS / "cpu"
    return sorted(p.name for p in base.glob("weft-bench-hosted-cpu-*"))


def test_bench_hosted_cpu_quick_has_every_figure_and_leaves_no_cgroup(tmp_path: Path) -> None:
    before = _scratch()
    out = tmp_path / "hosted-cpu.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "shim", "bench", "hosted-cpu", "--quick", "--json",
                           "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert json.loads(proc.stdout) == figures
    cpus = os.cpu_count() or 1
    for mode in ("local", "before", "after"):
        assert 0 < figures["cores"][mode] <= cpus * 1.05, figures
    assert figures["after_over_local"] > 0 and figures["before_over_local"] > 0
    assert _scratch() == before  # every scratch cgroup removed, and no busy process left in one
