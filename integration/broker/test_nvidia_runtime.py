"""No container under the ``weft`` handler sees a GPU outside its lease, with NVIDIA's runtime as the default.

On a GPU Operator's node containerd's default runtime is NVIDIA's (``nvidia-container-runtime``), and the
``weft`` handler copies it. That runtime gives a container whatever GPUs its ``NVIDIA_VISIBLE_DEVICES`` names,
in the image's environment too (CUDA base images set ``all``), which the CRI request does not show. Here the
toolkit's real runtime and prestart hook (v1.17.8 and v1.20.2, built from the module) run every container, in
their legacy mode (the hook hands ``nvidia-container-cli`` the devices: a recording stand-in for the C library,
as there is no GPU) and their CDI mode (the runtime injects the devices of a CDI spec of the test's own, whose
edits name each GPU in the environment). The image of every container sets ``NVIDIA_VISIBLE_DEVICES=all``:

- a container of an opted-in pod that holds no lease gets no GPU;
- an opted-in GPU container gets exactly its lease;
- a plain pod's container gets every GPU (the runtime does read the image's variable: the control).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from harness import binaries
from shim.broker.simulated import simulated_uuid
from shim.localfabric import images, pods
from shim.localfabric.agent import AgentProcess
from shim.localfabric.broker import BrokerProcess, weft_handler
from shim.localfabric.containerd import Containerd, RuntimeHandler

GPUS = [simulated_uuid(i) for i in range(2)]  # the broker's default: 2x80GiB
CUDA_IMAGE = "docker.io/weft-test/cuda-like:1"  # a busybox whose image sets NVIDIA_VISIBLE_DEVICES=all


@dataclasses.dataclass
class Node:
    ctrd: Containerd
    broker: BrokerProcess
    agent: AgentProcess
    mode: str
    cli_log: Path

    def rt(self) -> cri_grpc.RuntimeServiceStub:
        return cri_grpc.RuntimeServiceStub(grpc.insecure_channel(self.agent.address))

    def run(self, name: str, handler: str, envs: dict[str, str] | None = None,
            annotations: dict[str, str] | None = None) -> str:
        rt = self.rt()
        cfg = pods.sandbox_config(name, self.ctrd.pod_log_dir, cgroup_parent=self.ctrd.cgroup_root,
                                  annotations=annotations)
        sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler=handler),
                              timeout=120).pod_sandbox_id
        ccfg = pods.container_config("app", ["sleep", "3600"], image=CUDA_IMAGE, envs=envs)
        cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg),
                                 timeout=120).container_id
        rt.StartContainer(cri.StartContainerRequest(container_id=cid), timeout=120)
        return cid

    def gpus_given(self, cid: str) -> set[str]:
        """What NVIDIA's toolkit gave the container: the devices its hook handed nvidia-container-cli (legacy
        mode), or those whose CDI edits its runtime applied (CDI mode)."""
        if self.mode == "legacy":
            calls = [line for line in (self.cli_log.read_text().splitlines() if self.cli_log.exists() else [])
                     if cid in line]
            return {d for line in calls for w in line.split() if w.startswith("--device=")
                    for d in w.removeprefix("--device=").split(",")}
        # The container's first process: the runtime edited the spec it started from (an exec gets containerd's).
        out = self.rt().ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["cat", "/proc/1/environ"], timeout=10),
                                 timeout=30)
        env = dict(item.split("=", 1) for item in out.stdout.decode().split("\0") if "=" in item)
        return {v for k, v in env.items() if k.startswith("WEFT_NVIDIA_GPU_")}


def _toolkit(tmp: Path, line: str, mode: str) -> tuple[Path, Path]:
    """NVIDIA's runtime and hook as the operator's installer lays them out: wrappers that give each its config.
    Returns (the runtime to name as BinaryName, the log of nvidia-container-cli's calls)."""
    bins = binaries.nvidia_toolkit(line)
    tmp.mkdir(parents=True)
    cli_log, cdi = tmp / "nvidia-container-cli.log", tmp / "cdi"
    cli = tmp / "nvidia-container-cli"
    cli.write_text(f'#!/bin/sh\necho "$*" >> {cli_log}\n')
    cli.chmod(0o755)
    cdi.mkdir()
    devices = [{"name": name, "containerEdits": {"env": [f"WEFT_NVIDIA_GPU_{i}={uuid}"]}}
               for i, uuid in enumerate(GPUS) for name in (uuid, str(i))]
    devices.append({"name": "all", "containerEdits": {"env": ["WEFT_NVIDIA_GPU_ALL=all"]}})
    (cdi / "nvidia.json").write_text(json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices}))
    hook = tmp / "nvidia-container-runtime-hook"
    config_dir = tmp / "config"
    config = config_dir / "nvidia-container-runtime" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text(f"""accept-nvidia-visible-devices-envvar-when-unprivileged = true
accept-nvidia-visible-devices-as-volume-mounts = false

[nvidia-container-cli]
path = "{cli}"

[nvidia-container-runtime]
mode = "{mode}"
runtimes = ["{shutil.which('runc')}"]
log-level = "debug"
debug = "{tmp / 'nvidia-container-runtime.log'}"

[nvidia-container-runtime.modes.cdi]
default-kind = "nvidia.com/gpu"
spec-dirs = ["{cdi}"]

[nvidia-container-runtime-hook]
path = "{hook}"
skip-mode-detection = true
""")
    runtime = tmp / "nvidia-container-runtime"
    runtime.write_text(f'#!/bin/sh\nNVIDIA_CTK_CONFIG_FILE_PATH={config} XDG_CONFIG_HOME={config_dir} '
                       f'exec {bins}/nvidia-container-runtime "$@"\n')
    hook.write_text(f'#!/bin/sh\nexec {bins}/nvidia-container-runtime-hook -config {config} "$@"\n')
    runtime.chmod(0o755)
    hook.chmod(0o755)
    return runtime, cli_log


@contextlib.contextmanager
def _node(tmp_path: Path, line: str, mode: str) -> Iterator[Node]:
    runtime, cli_log = _toolkit(tmp_path / "toolkit", line, mode)
    broker = BrokerProcess(tmp_path / "broker")
    # As the toolkit leaves containerd with nvidia the default, and weft install then copies it for its handler.
    nvidia = RuntimeHandler("nvidia", binary_name=str(runtime))
    weft = dataclasses.replace(weft_handler(tmp_path, broker.socket), binary_name=str(runtime))
    with broker, Containerd(handlers=[nvidia, weft], default_runtime="nvidia") as ctrd:
        archive = images.build_archive(images.ImageSpec(CUDA_IMAGE, ("sh",), env=("NVIDIA_VISIBLE_DEVICES=all",)),
                                       tmp_path / "cuda-like.tar")
        ctrd.import_image(archive, CUDA_IMAGE)
        with AgentProcess(ctrd, tmp_path / "agent", extra_args=["--broker-socket", str(broker.socket)]) as agent:
            yield Node(ctrd, broker, agent, mode, cli_log)


@pytest.fixture(params=[(line, mode) for line in ("1.17", "1.20") for mode in ("legacy", "cdi")],
                ids=lambda p: f"toolkit-{p[0]}-{p[1]}")
def node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Node]:
    with _node(tmp_path, *request.param) as n:
        yield n


def test_a_container_without_a_lease_gets_no_gpu_though_its_image_asks_for_all(node: Node) -> None:
    cid = node.run("prep", "weft")
    ann = node.rt().ContainerStatus(cri.ContainerStatusRequest(container_id=cid), timeout=30).status.annotations
    assert ann["weft.io/placement-reason"] == "no-mesh", "a CPU stage kept on this node"
    assert node.gpus_given(cid) == set()
    assert node.broker.leases() == []


def test_a_leased_container_gets_exactly_its_lease(node: Node) -> None:
    # As NVIDIA's device plugin asks (its envvar strategy): one GPU of the node, here the second.
    cid = node.run("model", "weft", envs={"NVIDIA_VISIBLE_DEVICES": GPUS[1]},
                   annotations={"weft.io/gpu-memory.app": "20Gi"})
    [lease] = node.broker.leases()
    assert lease.container_id == cid and list(lease.device_uuids) == [GPUS[1]]
    assert node.gpus_given(cid) == {GPUS[1]}


def test_a_plain_pod_gets_what_its_image_asks_for_as_without_weft(node: Node) -> None:
    cid = node.run("plain", "")
    assert node.gpus_given(cid) == {"all"}
    assert node.broker.leases() == []


@pytest.mark.parametrize("line", ["1.17", "1.20"])
def test_in_auto_mode_a_container_without_a_lease_gets_no_gpu(line: str, tmp_path: Path) -> None:
    """The runtime's default mode: legacy on v1.17, just-in-time CDI from NVML on v1.20 (which, asked for a GPU,
    needs a driver: only the container that asks for none can run here, which is the point)."""
    with _node(tmp_path, line, "auto") as n:
        cid = n.run("prep", "weft")
        n.mode = "legacy"  # what auto resolves to without CDI names on v1.17; on v1.20 nothing reaches the hook
        assert n.gpus_given(cid) == set()
        log = (tmp_path / "toolkit" / "nvidia-container-runtime.log").read_text()
        assert "nvidia.com/gpu=all" not in log and "Injecting devices" not in log
