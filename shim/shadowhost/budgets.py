"""A host's stage budgets: each workload PodDisruptionBudget, kept in weft's namespace for its reservations.

What they are and why: ``shim.core.budget``. At each reconciliation the host
reads the PodDisruptionBudgets of the namespaces its reservations' origin pods
live in, the labels of those pods (kept for ``LABELS_TTL_S``: a budget selects
by labels that rarely change on a running pod), and writes the stage budgets it
should have, removing those it should not. A round that cannot read or write
leaves what is there and says so once per distinct error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import httpx2
import lightkube
from lightkube.resources.core_v1 import Pod
from lightkube.resources.policy_v1 import PodDisruptionBudget
from lightkube.types import PatchType

from shim import log
from shim.core.budget import (
    BUDGET_ROLE,
    HOST_LABEL,
    HostedReservation,
    StageBudget,
    WorkloadBudget,
    manifest,
    owned_by_node,
    plan,
    spec_of,
)
from shim.core.reservation import KEY_LABEL, ROLE_LABEL, label_value

_log = log.get("weft.reservations")
LABELS_TTL_S = 60.0


class StageBudgets:
    def __init__(self, client: Callable[[], lightkube.Client], node: str, namespace: str) -> None:
        self.client, self.node, self.namespace = client, node, namespace
        self._labels: dict[tuple[str, str], tuple[float, dict[str, str] | None]] = {}
        self._said = ""  # the last error said, so a lasting one is not said every round
        self._none = False  # this host has no stage budget on the API: a host with none to keep asks nothing

    def sync(self, reservations: Iterable[Any], node_uid: str = "") -> None:
        """Make the stage budgets match ``reservations`` (this host's reservation Pods, as listed)."""
        try:
            self._sync(list(reservations), node_uid)
        except lightkube.ApiError as exc:
            self._say(f"{exc.status.code} {exc.status.message}")
        except httpx2.TransportError as exc:
            self._say(f"the API server did not answer ({exc!r})")
        else:
            self._said = ""

    def _say(self, error: str) -> None:
        if error != self._said:
            _log.warning("budget.sync_failed", node=self.node, error=error)
            self._said = error

    def _sync(self, pods: list[Any], node_uid: str) -> None:
        hosted, origins = [], set()
        for p in pods:
            meta = p.metadata
            if meta is None:
                continue
            # One being evicted stays selected until it is gone: it is the disruption the stage budget has
            # just allowed, which the workload's budget may not count yet.
            ns, _, rest = (meta.annotations or {}).get("weft.io/origin", "").partition("/")
            pod, key = rest.partition("/")[0], (meta.labels or {}).get(KEY_LABEL, "")
            if not (ns and pod and key):
                continue
            origins.add((ns, pod))
            if (labels := self._origin_labels(ns, pod)) is not None:
                hosted.append(HostedReservation(key, ns, pod, labels))
        self._labels = {k: v for k, v in self._labels.items() if k in origins}
        workload = []
        for ns in sorted({r.namespace for r in hosted}):
            for b in self.client().list(PodDisruptionBudget, namespace=ns):
                d = b.to_dict()
                workload.append(WorkloadBudget(ns, d["metadata"]["name"],
                                               int((d.get("status") or {}).get("disruptionsAllowed", 0)),
                                               (d.get("spec") or {}).get("selector")))
        want = plan(self.node, hosted, workload)
        if not want and self._none:
            return
        have = {b.metadata.name: b.to_dict() for b in self.client().list(
            PodDisruptionBudget, namespace=self.namespace,
            labels={ROLE_LABEL: BUDGET_ROLE, HOST_LABEL: label_value(self.node)})}
        # What lets go of reservations first, then what takes them: a reservation two budgets select even for
        # a moment is one the Eviction API refuses outright (an error, where a drain retries on a budget).
        for name in have.keys() - want.keys():
            try:
                self.client().delete(PodDisruptionBudget, name, namespace=self.namespace)
            except lightkube.ApiError as exc:
                if exc.status.code != 404:
                    raise
            _log.info("budget.deleted", name=name, of=(have[name]["metadata"].get("annotations") or {}).get(
                "weft.io/budget-of", ""))
        changed = [(name, sb) for name, sb in want.items()
                   if name in have and not _same(have[name], sb, node_uid)]
        for name, sb in sorted(changed, key=lambda c: not set(c[1].keys) <= _keys(have[c[0]])):
            patch: dict[str, Any] = {"spec": spec_of(sb)}
            if node_uid:
                patch["metadata"] = {"ownerReferences": owned_by_node(self.node, node_uid)}
            self.client().patch(PodDisruptionBudget, name, patch, namespace=self.namespace,
                                patch_type=PatchType.MERGE)
            _log.info("budget.updated", name=name, of=sb.of, reservations=len(sb.keys),
                      min_available=sb.min_available)
        for name, sb in want.items():
            if name not in have:
                self._create(sb, node_uid)
        self._none = not want

    def _create(self, sb: StageBudget, node_uid: str) -> None:
        body = manifest(sb, host=self.node, host_label=label_value(self.node), namespace=self.namespace,
                        node_uid=node_uid)
        try:
            self.client().create(PodDisruptionBudget.from_dict(body), namespace=self.namespace)
        except lightkube.ApiError as exc:
            if exc.status.code != 409:  # made by a round that did not hear back: the next round compares it
                raise
            return
        _log.info("budget.created", name=sb.name, of=sb.of, reservations=len(sb.keys),
                  min_available=sb.min_available)

    def _origin_labels(self, namespace: str, pod: str) -> dict[str, str] | None:
        """The origin pod's labels; None when it is gone (its reservation goes too)."""
        now = time.monotonic()
        at, labels = self._labels.get((namespace, pod), (0.0, None))
        if now - at < LABELS_TTL_S:
            return labels
        try:
            obj = self.client().get(Pod, pod, namespace=namespace)
            labels = dict((obj.metadata.labels if obj.metadata else None) or {})
        except lightkube.ApiError as exc:
            if exc.status.code != 404:
                raise
            labels = None
        self._labels[(namespace, pod)] = (now, labels)
        return labels


def _keys(budget: dict[str, Any]) -> set[str]:
    """The reservation keys the budget selects; none unless it is one ``In`` expression, as weft makes them."""
    exprs = ((budget.get("spec") or {}).get("selector") or {}).get("matchExpressions") or []
    return set(exprs[0].get("values") or []) if len(exprs) == 1 else set()


def _same(budget: dict[str, Any], sb: StageBudget, node_uid: str) -> bool:
    spec = budget.get("spec") or {}
    owned = not node_uid or any(o.get("uid") == node_uid for o in budget["metadata"].get("ownerReferences") or [])
    return spec.get("minAvailable") == sb.min_available and tuple(sorted(_keys(budget))) == sb.keys and owned
