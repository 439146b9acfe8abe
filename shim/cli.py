"""The ``weft`` command line: one subcommand per job.

``weft agent``        serve the CRI proxy in front of containerd
``weft demo``         a throwaway fabric on this machine, end to end
``weft bench proxy``  pass-through cost, direct vs through the agent

Errors weft raises on purpose are printed as one line naming what to fix, with
exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from shim import __version__, log
from shim.errors import WeftError


def _agent(args: argparse.Namespace) -> int:
    from shim import config
    from shim.agent import Agent

    cfg = config.load(
        args.config,
        {
            "agent": {
                "socket": args.socket,
                "containerd_socket": args.containerd_socket,
                "state_dir": args.state_dir,
                "metrics_address": args.metrics_address,
                "log_level": args.log_level,
            }
        },
    )
    log.configure(cfg.agent.log_level)
    Agent(cfg).run()
    return 0


def _demo(args: argparse.Namespace) -> int:
    try:
        from integration import demo
    except ImportError:
        raise WeftError("weft demo runs from a source checkout (it uses integration/harness.py)") from None
    return demo.main(keep_going=args.keep)


def _bench(args: argparse.Namespace) -> int:
    try:
        from bench import proxy
    except ImportError:
        raise WeftError("weft bench runs from a source checkout (bench/ and integration/)") from None
    if args.what == "proxy":
        return proxy.main(
            as_json=args.json, pods=args.pods, samples=args.samples, load_seconds=args.load_seconds,
            output=args.output,
        )
    raise WeftError(f"unknown benchmark {args.what!r}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="weft", description="weft: an execution fabric beneath the Kubernetes scheduler")
    p.add_argument("--version", action="version", version=f"weft {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("agent", help="serve the CRI proxy in front of containerd until SIGTERM")
    a.add_argument("--socket", type=Path, help="unix socket kubelet talks to (default /run/weft/cri.sock)")
    a.add_argument("--containerd-socket", type=Path, help="containerd's CRI socket")
    a.add_argument("--state-dir", type=Path, help="where weft keeps its state (default /var/lib/weft)")
    a.add_argument("--metrics-address", help='HOST:PORT for /metrics, /healthz, /readyz ("" turns it off)')
    a.add_argument("--config", type=Path, help="TOML configuration file; flags override it")
    a.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    a.set_defaults(fn=_agent)

    d = sub.add_parser("demo", help="run a throwaway containerd and agent, start a pod through it, clean up")
    d.add_argument("--keep", action="store_true", help="leave the pod running until Enter is pressed")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="benchmarks that compare side by side in one run")
    b.add_argument("what", choices=("proxy",))
    b.add_argument("--json", action="store_true", help="print machine-readable figures")
    b.add_argument("--pods", type=int, default=50, help="running pods during the list and load phases")
    b.add_argument("--samples", type=int, default=2000, help="calls per method and path for latency")
    b.add_argument("--load-seconds", type=float, default=60.0, help="length of the kubelet-like load phase")
    b.add_argument("--output", type=Path, help="also write the JSON figures to this file")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except WeftError as exc:
        print(f"weft {args.command}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
