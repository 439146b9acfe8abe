"""kai-fractions against weft: the same shares packed alike, the memory limit enforced or not, worked out by hand.

Each GPU is 80 GiB and each stage declares 40 GiB, so two share a GPU. A
stage's memory is its profile's series from its pod's start. Under KAI's
fractions nothing holds a stage to its share: it may use what its neighbour
leaves, and when the two hold more than the GPU has, the allocation that does
not fit fails, whoever overran. Under weft the broker's limit fails a stage
the moment it goes above its lease, and only that stage. A failed stage is
restarted in place after kubelet's back-off (10 s, doubling, at most 300 s).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shim.sim.engine import DEVICE_FULL, OVER_LEASE, simulate
from shim.sim.metrics import summarise, up_segments
from shim.sim.model import GIB, GpuProfile, Mode
from shim.sim.plan import KAI_REASON, plan_pod
from tests.sim.builders import cluster, gpu_pod

DUTY = 0.5


def stepped(name: str, step_s: float, gib: list[int]) -> GpuProfile:
    return GpuProfile(name, step_s, [DUTY] * len(gib), [g * GIB for g in gib])


# "over" goes above its 40 GiB share at 300 s and back at 900 s; "neighbour" grows to 35 GiB (within its share) at
# 600 s, while "over" holds 50: 85 GiB on an 80 GiB GPU.
OVER = gpu_pod("over", run=1200.0, gib=40, profile=stepped("over", 300.0, [30, 50, 50, 30]))
NEIGHBOUR = gpu_pod("neighbour", run=1200.0, gib=40, profile=stepped("neighbour", 600.0, [20, 35]))


def failures(run) -> list[tuple[float, str, str, bool, int]]:
    """(first failure, pod, cause, within its own share, failures in a row): a crash loop is one record."""
    return [(f.t, run.pods[f.pod].name, f.cause, f.within_share, f.count) for f in run.failures]


def test_kai_pods_are_booked_whole_on_the_gpu_node_and_their_gpu_stage_asks_for_its_declared_share():
    plan = plan_pod(OVER, Mode.KAI, 80 * GIB)
    assert plan.needs_gpu_node and plan.node_request == OVER.total_cpu  # the CPU stage rides on the GPU node
    assert (plan.ask.memory_bytes, plan.ask.compute_percent) == (40 * GIB, 50)
    assert plan.ask == plan_pod(OVER, Mode.WEFT, 80 * GIB).ask  # the share weft would lease
    assert plan.reroutes == () and plan.stays == (("cpu", "bundled"), ("gpu", KAI_REASON))
    run = simulate([OVER, NEIGHBOUR], cluster(), Mode.KAI)
    assert run.rerouted == 0 and summarise(run).gpus_held_peak == 1  # two shares on one GPU


def test_under_kai_the_neighbour_within_its_share_fails_when_the_other_overran():
    run = simulate([OVER, NEIGHBOUR], cluster(), Mode.KAI)
    # At 300 s "over" takes 50 GiB beside 20: it fits, and nothing stops it. At 600 s the neighbour's 35 GiB do not
    # fit beside those 50, and it fails; restarted after 10, 20, 40, 80 and 160 s, it fails again each time until
    # "over" is back to 30 GiB at 900 s: the restart at 910 s fits.
    assert failures(run) == [(600.0, "neighbour", DEVICE_FULL, True, 5)]
    over, neighbour = run.outcomes
    assert over.down == [] and neighbour.down == [(600.0, 910.0)]
    s = summarise(run)
    assert (s.oom_failures, s.oom_failures_within_share, s.oom_stages_failed) == (5, 5, 1)
    assert s.oom_gpu_h_lost == pytest.approx(0.5 * 310 / 3600)  # half a GPU held for 310 s while down
    assert s.oom_busy_gpu_h_lost == pytest.approx(DUTY * 310 / 3600)
    assert s.busy_gpu_s == pytest.approx(DUTY * (1200 + 1200 - 310))  # the work done, not the work lost
    assert (neighbour.start, neighbour.end) == (0.0, 1200.0)  # restarted in place: the pod's life is unchanged


def test_under_weft_only_the_stage_above_its_lease_fails():
    run = simulate([OVER, NEIGHBOUR], cluster(), Mode.WEFT)
    # "over" fails the moment it goes above its 40 GiB lease, and again at each restart while its series is above
    # it (back-off 10, 20, 40, 80, 160, then 300 s); at 910 s its series is back to 30 GiB. The neighbour, within its
    # lease, never fails: the 85 GiB KAI ran out on cannot happen when each stage is held to its share.
    assert failures(run) == [(300.0, "over", OVER_LEASE, False, 6)]
    over, neighbour = run.outcomes
    assert over.down == [(300.0, 910.0)] and neighbour.down == []
    s = summarise(run)
    assert (s.oom_failures, s.oom_failures_within_share, s.oom_stages_failed) == (6, 0, 1)
    assert s.oom_gpu_h_lost == pytest.approx(0.5 * 610 / 3600)


def test_a_stage_above_its_share_with_room_on_the_gpu_runs_under_kai_and_fails_under_weft():
    alone = [OVER]
    assert simulate(alone, cluster(), Mode.KAI).failures == []  # 50 GiB of an 80 GiB GPU: nothing runs out
    assert failures(simulate(alone, cluster(), Mode.WEFT)) == [(300.0, "over", OVER_LEASE, False, 6)]


def test_under_kai_a_pod_placed_by_its_share_onto_an_overfilled_gpu_fails_as_it_starts():
    # "greedy" declares 40 GiB and holds 50 throughout; "late" is placed beside it by its declared 40 GiB.
    greedy = gpu_pod("greedy", run=1000.0, gib=40, profile=stepped("greedy", 60.0, [50]))
    late = gpu_pod("late", arrival=100.0, run=1000.0, gib=40, profile=stepped("late", 60.0, [35]))
    run = simulate([greedy, late], cluster(), Mode.KAI)
    # It fails at its start and at each restart until "greedy" ends at 1000 s; the restart at 1010 s runs.
    assert failures(run) == [(100.0, "late", DEVICE_FULL, True, 7)]  # at 100, 110, 130, 170, 250, 410 and 710 s
    assert run.outcomes[1].down == [(100.0, 1010.0)]
    weft = simulate([greedy, late], cluster(), Mode.WEFT)
    assert {run.pods[f.pod].name for f in weft.failures} == {"greedy"} and weft.outcomes[1].down == []


def test_a_stage_down_when_its_pod_ends_is_down_until_then_and_restarts_no_more():
    pod = gpu_pod("short", run=305.0, gib=40, profile=stepped("s", 300.0, [30, 50]))
    run = simulate([pod], cluster(), Mode.WEFT)
    assert failures(run) == [(300.0, "short", OVER_LEASE, False, 1)]
    assert run.outcomes[0].down == [(300.0, 305.0)]
    # The same under KAI, where a neighbour's overrun leaves it no room at 300 s: 36 GiB beside 45 of 80.
    hog = gpu_pod("hog", run=305.0, gib=40, profile=stepped("h", 60.0, [45]))
    kai = simulate([hog, replace(pod, gpu=replace(pod.gpu, profile=stepped("s", 300.0, [30, 36])))], cluster(),
                   Mode.KAI)
    assert failures(kai) == [(300.0, "short", DEVICE_FULL, True, 1)]
    assert kai.outcomes[1].down == [(300.0, 305.0)]
    assert up_segments(run.outcomes[0]) == [(0.0, 300.0)]


def test_kubelet_resets_the_back_off_after_ten_minutes_up():
    # Above its lease for one 60 s sample in every 20 minutes: each failure is the first after long enough up.
    profile = stepped("spiky", 60.0, [50] + [30] * 19)
    run = simulate([gpu_pod("spiky", run=3600.0, gib=40, profile=profile)], cluster(), Mode.WEFT)
    # Fails at 0 s, 10 s, 30 s (the spike lasts to 60 s), then at each spike: 1200 s and 2400 s, where it is
    # restarted after 10 s again, as the back-off was reset.
    assert [(f.t, f.count) for f in run.failures] == [(0.0, 3), (1200.0, 3), (2400.0, 3)]
    assert run.outcomes[0].down == [(0.0, 70.0), (1200.0, 1270.0), (2400.0, 2470.0)]


def test_leases_at_each_stages_peak_memory_never_run_out_in_any_mode():
    pods = [OVER, NEIGHBOUR]
    peak = [gpu_pod(p.name, run=p.run_s, gib=50, profile=p.gpu.profile) for p in pods]
    for mode in Mode:
        run = simulate(peak, cluster(gpus=2), mode)
        assert run.failures == [] and summarise(run).oom_failures == 0, mode


# -- the invariants, on random small workloads -------------------------------------------------------------------

stage_specs = st.lists(
    st.tuples(
        st.integers(0, 3000),  # arrival, s
        st.integers(1, 3000),  # run, s
        st.integers(1, 60),  # declared share, GiB
        st.sampled_from([60.0, 100.0, 450.0]),  # profile step, s
        st.lists(st.integers(1, 70), min_size=1, max_size=4),  # memory samples, GiB
    ),
    min_size=1, max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(stage_specs, st.integers(1, 2), st.sampled_from([Mode.KAI, Mode.WEFT, Mode.BUNDLED]))
def test_no_device_ever_holds_more_memory_than_it_has_and_weft_never_fails_a_stage_within_its_lease(specs, gpus, mode):
    pods = [gpu_pod(f"p{k}", arrival=a, run=r, gib=g, profile=stepped(f"p{k}", step, gib))
            for k, (a, r, g, step, gib) in enumerate(specs)]
    spec = cluster(gpus=gpus)
    run = simulate(pods, spec, mode)
    device: dict[int, str] = {lease.pod: lease.device for lease in run.leases}
    lease_bytes = {lease.pod: lease.memory_bytes for lease in run.leases}
    # Between two consecutive instants at which anything changes, nothing does: check at each midpoint.
    instants = set()
    for pod, out in zip(pods, run.outcomes, strict=True):
        assert out.start is not None and out.end is not None
        instants |= {out.start, out.end, *(t for span in out.down for t in span)}
        step = pod.gpu.profile.step_s
        instants |= {out.start + k * step for k in range(int((out.end - out.start) // step) + 1)}
    ordered = sorted(instants)
    for a, b in itertools.pairwise(ordered):
        t = (a + b) / 2
        held: dict[str, int] = defaultdict(int)
        for k, (pod, out) in enumerate(zip(pods, run.outcomes, strict=True)):
            if any(x <= t < y for x, y in up_segments(out)):
                profile = pod.gpu.profile
                memory = profile.memory[profile.locate(t - out.start)[0]]
                held[device[k]] += memory
                if mode.enforced:
                    assert memory <= lease_bytes[k], f"{pod.name} above its lease at {t}"
        assert all(v <= spec.gpu_memory_bytes for v in held.values()), f"a device over its memory at {t}"
    if mode.enforced:
        assert all(f.cause == OVER_LEASE and not f.within_share for f in run.failures)
    # A stage fails holding what its series says then, and is down only from a failure of its own.
    for f in run.failures:
        pod, out = pods[f.pod], run.outcomes[f.pod]
        assert f.memory_bytes == pod.gpu.profile.memory[pod.gpu.profile.locate(f.t - out.start)[0]]
    for k, out in enumerate(run.outcomes):
        assert all(x < y for x, y in out.down)
        assert {x for x, _ in out.down} <= {f.t for f in run.failures if f.pod == k}
