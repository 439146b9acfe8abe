"""``weft bench mesh-scale`` runs end to end in its reduced mode (``--quick``).

A measurement, so this checks that every figure is there and sane (the agent
measured, the peers reached, every placement on a peer, the agent's Hellos
bounded whatever the fleet), never how fast anything was. It runs the CLI
as a subprocess, as a platform engineer would.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shim", "bench", "mesh-scale", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"weft bench mesh-scale did not finish within {timeout:g} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _positive(value: float, what: str) -> None:
    assert isinstance(value, int | float) and math.isfinite(value) and value > 0, (what, value)


def test_bench_mesh_scale_quick_has_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "mesh-scale.json"
    res = _run("--quick", "--json", "--peers", "10,60", "--output", str(out))
    figures = json.loads(res.stdout)  # stdout holds the JSON object and nothing else
    assert json.loads(out.read_text()) == figures

    runs = figures["runs"]
    assert [r["peers"] for r in runs] == [10, 60]
    for r in runs:
        assert r["agent_cpu_pct"] >= 0, r
        _positive(r["agent_rss_mb"], "RSS")
        _positive(r["control_bytes_per_s"], "control bytes")
        assert r["calls_per_s"].get("Hello", 0) > 0, r
        p = r["placement"]
        _positive(p["p50_ms"], "placement p50")
        assert p["n"] == 5 and p["p95_ms"] >= p["p50_ms"]
        assert r["placement_hosts"] >= 1
    # A small fleet is said Hello to whole; a larger one only in part: no more connections than the bound.
    assert runs[0]["connections"] == 10
    assert runs[1]["connections"] <= 16 + 1
    _positive(figures["ratios"]["placement_p50"], "placement ratio")
    assert figures["ratios"]["of"] == [10, 60]
    assert set(figures["targets"]) == {"agent_cpu_pct", "agent_rss_mb", "placement_p50_ratio", "all"}


def test_bench_mesh_scale_refuses_a_bad_fleet_size() -> None:
    argv = [sys.executable, "-m", "shim", "bench", "mesh-scale", "--peers", "many"]
    res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "--peers" in res.stderr
