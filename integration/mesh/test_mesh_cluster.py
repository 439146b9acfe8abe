"""Agents in their own node namespaces, each with its own containerd, meshed over the test cluster's bridge.

The agent is started with ``ip netns exec NS weft agent ...`` as the mesh issue
says an operator may; the mesh uses the nodes' own addresses, and a cut link
shows up as a lost peer that comes back when the link does.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric.nodes import Cluster
from shim.localfabric.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
NAMES = ("gpu-1", "cpu-1", "cpu-2")
ROLES = {"gpu-1": "gpu", "cpu-1": "cpu", "cpu-2": "cpu"}
MESH_PORT = 7443


def _status(socket: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--socket", str(socket)],
                         capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout)


@pytest.fixture
def meshed(tmp_path: Path) -> Iterator[tuple[Cluster, dict[str, Path]]]:
    with Cluster(n=3, names=list(NAMES)) as cluster:
        certs = tmp_path / "certs"
        subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(certs), "--nodes", ",".join(NAMES)],
                       check=True, capture_output=True, cwd=REPO)
        peers = tmp_path / "peers.toml"
        peers.write_text("".join(f'[[peer]]\nname = "{n.name}"\naddress = "{n.mesh_ip}:{MESH_PORT}"\n'
                                 f'role = "{ROLES[n.name]}"\n\n' for n in cluster.nodes))
        conf = tmp_path / "weft.toml"
        conf.write_text("[mesh]\nhello_interval = 0.3\n")
        sockets = {}
        for node in cluster.nodes:
            sock = tmp_path / f"{node.name}.sock"
            sockets[node.name] = sock
            argv = ["ip", "netns", "exec", node.netns, sys.executable, "-m", "shim", "agent",
                    "--socket", str(sock), "--containerd-socket", str(node.containerd.socket),
                    "--state-dir", str(tmp_path / f"{node.name}-state"), "--metrics-address", "",
                    "--config", str(conf), "--node-name", node.name, "--role", ROLES[node.name],
                    "--mesh-address", f"{node.mesh_ip}:{MESH_PORT}", "--peers", str(peers),
                    "--tls-dir", str(certs)]
            log = open(tmp_path / f"{node.name}.log", "ab")  # noqa: SIM115 - handed to the child
            # Started from the root namespace with `ip netns exec`, tracked by the cluster for cleanup.
            proc = subprocess.Popen(argv, stdout=log, stderr=log, cwd=REPO, start_new_session=True)
            log.close()
            node.procs.append(proc)
        for sock in sockets.values():
            wait_for(sock.exists, timeout=20, what=f"{sock.name} to be served")
        yield cluster, sockets


def test_agents_in_node_namespaces_serve_cri_and_mesh(meshed) -> None:
    cluster, sockets = meshed
    # CRI through the agent inside gpu-1's namespace reaches that node's own containerd.
    with grpc.insecure_channel(f"unix://{sockets['gpu-1']}") as ch:
        version = cri_grpc.RuntimeServiceStub(ch).Version(cri.VersionRequest(), timeout=10)
    assert version.runtime_name == "containerd"

    def all_healthy() -> list[dict] | None:
        peers = _status(sockets["gpu-1"]).get("peers", [])
        return peers if len(peers) == 2 and all(p["healthy"] for p in peers) else None

    peers = {p["node"]: p for p in wait_for(all_healthy, timeout=20, what="gpu-1 to see both CPU hosts")}
    assert {n: p["address"] for n, p in peers.items()} == {
        n.name: f"{n.mesh_ip}:{MESH_PORT}" for n in cluster.nodes if n.name != "gpu-1"}

    cluster.cut(2)  # cpu-2's link goes down
    wait_for(lambda: not next(p for p in _status(sockets["gpu-1"])["peers"] if p["node"] == "cpu-2")["healthy"],
             timeout=20, what="cpu-2 to be seen lost")
    assert next(p for p in _status(sockets["gpu-1"])["peers"] if p["node"] == "cpu-1")["healthy"]
    cluster.heal(2)
    wait_for(all_healthy, timeout=30, what="cpu-2 to come back after the link heals")
