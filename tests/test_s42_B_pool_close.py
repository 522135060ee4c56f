"""A call waiting for one of the pool's connections when the store closes is told StoreClosed at
once (stop 42, helper B).

Every connection of the pool was busy (here: the one of ``pool_size=1``, held by a read the test
keeps waiting on a table lock), and another call waited for its ticket (``_Tickets``, in front of
asyncpg's acquire). ``close()`` then began: the waiter was woken only by a release or by
``connect_timeout`` - and only then told StoreClosed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import asyncpg
import pytest

from evstore import StoreClosed, open_store
from evstore.log import postgres
from evstore.log.postgres import PostgresBackend

GUARD = 10.0  # a hang guard, not a timing assertion


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


async def test_a_call_waiting_for_a_connection_is_told_store_closed_when_close_begins(pg_url: str) -> None:
    store = await open_store(pg_url, pool_size=1, connect_timeout=60)
    backend = store._backend
    assert isinstance(backend, PostgresBackend)
    other = await asyncpg.connect(pg_url)
    locked = other.transaction()
    await locked.start()
    holder = waiter = closing = None
    try:
        await other.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
        holder = asyncio.create_task(store.head())  # (takes the one connection, waits for the lock)
        await _until(lambda: backend._tickets._free == 0)
        waiter = asyncio.create_task(store.head())  # (waits for the one ticket)
        await _until(lambda: len(backend._tickets._waiters) == 1)
        closing = asyncio.create_task(store.close())
        async with asyncio.timeout(GUARD):
            with pytest.raises(StoreClosed):
                await waiter
        assert not holder.done()  # (told before the busy connection came back)
    finally:
        await locked.rollback()
        await other.close()
        async with asyncio.timeout(GUARD):
            if closing is None:
                await store.close()
            else:
                await closing
            for task in (holder, waiter):
                if task is not None:
                    await asyncio.wait([task])
                    if not task.cancelled():
                        task.exception()  # (retrieved: the holder may end either way)


async def test_closed_tickets_refuse_new_and_waiting_takers_and_a_late_give_changes_nothing() -> None:
    """``_Tickets.close``: the waiters and any later taker hear StoreClosed; a ticket given back
    afterwards (a release finishing) hands nothing to anyone and raises nothing."""
    tickets = postgres._Tickets(1)
    await tickets.take(GUARD)
    waiting = [asyncio.create_task(tickets.take(GUARD)) for _ in range(3)]
    await _until(lambda: len(tickets._waiters) == 3)
    tickets.close()
    async with asyncio.timeout(GUARD):
        for task in waiting:
            with pytest.raises(StoreClosed):
                await task
    tickets.give()
    with pytest.raises(StoreClosed):
        await tickets.take(GUARD)
    assert not tickets._waiters


async def test_a_backend_opened_again_after_a_close_has_its_tickets_again(pg_url: str) -> None:
    """An open that failed closes the backend (and its tickets); the store's next open() tries
    the same backend again: its calls must get connections, not StoreClosed."""
    backend = PostgresBackend(pg_url, pool_size=2)
    await backend.open()
    await backend.close()
    await backend.open()
    try:
        assert await backend.head() == 0
        assert await asyncio.gather(backend.head(), backend.head(), backend.head()) == [0, 0, 0]
    finally:
        await backend.close()
