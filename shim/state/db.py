"""Open a SQLite database with WAL and bring its schema up to date.

Each database has an ordered list of migrations; ``PRAGMA user_version`` holds
how many have been applied. Migrations run in one transaction each, so a crash
mid-migration leaves the previous version intact. A database newer than this
code refuses to open rather than be misread.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import grpc

from shim.errors import WeftError


class StateError(WeftError):
    """The state database cannot be used (newer schema, corrupt file, ...)."""

    code = grpc.StatusCode.INTERNAL


class StateStoreFull(StateError):
    """The state database's disk is full: nothing can be recorded, so no new opted-in work is taken."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Database:
    """A connection shared by the process's threads, serialised by a lock.

    Writes are small and rare (a sandbox, a placement, a lease), so one
    connection with a lock is simpler and no slower than a pool.
    """

    def __init__(self, path: Path, migrations: Sequence[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.path = path
        try:
            # Root's alone: the state directory 0700 whoever made it, the database (and so its journal files,
            # which SQLite makes with the database's mode) 0600. It holds remote containers' configs.
            path.parent.chmod(0o700)
            os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
            for f in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                if f.exists():
                    f.chmod(0o600)
            self._conn = sqlite3.connect(path, check_same_thread=False, isolation_level=None, timeout=10)
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            # NORMAL with WAL: a committed fact survives the process being killed
            # (what crash safety here is about); after a power loss every
            # container and lease is gone anyway, and the node starts afresh.
            self._conn.execute("PRAGMA synchronous=NORMAL")
            self._conn.execute("PRAGMA foreign_keys=ON")
        except (sqlite3.Error, OSError) as exc:
            raise StateError(f"cannot open state database {path}: {exc}") from exc
        self._lock = threading.RLock()
        self._migrate(migrations)

    def _migrate(self, migrations: Sequence[str]) -> None:
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > len(migrations):
            raise StateError(
                f"state database {self.path} has schema version {version}, newer than this weft "
                f"understands ({len(migrations)}); upgrade weft or move the file away"
            )
        for number, script in enumerate(migrations[version:], start=version + 1):
            try:
                with self.transaction() as conn:
                    for statement in filter(None, (s.strip() for s in script.split(";"))):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={number}")
            except sqlite3.Error as exc:
                self._conn.close()
                raise StateError(f"state database {self.path}: migration {number} failed ({exc}); "
                                 f"it stays at schema version {number - 1}") from exc

    @property
    def schema_version(self) -> int:
        return self._conn.execute("PRAGMA user_version").fetchone()[0]

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a full disk comes out as ``StateStoreFull``, other SQLite errors unchanged."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                except BaseException:
                    # SQLite may have rolled back already (a full disk does that): ROLLBACK would then fail.
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
                try:
                    self._conn.execute("COMMIT")
                except sqlite3.Error:
                    # A failed COMMIT leaves the transaction open; the shared connection must not stay in it.
                    if self._conn.in_transaction:
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as exc:
                if getattr(exc, "sqlite_errorcode", 0) & 0xFF == sqlite3.SQLITE_FULL:
                    raise StateStoreFull(
                        f"weft: the state store {self.path} is full ({exc}): weft records every opted-in "
                        f"sandbox and container before it answers, so it takes no new opted-in work until "
                        f"space is freed in {self.path.parent}; pods that did not opt in are not affected"
                    ) from exc
                raise

    def query(self, sql: str, params: Sequence[object] = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._conn.execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            self._conn.close()
