"""Pods out of traces or out of a seeded generator: the workload both modes replay.

Two sources of pod shapes (the Prism DLRM trace, or a synthetic Poisson
stream) and one source of GPU behaviour (GenTD26 profiles, or constant duty
cycles) are combined here, as :mod:`shim.sim.assumptions` describes under
"DLRM workload", "GenTD26 GPU behaviour" and "Synthetic workload". The GPU
stage's memory lease is set last, by :func:`with_lease`, so that the lease
sensitivity runs replay exactly the same pods with only the lease changed.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shim.core.placement import GPU_MEMORY_ANNOTATION
from shim.sim.model import GIB, CpuContainer, GpuProfile, GpuStage, PodSpec
from shim.sim.readers import DlrmInstance

LEASE_POLICIES = ("peak", "p99", "p95", "mean")
CN_CONTAINER, HN_CONTAINER = "cn", "hn"
# A CN and an HN are taken for parts of one replica only when their creation
# and deletion times differ by at most this much in total: wider pairs would
# move CPU demand in time (the validation measures that drift).
PAIR_WINDOW_S = 86400.0
CPU_CONTAINER, GPU_CONTAINER = "cpu-stage", "gpu-stage"


def genai_pool(samples: Sequence[GpuProfile], summary: Sequence[GpuProfile]) -> list[GpuProfile]:
    """The profiles pods draw from: every summary pod, replaced by its full series where the sample file has it."""
    series = {p.name: p for p in samples}
    pool = [series.pop(p.name, p) for p in summary]
    return pool + list(series.values())


def lease_bytes(profile: GpuProfile, policy: str) -> int:
    """The memory a GPU stage declares under ``policy``, rounded up to a whole GiB as a person would write it."""
    if policy == "peak":
        raw = profile.peak_bytes
    elif policy == "mean":
        raw = profile.mean_memory
    elif policy in ("p99", "p95"):
        # A profile replayed at its mean (summary-only) has no quantiles: keep its peak, the safe choice.
        flat = len(set(profile.memory)) == 1 and profile.peak_bytes > profile.memory[0]
        raw = profile.peak_bytes if flat else profile.memory_quantile(int(policy[1:]) / 100.0)
    else:
        raise ValueError(f"lease policy {policy!r} is not one of {', '.join(LEASE_POLICIES)}")
    return max(1, math.ceil(raw / GIB)) * GIB


def with_lease(pods: Sequence[PodSpec], policy: str) -> list[PodSpec]:
    """The same pods with ``weft.io/gpu-memory.<gpu container>`` set by ``policy`` (existing ones left alone)."""
    out = []
    for pod in pods:
        if pod.gpu is None:
            out.append(pod)
            continue
        key = GPU_MEMORY_ANNOTATION + pod.gpu.name
        if key in pod.annotations:
            out.append(pod)
            continue
        gib = lease_bytes(pod.gpu.profile, policy) // GIB
        out.append(replace(pod, annotations={**pod.annotations, key: f"{gib}Gi"}))
    return out


def _draw(pool: Sequence[GpuProfile], rng: random.Random) -> tuple[GpuProfile, float]:
    # Weighted by samples: a pod observed for an hour is an hour of GenTD26's GPU time, not a whole pod's worth,
    # and the published per-sample figures weigh it so.
    profile = rng.choices(pool, weights=[p.n for p in pool])[0]
    return profile, rng.randrange(profile.n) * profile.step_s


# -- DLRM -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Life:
    arrival: float
    run: float


def _life(inst: DlrmInstance, trace_end: float, duration: float | None) -> _Life | None:
    arrival = inst.created if inst.created is not None else 0.0
    started = inst.scheduled if inst.scheduled is not None else arrival
    end = inst.deleted if inst.deleted is not None else trace_end
    if duration is not None:
        if arrival >= duration:
            return None
        end = min(end, duration)
    run = end - started
    return _Life(arrival, run) if run > 0 else None


def _pairs(cns: list[DlrmInstance], hns: list[DlrmInstance], trace_end: float) -> list[
        tuple[DlrmInstance | None, DlrmInstance | None]]:
    """Each HN (in creation order) with the unpaired CN whose lifetime is nearest its own, if near enough."""
    def span(inst: DlrmInstance) -> tuple[float, float]:
        return (inst.created if inst.created is not None else 0.0,
                inst.deleted if inst.deleted is not None else trace_end)

    free = list(cns)
    out: list[tuple[DlrmInstance | None, DlrmInstance | None]] = []
    for hn in hns:
        h0, h1 = span(hn)
        best: DlrmInstance | None = None
        best_gap = PAIR_WINDOW_S
        for cn in free:
            c0, c1 = span(cn)
            gap = abs(c0 - h0) + abs(c1 - h1)
            if gap <= best_gap and (best is None or gap < best_gap):
                best, best_gap = cn, gap
        if best is not None:
            free.remove(best)
        out.append((best, hn))
    out.extend((cn, None) for cn in free)
    return out


def dlrm_pods(
    instances: Sequence[DlrmInstance],
    trace_end: float,
    pool: Sequence[GpuProfile],
    rng: random.Random,
    *,
    duration: float | None = None,
) -> list[PodSpec]:
    """Pair each app's HNs with CNs alive at the same time into pods; see the assumptions."""
    apps: dict[str, dict[str, list[DlrmInstance]]] = {}
    for inst in instances:
        apps.setdefault(inst.app, {"CN": [], "HN": []})[inst.role].append(inst)

    def order(inst: DlrmInstance) -> tuple[float, float, int]:
        created = inst.created if inst.created is not None else 0.0
        deleted = inst.deleted if inst.deleted is not None else math.inf
        return created, deleted, inst.order

    pods: list[PodSpec] = []
    for app, roles in apps.items():
        for cn, hn in _pairs(sorted(roles["CN"], key=order), sorted(roles["HN"], key=order), trace_end):
            owner = hn if hn is not None else cn
            assert owner is not None
            life = _life(owner, trace_end, duration)
            if life is None:
                continue
            cpu = () if cn is None else (CpuContainer(CN_CONTAINER, cn.vcpu, cn.memory_bytes),)
            gpu = None
            if hn is not None:
                profile, phase = _draw(pool, rng)
                gpu = GpuStage(HN_CONTAINER, hn.vcpu, hn.memory_bytes, profile, gpus=hn.gpus, phase_s=phase)
            name = f"{app}/{owner.name}" if cn is None or hn is None else f"{app}/{hn.name}+{cn.name}"
            pods.append(PodSpec(name, life.arrival, life.run, cpu, gpu, app=app))
    pods.sort(key=lambda p: p.arrival_s)  # stable: trace order within one instant
    return pods


# -- synthetic ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SyntheticSpec:
    pods: int
    arrival_rate_per_h: float
    run_time_s: float
    cpu_stage: tuple[float, int]  # vCPU, memory bytes
    gpu_host: tuple[float, int]
    stage_gpu_memory_bytes: int
    duty: Callable[[random.Random], float]  # a fraction, drawn per pod


def parse_duty(spec: str) -> Callable[[random.Random], float]:
    """``7`` (percent, every pod), ``uniform:LO,HI`` (percent) or ``beta:A,B``; raises ValueError saying which form."""
    text = spec.strip()
    kind, _, rest = text.partition(":")
    try:
        if not rest:
            value = float(kind)
            if not 0 <= value <= 100:
                raise ValueError
            return lambda _rng: value / 100.0
        args = [float(x) for x in rest.split(",")]
        if kind == "uniform" and len(args) == 2 and 0 <= args[0] <= args[1] <= 100:
            lo, hi = args
            return lambda rng: rng.uniform(lo, hi) / 100.0
        if kind == "beta" and len(args) == 2 and args[0] > 0 and args[1] > 0:
            a, b = args
            return lambda rng: rng.betavariate(a, b)
    except ValueError:
        pass
    raise ValueError(f"{spec!r} is not a duty cycle: use a percent (7), uniform:LO,HI (percent) or beta:A,B")


def synthetic_pods(spec: SyntheticSpec, pool: Sequence[GpuProfile], rng: random.Random) -> list[PodSpec]:
    pods = []
    t = 0.0
    for k in range(spec.pods):
        if k:
            t += rng.expovariate(spec.arrival_rate_per_h / 3600.0)
        run = max(1.0, rng.expovariate(1.0 / spec.run_time_s))
        if pool:
            profile, phase = _draw(pool, rng)
        else:
            profile = GpuProfile.constant(f"synthetic-{k}", spec.duty(rng), spec.stage_gpu_memory_bytes)
            phase = 0.0
        cpu = (CpuContainer(CPU_CONTAINER, spec.cpu_stage[0], spec.cpu_stage[1]),)
        gpu = GpuStage(GPU_CONTAINER, spec.gpu_host[0], spec.gpu_host[1], profile, phase_s=phase)
        pods.append(PodSpec(f"pod-{k:05d}", t, run, cpu, gpu, app="synthetic"))
    return pods
