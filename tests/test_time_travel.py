"""Time travel: state_at with snapshots equals a naive replay, at every position, for random workloads."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evstore import AllocationStore, CorruptEvent, InvalidInput, ProviderNotFound, StorageError, open_store
from evstore.log.sqlite import SqliteBackend
from projections import snapshots
from projections.replay import replay
from projections.snapshots import SNAPSHOT_FORMAT, decode_state, encode_state
from projections.state import ConsumerState, State
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_projections_support import random_workload


async def _check_positions(url: str, seed: int, every: int, positions: list[float]) -> None:
    async with open_store(url, snapshot_every=every) as store:
        await random_workload(store, seed, commands=60)
        head = await store.head()
        for fraction in positions:
            p = round(fraction * head)
            naive = await replay(store.backend.read, p)
            view = await store.state_at(position=p)
            assert view.position == p
            assert view.state == naive, f"state_at({p}) differs from a naive replay"
            tombstones = {u for u, c in naive.consumers.items() if c.deleted}
            assert tombstones == {u for u, c in view.state.consumers.items() if c.deleted}
        snapshots = await store.snapshot_positions()
        assert snapshots and all(s % every == 0 and s <= head for s in snapshots)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    every=st.integers(1, 40),
    positions=st.lists(st.floats(0, 1), min_size=1, max_size=6),
)
def test_state_at_with_snapshots_equals_naive_replay(
    tmp_path_factory: pytest.TempPathFactory, seed: int, every: int, positions: list[float]
) -> None:
    path = tmp_path_factory.mktemp("tt") / "store.db"
    # the last position forces snapshots up to the head, so the earlier ones are answered from them
    asyncio.run(_check_positions(f"sqlite:///{path}", seed, every, [1.0, *positions]))


async def test_snapshot_round_trip_keeps_every_tombstone(store: AllocationStore) -> None:
    await random_workload(store, seed=3, commands=80)
    state = await store.replay()
    assert any(c.deleted for c in state.consumers.values())
    assert decode_state(encode_state(state)) == state


def test_a_large_state_is_coded_in_chunks_of_consumers(monkeypatch: pytest.MonkeyPatch) -> None:
    """pydantic-core holds the GIL for a whole encode or parse: one call for a 200,000-consumer
    state stalled the event loop ~0.5 s even on a thread. The snapshot is lines, each a chunk of
    consumers coded by its own call (the loop gets its turns between them)."""
    monkeypatch.setattr(snapshots, "CHUNK", 3)
    state = State(position=7, custom_classes={"CUSTOM_X"})
    for i in range(8):
        uuid = new_uuid()
        state.consumers[uuid] = ConsumerState(uuid, "p", "u", "INSTANCE", 1, {"rp": {"VCPU": i + 1}})
    calls: list[int] = []
    loads = snapshots._loads
    monkeypatch.setattr(snapshots, "_loads", lambda text: calls.append(len(text)) or loads(text))
    text = encode_state(state)
    assert len(text.splitlines()) == 2 + 3  # header, providers, 3 + 3 + 2 consumers
    assert decode_state(text) == state
    assert len(calls) == 5


async def test_a_snapshot_whose_event_was_altered_is_not_used(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=5) as store:
        await random_workload(store, seed=8, commands=30)
        head = await store.head()
        await store.take_snapshots()
        assert 10 in await store.snapshot_positions()
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        target = min(12, head)
        truth = await replay(store.backend.read, target)
        # poison the snapshot at 10: while its event is intact, time travel trusts it (proof it is used)
        empty = encode_state(State(position=10))
        await backend.tamper("UPDATE snapshots SET state = ? WHERE position = 10", (empty,))
        await backend.tamper("DELETE FROM snapshots WHERE position <> 10")
        assert (await store.state_at(position=target)).state != truth
        # once the event it was taken at changes, the snapshot no longer matches and is ignored
        await backend.tamper("UPDATE events SET hash = hash || 'x' WHERE position = 10")
        assert (await store.state_at(position=target)).state == truth


@pytest.mark.parametrize(
    "damage",
    [
        "not json at all",
        f'{{"format":{SNAPSHOT_FORMAT}}}',
        f'{{"format":{SNAPSHOT_FORMAT},"position":10,"providers":7}}',
        "[]",  # (valid JSON of another shape raised AttributeError, failing state_at and diff)
        "null",
        # a sound document of another position: used, it answered that position's state
        encode_state(State(position=3)),
    ],
)
async def test_an_unreadable_snapshot_is_skipped_not_fatal(tmp_path: Path, damage: str) -> None:
    # snapshots are a cache: a damaged row (whole store or one provider's slice) makes time travel
    # fold from the start instead of failing (it used to raise from deep inside json.loads)
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=5) as store:
        await random_workload(store, seed=9, commands=30)
        await store.take_snapshots()
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        target = min(12, await store.head())
        truth = await replay(store.backend.read, target)
        provider = sorted(truth.providers)[0]
        await backend.tamper("UPDATE snapshots SET state = ?", (damage,))
        await backend.tamper("UPDATE provider_snapshots SET state = ?", (damage,))
        whole = await store.state_at(position=target)
        assert whole.state == truth
        sliced = await store.state_at(position=target, provider=provider)
        assert await sliced.usage(provider) == await whole.usage(provider)


async def test_taking_snapshots_at_a_smaller_interval_fills_in_before_the_latest(tmp_path: Path) -> None:
    """Regression: after snapshots every 10 events, taking them every 5 added only those after the
    latest one (fold_to starts from the newest snapshot): the ones in between never came."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url, snapshot_every=10) as store:
        await random_workload(store, seed=3, commands=40)
        head = await store.head()
        assert await store.take_snapshots() == list(range(10, head + 1, 10))
    async with open_store(url, snapshot_every=5) as store:
        assert await store.take_snapshots() == list(range(5, head + 1, 5))
        truth = await replay(store.backend.read, 15)
        assert (await store.state_at(position=15)).state == truth


async def test_a_snapshot_is_taken_at_the_head_when_the_head_is_a_multiple(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        await random_workload(store, seed=4, commands=20)
        head = await store.head()
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=head) as store:
        assert await store.take_snapshots() == [head]


async def test_state_at_a_time_and_the_queries_on_it(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    before = datetime.now(UTC) - timedelta(days=1)
    await allocate(store, c, {rp: {"VCPU": 3}})
    allocated = await store.head()
    await store.delete_consumer(c)
    then = await store.state_at(position=allocated)
    assert (await then.usage(rp))["VCPU"] == 3
    assert (await then.allocations(c)).allocations == {rp: {"VCPU": 3}}
    now = await store.state_at(at=datetime.now(UTC) + timedelta(seconds=5))
    assert (await now.allocations(c)).deleted
    assert (await now.usage(rp))["VCPU"] == 0
    assert (await store.state_at(at=before)).position == 0
    with pytest.raises(InvalidInput):
        await store.state_at(at=datetime.now())  # naive time
    with pytest.raises(InvalidInput):
        await store.state_at(position=1, at=before)
    # (regression: the first and last hours datetime allows raised OverflowError in UTC)
    east, west = timezone(timedelta(hours=5)), timezone(timedelta(hours=-5))
    assert (await store.state_at(at=datetime.min.replace(tzinfo=east))).position == 0
    assert (await store.state_at(at=datetime.max.replace(tzinfo=west))).position == await store.head()
    assert await store.position_of(datetime.max.replace(tzinfo=west)) == await store.head()


async def test_a_view_lists_its_providers_as_the_store_does(store: AllocationStore) -> None:
    """Regression (review 24, helper-53): ``state_at(...).providers()`` was not awaitable and
    answered bare uuids sorted by uuid, where ``store.providers()`` - the same question of the
    live store - is awaited and answers ``(uuid, name)`` by name: code moved from the store to a
    view (what a view is for) failed with a TypeError, or read names as uuids."""
    names = ["zeta", "alpha", "Mid", "beta-2"]
    for name in names:
        await make_provider(store, name, VCPU=4)
    head = await store.head()
    live = await store.providers()
    assert [n for _, n in live] == sorted(names)
    assert await (await store.state_at(position=head)).providers() == live
    # (position 2: the first provider and its inventory)
    assert await (await store.state_at(position=2)).providers() == [(u, n) for u, n in live if n == "zeta"]


async def test_replay_to_a_time(store: AllocationStore) -> None:
    """replay(at=) folds up to the last event recorded at or before the time, as state_at does."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 3}})
    allocated = await store.head()
    await asyncio.sleep(0.01)
    between = datetime.now(UTC)
    await asyncio.sleep(0.01)
    await store.delete_consumer(c)
    then = await store.replay(at=between)
    assert then.position == allocated
    assert then == await store.replay(allocated) == (await store.state_at(at=between)).state
    assert then.providers[rp].usages == {"VCPU": 3}
    assert (await store.replay(at=datetime.now(UTC) + timedelta(seconds=5))).consumers[c].deleted
    assert (await store.replay(at=between - timedelta(days=1))).position == 0
    with pytest.raises(InvalidInput, match="timezone-aware"):
        await store.replay(at=datetime.now())  # naive time

    class NoOffset(tzinfo):  # (helper-51: Python calls such a time naive; astimezone reads it as local)
        def utcoffset(self, dt: datetime | None) -> timedelta | None:
            return None

    odd = datetime.now().replace(tzinfo=NoOffset())
    for call in (
        lambda: store.replay(at=odd),
        lambda: store.position_of(odd),
        lambda: store.state_at(at=odd),
    ):
        with pytest.raises(InvalidInput, match="timezone-aware"):
            await call()
    with pytest.raises(InvalidInput, match="at most one"):
        await store.replay(allocated, at=between)
    with pytest.raises(InvalidInput, match="datetime"):
        await store.replay(at=allocated)  # type: ignore[arg-type]
    # (rev25: one wording, naming what was given, for replay, state_at, position_of and diff: a
    # string said "at must be a timezone-aware datetime" in state_at, "got str" in replay, and was
    # "an integer position" in diff)
    text = between.isoformat()
    for call in (
        lambda: store.replay(at=text),  # type: ignore[arg-type]
        lambda: store.state_at(at=text),  # type: ignore[arg-type]
        lambda: store.position_of(text),  # type: ignore[arg-type]
        lambda: store.diff(text, allocated),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidInput, match=r"timezone-aware datetime, e\.g\. .* got str '.*isoformat"):
            await call()
    for call in (
        lambda: store.replay(at=datetime.now()),
        lambda: store.state_at(at=datetime.now()),
        lambda: store.diff(0, datetime.now()),
    ):
        with pytest.raises(InvalidInput, match="got a naive datetime"):
            await call()


async def test_snapshots_of_an_older_format_are_made_again(tmp_path: Path) -> None:
    # Provider slices are re-made only where whole-store snapshots are: when the encoding of
    # either changes, both must be taken again, or old slices would be ignored forever.
    import sqlite3

    path = tmp_path / "store.db"
    async with open_store(f"sqlite:///{path}", snapshot_every=10) as store:
        rp = await make_provider(store, VCPU=100)
        holder = new_uuid()
        for consumer in (holder, *(new_uuid() for _ in range(29))):
            await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.take_snapshots()
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        for table in ("snapshots", "provider_snapshots"):
            await backend.tamper(f"UPDATE {table} SET format = 1")  # what an older evstore wrote
        await store.take_snapshots()
        answered_from: list[object] = []
        load_slice = backend.load_provider_snapshot

        async def spy(*args: Any) -> Any:
            answered_from.append(await load_slice(*args))
            return answered_from[-1]

        backend.load_provider_snapshot = spy  # type: ignore[method-assign]
        view = await store.state_at(position=25, provider=rp)
        assert answered_from and answered_from[-1] is not None  # a slice, not a fold from the start
        assert view.state.consumers[holder].consumer_type == "INSTANCE"
    with sqlite3.connect(path) as conn:
        for table in ("snapshots", "provider_snapshots"):
            formats = {f for (f,) in conn.execute(f"SELECT DISTINCT format FROM {table}")}
            assert formats == {SNAPSHOT_FORMAT}, table


async def test_a_snapshot_whose_text_was_altered_is_not_believed(store_url: str) -> None:
    """Regression (helper-39): a snapshot's content was believed as stored - an edited usage (or
    allocation) in a whole-store snapshot or a provider's slice made state_at and diff answer
    with it, the audit clean. Its header now holds the digest of the rest, checked on use: an
    altered snapshot is skipped (logged) and the log folded instead."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=8)
        for _ in range(8):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.take_snapshots()
        assert 5 in await store.snapshot_positions()
        truth = await replay(store.backend.read, 6)
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        edit = "replace(state, '{\"VCPU\":3}', '{\"VCPU\":7}')"
        await tamper(f"UPDATE snapshots SET state = {edit}")
        if isinstance(store.backend, SqliteBackend):
            await tamper(f"UPDATE provider_snapshots SET state = {edit}")
        whole = await store.state_at(position=6)
        assert whole.state == truth
        sliced = await store.state_at(position=6, provider=rp)
        assert await sliced.usage(rp) == await whole.usage(rp) == {"VCPU": 4}
        assert [u.after for u in (await store.diff(5, 6)).usage] == [4]


def test_a_snapshot_is_checked_against_its_digest() -> None:
    state = State(position=4, custom_classes={"CUSTOM_X"})
    uuid = new_uuid()
    state.consumers[uuid] = ConsumerState(uuid, "p", "u", "INSTANCE", 1, {"rp": {"VCPU": 2}})
    text = encode_state(state)
    assert decode_state(text) == state
    with pytest.raises(ValueError, match="does not match its digest"):
        decode_state(text.replace('{"VCPU":2}', '{"VCPU":3}'))
    # (a header of another format, its digest still matching the text after it)
    other = SNAPSHOT_FORMAT + 1
    with pytest.raises(InvalidInput, match=f"Unsupported snapshot format {other}"):
        decode_state(text.replace(f'"format":{SNAPSHOT_FORMAT}', f'"format":{other}', 1))


async def test_a_provider_slice_starts_from_its_latest_slice_snapshot(tmp_path: Path) -> None:
    """state_at(provider=) folds only the provider's events after its latest slice snapshot at or
    before the position (a slice whose header says another position is not used); fold_to
    refuses an interval below 1."""
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=10) as store:
        await random_workload(store, seed=5, commands=40)
        head = await store.head()
        taken = await store.take_snapshots()
        assert taken and head > taken[-1]
        rp = sorted(u for u, _ in await store.providers())[0]
        backend = store.backend
        real = backend.read_entities
        afters: list[int] = []

        async def spy(entities: list[str], after: int, limit: int, until: int | None = None) -> list[Any]:
            afters.append(after)
            return await real(entities, after, limit, until)

        backend.read_entities = spy  # type: ignore[method-assign]
        try:
            sliced = await store.state_at(position=head, provider=rp)
        finally:
            del backend.read_entities
        assert afters[0] == taken[-1]
        assert await sliced.usage(rp) == await store.usage(rp)
        with pytest.raises(InvalidInput, match="positive"):
            await snapshots.fold_to(backend, head, every=0)  # type: ignore[arg-type]


async def test_a_view_names_the_missing_provider_in_details_as_the_store_does(store: AllocationStore) -> None:
    """Regression (review 25, helper-h): ``ProviderNotFound`` from a ``state_at`` view carried no
    ``details`` at all, where the live store's (the same query, the same error) carries
    ``{"provider": uuid}``: a handler reading ``exc.details["provider"]`` got a KeyError."""
    await make_provider(store, VCPU=4)
    missing = new_uuid()
    view = await store.state_at(position=await store.head())
    for query in ("usage", "inventories", "provider", "provider_allocations"):
        with pytest.raises(ProviderNotFound) as live:
            await getattr(store, query)(missing)
        with pytest.raises(ProviderNotFound) as then:
            await getattr(view, query)(missing)
        assert then.value.details == live.value.details == {"provider": missing}, query


async def test_time_travel_over_a_hole_never_folds_an_event_past_the_position(store_url: str) -> None:
    """Found by review (helper-78): with a row deleted by hand (a hole, which ``read`` refuses as
    evstore.log.corrupt and the audit lists), the folds read "the next N events" to reach a
    position, and got one past it: ``state_at(8)``, ``replay(8)`` and ``diff(5, 8)`` answered the
    state at position 9 (its event folded in, ``position == 9``); ``state_at(7)``, the hole
    itself, answered position 8. Since stop 40 they do not fold over the hole at all (refused,
    naming it, as read, export and rebuild refuse it: an answer without the missing event - a
    tombstone, say - would be a state the log never had); before it they answer, from the
    snapshot at 5 or from the log."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)  # positions 1, 2
        for _ in range(8):  # 3-10: 1 VCPU each
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.take_snapshots()
        await store.backend.tamper("DELETE FROM events WHERE position = 7")  # type: ignore[attr-defined]
        for position in (8, 7):
            for fold in (store.state_at(position), store.replay(position), store.diff(5, position)):
                with pytest.raises(CorruptEvent, match="Position 7 is missing") as raised:
                    await fold
                assert raised.value.details == {"position": 7, "reason": "position_gap"}
        view = await store.state_at(6)
        assert (view.position, await view.usage(rp)) == (6, {"VCPU": 4})
        replayed = await store.replay(6)
        assert (replayed.position, replayed.providers[rp].usages) == (6, {"VCPU": 4})
        changed = await store.diff(5, 6)
        assert changed.to_position == 6 and [u.after for u in changed.usage] == [4]


async def test_no_snapshot_is_saved_from_a_fold_over_a_hole(store_url: str) -> None:
    """Found by review (helper-78): a snapshot saved while a row was missing from the log (a
    fold over the hole, by state_at or take_snapshots) still matched the hash of the event at
    its position once the row was put back (from a backup), so time travel kept answering
    without that event: state_at(10) said 7 VCPU used where the log (and replay) says 8, for
    good. A fold over a hole saves no snapshot; take_snapshots, asked to, says where the hole is."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)  # positions 1, 2
        for _ in range(8):  # 3-10: 1 VCPU each
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper("CREATE TABLE backup AS SELECT * FROM events WHERE position = 7")
        await tamper("DELETE FROM events WHERE position = 7")
        with pytest.raises(CorruptEvent, match="Position 7 is missing"):  # (not over the hole)
            await store.state_at(10)
        assert await store.snapshot_positions() == [5]  # (saved on its way, before the hole)
        with pytest.raises(CorruptEvent, match="Position 7 is missing") as raised:
            await store.take_snapshots()
        assert raised.value.code == "evstore.log.corrupt"
        assert await store.snapshot_positions() == [5]
        await tamper("INSERT INTO events SELECT * FROM backup")
        assert (await store.audit()).clean
        assert await (await store.state_at(10)).usage(rp) == {"VCPU": 8}
        assert await (await store.state_at(10, provider=rp)).usage(rp) == {"VCPU": 8}
        assert await store.take_snapshots() == [5, 10]


async def test_dropping_the_snapshots_drops_all_of_them_or_none(store_url: str) -> None:
    """Regression (stop 29's note): SQLite's drop_snapshots (what a rebuild then ended with) ran its two
    DELETEs, whole-store snapshots then provider slices, each in a transaction of its own; a
    failure between them (a crash, a full disk) left the slices of the state the rebuild was
    meant to forget. A failure of the second now leaves both as they were. (PostgreSQL keeps
    whole-store snapshots only: one DELETE, all or nothing as it is.)"""
    sqlite = store_url.startswith("sqlite:")
    async with open_store(store_url, snapshot_every=2) as store:
        rp = await make_provider(store, VCPU=8)
        for _ in range(3):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        taken = await store.take_snapshots()
        assert len(taken) >= 2
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        if sqlite:  # (the second DELETE fails)
            await tamper(
                "CREATE TRIGGER refuse BEFORE DELETE ON provider_snapshots "
                "BEGIN SELECT RAISE(ABORT, 'injected failure'); END"
            )
        else:  # (the last row's deletion fails)
            await tamper(
                "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS "
                "$f$ BEGIN RAISE EXCEPTION 'injected failure'; END $f$"
            )
            await tamper(
                f"CREATE TRIGGER refuse BEFORE DELETE ON snapshots FOR EACH ROW "
                f"WHEN (OLD.position = {taken[-1]}) EXECUTE FUNCTION refuse()"
            )
        with pytest.raises(StorageError, match="injected failure"):
            await store.backend.drop_snapshots()  # type: ignore[attr-defined]
        assert await store.snapshot_positions() == taken
        if sqlite:
            load = store.backend.load_provider_snapshot  # type: ignore[attr-defined]
            for position in taken:  # (the provider slices are all there too)
                found = await load(rp, position, SNAPSHOT_FORMAT)
                assert found is not None and found[0] == position
        await tamper("DROP TRIGGER refuse" + ("" if sqlite else " ON snapshots"))
        await store.backend.drop_snapshots()  # type: ignore[attr-defined]
        assert await store.snapshot_positions() == []
