"""A SQLite store that lost its schema version: its ``meta`` table dropped by hand, its
``schema_version`` row deleted, or a version that is not a number evstore writes (helper-E).

- With ``meta`` dropped, ``open_store(create=False)`` (every read-only CLI command) said "the
  database holds no evstore tables" - it holds the store's log and projection - and
  ``create=True`` made ``meta`` again at the current version without a word.
- With the version row deleted, ``create=True`` called the store another application's file.
- None of the messages said how to put the version back.

Each is now ``evstore.schema.version``, whichever the open, saying what is lost and the statement
that puts it back; nothing is written. The statement the message gives opens the store again.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

import pytest

from evstore import SchemaVersionError, StorageError, open_store
from evstore.errors import shown
from evstore.log.sqlite import SCHEMA_VERSION
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import demo_db, evstore
from tests.test_store import _as_version_4


async def _store(path: Path) -> tuple[str, str, int]:
    """A store at ``path``: a provider, a consumer holding on it; the two and the head."""
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 2}})
        return rp, consumer, await store.head()


def _tamper(path: Path, *statements: str) -> None:
    conn = sqlite3.connect(path)
    with conn:
        for statement in statements:
            conn.execute(statement)
    conn.close()


def _contents(path: Path) -> tuple[str, list[tuple[str, ...]], list[tuple[str, ...]]]:
    """The main file's digest, its schema and its meta rows (none when it has no meta table)."""
    conn = sqlite3.connect(path)
    try:
        schema = conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name").fetchall()
        has_meta = any(name == "meta" for _, name, _ in schema)
        meta = conn.execute("SELECT * FROM meta ORDER BY key").fetchall() if has_meta else []
    finally:
        conn.close()
    return hashlib.sha256(path.read_bytes()).hexdigest(), schema, meta


async def _refused(path: Path) -> str:
    """Open the store at ``path`` with create=True and with create=False: both refused alike,
    the file as it was; the message."""
    before = _contents(path)
    messages = []
    for create in (True, False):
        with pytest.raises(SchemaVersionError) as caught:
            async with open_store(f"sqlite:///{path}", create=create):
                pass
        assert caught.value.code == "evstore.schema.version"
        assert caught.value.details["path"] == str(path)
        assert _contents(path) == before, f"create={create} wrote to the store"
        messages.append(caught.value.message)
    assert messages[0] == messages[1], messages
    message = messages[0]
    assert "Nothing was written" in message and "backup" in message, message
    assert "no evstore tables" not in message and "another application" not in message, message
    return message


def _repair(path: Path, message: str) -> None:
    """Run the statements the message gives, as its reader would."""
    found = re.search(r"`([^`]*(?:meta)[^`]*)`", message)
    assert found is not None, message
    conn = sqlite3.connect(path)
    conn.executescript(found.group(1))
    conn.close()


async def _opens_as_it_was(path: Path, rp: str, consumer: str, head: int) -> None:
    for create in (False, True):
        async with open_store(f"sqlite:///{path}", create=create) as store:
            assert await store.head() == head
            assert await store.allocations(consumer) == {rp: {"VCPU": 2}}
            assert [e.position for e in [x async for x in store.history(consumer)]] == [head]
            assert (await store.audit()).clean
    conn = sqlite3.connect(path)
    try:
        version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    finally:
        conn.close()
    assert version == (str(SCHEMA_VERSION),)


async def test_a_store_whose_meta_table_was_dropped_is_refused_as_such(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    rp, consumer, head = await _store(path)
    _tamper(path, "DROP TABLE meta")
    message = await _refused(path)
    assert "lost its meta table" in message and "dropped by hand" in message, message
    assert f"('schema_version', '{SCHEMA_VERSION}')" in message, message
    # (it opened with create=True, meta made again at the current version: nothing said so)
    _repair(path, message)
    await _opens_as_it_was(path, rp, consumer, head)


def test_a_store_whose_meta_table_was_dropped_in_the_read_only_cli(tmp_path: Path) -> None:
    path = demo_db(tmp_path / "s.db", instances=10, nodes=2)
    _tamper(path, "DROP TABLE meta")
    for command in (["audit"], ["stats"], ["history", new_uuid()]):
        done = evstore(*command, "--db", str(path))
        assert done.returncode == 1, (command, done.stderr)
        # (it said "error: evstore.not_found: No evstore store in ...: the database holds no
        # evstore tables")
        assert done.stderr.startswith("error: evstore.schema.version: The store "), done.stderr
        assert "lost its meta table" in done.stderr, done.stderr


async def test_a_store_whose_schema_version_row_was_deleted_is_refused_as_such(tmp_path: Path) -> None:
    path = tmp_path / "s.db"
    rp, consumer, head = await _store(path)
    _tamper(path, "DELETE FROM meta WHERE key = 'schema_version'")
    # (create=True said "Not an evstore database: it has a meta table without evstore's schema
    # version (another application's?)", create=False that the file was damaged, neither how to
    # put the version back)
    message = await _refused(path)
    assert "no schema version" in message, message
    assert f"INSERT INTO meta VALUES ('schema_version', '{SCHEMA_VERSION}')" in message, message
    _repair(path, message)
    await _opens_as_it_was(path, rp, consumer, head)


@pytest.mark.parametrize(
    "value", ["abc", "", "1.1", " 5", "5_0", "\u0665", "0", pytest.param("9" * 5000, id="5000-nines")]
)
async def test_a_schema_version_evstore_does_not_write_is_refused_with_the_repair(
    tmp_path: Path, value: str
) -> None:
    # (' 5', '5_0' and the Arabic-Indic five are numbers to int(): 5, 50 - "upgrade evstore" - and 5;
    # 5000 nines were a bare ValueError out of open_store: more digits than int() reads)
    path = tmp_path / "s.db"
    rp, consumer, head = await _store(path)
    _tamper(path, f"UPDATE meta SET value = '{value}' WHERE key = 'schema_version'")
    message = await _refused(path)
    assert f"its schema version is {shown(value, 40)}, not a number" in message or value == "0", message
    assert f"UPDATE meta SET value = '{SCHEMA_VERSION}' WHERE key = 'schema_version'" in message, message
    _repair(path, message)
    await _opens_as_it_was(path, rp, consumer, head)


@pytest.mark.parametrize("older", [2, 4])
async def test_an_older_store_that_lost_its_meta_table_is_given_its_tables_version(
    tmp_path: Path, older: int
) -> None:
    """A store of schema version 2 (no instance_type column) or 4 (one allocation row per class):
    the message gives the version its tables have, not this evstore's (the store would then say
    it has tables it has not: refused), and the open after the repair upgrades it."""
    path = tmp_path / f"v{older}.db"
    rp, consumer, head = await _store(path)
    if older == 2:
        _tamper(path, "ALTER TABLE p_consumers DROP COLUMN instance_type")
    else:
        _as_version_4(path)
    _tamper(path, "DROP TABLE meta")
    message = await _refused(path)
    assert f"('schema_version', '{older}')" in message and f"version {older} or older" in message, message
    assert f"upgrades it to {SCHEMA_VERSION}" in message, message
    _repair(path, message)
    await _opens_as_it_was(path, rp, consumer, head)
    conn = sqlite3.connect(path)
    try:
        assert [r[1] for r in conn.execute("PRAGMA table_info(p_consumers)")][-1] == "instance_type"
        assert [r[1] for r in conn.execute("PRAGMA table_info(p_allocations)")] == [
            "consumer",
            "provider",
            "resources",
        ]
    finally:
        conn.close()


async def test_another_applications_meta_table_without_a_log_is_still_not_evstores(tmp_path: Path) -> None:
    """Without evstore's events table, a meta table (key, value) is another application's, as
    before: its tables are not a store that lost its version."""
    path = tmp_path / "app.db"
    _tamper(path, "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    with pytest.raises(StorageError) as caught:
        async with open_store(f"sqlite:///{path}"):
            pass
    assert caught.value.message.startswith("Not an evstore database: it has a meta table")
    _tamper(path, "INSERT INTO meta VALUES ('schema_version', 'v1')")
    with pytest.raises(SchemaVersionError, match="another application's meta table"):
        async with open_store(f"sqlite:///{path}"):
            pass
    conn = sqlite3.connect(path)
    try:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")] == ["meta"]
    finally:
        conn.close()
