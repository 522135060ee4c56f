"""Tasks that share a sequencer run get their positions from it (stop 42, helper B).

Commits that finish while a sequencer run is in progress share the next run; the run is asked for
all their seqs and returns all their positions, but each task that shared it then read its own
again (``SELECT evstore_positions``): one more round trip for about half the commands of a burst
(0.55 per command, 256 concurrent set_allocations). The run's positions are now handed to them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from evstore import Inventory, StorageError, StoreClosed, open_store
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 10.0  # a hang guard, not a timing assertion


def _pg(store: Any) -> PostgresBackend:
    backend = store._backend
    assert isinstance(backend, PostgresBackend)
    return backend


async def test_a_task_sharing_a_run_gets_its_positions_without_reading_them_again(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        backend = _pg(store)
        rp = await make_provider(store, VCPU=4)

        async def held_back(conn: Any) -> None:
            raise RuntimeError("the process died between its commit and the sequencing")

        backend._after_commit = held_back  # (two committed commands, their events unpositioned)
        for _ in range(2):
            with contextlib.suppress(StorageError):  # (committed; its positions are not known)
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        backend._after_commit = None
        async with backend._connection() as conn:
            seqs = [
                r["seq"]
                for r in await conn.fetch("SELECT seq FROM events WHERE position IS NULL ORDER BY seq")
            ]
        assert len(seqs) == 2

        connections = 0
        plain = backend._connection

        @contextlib.asynccontextmanager
        async def counted(command: bool = False) -> AsyncIterator[Any]:
            nonlocal connections
            connections += 1
            async with plain(command) as conn:
                yield conn

        backend._connection = counted  # type: ignore[method-assign]
        await backend._seq_lock.acquire()  # (a run in progress: both tasks wait for the next one)
        first = asyncio.ensure_future(backend._positions_of([seqs[0]]))
        second = asyncio.ensure_future(backend._positions_of([seqs[1]]))
        await asyncio.sleep(0)
        backend._seq_lock.release()
        async with asyncio.timeout(GUARD):
            got = await asyncio.gather(first, second)
        assert got == [(3,), (4,)]  # (after the provider's two events)
        assert connections == 1  # (the run's: the task that shared it read nothing)
        assert (backend._seq_sharers, backend._seq_found) == ({}, {})


async def test_a_burst_of_commands_gets_the_positions_of_its_own_events(pg_url: str) -> None:
    """Each receipt of a burst (many tasks sharing each run) names its own event's position."""
    async with open_store(pg_url, pool_size=4) as store:
        backend = _pg(store)
        rp = await make_provider(store, VCPU=Inventory(total=10_000))
        consumers = [new_uuid() for _ in range(48)]
        async with asyncio.timeout(GUARD):
            receipts = await asyncio.gather(
                *[
                    store.set_allocations(
                        c,
                        {rp: {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                    )
                    for c in consumers
                ]
            )
        for consumer, receipt in zip(consumers, receipts, strict=True):
            assert len(receipt.positions) == 1
            (recorded,) = await store.read(receipt.positions[0] - 1, 1)
            assert recorded.position == receipt.positions[0]
            assert f"consumer:{consumer}" in recorded.event.entities()
        assert sorted(p for r in receipts for p in r.positions) == list(range(3, 3 + len(consumers)))
        assert (backend._seq_sharers, backend._seq_found) == ({}, {})


async def test_tasks_cancelled_while_they_share_a_run_leave_nothing_kept(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        backend = _pg(store)
        await make_provider(store, VCPU=4)
        await backend._seq_lock.acquire()
        waiting = [asyncio.ensure_future(backend._sequenced([1], shared={})) for _ in range(3)]
        await asyncio.sleep(0)
        waiting[1].cancel()
        backend._seq_lock.release()
        async with asyncio.timeout(GUARD):
            done = await asyncio.gather(*waiting, return_exceptions=True)
        assert done[0] == [1] and done[2] is None
        assert (backend._seq_sharers, backend._seq_found) == ({}, {})


async def test_a_burst_closed_midway_answers_every_caller_and_loses_no_receipt(pg_url: str) -> None:
    """close() during a burst: every caller gets a receipt (or StoreClosed, for a command not
    taken yet), and every receipt's event is in the log at its position."""
    store = await open_store(pg_url, pool_size=4)
    rp = await make_provider(store, VCPU=Inventory(total=10_000))
    consumers = [new_uuid() for _ in range(64)]
    calls = [
        asyncio.ensure_future(
            store.set_allocations(
                c, {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
            )
        )
        for c in consumers
    ]
    for _ in range(5):
        await asyncio.sleep(0)
    async with asyncio.timeout(GUARD):
        await store.close()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    receipts = {c: o for c, o in zip(consumers, outcomes, strict=True) if not isinstance(o, BaseException)}
    assert all(isinstance(o, StoreClosed) for o in outcomes if isinstance(o, BaseException)), outcomes
    assert receipts
    async with open_store(pg_url) as again:
        for consumer, receipt in receipts.items():
            (recorded,) = await again.read(receipt.positions[0] - 1, 1)
            assert f"consumer:{consumer}" in recorded.event.entities()
        assert (await again.audit()).clean
