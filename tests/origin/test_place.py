"""The origin's choice of host for one CPU container, with peers that refuse, vanish, stall or answer garbage.

The mesh is a fake (its clients script each peer's answers); the state store
is the real one, so what a failed attempt leaves behind is what the agent
would keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri

from shim._pb import mesh_pb2 as pb
from shim.core.classify import Classification, ContainerAsk, Stage, StageReason
from shim.core.placement import PlacementReason, PlacementState
from shim.core.reroute import PeerView, Resources
from shim.cri.fabric import Fabric
from shim.crishared.attempt import CreateAttempt
from shim.errors import WeftError
from shim.mesh.client import PeerUnavailable
from shim.metrics import Metrics
from shim.origin.context import Origin
from shim.origin.place import read_volumes
from shim.origin.settings import OriginSettings
from shim.state.agent import AgentStore, SandboxRecord

GI = 1 << 30
CPU = Classification(Stage.CPU, StageReason.NO_GPU_REQUEST, "no GPU")


def attempt(fabric: Fabric, req: cri.CreateContainerRequest, key: str) -> CreateAttempt:
    return CreateAttempt(req, fabric.opted_in["sb"], key, ContainerAsk(req.config.metadata.name), {}, CPU)


@dataclass
class Peer:
    admit: str | Exception = "admitted"  # an AdmitResponse reason, or what Admit raises
    run: bytes | Exception | None = None  # the status bytes RunShadow answers (None: a CREATED status)
    calls: list[tuple[str, float | None]] = field(default_factory=list)

    def admit_call(self, request: pb.AdmitRequest) -> pb.AdmitResponse:
        self.calls.append(("Admit", None))
        if isinstance(self.admit, Exception):
            raise self.admit
        return pb.AdmitResponse(admitted=self.admit == "admitted", reason=self.admit, detail="scripted")

    def run_shadow(self, request: pb.RunShadowRequest, timeout: float = 300.0) -> pb.ShadowState:
        self.calls.append(("RunShadow", timeout))
        assert not cri.ContainerConfig.FromString(request.container_config).mounts  # volumes travel as files
        if isinstance(self.run, Exception):
            raise self.run
        status = self.run if self.run is not None else cri.ContainerStatus(
            state=cri.CONTAINER_CREATED).SerializeToString()
        return pb.ShadowState(key=request.key, shadow_sandbox_id="ssb", shadow_container_id="sc", status=status)

    def remove_shadow(self, origin: str, key: str) -> bool:
        self.calls.append(("RemoveShadow", None))
        return True


class FakeClient:
    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.admit = peer.admit_call
        self.run_shadow = peer.run_shadow
        self.remove_shadow = peer.remove_shadow


class FakeMesh:
    node = "gpu-1"

    def __init__(self, peers: dict[str, Peer]) -> None:
        self.peers = peers

    def spread(self, pod: str) -> str:
        return ""  # a small fleet: ranked by room alone

    def unreachable(self, node: str, error: str) -> None:
        self.__dict__.setdefault("silent", []).append(node)

    def views(self) -> list[PeerView]:
        return [PeerView(n, True, True, Resources(4.0 - i * 0.5, 8 * GI), 0.1) for i, n in enumerate(self.peers)]

    def client(self, node: str) -> FakeClient | None:
        return FakeClient(self.peers[node]) if node in self.peers else None


@pytest.fixture
def fabric(tmp_path: Path):
    store = AgentStore(tmp_path / "state")
    settings = OriginSettings(pods_dir=str(tmp_path / "pods"))
    fabric = Fabric(upstream=None, store=store, broker=None, metrics=Metrics(),  # type: ignore[arg-type]
                    origin=lambda f: Origin(FakeMesh({}), settings))
    fabric.remember(SandboxRecord("sb", "infer", "default", "uid-1", "weft", True, {}, 0.0))
    yield fabric
    store.close()


def request(tmp_path: Path, **security) -> cri.CreateContainerRequest:
    config = cri.ContainerConfig(metadata=cri.ContainerMetadata(name="tokenize"), image=cri.ImageSpec(image="busybox"),
                                 log_path="tokenize/0.log")
    res = config.linux.resources
    res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, 50000, GI
    for k, v in security.items():
        if k == "capabilities":
            config.linux.security_context.capabilities.CopyFrom(v)
        else:
            setattr(config.linux.security_context, k, v)
    sandbox = cri.PodSandboxConfig(metadata=cri.PodSandboxMetadata(name="infer", uid="uid-1"),
                                   log_directory=str(tmp_path / "logs"))
    return cri.CreateContainerRequest(pod_sandbox_id="sb", config=config, sandbox_config=sandbox)


def place(fabric: Fabric, tmp_path: Path, peers: dict[str, Peer], budget: float | None = None, **security):
    fabric.origin.mesh = FakeMesh(peers)
    req = request(tmp_path, **security)
    return fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"), budget)


def test_a_vanished_peer_is_skipped_for_the_next(fabric, tmp_path) -> None:
    gone = PeerUnavailable("peer cpu-1 did not answer Admit (UNAVAILABLE)", node="cpu-1")
    peers = {"cpu-1": Peer(admit=gone), "cpu-2": Peer()}
    remote, local = place(fabric, tmp_path, peers)
    assert local is None and remote is not None and remote.node == "cpu-2"
    rec = fabric.store.placement(remote.id)
    assert rec.state is PlacementState.CREATED and rec.placement == "remote:cpu-2" and "cpu-1" in rec.detail
    assert fabric.remotes.get(remote.id) is remote
    assert remote.kubelet_status().annotations["weft.io/placement"] == "remote:cpu-2"


def test_every_peer_refusing_means_local_with_each_answer(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer(admit="insufficient-cpu"), "cpu-2": Peer(admit="insufficient-memory")}
    remote, local = place(fabric, tmp_path, peers)
    assert remote is None and local.reason is PlacementReason.PEERS_REFUSED
    assert "cpu-1: insufficient-cpu" in local.detail and "cpu-2: insufficient-memory" in local.detail
    assert fabric.store.placements() == [] and not fabric.remotes.present


def test_garbage_from_run_shadow_is_cleaned_up_there_and_the_next_peer_used(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer(run=b"\xff\xff\xff garbage"), "cpu-2": Peer()}
    remote, local = place(fabric, tmp_path, peers)
    assert local is None and remote is not None and remote.node == "cpu-2"
    assert ("RemoveShadow", None) in peers["cpu-1"].calls  # whatever it made is not left running
    assert [p.key for p in fabric.store.placements()] == ["sb/tokenize/0"]


def test_a_stalling_peer_gets_half_of_kubelets_deadline_then_it_runs_locally(fabric, tmp_path) -> None:
    stall = PeerUnavailable("peer cpu-1 did not answer RunShadow (DEADLINE_EXCEEDED)", node="cpu-1",
                            status=grpc.StatusCode.DEADLINE_EXCEEDED)
    peers = {"cpu-1": Peer(run=stall), "cpu-2": Peer(run=stall)}
    remote, local = place(fabric, tmp_path, peers, budget=40.0)
    assert remote is None and local.reason is PlacementReason.PEERS_REFUSED
    waits = [t for _, t in peers["cpu-1"].calls if t is not None]
    assert waits and waits[0] <= 20.0
    assert fabric.store.placements() == []


def test_too_little_deadline_left_asks_no_peer(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer()}
    remote, local = place(fabric, tmp_path, peers, budget=4.0)
    assert remote is None and "too little of kubelet's deadline" in local.detail
    assert ("RunShadow", pytest.approx(2.0)) not in peers["cpu-1"].calls


def test_unsafe_containers_never_reach_a_peer(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer()}
    remote, local = place(fabric, tmp_path, peers, privileged=True)
    assert remote is None and local.reason is PlacementReason.UNSAFE and "privileged" in local.detail
    assert peers["cpu-1"].calls == []


def test_a_container_beyond_the_baseline_never_reaches_a_peer(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer()}
    remote, local = place(fabric, tmp_path, peers, capabilities=cri.Capability(add_capabilities=["NET_ADMIN"]))
    assert remote is None and local.reason is PlacementReason.UNSAFE
    assert local.detail.startswith("not-baseline: capabilities") and "NET_ADMIN" in local.detail
    assert peers["cpu-1"].calls == []


def test_configs_larger_than_a_mesh_message_stay_here_saying_so(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer()}
    fabric.origin.mesh = FakeMesh(peers)
    req = request(tmp_path)
    req.config.envs.add(key="BIG", value="x" * (4 << 20))
    remote, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"), None)
    assert remote is None and local.reason is PlacementReason.CONFIG_TOO_LARGE
    assert f"more than a mesh message carries ({4 << 20} bytes)" in local.detail
    assert peers["cpu-1"].calls == []


def test_read_only_volumes_and_etc_hosts_are_copied_nothing_else(tmp_path: Path) -> None:
    pod = tmp_path / "pods" / "uid-1"
    cm = pod / "volumes" / "kubernetes.io~configmap" / "settings"
    (cm / "..gen1").mkdir(parents=True)
    (cm / "..gen1" / "a.conf").write_text("a=1")
    (cm / "..data").symlink_to("..gen1")
    (cm / "a.conf").symlink_to("..data/a.conf")
    (pod / "etc-hosts").write_text("127.0.0.1 localhost\n")
    (tmp_path / "secret").write_text("outside")
    (cm / "escape").symlink_to(tmp_path / "secret")  # a link out of the volume is not its content
    config = cri.ContainerConfig()
    config.mounts.add(container_path="/etc/settings", host_path=str(cm), readonly=True)
    config.mounts.add(container_path="/etc/hosts", host_path=str(pod / "etc-hosts"))
    config.mounts.add(container_path="/dev/termination-log", host_path=str(pod / "containers" / "c" / "x"))
    volumes = read_volumes(config, (str(cm),))
    assert [(v.container_path, v.single_file, [(f.path, f.data) for f in v.files]) for v in volumes] == [
        ("/etc/settings", False, [("a.conf", b"a=1")]),
        ("/etc/hosts", True, [("", b"127.0.0.1 localhost\n")]),
    ]


def test_weft_errors_are_what_the_peer_said(fabric, tmp_path) -> None:
    refused = WeftError("peer cpu-1 refused RunShadow: this host never runs a rerouted container with devices")
    peers = {"cpu-1": Peer(run=refused)}
    remote, local = place(fabric, tmp_path, peers)
    assert remote is None and "never runs a rerouted container" in local.detail


# -- what the pod spec adds (an origin with the Kubernetes API) ---------------------------------------------


def _with_spec(fabric: Fabric, spec: dict | None) -> None:
    fabric.origin.pod_spec = lambda namespace, name: spec


def _mounted(req: cri.CreateContainerRequest, tmp_path: Path, volume: str, path: str) -> None:
    host = tmp_path / "pods" / "uid-1" / "volumes" / "kubernetes.io~empty-dir" / volume
    req.config.mounts.append(cri.Mount(container_path=path, host_path=str(host)))


SPEC = {"spec": {
    "volumes": [{"name": "scratch", "emptyDir": {"sizeLimit": "64Mi"}}, {"name": "handoff", "emptyDir": {}}],
    "initContainers": [{"name": "fetch"}],
    "containers": [
        {"name": "tokenize", "resources": {"requests": {"cpu": "250m", "memory": "128Mi"}},
         "volumeMounts": [{"name": "scratch", "mountPath": "/scratch"}, {"name": "handoff", "mountPath": "/out"}]},
        {"name": "model", "volumeMounts": [{"name": "handoff", "mountPath": "/in"}]}]}}


def _sent_to_cpu1(fabric) -> list[pb.RunShadowRequest]:
    """Makes cpu-1 the only peer, answering as the fake does; the RunShadow requests it gets are listed here."""
    sent: list[pb.RunShadowRequest] = []
    peer = Peer()
    run = peer.run_shadow
    peer.run_shadow = lambda request, timeout=300.0: sent.append(request) or run(request, timeout)
    fabric.origin.mesh = FakeMesh({"cpu-1": peer})
    return sent


def test_with_the_pod_spec_an_empty_dir_only_it_mounts_goes_with_it(fabric, tmp_path) -> None:
    spec = {"spec": {**SPEC["spec"], "containers": [{**SPEC["spec"]["containers"][0], "volumeMounts": [
        {"name": "scratch", "mountPath": "/scratch"}]}, SPEC["spec"]["containers"][1]]}}
    _with_spec(fabric, spec)
    sent = _sent_to_cpu1(fabric)
    req = request(tmp_path)
    _mounted(req, tmp_path, "scratch", "/scratch")
    remote, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"))
    assert local is None and remote.node == "cpu-1"
    (shadow,) = sent
    assert [(e.container_path, e.size_limit) for e in shadow.empty_dirs] == [("/scratch", 64 << 20)]
    assert not shadow.HasField("admitted")  # it has limits: admitted by them


def test_with_the_pod_spec_a_shared_empty_dir_keeps_it_here_and_says_which_rules(fabric, tmp_path) -> None:
    _with_spec(fabric, SPEC)
    fabric.origin.mesh = FakeMesh({"cpu-1": Peer()})
    req = request(tmp_path)
    _mounted(req, tmp_path, "handoff", "/out")
    remote, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"))
    assert remote is None and local.reason is PlacementReason.UNSAFE
    assert "pod spec read" in local.detail


def test_without_limits_it_is_admitted_by_its_requests_from_the_spec(fabric, tmp_path) -> None:
    _with_spec(fabric, SPEC)
    sent = _sent_to_cpu1(fabric)
    req = request(tmp_path)
    req.config.linux.resources.Clear()
    remote, _ = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"))
    assert remote is not None
    assert (sent[0].admitted.cpu_cores, sent[0].admitted.memory_bytes) == (0.25, 128 << 20)


def test_without_the_pod_spec_limits_are_required_and_the_detail_says_why(fabric, tmp_path) -> None:
    fabric.origin.mesh = FakeMesh({"cpu-1": Peer()})
    req = request(tmp_path)
    req.config.linux.resources.Clear()
    remote, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/0"))
    assert remote is None and local.reason is PlacementReason.UNSAFE and "no Kubernetes API" in local.detail


def test_an_init_container_stays_on_the_pod_s_node(fabric, tmp_path) -> None:
    _with_spec(fabric, SPEC)
    fabric.origin.mesh = FakeMesh({"cpu-1": Peer()})
    req = request(tmp_path)
    req.config.metadata.name = "fetch"
    remote, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/fetch/0"))
    assert remote is None and local.reason is PlacementReason.INIT_CONTAINER


def test_a_restart_is_not_sent_back_to_the_host_that_lost_its_reservation(fabric, tmp_path) -> None:
    peers = {"cpu-1": Peer(), "cpu-2": Peer()}
    remote, _ = place(fabric, tmp_path, peers)
    assert remote.node == "cpu-1"
    fabric.remotes.update(remote, cri.ContainerStatus(state=cri.CONTAINER_EXITED, reason="ReservationPreempted"))
    req = request(tmp_path)
    req.config.metadata.attempt = 1
    again, local = fabric.origin.place(fabric, attempt(fabric, req, "sb/tokenize/1"))
    assert local is None and again.node == "cpu-2" and "ReservationPreempted" in again.config.annotations.get(
        "weft.io/placement-reason", "") + fabric.store.placement_by_key("sb/tokenize/1").detail
