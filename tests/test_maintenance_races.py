"""Maintenance operations against live writers and readers, on both backends."""

from __future__ import annotations

import asyncio
import random

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 90.0  # a hang guard, not a timing assertion


async def test_a_full_rebuild_on_postgresql_does_not_deadlock_with_reads(pg_url: str) -> None:
    """Regression: ``rebuild(full=True)`` reindexed the projection's tables one after the other
    inside its transaction (each REINDEX locks the table's indexes exclusively), while reads -
    transactions that lock the tables they read one statement at a time, in another order - held
    one and waited for the next: PostgreSQL found a deadlock within a second and failed one side,
    the rebuild or the read ("deadlock detected", a StorageError), about every other rebuild with
    four readers. The rebuild now takes every projection table at once before touching them, in
    short attempts that give way to the reads (as the fence does), so no wait forms a cycle."""
    async with open_store(pg_url) as store:
        providers = [await make_provider(store, VCPU=64) for _ in range(3)]
        consumers = [new_uuid() for _ in range(12)]
        for i, c in enumerate(consumers):
            await allocate(store, c, {providers[i % 3]: {"VCPU": 1}}, project_id="p")
        async with open_store(pg_url) as reader:
            stop = asyncio.Event()
            reads = 0

            async def read() -> None:
                nonlocal reads
                while not stop.is_set():  # (each a transaction of several statements)
                    await reader.usages("p")
                    await reader.allocations(random.choice(consumers))
                    await reader.provider_allocations(random.choice(providers))
                    reads += 1

            tasks = [asyncio.create_task(read()) for _ in range(4)]
            try:
                async with asyncio.timeout(GUARD):
                    for _ in range(8):
                        assert await store.rebuild(full=True) == await store.head()
                        await asyncio.sleep(0)
            finally:
                stop.set()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            assert results == [None] * 4, results  # no read failed either
            assert reads
        assert (await store.audit(history=True)).clean
