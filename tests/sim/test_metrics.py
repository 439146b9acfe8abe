"""Summaries and series agree with each other and with the definitions in the assumptions."""

from __future__ import annotations

import pytest

from shim.core.stats import percentile
from shim.sim.engine import simulate
from shim.sim.metrics import series, summarise
from shim.sim.model import GpuProfile, Mode
from tests.sim.builders import cluster, cpu_pod, gpu_pod


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        pytest.param([], 50, None, id="empty"),
        pytest.param([5.0], 95, 5.0, id="one-value"),
        pytest.param([1.0, 2.0, 3.0, 4.0], 50, 2.5, id="interpolates-the-median"),
        pytest.param([10.0, 0.0, 20.0], 100, 20.0, id="unsorted-max"),
        pytest.param(list(range(101)), 95, 95.0, id="p95-of-0-to-100"),
    ],
)
def test_percentile(values, q, expected):
    assert percentile(values, q) == expected


def workload():
    varied = GpuProfile("v", 60.0, (0.0, 0.3, 0.9, 0.1), (1, 2, 3, 4))
    return [
        gpu_pod("a", run=5000.0, profile=varied),
        gpu_pod("b", arrival=700.0, run=2500.0, duty=0.4),
        gpu_pod("c", arrival=900.0, run=4000.0, profile=varied),
        cpu_pod("plain", arrival=100.0, run=1000.0),
    ]


@pytest.mark.parametrize("mode", list(Mode), ids=lambda m: m.value)
def test_the_series_adds_up_to_the_summary(mode):
    run = simulate(workload(), cluster(gpus=2), mode)
    s = summarise(run)
    se = series(run, s.makespan_s, bins=7)
    width = s.makespan_s / 7
    assert sum(se.gpus_held) * width == pytest.approx(s.held_gpu_s)
    busy = sum(u * h * width for u, h in zip(se.utilisation, se.gpus_held, strict=True) if u is not None)
    assert busy == pytest.approx(s.busy_gpu_s)
    assert s.gpus_held_mean == pytest.approx(s.held_gpu_s / s.makespan_s)


def test_cpu_node_utilisation_counts_plain_pods_and_hosted_stages():
    pods = [gpu_pod("a", run=1000.0, cpu=8.0), cpu_pod("plain", run=1000.0, cpu=8.0)]
    weft = summarise(simulate(pods, cluster(), Mode.WEFT))
    bundled = summarise(simulate(pods, cluster(), Mode.BUNDLED))
    assert weft.cpu_node_utilisation == pytest.approx(16 / 32)
    assert bundled.cpu_node_utilisation == pytest.approx(8 / 32)
    # vCPU off GPU nodes: the plain pod's 8 in both; weft adds the 8-vCPU stage (the GPU stage keeps 2).
    assert bundled.cpu_share_off_gpu_nodes == pytest.approx(8 / 18)
    assert weft.cpu_share_off_gpu_nodes == pytest.approx(16 / 18)


def test_installed_utilisation_counts_gpus_nobody_holds():
    s = summarise(simulate([gpu_pod("a", duty=0.5)], cluster(gpus=4), Mode.BUNDLED))
    assert s.gpu_utilisation == pytest.approx(0.5)
    assert s.installed_gpu_utilisation == pytest.approx(0.5 / 4)


def test_busy_seconds_are_the_same_work_when_queueing_shifts_a_start():
    # One GPU: bundled runs b after a, weft runs them side by side; b's replay starts when b starts.
    varied = GpuProfile("v", 60.0, (0.0, 0.3, 0.9, 0.1), (1, 2, 3, 4))
    pods = [gpu_pod("a", run=500.0, profile=varied), gpu_pod("b", arrival=10.0, run=430.0, profile=varied)]
    bundled = summarise(simulate(pods, cluster(gpus=1), Mode.BUNDLED))
    weft = summarise(simulate(pods, cluster(gpus=1), Mode.WEFT))
    assert bundled.queue_p95_s > 0 and weft.queue_p95_s == 0
    # a: 2 periods (156) + 20 s idle; b: 1 period (78) + 60 idle + 60 x 0.3 + 60 x 0.9 + 10 x 0.1
    assert bundled.busy_gpu_s == pytest.approx(156 + 78 + 18 + 54 + 1)
    assert weft.busy_gpu_s == pytest.approx(bundled.busy_gpu_s)
