"""A read leaves the cyclic collector on for the rest of the process while it waits for the
database: other tasks' cyclic garbage is collected however many reads overlap."""

from __future__ import annotations

import asyncio
import gc

from evstore import AllocationStore, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def test_the_collector_stays_on_for_other_tasks_while_postgres_reads_wait(pg_url: str) -> None:
    """Review 29 (helper-96): c6b69b1 paused the collector (process-wide) around every PostgreSQL
    read's ``await conn.fetch``, so every other task ran without it while a read waited on the
    server. Reads that overlap (subscribers, history requests) kept it off nearly all the time:
    16 readers for 25 s with a task making cyclic garbage, 243 collections and RSS 59 -> 207 MiB
    (13,320 collections, flat 57 MiB, without the pause)."""
    was = gc.isenabled()
    gc.enable()
    try:
        async with open_store(pg_url) as store:
            rp = await make_provider(store, VCPU=10**6)
            await asyncio.gather(*(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(50)))
            seen: list[bool] = []
            done = asyncio.Event()

            async def watch() -> None:
                while not done.is_set():
                    seen.append(gc.isenabled())
                    await asyncio.sleep(0)

            async def readers() -> None:
                try:
                    for _ in range(10):
                        await asyncio.gather(*(store.read(0, 60) for _ in range(4)))
                        assert len([e async for e in store.history(rp)]) == 52
                finally:
                    done.set()

            await asyncio.gather(watch(), readers())
    finally:
        if not was:
            gc.disable()
    assert seen and all(seen), (
        f"the collector was off for other tasks {seen.count(False)} times of {len(seen)}"
    )


async def test_a_read_does_not_hand_out_the_metadata_of_an_earlier_read(store: AllocationStore) -> None:
    """Review 29 (helper-96): 819c6e5 kept the last metadata decoded in a module global, for the
    events of one command to share one model; it was shared with every later read too (of any
    store, task or subscriber), so a caller changing a list in one read's metadata changed what
    every later read of that event returned - data the log does not hold."""
    rp = await make_provider(store, VCPU=10)
    await store.set_allocations(
        new_uuid(),
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        metadata={"tags": ["a"]},
    )
    head = await store.head()
    first = (await store.read(head - 1, 1))[0]
    first.metadata.model_extra["tags"].append("changed by a caller")  # type: ignore[index]
    again = (await store.read(head - 1, 1))[0]
    assert again.metadata is not first.metadata
    assert again.metadata.model_extra == {"tags": ["a"]}
    assert again.to_dict()["metadata"]["tags"] == ["a"]
    assert [e async for e in store.history(rp)][-1].metadata.model_extra == {"tags": ["a"]}
