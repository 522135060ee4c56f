"""Stop 40: time travel's snapshots share their tombstones instead of copying them.

A deleted consumer that holds nothing is saved once, in the tombstone segment of the first
snapshot after its delete; every later snapshot leaves it out while it is unchanged, and names the
chain of segments that holds it (each link checked by the digest of the segment it names). Until
this stop every whole-store snapshot re-encoded every tombstone so far, so the snapshots of a log
grew with its square (151.9 MB for 30 snapshots of a 309,699-event log, 0.92x its events table).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import structlog

from evstore import AllocationStore, open_store
from projections import snapshots
from projections.replay import replay
from projections.snapshots import SNAPSHOT_FORMAT, load_snapshot_state
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import append_row, chained


async def _every_position_equals_a_replay(store: AllocationStore) -> None:
    head = await store.head()
    for p in range(head + 1):
        assert (await store.state_at(p)).state == await replay(store.backend.read, p), p


async def test_each_tombstone_is_saved_once_not_in_every_snapshot_after_its_delete(
    store: AllocationStore,
) -> None:
    """Regression: with SNAPSHOT_FORMAT 5 a consumer deleted early was encoded again in every
    snapshot after its delete (the first one here in all 9); now once, in one segment. Every
    snapshot, decoded with its chain, is the replay's state at its position."""
    store.snapshot_every = 5
    rp = await make_provider(store, VCPU=1000)
    deleted: dict[str, int] = {}  # consumer -> its delete's position
    for i in range(30):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        if i % 2:
            deleted[consumer] = (await store.delete_consumer(consumer)).positions[-1]
    head = await store.head()
    taken = await store.take_snapshots()
    assert taken == list(range(5, head + 1, 5))
    backend: Any = store.backend
    segments = await backend.load_tombstones(head, SNAPSHOT_FORMAT)
    assert [p for p, _ in segments] == taken  # (a segment with each snapshot, in order)
    wholes = {p: (await backend.load_snapshot(p, SNAPSHOT_FORMAT))[1] for p in taken}
    for consumer, at in deleted.items():
        if at > taken[-1]:
            continue
        # in one segment (the first snapshot's after its delete), in no snapshot from its delete on
        assert sum(text.count(consumer) for _, text in segments) == 1, consumer
        assert [p for p, text in wholes.items() if consumer in text and p >= at] == [], consumer
    for position in taken:
        found = await load_snapshot_state(backend, position)
        assert found is not None and found.position == position
        assert found == await replay(store.backend.read, position), position
        tombstones = {c.uuid for c in found.consumers.values() if c.deleted}
        assert tombstones == {c for c, at in deleted.items() if at <= position}, position
    await _every_position_equals_a_replay(store)


async def test_segments_are_not_snapshot_positions_and_go_with_the_snapshots(store: AllocationStore) -> None:
    """A segment is kept in the snapshots table at minus its position: not listed as a snapshot,
    dropped with the snapshots (drop_snapshots, rebuild)."""
    store.snapshot_every = 3
    rp = await make_provider(store, VCPU=100)
    for _ in range(5):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.delete_consumer(consumer)
    head = await store.head()
    taken = await store.take_snapshots()
    assert taken == await store.snapshot_positions() == list(range(3, head + 1, 3))
    assert (await store.stats())["snapshot_positions"] == taken
    backend: Any = store.backend
    segments = await backend.load_tombstones(head, SNAPSHOT_FORMAT)
    assert sorted(p for p, _ in segments) == taken
    await store.rebuild()
    assert await store.snapshot_positions() == []
    assert await backend.load_tombstones(head, SNAPSHOT_FORMAT) == []
    await store.take_snapshots()
    await backend.drop_snapshots()
    assert await backend.load_tombstones(head, SNAPSHOT_FORMAT) == []


async def test_a_tombstone_an_older_writer_changed_is_right_at_every_position(
    backend_name: str, tmp_path: Path
) -> None:
    """An older writer's log gives allocations to a consumer after its delete (bug 1848343's
    shape), and ``release`` clears them: the tombstone a segment holds changed, so the snapshots
    after it keep the consumer in full (it wins over the chain), including once it holds nothing
    again with another generation. state_at equals a replay at every position."""
    from tests.test_s39_c_reads import _url

    async with open_store(_url(backend_name, tmp_path, "a")) as a:
        rp = await make_provider(a, VCPU=100)
        ghost = new_uuid()
        await allocate(a, ghost, {rp: {"VCPU": 2}})
        await a.delete_consumer(ghost)
        for _ in range(4):
            await allocate(a, new_uuid(), {rp: {"VCPU": 1}})
        lines = [line async for line in a.export()]
        [last] = await a.backend.read_raw(await a.head() - 1, 1)
    data = {
        "consumer": ghost,
        "allocations": {rp: {"VCPU": 3}},
        "consumer_type": "INSTANCE",
        "generation": 5,
        "project_id": "pa",
        "user_id": "ua",
    }
    append_row(lines, chained(last, "AllocationsReplaced", data))
    async with open_store(_url(backend_name, tmp_path, "b"), snapshot_every=2) as b:
        await b.import_events(lambda: iter(lines))
        changed_at = await b.head()
        await b.take_snapshots()  # (the ghost's tombstone is in the segment at 4; it changed at 9)
        for _ in range(3):
            await allocate(b, new_uuid(), {rp: {"VCPU": 1}})
        await b.release(ghost)  # (the leak cleared: a tombstone again, not as its segment has it)
        for _ in range(3):
            await allocate(b, new_uuid(), {rp: {"VCPU": 1}})
        await b.take_snapshots()
        backend: Any = b.backend
        for position in await b.snapshot_positions():
            found = await backend.load_snapshot(position, SNAPSHOT_FORMAT)
            whole = found[1]
            # (the segments hold it once; from its change on, each snapshot holds it in full)
            assert (ghost in whole) == (position >= changed_at), position
        await _every_position_equals_a_replay(b)
        assert (await b.state_at(await b.head())).state.consumers[ghost].deleted


async def test_a_snapshot_whose_chain_lost_a_segment_is_not_used(store: AllocationStore) -> None:
    """A segment missing (deleted by hand) or altered: the snapshots whose chain needs it are
    not used (logged), the answer is folded from the log, and the fold saves them again."""
    store.snapshot_every = 4
    rp = await make_provider(store, VCPU=100)
    for _ in range(8):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.delete_consumer(consumer)
    head = await store.head()
    await store.take_snapshots()
    backend: Any = store.backend
    await backend.tamper("DELETE FROM snapshots WHERE position = -8")
    with structlog.testing.capture_logs() as logs:
        assert (await store.state_at(head)).state == await replay(store.backend.read, head)
    unreadable = [e for e in logs if e["event"] == "snapshot.unreadable"]
    assert unreadable and "position 8 is missing" in unreadable[0]["error"], logs
    # (saved again on the way: the next answer starts from the latest snapshot)
    found = await load_snapshot_state(backend, head)
    assert found is not None and found == await replay(store.backend.read, found.position)
    segments = dict(await backend.load_tombstones(head, SNAPSHOT_FORMAT))
    altered = segments[12].replace('"since":8', '"since":4')
    await backend.tamper("UPDATE snapshots SET state = ? WHERE position = -12", (altered,))
    with structlog.testing.capture_logs() as logs:
        assert (await store.state_at(head)).state == await replay(store.backend.read, head)
    assert any(e["event"] == "snapshot.unreadable" for e in logs), logs


async def test_a_fold_with_another_interval_replacing_a_segment_breaks_no_answer(
    store: AllocationStore,
) -> None:
    """Two folds of one log with different intervals (two processes with different
    ``snapshot_every``) save different segments at a position both save: the later replaces the
    earlier, with its own snapshot there. A snapshot of the other fold whose chain ran through the
    replaced segment is then not used (its link's digest no longer matches) instead of decoded
    with tombstones it did not leave out; every answer equals a replay."""
    store.snapshot_every = 3
    rp = await make_provider(store, VCPU=1000)
    for i in range(20):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        if i % 3:
            await store.delete_consumer(consumer)
    head = await store.head()
    assert head >= 30
    await store.take_snapshots()  # (every 3: 3, 6, ..., 15, 18, ...)
    backend: Any = store.backend
    before = dict(await backend.load_tombstones(head, SNAPSHOT_FORMAT))
    # another process's fold with an interval of 5, from the start: saves 5, 10, 15, ... anew
    await snapshots.fold_to(backend, head, every=5, start_at=0)
    after = dict(await backend.load_tombstones(head, SNAPSHOT_FORMAT))
    assert after[15] != before[15] and after[18] == before[18]
    digest = hashlib.sha256(after[15].encode()).hexdigest()
    assert digest not in after[18]  # (18's link names the segment it was saved after: 15's first)
    with structlog.testing.capture_logs() as logs:
        assert (await store.state_at(19)).state == await replay(store.backend.read, 19)
    assert any(e["event"] == "snapshot.unreadable" and "was replaced" in e["error"] for e in logs), logs
    await _every_position_equals_a_replay(store)


async def test_a_migration_kept_for_its_link_then_forgotten_does_not_come_back(
    backend_name: str, tmp_path: Path
) -> None:
    """A migration its instance's delete left holding nothing is kept for the link (a later
    revert must learn the instance is gone): a segment shares it as it shares tombstones. Once a
    write empties it for good (here an older writer's, Nova's move_allocations), the state forgets
    it, and so must the chain: the next segment lists it as gone, or every later snapshot,
    decoded, would bring it back."""
    from tests.test_s39_c_reads import _url

    async with open_store(_url(backend_name, tmp_path, "a")) as a:
        rp = await make_provider(a, VCPU=100)
        instance, migration = new_uuid(), new_uuid()
        await allocate(a, instance, {rp: {"VCPU": 2}})
        await a.start_migration(instance, migration)
        await a.delete_consumer(instance)  # (the migration's allocations go with it; the link stays)
        for _ in range(3):
            await allocate(a, new_uuid(), {rp: {"VCPU": 1}})
        kept = (await a.replay()).consumers[migration]
        assert not kept.allocations and kept.on_behalf_of == instance
        lines = [line async for line in a.export()]
        [last] = await a.backend.read_raw(await a.head() - 1, 1)
    data = {
        "consumer": migration,
        "allocations": {},
        "consumer_type": "MIGRATION",
        "generation": 1,
        "project_id": "pa",
        "user_id": "ua",
    }
    append_row(lines, chained(last, "AllocationsReplaced", data))
    async with open_store(_url(backend_name, tmp_path, "b"), snapshot_every=2) as b:
        await b.import_events(lambda: iter(lines))
        forgotten_at = await b.head()
        for _ in range(4):
            await allocate(b, new_uuid(), {rp: {"VCPU": 1}})
        await b.take_snapshots()
        backend: Any = b.backend
        segments = dict(await backend.load_tombstones(await b.head(), SNAPSHOT_FORMAT))
        # (in one segment before it was forgotten, and named as gone by the first one after)
        assert [p for p, text in segments.items() if migration in text] == [
            min(p for p in segments if p >= 6),
            min(p for p in segments if p >= forgotten_at),
        ]
        await _every_position_equals_a_replay(b)
        assert migration not in (await b.state_at(await b.head())).state.consumers
