"""The agent's state: opted-in sandboxes and the placement of their containers.

A placement is written twice: as ``pending`` (with its lease) before the
agent asks containerd to create the container, and as ``created`` with the
container ID before CreateContainer answers kubelet. A restart finds any
``pending`` row and settles it against containerd (the container exists:
complete it; it does not: release the lease). Removing a sandbox removes its
placements (foreign key, cascade).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from shim.core.placement import PlacementState
from shim.state.db import Database

MIGRATIONS = (
    """
    CREATE TABLE sandboxes (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL, namespace TEXT NOT NULL, uid TEXT NOT NULL,
        runtime_handler TEXT NOT NULL,
        opted_in INTEGER NOT NULL,
        annotations TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE TABLE placements (
        key TEXT PRIMARY KEY,
        container_id TEXT UNIQUE,
        sandbox_id TEXT NOT NULL REFERENCES sandboxes(id) ON DELETE CASCADE,
        name TEXT NOT NULL, attempt INTEGER NOT NULL,
        stage TEXT NOT NULL, stage_reason TEXT NOT NULL, stage_detail TEXT NOT NULL,
        placement TEXT NOT NULL, reason TEXT NOT NULL, detail TEXT NOT NULL,
        lease_id TEXT NOT NULL DEFAULT '',
        state TEXT NOT NULL,
        created_at REAL NOT NULL
    );
    CREATE INDEX placements_sandbox ON placements(sandbox_id)
    """,
    # Remote containers (docs/architecture.md): the host, kubelet's own config (its labels,
    # annotations, mounts and log path are what ContainerStatus shows), the last
    # status the host pushed, and how far its log has been copied.
    """
    ALTER TABLE placements ADD COLUMN remote_node TEXT NOT NULL DEFAULT '';
    ALTER TABLE placements ADD COLUMN config BLOB;
    ALTER TABLE placements ADD COLUMN sandbox_id_remote TEXT NOT NULL DEFAULT '';
    ALTER TABLE placements ADD COLUMN status BLOB;
    ALTER TABLE placements ADD COLUMN log_path TEXT NOT NULL DEFAULT '';
    ALTER TABLE placements ADD COLUMN log_offset INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE placements ADD COLUMN log_size INTEGER NOT NULL DEFAULT 0
    """,
    # A CPU host's reservation pods (shim.shadowhost.reservations): what decides what it does next with a shadow
    # (the reservation's state, when it was made, its grace, and for one made while the API was away, the stage
    # to reserve once it answers) outlives the agent.
    """
    CREATE TABLE reservations (
        key TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        created_at REAL NOT NULL,
        state TEXT NOT NULL,
        stage TEXT NOT NULL DEFAULT '',
        grace REAL,
        reason TEXT NOT NULL DEFAULT '',
        detail TEXT NOT NULL DEFAULT ''
    )
    """,
)


@dataclass(frozen=True)
class ReservationRecord:
    key: str
    name: str
    created_at: float  # wall clock: it must mean the same after a restart
    state: str
    stage: str = ""  # JSON of shim.core.reservation.Stage, for one made while the API was away
    grace: float | None = None
    reason: str = ""  # a lost one's (shim.core.reservation.LossReason), and what Kubernetes said
    detail: str = ""


@dataclass(frozen=True)
class SandboxRecord:
    id: str
    name: str
    namespace: str
    uid: str
    runtime_handler: str
    opted_in: bool
    annotations: dict[str, str]
    created_at: float


@dataclass(frozen=True)
class PlacementRecord:
    key: str
    container_id: str | None
    sandbox_id: str
    name: str
    attempt: int
    stage: str
    stage_reason: str
    stage_detail: str
    placement: str
    reason: str
    detail: str
    lease_id: str
    state: PlacementState
    created_at: float
    # A remote container: the host it runs on ("" when local), kubelet's
    # ContainerConfig as weft answered it (bytes), the shadow sandbox on the
    # host, the host's last ContainerStatus (bytes), kubelet's log file and how
    # far the shadow's log has been copied into it (host offset, local size).
    remote_node: str = ""
    config: bytes | None = None
    sandbox_id_remote: str = ""
    status: bytes | None = None
    log_path: str = ""
    log_offset: int = 0
    log_size: int = 0

    @property
    def remote(self) -> bool:
        return bool(self.remote_node)


class AgentStore:
    def __init__(self, state_dir: Path) -> None:
        self.db = Database(state_dir / "agent.db", MIGRATIONS)

    # -- sandboxes -------------------------------------------------------------
    def add_sandbox(self, rec: SandboxRecord) -> None:
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO sandboxes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.id, rec.name, rec.namespace, rec.uid, rec.runtime_handler, int(rec.opted_in),
                 json.dumps(rec.annotations), rec.created_at),
            )

    def sandboxes(self) -> list[SandboxRecord]:
        return [self._sandbox(r) for r in self.db.query("SELECT * FROM sandboxes ORDER BY created_at")]

    def sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        rows = self.db.query("SELECT * FROM sandboxes WHERE id = ?", (sandbox_id,))
        return self._sandbox(rows[0]) if rows else None

    @staticmethod
    def _sandbox(r) -> SandboxRecord:
        return SandboxRecord(r["id"], r["name"], r["namespace"], r["uid"], r["runtime_handler"],
                             bool(r["opted_in"]), json.loads(r["annotations"]), r["created_at"])

    def remove_sandbox(self, sandbox_id: str) -> list[PlacementRecord]:
        """Forget the sandbox and its placements; returns the placements it owned."""
        with self.db.transaction() as conn:
            owned = [self._placement(r) for r in
                     conn.execute("SELECT * FROM placements WHERE sandbox_id = ?", (sandbox_id,)).fetchall()]
            conn.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        return owned

    # -- placements ------------------------------------------------------------
    def add_pending(self, rec: PlacementRecord) -> None:
        """A placement about to be created; a remote one carries its (virtual) container ID already."""
        with self.db.transaction() as conn:
            conn.execute(
                "INSERT OR REPLACE INTO placements (key, container_id, sandbox_id, name, attempt, stage, "
                "stage_reason, stage_detail, placement, reason, detail, lease_id, state, created_at, remote_node, "
                "config, sandbox_id_remote, status, log_path, log_offset, log_size) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0, 0)",
                (rec.key, rec.container_id, rec.sandbox_id, rec.name, rec.attempt, rec.stage, rec.stage_reason,
                 rec.stage_detail, rec.placement, rec.reason, rec.detail, rec.lease_id, PlacementState.PENDING.value,
                 rec.created_at or time.time(), rec.remote_node, rec.config, rec.sandbox_id_remote, rec.status,
                 rec.log_path),
            )

    def set_status(self, container_id: str, status: bytes) -> None:
        """The host's latest ContainerStatus of a remote container (or the origin's own verdict on it)."""
        with self.db.transaction() as conn:
            conn.execute("UPDATE placements SET status = ? WHERE container_id = ?", (status, container_id))

    def set_log_progress(self, container_id: str, offset: int, size: int, log_path: str | None = None) -> None:
        with self.db.transaction() as conn:
            if log_path is None:
                conn.execute("UPDATE placements SET log_offset = ?, log_size = ? WHERE container_id = ?",
                             (offset, size, container_id))
            else:
                conn.execute("UPDATE placements SET log_offset = ?, log_size = ?, log_path = ? "
                             "WHERE container_id = ?", (offset, size, log_path, container_id))

    def remote_placements(self) -> list[PlacementRecord]:
        return [self._placement(r) for r in
                self.db.query("SELECT * FROM placements WHERE remote_node != '' ORDER BY created_at")]

    def mark_created(self, key: str, container_id: str, *, sandbox_id_remote: str = "",
                     status: bytes | None = None, note: str = "") -> None:
        """``note``: what the host said of the shadow, added to the placement's detail."""
        with self.db.transaction() as conn:
            conn.execute("UPDATE placements SET container_id = ?, state = ?, "
                         "sandbox_id_remote = CASE WHEN ? != '' THEN ? ELSE sandbox_id_remote END, "
                         "status = COALESCE(?, status), "
                         "detail = CASE WHEN ? != '' THEN detail || '; ' || ? ELSE detail END WHERE key = ?",
                         (container_id, PlacementState.CREATED.value, sandbox_id_remote, sandbox_id_remote, status,
                          note, note, key))

    def drop_placement(self, key: str) -> None:
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM placements WHERE key = ?", (key,))

    def remove_container(self, container_id: str) -> PlacementRecord | None:
        with self.db.transaction() as conn:
            rows = conn.execute("SELECT * FROM placements WHERE container_id = ?", (container_id,)).fetchall()
            conn.execute("DELETE FROM placements WHERE container_id = ?", (container_id,))
        return self._placement(rows[0]) if rows else None

    def placement_by_key(self, key: str) -> PlacementRecord | None:
        rows = self.db.query("SELECT * FROM placements WHERE key = ?", (key,))
        return self._placement(rows[0]) if rows else None

    def placements(self) -> list[PlacementRecord]:
        return [self._placement(r) for r in self.db.query("SELECT * FROM placements ORDER BY created_at")]

    def placement(self, container_id: str, *, by_key: bool = True) -> PlacementRecord | None:
        """By container ID, a unique prefix of one, or (``by_key``) a placement key, as ``weft explain`` takes.

        Verbs kubelet sends name containers by ID only: they pass ``by_key=False``, so a key-shaped ID
        (which containerd knows nothing of) never matches another container's placement.
        """
        if not container_id:
            return None
        rows = self.db.query("SELECT * FROM placements WHERE container_id = ? OR (? AND key = ?)",
                             (container_id, by_key, container_id))
        if not rows:  # a unique prefix of the ID, as crictl accepts; matched literally, not as a LIKE pattern
            rows = self.db.query("SELECT * FROM placements WHERE substr(container_id, 1, length(?)) = ?",
                                 (container_id, container_id))
            rows = rows if len(rows) == 1 else []
        return self._placement(rows[0]) if rows else None

    @staticmethod
    def _placement(r) -> PlacementRecord:
        fields = {k: r[k] for k in r.keys()}  # noqa: SIM118 - sqlite3.Row
        return PlacementRecord(**{**fields, "state": PlacementState(fields["state"])})

    # -- reservations (a CPU host's) ------------------------------------------------
    def put_reservation(self, rec: ReservationRecord) -> None:
        with self.db.transaction() as conn:
            conn.execute("INSERT OR REPLACE INTO reservations VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                         (rec.key, rec.name, rec.created_at, rec.state, rec.stage, rec.grace, rec.reason,
                          rec.detail))

    def drop_reservation(self, key: str) -> None:
        with self.db.transaction() as conn:
            conn.execute("DELETE FROM reservations WHERE key = ?", (key,))

    def reservations(self) -> list[ReservationRecord]:
        rows = self.db.query("SELECT * FROM reservations ORDER BY created_at")
        return [ReservationRecord(r["key"], r["name"], r["created_at"], r["state"], r["stage"], r["grace"],
                                  r["reason"], r["detail"]) for r in rows]

    def close(self) -> None:
        self.db.close()
