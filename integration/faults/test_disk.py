"""The agent's state store on a full disk: new opted-in work refused clearly, pass-through untouched.

The agent's state directory is a small tmpfs, filled up once the agent runs.
Every mapping a restart must not lose is written before the call that creates
it answers (DESIGN 2.6), so with no room to write, an opted-in RunPodSandbox
or CreateContainer is refused with RESOURCE_EXHAUSTED naming the state store,
and leaves nothing half-made: no sandbox in containerd, no lease at the
broker, no shadow. Pods that did not opt in never touch the store and go on
as if weft were not there; and once space is freed, opted-in work goes on.
"""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration.faults.checks import GPU_ENV, cpu_config
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import gpu_fabric

TMPFS_SIZE = "2m"


@pytest.fixture
def full_disk_agent(tmp_path: Path) -> Iterator[tuple[AgentProcess, object]]:
    broker, ctrd = gpu_fabric(tmp_path)
    with broker, ctrd:
        agent = AgentProcess(ctrd, tmp_path / "agent", extra_args=["--broker-socket", str(broker.socket)])
        agent.state_dir.mkdir(parents=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0700", "tmpfs",
                        str(agent.state_dir)], check=True)
        try:
            with agent:
                yield agent, broker
        finally:
            subprocess.run(["umount", "-l", str(agent.state_dir)], check=False)


def _fill(directory: Path) -> Path:
    filler = directory / "filler"
    with open(filler, "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()
    return filler


def _sandboxes(agent: AgentProcess) -> list[str]:
    with agent.containerd.channel() as ch:
        return [s.id for s in cri_grpc.RuntimeServiceStub(ch).ListPodSandbox(cri.ListPodSandboxRequest()).items]


def test_a_full_state_store_refuses_opted_in_work_clearly_and_passes_the_rest(full_disk_agent) -> None:
    agent, broker = full_disk_agent
    ctrd = agent.containerd
    with agent.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        # A pod that opted in before the disk filled up.
        early_cfg = pods.sandbox_config("early", ctrd.pod_log_dir, annotations={"weft.io/gpu-memory.model": "10Gi"})
        early = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=early_cfg, runtime_handler="weft")).pod_sandbox_id
        filler = _fill(agent.state_dir)
        before = set(_sandboxes(agent))

        late_cfg = pods.sandbox_config("late", ctrd.pod_log_dir)
        with pytest.raises(grpc.RpcError) as err:
            rt.RunPodSandbox(cri.RunPodSandboxRequest(config=late_cfg, runtime_handler="weft"), timeout=60)
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "state store" in err.value.details() and str(agent.state_dir) in err.value.details()
        assert set(_sandboxes(agent)) == before, "a refused sandbox was left in containerd"

        for config in (pods.container_config("model", ["sleep", "3600"], envs=GPU_ENV), cpu_config("tokenize")):
            with pytest.raises(grpc.RpcError) as err:
                rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=early, config=config,
                                                              sandbox_config=early_cfg), timeout=60)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
            assert "state store" in err.value.details()
        assert broker.leases() == []  # the GPU container's lease was given back
        with ctrd.channel() as direct:
            assert list(cri_grpc.RuntimeServiceStub(direct).ListContainers(cri.ListContainersRequest()).containers) \
                == []

        # A pod that did not opt in: untouched.
        plain_cfg = pods.sandbox_config("plain", ctrd.pod_log_dir)
        plain = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=plain_cfg)).pod_sandbox_id
        cid = rt.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=plain, config=pods.container_config("app", ["sleep", "3600"]),
            sandbox_config=plain_cfg)).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid))
        assert rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state == \
            cri.CONTAINER_RUNNING
        assert agent.proc is not None and agent.proc.poll() is None  # and the agent is still up

        # Space again: opted-in work goes on, in the pod that opted in before.
        filler.unlink()
        model = rt.CreateContainer(cri.CreateContainerRequest(
            pod_sandbox_id=early, config=pods.container_config("model", ["sleep", "3600"], envs=GPU_ENV),
            sandbox_config=early_cfg)).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=model))
        [lease] = broker.leases()
        assert (lease.container_id, lease.state) == (model, "bound")
        rt.StopContainer(cri.StopContainerRequest(container_id=model, timeout=0))
        rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=0))
