"""The single-node fabric against real containerd, runc, the OCI hook and a real broker.

The broker runs with simulated GPUs (no GPU here); everything else is real:
the ``weft`` runtime handler's base spec runs the hook in runc, leases are
bound with the container's real PID and cgroup, enforcement kills real
processes. Crash tests kill the agent or the broker with SIGKILL at named
failpoints and check that nothing is leaked or granted twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import BrokerProcess, gpu_fabric
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for

GiB = 1 << 30


@dataclass
class Node:
    broker: BrokerProcess
    containerd: Containerd
    workdir: Path
    agent: AgentProcess | None = None

    def start_agent(self, env: dict[str, str] | None = None) -> AgentProcess:
        self.agent = AgentProcess(self.containerd, self.workdir / "agent",
                                  extra_args=["--broker-socket", str(self.broker.socket)], env=env or {})
        return self.agent.start()

    def rt(self) -> cri_grpc.RuntimeServiceStub:
        assert self.agent is not None
        return cri_grpc.RuntimeServiceStub(grpc.insecure_channel(self.agent.address))

    def direct(self) -> cri_grpc.RuntimeServiceStub:
        return cri_grpc.RuntimeServiceStub(grpc.insecure_channel(self.containerd.address))

    def pod(self, name: str, annotations: dict[str, str] | None = None, handler: str = "weft"):
        cfg = pods.sandbox_config(name, self.containerd.pod_log_dir, annotations=annotations)
        sb = self.rt().RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler=handler)).pod_sandbox_id
        return sb, cfg

    def create(self, sb: str, cfg, name: str, envs: dict[str, str] | None = None, *, start: bool = True,
               rt=None) -> str:
        rt = rt or self.rt()
        ccfg = pods.container_config(name, ["sleep", "3600"], envs=envs)
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg,
                                                            sandbox_config=cfg)).container_id
        if start:
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        return cid

    def status(self, *args: str) -> dict:
        assert self.agent is not None
        out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--socket", str(self.agent.socket),
                              *args], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    broker, ctrd = gpu_fabric(tmp_path)
    n = Node(broker, ctrd, tmp_path)
    with broker, ctrd:
        try:
            yield n
        finally:
            if n.agent is not None:
                n.agent.stop()


GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all"}




def _retry_unavailable(fn, timeout: float = 10.0):
    """As kubelet does: a CreateContainer that met UNAVAILABLE is tried again after a backoff."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            if exc.code() is not grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def _sample(text: str, series: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(series + " "))
    return float(line.rsplit(" ", 1)[1])


def _env_in(rt, cid: str) -> dict[str, str]:
    out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["env"], timeout=10)).stdout.decode()
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def test_opted_in_pod_is_classified_leased_and_explained(node: Node) -> None:
    node.start_agent()
    rt = node.rt()
    sb, cfg = node.pod("infer", {"weft.io/gpu-memory.model": "20Gi", "weft.io/gpu-compute.model": "50"})
    tok = node.create(sb, cfg, "tokenizer")
    model = node.create(sb, cfg, "model", GPU_ENV)

    # What crictl inspect shows: the decision and its reason.
    tok_ann = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=tok)).status.annotations
    assert (tok_ann["weft.io/placement"], tok_ann["weft.io/placement-reason"]) == ("local", "no-mesh")
    assert "weft.io/lease" not in tok_ann
    model_ann = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=model)).status.annotations
    assert (model_ann["weft.io/placement"], model_ann["weft.io/placement-reason"]) == ("local", "gpu-leased")

    # The broker's lease, bound by the hook to the container's real process.
    [lease] = node.broker.leases()
    assert lease.lease_id == model_ann["weft.io/lease"]
    assert (lease.state, lease.container_id, lease.memory_bytes, lease.compute_percent, lease.shared) == (
        "bound", model, 20 * GiB, 50, True)
    assert lease.pid > 0 and model in lease.cgroup

    # The container sees exactly its leased device and its MPS limits.
    env = _env_in(rt, model)
    assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == lease.device_uuids[0]
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    assert "CUDA_MPS_PIPE_DIRECTORY" in env
    # A container that holds no lease asks the runtime for no GPU, whatever its image's environment says.
    assert _env_in(rt, tok)["NVIDIA_VISIBLE_DEVICES"] == "void"

    doc = node.status()
    assert [s["id"] for s in doc["sandboxes"]] == [sb] and doc["sandboxes"][0]["opted_in"] is True
    by_name = {p["name"]: p for p in doc["placements"]}
    assert (by_name["tokenizer"]["stage"], by_name["tokenizer"]["reason"]) == ("cpu", "no-mesh")
    assert (by_name["model"]["container_id"], by_name["model"]["stage"]) == (model, "gpu")
    [doc_lease] = doc["leases"]
    assert (doc_lease["container_id"], doc_lease["devices"], doc_lease["state"]) == (model, list(lease.device_uuids),
                                                                                      "bound")
    # The same document from the state files, with the agent stopped.
    node.agent.stop()
    offline = json.loads(subprocess.run(
        [sys.executable, "-m", "shim", "status", "--json", "--state-dir", str(node.agent.state_dir)],
        capture_output=True, text=True, check=True).stdout)
    assert offline["placements"] == doc["placements"] and offline["sandboxes"] == doc["sandboxes"]
    node.start_agent()

    explained = json.loads(subprocess.run(
        [sys.executable, "-m", "shim", "explain", model[:12], "--json", "--socket", str(node.agent.socket)],
        capture_output=True, text=True, check=True).stdout)
    assert explained["container_id"] == model and explained["lease"]["lease_id"] == lease.lease_id
    assert any("visible-devices-env" in line for line in explained["why"])

    decided = [e for e in _events_before_restart(node) if e.get("event") == "placement.decided"]
    assert {(e["container"], e["stage"], e["reason"]) for e in decided} == {
        ("tokenizer", "cpu", "no-mesh"), ("model", "gpu", "gpu-leased")}
    metrics = node.broker.metrics_text()
    assert (f'weft_gpu_lease_bytes{{UUID="{lease.device_uuids[0]}",container="model",gpu="0",'
            f'lease="{lease.lease_id}",namespace="default",pod="infer"}} 2.147483648e+10') in metrics


def _events_before_restart(node: Node) -> list[dict]:
    assert node.agent is not None
    return node.agent.events()


def test_plain_pod_is_passed_through_untouched(node: Node) -> None:
    node.start_agent()
    rt = node.rt()
    sb, cfg = node.pod("plain", {"weft.io/gpu-memory.model": "20Gi"}, handler="")
    cid = node.create(sb, cfg, "model", GPU_ENV)
    ann = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.annotations
    assert not [k for k in ann if k.startswith("weft.io/")]
    assert _env_in(rt, cid)["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert node.broker.leases() == []
    status = node.status()
    assert {k: status[k] for k in ("sandboxes", "placements", "leases")} == {
        "sandboxes": [], "placements": [], "leases": []}


def test_lease_follows_the_container_life_even_with_the_agent_killed(node: Node) -> None:
    agent = node.start_agent()
    sb, cfg = node.pod("life")
    cid = node.create(sb, cfg, "model", GPU_ENV, start=False)
    [lease] = node.broker.leases()
    assert (lease.state, lease.shared) == ("acquired", False)  # a whole device, not yet bound
    agent.stop(sig=9)  # the hook talks to the broker, not to the agent
    direct = node.direct()
    direct.StartContainer(cri.StartContainerRequest(container_id=cid))
    [bound] = node.broker.leases()
    assert (bound.state, bound.container_id) == ("bound", cid) and bound.pid > 0
    direct.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=1))
    wait_for(lambda: node.broker.leases() == [], what="poststop release")
    released = [e for e in node.broker.events() if e.get("event") == "lease.released"]
    assert released[-1]["reason"] == "poststop"


@pytest.mark.parametrize(
    ("annotations", "words"),
    [
        pytest.param({"weft.io/gpu-memory.model": "lots"}, ["weft.io/gpu-memory.model", "lots"], id="not-a-size"),
        pytest.param({"weft.io/gpu-memory.model": "-5Gi"}, ["weft.io/gpu-memory.model", "-5Gi"], id="negative"),
        pytest.param({"weft.io/gpu-memory.model": "200Gi"}, ["weft.io/gpu-memory.model", "200Gi", "larger"],
                     id="larger-than-any-device"),
        pytest.param({"weft.io/gpu-compute.model": "150"}, ["weft.io/gpu-compute.model", "150"], id="compute-over-100"),
        pytest.param({"weft.io/stage.model": "fpga"}, ["weft.io/stage.model", "fpga"], id="unknown-stage"),
    ],
)
def test_bad_annotation_fails_create_naming_it_and_leaves_nothing(node: Node, annotations, words) -> None:
    node.start_agent()
    sb, cfg = node.pod("bad", annotations)
    with pytest.raises(grpc.RpcError) as err:
        node.create(sb, cfg, "model", GPU_ENV)
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in err.value.details()
    assert node.broker.leases() == []
    assert node.status()["placements"] == []
    assert [c.id for c in node.direct().ListContainers(cri.ListContainersRequest()).containers] == []


def test_broker_down_fails_only_gpu_containers_of_opted_in_pods(node: Node) -> None:
    node.start_agent()
    node.broker.stop()
    sb, cfg = node.pod("nobroker")
    with pytest.raises(grpc.RpcError) as err:
        node.create(sb, cfg, "model", GPU_ENV)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    assert str(node.broker.socket) in err.value.details()
    assert node.create(sb, cfg, "tokenizer")  # the CPU stage of the same pod works
    plain_sb, plain_cfg = node.pod("plain", handler="")
    assert node.create(plain_sb, plain_cfg, "model", GPU_ENV)  # a pod that did not opt in works
    assert [p["name"] for p in node.status()["placements"]] == ["tokenizer"]


def test_packing_consolidates_and_refuses_when_full(node: Node) -> None:
    node.start_agent()
    ann = {f"weft.io/gpu-memory.m{i}": "50Gi" for i in range(3)}
    ann.update({"weft.io/gpu-memory.small": "20Gi"})
    sb, cfg = node.pod("pack", ann)
    node.create(sb, cfg, "m0", GPU_ENV)
    node.create(sb, cfg, "small", GPU_ENV)  # best fit: next to m0 (30Gi free there)
    node.create(sb, cfg, "m1", GPU_ENV)  # needs the second device
    devices = {lease.container: lease.device_uuids[0] for lease in node.broker.leases()}
    assert devices["m0"] == devices["small"] != devices["m1"]
    with pytest.raises(grpc.RpcError) as err:
        node.create(sb, cfg, "m2", GPU_ENV)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(node.broker.leases()) == 3


@pytest.mark.parametrize("action", ["kill", "log"])
def test_watchdog_acts_only_on_the_container_over_its_lease(tmp_path: Path, action: str) -> None:
    broker, ctrd = gpu_fabric(tmp_path)
    broker.enforce = action
    node = Node(broker, ctrd, tmp_path)
    with broker, ctrd:
        node.start_agent()
        try:
            sb, cfg = node.pod("greedy", {"weft.io/gpu-memory.a": "20Gi", "weft.io/gpu-memory.b": "20Gi"})
            a, b = node.create(sb, cfg, "a", GPU_ENV), node.create(sb, cfg, "b", GPU_ENV)
            leases = {lease.container_id: lease for lease in broker.leases()}
            dev = leases[a].device_uuids[0]
            assert leases[b].device_uuids[0] == dev  # neighbours on one device
            broker.simulate([(leases[a].pid, dev, 30 * GiB), (leases[b].pid, dev, 10 * GiB)],
                            sm_percent={leases[b].pid: 40})
            rt = node.rt()

            def state(cid: str) -> int:
                return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state

            def violation_seen():
                return next((e for e in broker.events() if e.get("event") == "lease.violation"), None)

            violation = wait_for(violation_seen, what="the violation to be seen")
            if action == "kill":
                wait_for(lambda: state(a) == cri.CONTAINER_EXITED, what="the violator to be killed")
            else:
                time.sleep(1)  # several watchdog ticks: logging never kills
                assert state(a) == cri.CONTAINER_RUNNING
            assert state(b) == cri.CONTAINER_RUNNING
            assert violation["action"] == action
            assert (violation["container"], violation["used_bytes"], violation["limit_bytes"]) == (
                "a", 30 * GiB, 20 * GiB)
            # Held vs active GPU-seconds per container, with dcgm-exporter's labels.
            series = f'UUID="{dev}",container="b",gpu="0",namespace="default",pod="greedy"'
            held, active = (_sample(broker.metrics_text(), f"weft_gpu_lease_{kind}_seconds_total{{{series}}}")
                            for kind in ("held", "active"))
            assert held > 0 and 0 < active < held
        finally:
            node.agent.stop()


@pytest.mark.parametrize("failpoint", ["create_container.leased", "create_container.pending"])
def test_agent_killed_before_create_answers_leaks_no_lease(node: Node, failpoint: str) -> None:
    node.start_agent(env={"WEFT_FAILPOINTS": failpoint})
    sb, cfg = node.pod("crash")
    with pytest.raises(grpc.RpcError):
        node.create(sb, cfg, "model", GPU_ENV, start=False)
    node.agent.stop()
    node.start_agent()  # recovery: no container in containerd, so the lease goes
    wait_for(lambda: node.broker.leases() == [], what="the orphaned lease to be released")
    # kubelet retries the same CreateContainer: exactly one lease, one placement.
    cid = node.create(sb, cfg, "model", GPU_ENV)
    [lease] = node.broker.leases()
    assert (lease.container_id, lease.state) == (cid, "bound")
    assert [p["container_id"] for p in node.status()["placements"]] == [cid]


def test_agent_killed_after_containerd_created_recovers_the_record(node: Node) -> None:
    node.start_agent(env={"WEFT_FAILPOINTS": "create_container.created"})
    sb, cfg = node.pod("crash")
    with pytest.raises(grpc.RpcError):
        node.create(sb, cfg, "model", GPU_ENV, start=False)
    node.agent.stop()
    node.start_agent()
    [created] = node.direct().ListContainers(cri.ListContainersRequest()).containers
    doc = wait_for(lambda: (d := node.status()) and d["placements"] and d["placements"][0]["state"] == "created" and d,
                what="recovery to complete the placement")
    assert doc["placements"][0]["container_id"] == created.id
    [lease] = node.broker.leases()
    node.rt().RemoveContainer(cri.RemoveContainerRequest(container_id=created.id))
    assert node.broker.leases() == [] and lease.lease_id


def test_broker_killed_after_storing_a_lease_never_grants_twice(node: Node) -> None:
    node.broker.stop()
    node.broker.extra_env = {"WEFT_FAILPOINTS": "broker.lease.stored"}
    node.broker.start()
    node.start_agent()
    sb, cfg = node.pod("crash")
    with pytest.raises(grpc.RpcError) as err:
        node.create(sb, cfg, "model", GPU_ENV, start=False)
    assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    node.broker.stop()
    node.broker.extra_env = {}
    node.broker.start()
    cid = _retry_unavailable(lambda: node.create(sb, cfg, "model", GPU_ENV))  # kubelet's retry: same key
    [lease] = node.broker.leases()
    assert (lease.container_id, lease.state) == (cid, "bound")


def test_leases_survive_broker_restart_and_dead_containers_are_released(node: Node) -> None:
    node.start_agent()
    sb, cfg = node.pod("restart", {"weft.io/gpu-memory.keep": "10Gi", "weft.io/gpu-memory.die": "10Gi"})
    keep, die = node.create(sb, cfg, "keep", GPU_ENV), node.create(sb, cfg, "die", GPU_ENV)
    before = {lease.container_id: lease.lease_id for lease in node.broker.leases()}
    assert set(before) == {keep, die}
    node.broker.stop(sig=9)
    # The container dies while the broker is away: its poststop hook cannot reach it.
    node.direct().StopContainer(cri.StopContainerRequest(container_id=die, timeout=1))
    node.broker.start()
    after = {lease.container_id: lease.lease_id for lease in node.broker.leases()}
    assert after == {keep: before[keep]}


def test_kubelet_retrying_a_create_that_succeeded_keeps_the_lease(node: Node) -> None:
    node.start_agent()
    sb, cfg = node.pod("retry", {"weft.io/gpu-memory.model": "10Gi"})
    rt = node.rt()
    ccfg = pods.container_config("model", ["sleep", "3600"], envs=GPU_ENV)
    req = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(req).container_id
    [lease] = node.broker.leases()
    with pytest.raises(grpc.RpcError) as err:  # the answer was lost, kubelet tries again
        rt.CreateContainer(req)
    with grpc.insecure_channel(node.containerd.address) as direct_ch:
        direct = cri_grpc.RuntimeServiceStub(direct_ch)
        with pytest.raises(grpc.RpcError) as direct_err:
            direct.CreateContainer(req)
    assert (err.value.code(), err.value.details()) == (direct_err.value.code(), direct_err.value.details())
    assert [(x.lease_id, x.key) for x in node.broker.leases()] == [(lease.lease_id, lease.key)]
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    [bound] = node.broker.leases()
    assert (bound.state, bound.container_id) == ("bound", cid)
    assert [p["container_id"] for p in node.status()["placements"]] == [cid]


def test_remove_by_id_prefix_forgets_the_placement_and_its_lease(node: Node) -> None:
    node.start_agent()
    sb, cfg = node.pod("prefix", {"weft.io/gpu-memory.model": "10Gi"})
    cid = node.create(sb, cfg, "model", GPU_ENV, start=False)  # never started: no poststop to release it
    assert len(node.broker.leases()) == 1
    node.rt().RemoveContainer(cri.RemoveContainerRequest(container_id=cid[:12]))  # as `crictl rm` may send
    assert node.broker.leases() == []
    assert node.status()["placements"] == []
