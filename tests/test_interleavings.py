"""Every interleaving of two racing commands leaves zero leaked allocations.

In evstore a command has exactly one point where it can interleave with another: its place in
the write order (commands run whole, one after another, inside write transactions). So for each
pair among delete_consumer, revert_migration, start_migration, confirm_migration and a
Placement-style write_allocations revert, and for both orders, we run them
- queued together, so they share one group-commit transaction;
- in two separate transactions;
- from two separate store instances (two connections) on one file, racing for the write lock.
After each: the audit is clean (no leak, no drift), a tombstoned instance holds nothing, and no
migration holds resources for a tombstoned instance.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from evstore import AllocationStore, ConsumerAllocations, EvstoreError, Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid

SOURCE = {"VCPU": 2, "MEMORY_MB": 512}
DEST = {"VCPU": 4, "MEMORY_MB": 1024}


class World:
    def __init__(self, src: str, dst: str, instance: str, migration: str, instance_generation: int) -> None:
        self.src, self.dst = src, dst
        self.instance, self.migration = instance, migration
        self.instance_generation = instance_generation
        self.second_migration = new_uuid()


async def build(store: AllocationStore) -> World:
    inv = {"VCPU": Inventory(total=64), "MEMORY_MB": Inventory(total=65536)}
    src = await make_provider(store, "src", **inv)  # type: ignore[arg-type]
    dst = await make_provider(store, "dst", **inv)  # type: ignore[arg-type]
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: SOURCE})
    await store.start_migration(instance, migration)
    await allocate(store, instance, {dst: DEST})
    generation = (await store.allocations(instance)).generation
    assert generation is not None
    return World(src, dst, instance, migration, generation)


Command = Callable[[AllocationStore, World], Awaitable[object]]


def placement_style_revert(store: AllocationStore, w: World) -> Awaitable[object]:
    # Nova's move_allocations: empty the migration, give the instance the source allocations,
    # with the generations it read before the race.
    return store.write_allocations(
        {
            w.migration: ConsumerAllocations(
                allocations={},
                project_id="project",
                user_id="user",
                consumer_type="MIGRATION",
                consumer_generation=1,
            ),
            w.instance: ConsumerAllocations(
                allocations={w.src: SOURCE},
                project_id="project",
                user_id="user",
                consumer_type="INSTANCE",
                consumer_generation=w.instance_generation,
            ),
        }
    )


COMMANDS: dict[str, Command] = {
    "delete_consumer": lambda s, w: s.delete_consumer(w.instance),
    "revert_migration": lambda s, w: s.revert_migration(w.migration),
    "start_migration": lambda s, w: s.start_migration(w.instance, w.second_migration),
    "confirm_migration": lambda s, w: s.confirm_migration(w.migration),
    "write_allocations": placement_style_revert,
}
PAIRS = list(itertools.permutations(COMMANDS, 2))


async def attempt(call: Awaitable[object]) -> str:
    try:
        await call
    except EvstoreError as exc:
        return exc.code
    return "ok"


async def check(store: AllocationStore, w: World) -> None:
    report = await store.audit()
    assert report.clean, report.findings
    inst = await store.allocations(w.instance)
    if inst.deleted:
        assert inst.allocations == {}
        for m in (w.migration, w.second_migration):
            assert (await store.allocations(m)).allocations == {}
    total: dict[str, int] = {}
    for p in (w.src, w.dst):
        for consumer, res in (await store.provider_allocations(p)).items():
            assert not (await store.allocations(consumer)).deleted
            for rc, n in res.items():
                total[rc] = total.get(rc, 0) + n
    usage = {}
    for p in (w.src, w.dst):
        for rc, n in (await store.usage(p)).usages.items():
            usage[rc] = usage.get(rc, 0) + n
    assert {rc: n for rc, n in usage.items() if n} == total


@pytest.mark.parametrize(("first", "second"), PAIRS)
async def test_same_transaction(store: AllocationStore, first: str, second: str) -> None:
    w = await build(store)
    # Both are queued before the writer runs: one group-commit transaction, in this order.
    await asyncio.gather(attempt(COMMANDS[first](store, w)), attempt(COMMANDS[second](store, w)))
    await check(store, w)


@pytest.mark.parametrize(("first", "second"), PAIRS)
async def test_separate_transactions(store: AllocationStore, first: str, second: str) -> None:
    w = await build(store)
    await attempt(COMMANDS[first](store, w))
    await attempt(COMMANDS[second](store, w))
    await check(store, w)


@pytest.mark.parametrize(("first", "second"), PAIRS[::3])
async def test_two_connections_race(tmp_path: Path, first: str, second: str) -> None:
    url = f"sqlite:///{tmp_path}/race.db"
    async with open_store(url) as a, open_store(url) as b:
        w = await build(a)
        await asyncio.gather(attempt(COMMANDS[first](a, w)), attempt(COMMANDS[second](b, w)))
        await check(a, w)


async def test_delete_versus_revert_outcomes_are_exclusive(store: AllocationStore) -> None:
    """Exactly one of the two orders happens; in neither does the revert leak."""
    w = await build(store)
    delete, revert = await asyncio.gather(
        attempt(store.delete_consumer(w.instance)), attempt(store.revert_migration(w.migration))
    )
    assert delete == "ok"
    assert revert in ("ok", "evstore.consumer.deleted")
    assert set((await store.usage(w.src)).usages.values()) == {0}
    assert set((await store.usage(w.dst)).usages.values()) == {0}
