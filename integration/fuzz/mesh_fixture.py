"""A real CPU host agent (cpu-1) serving the mesh over mutual TLS, and raw mesh channels to it.

Its peers file knows two origins, gpu-1 and gpu-2. Certificates for both, for
``stranger`` (signed by the cluster CA but in no peers file) and for a node
signed by another CA are at hand, so tests can speak as any of them with raw
request bytes.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from cri_api.v1 import api_pb2 as cri

from shim._pb import mesh_pb2 as pb
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess, free_port
from shim.localfabric.containerd import Containerd
from shim.mesh import certs
from shim.mesh.certs import MeshTls, load_node_tls

REPO = Path(__file__).resolve().parents[2]
MESH = "/weft.mesh.v1.Mesh/"
ORIGINS = ("gpu-1", "gpu-2")


@dataclass
class MeshHost:
    agent: AgentProcess
    containerd: Containerd
    port: int
    tls: dict[str, MeshTls]
    cert_dir: Path  # the pairs in ``tls`` as files (mesh-certs' layout), for tunnel contexts

    def channel(self, as_node: str, dial: str = "cpu-1") -> grpc.Channel:
        key, cert, ca = self.tls[as_node]
        creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        return grpc.secure_channel(f"127.0.0.1:{self.port}", creds, options=[
            ("grpc.ssl_target_name_override", dial), ("grpc.max_send_message_length", 64 << 20)])

    def shadows(self) -> tuple[set[str], set[str]]:
        """(sandbox ids, container ids) in the host's containerd, asked directly."""
        from cri_api.v1 import api_pb2_grpc as cri_grpc

        with self.containerd.channel() as ch:
            rt = cri_grpc.RuntimeServiceStub(ch)
            return ({s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items},
                    {c.id for c in rt.ListContainers(cri.ListContainersRequest(), timeout=10).containers})


def ask(ch: grpc.Channel, method: str, request, timeout: float = 120) -> tuple[grpc.StatusCode, str, bytes | None]:
    """A raw mesh call: (OK, "", the answer's bytes), or (its code, its details, None)."""
    try:
        return grpc.StatusCode.OK, "", ch.unary_unary(MESH + method)(request.SerializeToString(), timeout=timeout)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


@contextlib.contextmanager
def running_shadow(mesh: MeshHost, req: pb.RunShadowRequest) -> Iterator[pb.ShadowState]:
    """The shadow ``req`` asks gpu-1's host for (RunShadow must succeed), removed on leaving; and then no sandbox
    or container of it is left in the host's containerd."""
    with mesh.channel("gpu-1") as ch:
        code, details, raw = ask(ch, "RunShadow", req)
        try:
            assert code is grpc.StatusCode.OK, details
            yield pb.ShadowState.FromString(raw)
        finally:
            ask(ch, "RemoveShadow", pb.ShadowRef(origin_node="gpu-1", key=req.key))
    assert mesh.shadows() == (set(), set())


def run_shadow_request(node: Containerd, origin: str, key: str, sandbox: str = "origin-sb-1",
                       **container) -> pb.RunShadowRequest:
    sandbox_cfg = pods.sandbox_config("infer", node.pod_log_dir, cgroup_parent=node.cgroup_root)
    config = pods.container_config("tokenize", ["sh", "-c", "exec sleep 3600"], **container)
    res = config.linux.resources  # a host admits by limits: 0.1 core and the 64 MiB of container_config
    res.cpu_period, res.cpu_quota = 100000, 10000
    return pb.RunShadowRequest(origin_node=origin, origin_sandbox_id=sandbox, key=key,
                               sandbox_config=sandbox_cfg.SerializeToString(),
                               container_config=config.SerializeToString())


def make_mesh_certs(cert_dir: Path, nodes: tuple[str, ...]) -> None:
    """``weft mesh-certs``: one cluster CA and a key pair per node, in ``cert_dir``."""
    subprocess.run([sys.executable, "-m", "shim", "mesh-certs", "--out", str(cert_dir), "--nodes", ",".join(nodes)],
                   check=True, capture_output=True, cwd=REPO)


def host_agent(containerd: Containerd, workdir: Path, cert_dir: Path, origins: tuple[str, ...],
               mesh_config: str = "") -> tuple[AgentProcess, int]:
    """cpu-1's agent (not started yet) on a free mesh port, its peers file listing ``origins`` and itself, and
    that port."""
    port = free_port()
    peers = workdir / "peers.toml"
    listed = [(o, free_port(), "gpu") for o in origins] + [("cpu-1", port, "cpu")]
    peers.write_text("".join(f'[[peer]]\nname = "{name}"\naddress = "127.0.0.1:{p}"\nrole = "{role}"\n\n'
                             for name, p, role in listed))
    # A fixed capacity, as the local fabric's hosts have: what this shared machine happens to be busy with
    # must not decide whether RunShadow admits.
    config = workdir / "weft.toml"
    config.write_text(f'[mesh]\nfixed_capacity = "8,32Gi"\n{mesh_config}')
    return AgentProcess(containerd, workdir / "cpu-1", name="cpu-1", extra_args=[
        "--config", str(config), "--node-name", "cpu-1", "--role", "cpu", "--mesh-address", f"127.0.0.1:{port}",
        "--peers", str(peers), "--tls-dir", str(cert_dir)]), port


def mesh_host(containerd: Containerd, workdir: Path) -> Iterator[MeshHost]:
    cert_dir = workdir / "certs"
    make_mesh_certs(cert_dir, (*ORIGINS, "cpu-1", "stranger"))
    tls = {n: load_node_tls(cert_dir, n) for n in (*ORIGINS, "cpu-1", "stranger")}
    ca_key, ca_pem = certs.generate_ca("another cluster")
    key, cert = certs.issue_node_cert(ca_key, ca_pem, "gpu-1")
    tls["foreign-gpu-1"] = MeshTls(key, cert, tls["gpu-1"].ca_pem)  # trusts our CA, signed by another
    agent, port = host_agent(containerd, workdir, cert_dir, ORIGINS)
    with agent:
        yield MeshHost(agent, containerd, port, tls, cert_dir)
