"""``weft bench proxy --json`` runs end to end and cleans up after itself.

The benchmark is a measurement, so this checks its shape and that the figures
are sane, never how fast anything was: timing thresholds would only measure
how busy the test machine is. It runs the CLI as a subprocess, as a platform
engineer would, and then looks for anything the harness left behind: its node
namespace, work directory and pod cgroups.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shim.localfabric.containerd import SLOT_DIR, cgroup_hierarchies

REPO = Path(__file__).resolve().parents[2]
METHODS = ("Version", "ListPodSandbox", "ListContainers", "ContainerStatus")
CALL_KEYS = {"direct_p50_ms", "direct_p99_ms", "agent_p50_ms", "agent_p99_ms", "added_p50_ms", "added_p99_ms"}

pytestmark = pytest.mark.slow


def _node_namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.startswith("weftnode")}


def _slot_in_use(netns: str) -> bool:
    """Whether a live harness (another test running meanwhile) holds this namespace's slot."""
    lock = SLOT_DIR / f"slot{netns.removeprefix('weftnode')}.lock"
    if not lock.exists():
        return False
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _run_bench() -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "shim", "bench", "proxy", "--json",
            "--pods", "3", "--samples", "100", "--load-seconds", "3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        # SIGTERM, not SIGKILL: the benchmark tears its containerd down on it.
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
        pytest.fail(f"weft bench proxy did not finish within 300 s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def test_bench_proxy_json_is_complete_and_leaves_nothing_behind() -> None:
    before = _node_namespaces()
    res = _run_bench()
    assert res.returncode == 0, res.stderr[-3000:]
    figures = json.loads(res.stdout)  # stdout holds the JSON object and nothing else

    assert set(figures) >= {"calls", "floor", "pod_start", "agent", "targets", "environment"}
    assert set(figures["calls"]) == set(METHODS)
    for method, c in figures["calls"].items():
        assert set(c) >= CALL_KEYS, method
        for key in ("direct_p50_ms", "direct_p99_ms", "agent_p50_ms", "agent_p99_ms"):
            assert c[key] > 0, (method, key)
        assert c["direct_p99_ms"] >= c["direct_p50_ms"], method
        assert c["agent_p99_ms"] >= c["agent_p50_ms"], method
        assert c["added_p50_ms"] == pytest.approx(c["agent_p50_ms"] - c["direct_p50_ms"], abs=1e-3), method

    floor = figures["floor"]
    version = figures["calls"]["Version"]
    assert floor["echo_p50_ms"] > 0
    assert floor["echo_p99_ms"] >= floor["echo_p50_ms"]
    assert {"added_p50_ms", "added_p99_ms"} <= set(floor)
    assert floor["forward_p50_ms"] > 0
    assert floor["forward_p99_ms"] >= floor["forward_p50_ms"]
    assert floor["forward_added_p50_ms"] == pytest.approx(floor["forward_p50_ms"] - version["direct_p50_ms"], abs=1e-3)
    assert floor["forward_added_p99_ms"] == pytest.approx(floor["forward_p99_ms"] - version["direct_p99_ms"], abs=1e-3)
    assert floor["agent_over_forward_p50_ms"] == pytest.approx(
        version["added_p50_ms"] - floor["forward_added_p50_ms"], abs=1e-3)

    pod_start = figures["pod_start"]
    assert pod_start["n"] == 3
    assert pod_start["direct_median_ms"] > 0
    assert pod_start["agent_median_ms"] > 0
    assert pod_start["ratio"] > 0

    agent = figures["agent"]
    assert agent["rss_idle_mb"] > 0
    assert agent["rss_max_mb"] >= agent["rss_idle_mb"]
    assert agent["cpu_percent_one_core"] >= 0
    assert agent["load_seconds"] >= 3
    assert agent["load_calls"] > 0
    # Pods have a cgroup parent, so every stats verb kubelet polls succeeds
    # (ListPodSandboxStats fails on containerd 1.6 without one).
    assert agent["load_errors"] == 0

    targets = figures["targets"]
    assert all(isinstance(v, bool) for v in targets.values())
    assert {"pod_start_ratio", "agent_rss", "agent_cpu", "all"} <= set(targets)
    for method in METHODS:
        assert {f"{method}.added_p50", f"{method}.added_p99"} <= set(targets)

    env = figures["environment"]
    assert env["pods"] == 3
    assert env["samples"] == 100
    assert env["containerd_version"]

    # Leftovers: the benchmark's own node namespace and work directory are
    # gone, and any other new weftnode namespace belongs to a live harness.
    after = _node_namespaces()
    assert env["netns"] not in after
    assert not Path(env["workdir"]).exists()
    cgroup_root = f"weft-harness{env['netns'].removeprefix('weftnode')}"
    assert not [h / cgroup_root for h in cgroup_hierarchies() if (h / cgroup_root).exists()]
    assert not {ns for ns in after - before if not _slot_in_use(ns)}
