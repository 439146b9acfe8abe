"""Does the bundled run look like the traces it was built from? The published figures, checked with a tolerance.

A simulator that cannot reproduce the status quo says nothing about weft, so
every run measures its bundled mode against the headline figures of
``validation-targets.json`` that apply to what the model consumes (the ids
below are that file's), each with a tolerance and the reason for it:

* GenTD26 serving (duty cycle mean, share of samples at 0 %, GPU memory held;
  with many pods also the median per-pod mean and the share of pods under
  10 %), measured over the GPU time of the pods the bundled run placed, so
  they test the replay and not just the input file. Each figure is checked
  twice. Against the published value, which covers all 143 pods, with a
  tolerance of two standard errors: of the input file as a sample of the 143
  (the spread of the 143 per-pod means over sqrt(n), finite-population
  corrected; large for the 3-pod sample, zero for the summary) combined with
  this run's own draws (the weighted spread of the placed pods' values), plus
  a floor for the model's rounding. And (``@input``) against the same figure
  computed from the input file, with the draw error alone: that is the test
  of the replay and accounting, and it is tight whatever the sample.
* Prism DLRM (CPU-node vCPU per GPU and the share of vCPU off the GPU node at
  t = 0, 7, 14 and 28 days, the modal HN vCPU per GPU): computed by stage
  over the pods running at each instant in the bundled run. The published
  values are for the full trace (156 apps); a whole-app sample of the file
  gives different ratios, so the simulated value is compared with the same
  figure computed straight from the input file (the pairing and lifetimes
  are what is being tested), with the published value shown beside it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from shim.sim.engine import Run
from shim.sim.model import GIB, GpuProfile
from shim.sim.readers import DlrmInstance

DAY = 86400.0
GENAI_PODS = 143  # pods in GenTD26's duty-cycle file
# Population standard deviations of the 143 per-pod means in
# alibaba-genai2026-pod-summary.csv: duty cycle (percentage points), share of
# samples at 0, GPU memory (GiB). They set how far an n-pod sample may stray.
GENAI_POD_SD = {"duty": 4.79, "zero": 0.145, "memory": 4.41}
# The model's own rounding (two-level summary replay, a replay cut mid-sample).
GENAI_FLOOR = {"duty": 0.2, "zero": 0.01, "memory": 0.25}
DLRM_RELATIVE_TOLERANCE = 0.05  # of the input file's own figure
DLRM_INSTANTS_D = (0, 7, 14, 28)
# From validation-targets.json (tests check these stay equal to that file).
TARGETS = {
    "genai_serving_gpu_duty_mean": 7.03,
    "genai_serving_gpu_duty_zero_frac": 0.668,
    "genai_serving_gpu_mem_held": 23.06,
    "genai_serving_pod_mean_duty_median": 5.78,
    "genai_serving_pods_under_10pct": 0.86,
    "dlrm_cn_vcpu_per_gpu": (91.7, 94.6, 100.3, 116.0),
    "dlrm_cpu_share_off_gpu_node": 0.92,
    "dlrm_hn_vcpu_per_gpu": 8,
}


@dataclass(frozen=True)
class Check:
    id: str
    what: str
    unit: str
    published: float  # the figure in validation-targets.json
    reference: float  # what the simulated value is held to (published, or the input file's own figure)
    simulated: float | None
    tolerance: float  # absolute, in ``unit``
    note: str

    @property
    def passed(self) -> bool:
        return self.simulated is not None and abs(self.simulated - self.reference) <= self.tolerance + 1e-12

    def as_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _file_se(kind: str, n: int) -> float:
    """Standard error of an n-pod file's figure against the 143-pod population (finite-population corrected)."""
    if n >= GENAI_PODS:
        return 0.0
    return GENAI_POD_SD[kind] / math.sqrt(n) * math.sqrt((GENAI_PODS - n) / (GENAI_PODS - 1))


def _draw_se(values: Sequence[float], weights: Sequence[float]) -> float:
    """Standard error of a weighted mean of independent draws: how far another seed's run could land."""
    total = sum(weights)
    if total <= 0 or len(values) < 2:
        return 0.0
    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    variance = sum(w * (v - mean) ** 2 for v, w in zip(values, weights, strict=True)) / total
    return math.sqrt(variance * sum(w * w for w in weights)) / total


_FIGURES = (
    # (id, kind, what, unit, published, scale of the per-pod value)
    ("genai_serving_gpu_duty_mean", "duty", "mean GPU duty cycle over held GPU time (= bundled GPU utilisation)",
     "percent", 7.03),
    ("genai_serving_gpu_duty_zero_frac", "zero", "share of held GPU time at exactly 0 % duty", "fraction", 0.668),
    ("genai_serving_gpu_mem_held", "memory", "mean GPU memory used per held GPU", "GiB", 23.06),
)


def _pool_figure(kind: str, pool: Sequence[GpuProfile]) -> float:
    samples = sum(p.n for p in pool)
    if kind == "duty":
        return 100.0 * sum(p.mean_duty * p.n for p in pool) / samples
    if kind == "zero":
        return sum(p.zero_fraction * p.n for p in pool) / samples
    return sum(p.mean_memory * p.n for p in pool) / samples / GIB


def genai_checks(run: Run, pool: Sequence[GpuProfile]) -> list[Check]:
    """The GenTD26 figures over the GPU time of the pods the bundled run placed, against the published figure
    and against the same figure computed from the input file (``pool``, the profiles pods were drawn from)."""
    per_pod: dict[str, list[float]] = {"duty": [], "zero": [], "memory": []}
    weights: list[float] = []
    whole_series: list[float] = []
    for pod, out in zip(run.pods, run.outcomes, strict=True):
        if pod.gpu is None or out.start is None or out.end is None:
            continue
        life = out.end - out.start
        got = pod.gpu.profile.integrals(pod.gpu.phase_s, life)
        weights.append(pod.gpu.gpus * life)
        per_pod["duty"].append(100.0 * got.busy_s / life)
        per_pod["zero"].append(got.zero_s / life)
        per_pod["memory"].append(got.memory_byte_s / life / GIB)
        if life >= pod.gpu.profile.period:
            whole_series.append(100.0 * got.busy_s / life)
    if not weights or not pool:
        return []
    n = len(pool)
    held = sum(weights)
    source = "the 143-pod population" if n >= GENAI_PODS else f"a {n}-pod sample of the 143"
    checks = []
    for figure, kind, what, unit, published in _FIGURES:
        simulated = sum(v * w for v, w in zip(per_pod[kind], weights, strict=True)) / held
        draw = _draw_se(per_pod[kind], weights)
        note = "" if kind != "memory" else "; the publishers may have scaled memory"
        checks.append(Check(
            figure, what, unit, published, published, simulated,
            2 * math.hypot(_file_se(kind, n), draw) + GENAI_FLOOR[kind],
            f"input is {source}: two standard errors of that sample and of this run's draws{note}"))
        checks.append(Check(
            f"{figure}@input", f"{what}, against the input file's own figure", unit, published,
            _pool_figure(kind, pool), simulated, 2 * draw + GENAI_FLOOR[kind],
            "tests the replay: two standard errors of this run's draws"))
    if n >= 30 and len(whole_series) >= 30:
        # Spread across pods only means something when the run draws from many pods, and a pod's mean is
        # comparable with the published per-pod means only over a whole series (22.8 h), as they were taken.
        under = sum(1 for m in whole_series if m < 10.0) / len(whole_series)
        spread = (f"over the {len(whole_series)} placed pods that ran at least one whole series; pods are drawn "
                  "with replacement, by their share of the observed time")
        checks += [
            Check("genai_serving_pod_mean_duty_median", "median over placed pods of the pod's mean duty cycle",
                  "percent", 5.78, 5.78, statistics.median(whole_series), 0.5, spread),
            Check("genai_serving_pods_under_10pct", "share of placed pods whose mean duty cycle is under 10 %",
                  "fraction", 0.86, 0.86, under, 0.05, spread),
        ]
    return checks


def _live(inst: DlrmInstance, t: float) -> bool:
    return (inst.created is None or inst.created <= t) and (inst.deleted is None or inst.deleted > t)


def _trace_ratio(instances: Sequence[DlrmInstance], t: float) -> tuple[float, float] | None:
    cn = sum(i.vcpu for i in instances if i.role == "CN" and _live(i, t))
    hn = sum(i.vcpu for i in instances if i.role == "HN" and _live(i, t))
    gpus = sum(i.gpus for i in instances if i.role == "HN" and _live(i, t))
    return (cn / gpus, cn / (cn + hn)) if gpus and cn + hn else None


def _run_ratio(run: Run, t: float) -> tuple[float, float] | None:
    cpu_stage = gpu_host = gpus = 0.0
    for pod, out in zip(run.pods, run.outcomes, strict=True):
        if out.start is None or out.end is None or not out.start <= t < out.end:
            continue
        cpu_stage += sum(c.vcpu for c in pod.cpu)
        if pod.gpu is not None:
            gpu_host += pod.gpu.vcpu
            gpus += pod.gpu.gpus
    return (cpu_stage / gpus, cpu_stage / (cpu_stage + gpu_host)) if gpus and cpu_stage + gpu_host else None


def dlrm_checks(run: Run, instances: Sequence[DlrmInstance]) -> list[Check]:
    apps = len({i.app for i in instances})
    sample_note = (f"published for the full trace (156 apps); this file has {apps} apps, so the reference is the "
                   "same figure computed from this file")
    checks = []
    for k, day in enumerate(DLRM_INSTANTS_D):
        t = day * DAY
        trace, sim = _trace_ratio(instances, t), _run_ratio(run, t)
        if trace is None:
            continue
        published = TARGETS["dlrm_cn_vcpu_per_gpu"][k]
        checks.append(Check(f"dlrm_cn_vcpu_per_gpu@{day}d", f"CPU-stage vCPU per GPU of pods running at day {day}",
                            "vCPU/GPU", published, trace[0], None if sim is None else sim[0],
                            DLRM_RELATIVE_TOLERANCE * trace[0], sample_note))
        if day == 0:
            checks.append(Check("dlrm_cpu_share_off_gpu_node@0d", "CPU-stage share of the vCPU of pods running at "
                                "day 0 (what weft moves off the GPU node)", "fraction", 0.92, trace[1],
                                None if sim is None else sim[1], DLRM_RELATIVE_TOLERANCE * trace[1], sample_note))
    hn_ratio = Counter(i.vcpu / i.gpus for i in instances if i.role == "HN")
    placed = Counter(p.gpu.vcpu / p.gpu.gpus for p, o in zip(run.pods, run.outcomes, strict=True)
                     if p.gpu is not None and o.start is not None)
    if hn_ratio and placed:
        mode_trace, count = hn_ratio.most_common(1)[0]
        checks.append(Check("dlrm_hn_vcpu_per_gpu", "modal GPU-stage vCPU per GPU of placed pods", "vCPU/GPU", 8,
                            mode_trace, placed.most_common(1)[0][0], 0.0,
                            f"an input, checked for the pairing: {count / sum(hn_ratio.values()):.0%} of HN rows "
                            "in this file (86 % in the full trace)"))
    return checks


NOT_APPLICABLE = (
    ("pai_*, philly_*, acme_*", "other workloads (MLaaS, training, LLM development): the model replays none of them"),
    ("prism_*, fgd_*", "outcomes of other schedulers (paper abstracts), not properties of the input"),
    ("openb_*", "the openb pod list is not replayed; --openb-nodes only sizes the nodes"),
)
