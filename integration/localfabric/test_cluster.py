"""The multi-node cluster keeps its promises, checked over real links, pods and processes.

Mesh tests will trust ``shim.localfabric.nodes.Cluster`` to give them nodes that
reach each other, and each other's pods, only through the mesh bridge, to
break exactly one node's link on ``cut`` and to leave nothing behind. These
check that: every probe below names the address it must come from or the way
it must fail, so a cluster whose nodes shared a namespace, or whose cut did
nothing, would not pass.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import psutil
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc

from shim.localfabric import pods
from shim.localfabric.containerd import NETNS_DIR, Containerd, RuntimeHandler
from shim.localfabric.nodes import Cluster, Node

pytestmark = pytest.mark.slow

PORT = 7000
POD_PORT = 8080

# Answers each connection with the address it came from, so a probe shows which path it took.
_ECHO = """
import socket, sys
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    conn, (peer, _) = srv.accept()
    with conn:
        conn.sendall(peer.encode() + b" " + conn.recv(64))
"""

# Connects to each HOST:PORT once; prints what came back, or how it failed.
_PROBE = """
import errno, json, socket, sys
out = {}
for target in sys.argv[2:]:
    host, port = target.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=float(sys.argv[1])) as s:
            s.sendall(b"hello")
            out[target] = s.recv(64).decode().strip()
    except OSError as e:
        out[target] = errno.errorcode.get(e.errno, "timeout") if e.errno else "timeout"
print(json.dumps(out))
"""


def probe(node: Node | None, *targets: str, timeout: float = 2.0) -> dict[str, str]:
    """Connect from ``node``'s namespace (the root namespace for None) to each target."""
    argv = [sys.executable, "-c", _PROBE, str(timeout), *targets]
    if node is None:
        res = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=30)
    else:
        res = node.run(*argv, timeout=30)
    return json.loads(res.stdout)


def start_echo(node: Node) -> subprocess.Popen[str]:
    # The node's work directory on the command line marks the process as the cluster's (see the close test).
    proc = node.popen([sys.executable, "-c", _ECHO, node.mesh_ip, str(PORT), str(node.workdir)],
                      stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", f"echo server on {node.name} exited with {proc.wait()}"
    return proc


def run_pod(ctrd: Containerd, name: str, command: list[str], runtime_handler: str = "") -> tuple[str, str, str]:
    """A running one-container pod; returns its sandbox id, IP and container id."""
    with ctrd.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        sb_cfg = pods.sandbox_config(name, ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root)
        sandbox = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sb_cfg, runtime_handler=runtime_handler),
                                   timeout=60).pod_sandbox_id
        c_cfg = pods.container_config(name, command)
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sandbox, config=c_cfg,
                                                            sandbox_config=sb_cfg), timeout=60).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
        ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sandbox), timeout=30).status.network.ip
    return sandbox, ip, cid


def wait_exit(ctrd: Containerd, cid: str, timeout: float = 20.0) -> int:
    with ctrd.channel() as ch:
        rt = api_pb2_grpc.RuntimeServiceStub(ch)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status
            if status.state == cri.CONTAINER_EXITED:
                return status.exit_code
            time.sleep(0.1)
    raise AssertionError(f"container {cid} still running after {timeout}s")


def probe_until(node: Node | None, target: str, want: str, timeout: float = 15.0) -> str:
    """Probe until the answer is ``want`` (a pod's listener restarts between connections); returns the last answer."""
    deadline = time.monotonic() + timeout
    got = ""
    while time.monotonic() < deadline:
        got = probe(node, target, timeout=1.0)[target]
        if got == want:
            break
        time.sleep(0.1)
    return got


def test_nodes_reach_each_other_and_the_root_namespace_reaches_them() -> None:
    with Cluster(n=3) as cluster:
        nodes = cluster.nodes
        assert [n.name for n in nodes] == ["node0", "node1", "node2"]
        assert len({n.netns for n in nodes}) == 3 and len({n.mesh_ip for n in nodes}) == 3
        for node in nodes:
            start_echo(node)
        for node in nodes:
            targets = [f"{peer.mesh_ip}:{PORT}" for peer in nodes if peer is not node]
            # Each answer names the connecting address: the node's own mesh IP, so over the mesh link.
            assert probe(node, *targets) == {t: f"{node.mesh_ip} hello" for t in targets}
        targets = [f"{n.mesh_ip}:{PORT}" for n in nodes]
        assert probe(None, *targets) == {t: f"{cluster.bridge_ip} hello" for t in targets}
        # The servers listen on the mesh IP of their own namespace only: the root namespace does not have it.
        assert probe(None, f"127.0.0.1:{PORT}")[f"127.0.0.1:{PORT}"] == "ECONNREFUSED"


def test_pods_reach_pods_on_other_nodes() -> None:
    with Cluster(n=2) as cluster:
        node0, node1 = cluster.nodes
        listener = ["sh", "-c", f"while true; do echo hi | nc -l -p {POD_PORT}; done"]
        _, pod_ip, _ = run_pod(node1.containerd, "server", listener)
        assert ipaddress.ip_address(pod_ip) in ipaddress.ip_network(node1.pod_subnet), (pod_ip, node1.pod_subnet)
        target = f"{pod_ip}:{POD_PORT}"
        # From node0's namespace (where a weft agent would dial its peers' pods) and from the test process.
        assert probe_until(node0, target, "hi") == "hi"
        assert probe_until(None, target, "hi") == "hi"
        # Pod to pod across nodes: a pod on node0 reads the server pod's greeting.
        client = ["sh", "-c", f'for i in $(seq 100); do [ "$(nc -w 1 {pod_ip} {POD_PORT})" = hi ] && exit 0; '
                              "sleep 0.1; done; exit 1"]
        _, client_ip, cid = run_pod(node0.containerd, "client", client)
        assert ipaddress.ip_address(client_ip) in ipaddress.ip_network(node0.pod_subnet)
        assert wait_exit(node0.containerd, cid) == 0


def test_cut_isolates_one_node_and_heal_restores_it() -> None:
    with Cluster(n=3) as cluster:
        node0, node1, node2 = cluster.nodes
        echo1 = start_echo(node1)
        start_echo(node2)
        to1, to2 = f"{node1.mesh_ip}:{PORT}", f"{node2.mesh_ip}:{PORT}"
        assert probe(node0, to1, to2) == {to1: f"{node0.mesh_ip} hello", to2: f"{node0.mesh_ip} hello"}

        cluster.cut(1)
        started = time.monotonic()
        # No answer at all, not a refusal: the node is still there, its link is not.
        assert probe(node0, to1, to2, timeout=1.0) == {to1: "timeout", to2: f"{node0.mesh_ip} hello"}
        assert time.monotonic() - started < 5
        assert probe(None, to1, timeout=1.0) == {to1: "timeout"}
        assert probe(node1, to2, timeout=1.0) == {to2: "timeout"}
        assert echo1.poll() is None

        cluster.heal(1)
        assert probe(node0, to1, to2) == {to1: f"{node0.mesh_ip} hello", to2: f"{node0.mesh_ip} hello"}
        assert probe(node1, to2) == {to2: f"{node1.mesh_ip} hello"}


def test_kill_node_stops_its_processes_and_containerd_but_not_its_link() -> None:
    with Cluster(n=2) as cluster:
        node0, node1 = cluster.nodes
        echo1 = start_echo(node1)
        to1 = f"{node1.mesh_ip}:{PORT}"
        cluster.kill_node(1)
        assert echo1.poll() is not None and not node1.containerd.running
        # The node still answers on the wire: a refusal, at once.
        assert probe(node0, to1, timeout=1.0) == {to1: "ECONNREFUSED"}
        node1.containerd.start()
        start_echo(node1)
        assert probe(node0, to1) == {to1: f"{node0.mesh_ip} hello"}


def test_handlers_for_gives_only_the_chosen_node_its_runtime_handlers() -> None:
    seen: list[tuple[int, Path, bool]] = []

    def handlers_for(i: int, workdir: Path) -> list[RuntimeHandler] | None:
        seen.append((i, workdir, workdir.is_dir()))
        return [RuntimeHandler("weft-test")] if i == 1 else None

    with Cluster(n=2, handlers_for=handlers_for, names=["a", "b"]) as cluster:
        a, b = cluster.nodes
        assert (a.name, b.name) == ("a", "b")
        assert seen == [(0, a.workdir, True), (1, b.workdir, True)]
        _, ip, _ = run_pod(b.containerd, "handled", ["sleep", "3600"], runtime_handler="weft-test")
        assert ipaddress.ip_address(ip) in ipaddress.ip_network(b.pod_subnet)
        with pytest.raises(grpc.RpcError, match="weft-test"):
            run_pod(a.containerd, "unhandled", ["sleep", "3600"], runtime_handler="weft-test")


def _links() -> set[str]:
    return {p.name for p in Path("/sys/class/net").iterdir()}


def _link_ids(names: list[str]) -> dict[str, int]:
    """Each link's ifindex, for those that exist: one made again under the same name has another."""
    out = {}
    for name in names:
        with contextlib.suppress(OSError):
            out[name] = int(Path(f"/sys/class/net/{name}/ifindex").read_text())
    return out


def _route_ids(subnets: list[str]) -> dict[str, tuple[str, int]]:
    """Each subnet's route: its device and that device's ifindex (a route made again by another test differs)."""
    out = {}
    for subnet in subnets:
        res = subprocess.run(["ip", "-j", "route", "show", subnet], capture_output=True, text=True, check=True)
        for route in json.loads(res.stdout or "[]"):
            dev = route.get("dev", "")
            out[subnet] = (dev, _link_ids([dev]).get(dev, -1))
    return out


def _netns_ids(names: list[str]) -> dict[str, int]:
    """Each named network namespace's inode, for those that exist: one made again under the name has another."""
    out = {}
    for name in names:
        with contextlib.suppress(OSError):
            out[name] = (NETNS_DIR / name).stat().st_ino
    return out


def _procs_mentioning(needles: list[str]) -> list[str]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or ())
        if any(n in cmdline for n in needles):
            found.append(f"{p.pid} {cmdline[:120]}")
    return found


def _routes() -> str:
    return subprocess.run(["ip", "route"], capture_output=True, text=True, check=True).stdout


def test_close_leaves_nothing_behind_even_when_the_test_fails() -> None:
    cluster = Cluster(n=2)
    with pytest.raises(RuntimeError, match="the test failed"), cluster:
        node0, node1 = cluster.nodes
        start_echo(node0)
        run_pod(node1.containerd, "left-running", ["sleep", "3600"])
        links = [cluster.bridge, cluster.veth(0), cluster.veth(1)]
        assert set(links) <= _links()
        namespaces = [n.netns for n in cluster.nodes]
        assert all((NETNS_DIR / ns).exists() for ns in namespaces)
        workdirs = [str(cluster.workdir), *(str(n.containerd.workdir) for n in cluster.nodes)]
        # containerd and shims name their work directory; the echo server names its node's.
        assert len(_procs_mentioning(workdirs)) >= 3, _procs_mentioning(workdirs)
        subnets = [n.pod_subnet for n in cluster.nodes]
        assert all(s in _routes() for s in subnets)
        # By identity, not by name: once closed, its slots are free, and a test on another worker may take one
        # and make a link or namespace of the same name (a CI run saw weftnode4 so, a moment after the close).
        made_links, made_netns, made_routes = _link_ids(links), _netns_ids(namespaces), _route_ids(subnets)
        mesh_links = _link_ids(sorted(link for link in _links() if link.startswith(f"wm{cluster.mesh}n")))
        raise RuntimeError("the test failed")

    still = {**_link_ids(links), **_link_ids(list(mesh_links))}
    left = {
        "links": sorted(name for name, i in {**made_links, **mesh_links}.items() if still.get(name) == i),
        "namespaces": sorted(name for name, i in _netns_ids(namespaces).items() if made_netns.get(name) == i),
        "processes": _procs_mentioning(workdirs),
        "work directories": [d for d in workdirs if Path(d).exists()],
        "routes": sorted(net for net, via in _route_ids(subnets).items() if made_routes.get(net) == via),
    }
    assert not any(left.values()), left
    cluster.close()  # again: nothing to do, and no error
