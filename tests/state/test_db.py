"""The state database: WAL, schema versions and migrations that never leave a half-applied schema."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import grpc
import pytest

from shim.state.db import Database, StateError, StateStoreFull

M1 = "CREATE TABLE things (id TEXT PRIMARY KEY)"
M2 = "CREATE TABLE more (id TEXT PRIMARY KEY); CREATE INDEX more_id ON more(id)"
BROKEN = "CREATE TABLE half (id TEXT); INSERT INTO no_such_table VALUES (1)"


def tables(db: Database) -> set[str]:
    return {r[0] for r in db.query("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "state" / "x.db"


def test_opens_in_wal_mode_creating_the_directory(path: Path) -> None:
    db = Database(path, [M1])
    try:
        assert path.parent.is_dir()
        assert db.query("PRAGMA journal_mode")[0][0] == "wal"
    finally:
        db.close()


def test_the_database_and_its_directory_are_roots_alone_whoever_made_them(path: Path) -> None:
    path.parent.mkdir(mode=0o755)
    path.touch(mode=0o644)
    db = Database(path, [M1])
    try:
        with db.transaction() as conn:
            conn.execute("INSERT INTO things VALUES ('a')")
        files = [path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")]
        assert [(f.name, f.stat().st_mode & 0o777) for f in files if f.exists()] == [
            (f.name, 0o600) for f in files if f.exists()]
        assert path.parent.stat().st_mode & 0o777 == 0o700
    finally:
        db.close()


@pytest.mark.parametrize(
    "migrations",
    [pytest.param([], id="no-migrations"), pytest.param([M1], id="one"), pytest.param([M1, M2], id="two")],
)
def test_schema_version_is_the_number_of_migrations(path: Path, migrations: list[str]) -> None:
    db = Database(path, migrations)
    try:
        assert db.schema_version == len(migrations)
        assert db.query("PRAGMA user_version")[0][0] == len(migrations)
    finally:
        db.close()


def test_a_newer_database_is_refused_naming_the_file(path: Path) -> None:
    Database(path, [M1, M2]).close()
    with pytest.raises(StateError) as err:
        Database(path, [M1])
    assert str(path) in err.value.message
    assert "schema version 2" in err.value.message


def test_an_appended_migration_is_applied_and_earlier_data_kept(path: Path) -> None:
    db = Database(path, [M1])
    with db.transaction() as conn:
        conn.execute("INSERT INTO things VALUES ('kept')")
    db.close()
    db = Database(path, [M1, M2])
    try:
        assert db.schema_version == 2
        assert {"things", "more"} <= tables(db)
        assert [r[0] for r in db.query("SELECT id FROM things")] == ["kept"]
    finally:
        db.close()


def test_reopening_at_the_same_version_runs_nothing_again(path: Path) -> None:
    Database(path, [M1]).close()
    db = Database(path, [M1])  # M1 again would fail: the table exists
    try:
        assert db.schema_version == 1
    finally:
        db.close()


def test_a_failing_migration_leaves_the_previous_version(path: Path) -> None:
    Database(path, [M1]).close()
    with pytest.raises((StateError, sqlite3.Error)):
        Database(path, [M1, BROKEN])
    db = Database(path, [M1])
    try:
        assert db.schema_version == 1
        assert "half" not in tables(db), "the failed migration's first statement was rolled back"
    finally:
        db.close()


def test_a_file_that_is_not_a_database_is_a_state_error_naming_it(path: Path) -> None:
    path.parent.mkdir(parents=True)
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StateError) as err:
        Database(path, [M1])
    assert str(path) in err.value.message


def test_a_failed_transaction_is_rolled_back(path: Path) -> None:
    db = Database(path, [M1])
    try:
        with pytest.raises(RuntimeError), db.transaction() as conn:
            conn.execute("INSERT INTO things VALUES ('gone')")
            raise RuntimeError("boom")
        assert db.query("SELECT id FROM things") == []
    finally:
        db.close()


def test_a_full_store_is_refused_clearly_and_the_connection_stays_usable(path: Path) -> None:
    db = Database(path, [M1])
    try:
        db.query(f"PRAGMA max_page_count = {db.query('PRAGMA page_count')[0][0]}")  # as a full disk
        with pytest.raises(StateStoreFull) as err, db.transaction() as conn:
            conn.executemany("INSERT INTO things VALUES (?)", ((f"{i:0>200}",) for i in range(1000)))
        assert err.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(path) in err.value.message and "full" in err.value.message
        assert isinstance(err.value.__cause__, sqlite3.OperationalError)
        db.query("PRAGMA max_page_count = 1073741823")  # space again
        with db.transaction() as conn:
            conn.execute("INSERT INTO things VALUES ('one')")
        assert [r[0] for r in db.query("SELECT id FROM things")] == ["one"]
    finally:
        db.close()
