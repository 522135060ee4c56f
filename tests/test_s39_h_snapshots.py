"""Stop 39, helpers H and I: what time travel's snapshots cost - a question saves every multiple on
its way, folded by replay; each position's snapshot and slices in one transaction."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, CorruptEvent, StorageError, open_store
from projections.replay import replay
from projections.snapshots import load_snapshot_state
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_projections_support import random_workload


def _spy_on_payload_reads(store: AllocationStore, afters: list[int]) -> None:
    """Note where each payload read of ``store`` starts (undone by ``del backend.read_payloads``)."""
    backend: Any = store.backend
    real = backend.read_payloads

    async def spy(after: int, limit: int) -> Any:
        afters.append(after)
        return await real(after, limit)

    backend.read_payloads = spy


async def test_a_question_saves_every_multiple_on_its_way(store: AllocationStore) -> None:
    """The first question about a log without snapshots saves one at every multiple of
    ``snapshot_every`` on its way (helper H's ee543a5 saved only the last: a user asking at random
    positions, without take_snapshots, then folded a question at a lower position from the start
    again - the issue's target, the whole store at any position of a 1M-event log in <= 1 s, relies
    on the first question's snapshots). It folds by replay (payload rows read ahead) to each in
    turn; a later, lower question starts from the nearest of them; every answer equals a replay."""
    store.snapshot_every = 5
    await random_workload(store, seed=11, commands=40)
    head = await store.head()
    assert head >= 30
    position = head - 2 if (head - 2) % 5 else head - 3  # (not a multiple)
    view = await store.state_at(position=position)
    assert view.state == await replay(store.backend.read, position)
    on_its_way = list(range(5, position + 1, 5))
    assert await store.snapshot_positions() == on_its_way
    afters: list[int] = []
    _spy_on_payload_reads(store, afters)
    try:
        # a lower question starts from the nearest snapshot the first one saved, and saves none
        assert (await store.state_at(position=12)).state == await replay(store.backend.read, 12)
    finally:
        del store.backend.read_payloads  # type: ignore[attr-defined]
    assert afters == [10]
    assert await store.snapshot_positions() == on_its_way
    # diff's start is a question too; take_snapshots takes the rest, to the head
    await store.diff(17, position)
    assert await store.snapshot_positions() == on_its_way
    taken = await store.take_snapshots()
    assert taken == list(range(5, head + 1, 5))
    for p in (1, 5, 9, 10, 21, position, head):
        assert (await store.state_at(position=p)).state == await replay(store.backend.read, p), p


async def test_every_snapshot_a_question_saves_decodes_to_a_replay_to_its_position(
    store: AllocationStore,
) -> None:
    """A question folds by replay to each multiple in turn (the first stretch with its usage
    recounted once at the end), and saves each: decoded, each is the replay's state there. The
    next question at the head starts from the last one (spied: nothing before it is read)."""
    store.snapshot_every = 4
    rp = await make_provider(store, VCPU=100)
    for i in range(12):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1 + i % 3}})
        if i % 4 == 3:
            await store.delete_consumer(consumer)
    head = await store.head()
    await store.state_at(position=head)
    saved = list(range(4, head + 1, 4))
    assert await store.snapshot_positions() == saved
    backend: Any = store.backend
    for position in saved:
        found = await load_snapshot_state(backend, position)  # (with its chain of tombstones)
        assert found is not None and found.position == position
        assert found == await replay(store.backend.read, position), position
    afters: list[int] = []
    _spy_on_payload_reads(store, afters)
    try:
        answer = await store.state_at(position=head)
    finally:
        del backend.read_payloads
    assert afters == ([saved[-1]] if saved[-1] < head else [])
    assert answer.state == await replay(store.backend.read, head)


async def test_a_hole_stops_a_questions_saves_after_it_not_before(store_url: str) -> None:
    """A question folds by replay, watching the positions for holes (rows deleted by hand): the
    snapshots before a hole are saved (each was folded from every event up to it), none at or
    after it, and the question itself is refused at the hole (since stop 40: it answered over it)."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)  # positions 1, 2
        for _ in range(10):  # 3-12: 1 VCPU each
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.backend.tamper("DELETE FROM events WHERE position = 11")  # type: ignore[attr-defined]
        with pytest.raises(CorruptEvent, match="Position 11 is missing"):
            await store.state_at(12)
        assert await store.snapshot_positions() == [5, 10]
        view = await store.state_at(10)  # (from the snapshot there)
        assert (view.position, await view.usage(rp)) == (10, {"VCPU": 8})
        await store.backend.tamper("DELETE FROM events WHERE position = 7")  # type: ignore[attr-defined]
        await store.backend.drop_snapshots()  # type: ignore[attr-defined]
        with pytest.raises(CorruptEvent, match="Position 7 is missing"):
            await store.state_at(12)
        assert await store.snapshot_positions() == [5]


async def test_every_snapshot_take_snapshots_saves_decodes_to_a_replay_to_its_position(
    store: AllocationStore,
) -> None:
    """take_snapshots folds by replay now, to each multiple in turn (the first stretch with its
    usage recounted once at the end): each snapshot it saved, decoded, is the replay's state there."""
    store.snapshot_every = 7
    await random_workload(store, seed=23, commands=50)
    head = await store.head()
    taken = await store.take_snapshots()
    assert taken == list(range(7, head + 1, 7))
    backend: Any = store.backend
    for position in taken:
        found = await load_snapshot_state(backend, position)  # (with its chain of tombstones)
        assert found is not None and found.position == position
        assert found == await replay(store.backend.read, position), position


async def test_take_snapshots_says_where_a_hole_after_its_last_snapshot_is(store_url: str) -> None:
    """A hole past the last multiple still fails take_snapshots (asked to, it checks the log it
    folds), after the snapshots before it are saved."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)  # positions 1, 2
        for _ in range(10):  # 3-12
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.backend.tamper("DELETE FROM events WHERE position = 11")  # type: ignore[attr-defined]
        with pytest.raises(CorruptEvent, match=r"Position 11 is missing .* next event is at 12"):
            await store.take_snapshots()
        assert await store.snapshot_positions() == [5, 10]


async def test_a_failure_between_a_positions_slices_leaves_nothing_of_it(tmp_path: Path) -> None:
    """Regression (stop 39, helper I): SQLite wrote a position's whole-store snapshot, then each
    provider's slice, each in a transaction of its own (an fsync each: 40 providers' slices were
    most of take_snapshots' write time). A failure between them (a crash, a full disk; injected
    here at the second provider's slice) left the snapshot and the first slices written. They are
    one transaction now: all of a position, or nothing of it."""
    db = tmp_path / "s.db"
    async with open_store(f"sqlite:///{db}", snapshot_every=5) as store:
        first, second = sorted([await make_provider(store, VCPU=100), await make_provider(store, VCPU=100)])
        for _ in range(8):  # 5-12
            await allocate(store, new_uuid(), {first: {"VCPU": 1}, second: {"VCPU": 1}})
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper(
            f"CREATE TRIGGER refuse BEFORE INSERT ON provider_snapshots WHEN NEW.provider = '{second}' "
            "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
        )
        with pytest.raises(StorageError, match="injected failure"):
            await store.take_snapshots()
        assert await store.snapshot_positions() == []
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT count(*) FROM provider_snapshots").fetchone() == (0,)
        # a question goes on without saving (a cache), its answer a replay's
        assert (await store.state_at(12)).state == await replay(store.backend.read, 12)
        assert await store.snapshot_positions() == []
        await tamper("DROP TRIGGER refuse")
        assert await store.take_snapshots() == [5, 10]
        with sqlite3.connect(db) as conn:
            rows = conn.execute(
                "SELECT position, count(*) FROM provider_snapshots GROUP BY position"
            ).fetchall()
        assert rows == [(5, 2), (10, 2)]
