"""The ``weft status`` and ``weft explain`` documents: the keys the CLI and users rely on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.core.leases import LeaseState
from shim.state.agent import AgentStore, PlacementRecord, SandboxRecord
from shim.state.leases import LeaseRecord
from shim.state.report import explain, lease_from_record, status

U0 = "GPU-00000000-0000-4000-8000-000000000000"
CID = "c" * 64
SB = SandboxRecord("sb" + "0" * 62, "web", "shop", "uid-1", "weft", True, {}, 1.0)
GPU_PLACEMENT = PlacementRecord(
    key=f"{SB.id}/app/0", container_id=None, sandbox_id=SB.id, name="app", attempt=0, stage="gpu",
    stage_reason="gpu-device", stage_detail="device /dev/nvidia0", placement="local", reason="gpu-leased",
    detail="GPU stage runs on this node's leased GPUs", lease_id="lease-1", state="pending", created_at=2.0,
)
CPU_PLACEMENT = PlacementRecord(
    key=f"{SB.id}/side/0", container_id=None, sandbox_id=SB.id, name="side", attempt=0, stage="cpu",
    stage_reason="no-gpu-request", stage_detail="nothing", placement="local", reason="no-mesh",
    detail="no peer mesh", lease_id="", state="pending", created_at=3.0,
)
LEASE = LeaseRecord(
    lease_id="lease-1", key=GPU_PLACEMENT.key, namespace="shop", pod="web", pod_uid="uid-1", container="app",
    sandbox_id=SB.id, device_uuids=(U0,), device_indices=(0,), memory_bytes=20 * 2**30, compute_percent=50,
    shared=True, state=LeaseState.BOUND, container_id=CID, pid=9, cgroup="/x", reason="best-fit",
    detail="fits on GPU-0",
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[AgentStore]:
    s = AgentStore(tmp_path)
    s.add_sandbox(SB)
    s.add_pending(GPU_PLACEMENT)
    s.mark_created(GPU_PLACEMENT.key, CID)
    s.add_pending(CPU_PLACEMENT)
    s.mark_created(CPU_PLACEMENT.key, "d" * 64)
    yield s
    s.close()


def test_status_has_the_contract_keys(store: AgentStore) -> None:
    doc = status(store, [lease_from_record(LEASE)])
    assert {"sandboxes", "placements", "leases"} <= set(doc)
    [sandbox] = doc["sandboxes"]
    assert {"id": SB.id, "opted_in": True}.items() <= sandbox.items()
    assert [p["container_id"] for p in doc["placements"]] == [CID, "d" * 64]
    gpu = doc["placements"][0]
    assert {"container_id": CID, "name": "app", "stage": "gpu", "placement": "local",
            "reason": "gpu-leased"}.items() <= gpu.items()
    [lease] = doc["leases"]
    assert {"lease_id": "lease-1", "container_id": CID, "devices": [U0], "memory_bytes": 20 * 2**30,
            "compute_percent": 50, "state": "bound"}.items() <= lease.items()


def test_status_without_a_broker_lists_no_leases(store: AgentStore) -> None:
    assert status(store, None)["leases"] == []


def test_status_of_an_empty_store(tmp_path: Path) -> None:
    s = AgentStore(tmp_path / "empty")
    try:
        assert status(s, None) == {"sandboxes": [], "placements": [], "leases": []}
    finally:
        s.close()


def test_explain_says_why_and_carries_the_lease(store: AgentStore) -> None:
    doc = explain(store, CID[:12], [lease_from_record(LEASE)])
    assert doc is not None
    assert (doc["container_id"], doc["pod"], doc["namespace"], doc["name"]) == (CID, "web", "shop", "app")
    assert doc["lease"]["lease_id"] == "lease-1"
    why = "\n".join(doc["why"])
    for fact in ("shop/web", "stage gpu", "gpu-device", "placement local", "gpu-leased", "lease-1", U0, "best-fit"):
        assert fact in why


def test_explain_of_a_cpu_container_has_no_lease(store: AgentStore) -> None:
    doc = explain(store, "d" * 64, [lease_from_record(LEASE)])
    assert doc is not None
    assert doc["lease"] is None
    assert len(doc["why"]) == 3
    assert "no-mesh" in doc["why"][2]


def test_explain_when_the_broker_no_longer_has_the_lease(store: AgentStore) -> None:
    doc = explain(store, CID, [])
    assert doc is not None and doc["lease"] is None and doc["lease_id"] == "lease-1"


def test_explain_of_an_unknown_container_is_none(store: AgentStore) -> None:
    assert explain(store, "f" * 64, None) is None
