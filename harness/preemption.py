"""A hosted stage preempted on a real cluster, observed from the host's containerd.

Shared by the test that says what preemption must do (``integration/kube/test_kube_hosted.py``) and the benchmark
that measures it with and without the reservation's preStop hook (``shim/bench/checkout/preemption.py``): the same
steps, the same samples, so the figures are those of the behaviour the test checks.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

from cri_api.v1.api_pb2 import CONTAINER_RUNNING

from harness.cluster import KubeCluster
from harness.workloads import apply, container, container_status, delete, get_pod, pod, wait_ready
from shim.localfabric.waiting import wait_for

PREEMPTOR = "important"
STAGED = "infer"

PRIORITY_CLASSES = (
    {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "low"}, "value": 10},
    {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "high"}, "value": 1000},
)


def two_stage(name: str) -> dict:
    """A GPU stage and a CPU stage (``prep``) with limits, at low priority: the CPU stage reroutes."""
    prep = container("prep", "echo prep up; exec sleep 3600",
                     resources={"requests": {"cpu": "200m", "memory": "32Mi"},
                                "limits": {"cpu": "500m", "memory": "64Mi"}})
    model = container("model", "exec sleep 3600", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}])
    p = pod(name, [model, prep], runtime_class="weft", node_selector={"weft.io/role": "gpu"},
            annotations={"weft.io/gpu-memory.model": "10Gi"})
    p["spec"]["priorityClassName"] = "low"
    return p


def plain(name: str, cpu_millis: int, priority_class: str, node: str) -> dict:
    p = pod(name, [container("c", "exec sleep 3600", resources={"requests": {"cpu": f"{cpu_millis}m"}})],
            node_selector={"kubernetes.io/hostname": node}, grace=0)
    p["spec"]["priorityClassName"] = priority_class
    return p


def reservations(kube: KubeCluster) -> list[dict]:
    out = kube.kubectl("get", "pods", "-A", "-l", "weft.io/role=hosted-stage", "-o", "json").stdout
    return json.loads(out)["items"]


def shadows(kube: KubeCluster, origin: str, host: str, running: bool = True) -> list:
    return [c for c in kube.containers(host) if c.labels.get("weft.io/origin-node") == origin
            and (c.state == CONTAINER_RUNNING or not running)]


def free_cpu_millis(kube: KubeCluster, host: str) -> int:
    """What the host's books leave: allocatable CPU less the requests of the pods bound to it."""
    node = json.loads(kube.kubectl("get", "node", host, "-o", "json").stdout)
    alloc = node["status"]["allocatable"]["cpu"]
    total = int(alloc[:-1]) if alloc.endswith("m") else int(alloc) * 1000
    pods = json.loads(kube.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={host}",
                                   "-o", "json").stdout)["items"]
    used = 0
    for p in pods:
        if p["status"].get("phase") in ("Succeeded", "Failed"):
            continue
        for c in p["spec"]["containers"]:
            cpu = (c.get("resources", {}).get("requests") or {}).get("cpu", "0")
            used += int(cpu[:-1]) if cpu.endswith("m") else int(float(cpu) * 1000)
    return total - used


class Overlap:
    """Samples the host's containerd every ``every`` s: whether the shadow and the preemptor's container ran at
    once, and when each was first seen stopped and running."""

    def __init__(self, kube: KubeCluster, origin: str, host: str, every: float = 0.05) -> None:
        self.kube, self.origin, self.host, self.every = kube, origin, host, every
        self.both = 0  # samples with both running
        self.first_both: float | None = None
        self.last_both: float | None = None
        self.shadow_stopped: float | None = None
        self.preemptor_running: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Overlap:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    @property
    def seconds(self) -> float:
        """From the first sample with both running to the last (0 when none)."""
        if self.first_both is None or self.last_both is None:
            return 0.0
        return self.last_both - self.first_both + self.every

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            cs = self.kube.containers(self.host)
            now = time.monotonic()
            shadow = any(c.labels.get("weft.io/origin-node") == self.origin and c.state == CONTAINER_RUNNING
                         for c in cs)
            preemptor = any(c.labels.get("io.kubernetes.pod.name") == PREEMPTOR and c.state == CONTAINER_RUNNING
                            for c in cs)
            if shadow and preemptor:
                self.both += 1
                self.first_both = self.first_both if self.first_both is not None else now
                self.last_both = now
            if not shadow and self.shadow_stopped is None:
                self.shadow_stopped = now
            if preemptor and self.preemptor_running is None:
                self.preemptor_running = now


@dataclass
class Preemption:
    """What one preemption of the stage looked like."""

    wait_s: float  # the preemptor's creation to its container seen running on the host
    overlap_samples: int  # samples with the shadow and the preemptor running at once
    overlap_s: float
    shadow_stopped_first: bool
    stop_hook: bool  # the reservation carried the preStop hook
    reason: str  # the stage's last termination reason, as the origin's kubelet shows it
    most_copies: int  # live copies of the stage at any sample
    shadows_after: int  # shadows of the origin on the host once it settled
    placed_again: dict = field(default_factory=dict)  # the origin's placement of the restart


def preempt(kube: KubeCluster, origin: str, host: str, index: int = 0) -> Preemption:
    """Run the two-stage pod with its CPU stage on ``host``, then a higher-priority pod that needs that CPU.

    The caller makes ``host`` the only place the stage can go (other hosts cordoned). Returns once the
    preemptor runs and the stage has restarted; the pods are deleted whatever happens.
    """
    apply(kube, two_stage(STAGED))
    try:
        wait_ready(kube, STAGED)
        wait_for(lambda: shadows(kube, origin, host), timeout=30, what=f"the shadow running on {host}")
        (held,) = wait_for(lambda: [r for r in reservations(kube) if r["status"].get("phase") == "Running"],
                           timeout=60, what="the reservation running")
        hook = "preStop" in (held["spec"]["containers"][0].get("lifecycle") or {})
        copies: list[int] = []
        with Overlap(kube, origin, host) as overlap:
            created = time.monotonic()
            apply(kube, plain(PREEMPTOR, free_cpu_millis(kube, host) + 300, "high", host))  # needs the stage's CPU

            def settled() -> bool:
                live = len(shadows(kube, origin, host))
                prep = container_status(get_pod(kube, STAGED), "prep")
                copies.append(live + (1 if prep.get("state", {}).get("running") and live == 0 else 0))
                # lastState too: on a busy machine kubelet may show the restart a sync before the ended attempt
                return (prep.get("restartCount", 0) >= 1 and "running" in prep.get("state", {})
                        and "terminated" in prep.get("lastState", {}) and overlap.preemptor_running is not None)

            wait_for(settled, timeout=120, what=f"preemption {index + 1}: prep restarted and the preemptor running",
                     every=0.2)
        assert overlap.preemptor_running is not None
        prep = container_status(get_pod(kube, STAGED), "prep")
        again = [p for p in kube.agent_status(origin)["placements"] if p["name"] == "prep" and p["attempt"] == 1]
        result = Preemption(
            wait_s=overlap.preemptor_running - created, overlap_samples=overlap.both, overlap_s=overlap.seconds,
            shadow_stopped_first=(overlap.shadow_stopped is not None
                                  and overlap.shadow_stopped <= overlap.preemptor_running),
            stop_hook=hook, reason=prep.get("lastState", {}).get("terminated", {}).get("reason", ""),
            most_copies=max(copies), shadows_after=len(shadows(kube, origin, host)),
            placed_again=again[-1] if again else {})
        wait_ready(kube, STAGED)
        return result
    finally:
        delete(kube, STAGED, PREEMPTOR)
