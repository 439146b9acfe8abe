"""``weft report WORKLOAD``: the command line (flags, config, output formats) around :mod:`shim.report.build`.

``shim/cli.py`` wires this in with :func:`add_parser`. Every bad input comes
back as a :class:`~shim.report.errors.ReportError` naming the flag to change;
``weft``'s main prints it as ``weft report: <message>`` and exits 2, as
argparse does for a malformed command line. A report exits 0 when it gives a
verdict and 3 when it cannot (too little data, no DCGM), so a pipeline can
tell the three apart. This is the one module of the package that touches the
agent's state directory (read-only, for ``--state-dir``), and it imports
that lazily.
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path

from shim.report import windows as win
from shim.report.errors import UsageError
from shim.report.model import Price, Prices

EXIT_VERDICT = 0  # kept, no change or worse
EXIT_ERROR = 2  # a ReportError, printed by weft's main; argparse's own errors exit 2 too
EXIT_NO_VERDICT = 3  # the report was made, but the data cannot give a verdict

_EPILOG = """\
WORKLOAD is deployment/NAME (also statefulset/, daemonset/, job/, replicaset/) or a pod label selector
(app=NAME[,label=value,label!=value]) in --namespace.

Windows: by default split at the first time weft recorded one of the workload's pods as opted in
(weft_sandbox_opted_in_timestamp_seconds in Prometheus, else --state-dir): after = opt-in..now (at most
--window), before = as long, ending at the opt-in. Or give --opt-in TIME, or --before and --after as START..END.
Times: RFC 3339 (2025-05-01T10:00:00Z), Unix seconds, now, or relative (-6h, now-2d).

Exit status: 0 with a verdict (kept, no change or worse), 3 without one (too little data, no DCGM), 2 on an error.

To back out of weft: remove `runtimeClassName: weft` from the pod template (the report prints the exact command).
"""


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="did opting a workload in pay off: GPU held vs active before and after, cost, verdict",
        description="Read Prometheus for two windows, before a workload opted in to weft and since, and print "
        "GPU-seconds held and active, memory, CPU, restarts, start times, costs and a verdict.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # argparse takes any word starting with "-" for an option, unless it looks
    # like a negative number, so "--before -14d..-7d" would lose its value. No
    # option here starts with a dash and a digit: such a word is a value.
    p._negative_number_matcher = re.compile(r"^-\d")
    p.add_argument("workload", metavar="WORKLOAD", help="deployment/NAME, statefulset/NAME, ... or app=NAME,...")
    p.add_argument("-n", "--namespace", default="default", help="the workload's namespace (default: default)")
    src = p.add_argument_group("Prometheus")
    src.add_argument("--prometheus", metavar="URL", help="Prometheus server (default: report.prometheus)")
    src.add_argument("--timeout", metavar="SECONDS", type=float, help="per request (default: report.timeout, 10)")
    src.add_argument("--config", type=Path, help="weft's TOML config ([report] section)")
    wg = p.add_argument_group("windows")
    wg.add_argument("--before", metavar="START..END", help="the window before opting in")
    wg.add_argument("--after", metavar="START..END", help="the window since")
    wg.add_argument("--opt-in", metavar="TIME", help="the opt-in moment, if weft has no record of it")
    wg.add_argument("--window", metavar="DURATION", help="longest window around the opt-in moment (default 7d)")
    wg.add_argument("--lookback", metavar="DURATION", default="30d",
                    help="how far back to look for the pods and the opt-in record (default 30d)")
    wg.add_argument("--step", metavar="DURATION", help="query step (default: the scrape interval Prometheus shows)")
    wg.add_argument("--now", metavar="TIME", help="report as of this time (default: now)")
    wg.add_argument("--state-dir", type=Path, help="also read the opt-in record from this agent state directory")
    money = p.add_argument_group("money")
    money.add_argument("--price", action="append", metavar="NODE_TYPE=GPU_HOUR,VCPU_HOUR",
                       help="price per GPU-hour and per vCPU-hour for a node type (repeatable; overrides the config)")
    money.add_argument("--node-type", help="node type of nodes without an instance-type label "
                       "(default: report.default_node_type)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object")
    out.add_argument("--markdown", action="store_true", help="Markdown for a ticket")
    out.add_argument("--plot", metavar="FILE.png", type=Path, help="also draw GPUs held vs active to this PNG")
    p.set_defaults(fn=run)
    return p


def _prices(flags: Sequence[str] | None, table: dict, default_type: str, currency: str) -> Prices:
    by_type = {t: Price(float(v["gpu_hour"]), float(v["vcpu_hour"])) for t, v in table.items()}
    for text in flags or ():
        node_type, sep, nums = text.partition("=")
        parts = nums.split(",")
        try:
            gpu, vcpu = (float(x) for x in parts) if sep and node_type and len(parts) == 2 else (None, None)
        except ValueError:
            gpu = vcpu = None
        if gpu is None or vcpu is None or gpu < 0 or vcpu < 0:
            raise UsageError(f"--price: {text!r} is not NODE_TYPE=GPU_HOUR,VCPU_HOUR (like p4d.24xlarge=4.10,0.05)")
        by_type[node_type] = Price(gpu, vcpu)
    return Prices(by_type=by_type, default_type=default_type, currency=currency)


def _state_opt_in(state_dir: Path):
    def read(namespace: str, pods: Sequence[str]) -> float | None:
        if not (state_dir / "agent.db").exists():
            raise UsageError(f"--state-dir: {state_dir} holds no agent state (no agent.db); give the agent's "
                             "--state-dir, or the windows with --before/--after")
        from shim.state.agent import AgentStore

        store = AgentStore(state_dir)
        try:
            records = store.sandboxes()
        finally:
            store.close()
        times = [r.created_at for r in records if r.opted_in and r.namespace == namespace and r.name in set(pods)]
        return min(times) if times else None

    return read


def run(args: argparse.Namespace) -> int:
    from shim import config
    from shim.report import render
    from shim.report.build import Request, build
    from shim.report.prom import PrometheusSource
    from shim.report.verdict import Outcome
    from shim.report.workload import parse

    if args.json and args.markdown:
        raise UsageError("--json and --markdown conflict: give one (the terminal table is the default)")
    if args.window is not None and args.before is not None:
        raise UsageError("--window conflicts with --before/--after, which fix both windows: drop --window")
    workload = parse(args.workload, args.namespace)
    now = win.parse_time(args.now, time.time(), "--now") if args.now else time.time()
    cfg = config.load(args.config, {"report": {"prometheus": args.prometheus, "timeout": args.timeout,
                                               "default_node_type": args.node_type}}).report
    if not cfg.prometheus:
        raise UsageError("no Prometheus address: pass --prometheus URL or set report.prometheus in --config")
    prices = _prices(args.price, cfg.prices, cfg.default_node_type, cfg.currency)
    step = win.parse_duration(args.step, "--step") if args.step else None
    if step is not None and step <= 0:
        raise UsageError(f"--step: {args.step!r} must be longer than zero")
    longest = win.parse_duration(args.window, "--window") if args.window else 7 * 86400.0
    if longest <= 0:
        raise UsageError(f"--window: {args.window!r} must be longer than zero")
    req = Request(workload=workload, now=now, before=args.before, after=args.after, opt_in=args.opt_in,
                  window=longest, lookback=win.parse_duration(args.lookback, "--lookback"), step=step,
                  state_opt_in=_state_opt_in(args.state_dir) if args.state_dir else None)
    with PrometheusSource(cfg.prometheus, timeout=cfg.timeout) as source:
        rep = build(source, req, prices)
    if args.plot is not None:
        from shim.report import plot

        plot.write(rep, args.plot)
    print(render.as_json(rep) if args.json else render.markdown(rep) if args.markdown else render.table(rep))
    return EXIT_NO_VERDICT if rep.verdict.outcome is Outcome.NONE else EXIT_VERDICT
