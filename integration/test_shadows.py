"""A host runs an origin's container as a shadow: real containerd on the host, mTLS between the two agents.

The origin side here is the mesh client the origin agent uses (its CRI verbs
for remote containers come next); everything on the host is real: the agent,
its containerd, the shadow sandbox and container, and its kubelet's view.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration import pods
from integration.agent import AgentProcess, free_port
from integration.harness import Containerd
from integration.waiting import wait_for
from shim._pb import mesh_pb2 as pb
from shim.errors import WeftError
from shim.mesh.certs import load_node_tls
from shim.mesh.client import PeerClient

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def host(containerd: Containerd, tmp_path: Path) -> Iterator[tuple[AgentProcess, PeerClient, Containerd]]:
    certs = tmp_path / "certs"
    subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(certs), "--nodes", "gpu-1,cpu-1"],
                   check=True, capture_output=True, cwd=REPO)
    port = free_port()
    peers = tmp_path / "peers.toml"
    peers.write_text(f'[[peer]]\nname = "gpu-1"\naddress = "127.0.0.1:{free_port()}"\nrole = "gpu"\n\n'
                     f'[[peer]]\nname = "cpu-1"\naddress = "127.0.0.1:{port}"\nrole = "cpu"\n')
    agent = AgentProcess(containerd, tmp_path / "cpu-1", name="cpu-1", extra_args=[
        "--node-name", "cpu-1", "--role", "cpu", "--mesh-address", f"127.0.0.1:{port}", "--peers", str(peers),
        "--tls-dir", str(certs)])
    with agent, PeerClient("cpu-1", f"127.0.0.1:{port}", load_node_tls(certs, "gpu-1")) as client:
        yield agent, client, containerd


def _request(node: Containerd, key: str, **container) -> pb.RunShadowRequest:
    sandbox = pods.sandbox_config("infer", node.pod_log_dir, cgroup_parent=node.cgroup_root)
    config = pods.container_config("tokenize", ["sh", "-c", "echo tokenizing; exec sleep 3600"], **container)
    return pb.RunShadowRequest(origin_node="gpu-1", origin_sandbox_id="origin-sb-1", key=key,
                               sandbox_config=sandbox.SerializeToString(), container_config=config.SerializeToString())


def test_a_shadow_runs_hidden_from_the_hosts_kubelet_and_goes_away(host) -> None:
    agent, client, node = host
    state = client.run_shadow(_request(node, "origin-sb-1/tokenize/0"))
    status = cri.ContainerStatus.FromString(state.status)
    assert status.state == cri.CONTAINER_CREATED  # as after CreateContainer: kubelet starts it next
    started = client.start_shadow("gpu-1", "origin-sb-1/tokenize/0")
    assert cri.ContainerStatus.FromString(started.status).state == cri.CONTAINER_RUNNING
    assert status.labels["weft.io/origin-node"] == "gpu-1"
    # Idempotent: the origin retrying gets the same shadow.
    assert client.run_shadow(_request(node, "origin-sb-1/tokenize/0")).shadow_container_id == state.shadow_container_id
    with node.channel() as direct, agent.channel() as kubelet:
        assert state.shadow_container_id in {c.id for c in cri_grpc.RuntimeServiceStub(direct).ListContainers(
            cri.ListContainersRequest()).containers}
        hidden = cri_grpc.RuntimeServiceStub(kubelet)
        wait_for(lambda: state.shadow_sandbox_id not in {s.id for s in hidden.ListPodSandbox(
            cri.ListPodSandboxRequest()).items}, what="the host's kubelet view to hide the shadow")
        assert state.shadow_container_id not in {c.id for c in hidden.ListContainers(
            cri.ListContainersRequest()).containers}
    # Low CPU weight, so the host's own pods win.
    out = node_exec(node, state.shadow_container_id, ["cat", "/sys/fs/cgroup/cpu/cpu.shares"])
    assert out.strip() == b"2"
    assert client.shadow_status("gpu-1", "origin-sb-1/tokenize/0").shadow_container_id == state.shadow_container_id
    assert client.remove_shadow("gpu-1", "origin-sb-1/tokenize/0") is True
    with node.channel() as direct:
        rt = cri_grpc.RuntimeServiceStub(direct)
        listed = rt.ListContainers(cri.ListContainersRequest()).containers
        assert state.shadow_container_id not in {c.id for c in listed}
        assert state.shadow_sandbox_id not in {s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest()).items}
    assert client.remove_shadow("gpu-1", "origin-sb-1/tokenize/0") is False


def node_exec(node: Containerd, cid: str, cmd: list[str]) -> bytes:
    with node.channel() as ch:
        req = cri.ExecSyncRequest(container_id=cid, cmd=cmd, timeout=10)
        return cri_grpc.RuntimeServiceStub(ch).ExecSync(req).stdout


def test_a_host_never_runs_what_must_not_be_rerouted(host) -> None:
    _, client, node = host
    req = _request(node, "origin-sb-1/priv/0")
    config = cri.ContainerConfig.FromString(req.container_config)
    config.linux.security_context.privileged = True
    req.container_config = config.SerializeToString()
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert "privileged" in err.value.message
    with node.channel() as direct:
        assert not cri_grpc.RuntimeServiceStub(direct).ListContainers(cri.ListContainersRequest()).containers


def test_a_peer_cannot_ask_in_another_origins_name(host) -> None:
    _, client, node = host
    req = _request(node, "origin-sb-1/tokenize/0")
    req.origin_node = "cpu-1"  # gpu-1's certificate, claiming to be someone else
    with pytest.raises(WeftError) as err:
        client.run_shadow(req)
    assert err.value.code is grpc.StatusCode.PERMISSION_DENIED
