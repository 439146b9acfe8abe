"""A study rendered three ways: ``results.json`` for machines, ``report.md`` for people, a short table for the terminal.

All three are built from one dictionary (:func:`results`), so the figures in
the Markdown and on stdout are the very numbers in the JSON. Nothing here
computes a metric; :mod:`shim.sim.metrics` and :mod:`shim.sim.study` do.
The JSON carries no timestamps or timings, so two runs with the same inputs
and seed write the same file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from shim.core.stats import percentile
from shim.sim import assumptions
from shim.sim.metrics import Summary
from shim.sim.model import GIB
from shim.sim.study import MODES, Study
from shim.sim.validate import NOT_APPLICABLE

SCHEMA = 1
FIGURES = ("utilisation.png", "completion_cdf.png")
# Where the full public traces live; shim/sim/traces/ holds the samples a run without input flags uses.
TRACE_SOURCES = (
    ("--genai-pods", "Alibaba GenTD26 (SoCC'25), github.com/alibaba/clusterdata cluster-trace-v2026-GenAI/: "
     "pod_gpu_duty_cycle_anon and pod_gpu_memory_used_bytes_anon (.tar.gz) joined on container_ip and "
     "timestamp_anon, their value columns named gpu_duty_cycle_pct and gpu_memory_used_bytes; research or study use"),
    ("--genai-summary", "per-pod summary of the same GenTD26 files: container_ip, n_samples, gpu_duty_mean_pct, "
     "frac_samples_zero_duty, gpu_mem_mean_GiB, gpu_mem_max_GiB"),
    ("--dlrm", "Alibaba Prism DLRM (NSDI'25), github.com/alibaba/clusterdata "
     "cluster-trace-gpu-v2025/disaggregated_DLRM_trace.csv, as published; research or study use"),
    ("--openb-nodes", "Alibaba openb (ATC'23 FGD), github.com/alibaba/clusterdata "
     "cluster-trace-gpu-v2023/csv/openb_node_list_all_node.csv, as published; research or study use"),
)


def results(st: Study, inputs: Mapping[str, object]) -> dict:
    c = st.cluster
    return {
        "schema": SCHEMA,
        "gpu_metric": "duty cycle (fraction of time a kernel runs), busy GPU-seconds over held GPU-seconds",
        "inputs": dict(inputs),
        "cluster": {
            "gpu_nodes": c.gpu_nodes, "gpus_per_node": c.gpus_per_node, "gpu_memory_gib": c.gpu_memory_bytes / GIB,
            "gpu_node_vcpu": c.gpu_node.cpu_cores, "gpu_node_memory_gib": c.gpu_node.memory_bytes / GIB,
            "cpu_nodes": c.cpu_nodes, "cpu_node_vcpu": c.cpu_node.cpu_cores,
            "cpu_node_memory_gib": c.cpu_node.memory_bytes / GIB, "sizing": st.sizing,
        },
        "nodes_needed_by_mode": st.needed,
        "lease": st.lease,
        "modes": {name: s.as_dict() for name, s in st.summaries.items()},
        "ratios_weft_over_bundled": st.ratios,
        "target": st.target,
        "validation": [check.as_dict() for check in st.validation],
        "validation_passed": all(check.passed for check in st.validation),
        "validation_not_applicable": [{"ids": ids, "why": why} for ids, why in NOT_APPLICABLE],
        "lease_sensitivity": st.sensitivity,
        "prices": st.prices.as_dict(),
        "fleet_by_mode": st.fleet,
        "fleet_note": st.fleet_note,
        "series": {
            "edges_h": [e / 3600.0 for e in next(iter(st.series.values())).edges_s] if st.series else [],
            **{name: {"gpu_utilisation": list(s.utilisation), "gpus_held": list(s.gpus_held)}
               for name, s in st.series.items()},
        },
        "completion_quantiles_s": {
            name: [percentile(values, q) for q in range(101)] for name, values in st.completions.items()
        },
        "assumptions": assumptions.sections(),
    }


# -- formatting ---------------------------------------------------------------------------------------------


def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f} %"


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def _hours(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds / 3600:,.2f} h" if seconds >= 3600 else f"{seconds:,.0f} s"


_ROWS = (
    ("GPU utilisation (duty cycle, busy/held)", "gpu_utilisation", _pct, "gpu_utilisation"),
    ("GPUs held, time average", "gpus_held_mean", _num, "gpus_held_mean"),
    ("GPUs held, peak", "gpus_held_peak", lambda x: _num(x, 0), None),
    ("GPUs installed", "gpus_installed", lambda x: _num(x, 0), None),
    ("GPU utilisation of installed GPUs", "installed_gpu_utilisation", _pct, None),
    ("GPU stages per held GPU", "gpu_stages_per_held_gpu", lambda x: _num(x, 2), None),
    ("held GPU time oversubscribed (duty > 100 %)", "oversubscribed_share", lambda x: _pct(x, 2), None),
    ("jobs per hour", "jobs_per_hour", lambda x: _num(x, 2), "jobs_per_hour"),
    ("completion p50", "completion_p50_s", _hours, None),
    ("completion p95", "completion_p95_s", _hours, "completion_p95"),
    ("queueing p50", "queue_p50_s", _hours, None),
    ("queueing p95", "queue_p95_s", _hours, None),
    ("CPU-node utilisation (requested)", "cpu_node_utilisation", _pct, None),
    ("vCPU placed off GPU nodes", "cpu_share_off_gpu_nodes", _pct, None),
    ("CPU stages rerouted / fell back", None, None, None),
    ("hosted CPU stages, vCPU-h", "hosted_vcpu_h", _num, None),
    ("of which squeezed (scheduler bound plain pods on top)", "hosted_squeezed_share", _pct, None),
    ("vCPU-h over GPU-node capacity (fallbacks)", "gpu_node_overcommit_vcpu_h", _num, None),
    ("GPU-stage OOM failures", "oom_failures", lambda x: _num(x, 0), None),
    ("of which within own share (neighbour's overrun)", "oom_failures_within_share", lambda x: _num(x, 0), None),
    ("GPU stages that failed at least once", "oom_stages_failed", lambda x: _num(x, 0), None),
    ("GPU-hours held while down after OOM", "oom_gpu_h_lost", lambda x: _num(x, 2), None),
    ("busy GPU-hours not done while down", "oom_busy_gpu_h_lost", lambda x: _num(x, 2), None),
    ("pods placed / never placed", None, None, None),
)


def _cells(st: Study) -> list[tuple[str, list[str], str]]:
    rows = []
    for label, key, fmt, ratio in _ROWS:
        values = []
        for mode in MODES:
            s = st.summaries[mode.value]
            if label.startswith("CPU stages"):
                values.append(f"{s.cpu_stages_rerouted} / {s.cpu_stages_fell_back}")
            elif label.startswith("pods placed"):
                values.append(f"{s.placed} / {s.unplaceable}")
            else:
                assert key is not None and fmt is not None
                values.append(fmt(getattr(s, key)))
        rows.append((label, values, _times(st.ratios.get(ratio)) if ratio else ""))
    return rows


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.0f}"


def _fleet_rows(st: Study) -> list[list[str]]:
    rows = []
    for mode in MODES:
        f = st.fleet.get(mode.value)
        if f is None:
            continue
        rows.append([mode.value, _num(f["gpu_nodes_needed"], 0), _num(f["cpu_nodes_needed"], 0),
                     _pct(f["hosted_squeezed_share"]), _money(f["fleet_usd_per_hour"]) + "/h",
                     _money(f["fleet_usd_over_run"]), _times(f["gpu_nodes_ratio"]), _times(f["cpu_nodes_ratio"]),
                     _times(f["cost_ratio"])])
    return rows


_FLEET_HEADER = ("mode", "GPU nodes", "CPU nodes", "hosted squeezed", "fleet cost", "over the run",
                 "GPU nodes/bundled", "CPU nodes/bundled", "cost/bundled")


def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return out


def _oom(s: Summary) -> str:
    if not s.oom_failures:
        return "no out-of-memory failure"
    return (f"{s.oom_failures:,} out-of-memory failures of {s.oom_stages_failed:,} GPU stages, "
            f"{s.oom_failures_within_share:,} of them of stages within their own share, "
            f"{s.oom_gpu_h_lost:,.2f} GPU-hours held while down")


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def markdown(st: Study, doc: Mapping, sections: Sequence[str]) -> str:
    t, c = st.target, st.cluster
    lines = ["# weft simulate: bundled pods against weft", ""]
    lines += ["## Inputs", ""]
    for key, value in doc["inputs"].items():
        lines.append(f"- **{key}**: {value}")
    lines += [
        f"- **cluster**: {c.gpu_nodes} GPU nodes of {c.gpus_per_node} x {c.gpu_memory_bytes / GIB:g} GiB GPUs, "
        f"{c.gpu_node.cpu_cores:g} vCPU, {c.gpu_node.memory_bytes / GIB:g} GiB; {c.cpu_nodes} CPU nodes of "
        f"{c.cpu_node.cpu_cores:g} vCPU, {c.cpu_node.memory_bytes / GIB:g} GiB. {st.sizing}.",
        f"- **GPU-stage lease**: each pod's {st.lease} GPU memory, rounded up to a GiB; compute share = memory share.",
        "",
        "## Headline",
        "",
        "GPU utilisation here is the **duty cycle** (fraction of time a kernel runs), busy GPU-seconds over held "
        "GPU-seconds; SM activity would be lower in both modes.",
        "",
        f"- GPU utilisation: bundled {_pct(st.summaries['bundled'].gpu_utilisation)}, weft "
        f"{_pct(st.summaries['weft'].gpu_utilisation)}: **{_times(t['gpu_utilisation_ratio'])}** "
        f"(target at least {t['gpu_utilisation_ratio_min']:g}x: {_verdict(t['gpu_utilisation_met'])}).",
        f"- Job completion p95, weft over bundled: **{_times(t['completion_p95_ratio'])}** (target at most "
        f"{t['completion_p95_ratio_max']:g}x: {_verdict(t['completion_p95_met'])}).",
    ]
    lines += [f"- Why: {why}" for why in t["why"]]
    lines += [f"- Note: {note}" for note in t["notes"]]
    if st.needed:
        lines.append("- GPU nodes each mode needs on its own, so that no pod waits: " + ", ".join(
            f"{name} {n['gpu_nodes']}" for name, n in st.needed.items())
            + f" (weft/bundled {_times(st.ratios.get('gpu_nodes_needed'))}); a bundled pod needs its CPU stage's "
            "vCPU on the GPU node, which caps how many GPUs of a node it can use.")
    kai, weft = st.summaries.get("kai-fractions"), st.summaries["weft"]
    if kai is not None:
        lines.append(
            f"- GPU memory enforced or not, the same shares packed alike: weft (each lease a hard limit) "
            f"{_oom(weft)}; kai-fractions (no limit between the stages on a GPU) {_oom(kai)}. "
            + ("Every stage's share is at least the most its series holds, so nothing can run out here; the lease "
               "sensitivity below shows smaller shares." if st.lease == "peak" else
               "See the lease sensitivity below for the other sizes."))
    reserved = st.fleet.get("weft-reserved")
    if reserved is not None:
        lines.append(
            f"- Fleet for the same work, hosted stages reserved (weft-reserved) against bundled: GPU nodes "
            f"**{_times(reserved['gpu_nodes_ratio'])}**, CPU nodes **{_times(reserved['cpu_nodes_ratio'])}**, cost "
            f"**{_times(reserved['cost_ratio'])}**, with {_pct(reserved['hosted_squeezed_share'])} of hosted "
            "vCPU-hours squeezed (see Fleet).")
    lines += ["", "## Fleet: the nodes each mode needs, and their cost", "", st.fleet_note, ""]
    if st.fleet:
        lines += _md_table(_FLEET_HEADER, _fleet_rows(st))
        lines.append("")
    p = st.prices
    lines += [f"- GPU node: ${p.gpu_node_usd_per_hour:g}/h: {p.gpu_node_source}.",
              f"- CPU node: ${p.cpu_node_usd_per_hour:g}/h: {p.cpu_node_source}.",
              "- Hosted squeezed: the share of hosted CPU stages' vCPU-hours over their host's capacity, because the "
              "scheduler bound plain pods on top of stages it could not see. A fleet that squeezes is smaller than "
              "the work needs: the stages it squeezes starve, and the GPU stages they feed wait. With reservations "
              "(weft-reserved) the scheduler sees every hosted stage: 0 by construction.",
              "", "## Results", ""]
    lines += _md_table(["", *[m.value for m in MODES], "weft/bundled"],
                       [[label, *values, ratio] for label, values, ratio in _cells(st)])
    if st.sensitivity:
        lines += ["", "## GPU-stage lease sensitivity (weft)", "",
                  "The same pods with the lease sized differently; 'over lease' is the share of GPU time a pod's "
                  "memory is above its lease, when MPS would fail its allocations.", ""]
        lines += _md_table(
            ["lease", "mean lease", "over lease", "GPU utilisation", "weft/bundled", "stages per held GPU",
             "p95 completion ratio", "oversubscribed"],
            [[r["lease"], f"{_num(r['mean_lease_gib'])} GiB", _pct(r["share_of_time_over_lease"], 2),
              _pct(r["gpu_utilisation"]), _times(r["gpu_utilisation_ratio"]), _num(r["gpu_stages_per_held_gpu"], 2),
              _times(r["completion_p95_ratio"]), _pct(r["oversubscribed_share"], 2)] for r in st.sensitivity])
        lines += ["", "### Out of memory: the shares enforced (weft) or not (kai-fractions)", "",
                  "The same shares, packed alike. weft's broker holds each stage to its lease, so a stage above it "
                  "fails alone; under KAI's fractions nothing does, so a stage may use what its neighbours leave, "
                  "and when the stages on a GPU hold more than it has, the allocation that does not fit fails, "
                  "whoever overran. Each failed stage is restarted in place after kubelet's back-off.", ""]
        lines += _md_table(
            ["lease", "weft: failures (stages)", "weft: within own share", "weft: GPU-h down",
             "kai: failures (stages)", "kai: within own share", "kai: GPU-h down", "kai: GPU utilisation"],
            [[r["lease"], f"{r['oom_failures']:,} ({r['oom_stages_failed']:,})",
              f"{r['oom_failures_within_share']:,}", _num(r["oom_gpu_h_lost"], 2),
              f"{r['kai_oom_failures']:,} ({r['kai_oom_stages_failed']:,})",
              f"{r['kai_oom_failures_within_share']:,}", _num(r["kai_oom_gpu_h_lost"], 2),
              _pct(r["kai_gpu_utilisation"])] for r in st.sensitivity])
    lines += ["", "## Validation of the bundled mode", ""]
    if st.validation:
        lines += _md_table(
            ["target", "what", "published", "held to", "simulated", "tolerance", "result", "note"],
            [[v.id, v.what, f"{v.published:g} {v.unit}", f"{v.reference:.4g}", _num(v.simulated, 3),
              f"±{v.tolerance:.3g}", "pass" if v.passed else "FAIL", v.note] for v in st.validation])
    else:
        lines.append("No validation target applies to these inputs (no GenTD26 or DLRM file).")
    lines += ["", "Not applicable to this model:", ""]
    lines += [f"- `{ids}`: {why}" for ids, why in NOT_APPLICABLE]
    lines += ["", "## Figures", "", "![GPU utilisation over time](utilisation.png)", "",
              "![Job completion time CDF](completion_cdf.png)", "", "## Assumptions", ""]
    for title, items in assumptions.sections().items():
        if title in sections:
            lines += [f"### {title}", "", *[f"- {item}" for item in items], ""]
    lines += ["## Where the public traces are", ""]
    lines += [f"- {flag}: {where}" for flag, where in TRACE_SOURCES]
    return "\n".join(lines) + "\n"


def table(st: Study) -> str:
    c = st.cluster
    head = (f"{sum(1 for _ in st.runs['bundled'].pods)} pods on {c.gpu_nodes} GPU nodes ({c.gpus} GPUs) and "
            f"{c.cpu_nodes} CPU nodes; leases at each pod's {st.lease} GPU memory")
    keep = {"GPU utilisation (duty cycle, busy/held)", "GPUs held, time average", "GPUs held, peak", "jobs per hour",
            "completion p50", "completion p95", "queueing p95", "CPU-node utilisation (requested)",
            "CPU stages rerouted / fell back", "GPU-stage OOM failures",
            "of which within own share (neighbour's overrun)", "GPU-hours held while down after OOM"}
    width = max(len(label) for label in keep)
    out = [head, f"{'':{width}}  " + "  ".join(f"{m.value:>18}" for m in MODES) + f"  {'weft/bundled':>12}"]
    for label, values, ratio in _cells(st):
        if label in keep:
            out.append(f"{label:{width}}  " + "  ".join(f"{v:>18}" for v in values) + f"  {ratio:>12}")
    t = st.target
    out.append(f"target: GPU utilisation >= {t['gpu_utilisation_ratio_min']:g}x: "
               f"{_verdict(t['gpu_utilisation_met'])} ({_times(t['gpu_utilisation_ratio'])}); p95 completion <= "
               f"{t['completion_p95_ratio_max']:g}x: {_verdict(t['completion_p95_met'])} "
               f"({_times(t['completion_p95_ratio'])})")
    if st.fleet:
        p = st.prices
        out.append(f"fleet each mode needs on its own (GPU node ${p.gpu_node_usd_per_hour:g}/h, CPU node "
                   f"${p.cpu_node_usd_per_hour:g}/h; sources in report.md):")
        widths = (18, 9, 9, 15, 12, 14, 17, 17, 12)
        out.append("  ".join(f"{h:>{w}}" for h, w in zip(_FLEET_HEADER, widths, strict=True)))
        for row in _fleet_rows(st):
            out.append("  ".join(f"{c:>{w}}" for c, w in zip(row, widths, strict=True)))
    elif st.fleet_note:
        out.append(st.fleet_note)
    passed = sum(1 for v in st.validation if v.passed)
    out.append(f"validation (bundled): {passed}/{len(st.validation)} within tolerance")
    return "\n".join(out)
