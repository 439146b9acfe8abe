"""One run summed up: the figures the report compares between modes, each defined in one place.

The engine only records what happened (when each pod started and ended,
each lease, the number of GPUs held over time); everything derived from that
lives here, so that a figure means the same thing in the table, in
``results.json`` and in the validation. The definitions follow
:mod:`shim.sim.assumptions` (section "Metrics"): GPU utilisation is busy
(duty-cycle) GPU-seconds over held GPU-seconds, where busy counts only the
time a GPU stage's container was up (not while an out-of-memory failure had
it waiting for kubelet to restart it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from shim.core.stats import percentile
from shim.sim.engine import PodRun, Run
from shim.sim.model import PodSpec

HOUR = 3600.0
SERIES_BINS = 120
# Instants at which co-located duty cycles are added up; evenly spaced so
# that two runs of the same workload sample the same instants.
OVERSUBSCRIPTION_SAMPLES = 400


@dataclass(frozen=True)
class Summary:
    mode: str
    pods: int
    placed: int
    unplaceable: int
    gpu_utilisation: float | None  # busy / held GPU-seconds, duty cycle
    busy_gpu_s: float
    held_gpu_s: float
    gpus_installed: int
    gpus_held_mean: float
    gpus_held_peak: int
    installed_gpu_utilisation: float | None  # busy / installed GPU-seconds
    gpu_stages_per_held_gpu: float | None  # lease-seconds over held GPU-seconds
    jobs_per_hour: float | None
    completion_p50_s: float | None
    completion_p95_s: float | None
    queue_p50_s: float | None
    queue_p95_s: float | None
    queue_mean_s: float | None
    cpu_node_utilisation: float | None  # requested vCPU-seconds on CPU nodes / their capacity
    cpu_share_off_gpu_nodes: float | None  # vCPU-seconds placed on CPU nodes / all vCPU-seconds
    cpu_stages_rerouted: int
    cpu_stages_fell_back: int
    oversubscribed_share: float | None  # of sampled held GPU-instants whose co-located duty adds up to > 100 %
    hosted_vcpu_h: float  # rerouted CPU stages' vCPU-hours on CPU nodes, by their limits
    hosted_squeezed_share: float | None  # of hosted vCPU-hours over the hosts' capacity: the scheduler bound on top
    gpu_node_overcommit_vcpu_h: float
    cpu_node_overcommit_vcpu_h: float
    makespan_s: float
    # GPU stages out of memory (an allocation that did not fit: above the stage's enforced lease, or beyond what
    # its device had left), each restarted in place after kubelet's back-off
    oom_failures: int = 0
    oom_failures_within_share: int = 0  # of them, stages that asked no more than their own share: a neighbour overran
    oom_stages_failed: int = 0  # GPU stages that failed at least once
    oom_gpu_h_lost: float = 0.0  # GPU-hours the failed stages held while down (their share of a GPU x time down)
    oom_busy_gpu_h_lost: float = 0.0  # busy GPU-hours their series had while they were down: work not done

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Series:
    """GPU utilisation and GPUs held over time, in equal bins from 0 to the makespan."""

    edges_s: tuple[float, ...]
    utilisation: tuple[float | None, ...]
    gpus_held: tuple[float, ...]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _step_integral(steps: Sequence[tuple[float, float]], end: float) -> float:
    total = 0.0
    for (t, value), (t_next, _) in zip(steps, [*steps[1:], (end, 0.0)], strict=True):
        total += value * (max(t, min(t_next, end)) - t) if t < end else 0.0
    return total


def up_segments(o: PodRun) -> list[tuple[float, float]]:
    """When a placed pod's GPU stage ran: its life less the times it was down after running out of memory."""
    assert o.start is not None and o.end is not None
    out, t = [], o.start
    for a, b in o.down:
        if a > t:
            out.append((t, a))
        t = b
    if o.end > t:
        out.append((t, o.end))
    return out


def _busy_s(p: PodSpec, o: PodRun, segments: Sequence[tuple[float, float]]) -> float:
    assert p.gpu is not None and o.start is not None
    profile, phase, start = p.gpu.profile, p.gpu.phase_s, o.start
    return p.gpu.gpus * sum(profile.integrals(phase + (a - start), b - a).busy_s for a, b in segments)


def summarise(run: Run) -> Summary:
    pods, outcomes = run.pods, run.outcomes
    done = [(p, o) for p, o in zip(pods, outcomes, strict=True) if o.start is not None and o.end is not None]
    makespan = max((o.end for _, o in done), default=0.0)
    busy = lost_busy = 0.0
    for p, o in done:
        if p.gpu is not None and o.leases:
            busy += _busy_s(p, o, up_segments(o))
            lost_busy += _busy_s(p, o, o.down)
    device = run.cluster.gpu_memory_bytes
    share: dict[int, float] = {}  # GPUs' worth each pod's leases hold
    for lease in run.leases:
        share[lease.pod] = share.get(lease.pod, 0.0) + lease.memory_bytes / device
    lost_held = sum(share.get(k, 0.0) * (b - a) for k, o in enumerate(outcomes) for a, b in o.down)
    held = _step_integral(run.held_steps, makespan)
    lease_s = sum(lease.end - lease.start for lease in run.leases)
    installed = run.cluster.gpus
    completion = [o.end - p.arrival_s for p, o in done]
    queue = [o.start - p.arrival_s for p, o in done]
    cpu_capacity = run.cluster.cpu_nodes * run.cluster.cpu_node.cpu_cores * makespan
    off = total_cpu = hosted = 0.0
    for p, o in done:
        life = o.end - o.start
        total_cpu += p.total_cpu.cpu_cores * life
        if p.gpu is None:
            off += p.total_cpu.cpu_cores * life
        else:
            moved = sum(limits.cpu_cores for _, limits in o.hosted) * life
            off += moved
            hosted += moved
    # Plain pods alone never exceed a node's books, so anything over a CPU node's capacity is hosted work.
    squeezed = max(0.0, run.cpu_node_overcommit_cpu_s)
    return Summary(
        mode=run.mode.value,
        pods=len(pods),
        placed=len(done),
        unplaceable=sum(1 for o in outcomes if o.unplaceable),
        gpu_utilisation=_ratio(busy, held),
        busy_gpu_s=busy,
        held_gpu_s=held,
        gpus_installed=installed,
        gpus_held_mean=held / makespan if makespan > 0 else 0.0,
        gpus_held_peak=max(count for _, count in run.held_steps),
        installed_gpu_utilisation=_ratio(busy, installed * makespan),
        gpu_stages_per_held_gpu=_ratio(lease_s, held),
        jobs_per_hour=len(done) / (makespan / HOUR) if makespan > 0 else None,
        completion_p50_s=percentile(completion, 50),
        completion_p95_s=percentile(completion, 95),
        queue_p50_s=percentile(queue, 50),
        queue_p95_s=percentile(queue, 95),
        queue_mean_s=sum(queue) / len(queue) if queue else None,
        cpu_node_utilisation=_ratio(_step_integral(run.cpu_node_steps, makespan), cpu_capacity),
        cpu_share_off_gpu_nodes=_ratio(off, total_cpu),
        cpu_stages_rerouted=run.rerouted,
        cpu_stages_fell_back=run.fell_back,
        oversubscribed_share=oversubscribed_share(run, makespan),
        hosted_vcpu_h=hosted / HOUR,
        hosted_squeezed_share=_ratio(squeezed, hosted),
        gpu_node_overcommit_vcpu_h=max(0.0, run.gpu_node_overcommit_cpu_s) / HOUR,
        cpu_node_overcommit_vcpu_h=squeezed / HOUR,
        makespan_s=makespan,
        oom_failures=sum(f.count for f in run.failures),
        oom_failures_within_share=sum(f.count for f in run.failures if f.within_share),
        oom_stages_failed=len({f.pod for f in run.failures}),
        oom_gpu_h_lost=lost_held / HOUR,
        oom_busy_gpu_h_lost=lost_busy / HOUR,
    )


def oversubscribed_share(run: Run, makespan: float, samples: int = OVERSUBSCRIPTION_SAMPLES) -> float | None:
    """Share of (held GPU, instant) samples where the duty cycles of the stages on that GPU add up to over 100 %."""
    if makespan <= 0:
        return None
    width = makespan / samples
    load: dict[tuple[str, int], float] = {}
    for lease in run.leases:
        pod, outcome = run.pods[lease.pod], run.outcomes[lease.pod]
        gpu = pod.gpu
        assert gpu is not None and outcome.start is not None
        first = max(0, math.ceil(lease.start / width - 0.5))
        down = outcome.down
        for k in range(first, samples):
            t = (k + 0.5) * width
            if t >= lease.end:
                break
            if down and any(a <= t < b for a, b in down):
                continue
            key = (lease.device, k)
            load[key] = load.get(key, 0.0) + gpu.profile.duty_at(t - outcome.start + gpu.phase_s)
    if not load:
        return None
    return sum(1 for v in load.values() if v > 1.0 + 1e-9) / len(load)


def series(run: Run, makespan: float, bins: int = SERIES_BINS) -> Series:
    if makespan <= 0:
        return Series((), (), ())
    width = makespan / bins
    edges = (*(k * width for k in range(bins)), makespan)

    def bin_of(t: float) -> int:
        # t // width can land one bin low or high of the float edges; the edges decide.
        k = min(bins - 1, max(0, int(t // width)))
        while k < bins - 1 and edges[k + 1] <= t:
            k += 1
        while k > 0 and edges[k] > t:
            k -= 1
        return k

    busy = [0.0] * bins
    for p, o in zip(run.pods, run.outcomes, strict=True):
        if p.gpu is None or o.start is None or o.end is None or not o.leases:
            continue
        profile, phase, gpus = p.gpu.profile, p.gpu.phase_s, p.gpu.gpus
        for start, end in up_segments(o):
            prev = profile.busy_until(start - o.start + phase)
            t, k = start, bin_of(start)
            while t < end:
                upto = min(end, edges[k + 1]) if k < bins - 1 else end
                now = profile.busy_until(upto - o.start + phase)
                busy[k] += gpus * (now - prev)
                prev, t, k = now, upto, k + 1
    held = [0.0] * bins
    steps = run.held_steps
    for (t, count), (t_next, _) in zip(steps, [*steps[1:], (makespan, 0)], strict=True):
        t_next = min(t_next, makespan)
        if t >= t_next:
            continue
        k = bin_of(t)
        while t < t_next:
            upto = min(t_next, edges[k + 1]) if k < bins - 1 else t_next
            held[k] += count * (upto - t)
            t, k = upto, k + 1
    return Series(
        edges,
        tuple(b / h if h > 0 else None for b, h in zip(busy, held, strict=True)),
        tuple(h / width for h in held),
    )


def completions(run: Run) -> list[float]:
    return sorted(o.end - p.arrival_s for p, o in zip(run.pods, run.outcomes, strict=True)
                  if o.start is not None and o.end is not None)
