"""``weft demo``: a throwaway fabric on this one machine, end to end.

Starts a private containerd (own root, socket, network namespace and CNI
bridge), puts a ``weft agent`` in front of it, runs a pod with a container
through the agent's socket exactly as kubelet would, prints what happened at
each step, and removes everything it made.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration import pods
from integration.agent import AgentProcess
from integration.harness import Containerd


def _say(step: str, detail: str = "") -> None:
    print(f"==> {step}" + (f"\n    {detail}" if detail else ""), flush=True)


def main(keep_going: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="weft-demo-") as tmp, Containerd() as node:
        _say("containerd started", f"socket {node.socket}, netns {node.netns}, bridge {node.bridge} {node.subnet}")
        with AgentProcess(node, Path(tmp) / "agent") as agent, agent.channel() as ch:
            _say("weft agent serving CRI", f"socket {agent.socket} (mode 0600) -> {node.socket}; "
                 f"metrics {agent.metrics_url}/metrics")
            rt = cri_grpc.RuntimeServiceStub(ch)
            v = rt.Version(cri.VersionRequest())
            _say("Version through the agent", f"{v.runtime_name} {v.runtime_version}, CRI {v.runtime_api_version}")

            cfg = pods.sandbox_config("demo", node.pod_log_dir)
            t0 = time.perf_counter()
            sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
            ccfg = pods.container_config("hello", ["sh", "-c", "echo hello from a pod started through weft; "
                                                   "exec sleep 3600"])
            cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg,
                                                                sandbox_config=cfg)).container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
            started_ms = (time.perf_counter() - t0) * 1e3
            ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sb)).status.network.ip
            _say("pod started through the agent", f"sandbox {sb[:12]} ip {ip}; container {cid[:12]}; "
                 f"{started_ms:.0f} ms for RunPodSandbox+CreateContainer+StartContainer")
            state = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.state
            _say("ContainerStatus", cri.ContainerState.Name(state))
            out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["uname", "-n"], timeout=10))
            _say("ExecSync uname -n", f"{out.stdout.decode().strip()} (exit {out.exit_code})")
            log_file = Path(cfg.log_directory) / ccfg.log_path
            for _ in range(50):
                if log_file.exists() and log_file.read_text().strip():
                    break
                time.sleep(0.05)
            _say("container log (CRI format)", log_file.read_text().strip() if log_file.exists() else "(empty)")
            if keep_going:
                input(f"pod running; try: crictl --runtime-endpoint {agent.address} ps   (Enter to clean up) ")
            rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=1))
            rt.RemoveContainer(cri.RemoveContainerRequest(container_id=cid))
            rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb))
            rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb))
            _say("pod stopped and removed")
            calls = [line for line in agent.metrics_text().splitlines()
                     if line.startswith("weft_cri_requests_total{")]
            _say("what the agent counted", "\n    ".join(calls))
    _say("cleaned up", "containerd stopped; its namespace, bridge, mounts and files removed")
    return 0
