"""A real agent in front of a real containerd (with weft's handler and hook) and a real broker, plus the
checks every bad-input example ends with: the agent still serves, and nothing it was given stayed behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from shim.localfabric import pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import BrokerProcess, gpu_fabric
from shim.localfabric.containerd import Containerd
from shim.localfabric.waiting import wait_for

CALL_TIMEOUT = 60.0
# What an agent's own bug looks like to a client (shim.cri.instrument) or a Python traceback leaking out.
_CRASH_MARKERS = ("weft: internal error", "Traceback (most recent call last)", 'File "/')


@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    response: bytes | None


def call(channel: grpc.Channel, path: str, body: bytes, timeout: float = CALL_TIMEOUT) -> Outcome:
    try:
        response = channel.unary_unary(path)(body, timeout=timeout)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", None)
    return Outcome(grpc.StatusCode.OK, "", response)


def assert_clear(out: Outcome, what: object) -> None:
    """A failed call names its problem: a message, never a hang, never the agent's own crash."""
    if out.code is grpc.StatusCode.OK:
        return
    assert out.code is not grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {CALL_TIMEOUT}s: {what}"
    assert out.details.strip(), f"{out.code.name} without a message: {what}"
    assert not any(m in out.details for m in _CRASH_MARKERS), f"{out.code.name} {out.details[:500]!r}: {what}"


@dataclass
class Snapshot:
    sandboxes: set[str]
    containers: set[str]
    leases: set[str]
    state: dict


@dataclass
class FuzzFabric:
    broker: BrokerProcess
    containerd: Containerd
    agent: AgentProcess
    sandbox_id: str
    sandbox_config: cri.PodSandboxConfig
    channel: grpc.Channel
    direct: grpc.Channel
    baseline: Snapshot | None = None
    resources: tuple[int, int] = (0, 0)
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def snapshot(self) -> Snapshot:
        rt = cri_grpc.RuntimeServiceStub(self.direct)
        state = json.loads(call(self.channel, "/weft.agent.v1.Admin/Status", b"", 10).response or b"{}")
        return Snapshot({s.id for s in rt.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=10).items},
                        {c.id for c in rt.ListContainers(cri.ListContainersRequest(), timeout=10).containers},
                        {lease.lease_id for lease in self.broker.leases()},
                        {k: v for k, v in state.items() if k in ("sandboxes", "placements")})

    def alive(self) -> None:
        assert self.agent.proc is not None and self.agent.proc.poll() is None, (
            f"the agent exited:\n{self.agent.log_text()[-3000:]}")
        assert self.broker.proc is not None and self.broker.proc.poll() is None, "the broker exited"
        cri_grpc.RuntimeServiceStub(self.channel).Version(cri.VersionRequest(), timeout=10)

    def remove_sandbox(self, sandbox_id: str) -> None:
        rt = cri_grpc.RuntimeServiceStub(self.channel)
        rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)
        rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sandbox_id), timeout=60)

    def remove_container(self, container_id: str) -> None:
        cri_grpc.RuntimeServiceStub(self.channel).RemoveContainer(
            cri.RemoveContainerRequest(container_id=container_id), timeout=60)

    def assert_nothing_left(self, what: object) -> None:
        """Everything the agent was given is gone again: no sandbox, container, lease or state row."""
        assert self.baseline is not None
        now = self.snapshot()
        assert now.sandboxes == self.baseline.sandboxes, f"sandboxes left behind by {what}"
        assert now.containers == self.baseline.containers, f"containers left behind by {what}"
        assert now.leases == self.baseline.leases, f"broker leases left behind by {what}"
        assert now.state == self.baseline.state, f"agent state rows left behind by {what}"

    def process(self) -> psutil.Process:
        return psutil.Process(self.agent.pid)

    def settle_resources(self) -> None:
        """After a run: no more file descriptors or threads in the agent than after warm-up."""
        fds, threads = self.resources
        proc = self.process()
        wait_for(lambda: proc.num_fds() <= fds and proc.num_threads() <= threads, timeout=20,
                 what=f"the agent back to {fds} fds / {threads} threads "
                      f"(has {proc.num_fds()} / {proc.num_threads()})")

    def state_dir_doc(self) -> dict:
        """``weft status --state-dir``: the agent's rows as the files hold them."""
        out = subprocess.run([sys.executable, "-m", "shim", "status", "--json", "--state-dir",
                              str(self.agent.state_dir)], capture_output=True, text=True, check=True)
        doc = json.loads(out.stdout)
        return {k: v for k, v in doc.items() if k in ("sandboxes", "placements")}


GPU_ENV = {"NVIDIA_VISIBLE_DEVICES": "all"}


def fuzz_fabric(workdir: Path) -> Iterator[FuzzFabric]:
    """Broker (2 simulated GPUs), containerd with the weft handler, agent, and one opted-in pod."""
    broker, ctrd = gpu_fabric(workdir)
    with broker, ctrd:
        agent = AgentProcess(ctrd, workdir / "agent", extra_args=["--broker-socket", str(broker.socket)])
        with agent, agent.channel() as ch, ctrd.channel() as direct:
            cfg = pods.sandbox_config("fuzz", ctrd.pod_log_dir, cgroup_parent=ctrd.cgroup_root,
                                      annotations={"weft.io/gpu-memory.fz": "1Gi"})
            sb = cri_grpc.RuntimeServiceStub(ch).RunPodSandbox(
                cri.RunPodSandboxRequest(config=cfg, runtime_handler="weft"), timeout=60).pod_sandbox_id
            fab = FuzzFabric(broker, ctrd, agent, sb, cfg, ch, direct)
            fab.baseline = fab.snapshot()
            yield fab
