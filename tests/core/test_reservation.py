"""Reservation pods: the Pod a host creates for a hosted stage, and what its state means for the shadow."""

from __future__ import annotations

import re

import pytest

from shim.core.reservation import (
    LossReason,
    ReservationState,
    Stage,
    StopHook,
    cpu_shares,
    label_value,
    name_of,
    pod_manifest,
    verdict,
)

STAGE = Stage(host="cpu-1", origin_node="gpu-1", namespace="ml", pod="infer-7d9f", container="prepare",
              key="sb123/prepare/0", cpu_millis=500, memory_bytes=64 << 20, priority_class="batch-high")


def test_the_pod_is_bound_to_its_host_with_the_stage_s_requests_and_the_origin_s_priority() -> None:
    pod = pod_manifest(STAGE, namespace="weft-system", pause_image="registry.k8s.io/pause:3.10")
    spec = pod["spec"]
    assert pod["metadata"]["namespace"] == "weft-system" and spec["nodeName"] == "cpu-1"
    (c,) = spec["containers"]
    assert c["resources"] == {"requests": {"cpu": "500m", "memory": str(64 << 20)}}
    assert spec["priorityClassName"] == "batch-high" and "priority" not in spec
    assert pod["metadata"]["labels"] == {
        "weft.io/role": "hosted-stage", "weft.io/origin-node": "gpu-1", "weft.io/origin-namespace": "ml",
        "weft.io/origin-pod": "infer-7d9f", "weft.io/origin-container": "prepare",
        "weft.io/origin-key": pod["metadata"]["labels"]["weft.io/origin-key"]}


def test_without_a_class_no_priority_is_set_and_the_api_s_default_applies() -> None:
    stage = Stage(**{**STAGE.__dict__, "priority_class": ""})
    spec = pod_manifest(stage, namespace="weft-system", pause_image="pause")["spec"]
    assert "priority" not in spec and "priorityClassName" not in spec


def test_it_passes_the_restricted_pod_security_standard() -> None:
    spec = pod_manifest(STAGE, namespace="weft-system", pause_image="pause")["spec"]
    (c,) = spec["containers"]
    assert spec["automountServiceAccountToken"] is False and "volumes" not in spec
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                    "capabilities": {"drop": ["ALL"]}}
    assert not any(k in spec for k in ("hostNetwork", "hostPID", "hostIPC"))


def test_with_a_stop_hook_kubelet_asks_the_host_to_stop_the_shadow_before_it_ends_the_pod() -> None:
    hook = StopHook("127.0.0.1", 9464, token="t0ken", grace_s=10)
    spec = pod_manifest(STAGE, namespace="weft-system", pause_image="pause", stop_hook=hook)["spec"]
    (c,) = spec["containers"]
    assert c["lifecycle"] == {"preStop": {"httpGet": {
        "host": "127.0.0.1", "port": 9464, "path": f"/reservations/{name_of(STAGE.key)}/stop", "scheme": "HTTP",
        "httpHeaders": [{"name": "X-Weft-Stop-Token", "value": "t0ken"}]}}}
    # kubelet waits for the hook at most the pod's grace: a host agent that hangs holds the CPU no longer.
    assert spec["terminationGracePeriodSeconds"] == 10
    # Without one the pod ends at once, as before.
    plain = pod_manifest(STAGE, namespace="weft-system", pause_image="pause")["spec"]
    assert plain["terminationGracePeriodSeconds"] == 0 and "lifecycle" not in plain["containers"][0]


def test_its_node_is_its_controller_so_kubectl_drain_evicts_it_without_force() -> None:
    pod = pod_manifest(STAGE, namespace="weft-system", pause_image="pause", node_uid="0b7e-uid")
    assert pod["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": "cpu-1",
                                                   "uid": "0b7e-uid", "controller": True}]
    # The Node not read (the API away when it was made): a bare pod, as before.
    assert "ownerReferences" not in pod_manifest(STAGE, namespace="weft-system", pause_image="pause")["metadata"]


def test_one_name_per_shadow_key_valid_for_the_api() -> None:
    assert name_of("a/b/0") == name_of("a/b/0") != name_of("a/b/1")
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name_of("x" * 300)) and len(name_of("x" * 300)) <= 63


@pytest.mark.parametrize("value", ["p" * 200, "weird name!", "-leading", "a.b_c-d"],
                         ids=["too-long", "spaces", "leading-dash", "already-valid"])
def test_label_values_are_valid_and_stay_distinct(value: str) -> None:
    got = label_value(value)
    assert len(got) <= 63 and re.fullmatch(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", got)
    assert label_value(value + "x") != got


def _pod(phase: str = "Running", reason: str = "", conditions=(), deleting: bool = False, message: str = ""):
    meta = {"name": "weft-hosted-x", **({"deletionTimestamp": "2026-12-03T10:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"phase": phase, "reason": reason, "message": message,
                                         "conditions": list(conditions)}}


@pytest.mark.parametrize(("pod", "deleted", "state", "reason"), [
    pytest.param(_pod("Pending"), False, ReservationState.PENDING, None, id="created-not-admitted-yet"),
    pytest.param(_pod("Running"), False, ReservationState.ADMITTED, None, id="running"),
    pytest.param(_pod("Failed", "OutOfcpu", message="Node didn't have enough resource: cpu"), False,
                 ReservationState.LOST, LossReason.REFUSED, id="kubelet-refused-cpu"),
    pytest.param(_pod("Failed", "OutOfmemory"), False, ReservationState.LOST, LossReason.REFUSED,
                 id="kubelet-refused-memory"),
    pytest.param(_pod("Failed", "Evicted", message="The node was low on resource: memory."), False,
                 ReservationState.LOST, LossReason.EVICTED, id="kubelet-evicted"),
    pytest.param(_pod("Running", conditions=[{"type": "DisruptionTarget", "reason": "PreemptionByScheduler"}],
                      deleting=True), False, ReservationState.LOST, LossReason.PREEMPTED, id="preempted"),
    pytest.param(_pod("Running", conditions=[{"type": "DisruptionTarget", "reason": "EvictionByEvictionAPI"}]),
                 True, ReservationState.LOST, LossReason.EVICTED, id="evicted-through-the-api"),
    pytest.param(_pod("Running", deleting=True), False, ReservationState.LOST, LossReason.DELETED,
                 id="being-deleted"),
    pytest.param(_pod("Running"), True, ReservationState.LOST, LossReason.DELETED, id="deleted"),
    pytest.param(None, False, ReservationState.LOST, LossReason.DELETED, id="gone"),
])
def test_what_a_reservation_s_state_means_for_its_shadow(pod, deleted, state, reason) -> None:
    v = verdict(pod, deleted=deleted)
    assert (v.state, v.reason) == (state, reason)
    if v.state is ReservationState.LOST:
        assert v.detail


@pytest.mark.parametrize(("millis", "shares"), [(0, 2), (1, 2), (250, 256), (1000, 1024), (3500, 3584)])
def test_cpu_weight_is_what_kubelet_gives_a_container_of_that_request(millis: int, shares: int) -> None:
    assert cpu_shares(millis) == shares
