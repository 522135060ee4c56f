"""Foreign files and damaged logs: opening and rebuilding must not guess (helper-94).

- A SQLite file of another application with tables named ``events`` and ``meta`` (other columns),
  opened read-only (``create=False``, every read-only CLI command), was called a damaged evstore
  store (``evstore.schema.version``); the open that creates said "Not an evstore database".
- ``open_store`` (``create=True``) added evstore's tables to another application's SQLite file,
  which ``evstore import`` refuses.
- A rebuild folded a log with a hole in it (a row deleted by hand from the middle) without a
  word - forgetting that event for good - where ``read`` and ``subscribe`` refuse it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from evstore import StorageError, open_store
from tests.conftest import make_provider, new_uuid
from tests.test_cli_support import evstore


def _foreign_file(path: Path, tables: dict[str, str]) -> Path:
    conn = sqlite3.connect(path)
    with conn:
        for name, columns in tables.items():
            conn.execute(f"CREATE TABLE {name} ({columns})")
            conn.execute(f"INSERT INTO {name} DEFAULT VALUES")
    conn.close()
    return path


def _tables(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return sorted(r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'"))
    finally:
        conn.close()


# --- a foreign file with evstore's table names, opened read-only -------------------------------


async def test_a_foreign_file_with_evstores_table_names_is_not_damaged_read_only(tmp_path: Path) -> None:
    path = _foreign_file(tmp_path / "other.db", {"events": "id INTEGER, what TEXT", "meta": "k TEXT, v TEXT"})
    with pytest.raises(StorageError) as creating:
        async with open_store(f"sqlite:///{path}"):
            pass
    with pytest.raises(StorageError) as reading:
        async with open_store(f"sqlite:///{path}", create=False):
            pass
    # (it said evstore.schema.version: "has evstore's tables but no schema version ... damaged")
    assert reading.value.code == creating.value.code == "evstore.storage"
    assert reading.value.message == creating.value.message
    assert reading.value.message.startswith("Not an evstore database: its table ")
    assert _tables(path) == ["events", "meta"]  # (neither open added anything)


def test_a_foreign_file_with_evstores_table_names_in_the_read_only_cli(tmp_path: Path) -> None:
    path = _foreign_file(tmp_path / "other.db", {"events": "id INTEGER, what TEXT", "meta": "k TEXT, v TEXT"})
    for command in (["audit"], ["stats"], ["history", new_uuid()]):
        done = evstore(*command, "--db", str(path))
        assert done.returncode == 1, (command, done.stderr)
        assert done.stderr.startswith("error: evstore.storage: Not an evstore database: its table "), (
            done.stderr
        )


async def test_a_store_that_lost_its_schema_version_is_still_called_damaged_read_only(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=4)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DELETE FROM meta WHERE key = 'schema_version'")
    conn.close()
    with pytest.raises(StorageError) as info:
        async with open_store(f"sqlite:///{path}", create=False):
            pass
    assert info.value.code == "evstore.schema.version" and "no schema version" in info.value.message


# --- open_store does not add evstore's tables to another application's file --------------------


async def test_open_store_refuses_a_file_that_holds_only_another_applications_tables(tmp_path: Path) -> None:
    path = _foreign_file(tmp_path / "app.db", {"users": "id INTEGER, name TEXT", "orders": "id INTEGER"})
    with pytest.raises(StorageError) as info:
        async with open_store(f"sqlite:///{path}"):
            pass
    assert info.value.code == "evstore.storage"
    assert info.value.details["tables"] == ["orders", "users"]
    assert "another application's tables (orders, users)" in info.value.message
    assert "Use a new file" in info.value.message
    assert _tables(path) == ["orders", "users"]  # (it had evstore's eleven tables added)
    demo = evstore("stats", "--db", str(path))  # read-only: still "no store here"
    assert demo.returncode == 1 and demo.stderr.startswith("error: evstore.not_found: "), demo.stderr


async def test_an_empty_file_and_a_database_without_tables_still_become_stores(tmp_path: Path) -> None:
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    bare = tmp_path / "bare.db"
    conn = sqlite3.connect(bare)
    conn.execute("PRAGMA user_version = 7")  # (a database file, with a header and no table)
    conn.close()
    for path in (empty, bare):
        async with open_store(f"sqlite:///{path}") as store:
            await make_provider(store, VCPU=4)
            assert await store.head() == 2


async def test_a_store_with_a_table_of_its_owners_added_still_opens(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=4)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE notes (t TEXT)")
    conn.close()
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 2
