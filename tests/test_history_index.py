"""SQLite's history index (``event_entities``) is written in bulk, lagging the log by up to
``HISTORY_LAG`` events (meta ``history_through``); reads look at the newest events themselves.

Whatever the lag, and whoever appended the events (this writer, another connection, an import,
a batch that rolled back), a history read must answer exactly what a scan of the whole log
answers: the events whose ``entities()`` name one of the keys, in ``(after, until]``, up to
``limit``.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest

import evstore.log.sqlite as sqlite_backend
from evstore import AllocationStore, CorruptEvent, open_store
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

    def failing_once(conn: sqlite3.Connection, cache: Any, start: int, tail: Any) -> None:
        real(conn, cache, start, tail)
        caught_up = cache.history_through == tail.position
        if caught_up and not failures and start >= 20:  # (past random_workload's set-up, which must not fail)
            failures.append(start)
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


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE events SET data = '{not json' WHERE position = ?",
        "UPDATE events SET data = '{\"consumer\": 7}' WHERE position = ?",
    ],
)
async def test_a_damaged_row_fails_history_reads_indexed_or_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """Whose a damaged row was cannot be told once its text is gone: a history read over it fails
    with CorruptEvent naming it, before the index reaches it and after (the catch-up marks it)."""
    monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", 5)
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await random_workload(store, 21, commands=20)
        truth = await _truth(store)
        victim = truth[-1][0]  # (not indexed yet: the index lags)
        some = sorted(next(iter(names)) for p, names in truth if p < victim)[0].split(":", 1)[1]
        assert _index(path)[0] < victim
        with sqlite3.connect(path) as conn:
            conn.execute(damage, (victim,))
        for seed in (22, 23):
            with pytest.raises(CorruptEvent, match=f"position {victim}") as info:
                [e async for e in store.history(some)]
            assert info.value.code == "evstore.log.corrupt"
            # reads that end before it are not affected
            assert await store.backend.read_entities(
                [f"consumer:{some}", f"provider:{some}"], 0, 1000, victim - 1
            )
            await random_workload(store, seed, commands=10)  # (the catch-up passes it)
        through, rows = _index(path)
        assert through > victim and (sqlite_backend.DAMAGED_KEY, victim) in rows
