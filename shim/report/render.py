"""The report as a terminal table, as Markdown for a ticket, and as one JSON object.

All three show the same rows from :func:`rows`, so they cannot disagree.
A figure that could not be measured shows as ``-`` (``null`` in JSON) with
the reason among the notes, never as a zero. Each ends with the step that
backs the workload out of weft, after any notes, so it is the last thing read.
"""

from __future__ import annotations

import json
from typing import Any

from shim.report.build import Report
from shim.report.compute import Figures
from shim.report.windows import human, iso

_GIB = 2**30


def _gpu_h(s: float | None) -> str:
    return "-" if s is None else f"{s / 3600:.2f}"


def _pct(r: float | None) -> str:
    return "-" if r is None else f"{r:.1%}"


def _gib(b: float | None) -> str:
    return "-" if b is None else f"{b / _GIB:.1f}"


def _money(f: Figures, attr: str) -> str:
    return "-" if f.costs is None else f"{f.costs.currency}{getattr(f.costs, attr):,.2f}"


def rows(rep: Report) -> list[tuple[str, str, str]]:
    b, a = rep.before, rep.after
    active = f"GPU-hours active ({rep.active_metric or 'no DCGM'})"
    spec: list[tuple[str, Any]] = [
        ("window", lambda f: f"{iso(f.window.start)} .. {iso(f.window.end)} ({human(f.window.seconds)})"),
        ("pods seen", lambda f: str(f.pods)),
        ("GPU-hours held", lambda f: _gpu_h(f.held_gpu_s) + (f" ({', '.join(f.held_from)})" if f.held_from else "")),
        (active, lambda f: _gpu_h(f.active_gpu_s)),
        ("GPU-active / held", lambda f: _pct(f.ratio)),
        ("GPU memory held, mean GiB", lambda f: _gib(f.memory_held_bytes)),
        ("GPU memory used, mean GiB", lambda f: _gib(f.memory_used_bytes)),
        ("CPU core-hours on GPU nodes", lambda f: f"{f.cpu_gpu_node_s / 3600:.2f}"),
        ("CPU core-hours on CPU hosts", lambda f: f"{f.cpu_hosts_s / 3600:.2f}"),
        ("pod restarts", lambda f: f"{f.restarts} ({f.pod_hours:.1f} pod-hours)"),
        ("p95 container start", lambda f: "-" if f.p95_start_s is None else f"{f.p95_start_s:.1f} s ({f.starts})"),
        ("GPU cost held", lambda f: _money(f, "held")),
        ("GPU cost active", lambda f: _money(f, "active")),
        ("GPU cost held but idle", lambda f: _money(f, "idle")),
        ("CPU cost on GPU nodes / hosts",
         lambda f: "-" if f.costs is None else f"{_money(f, 'cpu_gpu_node')} / {_money(f, 'cpu_hosts')}"),
        ("steps with GPU data", lambda f: f"{min(f.held_samples, f.active_samples)} at {human(f.step)}"),
    ]
    return [(name, fn(b), fn(a)) for name, fn in spec]


def _notes(rep: Report) -> list[str]:
    notes = list(rep.notes)
    for f in (rep.before, rep.after):
        notes += [f"{f.window.name}: {n}" for n in f.notes]
    return list(dict.fromkeys(notes))


def _header(rep: Report) -> list[str]:
    w = rep.windows
    if w.source == "flags":
        # The flags fix both windows; no opt-in moment was looked up or used.
        split = "windows from --before and --after (weft's record of the opt-in moment is not used)"
    else:
        split = f"opted in at {iso(w.opt_in)} (windows from {w.source})"
    return [f"weft report: {rep.workload} ({len(rep.pods)} pods) from {rep.prometheus}", split]


def table(rep: Report) -> str:
    r = rows(rep)
    w0 = max(len(n) for n, _, _ in r)
    w1 = max(len(x) for _, x, _ in [*r, ("", "before", "")])
    lines = [*_header(rep), "", f"{'':{w0}}  {'before':{w1}}  after"]
    lines += [f"{n:{w0}}  {x:{w1}}  {y}" for n, x, y in r]
    v = rep.verdict
    lines += ["", f"verdict: {v.outcome.value} ({v.reason.value}): {v.detail}", f"rule: {v.rule}"]
    notes = _notes(rep)
    if notes:
        lines += ["", "notes:"] + [f"- {n}" for n in notes]
    return "\n".join([*lines, "", f"to back out: {rep.backout}"])


def markdown(rep: Report) -> str:
    v = rep.verdict
    lines = [f"### weft report: `{rep.workload}`", "", *(f"{h}  " for h in _header(rep)[1:]), "",
             "| | before | after |", "| --- | --- | --- |"]
    lines += [f"| {n} | {x} | {y} |" for n, x, y in rows(rep)]
    lines += ["", f"**Verdict: {v.outcome.value}** ({v.reason.value}): {v.detail}", "", f"Rule: {v.rule}"]
    notes = _notes(rep)
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join([*lines, "", f"To back out: {rep.backout}"]) + "\n"


def _fig(f: Figures) -> dict[str, Any]:
    return {
        "start": iso(f.window.start), "end": iso(f.window.end), "seconds": f.window.seconds, "step_s": f.step,
        "gpu_seconds_held": f.held_gpu_s, "held_from": list(f.held_from), "gpu_seconds_active": f.active_gpu_s,
        "active_over_held": f.ratio, "steps_with_gpu_held": f.held_samples, "steps_with_activity": f.active_samples,
        "gpu_memory_held_bytes_mean": f.memory_held_bytes, "gpu_memory_used_bytes_mean": f.memory_used_bytes,
        "cpu_seconds_gpu_nodes": f.cpu_gpu_node_s, "cpu_seconds_hosts": f.cpu_hosts_s,
        "restarts": f.restarts, "pod_hours": f.pod_hours, "restarts_per_pod_hour": f.restarts_per_pod_hour,
        "p95_container_start_s": f.p95_start_s, "container_starts": f.starts,
        "shared_lease_fraction": f.shared_fraction,
        "costs": None if f.costs is None else {
            "currency": f.costs.currency, "gpu_held": f.costs.held, "gpu_active": f.costs.active,
            "gpu_idle": f.costs.idle, "cpu_gpu_nodes": f.costs.cpu_gpu_node, "cpu_hosts": f.costs.cpu_hosts},
        "notes": list(f.notes),
    }


def as_json(rep: Report) -> str:
    v = rep.verdict
    doc = {
        "workload": {"namespace": rep.workload.namespace, "kind": rep.workload.kind or "selector",
                     "name": rep.workload.name, "selector": [str(m) for m in rep.workload.selector]},
        "prometheus": rep.prometheus, "pods": list(rep.pods),
        "opt_in": iso(rep.windows.opt_in), "windows_from": rep.windows.source,
        "scrape_interval_s": rep.scrape_interval, "active_metric": rep.active_metric,
        "before": _fig(rep.before), "after": _fig(rep.after),
        "verdict": {"outcome": v.outcome.value, "reason": v.reason.value, "detail": v.detail, "rule": v.rule},
        "notes": _notes(rep), "backout": rep.backout,
    }
    return json.dumps(doc, indent=2)
