"""Acceptance checks of the debugging surface, written from README and SPEC only (outside-in).

Each check compares two public answers that must agree, on a mixed workload that a scheduler
could produce (trees of providers, renames, a provider deleted and created again under its uuid,
moves, migrations reverted, confirmed and deleted under, releases, inventory shrinks):

- time travel by time lands on the last event recorded at or before the time, for the whole
  store and for one provider's or consumer's slice, with and without snapshots, and the slices
  answer what the whole state answers;
- ``diff(a, b)`` says what the two states ``state_at(a)`` and ``state_at(b)`` say changed;
- ``history(uuid)`` is every event whose payload names the uuid, oldest first.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import timedelta, timezone

import pytest

from evstore import (
    AllocationStore,
    ConsumerAllocations,
    EvstoreError,
    Inventory,
    ProviderNotFound,
    RecordedEvent,
    StateView,
    open_store,
)


async def _mixed_workload(store: AllocationStore, seed: int, commands: int = 90) -> None:
    """Random scheduler traffic; rejected commands are part of it (they leave no trace)."""
    rng = random.Random(seed)

    def new_uuid() -> str:  # (from the seed: a seed is one workload)
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))

    await store.create_resource_class("CUSTOM_GPU")
    roots = []
    for i in range(3):
        rp = new_uuid()
        await store.create_provider(rp, f"host-{i}")
        await store.set_inventories(
            rp,
            {"VCPU": Inventory(total=8, allocation_ratio=2.0), "MEMORY_MB": Inventory(total=4096)},
            generation=0,
        )
        roots.append(rp)
    child = new_uuid()
    await store.create_provider(child, "host-0-gpu", parent=roots[0])
    await store.set_inventories(child, {"CUSTOM_GPU": Inventory(total=4)}, generation=0)
    spare = new_uuid()  # deleted and created again under the same uuid
    await store.create_provider(spare, "spare")
    providers = [*roots, child]
    live: set[str] = set()
    migrations: dict[str, str] = {}
    deleted: list[str] = []
    released: list[str] = []

    def body() -> dict[str, dict[str, int]]:
        host = rng.choice(roots)
        alloc = {host: {"VCPU": rng.randint(1, 4), "MEMORY_MB": 256 * rng.randint(1, 4)}}
        if host == roots[0] and rng.random() < 0.4:
            alloc[child] = {"CUSTOM_GPU": 1}
        return alloc

    async def generation(consumer: str) -> int | None:
        return (await store.allocations(consumer)).generation

    for step in range(commands):
        op = rng.random()
        try:
            if op < 0.25 or not live:
                c = new_uuid()
                await store.set_allocations(
                    c,
                    body(),
                    project_id=rng.choice(["p1", "p2"]),
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                    metadata={"request_id": f"req-{step}", "actor": rng.choice(["nova", "ops"])},
                )
                live.add(c)
            elif op < 0.35:
                c = rng.choice(sorted(live))
                await store.set_allocations(
                    c,
                    body(),
                    project_id="p1",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=await generation(c),
                )
            elif op < 0.47:
                c, m = rng.choice(sorted(live)), new_uuid()
                if rng.random() < 0.5:
                    await store.start_migration(c, m)
                else:  # Nova's move_allocations, as one write
                    view = await store.allocations(c)
                    await store.write_allocations(
                        {
                            c: ConsumerAllocations(
                                allocations={},
                                project_id="p1",
                                user_id="u",
                                consumer_type="INSTANCE",
                                consumer_generation=view.generation,
                            ),
                            m: ConsumerAllocations(
                                allocations=dict(view.allocations),
                                project_id=view.project_id or "p1",
                                user_id="u",
                                consumer_type="MIGRATION",
                                consumer_generation=None,
                            ),
                        }
                    )
                migrations[m] = c
                await store.set_allocations(
                    c, body(), project_id="p1", user_id="u", consumer_type="INSTANCE", generation=None
                )
            elif op < 0.57 and migrations:
                m = rng.choice(sorted(migrations))
                c = migrations.pop(m)
                await (store.revert_migration(m) if rng.random() < 0.5 else store.confirm_migration(m))
            elif op < 0.67:
                c = rng.choice(sorted(live | set(migrations.values())))
                await store.delete_consumer(c)
                live.discard(c)
                deleted.append(c)
            elif op < 0.72:
                c = rng.choice(sorted(live))
                await store.release(c)
                live.discard(c)
                released.append(c)
            elif op < 0.74 and released:  # a released consumer's uuid used again
                c = released.pop(rng.randrange(len(released)))
                await store.set_allocations(
                    c, body(), project_id="p2", user_id="u", consumer_type="INSTANCE", generation=None
                )
                live.add(c)
            elif op < 0.76 and deleted:
                await store.set_allocations(
                    rng.choice(deleted),
                    body(),
                    project_id="p1",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
            elif op < 0.82:
                rp = rng.choice(providers)
                await store.rename_provider(rp, f"{(await store.provider(rp)).name.split('~')[0]}~{step}")
            elif op < 0.88:
                rp = rng.choice(roots)
                gen = (await store.inventories(rp)).generation
                await store.set_inventories(
                    rp,
                    {"VCPU": Inventory(total=rng.choice([2, 8, 16])), "MEMORY_MB": Inventory(total=4096)},
                    gen,
                )
            elif op < 0.94:
                try:
                    await store.delete_provider(spare)
                except ProviderNotFound:
                    await store.create_provider(spare, f"spare-{step}")
            else:
                await store.release(new_uuid())  # NotFound: leaves no trace
        except EvstoreError:
            pass


def _text(event: RecordedEvent) -> str:
    return json.dumps(event.data)


async def _events(store: AllocationStore) -> list[RecordedEvent]:
    out: list[RecordedEvent] = []
    while batch := await store.read(after=out[-1].position if out else 0, limit=500):
        out.extend(batch)
    return out


async def _entity_uuids(store: AllocationStore, events: list[RecordedEvent]) -> tuple[list[str], list[str]]:
    providers = sorted({e.data["provider"] for e in events if e.type == "ProviderCreated"})
    consumers: set[str] = set()
    for e in events:
        for key in ("consumer", "instance", "migration"):
            if isinstance(e.data.get(key), str):
                consumers.add(e.data[key])
    return providers, sorted(consumers)


async def _answers(view: StateView, providers: list[str], consumers: list[str]) -> dict[str, object]:
    """What a view says of each entity (a provider absent at that point answers None)."""
    out: dict[str, object] = {}
    for rp in providers:
        try:
            usage = await view.usage(rp)
        except ProviderNotFound:
            out[rp] = None
            continue
        out[rp] = (usage.to_dict(), await view.provider_allocations(rp), (await view.provider(rp)).to_dict())
    for c in consumers:
        out[c] = (await view.allocations(c)).to_dict()
    return out


@pytest.mark.parametrize("snapshots", [False, True])
async def test_time_travel_by_time_lands_on_the_last_event_at_or_before_it_in_every_scope(
    store_url: str, snapshots: bool
) -> None:
    """For every recorded time t (and just before it, and in another zone): ``state_at(at=t)`` is
    the position of the last event recorded at or before t, the whole state and each entity's
    slice at that time answer alike, and the same as ``state_at(position=...)``."""
    async with open_store(store_url, snapshot_every=7) as store:
        await _mixed_workload(store, seed=1848343, commands=70)
        if snapshots:
            assert await store.take_snapshots()
        events = await _events(store)
        head = await store.head()
        assert [e.position for e in events] == list(range(1, head + 1))
        providers, consumers = await _entity_uuids(store, events)
        some = providers + consumers[:: max(1, len(consumers) // 8)]
        times = sorted({e.recorded_at for e in events})
        east = timezone(timedelta(hours=5, minutes=30))
        probes = [times[0] - timedelta(microseconds=1), *times[:: max(1, len(times) // 12)], times[-1]]
        probes += [t + timedelta(microseconds=1) for t in times[:: max(1, len(times) // 6)]]
        for t in probes:
            want = max((e.position for e in events if e.recorded_at <= t), default=0)
            whole = await store.state_at(at=t.astimezone(east))
            assert whole.position == want, t
            by_position = await store.state_at(position=want)
            truth = await _answers(by_position, some, [])
            assert await _answers(whole, some, []) == truth
            for rp in providers:
                sliced = await store.state_at(at=t, provider=rp)
                assert sliced.position == want
                assert await _answers(sliced, [rp], []) == {rp: truth[rp]}
            for c in some[len(providers) :]:
                sliced = await store.state_at(at=t, consumer=c)
                assert sliced.position == want
                assert await _answers(sliced, [], [c]) == await _answers(by_position, [], [c])


async def test_a_diff_says_what_the_two_states_say_changed(store_url: str) -> None:
    """``diff(a, b)`` against ``state_at(a)`` and ``state_at(b)``: each usage delta's before and
    after are the two states' usage, every class whose usage differs is listed, and each
    consumer's change kind is what its two views show; diffs over adjacent spans compose."""
    async with open_store(store_url) as store:
        await _mixed_workload(store, seed=7, commands=80)
        events = await _events(store)
        providers, consumers = await _entity_uuids(store, events)
        head = await store.head()
        rng = random.Random(5)
        spans = [(0, head), (head, head)] + [tuple(sorted(rng.sample(range(head + 1), 2))) for _ in range(6)]
        for a, b in spans:
            diff = await store.diff(a, b)
            assert (diff.from_position, diff.to_position) == (a, b)
            va, vb = await store.state_at(position=a), await store.state_at(position=b)
            moved: dict[tuple[str, str], tuple[int, int]] = {}
            for rp in providers:
                ua = dict(await va.usage(rp)) if (await _answers(va, [rp], []))[rp] else {}
                ub = dict(await vb.usage(rp)) if (await _answers(vb, [rp], []))[rp] else {}
                for rc in set(ua) | set(ub):
                    if ua.get(rc, 0) != ub.get(rc, 0):
                        moved[(rp, rc)] = (ua.get(rc, 0), ub.get(rc, 0))
            listed = {(d.provider, d.resource_class): (d.before, d.after) for d in diff.usage if d.delta}
            assert listed == moved, (a, b)
            for d in diff.usage:
                assert d.positions and all(a < p <= b for p in d.positions)
                assert d.delta == d.after - d.before
            by_consumer = {ch.consumer: ch for ch in diff.consumers}
            for c in consumers:
                ca, cb = await va.allocations(c), await vb.allocations(c)
                ch = by_consumer.get(c)
                if not ca.deleted and cb.deleted:
                    assert ch is not None and ch.change == "deleted", (a, b, c)
                elif not ca.allocations and cb.allocations:
                    assert ch is not None and ch.change == "created", (a, b, c)
                elif ca.allocations and not cb.allocations and not cb.deleted:
                    assert ch is not None and ch.change == "released", (a, b, c)
                elif ca.allocations != cb.allocations:
                    assert ch is not None and ch.change == "changed", (a, b, c)
                if ch is not None:
                    assert dict(ch.before) == dict(ca.allocations) and dict(ch.after) == dict(cb.allocations)
                    assert ch.positions and all(a < p <= b for p in ch.positions)
                    touching = {e.position for e in events if a < e.position <= b and c in _text(e)}
                    assert set(ch.positions) <= touching, (a, b, c)
            assert sum(diff.events_by_type.values()) == b - a
            assert diff.events_by_type == {
                t: n
                for t in {e.type for e in events[a:b]}
                if (n := sum(1 for e in events[a:b] if e.type == t))
            }
        # composition: a -> m -> b moves each class as a -> b does
        for _ in range(5):
            a, m, b = sorted(rng.choices(range(head + 1), k=3))
            left, right, whole = await store.diff(a, m), await store.diff(m, b), await store.diff(a, b)
            net: dict[tuple[str, str], int] = {}
            for d in (*left.usage, *right.usage):
                net[(d.provider, d.resource_class)] = net.get((d.provider, d.resource_class), 0) + d.delta
            assert {k: v for k, v in net.items() if v} == {
                (d.provider, d.resource_class): d.delta for d in whole.usage if d.delta
            }


async def test_history_is_every_event_that_names_the_uuid_oldest_first(store: AllocationStore) -> None:
    """The history of each provider and consumer (migrations, deleted consumers, a provider
    deleted and created again under its uuid) against a scan of the log for its uuid."""
    await _mixed_workload(store, seed=42, commands=90)
    events = await _events(store)
    providers, consumers = await _entity_uuids(store, events)
    for entity in providers + consumers:
        story = [e async for e in store.history(entity)]
        scan = [e.position for e in events if entity in _text(e)]
        assert [e.position for e in story] == scan, entity
        assert [e.metadata for e in story] == [events[p - 1].metadata for p in scan]
    lives = [[e.type async for e in store.history(rp)] for rp in providers]
    assert any(  # (the workload re-used a provider's uuid: both lives are in its history)
        "ProviderDeleted" in story and "ProviderCreated" in story[story.index("ProviderDeleted") :]
        for story in lives
    )
    report = await store.audit(history=True)
    # (inventory shrinks may leave a host over capacity: the only finding such a log may hold,
    # and each names the shrink that began it)
    assert {f.kind for f in report.findings} <= {"over_capacity"}, report.findings
    for finding in report.findings:
        assert events[finding.details["since"] - 1].type == "InventoriesReplaced"
        assert finding.details["since"] in finding.positions


@pytest.mark.parametrize("lag", [None, 3])
async def test_reading_an_entitys_events_of_some_types_only(
    store_url: str, monkeypatch: pytest.MonkeyPatch, lag: int | None
) -> None:
    """``read_entities(..., types=)`` - how ``evstore history`` reads the names another provider
    was given without decoding the rest of its history - answers exactly the entity's events of
    those types, paged by ``after`` and bounded by ``until``; on SQLite both through the history
    index and for the newest events it does not hold yet (``lag``: how far it may lag)."""
    if lag is not None:
        if not store_url.startswith("sqlite"):
            pytest.skip("the history index lags on SQLite only")
        from evstore.log import sqlite as sqlite_backend

        monkeypatch.setattr(sqlite_backend, "HISTORY_LAG", lag)
    naming = ("ProviderCreated", "ProviderUpdated")
    async with open_store(store_url) as store:
        await _mixed_workload(store, seed=9, commands=80)
        events = await _events(store)
        providers, _ = await _entity_uuids(store, events)
        middle = events[len(events) // 2].position
        for rp in providers:
            for until in (None, middle):
                want = [
                    e.position
                    for e in events
                    if f"provider:{rp}" in e.entities()
                    and e.type in naming
                    and (until is None or e.position <= until)
                ]
                got: list[int] = []
                while batch := await store.backend.read_entities(
                    [f"provider:{rp}"], got[-1] if got else 0, 2, until, types=naming
                ):
                    assert all(e.type in naming for e in batch)
                    got += [e.position for e in batch]
                assert got == want, (rp, until)
        assert any(len([e for e in events if e.type in naming and rp in _text(e)]) > 1 for rp in providers)
