"""``weft demo``: the three-node fabric on this machine, a two-stage pod through it, then nothing left.

Three test nodes (``shim.localfabric.fabric.Fabric3``), each a network namespace
with its own containerd and ``weft agent``: ``gpu-1``, the origin, with a GPU
broker on two simulated 80 GiB GPUs, and ``cpu-1``/``cpu-2``, CPU hosts.
Through the origin's socket, exactly as kubelet would, the demo runs a pod
that opted in (``runtimeClassName: weft``) with two stages:

- ``prepare`` (CPU) makes batches and sends each to the GPU stage on port
  9000. It tries ``127.0.0.1:9000`` first, which reaches the GPU stage from
  another node only through the stitched pod network; when that
  is not there it sends to the GPU stage's pod IP over the flat pod network
  (the cluster's own routes), and every line it logs says which one ran;
- ``serve`` (GPU, a 20 GiB lease) receives the batches and "serves" them.

It shows where each container runs and why (``weft explain``), the lease on
the GPU, the logs of both stages as kubelet reads them on the origin
(``ContainerStatus.log_path``), the agents' and broker's metrics before and
after, and a summary table; then removes everything. ``--keep`` leaves it
running for crictl (state in ``--state-file``) until ``weft demo --down``;
``--json`` ends the output with one line describing nodes, pod and containers
(``describe``). The keeping and the tearing down are in ``shim.localfabric.demo_keep``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from cri_api.v1 import api_pb2 as cri

from shim.localfabric import pods
from shim.localfabric.fabric import ROLES, Fabric3
from shim.localfabric.show import progress, say
from shim.localfabric.waiting import wait_for

PORT = 9000
BATCHES = 5
WEFT = "weft"
# Longer than the test fabric's: a kept demo may sit on a busy machine for a while.
FENCE_S, LOSS_S = 10.0, 20.0

# localhost first, and for a while: the stitch mirrors the GPU stage's port into this container's shadow
# sandbox within a second or two of both running. Only if it never answers do the batches take the pod IP.
PREPARE = f"""
i=0; mode=localhost
while [ $i -lt {BATCHES} ]; do
  i=$((i+1)); batch="batch-$i rows=$((i*128))"; via=failed; n=0
  while [ $n -lt 40 ] && [ "$via" = failed ]; do
    n=$((n+1))
    if [ $mode = localhost ] && echo "$batch" | nc -w 2 127.0.0.1 {PORT} 2>/dev/null; then via=localhost:{PORT}
    elif [ $mode = pod-ip ] || [ $n -ge 30 ]; then
      if echo "$batch" | nc -w 2 "$SERVE_IP" {PORT} 2>/dev/null; then
        via="pod-ip $SERVE_IP:{PORT} (no stitch)"; mode=pod-ip
      else sleep 0.3; fi
    else sleep 0.3; fi
  done
  echo "prepare: sent $batch via $via"
  sleep 0.3
done
exec sleep 86400
"""
SERVE = f"""
echo "serve: lease on ${{NVIDIA_VISIBLE_DEVICES:-no GPU}}, listening on :{PORT}"
n=0
while true; do
  line=$(nc -l -p {PORT})
  n=$((n+1)); echo "serve: got '$line' -> served as request $n on GPU ${{NVIDIA_VISIBLE_DEVICES:-?}}"
done
"""


# -- output ------------------------------------------------------------------------


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


# -- metrics ---------------------------------------------------------------------------

_SHOWN = ("weft_placements_total", "weft_remote_containers", "weft_shadows_hosted", "weft_mesh_peer_up",
          "weft_opted_in_sandboxes", "weft_gpu_leases", "weft_gpu_lease_bytes")


def metrics(f: Fabric3) -> dict[str, float]:
    """The series the demo shows, ``node: name{labels}`` -> value, plus each agent's CRI call count."""
    out: dict[str, float] = {}
    sources = [(name, agent.metrics_text) for name, agent in f.agents.items()]
    assert f.broker is not None
    sources.append(("broker", f.broker.metrics_text))
    for node, read in sources:
        for line in read().splitlines():
            m = re.match(r"^([a-z_]+)(\{[^}]*\})? (\S+)$", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            if name == "weft_cri_requests_total":
                key = f"{node}: weft_cri_requests_total (all methods)"
                out[key] = out.get(key, 0.0) + value
            elif name in _SHOWN:
                out[f"{node}: {name}{_short_labels(labels)}"] = value
    return out


def _short_labels(labels: str) -> str:
    # dcgm-exporter's labels are many; the demo shows the ones that tell series apart.
    keep = re.findall(r'(stage|placement|reason|peer|gpu|container)="([^"]*)"', labels)
    return "{" + ",".join(f"{k}={v}" for k, v in keep) + "}" if keep else ""


def metrics_diff(before: dict[str, float], after: dict[str, float]) -> str:
    rows = [["series", "before", "after"]]
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if b != a or "peer_up" in key:
            rows.append([key, _num(b), _num(a)])
    return table(rows)


def _num(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if v == int(v) else f"{v:g}"


# -- the pod -------------------------------------------------------------------------


def _rt(f: Fabric3):
    return f.runtime("gpu-1")


def run_pod(f: Fabric3) -> dict[str, Any]:
    origin = f.node("gpu-1").containerd
    annotations = {"weft.io/gpu-memory.serve": "20Gi", "weft.io/gpu-compute.serve": "50",
                   "weft.io/stage.prepare": "cpu", "weft.io/ports.serve": str(PORT)}
    sandbox = pods.sandbox_config("two-stage", origin.pod_log_dir, annotations=annotations,
                                  cgroup_parent=origin.cgroup_root)
    ch, rt = _rt(f)
    with ch:
        sid = rt.RunPodSandbox(cri.RunPodSandboxRequest(config=sandbox, runtime_handler=WEFT)).pod_sandbox_id
        ip = rt.PodSandboxStatus(cri.PodSandboxStatusRequest(pod_sandbox_id=sid)).status.network.ip
        say("pod default/two-stage (runtimeClassName: weft) on gpu-1",
            f"sandbox {sid[:13]}, pod IP {ip}\nannotations {json.dumps(annotations)}")
        serve = pods.container_config("serve", ["sh", "-c", SERVE], envs={"NVIDIA_VISIBLE_DEVICES": "all"})
        prepare = pods.container_config("prepare", ["sh", "-c", PREPARE], envs={"SERVE_IP": ip})
        res = prepare.linux.resources  # limits: a host admits a container by them
        res.cpu_period, res.cpu_quota, res.memory_limit_in_bytes = 100000, 50000, 64 << 20
        ids = {}
        for config in (serve, prepare):  # the server first, so the first batch finds it listening
            cid = rt.CreateContainer(cri.CreateContainerRequest(pod_sandbox_id=sid, config=config,
                                                                sandbox_config=sandbox)).container_id
            rt.StartContainer(cri.StartContainerRequest(container_id=cid))
            ids[config.metadata.name] = cid
    return {"sandbox_id": sid, "ip": ip, "ids": ids}


def container_status(f: Fabric3, cid: str) -> cri.ContainerStatus:
    ch, rt = _rt(f)
    with ch:
        return rt.ContainerStatus(cri.ContainerStatusRequest(container_id=cid)).status


def log_lines(f: Fabric3, cid: str) -> list[str]:
    """The container's log as kubelet reads it on the origin: the file ContainerStatus names, CRI format."""
    path = Path(container_status(f, cid).log_path)
    text = path.read_text(errors="replace") if path.exists() else ""
    return [ln.split(" ", 3)[3] for ln in text.splitlines() if ln.count(" ") >= 3]


def weft_cli(*argv: str) -> str:
    return subprocess.run([sys.executable, "-m", "shim", *argv], capture_output=True, text=True,
                          check=True).stdout.strip()


def describe(f: Fabric3, pod: dict[str, Any], placements: dict[str, str]) -> dict[str, Any]:
    """The ``--json`` line and the kept state: the nodes, the pod's sandbox on the origin, its containers."""
    assert f.cluster is not None
    return {
        "nodes": [{"name": n.name, "role": ROLES[n.name], "netns": n.netns,
                   "containerd_socket": str(n.containerd.socket), "weft_socket": str(f.agents[n.name].socket)}
                  for n in f.cluster.nodes],
        "sandbox_id": pod["sandbox_id"],
        "containers": [{"name": name, "id": cid, "placement": placements[name],
                        "node": placements[name].removeprefix("remote:") if placements[name].startswith("remote:")
                        else "gpu-1"} for name, cid in pod["ids"].items()],
    }


# -- the whole run -------------------------------------------------------------------


def main(keep: bool = False, as_json: bool = False, state_file: Path | None = None) -> int:
    from shim.localfabric import demo_keep

    if keep:
        demo_keep.refuse_if_kept(state_file)
    t_all = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="weft-demo-"))
    f = Fabric3(workdir, fence_s=FENCE_S, loss_s=LOSS_S)
    kept = False
    try:
        with progress("starting 3 nodes (network namespaces, containerd, agents, GPU broker, mesh)"):
            f.open()
        assert f.cluster is not None
        say("nodes", table([["node", "role", "netns", "mesh address", "weft socket"]]
                           + [[n.name, ROLES[n.name], n.netns, n.mesh_ip, str(f.agents[n.name].socket)]
                              for n in f.cluster.nodes]))
        peers = f.status("gpu-1")["peers"]
        say("gpu-1 sees its peers", "\n".join(
            f"{p['node']} ({p['role']}): healthy={p['healthy']}, free {p['free_cpu_cores']} CPU, "
            f"{(p['free_memory_bytes'] or 0) >> 20} MiB" for p in peers))
        before = metrics(f)
        with progress("running the two-stage pod through gpu-1's agent (as kubelet would)"):
            pod = run_pod(f)
            wait_for(lambda: all(container_status(f, c).state == cri.CONTAINER_RUNNING for c in pod["ids"].values()),
                     timeout=60, what="both stages running")
        statuses = {name: container_status(f, cid) for name, cid in pod["ids"].items()}
        placements = {name: st.annotations.get("weft.io/placement", "?") for name, st in statuses.items()}
        for name, st in statuses.items():
            ann = st.annotations
            say(f"container {name} ({st.id[:13]}, as kubelet knows it)",
                f"weft.io/placement={ann.get('weft.io/placement')} "
                f"weft.io/placement-reason={ann.get('weft.io/placement-reason')}"
                + (f" weft.io/lease={ann['weft.io/lease']}" if "weft.io/lease" in ann else ""))
        origin_sock = str(f.agents["gpu-1"].socket)
        for name, cid in pod["ids"].items():
            say(f"weft explain {name}", weft_cli("explain", cid[:13], "--socket", origin_sock))
        assert f.broker is not None
        for lease in f.broker.leases():
            say(f"GPU lease {lease.lease_id} ({lease.container})",
                f"{lease.state} on {', '.join(lease.device_uuids)}: {lease.memory_bytes >> 30} GiB of 80 GiB, "
                f"{lease.compute_percent}% compute, bound to pid {lease.pid}")
        with progress(f"the CPU stage sends {BATCHES} batches to the GPU stage"):
            wait_for(lambda: sum("sent batch" in ln for ln in log_lines(f, pod["ids"]["prepare"])) >= BATCHES
                     and sum("got " in ln for ln in log_lines(f, pod["ids"]["serve"])) >= BATCHES,
                     timeout=90, what="every batch sent and served (logs through the origin)")
        logs = {name: log_lines(f, cid) for name, cid in pod["ids"].items()}
        via = _data_path(logs["prepare"], placements["prepare"])
        say("data path", via)
        for name, lines in logs.items():
            say(f"log of {name}, read on gpu-1 ({statuses[name].log_path})", "\n".join(lines))
        say("weft status on gpu-1", weft_cli("status", "--socket", origin_sock))
        after = metrics(f)
        say("metrics before -> after (agents' /metrics and the broker's)", metrics_diff(before, after))
        desc = describe(f, pod, placements)
        say("summary", table(
            [["container", "stage", "runs on", "placement", "why", "GPU lease", "log lines"]]
            + [[name, "gpu" if name == "serve" else "cpu", c["node"], c["placement"],
                statuses[name].annotations.get("weft.io/placement-reason", "?"),
                statuses[name].annotations.get("weft.io/lease", "-"), str(len(logs[name]))]
               for name, c in ((c["name"], c) for c in desc["containers"])]))
        if keep:
            kept = demo_keep.keep(f, desc, state_file, as_json)
            return 0
        with progress("removing the pod through gpu-1"):
            ch, rt = _rt(f)
            with ch:
                for cid in pod["ids"].values():  # as kubelet does, with a short grace: sh as PID 1 ignores SIGTERM
                    rt.StopContainer(cri.StopContainerRequest(container_id=cid, timeout=1))
                rt.StopPodSandbox(cri.StopPodSandboxRequest(pod_sandbox_id=pod["sandbox_id"]))
                rt.RemovePodSandbox(cri.RemovePodSandboxRequest(pod_sandbox_id=pod["sandbox_id"]))
            say("pod removed", f"leases left: {len(f.broker.leases())}; shadows left on hosts: "
                f"{sum(len(f.shadows(h)) for h in ('cpu-1', 'cpu-2'))}")
    finally:
        if not kept:
            with progress("removing the fabric (agents, broker, containerds, namespaces, bridge, cgroups)"):
                f.close()
                import shutil

                shutil.rmtree(workdir, ignore_errors=True)
    say("cleaned up", f"everything the demo made is gone ({time.monotonic() - t_all:.0f}s in all)")
    if as_json:
        print(json.dumps(desc), flush=True)
    return 0


def _data_path(prepare_log: list[str], placement: str) -> str:
    if not placement.startswith("remote:"):
        return (f"localhost:{PORT}: the CPU stage ran on gpu-1 ({placement}), in the GPU stage's own pod network "
                "namespace")
    if prepare_log and all("via localhost" in ln for ln in prepare_log if "sent batch" in ln):
        return (f"localhost:{PORT}: the stitched pod network carried the batches from the CPU stage's node "
                "to the GPU stage")
    return (f"pod IP: 127.0.0.1:{PORT} did not reach the GPU stage from the CPU stage's node (no stitched "
            f"listener for port {PORT} in its shadow sandbox), so the batches went to the GPU stage's pod IP over "
            "the flat pod network")
