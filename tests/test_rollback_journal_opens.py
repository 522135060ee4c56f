"""A current SQLite store whose file is in rollback-journal mode (a ``VACUUM INTO`` copy, a
backup tool's) is left byte for byte as it was by ``open_store(url, upgrade=False)`` - the CLI's
commands that only read - and answered as its WAL original is; the switch to WAL, which rewrites
the file's header, waits for the first write, and every write through such an open (a command,
an import, a snapshot taken, a schema created) makes it first, so a store written to is in WAL
mode as every other.

Regression (session 35, helper K2): every open ran the writer connection's ``PRAGMA journal_mode
= WAL`` at once, so ``evstore audit`` (or stats, export, ...) of such a copy rewrote bytes 18-19
of its header.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_older_store import READ_ONLY
from tests.test_cli_support import demo_db, evstore


def _journal_mode_bytes(db: Path) -> bytes:
    """The header's write and read versions: 1 1 for a rollback journal, 2 2 for WAL."""
    return db.read_bytes()[18:20]


def _vacuum_into(source: Path, target: Path) -> Path:
    conn = sqlite3.connect(source)
    try:
        conn.execute("VACUUM INTO ?", (str(target),))
    finally:
        conn.close()
    assert _journal_mode_bytes(target) == b"\x01\x01"
    return target


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of the demo, in WAL mode."""
    return demo_db(tmp_path_factory.mktemp("wal") / "store.db", instances=10, nodes=2)


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_leaves_a_rollback_journal_store_byte_for_byte(
    original: Path, tmp_path: Path, command: list[str]
) -> None:
    copy = _vacuum_into(original, tmp_path / original.name)
    before = copy.read_bytes()
    done = evstore(*command, "--db", str(copy))
    assert done.returncode in (0, 1), done.stdout + done.stderr  # (history of a stranger: not found)
    assert copy.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [copy.name]  # (no -wal, -shm, -journal)
    if command[0] != "stats":  # (its sizes differ: the copy is vacuumed)
        same = evstore(*command, "--db", str(original))
        assert (done.returncode, done.stdout.replace(str(tmp_path), str(original.parent))) == (
            same.returncode,
            same.stdout,
        )


async def test_a_command_through_such_an_open_switches_the_file_to_wal_first(
    original: Path, tmp_path: Path
) -> None:
    db = _vacuum_into(original, tmp_path / "copy.db")
    async with open_store(f"sqlite:///{db}", upgrade=False) as store:
        head = await store.head()
        assert _journal_mode_bytes(db) == b"\x01\x01"  # (opened and read: as it was)
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
        assert _journal_mode_bytes(db) == b"\x02\x02"
        assert (await store.usage(rp)).usages == {"VCPU": 2}
        last = await store.head()
    conn = sqlite3.connect(db)
    try:
        assert conn.execute("PRAGMA journal_mode").fetchone() == ("wal",)
        assert conn.execute("SELECT max(position) FROM events").fetchone() == (last,)
    finally:
        conn.close()
    assert last > head


async def test_time_travel_leaves_it_unsaved_and_take_snapshots_switches_first(
    original: Path, tmp_path: Path
) -> None:
    """The snapshots saved on the way to an answer (a cache) are left unsaved rather than turn a
    file that is only read to WAL; ``take_snapshots``, asked to write them, switches it."""
    db = _vacuum_into(original, tmp_path / "copy.db")
    before = db.read_bytes()
    async with open_store(f"sqlite:///{db}", upgrade=False, snapshot_every=10) as store:
        head = await store.head()
        assert head >= 30
        assert (await store.state_at(position=head)).state == await store.replay(to_position=head)
        await store.diff(1, head)
        assert await store.snapshot_positions() == [] and db.read_bytes() == before
        taken = await store.take_snapshots()
        assert taken == list(range(10, head + 1, 10))
        assert _journal_mode_bytes(db) == b"\x02\x02"


async def test_an_import_into_an_empty_rollback_journal_store_switches_it_first(
    original: Path, tmp_path: Path
) -> None:
    empty = tmp_path / "empty.db"
    async with open_store(f"sqlite:///{empty}"):
        pass
    db = _vacuum_into(empty, tmp_path / "target.db")
    exported = tmp_path / "log.jsonl"
    done = evstore("export", "--db", str(original), "-o", str(exported))
    assert done.returncode == 0, done.stderr
    done = evstore("import", str(exported), "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    assert _journal_mode_bytes(db) == b"\x02\x02"
    audit = evstore("audit", "--db", str(db))
    assert audit.returncode == 0 and "clean" in audit.stdout, audit.stdout + audit.stderr


async def test_a_store_created_in_a_rollback_journal_file_is_in_wal_mode(tmp_path: Path) -> None:
    """A database holding no store yet, in rollback-journal mode: the open creates the store, and
    switches the file to WAL first, ``upgrade=False`` or not."""
    db = tmp_path / "blank.db"
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("CREATE TABLE scratch (x)")
    with conn:
        conn.execute("DROP TABLE scratch")
    conn.close()
    assert _journal_mode_bytes(db) == b"\x01\x01"
    async with open_store(f"sqlite:///{db}", upgrade=False) as store:
        assert await store.head() == 0
    assert _journal_mode_bytes(db) == b"\x02\x02"
