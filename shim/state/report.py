"""The status and explain documents, built the same way from any source.

``weft status`` prints one JSON object with ``sandboxes``, ``placements`` and
``leases``; ``weft explain`` one object for one container. The agent builds
them for its admin calls, and ``weft status --state-dir`` builds them from the
state files directly, so both ways show the same thing.
"""

from __future__ import annotations

from typing import Any

from shim.state.agent import AgentStore, PlacementRecord
from shim.state.leases import LeaseRecord


def lease_from_record(rec: LeaseRecord) -> dict[str, Any]:
    return {
        "lease_id": rec.lease_id, "container_id": rec.container_id, "devices": list(rec.device_uuids),
        "memory_bytes": rec.memory_bytes, "compute_percent": rec.compute_percent, "state": rec.state.value,
        "shared": rec.shared, "pod": rec.pod, "namespace": rec.namespace, "container": rec.container,
        "reason": rec.reason, "detail": rec.detail,
    }


def lease_from_pb(lease: Any) -> dict[str, Any]:
    return {
        "lease_id": lease.lease_id, "container_id": lease.container_id, "devices": list(lease.device_uuids),
        "memory_bytes": lease.memory_bytes, "compute_percent": lease.compute_percent, "state": lease.state,
        "shared": lease.shared, "pod": lease.pod, "namespace": lease.namespace, "container": lease.container,
        "reason": lease.reason, "detail": lease.detail,
    }


def _placement(p: PlacementRecord) -> dict[str, Any]:
    return {
        "container_id": p.container_id, "name": p.name, "sandbox_id": p.sandbox_id, "attempt": p.attempt,
        "stage": p.stage, "stage_reason": p.stage_reason, "stage_detail": p.stage_detail,
        "placement": p.placement, "reason": p.reason, "detail": p.detail, "lease_id": p.lease_id or None,
        "state": p.state.value,
    }


def status(store: AgentStore, leases: list[dict[str, Any]] | None) -> dict[str, Any]:
    placements = store.placements()
    if leases is None:  # no broker to ask: what the placements say they hold
        leases = []
    return {
        "sandboxes": [{"id": s.id, "opted_in": s.opted_in, "name": s.name, "namespace": s.namespace,
                       "runtime_handler": s.runtime_handler} for s in store.sandboxes()],
        "placements": [_placement(p) for p in placements],
        "leases": leases,
    }


def explain(store: AgentStore, container_id: str, leases: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    p = store.placement(container_id)
    if p is None:
        return None
    sandbox = store.sandbox(p.sandbox_id)
    lease = next((lease for lease in leases or [] if lease["lease_id"] == p.lease_id), None) if p.lease_id else None
    why = [f"pod {sandbox.namespace}/{sandbox.name} opted in (runtime handler {sandbox.runtime_handler})"
           if sandbox else "pod opted in",
           f"stage {p.stage}: {p.stage_reason} ({p.stage_detail})",
           f"placement {p.placement}: {p.reason} ({p.detail})"]
    if lease:
        why.append(f"lease {lease['lease_id']} on {', '.join(lease['devices'])}: {lease['reason']} ({lease['detail']})")
    return {**_placement(p), "pod": sandbox.name if sandbox else None,
            "namespace": sandbox.namespace if sandbox else None, "lease": lease, "why": why}
