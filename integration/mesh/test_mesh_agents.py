"""Agents on a peer mesh: mutual TLS, a static peers file, Hello with capacity, a peer lost and back.

Three agents on this machine (mesh on loopback ports; the three-node network
harness comes with rerouting), each with its own certificate from one CA.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for

NODES = ("gpu-1", "cpu-1", "cpu-2")
ROLES = {"gpu-1": "gpu", "cpu-1": "cpu", "cpu-2": "cpu"}


def _status(agent: AgentProcess) -> dict:
    out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--socket", str(agent.socket)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)




@pytest.fixture
def mesh(containerd: Containerd, tmp_path: Path) -> Iterator[dict[str, AgentProcess]]:
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(certs), "--nodes", ",".join(NODES)],
                   check=True, capture_output=True)
    ports = {n: free_port() for n in NODES}
    peers = tmp_path / "peers.toml"
    peers.write_text("".join(f'[[peer]]\nname = "{n}"\naddress = "127.0.0.1:{ports[n]}"\nrole = "{ROLES[n]}"\n\n'
                             for n in NODES))
    conf = tmp_path / "weft.toml"
    conf.write_text("[mesh]\nhello_interval = 0.3\n")
    agents = {n: AgentProcess(containerd, tmp_path / n, name=n, extra_args=[
        "--config", str(conf), "--node-name", n, "--role", ROLES[n], "--mesh-address", f"127.0.0.1:{ports[n]}",
        "--peers", str(peers), "--tls-dir", str(certs)]) for n in NODES}
    try:
        for a in agents.values():
            a.start()
        yield agents
    finally:
        for a in agents.values():
            a.stop()


def test_agents_see_each_other_with_roles_and_capacity(mesh: dict[str, AgentProcess]) -> None:
    def healthy_peers():
        peers = _status(mesh["gpu-1"]).get("peers", [])
        return peers if sum(p["healthy"] for p in peers) == 2 else None

    peers = {p["node"]: p for p in wait_for(healthy_peers, timeout=15, what="both peers healthy")}
    assert set(peers) == {"cpu-1", "cpu-2"}
    assert peers["cpu-1"]["role"] == "cpu"
    assert peers["cpu-1"]["free_cpu_cores"] >= 0 and peers["cpu-1"]["free_memory_bytes"] > 0
    assert 'weft_mesh_peer_up{peer="cpu-2"} 1.0' in mesh["gpu-1"].metrics_text()


def test_a_lost_peer_is_seen_and_logged_once_then_back(mesh: dict[str, AgentProcess]) -> None:
    gpu = mesh["gpu-1"]
    wait_for(lambda: all(p["healthy"] for p in _status(gpu).get("peers", [])) and _status(gpu)["peers"],
          timeout=15, what="peers healthy")
    mesh["cpu-2"].stop(sig=9)
    lost = wait_for(lambda: next((p for p in _status(gpu)["peers"] if p["node"] == "cpu-2" and not p["healthy"]), None),
                 timeout=15, what="cpu-2 marked unhealthy")
    assert lost["error"]
    time.sleep(1)  # several Hello rounds: still one log line
    assert [e["peer"] for e in gpu.events() if e.get("event") == "peer.lost"] == ["cpu-2"]
    mesh["cpu-2"].start()
    wait_for(lambda: next((p for p in _status(gpu)["peers"] if p["node"] == "cpu-2" and p["healthy"]), None),
          timeout=20, what="cpu-2 back")
    assert [e["peer"] for e in gpu.events() if e.get("event") == "peer.up"].count("cpu-2") == 2


def test_bad_mesh_configuration_names_what_to_fix(containerd: Containerd, tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "shim", "agent", "--socket", str(tmp_path / "a.sock"),
                          "--containerd-socket", str(containerd.socket), "--state-dir", str(tmp_path / "s"),
                          "--mesh-address", "127.0.0.1:7443"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 2 and "mesh.peers: required" in res.stderr
