"""Validation of the bundled mode: figures measured over the run, tolerances that follow from the sample size."""

from __future__ import annotations

import random

import pytest

from shim.core.reroute import Resources
from shim.sim.engine import simulate
from shim.sim.model import GIB, GpuProfile, Mode
from shim.sim.validate import Check, _draw_se, _file_se, dlrm_checks, genai_checks
from shim.sim.workload import dlrm_pods, with_lease
from tests.sim.builders import cluster, gpu_pod
from tests.sim.test_workload import inst


def test_the_file_error_shrinks_with_the_pods_it_holds_and_vanishes_for_all_143():
    three = _file_se("duty", 3)
    assert three == pytest.approx(4.79 / 3**0.5 * (140 / 142) ** 0.5)
    assert _file_se("duty", 30) < three
    assert _file_se("duty", 143) == 0.0


def test_the_draw_error_is_that_of_a_weighted_mean():
    assert _draw_se([5.0, 5.0, 5.0], [1, 1, 1]) == 0.0  # identical pods: any draw gives the same
    assert _draw_se([0.0, 10.0], [1, 1]) == pytest.approx(5.0 / 2**0.5)  # sd 5 over sqrt(2) draws
    # Nearly all the time on one pod: the weighted spread is small, and so is the error (not 5 / sqrt 2).
    assert _draw_se([0.0, 10.0], [1, 1000]) == pytest.approx(0.3156, abs=1e-4)


def test_a_check_passes_within_its_tolerance_and_fails_outside():
    assert Check("x", "", "", 1.0, 1.0, 1.5, 0.5, "").passed
    assert not Check("x", "", "", 1.0, 1.0, 1.51, 0.5, "").passed
    assert not Check("x", "", "", 1.0, 1.0, None, 0.5, "").passed


def test_genai_figures_are_measured_over_the_gpu_time_the_run_placed():
    # Half the time at 0 %, half at 14 %: mean 7 %, zero share 0.5; memory 20 then 26 GiB: mean 23 GiB.
    profile = GpuProfile("p", 60.0, (0.0, 0.14), (20 * GIB, 26 * GIB))
    run = simulate([gpu_pod("a", run=1200.0, profile=profile)], cluster(), Mode.BUNDLED)
    checks = {c.id: c for c in genai_checks(run, [profile])}
    assert set(checks) == {f"{figure}{suffix}" for figure in ("genai_serving_gpu_duty_mean",
                           "genai_serving_gpu_duty_zero_frac", "genai_serving_gpu_mem_held")
                           for suffix in ("", "@input")}  # one profile: no spread across pods to compare
    assert checks["genai_serving_gpu_duty_mean"].simulated == pytest.approx(7.0)
    assert checks["genai_serving_gpu_duty_zero_frac"].simulated == pytest.approx(0.5)
    assert checks["genai_serving_gpu_mem_held"].simulated == pytest.approx(23.0)
    # Held to the input's own figures, the replay is exact; against GenTD26's 0.668 a one-pod file is not.
    assert all(checks[f"{figure}@input"].passed for figure in ("genai_serving_gpu_duty_mean",
               "genai_serving_gpu_duty_zero_frac", "genai_serving_gpu_mem_held"))
    assert checks["genai_serving_gpu_duty_zero_frac@input"].reference == pytest.approx(0.5)


def test_a_replay_that_drifts_from_its_input_fails_the_input_check():
    profile = GpuProfile("p", 60.0, (0.0, 0.14), (20 * GIB, 26 * GIB))
    run = simulate([gpu_pod("a", run=60.0, profile=profile)], cluster(), Mode.BUNDLED)  # only the idle minute
    checks = {c.id: c for c in genai_checks(run, [profile])}
    assert checks["genai_serving_gpu_duty_mean"].simulated == 0.0
    assert not checks["genai_serving_gpu_duty_mean@input"].passed


def test_pod_spread_figures_need_many_pods_that_ran_a_whole_series():
    profiles = [GpuProfile(f"p{k}", 60.0, (0.01 * k,), (GIB,)) for k in range(40)]
    pods = [gpu_pod(f"a{k}", profile=profiles[k]) for k in range(40)]
    run = simulate(pods, cluster(gpus=40), Mode.BUNDLED)
    checks = {c.id: c for c in genai_checks(run, profiles)}
    assert checks["genai_serving_pods_under_10pct"].simulated == pytest.approx(10 / 40)
    assert checks["genai_serving_pod_mean_duty_median"].simulated == pytest.approx(19.5)
    few = {c.id for c in genai_checks(run, profiles[:10])}
    assert "genai_serving_pods_under_10pct" not in few


def test_dlrm_figures_compare_the_run_with_the_same_figure_from_the_file():
    instances = [
        inst("h1", "HN", None, None), inst("c1", "CN", None, None, vcpu=96.0),
        inst("h2", "HN", None, None), inst("c2", "CN", None, None, vcpu=64.0),
        inst("c3", "CN", None, None, vcpu=48.0),  # no HN: a plain CPU pod
    ]
    pods = with_lease(dlrm_pods(instances, 40 * 86400.0, [GpuProfile.constant("g", 0.1, GIB)], random.Random(0)),
                      "peak")
    big = Resources(224.0, 2048 * GIB)  # a bundled pod here needs up to 104 vCPU
    run = simulate(pods, cluster(gpus=2, cpu_nodes=1, gpu_node=big, cpu_node=big), Mode.BUNDLED)
    checks = {c.id: c for c in dlrm_checks(run, instances)}
    at0 = checks["dlrm_cn_vcpu_per_gpu@0d"]
    assert (at0.reference, at0.simulated, at0.published) == (104.0, 104.0, 91.7)  # (96 + 64 + 48) / 2 GPUs
    share = checks["dlrm_cpu_share_off_gpu_node@0d"]
    assert share.reference == pytest.approx(208 / 224) and share.passed
    assert checks["dlrm_hn_vcpu_per_gpu"].simulated == 8.0
    assert all(c.passed for c in checks.values())
