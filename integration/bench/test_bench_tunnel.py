"""``weft bench tunnel`` runs end to end in its reduced mode (``--quick``) and leaves no relay behind.

A measurement, so this checks that every figure is there and sane (bytes
moved both ways, round trips timed, each relay spent CPU), never how much:
that is the benchmark's to report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_bench_tunnel_quick_has_every_figure_and_leaves_no_relay(tmp_path: Path) -> None:
    out = tmp_path / "tunnel.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "shim", "bench", "tunnel", "--quick", "--json",
                             "--output", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    bench = psutil.Process(proc.pid)
    # By process, not by PID: psutil knows each one by its start time too, so a PID the system hands to
    # another process after a relay exits (PIDs wrap) is not taken for a relay left running.
    relays: dict[int, psutil.Process] = {}
    try:
        while proc.poll() is None and len(relays) < 3:  # the two relays and multiprocessing's resource tracker
            try:
                relays.update({c.pid: c for c in bench.children(recursive=True) if c.pid not in relays})
            except psutil.NoSuchProcess:  # the bench ended between the poll and the look
                break
            time.sleep(0.05)
        stdout, stderr = proc.communicate(timeout=180)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    figures = json.loads(out.read_text())
    assert json.loads(stdout) == figures
    for mode in ("plain", "tls"):
        assert figures["throughput_gbytes_s"][mode] > 0
        assert 0 < figures["rr_ms"][mode]["p50"] <= figures["rr_ms"][mode]["p99"]
        assert all(v > 0 for v in figures["relay_cpu_s_per_gib"][mode].values()), figures
    assert figures["round_trips"] == 500 and figures["gib_per_round"] == 0.25
    tput = figures["throughput_gbytes_s"]
    assert figures["tls_throughput_ratio"] == pytest.approx(tput["tls"] / tput["plain"], abs=0.01)
    assert relays, "the relays were never seen running"
    # multiprocessing's resource tracker (a child too, under "spawn") exits only once the bench has, a moment
    # later: what is left is what still runs after a grace that a relay left behind would outlast.
    _, alive = psutil.wait_procs(list(relays.values()), timeout=10)
    left = [p.pid for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"relays still running: {left}"
