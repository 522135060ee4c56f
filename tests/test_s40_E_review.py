"""Review of 2e13b0b (time travel's snapshots share what holds nothing, SNAPSHOT_FORMAT 6).

A whole-store snapshot now leans on a chain of tombstone segments; a snapshot whose chain is
broken is not used. These tests look for an answer that differs from a replay, and for snapshots
saved that can never be used (or are never saved again), across saves skipped, concurrent folds
with other intervals, drops, rebuilds and random logs.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import structlog

from evstore import AllocationStore, open_store
from evstore.errors import ConcurrentUpdate, ConsumerDeleted, EvstoreError, InvalidInput, NotFound
from projections import snapshots
from projections.replay import replay
from projections.snapshots import load_snapshot_state
from tests.conftest import allocate, make_provider, new_uuid


async def _tombstones(store: AllocationStore, count: int) -> str:
    rp = await make_provider(store, VCPU=1000)
    for _ in range(count):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.delete_consumer(consumer)
    return rp


async def _unusable_snapshots(store: AllocationStore) -> list[int]:
    """The snapshot positions whose snapshot, with its chain, cannot be used."""
    backend: Any = store.backend
    found = []
    for p in await store.snapshot_positions():
        with structlog.testing.capture_logs() as logs:
            state = await load_snapshot_state(backend, p)
        if state is None or state.position != p or any(e["event"] == "snapshot.unreadable" for e in logs):
            found.append(p)
    return found


async def test_a_question_past_a_snapshot_whose_chain_broke_saves_it_again(store: AllocationStore) -> None:
    """Two processes with different intervals: one took snapshots every 2, the other folds from the
    start every 5 and saves its own segment at 10, which the first one's chain ran through. The
    first one's snapshots at 12, 14, ... are then unusable; a question at 13 of the process folding
    every 5 finds 12, cannot use it, folds from the start and saves 5 and 10 again - but not 12,
    which no fold of interval 5 ever saves, and take_snapshots counts as taken. Every later question
    there folded from position 0 again, for good (the commit says "the chain saved again")."""
    store.snapshot_every = 2
    await _tombstones(store, 10)
    head = await store.head()
    await store.take_snapshots()
    backend: Any = store.backend
    await snapshots.fold_to(backend, head, every=5, start_at=0)  # (the other process)
    store.snapshot_every = 5
    assert (await store.state_at(13)).state == await replay(store.backend.read, 13)
    with structlog.testing.capture_logs() as logs:
        assert (await store.state_at(13)).state == await replay(store.backend.read, 13)
    assert [e for e in logs if e["event"] == "snapshot.unreadable"] == []
    for p in range(await store.head() + 1):
        assert (await store.state_at(p)).state == await replay(store.backend.read, p), p


async def test_take_snapshots_saves_again_those_whose_chain_broke(store: AllocationStore) -> None:
    """take_snapshots counted a snapshot whose chain broke (its event unchanged) as taken, and
    left it: after it, snapshots it listed could not be used."""
    store.snapshot_every = 2
    await _tombstones(store, 10)
    head = await store.head()
    await store.take_snapshots()
    backend: Any = store.backend
    await snapshots.fold_to(backend, head, every=5, start_at=0)  # (another process's fold)
    assert await _unusable_snapshots(store) == [p for p in range(12, head + 1, 2) if p % 10]
    await store.take_snapshots()
    assert await _unusable_snapshots(store) == []


async def test_a_snapshot_save_skipped_does_not_extend_the_chain(tmp_path: Path) -> None:
    """SQLite leaves a snapshot on the way to an answer unsaved (without an error) while the file
    is in rollback-journal mode - a ``VACUUM INTO`` copy opened to read - until the first write
    switches it to WAL. The fold extended its chain in memory all the same, so the snapshots it
    saved once a command in the same process had switched the file named segments never saved:
    unusable from the moment they were saved."""
    source = tmp_path / "source.db"
    async with open_store(f"sqlite:///{source}") as s:
        rp = await _tombstones(s, 8)
    copy = tmp_path / "copy.db"
    conn = sqlite3.connect(source)
    try:
        conn.execute("VACUUM INTO ?", (str(copy),))
    finally:
        conn.close()
    async with open_store(f"sqlite:///{copy}", upgrade=False) as store:
        head = await store.head()
        backend: Any = store.backend
        assert backend._wal_deferred  # (the rollback-journal file: saves on the way are skipped)
        written = False

        class Reads:
            """The backend, but a command of this process runs while the fold reads past 5."""

            def __getattr__(self, name: str) -> Any:
                return getattr(backend, name)

            async def read_payloads(self, after: int, limit: int) -> list[Any]:
                nonlocal written
                if after >= 5 and not written:
                    written = True
                    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # (switches the file to WAL)
                return list(await backend.read_payloads(after, limit))

        state = await snapshots.fold_to(Reads(), head, every=2, batch_size=1)  # type: ignore[arg-type]
        assert written and not backend._wal_deferred
        assert state == await replay(store.backend.read, head)
        assert await store.snapshot_positions()  # (some were saved once the file was switched)
        assert await _unusable_snapshots(store) == []


async def test_a_save_that_failed_leaves_the_chain_as_it_was(store: AllocationStore) -> None:
    """A save that raises (a busy lock, a full disk) on the way to an answer: the fold goes on
    without saving, and what it saved before stays usable."""
    store.snapshot_every = 3
    await _tombstones(store, 8)
    head = await store.head()
    backend: Any = store.backend
    calls = 0

    class Failing:
        def __getattr__(self, name: str) -> Any:
            attr = getattr(backend, name)
            if name not in ("save_snapshot", "save_provider_snapshots"):
                return attr

            async def save(*args: Any, **kwargs: Any) -> Any:
                nonlocal calls
                calls += 1
                if calls == 3:
                    raise EvstoreError("disk full")
                return await attr(*args, **kwargs)

            return save

    await snapshots.fold_to(Failing(), head, every=3)  # type: ignore[arg-type]
    assert calls == 3
    assert await store.snapshot_positions() == [3, 6]
    assert await _unusable_snapshots(store) == []
    assert (await store.state_at(head)).state == await replay(store.backend.read, head)


async def test_a_drop_under_a_fold_breaks_no_answer(store: AllocationStore) -> None:
    """A rebuild (or drop_snapshots) while take_snapshots folds drops the segments its chain ran
    through; the snapshots it saves after that are unusable. The answers stay right: each is
    folded from the log (here: checked at every position)."""
    store.snapshot_every = 2
    await _tombstones(store, 8)
    head = await store.head()
    backend: Any = store.backend
    dropped = False

    class Dropping:
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        async def read_payloads(self, after: int, limit: int) -> list[Any]:
            nonlocal dropped
            if after >= 7 and not dropped:
                dropped = True
                await backend.drop_snapshots()
            return list(await backend.read_payloads(after, limit))

    await snapshots.fold_to(Dropping(), head, every=2, batch_size=1)  # type: ignore[arg-type]
    assert dropped
    for p in range(head + 1):
        assert (await store.state_at(p)).state == await replay(store.backend.read, p), p


# --- random logs, two processes with different intervals --------------------------------------


async def _random_run(url: str, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    async with open_store(url, snapshot_every=3) as a, open_store(url, snapshot_every=5) as b:
        handles = [a, b]
        rp = await make_provider(a, VCPU=10_000)
        alive: list[str] = []
        migrating: dict[str, str] = {}  # migration -> instance
        deleted: list[str] = []
        for step in range(steps):
            s = rng.choice(handles)
            roll = rng.random()
            try:
                if roll < 0.3 or not alive:
                    c = new_uuid() if not deleted or rng.random() < 0.9 else rng.choice(deleted)
                    await allocate(s, c, {rp: {"VCPU": rng.randint(1, 3)}})
                    alive.append(c)
                elif roll < 0.45:
                    c = alive.pop(rng.randrange(len(alive)))
                    await s.delete_consumer(c)
                    deleted.append(c)
                elif roll < 0.52:
                    c = alive.pop(rng.randrange(len(alive)))
                    await s.release(c)
                elif roll < 0.6:
                    inst = rng.choice(alive)
                    if inst not in migrating.values() and inst not in migrating:
                        m = new_uuid()
                        await s.start_migration(inst, m)
                        migrating[m] = inst
                        alive.append(m)
                elif roll < 0.66 and migrating:
                    m = rng.choice(list(migrating))
                    inst = migrating.pop(m)
                    if m in alive:
                        alive.remove(m)
                    if rng.random() < 0.5:
                        await s.confirm_migration(m)
                    else:
                        await s.revert_migration(m)
                elif roll < 0.8:
                    head = await s.head()
                    p = rng.randint(0, head)
                    got = (await s.state_at(p)).state
                    assert got == await replay(s.backend.read, p), (seed, step, p)
                elif roll < 0.86:
                    await s.take_snapshots()
                elif roll < 0.88:
                    await s.backend.drop_snapshots()  # type: ignore[attr-defined]
                elif roll < 0.9:
                    await s.rebuild()
                else:
                    # questions of both processes at once, and a take_snapshots
                    head = await s.head()
                    ps = [rng.randint(0, head) for _ in range(3)]
                    got = await asyncio.gather(
                        a.state_at(ps[0]), b.state_at(ps[1]), a.state_at(ps[2]), b.take_snapshots()
                    )
                    for p, view in zip(ps, got[:3], strict=True):
                        assert view.state == await replay(s.backend.read, p), (seed, step, p)
            except (NotFound, ConsumerDeleted, ConcurrentUpdate, InvalidInput):
                continue  # (a command the random walk got wrong: refused, nothing written)
        head = await a.head()
        for p in range(head + 1):
            want = await replay(a.backend.read, p)
            assert (await a.state_at(p)).state == want, (seed, p)
            assert (await b.state_at(p)).state == want, (seed, p)


@pytest.mark.parametrize("seed", range(4))
async def test_random_logs_two_intervals_state_at_equals_replay(
    backend_name: str, tmp_path: Path, seed: int
) -> None:
    from tests.test_s39_c_reads import _url

    await asyncio.wait_for(_random_run(_url(backend_name, tmp_path, f"r{seed}"), seed, 150), 300)


# --- random logs an older writer wrote ----------------------------------------------------------


async def _legacy_run(backend_name: str, tmp_path: Path, seed: int) -> None:
    """A log of evstore's own commands, then an older writer's rows at random: allocations
    written for deleted consumers and for migrations kept for their link, writes that empty them,
    releases, second deletes. Imported, its snapshots taken and asked in random order by two
    processes with different intervals: state_at equals a replay at every position."""
    from tests.test_audit_findings import append_row, chained
    from tests.test_s39_c_reads import _url
    from tests.test_s47_E_impossible_history import importable

    rng = random.Random(seed)
    async with open_store(_url(backend_name, tmp_path, f"a{seed}")) as a:
        rp = await make_provider(a, VCPU=10_000)
        known: list[str] = []
        for _ in range(12):
            inst = new_uuid()
            await allocate(a, inst, {rp: {"VCPU": 2}})
            known.append(inst)
            if rng.random() < 0.4:
                mig = new_uuid()
                await a.start_migration(inst, mig)
                known.append(mig)
            if rng.random() < 0.6:
                await a.delete_consumer(inst)  # (a migration of it is kept for its link)
        lines = [line async for line in a.export()]
        [last] = await a.backend.read_raw(await a.head() - 1, 1)
    for _ in range(40):
        c = rng.choice(known)
        roll = rng.random()
        if roll < 0.45:
            held = {rp: {"VCPU": rng.randint(1, 3)}} if rng.random() < 0.7 else {}
            data: dict[str, Any] = {
                "consumer": c,
                "allocations": held,
                "consumer_type": "INSTANCE",
                "generation": rng.randint(1, 9),
                "project_id": "pa",
                "user_id": "ua",
            }
            last = chained(last, "AllocationsReplaced", data)
        elif roll < 0.7:
            last = chained(last, "AllocationsReleased", {"consumer": c, "released": {}})
        elif roll < 0.85:
            last = chained(
                last, "ConsumerDeleted", {"consumer": c, "released": {}, "migrations_released": {}}
            )
        else:
            c = new_uuid()
            known.append(c)
            data = {
                "consumer": c,
                "allocations": {rp: {"VCPU": 1}},
                "consumer_type": "INSTANCE",
                "generation": 1,
                "project_id": "pa",
                "user_id": "ua",
            }
            last = chained(last, "AllocationsReplaced", data)
        append_row(lines, last)
    url = _url(backend_name, tmp_path, f"b{seed}")
    async with open_store(url, snapshot_every=2) as b:
        # (stop 47: an import refuses a release of a consumer holding nothing, which the random
        # rows write; importable drops those)
        await b.import_events(lambda: iter(importable(lines)))
    async with (
        open_store(url, snapshot_every=rng.choice([2, 3])) as b,
        open_store(url, snapshot_every=5) as c2,
    ):
        head = await b.head()
        for _ in range(12):
            s = rng.choice([b, c2])
            if rng.random() < 0.3:
                await s.take_snapshots()
            else:
                p = rng.randint(0, head)
                assert (await s.state_at(p)).state == await replay(s.backend.read, p), (seed, p)
        for p in range(head + 1):
            want = await replay(b.backend.read, p)
            assert (await b.state_at(p)).state == want, (seed, p)
            assert (await c2.state_at(p)).state == want, (seed, p)


@pytest.mark.parametrize("seed", range(4))
async def test_random_older_writer_logs_state_at_equals_replay(
    backend_name: str, tmp_path: Path, seed: int
) -> None:
    await asyncio.wait_for(_legacy_run(backend_name, tmp_path, seed), 300)
