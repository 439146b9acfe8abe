"""weft's trust boundaries, tested from the outside (README "Threat model").

- The sockets: the agent's CRI socket, the broker's gRPC socket and its hook
  socket are root's alone (0600, owned by root); mesh keys are 0600.
- The hook boundary: a lease is bound and released only by its own container;
  a pod cannot name another pod's lease in its annotations and take it.
- The mesh: only a peer with a certificate from the cluster CA that names a
  node in the peer list, speaking for that node and no other, is answered;
  a peer reaches only the shadows its own origin made; a host never runs a
  privileged, host-namespace, host-path or device container for anyone.
- Credentials: a registry password given for a pull (kubelet's through the
  agent, or an origin's through the mesh) is in no log and no state file.
"""

from __future__ import annotations

import base64
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness.registry import Registry
from integration.fuzz.mesh_fixture import MESH, MeshHost, run_shadow_request
from shim._pb import mesh_pb2 as pb
from shim.localfabric import images, pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import BrokerProcess, gpu_fabric
from shim.localfabric.containerd import IMAGE_CACHE, Containerd

GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all"}


def _mode(path: Path) -> tuple[int, int]:
    st = path.stat()
    return stat.S_IMODE(st.st_mode), st.st_uid


@dataclass
class GpuNode:
    broker: BrokerProcess
    containerd: Containerd
    agent: AgentProcess

    def rt(self, ch: grpc.Channel) -> cri_grpc.RuntimeServiceStub:
        return cri_grpc.RuntimeServiceStub(ch)


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuNode]:
    workdir = tmp_path_factory.mktemp("security-gpu")
    broker, ctrd = gpu_fabric(workdir)
    with broker, ctrd:
        agent = AgentProcess(ctrd, workdir / "agent",
                             extra_args=["--broker-socket", str(broker.socket), "--log-level", "debug"])
        with agent:
            yield GpuNode(broker, ctrd, agent)


# -- sockets ------------------------------------------------------------------------------------
def test_the_agent_and_broker_sockets_are_roots_alone(gpu_node: GpuNode) -> None:
    hook = gpu_node.broker.socket.with_name(gpu_node.broker.socket.name + ".hook")
    for path in (gpu_node.agent.socket, gpu_node.broker.socket, hook):
        assert stat.S_ISSOCK(path.stat().st_mode), path
        assert _mode(path) == (0o600, 0), path


def test_mesh_private_keys_are_written_for_root_only(tmp_path: Path) -> None:
    from shim.mesh import certs

    paths = certs.write_mesh_certs(tmp_path, ["gpu-1", "cpu-1"])
    keys = [p for name, p in paths.items() if name.endswith(".key")]
    assert len(keys) == 3  # the CA's and each node's
    assert all(_mode(p)[0] == 0o600 for p in keys)


# -- the hook boundary --------------------------------------------------------------------------
def _gpu_pod(node: GpuNode, ch: grpc.Channel, name: str, annotations: dict[str, str] | None = None):
    cfg = pods.sandbox_config(name, node.containerd.pod_log_dir, cgroup_parent=node.containerd.cgroup_root,
                              annotations={"weft.io/gpu-memory.model": "10Gi", **(annotations or {})})
    try:
        sb = node.rt(ch).RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler="weft"),
                                       timeout=60).pod_sandbox_id
    except grpc.RpcError as exc:
        return None, cfg, exc
    return sb, cfg, None


def _remove_pod(node: GpuNode, ch: grpc.Channel, sb: str) -> None:
    node.rt(ch).StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb), timeout=60)
    node.rt(ch).RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb), timeout=60)


def test_a_pod_cannot_take_another_pods_lease_through_its_annotations(gpu_node: GpuNode) -> None:
    """containerd hands weft.io/* pod annotations to every container of the pod, the pause container too."""
    with gpu_node.agent.channel() as ch:
        rt = gpu_node.rt(ch)
        victim, cfg, _ = _gpu_pod(gpu_node, ch, "victim")
        ccfg = pods.container_config("model", ["sleep", "3600"], envs=GPU_ENV)
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=victim, config=ccfg, sandbox_config=cfg),
                                 timeout=60).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
        [lease] = gpu_node.broker.leases()
        assert (lease.state, lease.container_id) == ("bound", cid)
        try:
            thief, _, refused = _gpu_pod(gpu_node, ch, "thief", {"weft.io/lease": lease.lease_id})
            if thief is not None:
                _remove_pod(gpu_node, ch, thief)
            # Whether the thief's pod started or was refused, the victim's lease is untouched.
            [still] = gpu_node.broker.leases()
            assert (still.lease_id, still.state, still.container_id) == (lease.lease_id, "bound", cid), refused
        finally:
            _remove_pod(gpu_node, ch, victim)
        assert gpu_node.broker.leases() == []


# -- the mesh (``mesh``: a CPU host, in conftest) ---------------------------------------------------
# The volume streams (RunShadowChunked, SyncVolumesChunked) are client streams: security/test_mesh_messages.py.
_UNARY = [m.name for m in pb.DESCRIPTOR.services_by_name["Mesh"].methods
          if not m.server_streaming and not m.client_streaming]


def _ask(ch: grpc.Channel, method: str, request) -> tuple[grpc.StatusCode, str, bytes | None]:
    try:
        return grpc.StatusCode.OK, "", ch.unary_unary(MESH + method)(request.SerializeToString(), timeout=60)
    except grpc.RpcError as e:
        return e.code(), e.details() or "", None


def _as(origin: str, method: str, mesh: MeshHost, key: str = "origin-sb-1/tokenize/0"):
    """A request of ``method`` in which ``origin`` speaks for itself."""
    if method == "Hello":
        return pb.HelloRequest(origin=pb.PeerState(node=origin, role="gpu", healthy=True))
    if method == "RunShadow":
        return run_shadow_request(mesh.containerd, origin, key)
    message = getattr(pb, pb.DESCRIPTOR.services_by_name["Mesh"].methods_by_name[method].input_type.name)()
    message.origin_node = origin
    if "key" in message.DESCRIPTOR.fields_by_name:
        message.key = key
    if "method" in message.DESCRIPTOR.fields_by_name:  # ShadowCall: a verb an origin may call
        message.method = "ContainerStats"
    return message


@pytest.mark.parametrize("method", _UNARY)
@pytest.mark.parametrize(
    ("cert", "speaks_for", "words"),
    [
        pytest.param("stranger", "stranger", "'stranger' is not a known peer",
                     id="a-cluster-certificate-for-a-node-not-in-the-peer-list"),
        pytest.param("gpu-1", "gpu-2", "'gpu-1' claims to be 'gpu-2'", id="a-peer-speaking-for-another-node"),
    ],
)
def test_a_call_is_refused(mesh: MeshHost, method: str, cert: str, speaks_for: str, words: str) -> None:
    with mesh.channel(cert) as ch:
        code, details, _ = _ask(ch, method, _as(speaks_for, method, mesh))
    assert code is grpc.StatusCode.PERMISSION_DENIED and words in details
    assert mesh.shadows() == (set(), set())


@pytest.mark.parametrize("cert", ["foreign-gpu-1", "none"], ids=["another-ca", "no-certificate"])
def test_without_a_certificate_from_the_cluster_ca_nothing_is_answered(mesh: MeshHost, cert: str) -> None:
    if cert == "none":
        creds = grpc.ssl_channel_credentials(root_certificates=mesh.tls["gpu-1"].ca_pem)
        ch = grpc.secure_channel(f"127.0.0.1:{mesh.port}", creds, options=[("grpc.ssl_target_name_override",
                                                                            "cpu-1")])
    else:
        ch = mesh.channel(cert)
    with ch:
        code, _, _ = _ask(ch, "Hello", _as("gpu-1", "Hello", mesh))
    assert code is grpc.StatusCode.UNAVAILABLE  # the TLS handshake itself fails


def test_a_peer_reaches_only_the_shadows_its_own_origin_made(mesh: MeshHost) -> None:
    key = "origin-sb-1/tokenize/0"
    with mesh.channel("gpu-1") as owner, mesh.channel("gpu-2") as other:
        code, details, raw = _ask(owner, "RunShadow", _as("gpu-1", "RunShadow", mesh, key))
        assert code is grpc.StatusCode.OK, details
        mine = pb.ShadowState.FromString(raw)
        try:
            for method in _UNARY:
                if method in ("Hello", "Admit", "RunShadow"):
                    continue
                code, details, raw = _ask(other, method, _as("gpu-2", method, mesh, key))
                if method == "RemoveShadow":  # idempotent: nothing of gpu-2's to remove
                    assert code is grpc.StatusCode.OK and not pb.RemoveShadowResponse.FromString(raw).removed
                else:
                    assert code is grpc.StatusCode.NOT_FOUND, (method, code, details)
            # Watch sweeps the asker's orphans: gpu-2 has none, and gpu-1's shadow is not gpu-2's to sweep.
            watch = other.unary_stream(MESH + "Watch")(pb.WatchRequest(origin_node="gpu-2", keys=[],
                                                                       heartbeat_s=1).SerializeToString(), timeout=10)
            next(watch, None)
            watch.cancel()
            # The same key from gpu-2 is gpu-2's own shadow, never gpu-1's.
            code, details, raw = _ask(other, "RunShadow", _as("gpu-2", "RunShadow", mesh, key))
            assert code is grpc.StatusCode.OK, details
            theirs = pb.ShadowState.FromString(raw)
            assert theirs.shadow_container_id != mine.shadow_container_id
            assert theirs.shadow_sandbox_id != mine.shadow_sandbox_id
            status = cri.ContainerStatus.FromString(pb.ShadowState.FromString(
                _ask(owner, "ShadowStatus", _as("gpu-1", "ShadowStatus", mesh, key))[2]).status)
            assert status.id == mine.shadow_container_id and status.labels["weft.io/origin-node"] == "gpu-1"
        finally:
            for ch, origin in ((owner, "gpu-1"), (other, "gpu-2")):
                _ask(ch, "RemoveShadow", _as(origin, "RemoveShadow", mesh, key))
    assert mesh.shadows() == (set(), set())


def _unsafe(field: str, mesh: MeshHost) -> pb.RunShadowRequest:
    req = run_shadow_request(mesh.containerd, "gpu-1", f"origin-sb-1/{field}/0")
    sandbox = cri.PodSandboxConfig.FromString(req.sandbox_config)
    config = cri.ContainerConfig.FromString(req.container_config)
    sc, psc = config.linux.security_context, sandbox.linux.security_context
    match field:
        case "privileged":
            sc.privileged = True
        case "sandbox-privileged":
            psc.privileged = True
        case "host-network":
            psc.namespace_options.network = cri.NODE
        case "host-pid":
            sc.namespace_options.pid = cri.NODE
        case "host-ipc":
            psc.namespace_options.ipc = cri.NODE
        case "host-path":
            config.mounts.add(container_path="/host", host_path="/")
        case "device":
            config.devices.add(container_path="/dev/mem", host_path="/dev/mem", permissions="rw")
        case "cdi-device":
            config.CDI_devices.add(name="vendor.com/device=all")
    req.sandbox_config, req.container_config = sandbox.SerializeToString(), config.SerializeToString()
    return req


@pytest.mark.parametrize("field", ["privileged", "sandbox-privileged", "host-network", "host-pid", "host-ipc",
                                   "host-path", "device", "cdi-device"])
def test_a_host_never_runs_an_unsafe_container_for_a_peer(mesh: MeshHost, field: str) -> None:
    with mesh.channel("gpu-1") as ch:
        code, details, _ = _ask(ch, "RunShadow", _unsafe(field, mesh))
    assert code is grpc.StatusCode.PERMISSION_DENIED, (code, details)
    assert "never runs a rerouted container" in details
    assert mesh.shadows() == (set(), set())


# -- credentials ----------------------------------------------------------------------------------
def _secrets(registry: Registry) -> list[bytes]:
    basic = base64.b64encode(f"{registry.user}:{registry.password}".encode())
    return [registry.password.encode(), basic]


def _holds_secret(paths: list[Path], secrets: list[bytes]) -> list[str]:
    found = []
    for base in paths:
        for f in [base] if base.is_file() else base.rglob("*"):
            if f.is_file() and not f.is_socket():
                data = f.read_bytes()
                found += [f"{f}: {s[:4]!r}..." for s in secrets if s in data]
    return found


def test_credentials_of_a_shadow_pull_are_in_no_log_or_state_of_the_host(mesh: MeshHost) -> None:
    """The origin sends kubelet's AuthConfig with RunShadow; the host pulls with it and keeps it nowhere."""
    archive = next(a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name)
    with Registry(mesh.containerd) as registry:
        ref = registry.push(archive, "weft/shadow-private:1")
        req = run_shadow_request(mesh.containerd, "gpu-1", "origin-sb-9/tokenize/0", image=ref)
        req.auth = cri.AuthConfig(username=registry.user, password=registry.password,
                                  auth=_secrets(registry)[1].decode()).SerializeToString()
        with mesh.channel("gpu-1") as ch:
            code, details, _ = _ask(ch, "RunShadow", req)
            try:
                assert code is grpc.StatusCode.OK, details
            finally:
                _ask(ch, "RemoveShadow", _as("gpu-1", "RemoveShadow", mesh, "origin-sb-9/tokenize/0"))
        assert _holds_secret([mesh.agent.log_path, mesh.agent.state_dir], _secrets(registry)) == []


def test_credentials_of_a_pull_through_the_agent_are_in_no_log_or_state(gpu_node: GpuNode) -> None:
    """Beside ``test_pull_through_agent``: every call logged (debug), the basic-auth form and a token too."""
    archive = next(a for a in images.cached_archives(IMAGE_CACHE) if "busybox" in a.name)
    with Registry(gpu_node.containerd) as registry, gpu_node.agent.channel() as ch:
        ref = registry.push(archive, "weft/private:1")
        secrets = [*_secrets(registry), b"weft-test-registry-token"]
        auth = cri.AuthConfig(username=registry.user, password=registry.password, auth=secrets[1].decode(),
                              registry_token=secrets[2].decode())
        cri_grpc.ImageServiceStub(ch).PullImage(cri.PullImageRequest(image=cri.ImageSpec(image=ref), auth=auth),
                                                timeout=120)
        assert gpu_node.agent.metrics_text()  # metrics carry no request contents either
        assert not [s for s in secrets if s.decode() in gpu_node.agent.metrics_text()]
        assert _holds_secret([gpu_node.agent.log_path, gpu_node.agent.state_dir, gpu_node.broker.log_path,
                              gpu_node.broker.state_dir], secrets) == []
