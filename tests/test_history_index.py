"""SQLite's history index (``event_entities``) is written in bulk, lagging the log by up to
``HISTORY_LAG`` events (meta ``history_through``); reads look at the newest events themselves.

Whatever the lag, and whoever appended the events (this writer, another connection, an import,
a batch that rolled back), a history read must answer exactly what a scan of the whole log
answers: the events whose ``entities()`` name one of the keys, in ``(after, until]``, up to
``limit``.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import evstore.log.sqlite as sqlite_backend
from evstore import AllocationStore, CorruptEvent, StorageError, open_store
from tests.conftest import make_provider, new_uuid
from tests.test_projections_support import random_workload

pytestmark = pytest.mark.asyncio


async def _truth(store: AllocationStore) -> list[tuple[int, set[str]]]:
    head = await store.head()
    events = await store.backend.read(0, head + 1)
    return [(e.position, e.event.entities()) for e in events]


def _keys(truth: list[tuple[int, set[str]]]) -> list[str]:
    return sorted({k for _, keys in truth for k in keys})


async def _check_reads(store: AllocationStore, rng: random.Random, samples: int = 60) -> None:
    truth = await _truth(store)
    head = truth[-1][0]
    keys = _keys(truth)
    for _ in range(samples):
        wanted = rng.sample(keys, k=min(len(keys), rng.choice([1, 1, 2, 3])))
        after = rng.randint(0, head)
        until = rng.choice([None, rng.randint(after, head + 3)])
        limit = rng.choice([1, 2, 5, 1000])
        last = head if until is None else until
        want = [p for p, names in truth if after < p <= last and names & set(wanted)][:limit]
        got = await store.backend.read_entities(wanted, after, limit, until)
        assert [e.position for e in got] == want, (wanted, after, until, limit)


def _index(path: Path) -> tuple[int, set[tuple[str, int]]]:
    with sqlite3.connect(path) as conn:
        through = int(conn.execute("SELECT value FROM meta WHERE key = 'history_through'").fetchone()[0])
        rows = set(conn.execute("SELECT entity, position FROM event_entities"))
    return through, rows


async def _check_index(store: AllocationStore, path: Path, lag: int) -> None:
    """The index holds exactly the rows of the events through ``history_through``, which lags
    the head by less than ``lag``."""
    truth = await _truth(store)
    through, rows = _index(path)
    assert truth[-1][0] - through < lag
    assert rows == {(k, p) for p, names in truth if p <= through for k in names}


@pytest.mark.parametrize("lag", [1, 3, 7, 50])
@pytest.mark.parametrize("seed", [1, 2])
async def test_reads_equal_a_scan_whatever_the_lag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lag: int, seed: int
) -> None:
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", lag)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, seed, commands=60)
        await _check_index(store, path, lag)
        await _check_reads(store, random.Random(seed))
        # the public view of it
        some = _keys(await _truth(store))[0].split(":", 1)[1]
        mine = [e.position async for e in store.history(some, batch_size=2)]
        truth = await _truth(store)
        assert mine == [p for p, names in truth if {f"consumer:{some}", f"provider:{some}"} & names]


async def test_two_connections_taking_turns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each writer remembers the rows of the events it appended; when the other one appended some
    in between, the lagging part is read back from the events (nothing missing, nothing twice)."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 4)
    path = tmp_path / "s.db"
    url = f"sqlite:///{path}"
    async with open_store(url) as a, open_store(url) as b:
        for seed in range(6):
            await random_workload(a if seed % 2 else b, seed, commands=12)
        await _check_index(a, path, 4)
        await _check_reads(a, random.Random(5))
        await _check_reads(b, random.Random(6))


async def test_a_rolled_back_catch_up_is_done_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch that fails after the catch-up wrote its rows rolls them back with everything else;
    the writer forgets what it remembered and the next catch-up reads the events again."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 5)
    real = sqlite_backend.index_history
    failures = []

    def failing_once(conn: sqlite3.Connection, cache: Any, tail: Any, force: bool = False) -> None:
        real(conn, cache, tail, force)
        caught_up = cache.history_through == tail.position
        if caught_up and not failures and tail.position >= 25:  # (past random_workload's set-up)
            failures.append(tail.position)
            raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(sqlite_backend, "index_history", failing_once)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 3, commands=40)  # (it takes the injected StorageError as a rejection)
        assert failures
        before = await store.head()
        await random_workload(store, 4, commands=40)
        assert await store.head() > before
        await _check_index(store, path, 5)
        await _check_reads(store, random.Random(4))


async def test_import_indexes_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 1000)
    lines: list[str] = []
    async with open_store(f"sqlite:///{tmp_path / 'a.db'}") as store:
        await random_workload(store, 9, commands=40)
        async for line in store.export():
            lines.append(line)
    path = tmp_path / "b.db"
    async with open_store(f"sqlite:///{path}") as store:
        await store.import_events(lambda: lines)
        head = await store.head()
        through, _ = _index(path)
        assert through == head
        await _check_index(store, path, 1)
        await _check_reads(store, random.Random(9))


async def test_a_version_1_store_is_migrated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Schema version 1 wrote every event's history rows with it: opening such a store marks its
    index complete through its head, and version 2 goes on from there."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 1)  # (as version 1 did)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 11, commands=30)
        head = await store.head()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
        conn.execute("DELETE FROM meta WHERE key = 'history_through'")
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 1000)
    async with open_store(f"sqlite:///{path}") as store:
        with sqlite3.connect(path) as conn:
            meta = dict(conn.execute("SELECT key, value FROM meta"))
        assert meta == {"schema_version": str(sqlite_backend.SCHEMA_VERSION), "history_through": str(head)}
        await random_workload(store, 12, commands=30)
        assert await store.head() > head
        await _check_index(store, path, 1000)
        await _check_reads(store, random.Random(11))


DAMAGES = {
    "not json": "UPDATE events SET data = '{not json' WHERE position = ?",
    "ids gone": "UPDATE events SET data = '{\"consumer\": 7}' WHERE position = ?",
    "unknown type": "UPDATE events SET type = 'Teleported' WHERE position = ?",
}


async def _history(store: AllocationStore, uuid: str) -> list[int]:
    return [e.position async for e in store.history(uuid)]


@pytest.mark.parametrize("damage", sorted(DAMAGES))
@pytest.mark.parametrize("appended_by", ["this writer", "another connection"])
async def test_a_damaged_row_fails_only_the_reads_of_its_entities(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str, appended_by: str
) -> None:
    """A row damaged before the index reached it: the catch-up indexes it under the keys its writer
    remembers, else under the ids its text still holds, so reads of those entities fail with
    CorruptEvent (as if the index had reached it first) and no other entity's reads do; restored,
    it is back in its entities' history. (Before the catch-up, a read finds it by the ids in its
    text: a row whose damage erased them is missing from its entities' history until then.)"""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 8)
    path = tmp_path / "s.db"
    url = f"sqlite:///{path}"
    async with open_store(url) as store, open_store(url) as other:
        await random_workload(store, 31, commands=10)
        await random_workload(other if appended_by == "another connection" else store, 32, commands=4)
        truth = await _truth(store)
        victim, names = truth[-1]
        assert _index(path)[0] < victim
        ids = {key.split(":", 1)[1] for key in names}
        bystanders = {key.split(":", 1)[1] for _, keys in truth for key in keys} - ids
        with sqlite3.connect(path) as conn:
            original = conn.execute("SELECT type, data FROM events WHERE position = ?", (victim,)).fetchone()
            conn.execute(DAMAGES[damage], (victim,))
        await random_workload(store, 33, commands=12)  # (the catch-up passes it)
        assert _index(path)[0] > victim
        for uuid in bystanders:
            await _history(store, uuid)  # (no error)
        remembered = appended_by == "this writer" or damage == "unknown type"
        for uuid in ids:
            if remembered:
                with pytest.raises(CorruptEvent, match=f"position {victim}"):
                    await _history(store, uuid)
            else:
                assert victim not in await _history(store, uuid)
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE events SET type = ?, data = ? WHERE position = ?", (*original, victim))
        for uuid in ids:
            assert (victim in await _history(store, uuid)) == remembered
        assert (await store.audit()).clean


async def test_closing_indexes_what_the_store_appended(tmp_path: Path) -> None:
    """A store closed cleanly leaves a complete index: reads after it need no scan."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 41, commands=30)
        head = await store.head()
        assert _index(path)[0] < head
    through, _ = _index(path)
    assert through == head
    async with open_store(f"sqlite:///{path}") as store:
        await _check_index(store, path, 1)
        await _check_reads(store, random.Random(41))


async def test_keys_of_a_rolled_back_batch_are_not_used_for_the_events_another_connection_appends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer remembers the history keys of the events it appends; when their batch rolls
    back, another connection may append different events at those positions: the keys must go."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 60)
    real = sqlite_backend.index_history
    fail = {"armed": False}

    def failing(conn: sqlite3.Connection, cache: Any, tail: Any, force: bool = False) -> None:
        real(conn, cache, tail, force)
        if fail["armed"]:
            fail["armed"] = False
            raise sqlite3.OperationalError("disk I/O error (injected)")

    monkeypatch.setattr(sqlite_backend, "index_history", failing)
    path = tmp_path / "s.db"
    url = f"sqlite:///{path}"
    async with open_store(url) as a, open_store(url) as b:
        await random_workload(a, 51, commands=5)
        rp = await make_provider(a, VCPU=100)
        fail["armed"] = True
        with pytest.raises(StorageError):  # (appended, remembered, rolled back)
            await a.set_allocations(
                new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="X", generation=None
            )
        await random_workload(b, 53, commands=10)
        await random_workload(a, 54, commands=40)  # (a's catch-up covers b's events)
        assert _index(path)[0] > 0
        await _check_index(a, path, 60)
        await _check_reads(a, random.Random(51))


CANCELLED_CLOSE = """
import asyncio, sqlite3, sys, uuid
from evstore import open_store

async def main(path):
    store = await open_store(f"sqlite:///{path}").__aenter__()
    await store.create_provider(str(uuid.uuid4()), "p1")  # (not in the history index yet)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # (another process writing: the flush at close waits)
    try:
        async with asyncio.timeout(0.05):  # (a caller bounding its shutdown)
            await store.close()
    except TimeoutError:
        print("close timed out", flush=True)
    other.execute("ROLLBACK")

asyncio.run(main(sys.argv[1]))  # (cancels the close still running in the background)
print("exiting", flush=True)
"""


async def test_a_close_cancelled_during_the_flush_still_closes_the_connections(tmp_path: Path) -> None:
    """Found by review: a close() cancelled while it flushed the history index left both aiosqlite
    connections open, and their threads (not daemons) kept the process from exiting."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", CANCELLED_CLOSE, str(tmp_path / "s.db")],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "close timed out" in done.stdout and "exiting" in done.stdout


async def test_a_full_rebuild_writes_the_history_index_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: `rebuild --full` is for storage-level damage, 'an index that lost entries', but
    left the history index as it was: with a provider's rows deleted, its history and its
    state_at slice stayed wrong (and the audit stayed clean)."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 5)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 4, commands=80)
        await _check_index(store, path, 5)
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM event_entities WHERE entity LIKE 'provider:%' AND position > 20")
        await store.rebuild(full=True)
        await _check_index(store, path, 1)
        await _check_reads(store, random.Random(4))


async def test_a_history_through_past_the_head_is_not_trusted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: with meta history_through set past the head, reads never looked at the events
    appended after it and the writer never indexed them: their history was empty for good."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 3)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 5, commands=20)
        with sqlite3.connect(path) as conn:
            conn.execute("UPDATE meta SET value = '1000000' WHERE key = 'history_through'")
        store.backend._cache.forget()  # type: ignore[attr-defined]  # (as another process's write would)
        await _check_reads(store, random.Random(5))
        await random_workload(store, 6, commands=20)
        await _check_reads(store, random.Random(6))
        await _check_index(store, path, 3)


async def build(store: AllocationStore, provider: str, vcpu: int) -> None:
    await store.set_allocations(
        new_uuid(),
        {provider: {"VCPU": vcpu}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
    )


@pytest.mark.parametrize("force_rebuild", [False, True])
async def test_events_appended_where_a_lost_tail_was_are_indexed_as_themselves(
    tmp_path: Path, force_rebuild: bool
) -> None:
    """Regression: the log lost its last events (rows deleted, an older copy restored) after the
    history index had covered them. The index kept their rows, and the events appended next at
    the same positions were taken as indexed once the head passed the old ``history_through``:
    a provider's history listed events that never named it and missed its own, and
    ``state_at(provider=)`` answered from them (here: 0 VCPU used where 20 were)."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        old = await make_provider(store, "old", VCPU=100)  # positions 1, 2
        new = await make_provider(store, "new", VCPU=100)  # 3, 4
        for i in range(10):
            # (events of providers only: had they changed consumers, whose rows record their
            # positions, the store would refuse commands until rebuild(force=True), s40 D)
            await store.rename_provider(old, f"old-{i}")
    # (closed: the index covers positions 5-14, all of them on `old`)
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM events WHERE position > 4")
    async with open_store(f"sqlite:///{path}") as store:
        if force_rebuild:
            await store.rebuild(force=True)
        for _ in range(10):  # positions 5-14 again, all of them on `new`
            await build(store, new, 2)
        assert await store.usage(new) == {"VCPU": 20}
        assert await (await store.state_at(14, provider=new)).usage(new) == {"VCPU": 20}
        assert await (await store.state_at(14, provider=old)).usage(old) == {"VCPU": 0}
        assert [e.position async for e in store.history(new)] == list(range(3, 15))
        assert [e.position async for e in store.history(old)] == [1, 2]
        await random_workload(store, 7, commands=30)
        await _check_reads(store, random.Random(7))
    through, rows = _index(path)  # (closed: the index is complete, and holds only what the log holds)
    async with open_store(f"sqlite:///{path}") as store:
        truth = await _truth(store)
    assert through == truth[-1][0]
    assert rows == {(k, p) for p, names in truth for k in names}


async def test_an_import_into_a_store_whose_events_were_deleted_keeps_none_of_their_index(
    tmp_path: Path,
) -> None:
    """Regression: an older export imported back into the file whose log had lost its events
    (deleted by hand: an import needs a store without events) kept the history rows of the
    events that were gone; once the events appended after the import were indexed, a provider's
    history listed them although they never named it."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        old = await make_provider(store, "old", VCPU=100)  # positions 1, 2
        new = await make_provider(store, "new", VCPU=100)  # 3, 4
        lines = [line async for line in store.export()]
        for _ in range(10):  # positions 5-14, on `old`
            await build(store, old, 1)
    with sqlite3.connect(path) as conn:
        conn.execute("DELETE FROM events")
    async with open_store(f"sqlite:///{path}") as store:
        await store.import_events(lambda: lines)
        for _ in range(10):  # positions 5-14 again, on `new`
            await build(store, new, 2)
    async with open_store(f"sqlite:///{path}") as store:  # (closed: indexed through the head)
        assert [e.position async for e in store.history(old)] == [1, 2]
        assert [e.position async for e in store.history(new)] == list(range(3, 15))
        await _check_index(store, path, 1)


async def test_a_writer_does_not_index_another_process_events_with_the_keys_of_its_lost_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a writer keeps the history keys of the events it appended until the index
    takes them (``_WriterCache.own``). The log lost those events (rows deleted by hand, an older
    copy restored) while it was open, another process appended its own at the same positions and
    ended without indexing them (killed); the writer's next catch-up (here: its close) indexed
    the other process's events under the vanished events' keys - the history of ``new`` missed
    them, and that of ``old`` listed events that never named it."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        old = await make_provider(store, "old", VCPU=100)  # positions 1, 2
        new = await make_provider(store, "new", VCPU=100)  # 3, 4
        for i in range(6):  # 5-10: this writer's, not indexed yet (the lag); of a provider only
            # (events that changed consumers would be seen lost: commands refused, s40 D)
            await store.rename_provider(old, f"old-{i}")
        with sqlite3.connect(path) as conn:
            conn.execute("DELETE FROM events WHERE position > 4")
        with monkeypatch.context() as killed:  # (the other process ends without its close)
            killed.setattr(sqlite_backend, "flush_history", lambda conn, cache: None)
            async with open_store(f"sqlite:///{path}") as other:
                for _ in range(6):
                    await build(other, new, 2)  # 5-10 again, all of them on `new`
        await build(store, new, 2)  # 11
    through, rows = _index(path)
    async with open_store(f"sqlite:///{path}") as store:
        truth = await _truth(store)
        assert [e.position async for e in store.history(new)] == list(range(3, 12))
        assert [e.position async for e in store.history(old)] == [1, 2]
    assert through == 11
    assert rows == {(k, p) for p, names in truth for k in names}
