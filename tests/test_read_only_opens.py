"""``open_store(url, upgrade=False)``, as the CLI's commands that only read open a store, writes
nothing to a store of this evstore's version either: one whose schema lacks objects (dropped by
hand, left out of a copy or restore) is refused, ``evstore.schema.version`` naming them, rather
than repaired under the reader; ``evstore upgrade`` (and ``upgrade=True``: rebuild, snapshot, a
service's open) repairs it as before.

Regression (session 35, helper K): on a current store the open with ``upgrade=False`` still made
the missing tables and indexes again (SQLite and PostgreSQL) and refolded the log into a lost
projection table, and on PostgreSQL ran the refold an upgrade to version 5 left pending: the
"read-only" ``evstore audit`` / ``history`` / ... wrote to the store. (The older-version side:
test_cli_older_store.)
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from evstore import SchemaVersionError, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_older_store import READ_ONLY
from tests.test_cli_support import demo_db, evstore

#: what the tests drop: a projection table (refolded from the log when made again) and an index
DROPPED_SQLITE = ("p_usages", "p_allocations_provider")
DROPPED_PG = ("p_classes", "p_allocations_provider")


def _drop(db: Path, *statements: str) -> None:
    conn = sqlite3.connect(db)
    with conn:
        for statement in statements:
            conn.execute(statement)
    conn.close()


def _objects(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    finally:
        conn.close()


@pytest.fixture(scope="module")
def current_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_db(tmp_path_factory.mktemp("current") / "current.db", instances=10, nodes=2)


@pytest.fixture(scope="module")
def damaged_store(current_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A current store that lost a projection table and an index."""
    db = tmp_path_factory.mktemp("damaged") / "damaged.db"
    shutil.copy(current_store, db)
    _drop(db, "DROP TABLE p_usages", "DROP INDEX p_allocations_provider")
    return db


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_leaves_a_current_store_byte_for_byte(
    current_store: Path, command: list[str]
) -> None:
    before = current_store.read_bytes()
    done = evstore(*command, "--db", str(current_store))
    assert done.returncode in (0, 1), done.stdout + done.stderr  # (history of a stranger: not found)
    assert current_store.read_bytes() == before


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_refuses_a_store_that_lost_schema_objects_and_writes_nothing(
    damaged_store: Path, command: list[str]
) -> None:
    before = damaged_store.read_bytes()
    done = evstore(*command, "--db", str(damaged_store))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    for name in DROPPED_SQLITE:
        assert name in done.stderr, done.stderr
    assert "evstore upgrade --db" in done.stderr and "nothing was written" in done.stderr
    assert damaged_store.read_bytes() == before


async def test_open_store_with_upgrade_false_refuses_it_and_upgrade_true_repairs_it(
    damaged_store: Path, tmp_path: Path
) -> None:
    db = tmp_path / "copy.db"
    shutil.copy(damaged_store, db)
    before = db.read_bytes()
    for url, options in ((f"sqlite:///{db}", {"upgrade": False}), (f"sqlite:///{db}?upgrade=false", {})):
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(url, **options):  # type: ignore[arg-type]
                pass
        assert sorted(raised.value.details["missing"]) == sorted(DROPPED_SQLITE)
        assert "upgrade=False" in raised.value.message
        assert db.read_bytes() == before
    done = evstore("upgrade", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert set(DROPPED_SQLITE) <= _objects(db)
    audit = evstore("audit", "--db", str(db))
    assert audit.returncode == 0, audit.stdout + audit.stderr  # (p_usages refolded from the log)
    async with open_store(f"sqlite:///{db}", upgrade=False) as store:
        assert (await store.audit()).clean


async def test_upgrade_false_looks_again_with_the_writers_connection(
    current_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read-only look before the open is not the last word: a table dropped by another
    connection after it (the writer's open would make it again) is refused by the writer's."""
    from evstore.log import sqlite as backend

    db = tmp_path / "raced.db"
    shutil.copy(current_store, db)
    looked = backend._refuse_repair

    def then_another_connection_drops_a_table(conn: sqlite3.Connection, path: str) -> None:
        looked(conn, path)
        monkeypatch.setattr(backend, "_refuse_repair", looked)  # (once: the first look)
        _drop(db, "DROP TABLE p_usages")

    monkeypatch.setattr(backend, "_refuse_repair", then_another_connection_drops_a_table)
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(f"sqlite:///{db}", upgrade=False):
            pass
    assert raised.value.details["missing"] == ["p_usages"]
    assert "p_usages" not in _objects(db)


def test_evstore_upgrade_says_what_it_repaired_in_a_current_store(
    damaged_store: Path, tmp_path: Path
) -> None:
    """Regression (session 35, helper K2): ``evstore upgrade`` of a current store that it just
    repaired - made a lost table and index again, refolded the log into the table - said "at
    schema version 5 already", and its --json told nothing of the repair either."""
    human, machine = tmp_path / "human.db", tmp_path / "machine.db"
    for db in (human, machine):
        shutil.copy(damaged_store, db)
    done = evstore("upgrade", "--db", str(human))
    assert done.returncode == 0, done.stderr
    assert "already" not in done.stdout, done.stdout
    said = " ".join(done.stdout.split())  # (rich may wrap the line)
    assert (
        "repaired: made p_usages, p_allocations_provider again; refolded the projection from the log" in said
    )
    done = evstore("upgrade", "--db", str(machine), "--json")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert (said["upgraded_from"], said["repaired"]) == (
        None,
        {"made_again": ["p_usages", "p_allocations_provider"], "dropped": [], "refolded": True},
    )
    again = evstore("upgrade", "--db", str(machine), "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["repaired"] is None, again.stdout + again.stderr
    assert "at schema version 5 already" in evstore("upgrade", "--db", str(human)).stdout


def test_evstore_upgrade_says_it_dropped_an_index_an_earlier_version_kept(
    current_store: Path, tmp_path: Path
) -> None:
    db = tmp_path / "kept.db"
    shutil.copy(current_store, db)
    _drop(db, "CREATE INDEX p_consumers_behalf ON p_consumers (on_behalf_of)")
    done = evstore("upgrade", "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["repaired"] == {
        "made_again": [],
        "dropped": ["p_consumers_behalf"],
        "refolded": False,
    }
    assert "p_consumers_behalf" not in _objects(db)


# --- PostgreSQL ---------------------------------------------------------------------------------


async def _pg_store_with_events(url: str) -> None:
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}})


async def _pg(url: str, sql: str, *args: Any) -> Any:
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


async def _pg_present(url: str, names: tuple[str, ...]) -> list[str]:
    rows = await _pg(
        url, "SELECT n FROM unnest($1::text[]) AS n WHERE to_regclass(n) IS NOT NULL", list(names)
    )
    return [r[0] for r in rows]


async def _pg_rows(url: str) -> list[Any]:
    """Everything the store's log and meta hold (what a repair would change beside the objects)."""
    return [
        *await _pg(url, "SELECT key, value FROM evstore_meta ORDER BY key"),
        *await _pg(url, "SELECT seq, position, hash FROM events ORDER BY seq"),
    ]


async def test_a_postgresql_store_that_lost_projection_objects_is_refused_read_only(pg_url: str) -> None:
    await _pg_store_with_events(pg_url)
    for name in DROPPED_PG:
        kind = "TABLE" if name.startswith("p_classes") else "INDEX"
        await _pg(pg_url, f"DROP {kind} {name}")
    rows = await _pg_rows(pg_url)
    for command in READ_ONLY:
        done = await asyncio.to_thread(evstore, *command, "--url", pg_url)
        assert done.returncode == 1, (command, done.stdout + done.stderr)
        assert done.stderr.startswith("error: evstore.schema.version: "), (command, done.stderr)
        assert all(name in done.stderr for name in DROPPED_PG), done.stderr
        assert "evstore upgrade --url" in done.stderr and done.stderr.count("\n") == 1, done.stderr
        assert await _pg_present(pg_url, DROPPED_PG) == [], command
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(pg_url, upgrade=False):
            pass
    assert sorted(raised.value.details["missing"]) == sorted(DROPPED_PG)
    assert await _pg_present(pg_url, DROPPED_PG) == []
    assert await _pg_rows(pg_url) == rows
    done = await asyncio.to_thread(evstore, "upgrade", "--url", pg_url, "--json")
    assert done.returncode == 0, done.stderr
    repaired = json.loads(done.stdout)["repaired"]  # (not "at schema version 5 already")
    assert repaired["refolded"] is True and sorted(repaired["made_again"]) == sorted(DROPPED_PG), repaired
    assert sorted(await _pg_present(pg_url, DROPPED_PG)) == sorted(DROPPED_PG)
    again = await asyncio.to_thread(evstore, "upgrade", "--url", pg_url)
    assert again.returncode == 0 and "already" in again.stdout, again.stdout + again.stderr
    audit = await asyncio.to_thread(evstore, "audit", "--url", pg_url)
    assert audit.returncode == 0, audit.stdout + audit.stderr


async def test_a_postgresql_store_whose_refold_is_pending_is_refused_read_only(pg_url: str) -> None:
    """A refold an upgrade to version 5 left pending (its open failed before it) is not run by an
    open with upgrade=False - nor is the projection it would refold read as it is."""
    await _pg_store_with_events(pg_url)
    await _pg(pg_url, "INSERT INTO evstore_meta VALUES ('refold_pending', '5')")
    rows = await _pg_rows(pg_url)
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(pg_url, upgrade=False):
            pass
    assert raised.value.details["refold_pending"] is True and raised.value.details["missing"] == []
    assert "evstore upgrade --url" in raised.value.message
    assert await _pg_rows(pg_url) == rows  # (still pending)
    done = await asyncio.to_thread(evstore, "state", "--url", pg_url)
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    done = await asyncio.to_thread(evstore, "upgrade", "--url", pg_url)  # (upgrade=True: refolds it)
    assert done.returncode == 0, done.stderr
    assert "repaired: refolded the projection from the log" in " ".join(done.stdout.split()), done.stdout
    async with open_store(pg_url) as store:
        assert (await store.audit()).clean
    assert not await _pg(pg_url, "SELECT 1 FROM evstore_meta WHERE key = 'refold_pending'")
    async with open_store(pg_url, upgrade=False) as store:
        assert await store.head() == 3


async def test_a_read_only_open_during_another_opens_refold_waits_for_it(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refold left pending (by an earlier evstore's upgrade to version 5, which committed it
    and ran it just after, under the fence) is run by the next open with upgrade=True: an open with
    upgrade=False that looks while it runs (a command run during a service's upgrade) waits for the
    refold and opens the store, rather than refusing it as an upgrade that failed. (It refused it,
    saying so, before this test.)"""
    from evstore.log import postgres as backend

    await _pg_store_with_events(pg_url)
    await _pg(pg_url, "INSERT INTO evstore_meta VALUES ('refold_pending', '5')")
    rebuild, pending = backend._rebuild, backend._refold_pending
    refolding, looked = asyncio.Event(), asyncio.Event()

    async def seen(conn: Any) -> bool:
        found = await pending(conn)
        if refolding.is_set() and found:
            looked.set()  # (the read-only open saw it pending: the other's refold is under way)
        return found

    async def held(*args: Any, **kwargs: Any) -> Any:
        refolding.set()
        await asyncio.wait_for(looked.wait(), 60)
        return await rebuild(*args, **kwargs)

    monkeypatch.setattr(backend, "_refold_pending", seen)
    monkeypatch.setattr(backend, "_rebuild", held)

    async def upgrader() -> None:
        async with open_store(pg_url):  # (upgrade=True: runs the refold)
            pass

    task = asyncio.create_task(upgrader())
    await asyncio.wait_for(refolding.wait(), 60)
    async with open_store(pg_url, upgrade=False) as store:
        assert looked.is_set()
        assert await store.head() == 3
        assert (await store.audit()).clean
    await task
    assert not await _pg(pg_url, "SELECT 1 FROM evstore_meta WHERE key = 'refold_pending'")


async def _pg_older_store_with_a_migration(url: str) -> tuple[str, str]:
    """A version-4 PostgreSQL store (as an older evstore left it) holding a migration started for
    a BAREMETAL instance: the refold of its upgrade gives the migration that type to restore."""
    from tests.test_postgres import _downgrade_to_v4_sql

    async with open_store(url) as store:
        src = await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}}, consumer_type="BAREMETAL")
        await store.start_migration(inst, mig)
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]
    return inst, mig


async def test_a_postgresql_upgrade_never_commits_a_refold_left_to_do(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper s36_P): the upgrade to version 5 committed the new version with a
    ``refold_pending`` row, and its open took the fence to refold only after that commit: every
    other session saw a store of this version whose projection was not to be read - a read-only
    open looking then was refused (polled for up to connect_timeout since b6fd845), and a process
    dying there left the refold to the next open. The refold now runs in the upgrade's
    transaction: while it runs, other sessions see the older store, and after it the refolded one;
    a read-only open that comes meanwhile waits for it (past its connect_timeout, which bounds a
    stuck holder of the migration lock, not an upgrade under way) and opens the store."""
    from evstore.log import postgres as backend

    inst, mig = await _pg_older_store_with_a_migration(pg_url)
    rebuild = backend._rebuild
    refolding, go_on = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        refolding.set()
        await asyncio.wait_for(go_on.wait(), 60)
        return await rebuild(*args, **kwargs)

    monkeypatch.setattr(backend, "_rebuild", held)

    async def upgrader() -> None:
        async with open_store(pg_url):  # (upgrade=True)
            pass

    task = asyncio.create_task(upgrader())
    await asyncio.wait_for(refolding.wait(), 60)
    meta = dict(await _pg(pg_url, "SELECT key, value FROM evstore_meta"))  # (what others see)
    assert meta.get("schema_version") == "4" and "refold_pending" not in meta, meta

    async def read_only() -> int:
        async with open_store(pg_url, upgrade=False, connect_timeout=0.5) as store:
            return await store.head()

    looking = asyncio.create_task(read_only())
    await asyncio.sleep(1.5)  # (three times its connect_timeout: it waits for the upgrade)
    assert not looking.done(), looking
    go_on.set()
    await asyncio.wait_for(task, 60)
    assert await asyncio.wait_for(looking, 60) == 4
    meta = dict(await _pg(pg_url, "SELECT key, value FROM evstore_meta"))
    assert "refold_pending" not in meta and int(meta["schema_version"]) >= 5, meta
    async with open_store(pg_url, upgrade=False) as store:
        assert (await store.audit()).clean
        assert store.backend.repaired is None
    async with open_store(pg_url) as store:
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"


async def test_a_postgresql_upgrade_whose_refold_fails_leaves_the_older_store(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper s36_P): an upgrade whose refold failed (a statement_timeout on a large
    log, a lost connection) had committed version 5 and ``refold_pending``: read-only opens
    refused the store as awaiting a refold until an open with upgrade=True ran it. The upgrade and
    its refold are now one transaction: the store stays as the older evstore left it (refused by
    read-only opens as such, found 4), and the next open upgrades it whole."""
    import asyncpg

    from evstore.log import postgres as backend

    inst, mig = await _pg_older_store_with_a_migration(pg_url)
    rows = await _pg_rows(pg_url)

    async def interrupted(*args: object, **kwargs: object) -> int:
        raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")

    with monkeypatch.context() as m:
        m.setattr(backend, "_rebuild", interrupted)
        with pytest.raises(Exception):  # noqa: B017 (the upgrading open fails: fine)
            async with open_store(pg_url):
                pass
    assert await _pg_rows(pg_url) == rows  # (nothing committed: version 4, no refold_pending)
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(pg_url, upgrade=False, connect_timeout=1):
            pass
    assert raised.value.details["found"] == 4, raised.value.details
    async with open_store(pg_url) as store:
        assert store.backend.upgraded_from == 4
        assert (await store.audit()).clean
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"


async def test_both_backends_refuse_a_store_that_lost_objects_with_the_same_details_keys(
    damaged_store: Path, tmp_path: Path, pg_url: str
) -> None:
    """One mistake, one shape: a caller reading the refusal's details (missing, retired,
    refold_pending) finds the same keys on either backend, beside the place (path or url)."""
    db = tmp_path / "copy.db"
    shutil.copy(damaged_store, db)
    await _pg_store_with_events(pg_url)
    await _pg(pg_url, "DROP TABLE p_classes")
    keys = []
    for url in (f"sqlite:///{db}", pg_url):
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(url, upgrade=False):
                pass
        keys.append(set(raised.value.details) - {"path", "url"})
        assert raised.value.details["retired"] == [] and raised.value.details["refold_pending"] is False
    assert keys[0] == keys[1], keys


async def test_upgrade_false_writes_nothing_to_a_store_another_connection_just_created(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store another process creates between the open's look (no store yet) and its write lock:
    under the lock the open finds it whole, and writes nothing - it ran the DDL and rewrote the
    schema version, a commit to a store it then found current (with upgrade=False, a "read-only"
    open's write)."""
    from evstore.log import sqlite as backend

    db = tmp_path / "raced.db"
    looked = backend._refuse_changes
    watcher: list[sqlite3.Connection] = []

    def then_another_connection_creates_it(conn: sqlite3.Connection, path: str) -> None:
        looked(conn, path)
        monkeypatch.setattr(backend, "_refuse_changes", looked)  # (once)
        other = sqlite3.connect(db, isolation_level=None)
        other.execute("PRAGMA journal_mode = WAL")
        backend._ensure_schema(other)
        other.close()
        watcher.append(sqlite3.connect(db, check_same_thread=False))
        versions.append(watcher[0].execute("PRAGMA data_version").fetchone()[0])

    versions: list[int] = []
    monkeypatch.setattr(backend, "_refuse_changes", then_another_connection_creates_it)
    try:
        async with open_store(f"sqlite:///{db}", upgrade=False) as store:
            assert await store.head() == 0
            # (data_version changes when another connection commits: the open's own, if any)
            assert watcher[0].execute("PRAGMA data_version").fetchone()[0] == versions[0]
    finally:
        for conn in watcher:
            conn.close()


@pytest.mark.parametrize("store_of", ["an older version", "this version, missing a table"])
async def test_a_sqlite_read_only_open_during_another_opens_upgrade_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, store_of: str
) -> None:
    """Regression (session 37): an open with upgrade=False (the CLI's read-only commands) while
    another process's open upgraded the store - its transaction under way, holding the write lock -
    refused it as a store an older evstore wrote (or one to repair), though a moment later it was
    current: a command run during a service's upgrade failed, where PostgreSQL's open waits. It
    now waits for the write lock (busy_timeout) when it would refuse, then looks again."""
    import threading

    from evstore.log import sqlite as backend
    from tests.test_store import _as_version_4

    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
    if store_of == "an older version":
        _as_version_4(path)
    else:
        conn = sqlite3.connect(path)
        conn.execute("DROP TABLE p_usages")
        conn.close()
    refolding, go = threading.Event(), threading.Event()
    refold = backend._refold_lost_projection

    def held(*args: Any, **kwargs: Any) -> Any:
        refolding.set()
        go.wait(60)
        return refold(*args, **kwargs)

    monkeypatch.setattr(backend, "_refold_lost_projection", held)

    def upgrade() -> None:  # (another process's open, in its transaction: holding the write lock)
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            backend._ensure_schema(conn, path=str(path))
        finally:
            conn.close()

    upgrader = threading.Thread(target=upgrade)
    upgrader.start()
    try:
        assert await asyncio.to_thread(refolding.wait, 60)

        async def read_only() -> tuple[int, int, bool]:
            async with open_store(f"sqlite:///{path}", upgrade=False) as store:
                return await store.head(), (await store.usage(rp))["VCPU"], (await store.audit()).clean

        opening = asyncio.create_task(read_only())
        await asyncio.sleep(0.3)  # (the open looks meanwhile; it must wait, not refuse)
        go.set()
        assert await opening == (3, 2, True)
    finally:
        go.set()
        await asyncio.to_thread(upgrader.join)
