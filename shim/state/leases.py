"""The broker's leases on disk: one row per live lease; a released lease is deleted.

The row is written before Acquire answers and updated before Bind answers,
so a broker killed at any point restarts with exactly the leases it granted.
``key`` is unique: a second Acquire with the same key finds the first lease
instead of granting another.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from shim.core.leases import LEASE_SCHEMA, LeaseState
from shim.state.db import Database

MIGRATIONS = (
    """
    CREATE TABLE leases (
        lease_id TEXT PRIMARY KEY,
        key TEXT NOT NULL UNIQUE,
        namespace TEXT NOT NULL, pod TEXT NOT NULL, pod_uid TEXT NOT NULL,
        container TEXT NOT NULL, sandbox_id TEXT NOT NULL,
        device_uuids TEXT NOT NULL, device_indices TEXT NOT NULL,
        memory_bytes INTEGER NOT NULL, compute_percent INTEGER NOT NULL, shared INTEGER NOT NULL,
        state TEXT NOT NULL,
        env TEXT NOT NULL, mounts TEXT NOT NULL, device_nodes TEXT NOT NULL,
        container_id TEXT NOT NULL DEFAULT '', pid INTEGER NOT NULL DEFAULT 0, cgroup TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL, bound_at REAL NOT NULL DEFAULT 0,
        reason TEXT NOT NULL, detail TEXT NOT NULL,
        schema INTEGER NOT NULL
    )
    """,
)

_JSON_FIELDS = ("device_uuids", "device_indices", "env", "mounts", "device_nodes")


def new_lease_id() -> str:
    """A lease's ID: also the name of its MPS daemon's directory, so a pooled daemon is named by one ahead."""
    return "lease-" + uuid.uuid4().hex[:16]


@dataclass(frozen=True)
class LeaseRecord:
    lease_id: str
    key: str
    namespace: str
    pod: str
    pod_uid: str
    container: str
    sandbox_id: str
    device_uuids: tuple[str, ...]
    device_indices: tuple[int, ...]
    memory_bytes: int
    compute_percent: int
    shared: bool
    state: LeaseState
    env: dict[str, str] = field(default_factory=dict)
    mounts: tuple[tuple[str, str, bool], ...] = ()
    device_nodes: tuple[str, ...] = ()
    container_id: str = ""
    pid: int = 0
    cgroup: str = ""
    created_at: float = 0.0
    bound_at: float = 0.0
    reason: str = ""
    detail: str = ""


def _row(rec: LeaseRecord) -> dict[str, object]:
    d = asdict(rec)
    for f in _JSON_FIELDS:
        d[f] = json.dumps(d[f])
    d["state"] = rec.state.value
    d["shared"] = int(rec.shared)
    d["schema"] = LEASE_SCHEMA
    return d


def _record(row) -> LeaseRecord:
    d = dict(row)
    d.pop("schema")
    for f in _JSON_FIELDS:
        d[f] = json.loads(d[f])
    d["device_uuids"] = tuple(d["device_uuids"])
    d["device_indices"] = tuple(d["device_indices"])
    d["mounts"] = tuple(tuple(m) for m in d["mounts"])
    d["device_nodes"] = tuple(d["device_nodes"])
    d["state"] = LeaseState(d["state"])
    d["shared"] = bool(d["shared"])
    return LeaseRecord(**d)


class LeaseStore:
    def __init__(self, state_dir: Path) -> None:
        self.db = Database(state_dir / "broker.db", MIGRATIONS)

    def all(self) -> list[LeaseRecord]:
        return [_record(r) for r in self.db.query("SELECT * FROM leases ORDER BY created_at, lease_id")]

    def get(self, lease_id: str) -> LeaseRecord | None:
        rows = self.db.query("SELECT * FROM leases WHERE lease_id = ?", (lease_id,))
        return _record(rows[0]) if rows else None

    def by_key(self, key: str) -> LeaseRecord | None:
        rows = self.db.query("SELECT * FROM leases WHERE key = ?", (key,))
        return _record(rows[0]) if rows else None

    def insert(self, rec: LeaseRecord) -> None:
        row = _row(rec)
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        with self.db.transaction() as conn:
            conn.execute(f"INSERT INTO leases ({cols}) VALUES ({marks})", tuple(row.values()))

    def update(self, rec: LeaseRecord) -> None:
        row = _row(rec)
        sets = ", ".join(f"{k} = ?" for k in row if k != "lease_id")
        with self.db.transaction() as conn:
            conn.execute(f"UPDATE leases SET {sets} WHERE lease_id = ?",
                         (*[v for k, v in row.items() if k != "lease_id"], rec.lease_id))

    def delete(self, lease_id: str) -> bool:
        with self.db.transaction() as conn:
            return conn.execute("DELETE FROM leases WHERE lease_id = ?", (lease_id,)).rowcount > 0

    def close(self) -> None:
        self.db.close()


__all__ = ["LeaseRecord", "LeaseStore", "replace"]
