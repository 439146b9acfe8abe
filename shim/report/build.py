"""Put a report together: find the workload's pods, choose the windows and the step, fetch, measure, decide.

Everything outside comes through a :class:`~shim.report.source.Source` and
the ``state_opt_in`` callable (the agent's state directory, read by the CLI),
so this runs against the fake in unit tests exactly as against Prometheus.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shim.report import windows as win
from shim.report.compute import Figures, figures
from shim.report.errors import NoOptInRecord, UnknownWorkload, UsageError
from shim.report.model import Prices, Series, Window, Workload
from shim.report.source import Signal, Source
from shim.report.verdict import Verdict, decide
from shim.report.workload import backout

# Prometheus refuses range queries of more than 11,000 points per series.
MAX_POINTS = 10_000
ACTIVE_SIGNALS = (Signal.GR_ENGINE_ACTIVE, Signal.GPU_UTIL)
_PER_WINDOW = (Signal.LEASE_SHARE, Signal.LEASE_BYTES, Signal.PLUGIN_GPUS, Signal.DEVICE_MEMORY, Signal.FB_USED,
               Signal.CPU, Signal.RESTARTS, Signal.STARTED, Signal.LAST_TERMINATED, Signal.CREATED, Signal.POD_NODE,
               Signal.GPU_NODES, Signal.NODE_LABELS)


@dataclass(frozen=True)
class Request:
    workload: Workload
    now: float
    before: str | None = None  # START..END
    after: str | None = None
    opt_in: str | None = None  # a time
    window: float = 7 * 86400.0  # longest window chosen around an opt-in moment
    lookback: float = 30 * 86400.0  # how far back to look for the pods and the opt-in record
    step: float | None = None  # default: the scrape interval
    state_opt_in: Callable[[str, Sequence[str]], float | None] | None = None


@dataclass(frozen=True)
class Report:
    workload: Workload
    prometheus: str
    pods: tuple[str, ...]
    windows: win.Windows
    step: float
    scrape_interval: float
    active_metric: str | None
    before: Figures
    after: Figures
    verdict: Verdict
    backout: str
    notes: tuple[str, ...]


def build(source: Source, req: Request, prices: Prices) -> Report:
    w = req.workload
    fixed = win.from_flags(req.before, req.after, req.opt_in, req.now)
    opt_in_flag = win.parse_time(req.opt_in, req.now, "--opt-in") if req.opt_in is not None else None
    if fixed is not None:
        span = (fixed.before.start, fixed.after.end)
    elif opt_in_flag is not None:
        span = (opt_in_flag - req.window, req.now)
    else:
        span = (req.now - req.lookback, req.now)
    pods = sorted(source.pods(w, *span))
    if not pods:
        raise UnknownWorkload(
            f"no pods of {w} in Prometheus at {source.address} between {win.iso(span[0])} and {win.iso(span[1])} "
            "(looked in kube-state-metrics' kube_pod_owner / kube_pod_labels): check the name and --namespace, "
            "or widen --lookback")
    ws = fixed or _around_record(source, req, pods, opt_in_flag)

    interval = source.scrape_interval(w.namespace, pods, ws.after.end) or source.scrape_interval(
        w.namespace, pods, ws.before.end)
    if req.step is not None:
        interval = req.step
    if interval is None:
        raise UsageError(f"cannot tell the scrape interval: Prometheus at {source.address} has no raw samples of the "
                         "pods near the ends of the windows; pass --step (your scrape interval, like 30s)")
    win.check_against_scrape(ws, interval, {"before": "--before", "after": "--after"} if fixed else {})
    longest = max(ws.before.seconds, ws.after.seconds)
    step = interval * max(1, math.ceil(longest / interval / MAX_POINTS))

    notes: list[str] = []
    data = {wnd.name: {sig: source.series(sig, w.namespace, pods, wnd, step) for sig in _PER_WINDOW}
            for wnd in (ws.before, ws.after)}
    active = _active(source, w.namespace, pods, (ws.before, ws.after), step, data, notes)
    fig = {name: figures(wnd, step, pods, data[name], active, prices)
           for name, wnd in (("before", ws.before), ("after", ws.after))}
    verdict = decide(fig["before"], fig["after"])
    if step > interval:
        notes.append(f"step {win.human(step)} (the scrape interval, {win.human(interval)}, widened to stay under "
                     f"Prometheus' points-per-series limit)")
    for f in fig.values():
        if f.shared_fraction > 0:
            notes.append(f"{f.window.name}: {f.shared_fraction:.0%} of the GPU-seconds held were leases or "
                         "device-plugin replicas smaller than a device; dcgm-exporter's activity is per device, so it "
                         "includes the other tenants' work")
    return Report(workload=w, prometheus=source.address, pods=tuple(pods), windows=ws, step=step,
                  scrape_interval=interval, active_metric=active.value if active else None, before=fig["before"],
                  after=fig["after"], verdict=verdict, backout=backout(w), notes=tuple(notes))


def _around_record(source: Source, req: Request, pods: list[str], opt_in_flag: float | None) -> win.Windows:
    if opt_in_flag is not None:
        return win.around(opt_in_flag, req.now, req.window, "--opt-in", "--opt-in")
    ns = req.workload.namespace
    at = source.opt_in(ns, pods, req.now - req.lookback, req.now)
    if at is not None:
        return win.around(at, req.now, req.window, "weft metrics")
    if req.state_opt_in is not None:
        at = req.state_opt_in(ns, pods)
        if at is not None:
            return win.around(at, req.now, req.window, "state dir")
    raise NoOptInRecord(
        f"no record of when {req.workload} opted in (no weft_sandbox_opted_in_timestamp_seconds for its pods in "
        f"the last {win.human(req.lookback)}{', nor in --state-dir' if req.state_opt_in else ''}): give the windows "
        "with --before START..END --after START..END, or the moment with --opt-in TIME")


def _active(source: Source, ns: str, pods: list[str], windows: tuple[Window, Window], step: float,
            data: dict[str, dict[Signal, list[Series]]], notes: list[str]) -> Signal | None:
    """The DCGM activity metric both windows have: GR_ENGINE_ACTIVE if it can, else GPU_UTIL."""
    have: dict[Signal, dict[str, bool]] = {}
    for sig in ACTIVE_SIGNALS:
        for wnd in windows:
            data[wnd.name][sig] = source.series(sig, ns, pods, wnd, step)
        have[sig] = {wnd.name: bool(data[wnd.name][sig]) for wnd in windows}
        if all(have[sig].values()):
            if sig is Signal.GPU_UTIL:
                notes.append("GPU activity from DCGM_FI_DEV_GPU_UTIL (the share of time a kernel ran): "
                             "DCGM_FI_PROF_GR_ENGINE_ACTIVE is not in both windows; enable DCGM profiling metrics "
                             "for the finer measure")
            return sig
    lacking = [wnd.name for wnd in windows if not any(have[s][wnd.name] for s in ACTIVE_SIGNALS)]
    if not lacking:
        notes.append("one window has only DCGM_FI_PROF_GR_ENGINE_ACTIVE and the other only DCGM_FI_DEV_GPU_UTIL: "
                     "they measure different things, so GPU activity is left out. No verdict without it.")
        return None
    notes.append(f"no DCGM activity series for the pods in the {' and '.join(lacking)} window: looked for "
                 "DCGM_FI_PROF_GR_ENGINE_ACTIVE and DCGM_FI_DEV_GPU_UTIL with namespace and pod labels (or "
                 "exported_namespace and exported_pod, as a scrape that does not honour the exporter's labels "
                 "leaves them); dcgm-exporter needs its Kubernetes pod mapping on (-k, or "
                 "DCGM_EXPORTER_KUBERNETES=true). No verdict without them.")
    return None
