"""``weft bench mesh`` and ``weft bench e2e`` run end to end in their reduced mode (``--quick``).

Measurements, so this checks that every figure is there and sane (positive,
ratios finite, the remote side really remote), never how fast anything was:
timing thresholds would only measure how busy the test machine is. Each runs
the CLI as a subprocess, as a platform engineer would; ``--quick`` keeps the
pair under about 90 s (mesh's loss figure waits out the default 16 s loss
timeout by design).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.weft_bench import positive, run

pytestmark = pytest.mark.slow


def _latency(s: dict, what: str) -> None:
    positive(s["p50_ms"], f"{what} p50")
    assert s["n"] >= 3, what
    for q in ("p95_ms", "p99_ms", "max_ms"):
        if q in s:
            assert s[q] >= s["p50_ms"], (what, q)


def test_bench_mesh_quick_has_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "mesh.json"
    res = run("mesh", "--quick", "--json", "--output", str(out))
    figures = json.loads(res.stdout)  # stdout holds the JSON object and nothing else
    assert json.loads(out.read_text()) == figures

    start = figures["start"]
    for side in ("remote", "remote_cold", "local"):
        _latency(start[side], side)
    for ratio in ("ratio_p50", "ratio_p95", "cold_ratio_p50"):
        positive(start[ratio], ratio)
    assert set(start["remote_hosts"]) <= {"cpu-1", "cpu-2"} and sum(start["remote_hosts"].values()) == 3

    status = figures["status"]
    _latency(status["remote"], "status remote")
    _latency(status["local"], "status local")
    positive(status["ratio_p50"], "status ratio")

    loss = figures["loss"]
    assert loss["reason"] == "WeftPeerLost" and loss["exit_code"] == 137
    positive(loss["reported_lost_s"], "reported lost")
    assert loss["replaced_s"] >= loss["reported_lost_s"]
    other = ({"cpu-1", "cpu-2"} - {loss["host_killed"]}).pop()
    assert loss["replacement_placement"] == f"remote:{other}"

    targets = figures["targets"]
    assert set(targets) == {"remote_start_ratio", "status_p50_ratio", "replaced_s", "all"}
    assert all(isinstance(v, bool) for v in targets.values())
    env = figures["environment"]
    assert (env["fence_timeout_s"], env["loss_timeout_s"]) == (8.0, 16.0)  # what a user gets


def test_bench_e2e_quick_has_every_figure(tmp_path: Path) -> None:
    res = run("e2e", "--quick", "--json", "--output", str(tmp_path))
    figures = json.loads(res.stdout)
    assert json.loads((tmp_path / "e2e.json").read_text()) == figures
    table = (tmp_path / "e2e.md").read_text()

    pod_start = figures["pod_start"]
    _latency(pod_start["opted_in"], "pod start opted in")
    _latency(pod_start["plain"], "pod start plain")
    positive(pod_start["ratio_p50"], "pod start ratio")
    # Opted in, the CPU container went to a host and the GPU one stayed, leased.
    assert all(p.startswith("remote:cpu-") and p.endswith(" + local") for p in pod_start["opted_in_placements"])

    # The pod start also opted in without the prepared shadow sandbox, side by side.
    _latency(pod_start["opted_in_unprepared"], "pod start opted in, unprepared")
    for ratio in ("ratio_p95", "unprepared_ratio_p50", "unprepared_ratio_p95"):
        positive(pod_start[ratio], ratio)
    # And both sides under the runtime's default seccomp profile, which a host gives a rerouted container anyway.
    _latency(pod_start["opted_in_runtime_default"], "pod start opted in, RuntimeDefault")
    _latency(pod_start["plain_runtime_default"], "pod start plain, RuntimeDefault")
    for ratio in ("runtime_default_ratio_p50", "runtime_default_ratio_p95"):
        positive(pod_start[ratio], ratio)
    assert "both under the runtime's default seccomp profile" in table
    assert figures["targets"]["pod_start_ratio"] == 1.2 and figures["targets"]["first_start_ratio"] == 1.3

    start = figures["container_start"]
    for side in ("remote", "remote_cold", "local"):
        _latency(start[side], side)
    positive(start["ratio_p50"], "container start ratio")
    first = start["first"]
    for side in ("remote", "remote_unprepared", "local"):
        _latency(first[side], f"first start {side}")
    for ratio in ("ratio_p50", "ratio_p95", "unprepared_ratio_p50"):
        positive(first[ratio], f"first start {ratio}")

    assert set(figures["cri_calls"]) == {"Version", "ListContainers", "ContainerStatus"}
    for method, c in figures["cri_calls"].items():
        _latency(c["agent"], f"{method} agent")
        _latency(c["direct"], f"{method} direct")
        positive(c["ratio_p50"], f"{method} ratio")

    assert set(figures["resources"]) == {"agent gpu-1", "agent cpu-1", "agent cpu-2", "broker"}
    for name, r in figures["resources"].items():
        for window in ("idle", "churn"):
            assert r[window]["cpu_percent"] >= 0, (name, window)
            positive(r[window]["rss_max_mb"], f"{name} {window} RSS")
    churn = figures["churn"]
    assert churn["started"] >= 1 and churn["errors"] == 0, churn["first_errors"]
    assert churn["max_alive"] <= figures["plan"]["churn_pods"]

    assert "available" in figures["network"]
    machine = figures["machine"]
    assert machine["cpu_count"] >= 1 and machine["kernel"] and machine["containerd_version"] and machine["date"]
    for row in ("pod start p50", "container start p50, remote vs local", "Version p50", "ListContainers p50",
                "pod start p50 / p95 ratio", "first container start p50 / p95 in a fresh pod",
                "ContainerStatus p50", "stitched localhost", "agent gpu-1", "broker", machine["kernel"]):
        assert row in table, row
