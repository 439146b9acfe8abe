"""The broker's lease store: every field comes back as written, one lease per key."""

from __future__ import annotations

import dataclasses
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from shim.core.leases import LeaseState
from shim.state.leases import LeaseRecord, LeaseStore, replace

U0 = "GPU-00000000-0000-4000-8000-000000000000"
U1 = "GPU-00000000-0000-4000-8000-000000000001"

# Every field set to something other than its default, so a field lost on the
# way to disk and back shows up.
FULL = LeaseRecord(
    lease_id="lease-0000000000000001", key="sb/app/0", namespace="ns", pod="pod", pod_uid="uid",
    container="app", sandbox_id="sb", device_uuids=(U0, U1), device_indices=(0, 1), memory_bytes=20 * 2**30,
    compute_percent=50, shared=True, state=LeaseState.BOUND,
    env={"CUDA_MPS_PIPE_DIRECTORY": "/run/weft-mps", "NVIDIA_VISIBLE_DEVICES": f"{U0},{U1}"},
    mounts=(("/run/weft/mps/x", "/run/weft-mps", False), ("/etc/a", "/etc/b", True)),
    device_nodes=("/dev/nvidia0", "/dev/nvidiactl"), container_id="c" * 64, pid=4242, cgroup="/kubepods/pod/c",
    created_at=1700000000.5, bound_at=1700000001.25, reason="best-fit", detail="fits on GPU-0",
)
MINIMAL = LeaseRecord(
    lease_id="lease-0000000000000002", key="sb/other/0", namespace="ns", pod="pod", pod_uid="uid",
    container="other", sandbox_id="sb", device_uuids=(U0,), device_indices=(0,), memory_bytes=80 * 2**30,
    compute_percent=100, shared=False, state=LeaseState.ACQUIRED, created_at=1700000002.0,
)


def test_every_field_is_set_in_the_full_example() -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(LeaseRecord)
                if f.default is not dataclasses.MISSING}
    unset = [name for name, default in defaults.items() if getattr(FULL, name) == default]
    assert unset == []
    assert FULL.env != {}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[LeaseStore]:
    s = LeaseStore(tmp_path)
    yield s
    s.close()


@pytest.mark.parametrize("rec", [pytest.param(FULL, id="every-field-set"), pytest.param(MINIMAL, id="defaults")])
def test_round_trip(store: LeaseStore, rec: LeaseRecord) -> None:
    store.insert(rec)
    assert store.get(rec.lease_id) == rec
    assert store.by_key(rec.key) == rec
    assert store.all() == [rec]


def test_round_trip_survives_reopening(tmp_path: Path) -> None:
    s = LeaseStore(tmp_path)
    s.insert(FULL)
    s.insert(MINIMAL)
    s.close()
    again = LeaseStore(tmp_path)
    try:
        assert again.all() == [FULL, MINIMAL]
    finally:
        again.close()


def test_all_is_in_creation_order(store: LeaseStore) -> None:
    store.insert(MINIMAL)
    store.insert(FULL)
    assert [r.lease_id for r in store.all()] == [FULL.lease_id, MINIMAL.lease_id]


def test_update_replaces_every_field(store: LeaseStore) -> None:
    store.insert(MINIMAL)
    bound = replace(MINIMAL, state=LeaseState.BOUND, container_id="d" * 64, pid=7, cgroup="/x", bound_at=5.0,
                    env={"A": "b"}, mounts=(("/h", "/c", True),), device_nodes=("/dev/nvidia0",))
    store.update(bound)
    assert store.get(MINIMAL.lease_id) == bound


def test_key_is_unique(store: LeaseStore) -> None:
    store.insert(FULL)
    with pytest.raises(sqlite3.IntegrityError):
        store.insert(replace(MINIMAL, key=FULL.key))
    assert store.all() == [FULL]


@pytest.mark.parametrize(
    "lookup",
    [pytest.param(lambda s: s.get("lease-nope"), id="get"), pytest.param(lambda s: s.by_key("nope"), id="by-key")],
)
def test_unknown_lease_is_none(store: LeaseStore, lookup) -> None:
    store.insert(FULL)
    assert lookup(store) is None


def test_delete_returns_whether_there_was_a_lease(store: LeaseStore) -> None:
    store.insert(FULL)
    store.insert(MINIMAL)
    assert store.delete(FULL.lease_id) is True
    assert store.delete(FULL.lease_id) is False
    assert store.delete("lease-never") is False
    assert store.all() == [MINIMAL]
