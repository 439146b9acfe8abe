"""The ``weft`` command line: one subcommand per job.

``weft agent``        serve the CRI proxy in front of containerd
``weft broker``       serve the node's GPU leases (NVML or simulated devices)
``weft status``       sandboxes, placements and leases, as JSON or a table
``weft explain ID``   why a container was placed where it is
``weft drain``        a host takes no new containers and waits until those it hosts are gone
``weft mesh-certs``   a mesh CA and node certificates for tests and small clusters
``weft mesh-signer``  sign nodes' mesh certificates asked through the Kubernetes CSR API
``weft mesh-identity`` keep this node's mesh key and certificate, asked of the signer
``weft simulate``     a fleet simulation: bundled pods against weft, on public traces
``weft install``      install weft onto the node's host (``weft uninstall`` restores it)
``weft report``       did opting a workload in pay off: its GPUs held vs active before and since, from Prometheus
``weft gpu-check``    can this node enforce GPU leases: driver, MPS, device plugin, a live test (docs/gpu.md)
``weft demo``         three test nodes on this machine, a two-stage pod through them, end to end
``weft bench ...``    benchmarks that compare side by side in one run

Errors weft raises on purpose are printed as one line naming what to fix, with
exit code 2; anything else is a bug and keeps its traceback.

This module imports nothing slow at its top: the console script imports it
before ``main`` sets how SIGTERM ends the process (``shim.stopping``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from shim import __version__, stopping

# The commands that run as containers' main processes (nodeimage/manifests, charts/weft). As the process's own
# command line they end on SIGTERM and SIGINT through shim.stopping: at once until their work starts (the entry
# point's first line sets that), then as stopping.serve ends them.
SERVING = frozenset({"mesh-signer", "mesh-identity", "kube-credentials"})  # they call stopping.serve
INSTALLING = frozenset({"install", "uninstall"})  # run by main under stopping.serve, ended at once by a signal


def _agent(args: argparse.Namespace) -> int:
    from shim import config, log
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
                "broker_socket": None if args.broker_socket is None else str(args.broker_socket),
                "cdi_spec_dirs": args.cdi_spec_dirs,
            },
            "mesh": {
                "node_name": args.node_name, "role": args.role, "address": args.mesh_address,
                "peers": args.peers, "tls_dir": None if args.tls_dir is None else str(args.tls_dir),
            },
            "kubernetes": {"kubeconfig": None if args.kubeconfig is None else str(args.kubeconfig)},
        },
    )
    log.configure(cfg.agent.log_level)
    from shim.install import dropin

    k = cfg.kubernetes
    check = dropin.agent_watch(Path(cfg.agent.containerd_socket), cfg.mesh.node_name or socket.gethostname(),
                               k.namespace, Path(k.kubeconfig) if k.kubeconfig else None)
    Agent(cfg, host_check=check,
          host_sandbox_image=dropin.agent_sandbox_image(Path(cfg.agent.containerd_socket))).run()
    return 0


def _kube_credentials(args: argparse.Namespace) -> int:
    from shim import log
    from shim.errors import WeftError
    from shim.kube import credentials

    log.configure("info")
    identity = None
    if args.namespace or args.service_account:
        if not (args.namespace and args.service_account):
            raise WeftError("kube-credentials: --namespace and --service-account go together")
        identity = credentials.Identity(args.namespace, args.service_account)
    keeper = credentials.in_cluster_keeper(args.dir, args.lifetime, args.refresh, args.kubeconfig, identity)
    # The keeper on a thread of its own, the signal taken by the main thread: a TokenRequest that hangs does
    # not keep the process once SIGTERM comes (shim.stopping).
    if args.once:
        def once(_stop: object) -> None:
            keeper.renew()

        return stopping.serve(once, name="weft-kube-credentials", stopped=None) or 0
    return stopping.serve(keeper.run, name="weft-kube-credentials") or 0


def _broker(args: argparse.Namespace) -> int:
    from shim import brokerd, log

    log.configure(args.log_level or "info")
    return brokerd.run(brokerd.BrokerConfig(
        socket=args.socket, state_dir=args.state_dir, backend=args.backend,
        simulated_devices=args.simulated_devices, metrics_address=args.metrics_address or "",
        enforce=args.enforce, watchdog_interval=args.watchdog_interval,
        **({} if args.mps_pool is None else {"mps_pool": args.mps_pool})))


def _status_doc(args: argparse.Namespace, explain: str | None = None) -> dict:
    from shim import status

    if args.socket is not None:
        return status.from_agent(args.socket, explain)
    return status.from_state_dir(args.state_dir, explain)


def _status(args: argparse.Namespace) -> int:
    from shim import status

    doc = _status_doc(args)
    print(json.dumps(doc, indent=2) if args.json else status.table(doc))
    return 0


def _explain(args: argparse.Namespace) -> int:
    from shim import status

    doc = _status_doc(args, explain=args.container_id)
    print(json.dumps(doc, indent=2) if args.json else status.explain_text(doc))
    return 0


def _drain(args: argparse.Namespace) -> int:
    import time

    from shim import status

    doc = status.drain(args.socket, not args.undo)
    if args.undo:
        print(json.dumps(doc) if args.json else f"{doc['node']}: no longer draining; admits new containers again")
        return 0
    if not args.json:
        print(f"{doc['node']}: draining: admits no new containers; waiting for the {len(doc['hosted'])} it hosts "
              f"to be removed by their origins (at most {args.timeout:g}s)", flush=True)
    deadline = time.monotonic() + args.timeout
    tty = sys.stdout.isatty() and not args.json
    while isinstance(doc["hosted"], str) or doc["hosted"]:
        if time.monotonic() >= deadline:
            left = doc["hosted"] if isinstance(doc["hosted"], str) else ", ".join(
                f"{h['name']} ({h['id'][:13]}, {h['state']}, for {h['origin']})" for h in doc["hosted"])
            print(json.dumps({**doc, "done": False}) if args.json else
                  f"\n{doc['node']}: still hosting after {args.timeout:g}s: {left}; the node stays draining "
                  "('weft drain --undo' ends it)", flush=True)
            return 1
        if not args.json:
            hosted = doc["hosted"]
            text = (f"  {len(hosted)} hosted ({sum(h['state'] == 'running' for h in hosted)} running): "
                    + ", ".join(h["name"] for h in hosted[:5]) if not isinstance(hosted, str) else f"  {hosted}")
            print(("\r" + text + " " * 10) if tty else text, end="" if tty else "\n", flush=True)
        time.sleep(args.interval)
        doc = status.drain(args.socket, True)
    print(json.dumps({**doc, "done": True}) if args.json else
          ("\n" if tty else "") + f"{doc['node']}: drained: hosts nothing; 'weft drain --undo' admits again",
          flush=True)
    return 0


def _mesh_certs(args: argparse.Namespace) -> int:
    from shim.mesh import certs

    names = [n.strip() for n in ",".join(args.nodes or []).split(",") if n.strip()]
    addresses: dict[str, list[str]] = {}
    for spec in args.node or []:
        name, addrs = certs.parse_node_spec(spec)
        if name not in names:
            names.append(name)
        addresses.setdefault(name, []).extend(addrs)
    return certs.main(args.out, names, {n: a for n, a in addresses.items() if a})


def _demo(args: argparse.Namespace) -> int:
    import os

    from shim.localfabric import demo, demo_keep

    if args.down:
        return demo_keep.down(args.state_file)
    if args.keep and demo_keep.KEEPER_ENV not in os.environ:
        demo_keep.refuse_if_kept(args.state_file)
        return demo_keep.launch(["demo", "--keep", *(["--json"] if args.json else []),
                                 *(["--state-file", str(args.state_file)] if args.state_file else [])])
    return demo.main(keep=args.keep, as_json=args.json, state_file=args.state_file)


def _bench(args: argparse.Namespace) -> int:
    from shim.bench import proxy

    if args.what == "hook":
        from shim.bench import hook

        return hook.main(as_json=args.json, samples=args.samples, output=args.output)
    if args.what == "broker":
        from shim.bench import broker

        return broker.main(as_json=args.json, samples=args.samples, output=args.output)
    if args.what == "packing":
        from shim.bench import packing

        return packing.main(as_json=args.json, output=args.output)
    if args.what == "mesh":
        from shim.bench import mesh

        return mesh.main(as_json=args.json, starts=3 if args.quick else args.starts,
                         samples=50 if args.quick else args.samples, output=args.output)
    if args.what == "mesh-scale":
        from shim.bench import mesh_scale

        return mesh_scale.main(as_json=args.json, peers=args.peers, quick=args.quick, output=args.output)
    if args.what == "host-scale":
        from shim.bench import host_scale

        return host_scale.main(as_json=args.json, origins=args.origins, quick=args.quick, output=args.output)
    if args.what == "network":
        from shim.bench import network

        return network.main(as_json=args.json, gib=0.25 if args.quick else 1.0,
                            samples=1000 if args.quick else 3000, output=args.output,
                            busy_poll_us=args.stream_busy_poll_us)
    if args.what == "e2e":
        from shim.bench import e2e

        return e2e.main(as_json=args.json, quick=args.quick, starts=args.starts, samples=args.samples,
                        pods=args.pods, churn_seconds=args.churn_seconds, output=args.output, cpusets=args.cpusets)
    if args.what == "tunnel":
        from shim.bench import tunnel

        return tunnel.main(as_json=args.json, gib=0.25 if args.quick else 1.0,
                           samples=500 if args.quick else args.samples, output=args.output)
    if args.what == "hosted-cpu":
        from shim.bench import hosted_cpu

        return hosted_cpu.main(as_json=args.json, quick=args.quick, output=args.output)
    if args.what == "proxy":
        return proxy.main(
            as_json=args.json, pods=args.pods, samples=args.samples, load_seconds=args.load_seconds,
            output=args.output,
        )
    from shim.errors import WeftError

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
    a.add_argument("--broker-socket", type=Path, help="the GPU broker's socket (omit on nodes without GPUs)")
    a.add_argument("--cdi-spec-dirs", help="where containerd reads CDI specs, colon-separated "
                   "(default /etc/cdi:/var/run/cdi): a DRA claim's GPUs are read there")
    a.add_argument("--node-name", help="this node's name in the mesh (default: the host name)")
    a.add_argument("--role", choices=("gpu", "cpu", "both"), help="what this node offers the mesh")
    a.add_argument("--mesh-address", help="HOST:PORT for the peer mesh (mutual TLS); omit for no mesh")
    a.add_argument("--peers", help="static peers file (TOML [[peer]] tables) or 'kubernetes'")
    a.add_argument("--tls-dir", type=Path, help="mesh certificates: ca.crt and <node>.crt/.key")
    a.add_argument("--kubeconfig", type=Path, help="the Kubernetes API for this agent (default: in-cluster "
                   "configuration where there is one, else none)")
    a.set_defaults(fn=_agent)

    kc = sub.add_parser("kube-credentials", help="keep a kubeconfig for the host agent, with a service-account "
                        "token renewed before it expires (run by the DaemonSet)")
    kc.add_argument("--dir", type=Path, default=Path("/etc/weft"), help="where to write kubeconfig and token "
                    "(default /etc/weft)")
    kc.add_argument("--lifetime", type=int, default=3600, help="seconds each token lasts (default 3600; the API "
                    "server's minimum is 600)")
    kc.add_argument("--refresh", type=float, default=0.5, help="renew when this share of a token's lifetime has "
                    "passed (default 0.5)")
    kc.add_argument("--once", action="store_true", help="write a token and the kubeconfig, then exit")
    kc.add_argument("--kubeconfig", type=Path, help="ask the API as this kubeconfig's user instead of the pod's "
                    "service account (with --namespace and --service-account)")
    kc.add_argument("--namespace", help="the service account's namespace (default: the pod's)")
    kc.add_argument("--service-account", help="the service account (default: the pod's)")
    kc.set_defaults(fn=_kube_credentials)

    br = sub.add_parser("broker", help="serve GPU leases on a unix socket until SIGTERM")
    br.add_argument("--socket", type=Path, required=True, help="unix socket of the broker API")
    br.add_argument("--state-dir", type=Path, required=True, help="where leases are kept")
    br.add_argument("--backend", choices=("nvml", "simulated"), required=True)
    br.add_argument("--simulated-devices", default="2x80GiB", help="simulated GPUs, e.g. 2x80GiB or 4x40GiB,1x80GiB")
    br.add_argument("--metrics-address", help="HOST:PORT for /metrics")
    br.add_argument("--enforce", choices=("log", "kill"), default="kill",
                    help="what to do with a container over its lease or outside its MPS server (default: kill)")
    br.add_argument("--watchdog-interval", type=float, default=1.0, help="seconds between usage samples")
    br.add_argument("--mps-pool", type=int, metavar="N",
                    help="MPS control daemons kept started ahead per GPU, so that a shared lease does not wait for "
                         "one to start (nvml backend; 0: each lease starts its own; default: one)")
    br.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    br.set_defaults(fn=_broker)

    for name, fn, text in (("status", _status, "opted-in sandboxes, placements and GPU leases"),
                           ("explain", _explain, "why a container was placed where it is")):
        sp = sub.add_parser(name, help=text)
        if name == "explain":
            sp.add_argument("container_id", help="container ID (or a unique prefix)")
        src = sp.add_mutually_exclusive_group()
        src.add_argument("--state-dir", type=Path, default=Path("/var/lib/weft"), help="read the state files here")
        src.add_argument("--socket", type=Path, help="ask the running agent on this socket")
        sp.add_argument("--json", action="store_true", help="one JSON object")
        sp.set_defaults(fn=fn)

    dr = sub.add_parser("drain", help="a host stops admitting new containers and waits until those it hosts are gone")
    dr.add_argument("--socket", type=Path, default=Path("/run/weft/cri.sock"), help="the host agent's socket")
    dr.add_argument("--undo", action="store_true", help="admit new containers again")
    dr.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for hosted containers to go")
    dr.add_argument("--interval", type=float, default=1.0, help=argparse.SUPPRESS)
    dr.add_argument("--json", action="store_true", help="one JSON object at the end")
    dr.set_defaults(fn=_drain)

    mc = sub.add_parser("mesh-certs", help="make a mesh CA (or reuse one) and node certificates")
    mc.add_argument("--out", type=Path, required=True, help="directory for ca.crt/ca.key and <node>.crt/.key")
    mc.add_argument("--nodes", action="append", metavar="A,B,C", help="node names, comma-separated")
    mc.add_argument("--node", action="append", metavar="NAME[=ADDR,...]",
                    help="a node with the addresses its certificate should name too (repeatable)")
    mc.set_defaults(fn=_mesh_certs)
    from shim.mesh import cli as mesh_cli

    mesh_cli.add_parser(sub)

    from shim.sim import cli as sim_cli

    sim_cli.add_parser(sub)
    from shim.install import cli as install_cli

    install_cli.add_parser(sub)
    from shim.report import cli as report_cli

    report_cli.add_parser(sub)
    from shim.gpucheck import cli as gpucheck_cli

    gpucheck_cli.add_parser(sub)

    d = sub.add_parser("demo", help="three test nodes (a GPU origin, two CPU hosts), a two-stage pod through them, "
                       "then clean up")
    dm = d.add_mutually_exclusive_group()
    dm.add_argument("--keep", action="store_true", help="leave it all running (for crictl) until 'weft demo --down'")
    dm.add_argument("--down", action="store_true", help="remove a demo left by --keep (nothing to do is fine)")
    d.add_argument("--json", action="store_true", help="end with one JSON line: nodes, the pod's sandbox, containers")
    d.add_argument("--state-file", type=Path, help="where --keep describes the fabric for --down "
                   "(default /run/weft-demo/state.json)")
    d.set_defaults(fn=_demo)

    b = sub.add_parser("bench", help="benchmarks that compare side by side in one run")
    b.add_argument("what", choices=("proxy", "hook", "broker", "packing", "mesh", "e2e", "network", "mesh-scale",
                                    "host-scale", "hosted-cpu", "tunnel"))
    b.add_argument("--json", action="store_true", help="print machine-readable figures")
    b.add_argument("--pods", type=int, default=50, help="running pods during the list and load phases")
    b.add_argument("--samples", type=int, default=2000, help="calls per method and path for latency")
    b.add_argument("--load-seconds", type=float, default=60.0, help="length of the kubelet-like load phase")
    b.add_argument("--output", type=Path, help="also write the JSON figures to this file "
                   "(e2e: a directory for e2e.json and e2e.md, default bench/results/)")
    b.add_argument("--starts", type=int, default=20, help="mesh, e2e: container and pod starts per side")
    b.add_argument("--churn-seconds", type=float, default=30.0, help="e2e: length of the 50-pod churn")
    b.add_argument("--quick", action="store_true", help="mesh, e2e, mesh-scale, host-scale, hosted-cpu, tunnel: a "
                   "reduced run (few samples, short phases)")
    b.add_argument("--peers", help="mesh-scale: the fleet sizes to measure, N or N,N,... (default 100,1000,5000)")
    b.add_argument("--origins", help="host-scale: the numbers of origins watching the host, N or N,N,... "
                   "(default 10,100,500)")
    b.add_argument("--cpusets", action="store_true", help="e2e: each node confined to CPUs of its own (the origin "
                   "on half of this machine's, the hosts on the other half), as on separate machines; writes "
                   "e2e-cpusets.json and e2e-cpusets.md")
    b.add_argument("--stream-busy-poll-us", type=int, help="network: the agents' agent.stream_busy_poll_us "
                   "(default: the agents' default)")
    b.set_defaults(fn=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """weft's command line; ``argv`` None: the process's own (``sys.argv``), whose signals are then its to take."""
    entry = argv is None
    if entry:
        stopping.end_at_once()  # again after nodeimage/bin/weft and python -m shim; first for the console script
        argv = sys.argv[1:]
        if not (argv[:1] and argv[0] in SERVING | INSTALLING):
            stopping.as_usual()  # the other commands take signals as they always did
    if argv[:1] == ["gpu-check"]:  # before the whole parser: a driverless node's answer must come at once
        from shim.gpucheck import cli as gpucheck_cli

        return gpucheck_cli.main(argv)
    args = parser().parse_args(argv)
    from shim.errors import WeftError

    try:
        if entry and args.command in INSTALLING:
            # Ended at once by SIGTERM, as any process its default action ends (which a PID 1 never is): the
            # installer's journal makes a later run finish the job from any point, as after kill -9.
            return stopping.serve(lambda _stop: args.fn(args), name=f"weft-{args.command}", grace_s=0.0,
                                  stopped=None)
        return args.fn(args)
    except WeftError as exc:
        print(f"weft {args.command}: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
