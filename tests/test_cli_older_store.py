"""The commands that only read leave a store an older evstore wrote as it is; ``evstore upgrade``
upgrades it.

Regression (session 33, helper B; known since earlier reviews): ``evstore audit`` / ``history`` /
``state`` / ``diff`` / ``tail`` / ``stats`` / ``export`` on a SQLite store of an older schema
version opened it as every open does, which upgrades it: the file was rewritten and closed to the
older evstore processes still using it, by a debugging command. They now refuse it, with
``evstore.schema.version`` and what to run, and write nothing: they open with ``upgrade=False``,
an option of ``open_store`` (PostgreSQL's side: test_postgres).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

from evstore import InvalidInput, SchemaVersionError, open_store
from evstore.log.sqlite import SCHEMA_VERSION
from tests.test_cli_support import demo_db, evstore

READ_ONLY = [
    ["audit"],
    ["audit", "--history"],
    ["stats"],
    ["export"],
    ["state"],
    ["state", "--at", "3"],
    ["diff", "1", "3"],
    ["history", "6c3e1a2e-3c2b-4c55-9d47-000000000001"],
    ["tail", "--no-follow"],
]


def _version(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    finally:
        conn.close()


@pytest.fixture(scope="module")
def older_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo store whose meta says schema version 4: what every open upgrades (to 5)."""
    db = demo_db(tmp_path_factory.mktemp("older") / "older.db", instances=10, nodes=2)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    return db


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_refuses_an_older_store_and_leaves_it_as_it_is(
    older_store: Path, command: list[str]
) -> None:
    done = evstore(*command, "--db", str(older_store))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    assert "schema version 4" in done.stderr and "evstore upgrade --db" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert _version(older_store) == "4"


def test_evstore_upgrade_upgrades_it_and_says_from_what(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "older.db", instances=10, nodes=2)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    done = evstore("upgrade", "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["upgraded_from"] == 4
    assert _version(db) == "5"
    again = evstore("upgrade", "--db", str(db))
    assert again.returncode == 0 and "already" in again.stdout, again.stdout + again.stderr
    assert evstore("audit", "--db", str(db)).returncode == 0


def test_upgrade_of_a_missing_file_is_not_found(tmp_path: Path) -> None:
    done = evstore("upgrade", "--db", str(tmp_path / "none.db"))
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.not_found: "), done.stderr
    assert not (tmp_path / "none.db").exists()


async def test_open_store_with_upgrade_false_refuses_an_older_store_and_writes_nothing(
    older_store: Path, tmp_path: Path
) -> None:
    db = tmp_path / "copy.db"
    shutil.copy(older_store, db)
    for url, options in ((f"sqlite:///{db}", {"upgrade": False}), (f"sqlite:///{db}?upgrade=false", {})):
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(url, **options):  # type: ignore[arg-type]
                pass
        assert raised.value.code == "evstore.schema.version"
        assert raised.value.details["found"] == 4 and raised.value.details["supported"] == SCHEMA_VERSION
        assert "upgrade=False" in raised.value.message and "nothing was written" in raised.value.message
        assert _version(db) == "4"
    async with open_store(f"sqlite:///{db}") as store:  # (the default upgrades it, and says so)
        assert store.backend.upgraded_from == 4
        assert (await store.audit()).clean
    assert _version(db) == str(SCHEMA_VERSION)
    async with open_store(f"sqlite:///{db}", upgrade=False) as store:  # (a current store opens)
        assert store.backend.upgraded_from is None


@pytest.mark.parametrize(("url", "options"), [("sqlite://", {"upgrade": "no"}), ("sqlite://?upgrade=no", {})])
async def test_upgrade_must_be_true_or_false(url: str, options: dict[str, object]) -> None:
    with pytest.raises(InvalidInput) as raised:
        async with open_store(url, **options):  # type: ignore[arg-type]
            pass
    assert raised.value.details["field"] == "upgrade"


def test_import_into_an_older_store_with_events_refuses_it_without_upgrading_it(
    older_store: Path, tmp_path: Path
) -> None:
    """Regression (session 34, helper B): ``evstore import`` opened its store as every open does,
    which upgrades one an older evstore wrote, and only then refused it for holding events: the
    refused import had closed the store to the older evstore processes still using it (and said
    nothing of it). It now opens with ``upgrade=False``, as the read-only commands do."""
    older = tmp_path / "older.db"
    shutil.copy(older_store, older)
    export = tmp_path / "log.jsonl"
    source = demo_db(tmp_path / "current.db", instances=3, nodes=2)
    assert evstore("export", "--db", str(source), "-o", str(export)).returncode == 0
    done = evstore("import", str(export), "--db", str(older))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    assert "evstore upgrade --db" in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert _version(older) == "4"


@pytest.fixture
async def older_pg_store(pg_url: str) -> str:
    """A PostgreSQL store with events at schema version 4 (as test_postgres builds one)."""
    from tests.conftest import make_provider
    from tests.test_postgres import _downgrade_to_v4_sql

    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=8)
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]
    return pg_url


async def _pg_version(url: str) -> str:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return str(await conn.fetchval("SELECT value FROM evstore_meta WHERE key = 'schema_version'"))
    finally:
        await conn.close()


async def test_every_command_but_upgrade_rebuild_and_snapshot_refuses_an_older_postgresql_store(
    older_pg_store: str, tmp_path: Path
) -> None:
    """The read-only commands on PostgreSQL (test_postgres drives only ``audit``), and ``demo`` and
    ``import``, which need an empty store: each refuses a store an older evstore wrote, one line,
    ``evstore.schema.version``, and the store keeps its version. Regression (session 34, helper B):
    ``demo --url`` and ``import --url`` upgraded it, then refused it for holding events."""
    import asyncio

    export = tmp_path / "log.jsonl"
    source = demo_db(tmp_path / "current.db", instances=3, nodes=2)
    assert evstore("export", "--db", str(source), "-o", str(export)).returncode == 0
    for command in [*READ_ONLY, ["demo", "--instances", "3"], ["import", str(export)]]:
        done = await asyncio.to_thread(evstore, *command, "--url", older_pg_store)
        assert done.returncode == 1, (command, done.stdout + done.stderr)
        assert done.stderr.startswith("error: evstore.schema.version: "), (command, done.stderr)
        assert "schema version 4" in done.stderr and "evstore upgrade --url" in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1, (command, done.stderr)
        assert await _pg_version(older_pg_store) == "4", command


async def test_upgrade_false_refuses_an_older_store_another_connection_holds_locked(
    older_store: Path, tmp_path: Path
) -> None:
    """The refusal needs no write lock: an older store another process is writing to (an older
    evstore still running, as the refusal assumes) is refused as older, not as busy after waiting
    busy_timeout for a lock that would only have been used to refuse it."""
    db = tmp_path / "copy.db"
    shutil.copy(older_store, db)
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(f"sqlite:///{db}", upgrade=False, busy_timeout=0.2):
                pass
        assert raised.value.details["found"] == 4
    finally:
        writer.execute("ROLLBACK")
        writer.close()
    assert _version(db) == "4"


async def test_upgrade_false_looks_again_under_the_write_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The look before the write lock is not the last word: a store an older evstore made in the
    file between that look (an empty file: nothing to refuse) and the lock is refused under the
    lock, not upgraded."""
    from evstore.log import sqlite as backend

    db = tmp_path / "raced.db"
    sqlite3.connect(db).close()  # (an empty database file)
    looked = backend._refuse_upgrade

    def then_an_older_evstore_creates_its_store(conn: sqlite3.Connection, path: str) -> None:
        looked(conn, path)
        if not sys._getframe(2).f_code.co_qualname.startswith("_ensure_schema.<locals>"):
            return  # (the read-only look before the open: the race is after the writer's look)
        monkeypatch.setattr(backend, "_refuse_upgrade", looked)  # (once: the look before the lock)
        other = sqlite3.connect(db, isolation_level=None)
        try:
            backend._ensure_schema(other)
            other.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
        finally:
            other.close()

    monkeypatch.setattr(backend, "_refuse_upgrade", then_an_older_evstore_creates_its_store)
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(f"sqlite:///{db}", upgrade=False):
            pass
    assert raised.value.details["found"] == 4
    assert _version(db) == "4"


async def test_upgrade_false_leaves_an_older_rollback_journal_file_byte_for_byte(
    older_store: Path, tmp_path: Path
) -> None:
    """Regression (review of session 34): a copy made with ``VACUUM INTO`` is in rollback-journal
    mode; the writer connection's ``PRAGMA journal_mode = WAL`` rewrote its header before the look
    that refused it, so "nothing was written" was not so (the CLI's read-only look before the open
    had left it untouched). It is refused read-only first now."""
    db = tmp_path / "copy.db"
    source = sqlite3.connect(older_store)
    source.execute(f"VACUUM INTO '{db}'")
    source.close()
    before = db.read_bytes()
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(f"sqlite:///{db}", upgrade=False):
            pass
    assert raised.value.details["found"] == 4
    assert db.read_bytes() == before
    done = evstore("audit", "--db", str(db))
    assert done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    assert db.read_bytes() == before
