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

import json
import sqlite3
from pathlib import Path

import pytest

from evstore import AllocationStore, CorruptEvent, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid
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


# --- rebuild over a hole in the log ------------------------------------------------------------


async def _log_with_a_tombstone(store: AllocationStore) -> tuple[str, str, int]:
    """A provider, a consumer deleted (its tombstone at the returned position), and an event
    after it (so that the deleted row leaves a hole, not a lost tail)."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 2}})
    deleted_at = (await store.delete_consumer(c)).position
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    return rp, c, deleted_at


async def _refused_as_the_reads_refuse(store: AllocationStore, missing: int, **how: bool) -> None:
    with pytest.raises(CorruptEvent) as info:
        await store.read(0, 100)
    read_error = info.value
    with pytest.raises(CorruptEvent) as info:
        await store.rebuild(**how)
    assert info.value.code == "evstore.log.corrupt"
    assert info.value.details["reason"] == read_error.details["reason"] == "position_gap"
    assert info.value.details["position"] == read_error.details["position"] == missing
    assert f"Position {missing} is missing" in info.value.message


@pytest.mark.parametrize("full", [False, True])
async def test_rebuild_refuses_a_log_with_a_hole(store: AllocationStore, full: bool) -> None:
    # a consumer written twice: its first write deleted from the log, the fold without it gave
    # the consumer another generation (and the rebuild wrote it, "from N events")
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 2}})
    first = await store.head()
    await allocate(store, c, {rp: {"VCPU": 3}}, generation=1)
    await store.backend.tamper("DELETE FROM events WHERE position = ?", (first,))
    await _refused_as_the_reads_refuse(store, first, full=full)
    view = await store.allocations(c)  # nothing written
    assert (view.generation, view.allocations) == (2, {rp: {"VCPU": 3}})


@pytest.mark.parametrize("full", [False, True])
async def test_force_does_not_fold_over_a_hole(store: AllocationStore, full: bool) -> None:
    # (force accepts a lost tail - README - not a hole: here the tombstone is in the hole, and the
    # fold without it gave the deleted consumer its allocation back)
    rp, _, deleted_at = await _log_with_a_tombstone(store)
    await store.backend.tamper("DELETE FROM events WHERE position = ?", (deleted_at,))
    await _refused_as_the_reads_refuse(store, deleted_at, force=True, full=full)
    # nothing written: the deleted consumer's VCPU=2 is not counted again (PostgreSQL's queries
    # of the consumer itself refuse its tombstone, which names an event the log lost)
    assert await store.usage(rp) == {"VCPU": 1}


async def test_rebuild_refuses_a_log_that_lost_its_first_event(store: AllocationStore) -> None:
    await _log_with_a_tombstone(store)
    await store.backend.tamper("DELETE FROM events WHERE position = 1")
    with pytest.raises(CorruptEvent) as info:
        await store.rebuild()
    assert info.value.details["position"] == 1


def test_cli_rebuild_over_a_hole_fails_and_writes_nothing(tmp_path: Path) -> None:
    from tests.test_cli_support import demo_db

    path = demo_db(tmp_path / "demo.db", instances=10, nodes=2)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("DELETE FROM events WHERE position = 20")
        before = conn.execute("SELECT * FROM p_allocations ORDER BY 1, 2").fetchall()
    conn.close()
    done = evstore("rebuild", "--db", str(path))
    assert done.returncode == 1, done.stdout
    assert done.stderr.startswith("error: evstore.log.corrupt: Position 20 is missing from the log"), (
        done.stderr
    )
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT * FROM p_allocations ORDER BY 1, 2").fetchall() == before
    conn.close()


async def test_a_lost_projection_table_is_not_refolded_over_a_hole(sqlite_url: str) -> None:
    """The open's repair of a projection table dropped by hand folded the log over a hole too,
    forgetting the deleted event (here a tombstone: the consumer held its allocation again)."""
    async with open_store(sqlite_url) as store:
        _, c, deleted_at = await _log_with_a_tombstone(store)
        await store.backend.tamper("DELETE FROM events WHERE position = ?", (deleted_at,))
        await store.backend.tamper("DROP TABLE p_allocations")
    async with open_store(sqlite_url) as store:
        assert (await store.allocations(c)).deleted
        reasons = [f.details.get("reason") for f in (await store.audit()).integrity]
        assert "position_gap" in reasons


async def test_a_tombstone_deleted_from_the_middle_is_a_hole_not_a_lost_tail(store: AllocationStore) -> None:
    """Regression (PostgreSQL): a consumer's tombstone event deleted from the middle of the log was
    taken for a lost tail (its projection row names an event the log no longer holds), so a
    rebuild was refused as log_truncated, advising --force, which then refused it as a hole; the
    audit's log_truncated finding said the log lost its last events, which it had not."""
    _, _, deleted_at = await _log_with_a_tombstone(store)
    await store.backend.tamper("DELETE FROM events WHERE position = ?", (deleted_at,))
    assert await store.backend.lost_tail() is None
    await _refused_as_the_reads_refuse(store, deleted_at)
    reasons = [f.details.get("reason") for f in (await store.audit()).integrity]
    assert "position_gap" in reasons and "log_truncated" not in reasons, reasons


async def test_an_export_of_a_log_with_a_hole_is_refused_as_a_read_is(store: AllocationStore) -> None:
    """Regression: export went on over a hole (exit 0), writing a file whose header counts the head
    but whose rows skip a position: an import refuses it, and a backup taken so hides the damage.
    It stops as read() does, at the missing position."""
    _, _, deleted_at = await _log_with_a_tombstone(store)
    await store.backend.tamper("DELETE FROM events WHERE position = ?", (deleted_at,))
    for batch_size in (1, 2, 1000):  # (the hole at a page's start, inside one, across pages)
        lines: list[str] = []
        with pytest.raises(CorruptEvent) as info:
            async for line in store.export(batch_size=batch_size):
                lines.append(line)
        assert info.value.details == {"position": deleted_at, "reason": "position_gap"}
        # (the header, then rows before the hole only: a page holding it is refused whole)
        assert all(json.loads(line)["position"] < deleted_at for line in lines[1:]), lines
