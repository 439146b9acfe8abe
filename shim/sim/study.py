"""One comparison, start to finish: size the cluster, run every mode on it, sum up, validate, explain.

The CLI and the tests both need the whole pipeline without the file output,
so it lives here as one function, :func:`study`, that returns values; the
report module only renders them. The targets (weft's GPU utilisation
at least 3x bundled, p95 completion no worse than 1.1x) are judged here, and
when the model misses one the explanation is computed from the run (GPU
stages per held GPU, lease sizes, the lease sensitivity) rather than
asserted.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from shim.core.placement import GPU_MEMORY_ANNOTATION
from shim.core.quantity import parse_memory
from shim.sim.cost import DEFAULT_PRICES, Prices, books, fleet_usd_per_hour
from shim.sim.engine import Run, simulate
from shim.sim.metrics import Series, Summary, completions, series, summarise
from shim.sim.model import GIB, ClusterSpec, GpuProfile, Mode, PodSpec
from shim.sim.readers import DlrmInstance
from shim.sim.validate import Check, dlrm_checks, genai_checks
from shim.sim.workload import LEASE_POLICIES, with_lease

UTILISATION_TARGET = 3.0
COMPLETION_P95_TARGET = 1.1
MODES = (Mode.BUNDLED, Mode.WEFT, Mode.WEFT_FULL, Mode.WEFT_RESERVED, Mode.KAI)


@dataclass
class Study:
    cluster: ClusterSpec
    sizing: str
    needed: dict[str, dict[str, int]]  # nodes each mode needed on its own (when sized from the workload)
    lease: str
    summaries: dict[str, Summary]
    series: dict[str, Series]
    completions: dict[str, list[float]]
    ratios: dict[str, float | None]
    target: dict
    validation: list[Check]
    sensitivity: list[dict]
    runs: dict[str, Run] = field(repr=False)
    elapsed_s: float = 0.0
    prices: Prices = DEFAULT_PRICES
    # Per mode, on the fleet it needs on its own: nodes, squeezed share, cost, ratios to bundled (shim.sim.cost)
    fleet: dict[str, dict] = field(default_factory=dict)
    fleet_note: str = ""


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def size_cluster(pods: Sequence[PodSpec], cluster: ClusterSpec, gpu_given: bool, cpu_given: bool) -> tuple[
        ClusterSpec, str, dict[str, dict[str, int]], dict[str, Run]]:
    """The node counts: as given, or the most any mode needed on pools that grow when nothing fits.

    Also returns what each mode needed on its own (empty when both counts
    were given): the number of GPU nodes bundled pods need for their CPU is
    itself a result; and each mode's run on its own grown pools, which the
    fleet's books (:mod:`shim.sim.cost`) read.
    """
    if gpu_given and cpu_given:
        return cluster, "Node counts as given", {}, {}
    start = replace(cluster, gpu_nodes=cluster.gpu_nodes if gpu_given else 0,
                    cpu_nodes=cluster.cpu_nodes if cpu_given else 0)
    sized = {mode.value: simulate(pods, start, mode, grow_gpu=not gpu_given, grow_cpu=not cpu_given)
             for mode in MODES}
    grown = {name: run.cluster for name, run in sized.items()}
    needed = {name: {"gpu_nodes": c.gpu_nodes, "cpu_nodes": c.cpu_nodes} for name, c in grown.items()}
    gpu = max(c.gpu_nodes for c in grown.values())
    cpu = max(c.cpu_nodes for c in grown.values())
    listed = "; ".join(f"{name} {c.gpu_nodes} GPU and {c.cpu_nodes} CPU nodes" for name, c in grown.items())
    what = " and ".join(w for w, given in (("GPU", gpu_given), ("CPU", cpu_given)) if not given)
    return (replace(cluster, gpu_nodes=gpu, cpu_nodes=cpu),
            f"{what} node counts sized from the workload: the most any mode needed on a pool that grows whenever "
            f"nothing fits ({listed})", needed, sized)


def _lease_facts(run: Run) -> tuple[float | None, float | None]:
    """Mean lease (GiB) of the GPU stages and the GPU-time-weighted share of samples above it."""
    total = above = leased = 0.0
    for pod, out in zip(run.pods, run.outcomes, strict=True):
        if pod.gpu is None or out.start is None or out.end is None:
            continue
        life = out.end - out.start
        lease = _declared_lease(pod)
        if lease is None:
            continue
        total += life
        leased += life * lease / GIB
        above += life * pod.gpu.profile.share_above(lease)
    return (leased / total, above / total) if total else (None, None)


def _declared_lease(pod: PodSpec) -> int | None:
    assert pod.gpu is not None
    key = GPU_MEMORY_ANNOTATION + pod.gpu.name
    return parse_memory(key, pod.annotations[key]) if key in pod.annotations else None


def study(
    pods: Sequence[PodSpec],
    cluster: ClusterSpec,
    *,
    gpu_nodes_given: bool,
    cpu_nodes_given: bool,
    lease: str = "peak",
    dlrm: Sequence[DlrmInstance] | None = None,
    genai: Sequence[GpuProfile] = (),
    sensitivity: bool = True,
    prices: Prices = DEFAULT_PRICES,
) -> Study:
    """Size the cluster, run every mode and sum up.

    ``genai`` (the GenTD26 profiles pods drew from) and ``dlrm`` (the
    instances pods were paired from) say which validation figures apply;
    ``prices`` are the nodes' hourly prices the fleet's cost is counted in.
    """
    began = time.perf_counter()
    leased = with_lease(pods, lease)
    cluster, sizing, needed, sized = size_cluster(leased, cluster, gpu_nodes_given, cpu_nodes_given)
    fleet, fleet_note = _fleet(needed, sized, cluster, prices)
    runs = {mode.value: simulate(leased, cluster, mode) for mode in MODES}
    summaries = {name: summarise(run) for name, run in runs.items()}
    bundled, weft = summaries[Mode.BUNDLED.value], summaries[Mode.WEFT.value]
    ratios = {
        "gpu_utilisation": _ratio(weft.gpu_utilisation, bundled.gpu_utilisation),
        "completion_p95": _ratio(weft.completion_p95_s, bundled.completion_p95_s),
        "gpus_held_mean": _ratio(weft.gpus_held_mean, bundled.gpus_held_mean),
        "jobs_per_hour": _ratio(weft.jobs_per_hour, bundled.jobs_per_hour),
        "gpu_nodes_needed": _ratio(needed[Mode.WEFT.value]["gpu_nodes"], needed[Mode.BUNDLED.value]["gpu_nodes"])
        if needed and not gpu_nodes_given else None,
    }
    validation = genai_checks(runs[Mode.BUNDLED.value], genai) if genai else []
    if dlrm is not None:
        validation += dlrm_checks(runs[Mode.BUNDLED.value], dlrm)
    rows = []
    if sensitivity:
        for policy in LEASE_POLICIES:
            policy_runs = [runs[mode.value] if policy == lease else simulate(with_lease(pods, policy), cluster, mode)
                           for mode in (Mode.WEFT, Mode.KAI)]
            rows.append(_sensitivity_row(policy, *policy_runs, bundled))
    target = _judge(ratios, summaries, runs[Mode.WEFT.value], lease, cluster, rows, needed)
    return Study(
        cluster=cluster, sizing=sizing, needed=needed, lease=lease, summaries=summaries,
        series={name: series(run, summaries[name].makespan_s) for name, run in runs.items()},
        completions={name: completions(run) for name, run in runs.items()},
        ratios=ratios, target=target, validation=validation, sensitivity=rows, runs=runs,
        elapsed_s=time.perf_counter() - began, prices=prices, fleet=fleet, fleet_note=fleet_note,
    )


def _fleet(needed: dict[str, dict[str, int]], sized: dict[str, Run], cluster: ClusterSpec,
           prices: Prices) -> tuple[dict[str, dict], str]:
    """Each mode's books on the fleet it needs on its own, and a note on what they cover."""
    if not needed:
        per_hour = fleet_usd_per_hour(cluster.gpu_nodes, cluster.cpu_nodes, prices)
        return {}, (f"Both node counts were given, so no mode was sized on its own: every mode runs on the same "
                    f"fleet, ${per_hour:,.2f}/h. Leave out --gpu-nodes and --cpu-nodes to compare the fleets each "
                    "mode needs.")
    squeezed, hours = {}, {}
    for name, run in sized.items():
        s = summarise(run)
        squeezed[name] = s.hosted_squeezed_share
        hours[name] = s.makespan_s / 3600.0
    return books(needed, squeezed, hours, prices), (
        "Each mode on the nodes it needs on its own (pools that grow whenever nothing fits, so no pod waits); "
        "its squeezed share is measured on that fleet. The cost is those nodes for the whole run at the hourly "
        "prices below.")


def _sensitivity_row(policy: str, run: Run, kai_run: Run, bundled: Summary) -> dict:
    s, kai = summarise(run), summarise(kai_run)
    mean_lease, above = _lease_facts(run)
    return {
        "lease": policy,
        "mean_lease_gib": mean_lease,
        "share_of_time_over_lease": above,
        "gpu_utilisation": s.gpu_utilisation,
        "gpu_utilisation_ratio": _ratio(s.gpu_utilisation, bundled.gpu_utilisation),
        "gpu_stages_per_held_gpu": s.gpu_stages_per_held_gpu,
        "completion_p95_ratio": _ratio(s.completion_p95_s, bundled.completion_p95_s),
        "oversubscribed_share": s.oversubscribed_share,
        # The same leases enforced (weft) and unenforced (KAI's fractions, packed alike): what failed, what it cost
        "oom_failures": s.oom_failures,
        "oom_failures_within_share": s.oom_failures_within_share,
        "oom_stages_failed": s.oom_stages_failed,
        "oom_gpu_h_lost": s.oom_gpu_h_lost,
        "oom_busy_gpu_h_lost": s.oom_busy_gpu_h_lost,
        "kai_gpu_utilisation": kai.gpu_utilisation,
        "kai_oom_failures": kai.oom_failures,
        "kai_oom_failures_within_share": kai.oom_failures_within_share,
        "kai_oom_stages_failed": kai.oom_stages_failed,
        "kai_oom_gpu_h_lost": kai.oom_gpu_h_lost,
        "kai_oom_busy_gpu_h_lost": kai.oom_busy_gpu_h_lost,
    }


def _judge(ratios: dict[str, float | None], summaries: dict[str, Summary], weft_run: Run, lease: str,
           cluster: ClusterSpec, rows: list[dict], needed: dict[str, dict[str, int]]) -> dict:
    util, p95 = ratios["gpu_utilisation"], ratios["completion_p95"]
    util_met = util is not None and util >= UTILISATION_TARGET
    p95_met = p95 is not None and p95 <= COMPLETION_P95_TARGET
    why: list[str] = []
    notes: list[str] = []
    weft, bundled = summaries[Mode.WEFT.value], summaries[Mode.BUNDLED.value]
    if not util_met and util is not None:
        mean_lease, _ = _lease_facts(weft_run)
        device_gib = cluster.gpu_memory_bytes / GIB
        stages = weft.gpu_stages_per_held_gpu or 0.0
        text = (f"weft shares a held GPU among {stages:.2f} GPU stages on average (bundled "
                f"{bundled.gpu_stages_per_held_gpu or 0:.2f}), and utilisation rises with that number, so "
                f"{UTILISATION_TARGET:g}x needs about {UTILISATION_TARGET:g} stages per held GPU.")
        if mean_lease is not None:
            text += (f" Leases are each pod's {lease} GPU memory, {mean_lease:.1f} GiB on average, with the compute "
                     f"share equal to the memory share, so about {math.floor(device_gib / mean_lease)} fit on one "
                     f"{device_gib:g} GiB GPU; {UTILISATION_TARGET:g} fit only at "
                     f"{device_gib / UTILISATION_TARGET:.1f} GiB or less each.")
        others = [r for r in rows if r["lease"] != lease and r["gpu_utilisation_ratio"] is not None]
        if others:
            best = max(others, key=lambda r: r["gpu_utilisation_ratio"])
            text += (f" Sized at {best['lease']} ({best['mean_lease_gib'] or 0:.1f} GiB on average) the ratio would "
                     f"be {best['gpu_utilisation_ratio']:.2f}x, but the pods would be over their lease "
                     f"{100 * (best['share_of_time_over_lease'] or 0):.1f} % of the time, when MPS fails their "
                     f"allocations: {best['oom_failures']} out-of-memory failures of {best['oom_stages_failed']} "
                     f"stages, {best['oom_gpu_h_lost']:.1f} GPU-hours held while down.")
        why.append(text)
    if not p95_met and p95 is not None:
        why.append(f"weft's p95 completion is {p95:.2f}x bundled's: queueing p95 {weft.queue_p95_s or 0:.0f} s "
                   f"against {bundled.queue_p95_s or 0:.0f} s.")
    for name, s in summaries.items():
        if s.unplaceable:
            notes.append(f"{name} never placed {s.unplaceable} of {s.pods} pods (larger than an empty node, or "
                         "declared in a way the model cannot run), so the modes' figures cover different pods.")
    if needed and not any(s.queue_p95_s for s in summaries.values()):
        gpu_nodes = needed.get(Mode.WEFT.value, {}).get("gpu_nodes")
        notes.append("No pod waited in any mode: the cluster has the GPU nodes bundled pods need, so completion "
                     "times are equal by construction. To compare on a smaller fleet, pass --gpu-nodes (weft alone "
                     f"needed {gpu_nodes}).")
    return {
        "gpu_utilisation_ratio_min": UTILISATION_TARGET,
        "completion_p95_ratio_max": COMPLETION_P95_TARGET,
        "gpu_utilisation_ratio": util,
        "completion_p95_ratio": p95,
        "gpu_utilisation_met": util_met,
        "completion_p95_met": p95_met,
        "met": util_met and p95_met,
        "why": why,
        "notes": notes,
    }
