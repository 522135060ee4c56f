"""Adversarial review of stop 42's two PostgreSQL changes (helper E).

- f90ad57: tasks sharing a sequencer run take their positions from it (``_seq_sharers`` /
  ``_seq_found``). Every receipt must name where its event really is (``store.read``), also with
  other stores (processes) on the schema positioning events first, a run that fails or is
  cancelled, and seqs the run finds no position for; nothing may be kept once its tasks leave.
- 23bc440: ``_Tickets.close`` (a call waiting for a connection hears StoreClosed as close begins)
  and the fresh tickets of an open after a close: no ticket lost or handed twice.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

from evstore import AllocationStore, Inventory, StorageError, open_store
from evstore.log import postgres
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 10.0  # a hang guard, not a timing assertion


def _pg(store: Any) -> PostgresBackend:
    backend = store._backend
    assert isinstance(backend, PostgresBackend)
    return backend


def _nothing_kept(backend: PostgresBackend) -> None:
    assert (backend._seq_sharers, backend._seq_found, backend._seq_wanted) == ({}, {}, [])


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.005)


async def _burst(store: AllocationStore, rps: list[str], count: int) -> tuple[list[str], list[Any]]:
    """``count`` commands at once, spread over ``rps`` (commands on one provider go one at a time)."""
    consumers = [new_uuid() for _ in range(count)]
    receipts = await asyncio.gather(
        *[
            store.set_allocations(
                c,
                {rps[i % len(rps)]: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
            for i, c in enumerate(consumers)
        ]
    )
    return consumers, list(receipts)


async def _each_where_it_is(store: AllocationStore, consumers: list[str], receipts: list[Any]) -> None:
    """Each receipt's one position holds that consumer's event (``store.read``)."""
    for consumer, receipt in zip(consumers, receipts, strict=True):
        assert len(receipt.positions) == 1
        (recorded,) = await store.read(receipt.positions[0] - 1, 1)
        assert recorded.position == receipt.positions[0]
        assert f"consumer:{consumer}" in recorded.event.entities()


async def _unpositioned(store: AllocationStore, rp: str, count: int) -> list[int]:
    """``count`` committed commands whose events the sequencer has not positioned (their writer
    "died" between its commit and the sequencing): their seqs, in order."""
    backend = _pg(store)

    async def died(conn: Any) -> None:
        raise RuntimeError("the process died between its commit and the sequencing")

    backend._after_commit = died
    for _ in range(count):
        with contextlib.suppress(StorageError):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    backend._after_commit = None
    async with backend._connection() as conn:
        rows = await conn.fetch("SELECT seq FROM events WHERE position IS NULL ORDER BY seq")
    assert len(rows) == count
    return [r["seq"] for r in rows]


async def _true_positions(backend: PostgresBackend, seqs: list[int]) -> list[int]:
    async with backend._connection() as conn:
        return list(await conn.fetchval("SELECT evstore_positions($1)", seqs))


# --- f90ad57: positions handed to the tasks that share a run ------------------------------------


async def test_bursts_of_three_stores_on_one_schema_each_get_the_positions_of_their_own_events(
    pg_url: str,
) -> None:
    """Three stores (as three processes) each send a burst at once: each store's runs are asked
    for seqs another store's run may have positioned first; every receipt names its own event."""
    stores = [await open_store(pg_url, pool_size=3) for _ in range(3)]
    try:
        rps = [await make_provider(stores[0], VCPU=Inventory(total=10_000)) for _ in range(6)]
        async with asyncio.timeout(GUARD * 3):
            bursts = await asyncio.gather(*[_burst(s, rps, 24) for s in stores])
        for store, (consumers, receipts) in zip(stores, bursts, strict=True):
            await _each_where_it_is(store, consumers, receipts)
            _nothing_kept(_pg(store))
        every = sorted(p for _, receipts in bursts for r in receipts for p in r.positions)
        assert every == list(range(13, 13 + 72))  # (after the providers' 12 events: none twice)
    finally:
        for store in stores:
            await store.close()


@pytest.mark.parametrize("when", ["before", "after"])
async def test_a_run_that_fails_leaves_its_sharers_to_find_their_own(pg_url: str, when: str) -> None:
    """Two runs that other commands share fail (before the statement, or after it positioned
    everything): their sharers are handed nothing of them and still get the right positions;
    nothing is kept."""
    async with open_store(pg_url, pool_size=8) as store:
        backend = _pg(store)
        rps = [await make_provider(store, VCPU=Inventory(total=10_000)) for _ in range(8)]
        real = postgres._sequence
        failed: list[int] = []  # (how many seqs each failed run was asked for)

        async def flaky(conn: Any, key: int, wait: bool, want: list[int]) -> Any:
            await asyncio.sleep(0.02)  # (more commands commit meanwhile, to share the next run)
            if len(failed) < 2 and len(want) > 1:  # (a run others share)
                failed.append(len(want))
                if when == "after":
                    await real(conn, key, wait, want)
                raise asyncpg.exceptions.SerializationError("the run failed")
            return await real(conn, key, wait, want)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(postgres, "_sequence", flaky)
            async with asyncio.timeout(GUARD):
                consumers, receipts = await _burst(store, rps, 32)
        assert len(failed) == 2
        await _each_where_it_is(store, consumers, receipts)
        _nothing_kept(backend)


@pytest.mark.parametrize("victim", ["runner", "sharer_waiting", "sharer_after_the_run"])
async def test_a_task_cancelled_at_each_await_of_a_shared_run_leaves_the_others_right(
    pg_url: str, victim: str
) -> None:
    """Three tasks want positions: the first runs, the others share its run. One is cancelled -
    the runner in its run, a sharer while the run goes on, or a sharer once the run ended but
    before it took the lock back. The others get the true positions; nothing is kept."""
    async with open_store(pg_url) as store:
        backend = _pg(store)
        rp = await make_provider(store, VCPU=4)
        seqs = await _unpositioned(store, rp, 3)
        real = postgres._sequence
        entered, go = asyncio.Event(), asyncio.Event()
        tasks: list[asyncio.Future[tuple[int, ...]]] = []

        class Handing(asyncio.Lock):
            def release(self) -> None:
                super().release()  # (hands the lock to the first sharer waiting: it has not run yet)
                if victim == "sharer_after_the_run" and go.is_set() and not tasks[1].done():
                    tasks[1].cancel()

        backend._seq_lock = Handing()

        async def held(conn: Any, key: int, wait: bool, want: list[int]) -> Any:
            entered.set()
            await go.wait()
            return await real(conn, key, wait, want)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(postgres, "_sequence", held)
            await backend._seq_lock.acquire()  # (a run in progress: all three share the next)
            tasks += [asyncio.ensure_future(backend._positions_of([s])) for s in seqs]
            await asyncio.sleep(0)
            backend._seq_lock.release()
            await _until(entered.is_set)  # (the first is the runner, in its run)
            if victim == "runner":
                tasks[0].cancel()
            elif victim == "sharer_waiting":
                tasks[1].cancel()
            go.set()
            async with asyncio.timeout(GUARD):
                done = await asyncio.gather(*tasks, return_exceptions=True)
        truth = await _true_positions(backend, seqs)
        assert None not in truth
        cancelled = 0 if victim == "runner" else 1
        for i, got in enumerate(done):
            if i == cancelled:
                assert isinstance(got, asyncio.CancelledError)
            else:
                assert got == (truth[i],)
        _nothing_kept(backend)


async def test_a_shared_run_that_finds_no_position_for_one_seq_hands_the_others_theirs(pg_url: str) -> None:
    """A run asked for a seq no event has (its position: None) and for real ones: the sharers of
    the real ones get theirs, the other is refused (StorageError); nothing is kept."""
    async with open_store(pg_url) as store:
        backend = _pg(store)
        rp = await make_provider(store, VCPU=4)
        seqs = await _unpositioned(store, rp, 2)
        await backend._seq_lock.acquire()
        tasks = [asyncio.ensure_future(backend._positions_of(w)) for w in ([seqs[0]], [10**12], [seqs[1]])]
        await asyncio.sleep(0)
        backend._seq_lock.release()
        async with asyncio.timeout(GUARD):
            done = await asyncio.gather(*tasks, return_exceptions=True)
        truth = await _true_positions(backend, seqs)
        assert (done[0], done[2]) == ((truth[0],), (truth[1],))
        assert isinstance(done[1], StorageError)
        _nothing_kept(backend)


async def test_another_store_positions_a_sharers_events_first(pg_url: str) -> None:
    """Another store (process) positions the events before this store's run: the run's first look
    finds them positioned, and the tasks that shared it get those positions."""
    async with open_store(pg_url) as store, open_store(pg_url) as other:
        backend = _pg(store)
        rp = await make_provider(store, VCPU=4)
        seqs = await _unpositioned(store, rp, 3)
        await backend._seq_lock.acquire()
        tasks = [asyncio.ensure_future(backend._positions_of([s])) for s in seqs]
        await asyncio.sleep(0)
        await other.head()  # (its catch-up positions them)
        backend._seq_lock.release()
        async with asyncio.timeout(GUARD):
            done = await asyncio.gather(*tasks)
        truth = await _true_positions(backend, seqs)
        assert done == [(p,) for p in truth]
        _nothing_kept(backend)


# --- 23bc440: the pool's tickets under close and a second open ---------------------------------


async def test_a_connection_held_through_a_close_gives_its_ticket_back_to_its_own_pool(pg_url: str) -> None:
    """A read held its connection through close() (the pool's close ran out: terminated), and
    the backend was opened again before it ended: its ticket, given back then, must not become
    one more ticket than the new pool has connections (pool_size 1: two calls past the tickets,
    the second waiting in asyncpg's queue, which the tickets are there to keep empty)."""
    backend = PostgresBackend(pg_url, pool_size=1)
    await backend.open()
    release = asyncio.Event()

    async def hold() -> None:
        async with backend._connection():
            await release.wait()

    holder = asyncio.ensure_future(hold())
    try:
        await _until(lambda: backend._tickets._free == 0)
        pool = backend._pool
        assert pool is not None

        async def ran_out(self: Any) -> None:
            raise TimeoutError  # (as asyncio.wait_for(pool.close(), 10) does, the holder still out)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(pool), "close", ran_out)
            await backend.close()
        await backend.open()
        release.set()
        async with asyncio.timeout(GUARD):
            await asyncio.wait([holder])
        assert await backend.head() >= 0
        assert (backend._tickets._free, list(backend._tickets._waiters)) == (1, [])
    finally:
        release.set()
        await backend.close()
        await asyncio.wait([holder])
        if not holder.cancelled():
            holder.exception()


async def test_each_pool_has_its_own_tickets_also_when_opened_again_without_a_close(pg_url: str) -> None:
    """An open over an open backend (no close between): the new pool gets its own tickets, all
    free, and the old pool's call, ending after it, takes none from them nor adds one to them."""
    backend = PostgresBackend(pg_url, pool_size=1)
    await backend.open()
    old = backend._pool
    assert old is not None
    release = asyncio.Event()

    async def hold() -> None:
        async with backend._connection():
            await release.wait()

    holder = asyncio.ensure_future(hold())
    try:
        await _until(lambda: backend._tickets._free == 0)
        await backend.open()
        assert (backend._tickets._free, backend._tickets.pool) == (1, backend._pool)
        release.set()
        async with asyncio.timeout(GUARD):
            await holder
        assert await backend.head() >= 0
        assert (backend._tickets._free, list(backend._tickets._waiters)) == (1, [])
    finally:
        release.set()
        await backend.close()
        old.terminate()
        await asyncio.wait([holder])
