"""The verdict: kept, no change or worse, from the two windows' figures, by one stated rule.

The measure is GPU utilisation, busy GPU-seconds over held GPU-seconds,
because that is what weft changes: the same work holding less GPU. A
verdict also looks at what could get worse on the way (restarts, container
start time). It is never given from too little data: each window needs
``MIN_SAMPLES`` steps with GPUs held and with DCGM activity, and the verdict
says how much it would need when it has less.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from shim.report.compute import Figures
from shim.report.windows import human

RATIO_GAIN = 1.10  # kept: utilisation at least 10 % (relative) higher after
RATIO_LOSS = 0.90  # worse: utilisation more than 10 % lower after
RESTART_MARGIN = 0.1  # worse: restarts per pod-hour up by more than this
START_FACTOR = 2.0  # worse: p95 container start more than twice as long ...
START_SLACK_S = 10.0  # ... and more than 10 s longer
MIN_SAMPLES = 30  # steps with data in each window before any verdict
MIN_STARTS = 5  # container starts in each window before start times count

RULE = (f"kept if GPU-active/held rose by at least {RATIO_GAIN - 1:.0%} (relative) and nothing got worse; worse "
        f"if it fell by more than {1 - RATIO_LOSS:.0%}, or restarts per pod-hour rose by more than {RESTART_MARGIN}, "
        f"or p95 container start grew more than {START_FACTOR:g}x and by over {START_SLACK_S:g} s (compared only "
        f"with at least {MIN_STARTS} starts in each window); otherwise no change. Each window needs at least "
        f"{MIN_SAMPLES} scrape steps with GPUs held and with DCGM activity.")


class Outcome(enum.Enum):
    KEPT = "kept"
    NO_CHANGE = "no change"
    WORSE = "worse"
    NONE = "no verdict"


class Reason(enum.Enum):
    UTILISATION_ROSE = "utilisation-rose"
    UTILISATION_FELL = "utilisation-fell"
    WITHIN_MARGIN = "within-margin"
    RESTARTS_ROSE = "restarts-rose"
    STARTS_SLOWER = "starts-slower"
    NO_GPU_HELD = "no-gpu-held"
    NO_DCGM = "no-dcgm"
    TOO_LITTLE_DATA = "too-little-data"


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    reason: Reason
    detail: str  # what the rule saw, in numbers
    rule: str = RULE


def decide(before: Figures, after: Figures) -> Verdict:
    for f in (before, after):
        if f.held_samples == 0:
            return Verdict(Outcome.NONE, Reason.NO_GPU_HELD,
                           f"no GPU was held by the workload in the {f.window.name} window, so there is no "
                           "utilisation to compare")
    for f in (before, after):
        if f.active_gpu_s is None:
            return Verdict(Outcome.NONE, Reason.NO_DCGM,
                           f"no DCGM activity series for the workload's pods in the {f.window.name} window")
    for f in (before, after):
        have = min(f.held_samples, f.active_samples)
        if have < MIN_SAMPLES:
            return Verdict(Outcome.NONE, Reason.TOO_LITTLE_DATA,
                           f"the {f.window.name} window has {have} steps with GPU data ({human(have * f.step)} at a "
                           f"{human(f.step)} step); a verdict needs {MIN_SAMPLES} ({human(MIN_SAMPLES * f.step)}): "
                           "widen the window or wait for more data")
    rb, ra = before.ratio, after.ratio
    assert rb is not None and ra is not None  # held > 0 and active known, checked above
    change = f"GPU-active/held went from {rb:.1%} to {ra:.1%}"
    restart_b, restart_a = before.restarts_per_pod_hour or 0.0, after.restarts_per_pod_hour or 0.0
    if restart_a > restart_b + RESTART_MARGIN:
        return Verdict(Outcome.WORSE, Reason.RESTARTS_ROSE,
                       f"restarts per pod-hour rose from {restart_b:.2f} to {restart_a:.2f} ({change})")
    if (before.starts >= MIN_STARTS and after.starts >= MIN_STARTS and before.p95_start_s is not None
            and after.p95_start_s is not None and after.p95_start_s > START_FACTOR * before.p95_start_s
            and after.p95_start_s - before.p95_start_s > START_SLACK_S):
        return Verdict(Outcome.WORSE, Reason.STARTS_SLOWER,
                       f"p95 container start grew from {before.p95_start_s:.1f} s to {after.p95_start_s:.1f} s "
                       f"({change})")
    if ra < RATIO_LOSS * rb:
        return Verdict(Outcome.WORSE, Reason.UTILISATION_FELL, change)
    if ra >= RATIO_GAIN * rb:
        return Verdict(Outcome.KEPT, Reason.UTILISATION_ROSE, change)
    return Verdict(Outcome.NO_CHANGE, Reason.WITHIN_MARGIN, f"{change}, within the {RATIO_GAIN - 1:.0%} margin")
