"""``weft demo``: a throwaway single-node fabric on this machine, end to end.

Starts a private containerd (own root, socket, network namespace and CNI
bridge) whose ``weft`` runtime handler runs the OCI hook, a GPU broker with
two simulated 80 GiB GPUs (there is no GPU here), and a ``weft agent`` in
front of containerd. Then, through the agent's socket exactly as kubelet
would: a plain pod, which passes through untouched, and a pod that opted in
(``runtimeClassName: weft``) with a CPU stage and two GPU stages sharing one
GPU by memory. It prints what happened at each step and removes everything
it made.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cri_api.v1 import api_pb2 as cri
from cri_api.v1 import api_pb2_grpc as cri_grpc

from integration import pods
from integration.agent import AgentProcess
from integration.broker import gpu_fabric


def _say(step: str, detail: str = "") -> None:
    print(f"==> {step}" + (f"\n    {detail}" if detail else ""), flush=True)


def _start(rt, sb: str, cfg, name: str, command: list[str], envs: dict[str, str] | None = None) -> str:
    ccfg = pods.container_config(name, command, envs=envs)
    req = cri.CreateContainerRequest(pod_sandbox_id=sb, config=ccfg, sandbox_config=cfg)
    cid = rt.CreateContainer(req).container_id
    rt.StartContainer(cri.StartContainerRequest(container_id=cid))
    return cid


def _remove_pod(rt, sb: str) -> None:
    rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=sb))
    rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=sb))


def main(keep_going: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="weft-demo-") as tmp:
        broker, node = gpu_fabric(Path(tmp))
        with broker, node:
            _say("containerd started", f"socket {node.socket}, netns {node.netns}, bridge {node.bridge} "
                 f"{node.subnet}; runtime handler 'weft' = runc + weft-oci-hook")
            _say("GPU broker started", f"socket {broker.socket}, simulated GPUs {broker.devices}")
            agent = AgentProcess(node, Path(tmp) / "agent", extra_args=["--broker-socket", str(broker.socket)])
            with agent, agent.channel() as ch:
                _say("weft agent serving CRI", f"socket {agent.socket} (mode 0600) -> {node.socket}; "
                     f"metrics {agent.metrics_url}/metrics")
                rt = cri_grpc.RuntimeServiceStub(ch)
                v = rt.Version(cri.VersionRequest())
                _say("Version through the agent", f"{v.runtime_name} {v.runtime_version}, CRI {v.runtime_api_version}")
                _plain_pod(rt, node)
                _opted_in_pod(rt, node, broker, agent, keep_going)
                calls = [line for line in agent.metrics_text().splitlines()
                         if line.startswith("weft_cri_requests_total{")]
                _say("what the agent counted", "\n    ".join(calls))
    _say("cleaned up", "agent, broker and containerd stopped; namespace, bridge, mounts, cgroups and files removed")
    return 0


def _plain_pod(rt, node) -> None:
    cfg = pods.sandbox_config("plain", node.pod_log_dir, cgroup_parent=node.cgroup_root)
    t0 = time.perf_counter()
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg)).pod_sandbox_id
    cid = _start(rt, sb, cfg, "hello", ["sh", "-c", "echo hello from a pod started through weft; exec sleep 3600"])
    ms = (time.perf_counter() - t0) * 1e3
    ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sb)).status.network.ip
    _say("plain pod started through the agent (passes through untouched)",
         f"sandbox {sb[:12]} ip {ip}; container {cid[:12]}; {ms:.0f} ms for RunPodSandbox+CreateContainer+"
         "StartContainer")
    out = rt.ExecSync(cri.ExecSyncRequest(container_id=cid, cmd=["uname", "-n"], timeout=10))
    _say("ExecSync uname -n", f"{out.stdout.decode().strip()} (exit {out.exit_code})")
    log_file = Path(cfg.log_directory) / "hello" / "0.log"
    for _ in range(50):
        if log_file.exists() and log_file.read_text().strip():
            break
        time.sleep(0.05)
    _say("container log (CRI format)", log_file.read_text().strip() if log_file.exists() else "(empty)")
    _remove_pod(rt, sb)
    _say("plain pod stopped and removed")


def _opted_in_pod(rt, node, broker, agent, keep_going: bool) -> None:
    annotations = {"weft.io/gpu-memory.embed": "20Gi", "weft.io/gpu-memory.rank": "30Gi",
                   "weft.io/gpu-compute.rank": "40"}
    cfg = pods.sandbox_config("infer", node.pod_log_dir, annotations=annotations, cgroup_parent=node.cgroup_root)
    sb = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=cfg, runtime_handler="weft")).pod_sandbox_id
    _say("opted-in pod (runtimeClassName: weft)", f"sandbox {sb[:12]}; annotations {json.dumps(annotations)}")
    ids = {
        "tokenize": _start(rt, sb, cfg, "tokenize", ["sleep", "3600"]),
        "embed": _start(rt, sb, cfg, "embed", ["sleep", "3600"], {"NVIDIA_VISIBLE_DEVICES": "all"}),
        "rank": _start(rt, sb, cfg, "rank", ["sleep", "3600"], {"NVIDIA_VISIBLE_DEVICES": "all"}),
    }
    for name, cid in ids.items():
        ann = rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status.annotations
        lease = ann.get("weft.io/lease", "-")
        _say(f"container {name}", f"weft.io/placement={ann['weft.io/placement']} "
             f"weft.io/placement-reason={ann['weft.io/placement-reason']} weft.io/lease={lease}")
    for lease in broker.leases():
        _say(f"lease {lease.lease_id} ({lease.container})",
             f"{lease.state} on {', '.join(lease.device_uuids)}: {lease.memory_bytes >> 30} GiB, "
             f"{lease.compute_percent}% compute, bound to pid {lease.pid}")
    show_env = ["sh", "-c", "env | grep -E '^(CUDA|NVIDIA)'"]
    env = rt.ExecSync(cri.ExecSyncRequest(container_id=ids["rank"], cmd=show_env, timeout=10)).stdout.decode().strip()
    _say("what the rank container sees", env.replace("\n", "\n    "))
    explain = subprocess.run([sys.executable, "-m", "shim", "explain", ids["rank"][:12], "--socket",
                              str(agent.socket)], capture_output=True, text=True, check=True).stdout.strip()
    _say("weft explain", explain.replace("\n", "\n    "))
    if keep_going:
        input(f"pods running; try: weft status --socket {agent.socket}   (Enter to clean up) ")
    _remove_pod(rt, sb)
    _say("opted-in pod removed", f"leases left: {len(broker.leases())}")
