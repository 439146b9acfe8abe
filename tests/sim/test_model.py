"""GPU profiles: the replayed duty cycle and memory integrate exactly, wrap around, and give lease sizes."""

from __future__ import annotations

import pytest

from shim.sim.model import GIB, GpuProfile, PodSpec

# Three 60-second samples: idle, half busy, fully busy; memory 10, 20, 30 GiB.
SERIES = GpuProfile("p", 60.0, (0.0, 0.5, 1.0), (10 * GIB, 20 * GIB, 30 * GIB))


def test_statistics_of_the_series():
    assert SERIES.period == 180.0
    assert SERIES.mean_duty == pytest.approx(0.5)
    assert SERIES.zero_fraction == pytest.approx(1 / 3)
    assert SERIES.mean_memory == pytest.approx(20 * GIB)
    assert SERIES.peak_bytes == 30 * GIB


@pytest.mark.parametrize(
    ("phase", "seconds", "busy", "zero"),
    [
        pytest.param(0, 180, 90, 60, id="one-whole-period"),
        pytest.param(30, 60, 15, 30, id="half-idle-half-half-busy"),
        pytest.param(120, 60, 60, 0, id="phase-starts-in-the-busy-sample"),
        pytest.param(120, 120, 60, 60, id="wraps-from-the-end-to-the-start"),
        pytest.param(17, 3 * 180, 270, 180, id="three-periods-from-anywhere"),
        pytest.param(1000, 0, 0, 0, id="nothing-in-no-time"),
    ],
)
def test_integrals_over_an_interval(phase, seconds, busy, zero):
    got = SERIES.integrals(phase, seconds)
    assert got.busy_s == pytest.approx(busy)
    assert got.zero_s == pytest.approx(zero)


def test_duty_at_an_instant_wraps_around():
    assert [SERIES.duty_at(x) for x in (0, 59.9, 60, 179, 180, 245)] == [0.0, 0.0, 0.5, 1.0, 0.0, 0.5]


def test_quantiles_are_samples_the_pod_really_used():
    assert SERIES.memory_quantile(1.0) == 30 * GIB
    assert SERIES.memory_quantile(0.5) == 20 * GIB
    assert SERIES.share_above(20 * GIB) == pytest.approx(1 / 3)


def test_a_summary_profile_keeps_its_peak_apart_from_what_it_replays():
    flat = GpuProfile("s", 57.0, (0.1,), (20 * GIB,), peak_bytes=40 * GIB)
    assert flat.peak_bytes == 40 * GIB and flat.mean_memory == 20 * GIB


@pytest.mark.parametrize(
    ("duty", "memory", "message"),
    [
        pytest.param((1.5,), (1,), "fraction", id="duty-over-one"),
        pytest.param((0.5, 0.5), (1,), "as many", id="lengths-differ"),
        pytest.param((), (), "as many", id="empty"),
    ],
)
def test_bad_profiles_are_refused(duty, memory, message):
    with pytest.raises(ValueError, match=message):
        GpuProfile("bad", 60.0, duty, memory)


def test_a_pod_needs_a_positive_run_time_and_a_container():
    with pytest.raises(ValueError, match="run time"):
        PodSpec("p", 0.0, 0.0, gpu=None, cpu=())
    with pytest.raises(ValueError, match="no containers"):
        PodSpec("p", 0.0, 1.0)
