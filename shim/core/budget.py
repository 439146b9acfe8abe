"""A workload's PodDisruptionBudget, kept for its hosted stages' reservations (pure).

Evicting a reservation (``kubectl drain`` of a CPU host) stops its stage, and
kubelet on the GPU node restarts that container: a disruption of the workload
pod. The Eviction API consults only budgets in the evicted pod's own namespace,
and reservations live in weft's, so a host keeps there, for each workload
budget that covers pods with stages on it, a *stage budget*: a
PodDisruptionBudget selecting exactly those reservations (by their key label),
with ``minAvailable`` set so that the disruption controller allows no more
evictions among them than the workload budget allows now. A reservation is
covered by one stage budget at most (the Eviction API refuses a pod that two
budgets select), that of the strictest workload budget selecting its pod.

Counted in reservations, not pods, it is stricter than the workload budget
where one pod has several stages on the host. A reservation being evicted
stays selected until it is gone, so the disruption just allowed is counted
before the workload budget sees it. It follows the workload budget at the
host's reconciliation, so an allowance that just fell to 0 is seen within one
round; and each host keeps its own stage budgets, so hosts drained at the same
moment may together take more than the allowance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shim.core.reservation import KEY_LABEL, ROLE_LABEL

BUDGET_ROLE = "stage-budget"
HOST_LABEL = "weft.io/host"
BUDGET_OF_ANNOTATION = "weft.io/budget-of"
NAME_PREFIX = "weft-stages-"


class SelectorError(ValueError):
    """A label selector with an operator that policy/v1 does not have."""


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """Whether a LabelSelector selects a pod with ``labels``. A budget without a selector selects no pod
    (policy/v1); an empty one, every pod of its namespace."""
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key", ""), expr.get("operator", ""), expr.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            raise SelectorError(f"matchExpressions: operator {op!r} on {key!r} is not In, NotIn, Exists or "
                                "DoesNotExist")
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class WorkloadBudget:
    namespace: str
    name: str
    allowed: int  # its status.disruptionsAllowed
    selector: Mapping[str, Any] | None


@dataclass(frozen=True)
class HostedReservation:
    key_label: str  # the reservation's KEY_LABEL value
    namespace: str  # the origin pod's
    pod: str
    pod_labels: Mapping[str, str]


@dataclass(frozen=True)
class StageBudget:
    name: str
    of: str  # namespace/name of the workload budget
    keys: tuple[str, ...]  # KEY_LABEL values it selects, sorted
    min_available: int


def _selects(b: WorkloadBudget, labels: Mapping[str, str]) -> bool:
    try:
        return selects(b.selector, labels)
    except SelectorError:  # the API server validates selectors: not to be met; such a budget covers nothing
        return False


def budget_name(host: str, namespace: str, name: str) -> str:
    digest = hashlib.sha256(f"{host}\n{namespace}\n{name}".encode()).hexdigest()[:20]
    return f"{NAME_PREFIX}{digest}"


def plan(host: str, reservations: Iterable[HostedReservation],
         budgets: Iterable[WorkloadBudget]) -> dict[str, StageBudget]:
    """The stage budgets ``host`` should keep, by name."""
    by_ns: dict[str, list[WorkloadBudget]] = {}
    for b in budgets:
        by_ns.setdefault(b.namespace, []).append(b)
    keys: dict[tuple[str, str], list[str]] = {}
    allowed: dict[tuple[str, str], int] = {}
    for r in reservations:
        covering = [b for b in by_ns.get(r.namespace, ()) if _selects(b, r.pod_labels)]
        if not covering:
            continue
        strictest = min(covering, key=lambda b: (b.allowed, b.name))
        at = (strictest.namespace, strictest.name)
        keys.setdefault(at, []).append(r.key_label)
        allowed[at] = strictest.allowed
    out = {}
    for (ns, name), ks in keys.items():
        sb = StageBudget(budget_name(host, ns, name), f"{ns}/{name}", tuple(sorted(set(ks))),
                         max(0, len(set(ks)) - max(0, allowed[(ns, name)])))
        out[sb.name] = sb
    return out


def spec_of(sb: StageBudget) -> dict[str, Any]:
    return {"minAvailable": sb.min_available,
            "selector": {"matchExpressions": [{"key": KEY_LABEL, "operator": "In", "values": list(sb.keys)}]}}


def owned_by_node(host: str, node_uid: str) -> list[dict[str, Any]]:
    """The ownerReferences that make a stage budget go with the host's Node."""
    return [{"apiVersion": "v1", "kind": "Node", "name": host, "uid": node_uid}]


def manifest(sb: StageBudget, *, host: str, host_label: str, namespace: str, node_uid: str = "") -> dict[str, Any]:
    """The stage budget as JSON for the API; owned by the host's Node where its UID is known (it goes with
    the Node)."""
    metadata: dict[str, Any] = {
        "name": sb.name, "namespace": namespace,
        "labels": {ROLE_LABEL: BUDGET_ROLE, HOST_LABEL: host_label, "app.kubernetes.io/name": "weft"},
        "annotations": {BUDGET_OF_ANNOTATION: sb.of},
    }
    if node_uid:
        metadata["ownerReferences"] = owned_by_node(host, node_uid)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": metadata, "spec": spec_of(sb)}
