"""The agent's store: opted-in sandboxes and their containers' placements, kept across restarts."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from shim.core.placement import PlacementState
from shim.state.agent import AgentStore, PlacementRecord, SandboxRecord

SB1 = SandboxRecord("sb1" + "0" * 61, "web", "default", "uid-1", "weft", True, {"weft.io/stage.app": "gpu"}, 1.0)
SB2 = SandboxRecord("sb2" + "0" * 61, "batch", "jobs", "uid-2", "runc", False, {}, 2.0)


def placement(sandbox: SandboxRecord, name: str, created_at: float, lease_id: str = "") -> PlacementRecord:
    return PlacementRecord(
        key=f"{sandbox.id}/{name}/0", container_id=None, sandbox_id=sandbox.id, name=name, attempt=0,
        stage="gpu" if lease_id else "cpu", stage_reason="gpu-device" if lease_id else "no-gpu-request",
        stage_detail="device /dev/nvidia0" if lease_id else "nothing", placement="local",
        reason="gpu-leased" if lease_id else "no-mesh", detail="why", lease_id=lease_id, state=PlacementState.PENDING,
        created_at=created_at,
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[AgentStore]:
    s = AgentStore(tmp_path)
    yield s
    s.close()


def test_sandboxes_round_trip_in_creation_order(store: AgentStore) -> None:
    store.add_sandbox(SB2)
    store.add_sandbox(SB1)
    assert store.sandboxes() == [SB1, SB2]
    assert store.sandbox(SB2.id) == SB2
    assert store.sandbox("nope") is None


def test_adding_a_sandbox_again_replaces_it(store: AgentStore) -> None:
    store.add_sandbox(SB1)
    store.add_sandbox(replace(SB1, annotations={}))
    assert store.sandboxes() == [replace(SB1, annotations={})]


def test_pending_placement_becomes_created_with_its_container_id(store: AgentStore) -> None:
    store.add_sandbox(SB1)
    p = placement(SB1, "app", 10.0, lease_id="lease-1")
    store.add_pending(p)
    assert store.placements() == [p]
    assert store.placement(p.key) == p, "a pending placement is found by its key"
    store.mark_created(p.key, "c" * 64)
    created = replace(p, container_id="c" * 64, state=PlacementState.CREATED)
    assert store.placements() == [created]
    assert store.placement("c" * 64) == created


def test_a_placement_needs_its_sandbox(store: AgentStore) -> None:
    with pytest.raises(sqlite3.IntegrityError):
        store.add_pending(placement(SB1, "app", 10.0))


def test_dropped_placement_is_gone(store: AgentStore) -> None:
    store.add_sandbox(SB1)
    p = placement(SB1, "app", 10.0)
    store.add_pending(p)
    store.drop_placement(p.key)
    assert store.placements() == []


@pytest.fixture
def two_created(store: AgentStore) -> AgentStore:
    store.add_sandbox(SB1)
    for name, cid, at in (("a", "abcdef01" + "1" * 56, 1.0), ("b", "abcdef02" + "2" * 56, 2.0)):
        store.add_pending(placement(SB1, name, at))
        store.mark_created(f"{SB1.id}/{name}/0", cid)
    return store


@pytest.mark.parametrize(
    ("query", "name"),
    [
        pytest.param("abcdef01" + "1" * 56, "a", id="full-id"),
        pytest.param("abcdef02", "b", id="unique-prefix"),
        pytest.param("abcdef01111", "a", id="longer-unique-prefix"),
        pytest.param("abcdef0", None, id="ambiguous-prefix-finds-nothing"),
        pytest.param("ffff", None, id="unknown-prefix"),
        pytest.param(f"{SB1.id}/b/0", "b", id="placement-key"),
    ],
)
def test_lookup_by_id_or_unique_prefix(two_created: AgentStore, query: str, name: str | None) -> None:
    got = two_created.placement(query)
    assert (got.name if got else None) == name


@pytest.mark.parametrize(
    "query",
    [
        pytest.param("a_cdef01", id="underscore-is-not-a-wildcard"),
        pytest.param("%01", id="percent-is-not-a-wildcard"),
        pytest.param("", id="empty-id-names-no-container"),
    ],
)
def test_prefix_is_matched_literally(store: AgentStore, query: str) -> None:
    store.add_sandbox(SB1)
    store.add_pending(placement(SB1, "a", 1.0))
    store.mark_created(f"{SB1.id}/a/0", "abcdef01" + "1" * 56)
    assert store.placement(query) is None, f"{query!r} is no prefix of any container ID"


def test_remove_sandbox_returns_and_removes_its_placements_only(store: AgentStore) -> None:
    store.add_sandbox(SB1)
    store.add_sandbox(SB2)
    mine = [placement(SB1, "a", 1.0), placement(SB1, "b", 2.0, lease_id="lease-b")]
    theirs = placement(SB2, "c", 3.0)
    for p in [*mine, theirs]:
        store.add_pending(p)
    assert sorted(store.remove_sandbox(SB1.id), key=lambda p: p.name) == mine
    assert store.sandboxes() == [SB2]
    assert store.placements() == [theirs]


def test_remove_unknown_sandbox_returns_nothing(store: AgentStore) -> None:
    assert store.remove_sandbox("nope") == []


def test_remove_container_returns_its_placement_once(two_created: AgentStore) -> None:
    cid = "abcdef01" + "1" * 56
    removed = two_created.remove_container(cid)
    assert removed is not None and removed.name == "a"
    assert [p.name for p in two_created.placements()] == ["b"]
    assert two_created.remove_container(cid) is None


def test_everything_survives_reopening(tmp_path: Path) -> None:
    s = AgentStore(tmp_path)
    s.add_sandbox(SB1)
    s.add_sandbox(SB2)
    p1, p2 = placement(SB1, "a", 1.0, lease_id="lease-a"), placement(SB2, "b", 2.0)
    s.add_pending(p1)
    s.add_pending(p2)
    s.mark_created(p1.key, "c1" * 32)
    sandboxes, placements = s.sandboxes(), s.placements()
    s.close()
    again = AgentStore(tmp_path)
    try:
        assert again.sandboxes() == sandboxes == [SB1, SB2]
        assert again.placements() == placements
        assert again.placement(p2.key) == p2, "still pending after the restart"
        assert again.placement("c1" * 32) == replace(p1, container_id="c1" * 32, state=PlacementState.CREATED)
    finally:
        again.close()
