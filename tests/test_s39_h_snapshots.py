"""Stop 39, helper H: what time travel's snapshots cost - how many a question saves."""

from __future__ import annotations

from typing import Any

import pytest

from evstore import AllocationStore, CorruptEvent, open_store
from projections.replay import replay
from projections.snapshots import SNAPSHOT_FORMAT, decode_state
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_projections_support import random_workload


async def test_a_question_saves_only_the_snapshot_that_answers_it_next_time(store: AllocationStore) -> None:
    """Stop 39 (measured): the first question about a log without snapshots saved one at every
    multiple of ``snapshot_every`` on its way - 23 encodings and writes for a question at 232k
    events, 3.6 s of CPU where the fold took 1.6 s. A question now saves the last multiple at or
    before its position (the nearest a next question there starts from); ``take_snapshots`` takes
    the rest. Every answer still equals a replay."""
    store.snapshot_every = 5
    await random_workload(store, seed=11, commands=40)
    head = await store.head()
    assert head >= 30
    position = head - 2 if (head - 2) % 5 else head - 3  # (not a multiple: the save is before it)
    last = position - position % 5
    view = await store.state_at(position=position)
    assert view.state == await replay(store.backend.read, position)
    assert await store.snapshot_positions() == [last]
    # an earlier question folds from the start again, and saves its own
    assert (await store.state_at(position=12)).state == await replay(store.backend.read, 12)
    assert await store.snapshot_positions() == [10, last]
    # a question answered from a snapshot saves none past it but the last before its position
    assert (await store.state_at(position=14)).state == await replay(store.backend.read, 14)
    assert await store.snapshot_positions() == [10, last]
    # diff saves the one for its start
    await store.diff(17, position)
    assert await store.snapshot_positions() == [10, 15, last]
    taken = await store.take_snapshots()
    assert taken == list(range(5, head + 1, 5))
    for p in (1, 5, 9, 10, 21, position, head):
        assert (await store.state_at(position=p)).state == await replay(store.backend.read, p), p


async def test_a_question_answered_from_a_snapshot_it_saved_equals_a_replay(store: AllocationStore) -> None:
    """The snapshot a question saved is what the next question starts from (spied: it is loaded
    and nothing before it is read), and that answer equals a replay."""
    store.snapshot_every = 4
    rp = await make_provider(store, VCPU=100)
    for i in range(12):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1 + i % 3}})
        if i % 4 == 3:
            await store.delete_consumer(consumer)
    head = await store.head()
    await store.state_at(position=head)
    saved = head - head % 4
    assert await store.snapshot_positions() == [saved]
    backend: Any = store.backend
    real = backend.read_payloads
    afters: list[int] = []

    async def spy(after: int, limit: int) -> Any:
        afters.append(after)
        return await real(after, limit)

    backend.read_payloads = spy
    try:
        answer = await store.state_at(position=head)
    finally:
        del backend.read_payloads
    assert afters == ([saved] if saved < head else [])
    assert answer.state == await replay(store.backend.read, head)


async def test_a_hole_after_the_snapshot_a_question_saves_does_not_stop_the_save(store_url: str) -> None:
    """A question folds by replay now, watching the positions for holes (rows deleted by hand):
    one before the snapshot it would save stops the save (test_time_travel.py's hole tests), one
    after it does not - that snapshot was folded from every event up to it."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)  # positions 1, 2
        for _ in range(10):  # 3-12: 1 VCPU each
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.backend.tamper("DELETE FROM events WHERE position = 11")  # type: ignore[attr-defined]
        view = await store.state_at(12)
        assert (view.position, await view.usage(rp)) == (12, {"VCPU": 9})
        assert await store.snapshot_positions() == [10]
        assert await (await store.state_at(12)).usage(rp) == {"VCPU": 9}  # (from it)
        await store.backend.tamper("DELETE FROM events WHERE position = 7")  # type: ignore[attr-defined]
        await store.backend.drop_snapshots()  # type: ignore[attr-defined]
        assert await (await store.state_at(12)).usage(rp) == {"VCPU": 8}
        assert await store.snapshot_positions() == []


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
        found = await backend.load_snapshot(position, SNAPSHOT_FORMAT)
        assert found is not None and found[0] == position
        assert decode_state(found[1]) == await replay(store.backend.read, position), position


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
