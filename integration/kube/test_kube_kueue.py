"""weft beneath Kueue: Jobs queued and admitted by Kueue v0.17.0 on a real cluster, their CPU stages rerouted.

Kueue's controller manager (built from ``sigs.k8s.io/kueue``, ``harness/kueue.py``) runs against the
test cluster's API server with kube-controller-manager's Job controller; a ClusterQueue holds CPU, memory and
``nvidia.com/gpu`` quota (the GPU node advertises two, as a device plugin would) and a LocalQueue in ``default``
points at it. What must hold:

- an opted-in two-stage Job admitted by Kueue runs with its CPU stage on the CPU node and that stage's
  reservation pod there, and Kueue's books for it are what they are for the same Job not opted in (weft's
  namespace, where reservation pods live, is none of Kueue's: they are no workload, count against no queue);
- Kueue preempting an opted-in Job for a higher-priority one: its shadow stops before the preemptor's pod
  starts (sampled on the hosts' containerd, as the scheduler-preemption test does);
- a Job of parallelism 2, admitted as one gang, runs both pods with their CPU stages rerouted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from cri_api.v1.api_pb2 import CONTAINER_RUNNING

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.kueue import API, PRIORITY_LABEL, QUEUE_LABEL, Kueue
from harness.workloads import apply, container
from shim.localfabric.waiting import wait_for

pytestmark = pytest.mark.slow

ORIGIN, HOST = "gpu-1", "cpu-1"
QUEUE = "team"
GPUS = 2


@pytest.fixture(scope="module")
def kube(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    for c in fixture.cluster(request, tmp_path_factory, [NodeSpec(ORIGIN, "gpu"), NodeSpec(HOST, "cpu")],
                             agent_api=True):
        c.control.start_controller_manager(["job-controller", "garbage-collector-controller"])
        # What NVIDIA's device plugin would advertise (kubelet keeps an extended resource the API was given).
        c.kubectl("patch", "node", ORIGIN, "--subresource=status", "--type=merge", "-p",
                  json.dumps({"status": {"capacity": {"nvidia.com/gpu": str(GPUS)},
                                         "allocatable": {"nvidia.com/gpu": str(GPUS)}}}))
        with Kueue(c.control, tmp_path_factory.mktemp("kueue")) as kueue:
            fixture.report(request.config, f"kueue started in {kueue.timings['kueue start']:.1f} s")
            apply(c,
                  {"apiVersion": API, "kind": "ResourceFlavor", "metadata": {"name": "default"}},
                  {"apiVersion": API, "kind": "ClusterQueue", "metadata": {"name": QUEUE}, "spec": {
                      "namespaceSelector": {}, "preemption": {"withinClusterQueue": "LowerPriority"},
                      "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [{
                          "name": "default", "resources": [{"name": "cpu", "nominalQuota": "4"},
                                                           {"name": "memory", "nominalQuota": "4Gi"},
                                                           {"name": "nvidia.com/gpu", "nominalQuota": str(GPUS)}]}]}]}},
                  {"apiVersion": API, "kind": "LocalQueue", "metadata": {"name": QUEUE, "namespace": "default"},
                   "spec": {"clusterQueue": QUEUE}},
                  {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "low"}, "value": 10},
                  {"apiVersion": API, "kind": "WorkloadPriorityClass", "metadata": {"name": "high"}, "value": 1000})
            try:
                yield c
            finally:
                fixture.report(request.config, "kueue log tail:\n" + kueue.log()[-1500:]
                               if request.session.testsfailed else "kueue stopped")


def _job(name: str, *, opted_in: bool, gpus: int = 1, parallelism: int = 1, priority: str = "low") -> dict:
    """A two-stage Job as a team queues it: the GPU stage (``model``) and a CPU stage (``prep``) with limits,
    created suspended (what Kueue's job webhook makes of a queued Job)."""
    prep = container("prep", "echo prep up; exec sleep 3600",
                     resources={"requests": {"cpu": "200m", "memory": "32Mi"},
                                "limits": {"cpu": "500m", "memory": "64Mi"}})
    model = container("model", "exec sleep 3600", env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                      resources={"requests": {"cpu": "100m", "memory": "32Mi", "nvidia.com/gpu": str(gpus)},
                                 "limits": {"nvidia.com/gpu": str(gpus)}})
    spec: dict = {"containers": [model, prep], "restartPolicy": "Never", "terminationGracePeriodSeconds": 2,
                  "nodeSelector": {"weft.io/role": "gpu"}}
    if opted_in:
        spec["runtimeClassName"] = "weft"
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": "default",
                         "labels": {QUEUE_LABEL: QUEUE, PRIORITY_LABEL: priority}},
            "spec": {"suspend": True, "parallelism": parallelism, "completions": parallelism, "backoffLimit": 0,
                     "template": {"metadata": {"annotations": {"weft.io/gpu-memory.model": "10Gi"} if opted_in
                                               else {}}, "spec": spec}}}


def _pods(kube: KubeCluster, job: str) -> list[dict]:
    out = kube.kubectl("get", "pods", "-n", "default", "-l", f"job-name={job}", "-o", "json").stdout
    return json.loads(out)["items"]


def _running(p: dict, name: str) -> bool:
    return any(s["name"] == name and "running" in s.get("state", {}) for s in p.get("status", {}).get(
        "containerStatuses") or [])


def _workload(kube: KubeCluster, job: str) -> dict:
    out = json.loads(kube.kubectl("get", "workloads.kueue.x-k8s.io", "-n", "default", "-o", "json").stdout)
    return next(w for w in out["items"] if any(o.get("name") == job for o in w["metadata"].get("ownerReferences", [])))


def _admitted_usage(kube: KubeCluster, job: str) -> dict:
    [assignment] = _workload(kube, job)["status"]["admission"]["podSetAssignments"]
    return assignment["resourceUsage"]


def _queue_usage(kube: KubeCluster) -> dict:
    cq = json.loads(kube.kubectl("get", "clusterqueues.kueue.x-k8s.io", QUEUE, "-o", "json").stdout)
    return {r["name"]: r["total"] for f in cq["status"].get("flavorsUsage", []) for r in f["resources"]}


def _booked(kube: KubeCluster, usage: dict) -> dict:
    """The ClusterQueue's usage once it books the admitted workload's (its status follows the admission)."""
    def booked() -> dict | None:
        queue = _queue_usage(kube)
        return queue if all(queue.get(k) == v for k, v in usage.items()) else None

    return wait_for(booked, timeout=30, what=f"the ClusterQueue booking {usage}")


def _reservations(kube: KubeCluster) -> list[dict]:
    out = kube.kubectl("get", "pods", "-n", "weft-system", "-l", "weft.io/role=hosted-stage", "-o", "json").stdout
    return json.loads(out)["items"]


def _shadows(kube: KubeCluster) -> list:
    return [c for c in kube.containers(HOST) if c.labels.get("weft.io/origin-node") == ORIGIN
            and c.state == CONTAINER_RUNNING]


def _delete_jobs(kube: KubeCluster, *names: str) -> None:
    kube.kubectl("delete", "job", "-n", "default", "--ignore-not-found", "--cascade=foreground", "--wait=true",
                 "--timeout=120s", *names, timeout=180)
    wait_for(lambda: not any(_pods(kube, n) for n in names), timeout=120, what="the jobs' pods gone")
    wait_for(lambda: not _shadows(kube) and not _reservations(kube), timeout=120,
             what="no shadow or reservation left on the host")
    wait_for(lambda: not _workloads(kube) and not any(q != "0" for q in _queue_usage(kube).values()), timeout=120,
             what="the jobs' workloads gone and the queue's usage released")


def _workloads(kube: KubeCluster) -> list[dict]:
    return json.loads(kube.kubectl("get", "workloads.kueue.x-k8s.io", "-A", "-o", "json").stdout)["items"]


def _until_prep_runs(kube: KubeCluster, job: str, pods: int = 1) -> float:
    """Seconds from the Job's creation to its CPU stage running in every pod (as kubelet reports it)."""
    t0 = time.monotonic()
    wait_for(lambda: len([p for p in _pods(kube, job) if _running(p, "prep") and _running(p, "model")]) == pods,
             timeout=180, what=f"{job}'s stages running", every=0.1)
    return time.monotonic() - t0


def test_an_opted_in_job_admitted_by_kueue_is_booked_as_without_weft_and_its_cpu_stage_rerouted(
        kube: KubeCluster, request: pytest.FixtureRequest) -> None:
    try:
        apply(kube, _job("plain-job", opted_in=False))
        plain_s = _until_prep_runs(kube, "plain-job")
        plain_usage = _admitted_usage(kube, "plain-job")
        plain_queue = _booked(kube, plain_usage)
        _delete_jobs(kube, "plain-job")

        apply(kube, _job("weft-job", opted_in=True))
        weft_s = _until_prep_runs(kube, "weft-job")
        assert _admitted_usage(kube, "weft-job") == plain_usage, "Kueue books the opted-in Job as the plain one"
        assert _booked(kube, plain_usage) == plain_queue
        [p] = _pods(kube, "weft-job")
        doc = kube.agent_status(ORIGIN)
        sandbox = next(s["id"] for s in doc["sandboxes"] if s["name"] == p["metadata"]["name"])
        placed = {x["name"]: x for x in doc["placements"] if x["sandbox_id"] == sandbox}
        assert placed["prep"]["placement"] == f"remote:{HOST}" and placed["model"]["reason"] == "gpu-leased"
        [r] = wait_for(lambda: _reservations(kube), timeout=60, what="the stage's reservation pod")
        assert r["spec"]["nodeName"] == HOST
        workloads = json.loads(kube.kubectl("get", "workloads.kueue.x-k8s.io", "-A", "-o", "json").stdout)["items"]
        assert {w["metadata"]["namespace"] for w in workloads} == {"default"}, "a reservation pod is no workload"
        fixture.report(request.config, f"kueue: job created to its CPU stage running, opted in "
                                       f"{weft_s:.1f} s vs not opted in {plain_s:.1f} s ({weft_s / plain_s:.2f}x)",
                       figures={"admission": {"opted in s": weft_s, "not opted in s": plain_s,
                                              "booked as without weft": True}})
    finally:
        _delete_jobs(kube, "plain-job", "weft-job")


def test_kueue_preempting_an_opted_in_job_stops_its_shadow_before_the_preemptor_starts(
        kube: KubeCluster, request: pytest.FixtureRequest) -> None:
    samples = {"overlap": 0, "taken": 0}
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.05):
            shadow = bool(_shadows(kube))
            preemptor = any(c.labels.get("io.kubernetes.container.name") == "model" and c.state == CONTAINER_RUNNING
                            and c.labels.get("io.kubernetes.pod.name", "").startswith("urgent-")
                            for c in kube.containers(ORIGIN))
            samples["taken"] += 1
            samples["overlap"] += shadow and preemptor

    try:
        apply(kube, _job("batch", opted_in=True, gpus=GPUS))
        _until_prep_runs(kube, "batch")
        wait_for(lambda: _shadows(kube), timeout=30, what="the batch job's shadow on the host")
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        apply(kube, _job("urgent", opted_in=False, gpus=GPUS, priority="high"))
        wait_for(lambda: any(_running(p, "model") for p in _pods(kube, "urgent")), timeout=180,
                 what="the preemptor running", every=0.1)
        took = time.monotonic() - t0
        stop.set()
        sampler.join(10)
        evicted = _workload(kube, "batch")["status"]["conditions"]
        assert any(c["type"] == "Evicted" and c["status"] == "True" for c in evicted), evicted
        assert not _shadows(kube), "the preempted job's shadow is gone"
        assert samples["taken"] > 0 and samples["overlap"] == 0, samples
        fixture.report(request.config, f"kueue preemption: {samples['overlap']} of {samples['taken']} "
                                       f"samples with the shadow and the preemptor running; preemptor ran "
                                       f"{took:.1f} s after it was queued",
                       figures={"preemption": {"samples": samples["taken"], "samples overlapping": samples["overlap"],
                                               "preemptor running after s": took}})
    finally:
        stop.set()
        _delete_jobs(kube, "batch", "urgent")


def test_a_job_of_parallelism_two_admitted_as_one_gang_runs_both_pods_rerouted(
        kube: KubeCluster, request: pytest.FixtureRequest) -> None:
    try:
        apply(kube, _job("gang", opted_in=True, parallelism=2))
        took = _until_prep_runs(kube, "gang", pods=2)
        [assignment] = _workload(kube, "gang")["status"]["admission"]["podSetAssignments"]
        assert assignment["count"] == 2, "one workload for both pods"
        remote = [x for x in kube.agent_status(ORIGIN)["placements"] if x["name"] == "prep"
                  and x["placement"] == f"remote:{HOST}"]
        assert len(remote) == 2, kube.agent_status(ORIGIN)["placements"]
        wait_for(lambda: len(_reservations(kube)) == 2, timeout=60, what="two reservation pods")
        assert len(_shadows(kube)) == 2
        fixture.report(request.config, f"kueue gang: a Job of parallelism 2 admitted as one workload, both CPU "
                                       f"stages rerouted and running {took:.1f} s after its creation",
                       figures={"gang": {"pods": 2, "workloads": 1, "both stages running after s": took}})
    finally:
        _delete_jobs(kube, "gang")
