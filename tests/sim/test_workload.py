"""Building pods: DLRM pairing by lifetime, GenTD26 draws, leases by policy, synthetic streams."""

from __future__ import annotations

import random

import pytest

from shim.sim.model import GIB, GpuProfile
from shim.sim.readers import DlrmInstance
from shim.sim.workload import (
    PAIR_WINDOW_S,
    SyntheticSpec,
    dlrm_pods,
    genai_pool,
    lease_bytes,
    parse_duty,
    synthetic_pods,
    with_lease,
)

END = 1_000_000.0
PROFILE = GpuProfile("g", 57.0, (0.0, 0.2), (20 * GIB, 30 * GIB))


def inst(name, role, created, deleted, app="app", vcpu=None, order=0):
    vcpu = vcpu if vcpu is not None else (64.0 if role == "CN" else 8.0)
    return DlrmInstance(name, role, app, vcpu, 1 if role == "HN" else 0, 40 * GIB, created, created, deleted, order)


def shapes(pods):
    return sorted((p.name, p.arrival_s, p.run_s, bool(p.cpu), p.gpu is not None) for p in pods)


def test_an_hn_pairs_with_the_cn_whose_lifetime_is_nearest_within_the_window():
    instances = [
        inst("hn1", "HN", None, 5000.0),
        inst("cn-near", "CN", None, 5100.0),  # 100 s apart: pairs
        inst("cn-far", "CN", None, 5000.0 + PAIR_WINDOW_S + 1),  # too far: stays a plain CPU pod
        inst("hn2", "HN", 200_000.0, None),  # nobody near: a GPU-only pod
    ]
    pods = dlrm_pods(instances, END, [PROFILE], random.Random(0))
    assert shapes(pods) == [
        ("app/cn-far", 0.0, 5000.0 + PAIR_WINDOW_S + 1, True, False),
        ("app/hn1+cn-near", 0.0, 5000.0, True, True),  # the HN's lifetime
        ("app/hn2", 200_000.0, END - 200_000.0, False, True),
    ]
    paired = next(p for p in pods if "+" in p.name)
    assert (paired.cpu[0].name, paired.cpu[0].vcpu, paired.gpu.name, paired.gpu.vcpu) == ("cn", 64.0, "hn", 8.0)


def test_instances_of_different_apps_never_pair():
    pods = dlrm_pods([inst("h", "HN", None, None, app="x"), inst("c", "CN", None, None, app="y")], END,
                     [PROFILE], random.Random(0))
    assert sorted(p.name for p in pods) == ["x/h", "y/c"]


def test_duration_drops_late_arrivals_and_cuts_runs():
    instances = [inst("h", "HN", None, None), inst("late", "CN", 5000.0, 9000.0)]
    pods = dlrm_pods(instances, END, [PROFILE], random.Random(0), duration=4000.0)
    assert [(p.name, p.run_s) for p in pods] == [("app/h", 4000.0)]


def test_gpu_behaviour_draws_are_seeded():
    instances = [inst(f"h{k}", "HN", None, None, order=k) for k in range(20)]
    pool = [PROFILE, GpuProfile("other", 57.0, (0.5,), (10 * GIB,))]
    first = [(p.gpu.profile.name, p.gpu.phase_s) for p in dlrm_pods(instances, END, pool, random.Random(7))]
    again = [(p.gpu.profile.name, p.gpu.phase_s) for p in dlrm_pods(instances, END, pool, random.Random(7))]
    assert first == again and len(set(first)) > 1


def test_the_pool_prefers_full_series_over_summary_means():
    summary = [GpuProfile("a", 57.0, (0.1,), (GIB,)), GpuProfile("b", 57.0, (0.1,), (GIB,))]
    series = [GpuProfile("b", 57.0, (0.0, 0.2), (GIB, GIB)), GpuProfile("c", 57.0, (0.3,), (GIB,))]
    pool = genai_pool(series, summary)
    assert [(p.name, p.n) for p in pool] == [("a", 1), ("b", 2), ("c", 1)]


@pytest.mark.parametrize(
    ("policy", "gib"),
    [("peak", 30), ("mean", 25), ("p99", 30), ("p95", 30)],
)
def test_lease_policies_round_up_to_a_gib(policy, gib):
    assert lease_bytes(PROFILE, policy) == gib * GIB


def test_a_summary_only_profile_keeps_its_peak_for_quantile_leases():
    flat = GpuProfile("s", 57.0, (0.1,), (20 * GIB,), peak_bytes=int(33.2 * GIB))
    assert lease_bytes(flat, "p95") == 34 * GIB
    assert lease_bytes(flat, "mean") == 20 * GIB


def test_with_lease_annotates_only_gpu_pods_and_keeps_declared_leases():
    pods = dlrm_pods([inst("h", "HN", None, None), inst("c", "CN", 0.0, 10.0 + 2 * PAIR_WINDOW_S)], END,
                     [PROFILE], random.Random(0))
    leased = with_lease(pods, "mean")
    notes = {p.name: dict(p.annotations) for p in leased}
    assert notes == {"app/h": {"weft.io/gpu-memory.hn": "25Gi"}, "app/c": {}}
    assert with_lease(leased, "peak")[0].annotations == leased[0].annotations


@pytest.mark.parametrize(
    ("spec", "low", "high"),
    [("7", 0.07, 0.07), ("uniform:1,20", 0.01, 0.20), ("beta:0.5,6.6", 0.0, 1.0)],
)
def test_duty_specs(spec, low, high):
    draw = parse_duty(spec)
    rng = random.Random(3)
    values = [draw(rng) for _ in range(200)]
    assert all(low <= v <= high for v in values)


@pytest.mark.parametrize("spec", ["", "abc", "120", "uniform:5", "uniform:9,2", "beta:0,1", "gamma:1,2"])
def test_bad_duty_specs_say_what_is_expected(spec):
    with pytest.raises(ValueError, match="uniform:LO,HI"):
        parse_duty(spec)


def test_synthetic_pods_arrive_at_the_requested_rate():
    spec = SyntheticSpec(400, 60.0, 600.0, (8.0, 32 * GIB), (4.0, 16 * GIB), 20 * GIB, parse_duty("10"))
    pods = synthetic_pods(spec, [], random.Random(1))
    span_h = pods[-1].arrival_s / 3600
    assert len(pods) / span_h == pytest.approx(60.0, rel=0.15)
    assert all(p.gpu.profile.mean_duty == pytest.approx(0.10) for p in pods)
    assert all(p.cpu[0].vcpu == 8.0 and p.gpu.profile.peak_bytes == 20 * GIB for p in pods)
