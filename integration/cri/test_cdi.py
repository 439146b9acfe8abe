"""A GPU asked for as a CDI device, on containerd 2.x (CDI on by default), against a real broker.

kubelet passes a device plugin's CDI devices in ``ContainerConfig.CDI_devices``
(``nvidia.com/gpu=all`` here). The agent classifies the container ``gpu``,
leases a device from the broker, and names only the leased device to
containerd, which injects it through the CDI spec: a spec of this test's
own for the broker's simulated GPUs, whose edits set an environment variable
naming the device (and an ``all`` device, as NVIDIA's generated specs have).
So the container sees exactly the leased GPU, as with the visible-devices
variable; a plain pod's CDI devices are left as they are.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.broker.simulated import simulated_uuid
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import BrokerProcess, weft_handler
from shim.localfabric.containerd import Containerd

GPUS = [simulated_uuid(i) for i in range(2)]  # the broker's default: 2x80GiB


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Containerd, BrokerProcess, AgentProcess]]:
    broker = BrokerProcess(tmp_path / "broker")
    with broker, Containerd(handlers=[weft_handler(tmp_path, broker.socket)], line="2") as ctrd:
        devices = [{"name": u, "containerEdits": {"env": [f"WEFT_CDI_GPU_{i}={u}"]}} for i, u in enumerate(GPUS)]
        devices.append({"name": "all", "containerEdits": {"env": ["WEFT_CDI_ALL=1"]}})
        spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}
        (ctrd.cdi_spec_dir / "weft-test-gpus.json").write_text(json.dumps(spec))
        with AgentProcess(ctrd, tmp_path / "agent", extra_args=["--broker-socket", str(broker.socket)]) as agent:
            yield ctrd, broker, agent


def _run(agent: AgentProcess, ctrd: Containerd, name: str, handler: str,
         device: str = "nvidia.com/gpu=all") -> tuple[str, cri_grpc.RuntimeServiceStub]:
    rt = cri_grpc.RuntimeServiceStub(grpc.insecure_channel(agent.address))
    cfg = pods.sandbox_config(name, ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root)
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler=handler), timeout=120).pod_sandbox_id
    ccfg = pods.container_config("model", ["sleep", "3600"])
    ccfg.CDI_devices.add(name=device)
    cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg),
                             timeout=120).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=120)
    return cid, rt


def _injected(env: dict[str, str]) -> set[str]:
    """The devices whose CDI edits containerd applied ("all" for the spec's all-devices entry)."""
    return {v for k, v in env.items() if k.startswith("WEFT_CDI_GPU_")} | ({"all"} if "WEFT_CDI_ALL" in env else set())


def _env(rt: cri_grpc.RuntimeServiceStub, cid: str) -> dict[str, str]:
    out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["env"], timeout=10), timeout=30).stdout.decode()
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.mark.parametrize(("device", "leased"), [("nvidia.com/gpu=1", {GPUS[1]}), ("nvidia.com/gpu=all", set(GPUS))],
                         ids=["one-by-index", "all"])
def test_a_cdi_gpu_is_classified_leased_and_injected_as_the_leased_devices(node, device: str,
                                                                           leased: set[str]) -> None:
    ctrd, broker, agent = node
    cid, rt = _run(agent, ctrd, "cdi", "weft", device)
    ann = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status.annotations
    assert (ann["weft.io/placement"], ann["weft.io/placement-reason"]) == ("local", "gpu-leased"), ann
    [lease] = broker.leases()
    assert lease.lease_id == ann["weft.io/lease"] and lease.state == "bound" and lease.container_id == cid
    assert set(lease.device_uuids) == leased
    env = _env(rt, cid)
    # containerd applied the CDI edits of the leased devices, named one by one, and never the spec's "all".
    assert _injected(env) == leased, env
    assert set(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == leased


def test_a_plain_pods_cdi_devices_pass_through(node) -> None:
    ctrd, broker, agent = node
    cid, rt = _run(agent, ctrd, "plain", "")
    assert broker.leases() == []
    # No lease, no rewrite: containerd resolves "all" as the spec says.
    assert _injected(_env(rt, cid)) == {"all"}
