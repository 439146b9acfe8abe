"""``weft install`` / ``weft uninstall``: flags in, :mod:`shim.install.run` does the work.

``shim/cli.py`` wires this in with :func:`add_parser`; a refusal or failure is
a :class:`~shim.errors.InstallError`, printed as ``weft install: <message>``
with exit code 2.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from shim.core.annotations import parse_host_port
from shim.errors import InstallError, UnrecognisedHost
from shim.install import plan, run, services

_HELP_SYSTEMCTL = ("the systemctl to run (default: systemctl when --root is /; none otherwise, so a --root install "
                   "only writes files), e.g. 'nsenter -t 1 -m -- systemctl' from a privileged pod")


def _settings(args: argparse.Namespace) -> run.Settings:
    root = args.root.resolve()
    command = args.systemctl if args.systemctl is not None else ("systemctl" if root == Path("/") else "")
    svc: services.Services = services.Systemctl(command) if command else services.NoServices()
    say = lambda line: print(f"weft {args.command}: {line}", flush=True)  # noqa: E731
    broker, devices = getattr(args, "broker", "none"), getattr(args, "simulated_devices", "2x80GiB")
    labels = _node_labels(getattr(args, "node_name", None), say) if args.command == "install" else {}
    if broker == "auto":
        broker, devices = _broker_of_node(root, labels, devices, say)
    mesh = None
    if getattr(args, "mesh_address", None):
        role = _role_of_node(args, labels, say)
        mesh = _mesh(args, broker, plan.capacity_from_labels(labels), role)
    return run.Settings(
        root=root, services=svc, agent_socket=args.agent_socket, containerd_socket=args.containerd_socket,
        kubelet_health_url=args.kubelet_health_url, kubelet_timeout=args.kubelet_timeout,
        agent_timeout=getattr(args, "agent_timeout", 60.0), source=getattr(args, "source", None),
        options=plan.Options(broker=broker, simulated_devices=devices, mesh=mesh),
        say=say,
        purge=getattr(args, "purge", False),
    )


def _node_labels(node_name: str | None, say: Callable[[str], None]) -> dict[str, str]:
    """The Node's labels where the installer runs in the DaemonSet (whose service account reads nodes), else none:
    one DaemonSet installs every node alike, and labels say what differs (``plan.BROKER_LABEL`` and the rest)."""
    if not node_name or not os.environ.get("WEFT_POD_NAME"):
        return {}
    from shim.kube import nodes

    labels, problem = nodes.labels(node_name)
    if problem:
        say(f"node {node_name}'s labels could not be read ({problem}); the host alone decides")
    return labels


def _broker_of_node(root: Path, labels: dict[str, str], devices: str,
                    say: Callable[[str], None]) -> tuple[str, str]:
    """``--broker auto``: the node's ``weft.io/broker`` label where it has one, else nvml where the host has an
    NVIDIA device and none elsewhere."""
    chosen, chose_devices = plan.broker_from_labels(labels)
    if chosen is not None:
        say(f"broker {chosen}, as the node's label {plan.BROKER_LABEL} says")
        return chosen, chose_devices or devices
    return ("nvml" if (root / "dev/nvidiactl").exists() else "none"), devices


def _role_of_node(args: argparse.Namespace, labels: dict[str, str], say: Callable[[str], None]) -> str:
    """``--role auto``: what ``--gpu-nodes`` and ``--cpu-nodes`` (the chart's selectors) say of this node's
    labels, where they say anything; "auto" (the host decides) otherwise. Both selectors are checked first."""
    role = plan.role_from_selectors(labels, args.gpu_nodes or "", args.cpu_nodes or "")
    if args.role != "auto":
        return args.role
    if role is not None:
        said = {"gpu": f"--gpu-nodes {args.gpu_nodes!r}", "cpu": f"--cpu-nodes {args.cpu_nodes!r}"}
        say(f"mesh role {role}, as the node's labels match "
            + (f"{said['gpu']} and {said['cpu']}" if role == "both" else said[role]))
        return role
    return "auto"


def _mesh(args: argparse.Namespace, broker: str, fixed_capacity: str = "", role: str = "auto") -> plan.Mesh:
    """The mesh settings, with this node's TLS files (and a static peers file) read from where the flags name."""
    if not args.node_name:
        raise InstallError("--mesh-address needs --node-name (or WEFT_NODE_NAME); nothing was changed")
    on_host = bool(getattr(args, "tls_on_host", False))
    if not args.tls_source and not on_host:
        raise InstallError("--mesh-address needs --tls-source (or WEFT_TLS_SOURCE): the directory with ca.crt and "
                           f"{args.node_name}.crt/.key, or --tls-on-host; nothing was changed")
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?", args.node_name):
        raise InstallError(f"--node-name {args.node_name!r} is not a Kubernetes node name; nothing was changed")
    try:
        parse_host_port(args.mesh_address, field="--mesh-address")
    except ValueError as exc:
        raise InstallError(f"{exc}; nothing was changed") from None
    role = role if role != "auto" else ("gpu" if broker != "none" else "cpu")
    peers = args.peers or "kubernetes"

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise InstallError(f"{path}: cannot read {what} ({exc.strerror}); nothing was changed") from None

    tls = args.root.resolve() / plan.MESH_TLS_DIR.lstrip("/") if on_host else Path(args.tls_source)
    return plan.Mesh(
        node_name=args.node_name, role=role, address=args.mesh_address, peers=peers,
        ca_crt=read(tls / "ca.crt", "the mesh CA certificate"),
        node_crt=read(tls / f"{args.node_name}.crt", "this node's mesh certificate"),
        node_key=read(tls / f"{args.node_name}.key", "this node's mesh key"),
        peers_file=None if peers == "kubernetes" else read(Path(peers), "the static peers file"),
        tls_on_host=on_host, fixed_capacity=fixed_capacity, namespace=os.environ.get("WEFT_POD_NAMESPACE", ""))


def _install(args: argparse.Namespace) -> int:
    try:
        run.install(_settings(args))
    except InstallError as exc:
        _report(exc)
        raise
    return 0


def _report(exc: InstallError) -> None:
    """In the DaemonSet, what stopped the install is also an Event on the pod (``kubectl describe pod``)."""
    from shim.kube import events

    pod = events.PodRef.from_environment()
    if pod is None:
        return
    reason = "WeftInstallRefused" if isinstance(exc, UnrecognisedHost) else "WeftInstallFailed"
    problem = events.report(pod, reason, exc.message)
    if problem:
        print(f"weft install: could not report this on pod {pod.namespace}/{pod.name}: {problem}", flush=True)


def _uninstall(args: argparse.Namespace) -> int:
    run.uninstall(_settings(args))
    return 0


def _containerd_dropin(args: argparse.Namespace) -> int:
    """Make weft's containerd drop-in again from the files it copies (containerd's ExecStartPre)."""
    from shim.install import dropin
    from shim.install.host import Host

    host = Host(args.root.resolve())
    say = lambda line: print(f"weft containerd-dropin: {line}", flush=True)  # noqa: E731
    if not dropin.installed(host):
        say("weft is not installed here (no install journal in the installed state); nothing to do")
        return 0
    status = dropin.regenerate(host, dropin.containerd_of(host, args.containerd_socket), write=not args.check)
    if status.wrote:
        say(("would write " if args.check else "wrote ") + ", ".join(status.wrote)
            + f" (made for containerd {status.containerd} from the files as they are)")
    else:
        say("the drop-in is current")
    if status.problem:
        print(f"weft containerd-dropin: {status.state.value}: {status.detail}", file=sys.stderr, flush=True)
        return 2
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
                   help="GPU broker backend (auto: the node's weft.io/broker label where the DaemonSet's pod can "
                   "read it, else nvml when the host has /dev/nvidiactl, else no broker)")
    i.add_argument("--simulated-devices", default="2x80GiB", help="with --broker simulated")
    m = i.add_argument_group("mesh", "the agent's peer mesh (off without --mesh-address); each flag defaults to "
                             "the DaemonSet's environment variable")
    m.add_argument("--node-name", default=os.environ.get("WEFT_NODE_NAME") or None,
                   help="this node's name in the mesh and its certificate (WEFT_NODE_NAME)")
    m.add_argument("--role", choices=("auto", *plan.MESH_ROLES), default=os.environ.get("WEFT_ROLE") or "auto",
                   help="what this node offers (WEFT_ROLE; auto: gpu with a GPU broker, else cpu)")
    m.add_argument("--gpu-nodes", default=os.environ.get("WEFT_GPU_NODES") or None, metavar="SELECTOR",
                   help="with --role auto: a node whose labels match this label selector (key=value,key!=value,"
                   "key,!key) is a GPU node (WEFT_GPU_NODES; read where the DaemonSet's pod can read its node)")
    m.add_argument("--cpu-nodes", default=os.environ.get("WEFT_CPU_NODES") or None, metavar="SELECTOR",
                   help="likewise for CPU nodes (WEFT_CPU_NODES); a node both match is both")
    m.add_argument("--mesh-address", default=os.environ.get("WEFT_MESH_ADDRESS") or None, metavar="HOST:PORT",
                   help="where the agent's mesh listens (WEFT_MESH_ADDRESS)")
    m.add_argument("--peers", default=os.environ.get("WEFT_PEERS") or None,
                   help="'kubernetes' (default) or a static peers file to copy to /etc/weft/peers.toml (WEFT_PEERS)")
    m.add_argument("--tls-source", type=Path, default=os.environ.get("WEFT_TLS_SOURCE") or None, metavar="DIR",
                   help="ca.crt and <node>.crt/.key, copied to /etc/weft/mesh (keys 0600) (WEFT_TLS_SOURCE)")
    m.add_argument("--tls-on-host", action="store_true", default=os.environ.get("WEFT_TLS_ON_HOST") == "1",
                   help="the host's /etc/weft/mesh already holds them, kept by weft mesh-identity (the node's own "
                   "key, made there): check them, copy nothing (WEFT_TLS_ON_HOST=1)")
    i.add_argument("--source", type=Path, help="copy this prepared weft tree to /opt/weft instead of bundling "
                   "the running Python and weft")
    i.set_defaults(fn=_install)
    u = sub.add_parser("uninstall", help="restore containerd's and kubelet's files exactly and remove weft")
    _common(u)
    u.add_argument("--purge", action="store_true", help="also remove what weft's DaemonSet keeps on the host: "
                   "the node's mesh key and certificate and the agent's API credentials (/etc/weft), and the "
                   "agent's state (/var/lib/weft); the cluster's back-out runs it")
    u.set_defaults(fn=_uninstall)
    d = sub.add_parser("containerd-dropin", help="make weft's containerd drop-in again from the files it copies "
                       "(run before every start of containerd: an ExecStartPre weft install adds to its unit), so "
                       "that another tool's later change of containerd's configuration is never frozen by it")
    d.add_argument("--root", type=Path, default=Path("/"), help="the host's root directory")
    d.add_argument("--containerd-socket", type=Path, help="containerd's socket as this process sees it "
                   "(default <root>/<grpc.address of its config>; its binary's --version where nothing answers)")
    d.add_argument("--check", action="store_true", help="say what would change, write nothing")
    d.set_defaults(fn=_containerd_dropin)
