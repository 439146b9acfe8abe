"""``weft install`` / ``weft uninstall``: flags in, :mod:`shim.install.run` does the work.

``shim/cli.py`` wires this in with :func:`add_parser`; a refusal or failure is
a :class:`~shim.errors.InstallError`, printed as ``weft install: <message>``
with exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from shim.install import plan, run, services

_HELP_SYSTEMCTL = ("the systemctl to run (default: systemctl when --root is /; none otherwise, so a --root install "
                   "only writes files), e.g. 'nsenter -t 1 -m -- systemctl' from a privileged pod")


def _settings(args: argparse.Namespace) -> run.Settings:
    root = args.root.resolve()
    command = args.systemctl if args.systemctl is not None else ("systemctl" if root == Path("/") else "")
    svc: services.Services = services.Systemctl(command) if command else services.NoServices()
    broker = getattr(args, "broker", "none")
    if broker == "auto":
        broker = "nvml" if (root / "dev/nvidiactl").exists() else "none"
    return run.Settings(
        root=root, services=svc, agent_socket=args.agent_socket, containerd_socket=args.containerd_socket,
        kubelet_health_url=args.kubelet_health_url, kubelet_timeout=args.kubelet_timeout,
        agent_timeout=getattr(args, "agent_timeout", 60.0), source=getattr(args, "source", None),
        options=plan.Options(broker=broker, simulated_devices=getattr(args, "simulated_devices", "2x80GiB")),
        say=lambda line: print(f"weft {args.command}: {line}", flush=True),
    )


def _install(args: argparse.Namespace) -> int:
    run.install(_settings(args))
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    run.uninstall(_settings(args))
    return 0


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", type=Path, default=Path("/"), help="the host's root directory (e.g. /host in the "
                   "DaemonSet; a directory tree laid out like a node in tests)")
    p.add_argument("--systemctl", metavar="COMMAND", help=_HELP_SYSTEMCTL)
    p.add_argument("--agent-socket", type=Path, help="the agent's socket as this process sees it "
                   "(default <root>/run/weft/cri.sock)")
    p.add_argument("--containerd-socket", type=Path, help="containerd's socket as this process sees it "
                   "(default <root>/<grpc.address of its config>)")
    p.add_argument("--kubelet-health-url", default="http://127.0.0.1:10248/healthz", help="kubelet's healthz")
    p.add_argument("--kubelet-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long kubelet has to come back healthy after its restart")


def add_parser(sub: argparse._SubParsersAction) -> None:
    i = sub.add_parser("install", help="install weft onto this node's host (systemd units, containerd drop-in, "
                       "kubelet switched to the agent); rolls back if kubelet does not come back healthy")
    _common(i)
    i.add_argument("--agent-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="how long the agent has to answer CRI before kubelet is switched")
    i.add_argument("--broker", choices=("auto", *plan.BROKERS), default="auto",
                   help="GPU broker backend (auto: nvml when the host has /dev/nvidiactl, else no broker)")
    i.add_argument("--simulated-devices", default="2x80GiB", help="with --broker simulated")
    i.add_argument("--source", type=Path, help="copy this prepared weft tree to /opt/weft instead of bundling "
                   "the running Python and weft")
    i.set_defaults(fn=_install)
    u = sub.add_parser("uninstall", help="restore containerd's and kubelet's files exactly and remove weft")
    _common(u)
    u.set_defaults(fn=_uninstall)
