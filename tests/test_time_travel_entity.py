"""Time travel for one entity: the slice folded from its own history equals the whole replay.

``state_at(p, provider=u)`` starts from the provider's latest slice snapshot and folds only the
events that touch it; ``state_at(p, consumer=c)`` folds the consumer's history. Both must answer
exactly what a naive replay of the whole log to ``p`` answers, with or without snapshots.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evstore import AllocationStore, InvalidInput, ProviderNotFound, open_store
from projections.replay import StateView, replay
from tests.test_projections_support import random_workload


async def _compare(url: str, seed: int, every: int, fractions: list[float]) -> None:
    async with open_store(url, snapshot_every=every) as store:
        await random_workload(store, seed, commands=70)
        head = await store.head()
        await store.take_snapshots()
        full = await replay(store.backend.read, head)
        consumers = sorted(full.consumers)[:6]
        providers = sorted({u for u, _ in await store.providers()})
        for fraction in fractions:
            p = round(fraction * head)
            naive = StateView(await replay(store.backend.read, p))
            for u in providers:
                sliced = await store.state_at(position=p, provider=u)
                try:
                    want = await naive.usage(u)
                except ProviderNotFound:
                    with pytest.raises(ProviderNotFound):
                        await sliced.usage(u)
                    continue
                assert await sliced.usage(u) == want
                assert await sliced.provider_allocations(u) == await naive.provider_allocations(u)
                for holder in await naive.provider_allocations(u):  # what `evstore state` shows of them
                    got, truth = sliced.state.consumers[holder], naive.state.consumers[holder]
                    assert (got.project_id, got.user_id, got.consumer_type, got.generation) == (
                        truth.project_id,
                        truth.user_id,
                        truth.consumer_type,
                        truth.generation,
                    )
            for c in consumers:
                assert await (await store.state_at(position=p, consumer=c)).allocations(
                    c
                ) == await naive.allocations(c)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 10_000),
    every=st.integers(3, 30),
    fractions=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4),
)
def test_entity_slices_equal_a_naive_replay(
    backend_name: str, tmp_path_factory: pytest.TempPathFactory, seed: int, every: int, fractions: list[float]
) -> None:
    if backend_name == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('slices')}/store.db"
    else:
        from tests.pg import fresh_database_url

        url = fresh_database_url()
    asyncio.run(_compare(url, seed, every, fractions))


async def test_a_slice_answers_only_for_its_entity(store: AllocationStore) -> None:
    await random_workload(store, seed=3, commands=10)
    providers = [u for u, _ in await store.providers()]
    view = await store.state_at(position=await store.head(), provider=providers[0])
    with pytest.raises(InvalidInput, match="folded for provider"):
        await view.usage(providers[1])
    with pytest.raises(InvalidInput):
        await view.usages("p1")
    with pytest.raises(InvalidInput):
        await store.state_at(position=1, provider=providers[0], consumer=providers[1])
    # Regression (helper-39): a slice answered providers() with what its fold happened to hold (the
    # provider and any child created after it, or only the provider when folded from a snapshot)
    with pytest.raises(InvalidInput, match="providers\\(\\) needs the whole state"):
        await view.providers()
    consumer_view = await store.state_at(position=await store.head(), consumer=providers[0])
    with pytest.raises(InvalidInput, match="folded for consumer"):
        await consumer_view.providers()


async def test_a_position_beyond_the_head_is_rejected_for_every_scope(store: AllocationStore) -> None:
    # The whole-store fold used to answer with the head's state and an entity slice with a view
    # claiming the unreached position; diff and the CLI already refused it.
    await random_workload(store, seed=4, commands=10)
    head = await store.head()
    provider = (await store.providers())[0][0]
    for scope in ({}, {"provider": provider}, {"consumer": provider}):
        assert (await store.state_at(head, **scope)).position == head
        with pytest.raises(InvalidInput, match=f"beyond the head of the log \\({head}\\)"):
            await store.state_at(head + 1, **scope)


async def test_read_entities_stops_at_until(store: AllocationStore) -> None:
    await random_workload(store, 3, commands=40)
    rp = sorted(u for u, _ in await store.providers())[0]
    everything = await store.backend.read_entities([f"provider:{rp}"], 0, 10_000)
    assert len(everything) > 4
    cut = everything[len(everything) // 2].position
    bounded = await store.backend.read_entities([f"provider:{rp}"], 0, 10_000, cut)
    assert [r.position for r in bounded] == [r.position for r in everything if r.position <= cut]


async def test_a_provider_slice_reads_nothing_after_its_position(store: AllocationStore) -> None:
    """Regression: the slice fold read (and decoded) up to a batch of 2,000 of the provider's events
    past the position it was asked about, then dropped them: on a long log most of the time of
    ``state_at(p, provider=)`` went there (65 -> 8 ms mean on a 1M-event log)."""
    await random_workload(store, 4, commands=60)
    head = await store.head()
    providers = sorted(u for u, _ in await store.providers())
    backend = store.backend
    real = backend.read_entities
    seen: list[int] = []

    async def spy(entities: list[str], after: int, limit: int, until: int | None = None) -> list[Any]:
        rows = await real(entities, after, limit, until)
        seen.extend(r.position for r in rows)
        return rows

    backend.read_entities = spy  # type: ignore[method-assign]
    try:
        for p in (head // 3, head // 2):
            seen.clear()
            for u in providers:
                await store.state_at(position=p, provider=u)
            assert seen, "the slices folded no history at all"
            assert max(seen) <= p
    finally:
        del backend.read_entities


async def test_history_gives_the_events_before_a_damaged_row_then_fails(store: AllocationStore) -> None:
    """Regression (review 24, helper-53): ``history`` of a consumer whose third event was damaged
    raised CorruptEvent before yielding anything, so the events leading up to the damage - what a
    person debugging it wants first - were not shown (``subscribe`` and ``tail`` give them); the
    batch holding the damaged row was decoded as a whole."""
    from evstore import CorruptEvent
    from tests.conftest import allocate, make_provider, new_uuid

    rp = await make_provider(store, VCPU=8)
    consumer = new_uuid()
    await allocate(store, consumer, {rp: {"VCPU": 1}})
    await allocate(store, consumer, {rp: {"VCPU": 2}}, generation=1)
    await allocate(store, consumer, {rp: {"VCPU": 3}}, generation=2)
    await store.release(consumer)
    positions = [e.position async for e in store.history(consumer)]
    assert len(positions) == 4
    damaged = positions[2]
    # (truncated: the text still names the consumer, so a scan of unindexed rows finds it too)
    await store.backend.tamper(  # type: ignore[attr-defined]
        "UPDATE events SET data = substr(data, 1, length(data) - 1) WHERE position = ?", (damaged,)
    )
    for batch_size in (1, 2, 1000):
        got: list[int] = []
        with pytest.raises(CorruptEvent, match=f"position {damaged}"):
            async for event in store.history(consumer, batch_size=batch_size):
                got.append(event.position)
        assert got == positions[:2], batch_size


@pytest.mark.parametrize("ending", ["delete", "release", "empty", "replace"])
async def test_an_instance_history_shows_what_happened_to_its_migration(
    store: AllocationStore, ending: str
) -> None:
    """Regression (stop 26): the events that ended or changed what a migration consumer held on an
    instance's behalf without naming the instance (Nova deleting the migration consumer, or
    emptying or rewriting its allocations with a plain write, as Nova's old revert did) were
    missing from the instance's history: an operator following a leak lost the thread at the
    migration. Such events now record the instance (``on_behalf_of``), and only they do."""
    from evstore import ConsumerAllocations
    from evstore import events as ev
    from tests.conftest import allocate, make_provider, new_uuid

    src, dst = await make_provider(store, VCPU=8), await make_provider(store, VCPU=8)
    instance, migration, other = new_uuid(), new_uuid(), new_uuid()
    await allocate(store, instance, {src: {"VCPU": 2}})
    await allocate(store, other, {src: {"VCPU": 1}})
    await store.start_migration(instance, migration)
    await allocate(store, instance, {dst: {"VCPU": 2}}, generation=None)
    if ending == "delete":
        receipt = await store.delete_consumer(migration)
    elif ending == "release":
        receipt = await store.release(migration)
    else:
        body = {src: {"VCPU": 1}} if ending == "replace" else {}
        receipt = await store.write_allocations(
            {
                migration: ConsumerAllocations(
                    allocations=body,
                    project_id="project",
                    user_id="user",
                    consumer_type="MIGRATION",
                    generation=1,
                )
            }
        )
    await store.release(other)  # (an event of a consumer that is no migration: not the instance's)
    [ended] = [e async for e in store.history(migration)][-1:]
    assert ended.position == receipt.position
    assert ended.event.on_behalf_of == instance  # type: ignore[attr-defined]
    history = [e async for e in store.history(instance)]
    assert history[-1].position == ended.position
    from evstore.cli import describe

    assert f"(migration of instance {instance})" in describe(ended.event, {})
    assert [type(e.event).__name__ for e in history[:2]] == ["AllocationsReplaced", "MigrationStarted"]
    # a consumer that is no migration records nothing (its stored payload is what it always was)
    [released] = [e async for e in store.history(other)][-1:]
    assert isinstance(released.event, ev.AllocationsReleased)
    assert released.event.on_behalf_of is None
    assert "on_behalf_of" not in released.event.payload_json()
    # the instance's state at that position is unchanged by it: only its history names it
    before = await store.state_at(position=ended.position - 1, consumer=instance)
    after = await store.state_at(position=ended.position, consumer=instance)
    assert (await before.allocations(instance)).to_dict() == (await after.allocations(instance)).to_dict()


async def test_a_parent_history_shows_its_child_deleted(store: AllocationStore) -> None:
    """Regression (helper-73): a parent's history showed its child's creation (ProviderCreated
    names the parent) but not its deletion: ProviderDeleted named only the child. It now records
    the parent the child had, stored only when there is one (a root's deletion is stored as
    before)."""
    from evstore import events as ev
    from evstore.cli import describe
    from tests.conftest import make_provider

    root = await make_provider(store, "root-1", VCPU=4)
    child = await make_provider(store, "child-1", parent=root)
    lone = await make_provider(store, "lone-1")
    await store.delete_provider(child)
    await store.delete_provider(lone)
    history = [e async for e in store.history(root)]
    assert [type(e.event).__name__ for e in history][-2:] == ["ProviderCreated", "ProviderDeleted"]
    deleted = history[-1].event
    assert isinstance(deleted, ev.ProviderDeleted) and deleted.provider == child and deleted.parent == root
    assert (
        describe(deleted, {root: "root-1", child: "child-1"})
        == "provider child-1 (a child of root-1) deleted"
    )
    [gone] = [e.event async for e in store.history(lone)][-1:]
    assert isinstance(gone, ev.ProviderDeleted) and gone.parent is None
    assert gone.payload_json() == f'{{"provider":"{lone}"}}'
