"""Issue 6, point 2, read literally: for each ordered pair among delete_consumer, revert_migration,
start_migration, confirm_migration and write_allocations, the two commands run concurrently *from
separate OS processes with barriers* - each process its own store (on PostgreSQL its own pool, so
the two really run in parallel) - and zero allocations leak, no invariant breaks, in every order.

tests/test_interleavings.py runs the pairs in one process (one group commit; two transactions; two
connections, a third of the pairs, SQLite only). Here every ordered pair runs on both backends, the
second process released at once (and, with EVSTORE_SLOW=1, also a few milliseconds after the
first), so the two race for real and each order of their steps comes up.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
from collections.abc import Awaitable, Callable
from typing import Any

from evstore import AllocationStore, ConsumerAllocations, EvstoreError, Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid

Command = Callable[[AllocationStore, dict[str, Any]], Awaitable[object]]


def _placement_style_revert(store: AllocationStore, w: dict[str, Any]) -> Awaitable[object]:
    """Nova's move_allocations of a revert: the migration emptied, the instance given the source
    allocations back, with the generations read before the race."""
    return store.write_allocations(
        {
            w["migration"]: ConsumerAllocations(
                allocations={},
                project_id="project",
                user_id="user",
                consumer_type="MIGRATION",
                consumer_generation=1,
            ),
            w["instance"]: ConsumerAllocations(
                allocations={w["src"]: {"VCPU": 2, "MEMORY_MB": 512}},
                project_id="project",
                user_id="user",
                consumer_type="INSTANCE",
                consumer_generation=w["instance_generation"],
            ),
        }
    )


COMMANDS: dict[str, Command] = {
    "delete_consumer": lambda s, w: s.delete_consumer(w["instance"]),
    "revert_migration": lambda s, w: s.revert_migration(w["migration"]),
    "start_migration": lambda s, w: s.start_migration(w["instance"], w["second_migration"]),
    "confirm_migration": lambda s, w: s.confirm_migration(w["migration"]),
    "write_allocations": _placement_style_revert,
}
PAIRS = list(itertools.permutations(COMMANDS, 2))
#: how long the second process waits after the barrier: together, and one a little behind
OFFSETS = (0.0, 0.004) if os.environ.get("EVSTORE_SLOW") else (0.0,)


async def build(store: AllocationStore, n: int) -> dict[str, Any]:
    """tests/test_interleavings.py's world (an instance mid-resize: its migration holds the source,
    it holds the destination), with provider names of its own, many worlds sharing one store."""
    inv = {"VCPU": Inventory(total=64), "MEMORY_MB": Inventory(total=65536)}
    src = await make_provider(store, f"src-{n}", **inv)  # type: ignore[arg-type]
    dst = await make_provider(store, f"dst-{n}", **inv)  # type: ignore[arg-type]
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: {"VCPU": 2, "MEMORY_MB": 512}})
    await store.start_migration(instance, migration)
    await allocate(store, instance, {dst: {"VCPU": 4, "MEMORY_MB": 1024}})
    generation = (await store.allocations(instance)).generation
    return {
        "src": src,
        "dst": dst,
        "instance": instance,
        "migration": migration,
        "second_migration": new_uuid(),
        "instance_generation": generation,
    }


def _worker(
    url: str, role: int, rounds: list[tuple[dict[str, Any], str, float]], barrier: Any, out: Any
) -> None:
    """One OS process: its own store; before each round it waits at the barrier with the other."""

    async def main() -> list[str]:
        outcomes = []
        async with open_store(url, **({"pool_size": 2} if url.startswith("postgresql") else {})) as store:
            for world, command, delay in rounds:
                await asyncio.to_thread(barrier.wait, 60)
                if delay:
                    await asyncio.sleep(delay)
                try:
                    await COMMANDS[command](store, world)
                    outcomes.append("ok")
                except EvstoreError as exc:
                    outcomes.append(exc.code)
        return outcomes

    out.put((role, asyncio.run(main())))


async def test_every_pair_from_two_processes_behind_a_barrier_leaks_nothing(store_url: str) -> None:
    rounds: list[tuple[dict[str, Any], str, str, float]] = []
    async with open_store(store_url) as store:
        plan = [(first, second, offset) for first, second in PAIRS for offset in OFFSETS]
        worlds = await asyncio.gather(*(build(store, i) for i in range(len(plan))))
        rounds = [(w, *step) for w, step in zip(worlds, plan, strict=True)]
        setup_head = await store.head()

    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    plans = [
        [(w, first, 0.0) for w, first, _, _ in rounds],
        [(w, second, offset) for w, _, second, offset in rounds],
    ]
    procs = [
        ctx.Process(target=_worker, args=(store_url, role, plans[role], barrier, out)) for role in (0, 1)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(await asyncio.to_thread(lambda: [out.get(timeout=300) for _ in procs]))
    finally:
        for p in procs:
            await asyncio.to_thread(p.join, 60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]

    async with open_store(store_url) as store:
        report = await store.audit()
        assert report.clean, report.findings  # no leak, no drift, never over capacity
        events = await store.read(0, await store.head() + 1)
        assert [e.position for e in events] == list(range(1, len(events) + 1))
        assert len(events) > setup_head
        for i, (w, first, second, offset) in enumerate(rounds):
            label = f"{first} | {second} (+{offset}s)"
            a, b = results[0][i], results[1][i]
            inst = await store.allocations(w["instance"])
            if inst.deleted:
                assert dict(inst.allocations) == {}, label
                for m in (w["migration"], w["second_migration"]):
                    assert dict((await store.allocations(m)).allocations) == {}, (label, m)
            total: dict[str, int] = {}
            for p in (w["src"], w["dst"]):
                for consumer, res in (await store.provider_allocations(p)).items():
                    assert not (await store.allocations(consumer)).deleted, (label, consumer)
                    for rc, n in res.items():
                        total[rc] = total.get(rc, 0) + n
            usage: dict[str, int] = {}
            for p in (w["src"], w["dst"]):
                for rc, n in (await store.usage(p)).usages.items():
                    usage[rc] = usage.get(rc, 0) + n
            assert {rc: n for rc, n in usage.items() if n} == total, label
            if {first, second} == {"delete_consumer", "revert_migration"}:
                delete, revert = (a, b) if first == "delete_consumer" else (b, a)
                assert delete == "ok" and revert in ("ok", "evstore.consumer.deleted"), (label, a, b)
                assert set((await store.usage(w["src"])).usages.values()) == {0}, label
                assert set((await store.usage(w["dst"])).usages.values()) == {0}, label
