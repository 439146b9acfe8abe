"""``weft simulate``: the fleet simulator's command line (flags, input checks, output files).

``shim/cli.py`` wires this in with :func:`add_parser` and calls :func:`run`.
Flags stay strings in argparse and are parsed here, so that every bad input
(a missing file, a malformed column, a size like ``80GB``) comes back as one
line naming the flag, with exit code 2, whether ``run`` was reached through
``weft`` or called directly. With no workload flag at all the run is on the
samples of public traces that ship in ``shim/sim/traces/`` (its README names
each source and its terms); with flags, on the user's own files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from shim.core.quantity import AnnotationError, parse_memory
from shim.core.reroute import Resources
from shim.sim import mesh, plots, report
from shim.sim.cost import DEFAULT_PRICES, Prices
from shim.sim.model import ClusterSpec, GpuProfile, PodSpec
from shim.sim.readers import TraceError, read_dlrm, read_genai_samples, read_genai_summary, read_openb_nodes
from shim.sim.study import study
from shim.sim.workload import LEASE_POLICIES, SyntheticSpec, dlrm_pods, genai_pool, parse_duty, synthetic_pods

N = TypeVar("N", int, float)

# A DGX H100-class GPU node, and a CPU node that holds the largest DLRM CN instance (192 vCPU, 960 GiB).
DEFAULT_GPU_NODE = ("224", "2TiB")
DEFAULT_CPU_NODE = ("192", "1TiB")
_DURATION = re.compile(r"(?P<n>\d+(?:\.\d+)?)\s*(?P<unit>[smhd]?)")
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class UsageError(ValueError):
    """A flag's value cannot be used; the message starts with the flag."""


# What a run with no workload flag reads: the samples in shim/sim/traces/.
SAMPLES = Path(__file__).resolve().parent / "traces"
DEFAULT_INPUTS = {
    "genai_pods": "alibaba-genai2026-pod-gpu-sample.csv",
    "genai_summary": "alibaba-genai2026-pod-summary.csv",
    "dlrm": "alibaba-dlrm2025-disagg-sample.csv",
}


def _epilog() -> str:
    lines = [f"With no workload flag, the run is on samples of the public traces below that ship with weft "
             f"({SAMPLES}).", "Full traces (download them and pass the paths):"]
    lines += [f"  {flag}: {where}" for flag, where in report.TRACE_SOURCES]
    lines.append("GPU utilisation is the duty cycle (busy / held GPU-seconds), not SM activity.")
    lines.append("Default node prices ($/hour, on-demand list prices):")
    lines.append(f"  --gpu-node-price {DEFAULT_PRICES.gpu_node_usd_per_hour:g}: {DEFAULT_PRICES.gpu_node_source}")
    lines.append(f"  --cpu-node-price {DEFAULT_PRICES.cpu_node_usd_per_hour:g}: {DEFAULT_PRICES.cpu_node_source}")
    return "\n".join(lines)


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "simulate", help="fleet simulation: bundled pods, KAI's GPU fractions and weft on one workload, side by side",
        description="Replay a workload (public traces or synthetic) through a cluster once per mode: as bundled "
        "pods, as KAI scheduler's GPU fractions share GPUs without a memory limit (kai-fractions), and as weft "
        "places them with its own decision code, and report GPU utilisation, GPUs held, completion times, "
        "out-of-memory failures and a validation of the bundled mode against published figures.",
        epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("mode", nargs="?", choices=("fleet", "mesh"), default="fleet",
                   help="fleet (default): the workload, bundled and with weft; mesh: the mesh's control plane "
                   "across a fleet of origins and hosts placing at once (docs/simulator.md)")
    me = p.add_argument_group("mesh mode")
    me.add_argument("--scenario", action="append", choices=tuple(mesh.SCENARIOS),
                    help="a scenario to run (repeat for several; default: every one)")
    me.add_argument("--hosts", help="CPU hosts (default: each scenario's, 5000)")
    me.add_argument("--origins", help="origins placing (default: each scenario's, 1000); the placements scale "
                    "with them")
    src = p.add_argument_group("workload")
    src.add_argument("--dlrm", metavar="FILE", help="Prism DLRM instances CSV (CN and HN rows paired into pods)")
    src.add_argument("--genai-pods", metavar="FILE", help="GenTD26 per-pod duty-cycle and GPU-memory samples CSV")
    src.add_argument("--genai-summary", metavar="FILE", help="GenTD26 per-pod summary CSV (all 143 pods, means)")
    src.add_argument("--openb-nodes", metavar="FILE", help="openb node inventory CSV: node sizes from its most "
                     "common GPU-node and CPU-only shapes")
    src.add_argument("--synthetic", action="store_true", help="draw a Poisson workload instead of --dlrm")
    src.add_argument("--pods", default="200", help="synthetic: number of pods (default 200)")
    src.add_argument("--arrival-rate", default="60", help="synthetic: pods per hour (default 60)")
    src.add_argument("--run-time", default="30m", help="synthetic: mean run time, e.g. 30m, 2h (default 30m)")
    src.add_argument("--cpu-stage", default="8:32GiB", help="synthetic: CPU stage VCPU:MEMORY (default 8:32GiB)")
    src.add_argument("--gpu-host", default="4:16GiB", help="synthetic: GPU stage host VCPU:MEMORY (default 4:16GiB)")
    src.add_argument("--stage-gpu-memory", default="20GiB", help="synthetic: GPU memory a stage holds (default 20GiB)")
    src.add_argument("--duty", default="beta:0.5,6.6", help="synthetic: duty cycle per pod, a percent (7), "
                     "uniform:LO,HI (percent) or beta:A,B (default beta:0.5,6.6, mean about 7 %%)")
    src.add_argument("--duration", help="keep pods arriving before this and cut runs at it, e.g. 7d, 12h")
    src.add_argument("--seed", default="1", help="seed of every random draw (default 1)")
    cl = p.add_argument_group("cluster (node counts default to the most any mode needs; see report)")
    cl.add_argument("--gpu-nodes", help="GPU nodes")
    cl.add_argument("--gpus-per-node", default="8", help="GPUs per GPU node (default 8)")
    cl.add_argument("--gpu-memory", default="80GiB", help="memory of each GPU (default 80GiB)")
    cl.add_argument("--node-vcpu", help=f"vCPU of each GPU node (default {DEFAULT_GPU_NODE[0]})")
    cl.add_argument("--node-memory", help=f"host memory of each GPU node (default {DEFAULT_GPU_NODE[1]})")
    cl.add_argument("--cpu-nodes", help="CPU-only nodes")
    cl.add_argument("--cpu-node-vcpu", help=f"vCPU of each CPU node (default {DEFAULT_CPU_NODE[0]})")
    cl.add_argument("--cpu-node-memory", help=f"memory of each CPU node (default {DEFAULT_CPU_NODE[1]})")
    cl.add_argument("--lease", default="peak", choices=LEASE_POLICIES,
                    help="GPU-stage memory lease: each pod's peak (default), p99, p95 or mean GPU memory")
    co = p.add_argument_group("cost (the fleet each mode needs, at these hourly prices; sources below)")
    co.add_argument("--gpu-node-price", metavar="USD", help="$ per hour of one GPU node (default "
                    f"{DEFAULT_PRICES.gpu_node_usd_per_hour:g}: AWS p5.48xlarge on-demand, us-east-1)")
    co.add_argument("--cpu-node-price", metavar="USD", help="$ per hour of one CPU node (default "
                    f"{DEFAULT_PRICES.cpu_node_usd_per_hour:g}: AWS r7i.48xlarge on-demand, us-east-1)")
    out = p.add_argument_group("output")
    out.add_argument("--out", metavar="DIR", help="write report.md, results.json, utilisation.png, "
                     "completion_cdf.png here")
    out.add_argument("--json", action="store_true", help="print only results.json's content")
    out.add_argument("--validate", action="store_true", help="also print the validation table; exit 1 if a "
                     "figure is out of tolerance")
    p.set_defaults(fn=run)
    return p


# -- parsing flag values ------------------------------------------------------------------------------------


def _size(flag: str, value: str) -> int:
    text = value.strip()
    # People write 80GiB; Kubernetes quantities say 80Gi. Accept both, and nothing looser.
    if re.fullmatch(r".*[KMGTPE]iB", text):
        text = text[:-1]
    try:
        return parse_memory(flag, text)
    except AnnotationError as exc:
        raise UsageError(str(exc)) from None


def _number(flag: str, value: str, read: Callable[[str], N], what: str, ok: Callable[[N], bool], must: str) -> N:
    """``value`` as ``read`` reads it; UsageError naming ``flag`` if it is not ``what`` or ``ok`` refuses it."""
    try:
        x = read(value)
    except ValueError:
        raise UsageError(f"{flag}: {value!r} is not {what}") from None
    if not ok(x):
        raise UsageError(f"{flag}: {value!r} must be {must}")
    return x


def _count(flag: str, value: str, lo: int = 0) -> int:
    return _number(flag, value, int, "a whole number", lambda n: n >= lo, f"at least {lo}")


def _positive(flag: str, value: str) -> float:
    return _number(flag, value, float, "a number", lambda x: x > 0 and x != float("inf"), "more than zero")


def _price(flag: str, value: str) -> float:
    return _number(flag, value, float, "a price in $ per hour (e.g. 55.04)", lambda x: math.isfinite(x) and x >= 0,
                   "a price of 0 or more $ per hour")


def _prices(args: argparse.Namespace) -> Prices:
    given = "given with {flag}"
    gpu, cpu = DEFAULT_PRICES.gpu_node_usd_per_hour, DEFAULT_PRICES.cpu_node_usd_per_hour
    gpu_source, cpu_source = DEFAULT_PRICES.gpu_node_source, DEFAULT_PRICES.cpu_node_source
    if args.gpu_node_price is not None:
        gpu, gpu_source = _price("--gpu-node-price", args.gpu_node_price), given.format(flag="--gpu-node-price")
    if args.cpu_node_price is not None:
        cpu, cpu_source = _price("--cpu-node-price", args.cpu_node_price), given.format(flag="--cpu-node-price")
    return Prices(gpu, cpu, gpu_source, cpu_source)


def _duration(flag: str, value: str) -> float:
    m = _DURATION.fullmatch(value.strip())
    if m is None or float(m["n"]) <= 0:
        raise UsageError(f"{flag}: {value!r} is not a duration (e.g. 3600, 90m, 12h, 7d)")
    return float(m["n"]) * _UNIT_S[m["unit"]]


def _pair(flag: str, value: str) -> tuple[float, int]:
    vcpu, sep, memory = value.partition(":")
    if not sep:
        raise UsageError(f"{flag}: {value!r} is not VCPU:MEMORY (e.g. 8:32GiB)")
    return _positive(flag, vcpu), _size(flag, memory)


def _read(flag: str, path: str, reader: Callable):
    try:
        return reader(Path(path))
    except TraceError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _describe(path: str, what: str) -> str:
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    return f"{path} ({what}; sha256 {digest}…)"


# -- the command --------------------------------------------------------------------------------------------


def _cluster(args: argparse.Namespace, inputs: dict, pods: list[PodSpec]) -> tuple[ClusterSpec, bool, bool]:
    gpu_shape = list(DEFAULT_GPU_NODE)
    cpu_shape = list(DEFAULT_CPU_NODE)
    gpus_per_node = _count("--gpus-per-node", args.gpus_per_node, lo=1)
    if args.openb_nodes:
        nodes = _read("--openb-nodes", args.openb_nodes, read_openb_nodes)
        gpu_rows = Counter((n.vcpu, n.memory_bytes, n.gpus) for n in nodes if n.gpus > 0)
        cpu_rows = Counter((n.vcpu, n.memory_bytes) for n in nodes if n.gpus == 0)
        if gpu_rows:
            (vcpu, memory, gpus), _ = gpu_rows.most_common(1)[0]
            gpu_shape = [f"{vcpu:g}", f"{memory}"]
            if args.gpus_per_node == "8":  # the default: the inventory knows better
                gpus_per_node = gpus
        # What must fit on one CPU node: the largest plain pod and the largest CPU stage.
        needs = [p.total_cpu for p in pods if p.gpu is None] + [c.need for p in pods if p.gpu for c in p.cpu]
        cpu_kept = "most common CPU-only shape"
        if cpu_rows:
            (vcpu, memory), _ = cpu_rows.most_common(1)[0]
            if all(n.fits_in(Resources(vcpu, memory)) for n in needs):
                cpu_shape = [f"{vcpu:g}", f"{memory}"]
            else:
                cpu_kept = (f"its most common CPU-only node ({vcpu:g} vCPU) cannot hold the workload's largest "
                            "CPU container, so CPU nodes keep the default shape")
        inputs["--openb-nodes"] = _describe(args.openb_nodes, f"{len(nodes)} nodes; GPU nodes take the most common "
                                            f"GPU-node shape; {cpu_kept}")
    gpu_node = Resources(_positive("--node-vcpu", args.node_vcpu or gpu_shape[0]),
                         _size("--node-memory", args.node_memory or gpu_shape[1]))
    cpu_node = Resources(_positive("--cpu-node-vcpu", args.cpu_node_vcpu or cpu_shape[0]),
                         _size("--cpu-node-memory", args.cpu_node_memory or cpu_shape[1]))
    cluster = ClusterSpec(
        gpu_nodes=_count("--gpu-nodes", args.gpu_nodes) if args.gpu_nodes else 0,
        gpus_per_node=gpus_per_node,
        gpu_memory_bytes=_size("--gpu-memory", args.gpu_memory),
        gpu_node=gpu_node,
        cpu_nodes=_count("--cpu-nodes", args.cpu_nodes) if args.cpu_nodes else 0,
        cpu_node=cpu_node,
    )
    return cluster, args.gpu_nodes is not None, args.cpu_nodes is not None


def _use_samples(args: argparse.Namespace) -> None:
    """No workload flag at all: run on the bundled samples, as a user's first try would want."""
    if args.synthetic or args.dlrm or args.genai_pods or args.genai_summary:
        return
    for attr, name in DEFAULT_INPUTS.items():
        setattr(args, attr, str(SAMPLES / name))


def _workload(args: argparse.Namespace, rng: random.Random, inputs: dict) -> tuple[
        list[PodSpec], list, list[GpuProfile], list[str]]:
    _use_samples(args)
    if args.synthetic == bool(args.dlrm):
        raise UsageError("--dlrm: give either --dlrm FILE or --synthetic (exactly one)")
    samples: list[GpuProfile] = []
    summary: list[GpuProfile] = []
    sections = ["Cluster", "Modes", "Out of memory", "Metrics", "Cost"]
    if args.genai_pods:
        samples = _read("--genai-pods", args.genai_pods, read_genai_samples)
        inputs["--genai-pods"] = _describe(args.genai_pods, f"{len(samples)} pods with full series")
    if args.genai_summary:
        summary = _read("--genai-summary", args.genai_summary, read_genai_summary)
        inputs["--genai-summary"] = _describe(args.genai_summary, f"{len(summary)} pods, means only")
    pool = genai = genai_pool(samples, summary)
    if pool:
        sections.append("GenTD26 GPU behaviour (--genai-pods, --genai-summary)")
    duration = _duration("--duration", args.duration) if args.duration else None
    dlrm = None
    if args.dlrm:
        dlrm, trace_end = _read("--dlrm", args.dlrm, read_dlrm)
        if not pool:
            # No GenTD26 file: the DLRM trace has no utilisation, so the synthetic GPU behaviour stands in.
            duty = _duty(args)
            memory = _size("--stage-gpu-memory", args.stage_gpu_memory)
            pool = [GpuProfile.constant(f"synthetic-{k}", duty(rng), memory) for k in range(100)]
        pods = dlrm_pods(dlrm, trace_end, pool, rng, duration=duration)
        inputs["--dlrm"] = _describe(args.dlrm, f"{len(dlrm)} instances of {len({i.app for i in dlrm})} apps, "
                                     f"trace end {trace_end / 86400:.1f} d")
        sections.append("DLRM workload (--dlrm)")
    else:
        spec = SyntheticSpec(
            pods=_count("--pods", args.pods, lo=1),
            arrival_rate_per_h=_positive("--arrival-rate", args.arrival_rate),
            run_time_s=_duration("--run-time", args.run_time),
            cpu_stage=_pair("--cpu-stage", args.cpu_stage),
            gpu_host=_pair("--gpu-host", args.gpu_host),
            stage_gpu_memory_bytes=_size("--stage-gpu-memory", args.stage_gpu_memory),
            duty=_duty(args),
        )
        pods = synthetic_pods(spec, pool, rng)
        if duration is not None:
            pods = [p for p in pods if p.arrival_s < duration]
        inputs["--synthetic"] = (f"{spec.pods} pods at {spec.arrival_rate_per_h:g}/h, mean run {spec.run_time_s:g} s,"
                                 f" CPU stage {args.cpu_stage}, GPU host {args.gpu_host}, duty {args.duty}")
        sections.append("Synthetic workload (--synthetic)")
    if not pods:
        raise UsageError("--duration: no pod arrives within it" if duration else
                         "--dlrm: no instance lives for any time in the file (are all its times empty?)")
    both = sum(1 for p in pods if p.gpu is not None and p.cpu)
    gpu_only = sum(1 for p in pods if p.gpu is not None and not p.cpu)
    inputs["pods"] = (f"{len(pods)}: {both} with a CPU and a GPU stage, {gpu_only} GPU-only, "
                      f"{len(pods) - both - gpu_only} CPU-only; arrivals over "
                      f"{max(p.arrival_s for p in pods) / 3600:,.1f} h")
    return pods, dlrm, genai, sections


def _duty(args: argparse.Namespace) -> Callable[[random.Random], float]:
    try:
        return parse_duty(args.duty)
    except ValueError as exc:
        raise UsageError(f"--duty: {exc}") from None


def run_mesh(args: argparse.Namespace) -> int:
    try:
        seed = _count("--seed", args.seed)
        hosts = _count("--hosts", args.hosts, 1) if args.hosts else None
        origins = _count("--origins", args.origins, 1) if args.origins else None
    except UsageError as exc:
        print(f"weft simulate: {exc}", file=sys.stderr)
        return 2
    names = args.scenario or list(mesh.SCENARIOS)
    figures = mesh.simulate(names, hosts=hosts, origins=origins, seed=seed)
    if args.json:
        print(json.dumps({"seed": seed, "delays": str(mesh.Delays()), "scenarios": figures}, indent=2))
    else:
        print(mesh.table(figures))
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "mode", "fleet") == "mesh":
        return run_mesh(args)
    try:
        seed = _count("--seed", args.seed)
        inputs: dict = {"seed": seed}
        rng = random.Random(seed)
        pods, dlrm, genai, sections = _workload(args, rng, inputs)
        cluster, gpu_given, cpu_given = _cluster(args, inputs, pods)
        prices = _prices(args)
        out = Path(args.out) if args.out else None
        if out is not None and out.exists() and not out.is_dir():
            raise UsageError(f"--out: {out} exists and is not a directory")
    except UsageError as exc:
        print(f"weft simulate: {exc}", file=sys.stderr)
        return 2
    st = study(pods, cluster, gpu_nodes_given=gpu_given, cpu_nodes_given=cpu_given, lease=args.lease, dlrm=dlrm,
               genai=genai, prices=prices)
    doc = report.results(st, inputs)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(doc, indent=2) + "\n")
        (out / "report.md").write_text(report.markdown(st, doc, sections))
        try:
            plots.write(out, st.series, st.completions)
        except plots.PlotError as exc:
            print(f"weft simulate: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(report.table(st))
        if args.validate:
            print(_validation_table(st))
        if out is not None:
            print(f"wrote {out}/report.md, results.json, {', '.join(report.FIGURES)} ({st.elapsed_s:.1f} s)")
    return 1 if args.validate and not doc["validation_passed"] else 0


def _validation_table(st) -> str:
    lines = [f"{'target':36} {'held to':>10} {'simulated':>10} {'tolerance':>10}  result"]
    for v in st.validation:
        simulated = "-" if v.simulated is None else f"{v.simulated:.4g}"
        lines.append(f"{v.id:36} {v.reference:>10.4g} {simulated:>10} {'±' + format(v.tolerance, '.3g'):>10}  "
                     f"{'pass' if v.passed else 'FAIL'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m shim.sim.cli``: the same command without the rest of ``weft``."""
    parser = argparse.ArgumentParser(prog="weft")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
