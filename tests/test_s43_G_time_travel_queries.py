"""Issue 3 point 2, read literally: ``state_at`` "returns the full state as it was: usages,
allocations, consumers (including tombstones), generations; the same query methods work on it as
on the live store", snapshots "every N events (configurable)". Here the live store's answers are
recorded after each command of a workload with builds, moves, migrations, deletes (tombstones) and
inventory changes; afterwards ``state_at`` at each of those positions - and at the time each was
recorded - answers every query exactly as the live store did then, with snapshots every 4 events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput, Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def _answers(q: Any, providers: list[str], consumers: list[str]) -> dict[str, Any]:
    """Every query method the live store and a state view share, over the given entities."""
    out: dict[str, Any] = {"providers": sorted(await q.providers())}
    for rp in providers:
        usage = await q.usage(rp)
        inventories = await q.inventories(rp)
        out[f"usage {rp}"] = (dict(usage.usages), usage.generation)
        out[f"inventories {rp}"] = (
            {rc: inv.model_dump() for rc, inv in inventories.items()},
            inventories.generation,
        )
        out[f"provider_allocations {rp}"] = await q.provider_allocations(rp)
        out[f"provider {rp}"] = await q.provider(rp)
    for c in consumers:
        a = await q.allocations(c)
        out[f"allocations {c}"] = (
            {p: dict(r) for p, r in a.allocations.items()},
            a.project_id,
            a.user_id,
            a.consumer_type,
            a.generation,
            a.deleted,
        )
    for project, user, ctype in (
        ("p1", None, None),
        ("p1", "u1", None),
        ("p2", None, "MIGRATION"),
        ("p1", None, "all"),
    ):
        out[f"usages {project} {user} {ctype}"] = dict(await q.usages(project, user, ctype))
    return out


async def test_state_at_answers_every_query_as_the_live_store_did(store_url: str) -> None:
    async with open_store(store_url, snapshot_every=4) as store:
        a = await make_provider(store, "tt-a", VCPU=8, MEMORY_MB=4096)
        b = await make_provider(store, "tt-b", VCPU=Inventory(total=4, allocation_ratio=2.0))
        providers = [a, b]
        x, y, z, mig = new_uuid(), new_uuid(), new_uuid(), new_uuid()
        consumers = [x, y, z, mig]
        recorded: list[tuple[int, datetime, dict[str, Any]]] = []

        async def record() -> None:
            head = await store.head()
            [event] = await store.read(head - 1, 1)
            recorded.append((head, event.recorded_at, await _answers(store, providers, consumers)))

        await record()
        steps = [
            lambda: allocate(store, x, {a: {"VCPU": 2, "MEMORY_MB": 1024}}, project_id="p1", user_id="u1"),
            lambda: allocate(store, y, {b: {"VCPU": 3}}, project_id="p1", user_id="u2"),
            lambda: store.start_migration(x, mig),
            lambda: allocate(store, x, {b: {"VCPU": 2}}, project_id="p1", user_id="u1"),
            lambda: store.set_inventories(b, {"VCPU": Inventory(total=2)}, generation=3),  # shrink below use
            lambda: store.delete_consumer(x),  # tombstone; releases the migration too
            lambda: allocate(store, z, {a: {"MEMORY_MB": 512}}, project_id="p2", user_id="u1"),
            lambda: store.release(y),
            lambda: store.rename_provider(a, "tt-a2"),
        ]
        for step in steps:
            await step()
            await record()

        for position, when, answers in recorded:
            view = await store.state_at(position=position)
            assert await _answers(view, providers, consumers) == answers, f"state_at(position={position})"
            by_time = await store.state_at(at=when)
            assert by_time.position == position
            assert await _answers(by_time, providers, consumers) == answers, f"state_at(at={when})"
        assert len(await store.snapshot_positions()) >= 2, "snapshots every 4 events were taken and used"
        tombstone = await (await store.state_at(position=recorded[-1][0])).allocations(x)
        assert tombstone.deleted is True and dict(tombstone.allocations) == {}


async def test_state_at_takes_exactly_one_aware_point(store: AllocationStore) -> None:
    await make_provider(store, "tt-one", VCPU=1)
    head = await store.head()
    [event] = await store.read(head - 1, 1)
    for kwargs in (
        {},
        {"position": head, "at": event.recorded_at},
        {"at": event.recorded_at.replace(tzinfo=None)},
    ):
        with pytest.raises(InvalidInput) as info:
            await store.state_at(**kwargs)
        assert info.value.code == "evstore.invalid_input" and info.value.message
        assert await store.head() == head
