"""Reservation pods on a real node: kube-apiserver, kube-scheduler and the host's own kubelet decide.

The host's reservation code (``shim.shadowhost.reservations``) runs here as the
host agent runs it, against a real cluster with one CPU node. What
Kubernetes does with a reservation is what the shadow beside it lives by: it
is bound and admitted within a moment, the scheduler counts its requests (a
plain pod that would fit only in that CPU waits), kubelet refuses one that
does not fit, a higher-priority pod preempts it, and a deleted or orphaned
one is noticed. Each loss reaches ``on_lost`` with Kubernetes' reason.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Iterator

import pytest

from harness import fixture
from harness.cluster import KubeCluster, NodeSpec
from harness.workloads import apply, get_pod
from shim.core.reservation import LossReason, ReservationState, Stage, Verdict, name_of
from shim.kube import access
from shim.localfabric import images
from shim.localfabric.waiting import wait_for
from shim.shadowhost.reservations import ApiUnreachable, ReservationRefused, Reservations

pytestmark = pytest.mark.slow

HOST = "cpu-1"
NS = "weft-system"


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeCluster]:
    yield from fixture.cluster(request, tmp_path_factory, [NodeSpec(HOST, "cpu")])


@pytest.fixture(scope="module")
def setup(cluster: KubeCluster) -> KubeCluster:
    apply(cluster,
          {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
          # No controller-manager here: the namespace's default account, which it would have made.
          {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": NS}},
          {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "low"}, "value": 10},
          {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": "high"},
           "value": 1000})
    return cluster


class Losses:
    def __init__(self) -> None:
        self.seen: dict[str, Verdict] = {}
        self.lock = threading.Lock()

    def __call__(self, key: str, v: Verdict) -> None:
        with self.lock:
            self.seen.setdefault(key, v)

    def of(self, key: str) -> Verdict | None:
        with self.lock:
            return self.seen.get(key)


@pytest.fixture
def reservations(setup: KubeCluster) -> Iterator[tuple[Reservations, Losses, set[str]]]:
    losses, live = Losses(), set()
    api = access.resolve(setup.control.kubeconfig("admin"))
    r = Reservations(api, HOST, NS, images.PAUSE_IMAGE, losses, lambda: set(live), grace=20.0)
    r.start()
    try:
        yield r, losses, live
    finally:
        r.stop()
        # Gone from kubelet too, not only from the API: the next test's pods must find the node's CPU free.
        for ns in (NS, "default"):
            setup.control.kubectl("delete", "pods", "-n", ns, "--all", "--grace-period=1", "--wait=true",
                                  "--timeout=90s", check=False, timeout=120)


def _stage(key: str, cpu_millis: int, priority_class: str = "low") -> Stage:
    return Stage(host=HOST, origin_node="gpu-1", namespace="default", pod="infer", container="prep", key=key,
                 cpu_millis=cpu_millis, memory_bytes=64 << 20, priority_class=priority_class)


def _node_cpu_millis(c: KubeCluster) -> int:
    node = json.loads(c.control.kubectl("get", "node", HOST, "-o", "json").stdout)
    cpu = node["status"]["allocatable"]["cpu"]
    return int(cpu[:-1]) if cpu.endswith("m") else int(cpu) * 1000


def _plain(name: str, cpu_millis: int, priority_class: str = "low") -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "default"},
            "spec": {"priorityClassName": priority_class, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": images.BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"],
                                     "resources": {"requests": {"cpu": f"{cpu_millis}m"}}}]}}


def _reservation(c: KubeCluster, key: str) -> dict | None:
    res = c.control.kubectl("get", "pod", "-n", NS, name_of(key), "-o", "json", check=False)
    return json.loads(res.stdout) if res.returncode == 0 else None


def test_a_reservation_is_admitted_at_once_and_the_scheduler_counts_it(
        setup: KubeCluster, reservations, request: pytest.FixtureRequest) -> None:
    r, losses, live = reservations
    free = _node_cpu_millis(setup)
    live.add("sb/prep/0")
    began = time.monotonic()
    r.reserve(_stage("sb/prep/0", free - 200))
    wait_for(lambda: (r.state("sb/prep/0") or {}).get("state") == ReservationState.ADMITTED.value, timeout=60,
             what="the reservation admitted")
    fixture.report(request.config, f"reservation admitted {time.monotonic() - began:.2f} s after it was made")
    pod = _reservation(setup, "sb/prep/0")
    assert pod["spec"]["nodeName"] == HOST and pod["metadata"]["labels"]["weft.io/role"] == "hosted-stage"
    # A plain pod that fits only in the CPU the stage holds waits, for lack of CPU.
    apply(setup, _plain("squeezer", 500))
    wait_for(lambda: any(c.get("reason") == "Unschedulable" and "Insufficient cpu" in c.get("message", "")
                         for c in get_pod(setup, "squeezer").get("status", {}).get("conditions", [])),
             timeout=60, what="the plain pod unschedulable for lack of CPU")
    live.discard("sb/prep/0")
    r.release("sb/prep/0")  # the stage is done
    wait_for(lambda: get_pod(setup, "squeezer").get("status", {}).get("phase") == "Running", timeout=90,
             what="the plain pod running once the stage's CPU is free")
    assert losses.of("sb/prep/0") is None


def test_kubelet_refusing_it_stops_the_shadow_with_that_reason(setup: KubeCluster, reservations) -> None:
    r, losses, live = reservations
    live.add("sb/big/0")
    r.reserve(_stage("sb/big/0", _node_cpu_millis(setup) + 4000))  # more than the node has: kubelet says no
    v = wait_for(lambda: losses.of("sb/big/0"), timeout=60, what="the refusal")
    assert v.reason is LossReason.REFUSED and "OutOfcpu" in v.detail


def test_a_higher_priority_pod_preempts_it_and_the_shadow_stops_first(setup: KubeCluster, reservations) -> None:
    r, losses, live = reservations
    free = _node_cpu_millis(setup)
    live.add("sb/low/0")
    r.reserve(_stage("sb/low/0", free - 200, "low"))
    wait_for(lambda: (r.state("sb/low/0") or {}).get("state") == ReservationState.ADMITTED.value, timeout=60,
             what="the reservation admitted")
    apply(setup, _plain("important", 500, "high"))
    v = wait_for(lambda: losses.of("sb/low/0"), timeout=90, what="the preemption")
    assert v.reason in (LossReason.PREEMPTED, LossReason.DELETED)
    try:
        wait_for(lambda: get_pod(setup, "important").get("status", {}).get("phase") == "Running", timeout=90,
                 what="the preemptor running")
    except AssertionError as exc:
        described = setup.control.kubectl("describe", "pod", "important", check=False).stdout[-2500:]
        pods = setup.control.kubectl("get", "pods", "-A", "-o", "wide", check=False).stdout
        kubelet = [line for line in setup.kubelets[HOST].log_path.read_text(errors="replace").splitlines()
                   if "important" in line][-30:]
        agent = [line for line in setup.agents[HOST].log_path.read_text(errors="replace").splitlines()
                 if "StartContainer" in line or "important" in line][-15:]
        raise AssertionError("\n".join([str(exc), pods, described, "kubelet:", *kubelet, "agent:", *agent])) from None


def test_a_deleted_reservation_stops_its_shadow(setup: KubeCluster, reservations) -> None:
    r, losses, live = reservations
    live.add("sb/del/0")
    r.reserve(_stage("sb/del/0", 100))
    wait_for(lambda: _reservation(setup, "sb/del/0"), timeout=30, what="the reservation")
    setup.control.kubectl("delete", "pod", "-n", NS, name_of("sb/del/0"), "--grace-period=0", "--force")
    v = wait_for(lambda: losses.of("sb/del/0"), timeout=30, what="the loss")
    assert v.reason is LossReason.DELETED


def test_a_reservation_without_its_shadow_is_deleted(setup: KubeCluster, reservations) -> None:
    r, losses, _live = reservations
    r.reserve(_stage("sb/orphan/0", 100))  # its shadow never ran (or is gone): not among the live keys
    wait_for(lambda: _reservation(setup, "sb/orphan/0") is None, timeout=30, what="the orphan deleted")
    assert losses.of("sb/orphan/0") is None


def test_the_api_refusing_a_reservation_is_a_clear_error(setup: KubeCluster, reservations) -> None:
    r, _, _ = reservations
    with pytest.raises(ReservationRefused, match="no-such-class"):
        r.reserve(_stage("sb/bad/0", 100, "no-such-class"))
    assert r.state("sb/bad/0") is None


def test_a_peer_reserves_only_for_pods_bound_to_itself(setup: KubeCluster, reservations) -> None:
    r, _, _ = reservations
    apply(setup, {**_plain("someone-elses", 10), "spec": {**_plain("x", 10)["spec"], "nodeName": HOST}})
    with pytest.raises(ReservationRefused, match="not bound to gpu-1"):
        r.origin_pod("gpu-1", "default", "someone-elses", "c")
    assert r.origin_pod(HOST, "default", "someone-elses", "c").priority_class == "low"


def test_without_the_api_shadows_run_on_and_new_ones_are_reserved_once_it_is_back(
        setup: KubeCluster, reservations) -> None:
    r, losses, live = reservations
    # The origin's pod, bound to the origin: here the one node (a pod on a node without a kubelet would outlive
    # the test), so the stages below name it as their origin.
    apply(setup, {**_plain("infer", 10), "spec": {**_plain("x", 10)["spec"], "nodeName": HOST}})

    def stage(key: str) -> Stage:
        return dataclasses.replace(_stage(key, 100), origin_node=HOST)

    live.add("sb/kept/0")
    r.reserve(stage("sb/kept/0"))
    wait_for(lambda: (r.state("sb/kept/0") or {}).get("state") == ReservationState.ADMITTED.value, timeout=60,
             what="the first reservation admitted")
    setup.control.stop_apiserver()
    try:
        with pytest.raises(ApiUnreachable, match="did not answer"):
            r.origin_pod(HOST, "default", "infer", "prep")
        # A shadow made now runs as before reservations, and says so.
        live.add("sb/new/0")
        r.defer(stage("sb/new/0"), "the test's API server is stopped")
        assert r.state("sb/new/0") == {"name": name_of("sb/new/0"), "state": "unreserved", "reason": "ApiUnreachable"}
        with pytest.raises(ApiUnreachable):
            r.reserve(stage("sb/late/0"))  # the API went away between the check and the reservation
        live.add("sb/late/0")
        assert r.state("sb/late/0")["state"] == "unreserved"
        # Past the grace and several reconciliations, nothing running is judged without the API.
        time.sleep(r.grace + 2 * 5.0)
        assert losses.of("sb/kept/0") is None and losses.of("sb/new/0") is None
    finally:
        setup.control.start_apiserver()
    for key in ("sb/new/0", "sb/late/0"):
        wait_for(lambda k=key: (r.state(k) or {}).get("state") == ReservationState.ADMITTED.value, timeout=60,
                 what=f"{key}'s reservation made and admitted once the API is back")
        assert _reservation(setup, key)["spec"]["priorityClassName"] == "low"
    assert r.state("sb/kept/0")["state"] == "admitted" and not losses.seen
