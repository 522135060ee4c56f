"""Replay reads only what a fold needs (``read_payloads``); every way of reading folds the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evstore import AllocationStore, CorruptEvent, Inventory
from projections.replay import replay
from tests.conftest import make_provider, new_uuid

FIXTURES = Path(__file__).parent / "fixtures"


async def _workload(store: AllocationStore) -> list[str]:
    a = await make_provider(store, VCPU=16, MEMORY_MB=Inventory(total=4096, step_size=256))
    b = await make_provider(store, VCPU=16)
    instances = [new_uuid() for _ in range(6)]
    for i, c in enumerate(instances):
        await store.set_allocations(
            c,
            {a if i % 2 else b: {"VCPU": 1 + i % 3}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
    migration = new_uuid()
    await store.start_migration(instances[0], migration)
    await store.revert_migration(migration)
    await store.start_migration(instances[1], new_uuid())
    await store.delete_consumer(instances[1])  # its migration is released with it
    await store.delete_consumer(instances[2])
    return instances


async def test_every_read_path_folds_the_same_state(store: AllocationStore) -> None:
    await _workload(store)
    backend = store.backend
    head = await store.head()
    for position in (1, head // 2, head - 1, head):
        via_payloads = await replay(backend.read_payloads, position, batch_size=3)
        via_raw = await replay(backend.read_raw, position, batch_size=4)
        via_recorded = await replay(backend.read, position)
        assert via_payloads == via_raw == via_recorded, position
        assert via_payloads.position == position
    assert await store.replay() == await replay(backend.read_raw)
    rows = await backend.read_payloads(0, 2)
    assert [r[0] for r in rows] == [1, 2] and all(len(r) == 4 for r in rows)


async def test_replay_names_the_position_of_a_corrupt_row(store: AllocationStore) -> None:
    await _workload(store)
    await store.backend.tamper("UPDATE events SET data = '{\"consumer\": 42' WHERE position = 5")
    with pytest.raises(CorruptEvent) as caught:
        await store.replay()
    assert caught.value.details["position"] == 5
    assert (await store.replay(to_position=4)).position == 4, "the rows before it still fold"


async def test_replay_upcasts_an_old_row(sqlite_url: str) -> None:
    from evstore import open_store

    fixture = json.loads((FIXTURES / "allocations_replaced_v1.json").read_text())
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        await store.set_allocations(
            consumer,
            {rp: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        position = await store.head()
        old = dict(
            fixture["data"], consumer=consumer, allocations={rp: {"VCPU": 2}}, provider_generations={rp: 2}
        )
        await store.backend.tamper(
            "UPDATE events SET schema_version = 1, data = ? WHERE position = ?", (json.dumps(old), position)
        )
        state = await store.replay()
        assert state.consumers[consumer].consumer_type == "UNKNOWN"  # what the v1 -> v2 upcaster fills in
        assert state.providers[rp].usages == {"VCPU": 2}
