"""Reservation pods: what makes a hosted stage visible to Kubernetes on its host (pure).

A host that runs a shadow creates a Pod in weft's own namespace, bound to
itself (``spec.nodeName``), with one pause container whose requests are what
the stage was admitted by and the origin pod's priority. The scheduler counts
it like any pod, kubelet admits or refuses it, preemption and eviction apply
to it, and kubectl and cost tools see it (``weft.io/role=hosted-stage`` and the
``weft.io/origin-*`` labels). It runs nothing and may do nothing: no volumes,
no token, non-root, read-only, no capabilities, ``RuntimeDefault`` seccomp (the
``restricted`` Pod Security Standard, but for its ``preStop`` hook's ``host``,
the host's agent, which baseline forbids from v1.34: weft's namespace is
privileged).

The shadow lives only as long as its reservation::

    (none) --created--> PENDING --admitted--> ADMITTED
                          |                     |
                          +--refused/lost--> LOST <--lost (deleted, evicted, preempted)--+

A shadow whose reservation is LOST stops at once; one that stays PENDING past
the grace stops too. A shadow made while the API server was unreachable runs
by the rules from before reservations (the lowest CPU weight) as UNRESERVED,
and gets its reservation, PENDING, once the API answers again. This module builds the Pod and reads a Pod's state; the
host's reservation code does the API calls.
"""

from __future__ import annotations

import enum
import hashlib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

ROLE_LABEL = "weft.io/role"
ROLE = "hosted-stage"
ORIGIN_NODE_LABEL = "weft.io/origin-node"
ORIGIN_NAMESPACE_LABEL = "weft.io/origin-namespace"
ORIGIN_POD_LABEL = "weft.io/origin-pod"
ORIGIN_CONTAINER_LABEL = "weft.io/origin-container"
KEY_LABEL = "weft.io/origin-key"  # the shadow's key, as the host labels the shadow (a digest)
NAME_PREFIX = "weft-hosted-"
# kubelet's own reasons for refusing a pod at admission (pod status reason).
_REFUSED = re.compile(r"^Out[Oo]f|^UnexpectedAdmissionError$|^NodeAffinity$|^NodeName$|^Taint")


class ReservationState(enum.Enum):
    UNRESERVED = "unreserved"  # the shadow was made while the API was unreachable: made once it is back
    PENDING = "pending"  # created; kubelet has not admitted it yet
    ADMITTED = "admitted"  # kubelet runs it: the scheduler counts it, the stage holds its CPU
    LOST = "lost"  # refused at admission, deleted, evicted or preempted: the shadow must stop


class LossReason(enum.Enum):
    REFUSED = "ReservationRefused"  # kubelet refused it at admission (OutOfcpu, OutOfmemory, ...)
    EVICTED = "ReservationEvicted"  # kubelet's eviction manager, or the API's eviction
    PREEMPTED = "ReservationPreempted"  # the scheduler made room for a higher-priority pod
    DELETED = "ReservationDeleted"  # deleted by someone
    NOT_ADMITTED = "ReservationNotAdmitted"  # still not admitted after the grace
    REJECTED = "ReservationRejected"  # the API server would not create it (quota, webhook, Pod Security)


@dataclass(frozen=True)
class Verdict:
    state: ReservationState
    reason: LossReason | None = None
    detail: str = ""


@dataclass(frozen=True)
class Stage:
    """What a hosted stage is, as the reservation records it."""

    host: str
    origin_node: str
    namespace: str  # the origin pod's
    pod: str
    container: str
    key: str  # the shadow's key on the host
    cpu_millis: int
    memory_bytes: int
    # The origin pod's PriorityClass (its priority comes with it). Never a bare priority value: the API's
    # Priority admission refuses one, and sets the class (or the global default's) on every pod anyway.
    priority_class: str = ""


def _digest(value: str, n: int) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:n]


def name_of(key: str) -> str:
    """The reservation's name: one per shadow key, stable across retries (a second create conflicts)."""
    return f"{NAME_PREFIX}{_digest(key, 20)}"


_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def label_value(value: str) -> str:
    """``value`` if it is a valid label value, else a shortened one with a digest that keeps it unique."""
    if len(value) <= 63 and _LABEL_VALUE.match(value):
        return value
    head = re.sub(r"[^-A-Za-z0-9_.]", "-", value)[:50].strip("-_.")
    return f"{head}-{_digest(value, 10)}".lstrip("-_.")


def labels_of(stage: Stage) -> dict[str, str]:
    return {ROLE_LABEL: ROLE, ORIGIN_NODE_LABEL: label_value(stage.origin_node),
            ORIGIN_NAMESPACE_LABEL: label_value(stage.namespace), ORIGIN_POD_LABEL: label_value(stage.pod),
            ORIGIN_CONTAINER_LABEL: label_value(stage.container), KEY_LABEL: _digest(stage.key, 40)}


STOP_TOKEN_HEADER = "X-Weft-Stop-Token"


@dataclass(frozen=True)
class StopHook:
    """Where kubelet asks the host's agent to stop the shadow before it ends the reservation's container."""

    host: str  # the agent's HTTP endpoint, as kubelet reaches it (kubelet runs in the host's network)
    port: int
    token: str  # this reservation's own (the host's HMAC of its name): nobody else stops its shadow
    grace_s: int  # how long kubelet waits for the answer (the pod's termination grace)


def stop_path(name: str) -> str:
    return f"/reservations/{name}/stop"


def pod_manifest(stage: Stage, *, namespace: str, pause_image: str,
                 stop_hook: StopHook | None = None, node_uid: str = "") -> dict[str, Any]:
    """The reservation Pod, as JSON for the API: bound to the host, the stage's requests, the origin's priority.

    With ``node_uid`` (the host's Node), the Node is the pod's controller: `kubectl drain` evicts pods that
    have one and refuses, without ``--force``, those that have none; and the pod goes with its Node.

    With ``stop_hook``, the container's ``preStop`` asks the host's agent to stop the shadow, and kubelet ends
    the container (and Kubernetes lets the pod's CPU go) only once it has answered: whatever removes the
    reservation (preemption, eviction, deletion, a drain), the stage's CPU is never counted free while its
    shadow still runs. Without one, the pod ends at once and the host stops the shadow when it sees it go.
    """
    requests = {"cpu": f"{max(stage.cpu_millis, 1)}m", "memory": str(max(stage.memory_bytes, 1))}
    spec: dict[str, Any] = {
        "nodeName": stage.host,
        "restartPolicy": "Always",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 0,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65535, "runAsGroup": 65535,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "reserve",
            "image": pause_image,
            "imagePullPolicy": "IfNotPresent",
            "resources": {"requests": requests},
            "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}},
        }],
    }
    if stop_hook is not None:
        spec["terminationGracePeriodSeconds"] = max(1, stop_hook.grace_s)
        spec["containers"][0]["lifecycle"] = {"preStop": {"httpGet": {
            "host": stop_hook.host, "port": stop_hook.port, "path": stop_path(name_of(stage.key)),
            "scheme": "HTTP", "httpHeaders": [{"name": STOP_TOKEN_HEADER, "value": stop_hook.token}]}}}
    if stage.priority_class:
        spec["priorityClassName"] = stage.priority_class
    metadata: dict[str, Any] = {
        "name": name_of(stage.key), "namespace": namespace, "labels": labels_of(stage),
        # The exact origin, where a label had to be shortened.
        "annotations": {"weft.io/origin": f"{stage.namespace}/{stage.pod}/{stage.container}",
                        "weft.io/origin-key-full": stage.key},
    }
    if node_uid:
        metadata["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": stage.host, "uid": node_uid,
                                        "controller": True}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


_DISRUPTION = {"PreemptionByScheduler": LossReason.PREEMPTED, "EvictionByEvictionAPI": LossReason.EVICTED,
               "TerminationByKubelet": LossReason.EVICTED, "DeletionByTaintManager": LossReason.EVICTED}


def verdict(pod: Mapping[str, Any] | None, *, deleted: bool = False) -> Verdict:
    """A reservation Pod's state from what the API shows of it (its last state when ``deleted``); None: gone."""
    if pod is None:
        return Verdict(ReservationState.LOST, LossReason.DELETED, "the reservation pod is gone")
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    phase, reason, message = status.get("phase", ""), status.get("reason", "") or "", status.get("message", "")
    if phase == "Failed":
        if reason == "Evicted":
            return Verdict(ReservationState.LOST, LossReason.EVICTED, message or "evicted")
        if _REFUSED.match(reason):
            return Verdict(ReservationState.LOST, LossReason.REFUSED, f"{reason}: {message}".strip(": "))
    if deleted or meta.get("deletionTimestamp") or phase in ("Failed", "Succeeded"):
        for c in status.get("conditions") or []:
            if c.get("type") == "DisruptionTarget" and c.get("reason") in _DISRUPTION:
                return Verdict(ReservationState.LOST, _DISRUPTION[c["reason"]],
                               c.get("message") or message or c["reason"])
        if phase in ("Failed", "Succeeded") and not (deleted or meta.get("deletionTimestamp")):
            return Verdict(ReservationState.LOST, LossReason.DELETED, f"it ended: {phase} {reason}".strip())
        return Verdict(ReservationState.LOST, LossReason.DELETED, "the reservation pod was deleted")
    if phase == "Running":
        return Verdict(ReservationState.ADMITTED)
    return Verdict(ReservationState.PENDING, detail=reason or phase or "created")


def cpu_shares(cpu_millis: int) -> int:
    """The CPU weight kubelet gives a container of this request (cgroup v1 shares), at least 2."""
    return max(2, cpu_millis * 1024 // 1000)


# cpu.shares bounds (the kernel's, as kubelet uses them for its QoS cgroups).
MIN_SHARES, MAX_SHARES = 2, 262144


def group_shares(shares: Iterable[int]) -> int:
    """The weight of the cgroup every shadow of a host sits in: the sum of the shadows' own.

    That group is a sibling of kubelet's pods cgroup, so its weight, not each shadow's, is what the host's own
    pods compete with; kubelet sizes its QoS cgroups the same way (the sum of their pods' requests).
    """
    return min(MAX_SHARES, max(MIN_SHARES, sum(shares)))


def weight_of_shares(shares: int) -> int:
    """cgroup v2 ``cpu.weight`` for a cgroup v1 ``cpu.shares``, converted as runc converts a container's."""
    shares = min(MAX_SHARES, max(MIN_SHARES, shares))
    return 1 + ((shares - 2) * 9999) // 262142
