"""``weft bench hook --json`` and ``weft bench broker --json`` run end to end and clean up after themselves.

Both benchmarks start a real ``weft broker`` (simulated GPUs) in a temporary
directory. These tests check the figures' shape and that they are sane, never
how fast anything was: timing thresholds would only measure how busy the test
machine is. They run the CLI as a subprocess, as a platform engineer would,
then look for a broker (or anything else) still running from the bench's work
directory, and for the directory itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"p50_ms", "p99_ms", "max_ms", "n"}

pytestmark = pytest.mark.slow


def _run_bench(what: str, samples: int) -> dict:
    argv = [sys.executable, "-m", "shim", "bench", what, "--json", "--samples", str(samples)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the benchmark stops its broker on it.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"weft bench {what} did not finish within 300 s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)  # stdout holds the JSON object and nothing else


def _check_summary(s: dict, n: int, what: str) -> None:
    assert set(s) >= SUMMARY_KEYS, what
    assert s["n"] == n, what
    assert 0 < s["p50_ms"] <= s["p99_ms"] <= s["max_ms"], (what, s)


def _leftovers(workdir: str) -> list[str]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if workdir in cmdline:
            found.append(f"{p.info['pid']}: {cmdline}")
    return found


def _check_environment(env: dict) -> None:
    workdir = env["workdir"]
    assert workdir and Path(workdir).is_absolute()
    assert not Path(workdir).exists()
    assert not _leftovers(workdir)


def test_bench_hook_json_is_complete_and_leaves_nothing_behind() -> None:
    f = _run_bench("hook", 20)

    # The native hook too: CI builds it (scripts/setup.sh installs the C compiler).
    for kind in ("fast_path", "python_floor", "bind", "release", "native_fast_path", "native_bind",
                 "native_release"):
        _check_summary(f[kind], 20, kind)
    assert f["native_over_python_fast_path_p50"] > 0 and f["native_over_python_bind_p50"] > 0
    assert f["environment"]["native_hook"]
    if f["environment"]["console_script"] is None:
        assert f["fast_path_console_script"] is None
    else:
        _check_summary(f["fast_path_console_script"], 20, "fast_path_console_script")
    assert isinstance(f["hook_own_p50_ms"], float)

    targets = f["targets"]
    assert set(targets) == {"fast_path_p99", "bind_p99", "all"}
    assert all(isinstance(v, bool) for v in targets.values())
    assert targets["all"] == (targets["fast_path_p99"] and targets["bind_p99"])

    env = f["environment"]
    assert env["samples_requested"] == 20
    assert env["runs"] == 20
    assert env["warmup_runs"] >= 1
    _check_environment(env)


def test_bench_broker_json_is_complete_and_leaves_nothing_behind() -> None:
    f = _run_bench("broker", 50)

    for call in ("acquire", "release", "list"):
        _check_summary(f[call], 50, call)
    assert f["list"]["leases"] == 64

    broker = f["broker"]
    assert broker["rss_start_mb"] > 0
    assert broker["rss_filled_mb"] > 0
    assert broker["rss_after_mb"] > 0
    assert broker["cpu_seconds"] > 0

    # The 64 live leases stay spread 8 to a device; each probe lease was released.
    devices = f["devices"]
    assert len(devices) == 8
    assert [d["leases"] for d in devices] == [8] * 8
    for d in devices:
        assert d["memory_leased_gib"] == pytest.approx(40.0)
        assert d["compute_leased_percent"] == 80

    targets = f["targets"]
    assert set(targets) == {"acquire_p99", "all"}
    assert all(isinstance(v, bool) for v in targets.values())

    env = f["environment"]
    assert env["samples"] == 50
    assert env["live_leases"] == 64
    _check_environment(env)
