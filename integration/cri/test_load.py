"""200 concurrent CRI clients for 60 s through a real agent in front of a real containerd.

Each client has its own connection (as 200 kubelet-like pollers would) and
loops over the polling verbs kubelet uses most: Version, ListPodSandbox,
ListContainers and ContainerStatus, with 10 pods running. No call may fail;
the latency percentiles are printed to the terminal (not asserted: the
machine is shared). ``WEFT_LOAD_SECONDS`` shortens the run for local work.
"""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.core.stats import percentile
from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.containerd import Containerd

CLIENTS = 200
SECONDS = float(os.environ.get("WEFT_LOAD_SECONDS", "60"))


def _pods(containerd: Containerd, n: int) -> list[str]:
    with containerd.channel() as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        ids = []
        for i in range(n):
            cfg = pods.sandbox_config(f"load-{i}", containerd.pod_log_dir, cgroup_parent=containerd.cgroup_root)
            sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg), timeout=60).pod_sandbox_id
            ccfg = pods.container_config("app", ["sleep", "3600"])
            cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg),
                                     timeout=60).container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=60)
            ids.append(cid)
        return ids


async def _client(address: str, containers: list[str], n: int, deadline: float,
                  latencies: dict[str, list[float]], errors: list[str]) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        rt = cri_grpc.RuntimeServiceStub(ch)
        calls = [
            ("Version", lambda: rt.Version(cri.VersionRequest(), timeout=30)),
            ("ListPodSandbox", lambda: rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=30)),
            ("ListContainers", lambda: rt.ListContainers(cri.ListContainersRequest(), timeout=30)),
            ("ContainerStatus", lambda: rt.ContainerStatus(
                cri.ContainerStatusRequest(container_id=containers[n % len(containers)]), timeout=30)),
        ]
        i = n
        while time.monotonic() < deadline:
            name, fn = calls[i % len(calls)]
            i += 1
            start = time.perf_counter()
            try:
                await fn()
            except grpc.aio.AioRpcError as e:
                errors.append(f"{name}: {e.code().name} {e.details()}")
                continue
            latencies[name].append(time.perf_counter() - start)


async def _load(address: str, containers: list[str]) -> tuple[dict[str, list[float]], list[str]]:
    latencies: dict[str, list[float]] = {"Version": [], "ListPodSandbox": [], "ListContainers": [],
                                         "ContainerStatus": []}
    errors: list[str] = []
    deadline = time.monotonic() + SECONDS
    await asyncio.gather(*(_client(address, containers, n, deadline, latencies, errors) for n in range(CLIENTS)))
    return latencies, errors


def _pct(values: list[float], q: float) -> float:
    return percentile(values, q) or 0.0


def test_200_concurrent_clients_for_a_minute_without_an_error(containerd: Containerd, agent: AgentProcess,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    containers = _pods(containerd, 10)
    latencies, errors = asyncio.run(_load(agent.address, containers))
    everything = [x for v in latencies.values() for x in v]
    lines = [f"load: {CLIENTS} clients, {SECONDS:g} s, {len(everything)} calls "
             f"({len(everything) / SECONDS:.0f}/s), {len(errors)} errors"]
    for name, values in [*latencies.items(), ("all", everything)]:
        if values:
            lines.append(f"  {name:<16} n={len(values):<7} p50={_pct(values, 50) * 1e3:7.2f} ms  "
                         f"p99={_pct(values, 99) * 1e3:7.2f} ms  max={max(values) * 1e3:7.2f} ms")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert not errors, f"{len(errors)} calls failed, first: {errors[:5]}"
    assert all(latencies.values()), {k: len(v) for k, v in latencies.items()}
    assert agent.proc is not None and agent.proc.poll() is None
