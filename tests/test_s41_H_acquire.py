"""Callers cancelled while they wait for one of the pool's connections leave nothing queued ahead
of the live ones (stop 41, helper H).

``_acquire`` lets asyncpg's acquire finish in a task of its own when its caller is cancelled
(see tests/test_s40_A_acquire.py), and gives back the connection that arrives. With the pool
full, each cancelled caller left such an acquire waiting in asyncpg's queue: every connection
that came free went to those first, one after the other (each given back after its reset), and
live callers waited behind the whole backlog - under a storm of cancellations (callers with
timeouts) for as long as it lasted.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import pytest

from evstore import open_store
from evstore.log import postgres
from evstore.log.postgres import PostgresBackend

GUARD = 10.0  # a hang guard, not a timing assertion

_WHO: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="?")


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[str]]:
    """What the running loop's exception handler was given ("never retrieved", ...), as text."""
    loop = asyncio.get_running_loop()
    seen: list[str] = []
    before = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, ctx: seen.append(f"{ctx.get('message')} {ctx.get('exception')!r}"))
    yield seen
    loop.set_exception_handler(before)


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


async def _turns(n: int = 50) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _as(who: str, coro: Any) -> asyncio.Task[Any]:
    context = contextvars.copy_context()
    context.run(_WHO.set, who)
    return asyncio.get_running_loop().create_task(coro, context=context)


async def test_callers_cancelled_while_the_pool_is_full_take_no_connection_ahead_of_a_live_one(
    pg_url: str, loop_errors: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: 8 reads cancelled while both connections of the pool were held, then a live
    read: each connection given back went to the cancelled reads' acquires first (8 of them,
    each giving it back after a reset), the live read last. Now none of them takes one; the
    live read gets the first to come free, nothing is logged and none leaks."""
    async with open_store(pg_url, pool_size=2, min_pool_size=2, connect_timeout=GUARD) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        pool = backend._pool
        assert pool is not None
        handed: list[str] = []  # (who each acquire of the pool gave a connection to, in turn)
        real = asyncpg.Pool.acquire

        def acquire(self: asyncpg.Pool, *, timeout: float | None = None) -> Any:
            who = _WHO.get()

            async def recorded() -> Any:
                conn = await real(self, timeout=timeout)
                handed.append(who)
                return conn

            return recorded()

        monkeypatch.setattr(asyncpg.Pool, "acquire", acquire)
        release = asyncio.Event()

        async def hold() -> None:
            async with backend._connection():
                await release.wait()

        holders = [_as("holder", hold()) for _ in range(2)]
        await _until(lambda: handed == ["holder", "holder"])
        ghosts = [_as(f"ghost{i}", store.head()) for i in range(8)]
        await _turns()  # (all waiting for a connection)
        for ghost in ghosts:
            ghost.cancel()
        async with asyncio.timeout(GUARD):
            await asyncio.wait(ghosts)
        assert all(g.cancelled() for g in ghosts)
        live = _as("live", store.head())
        await _turns()
        release.set()
        async with asyncio.timeout(GUARD):
            assert await live == 0
            await asyncio.gather(*holders)
        before_live = handed[2 : handed.index("live")]
        assert before_live == [], f"connections went to cancelled callers first: {before_live}"
        await _until(lambda: not backend._orphans and pool.get_idle_size() == pool.get_size() == 2)
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
        assert loop_errors == []
        async with backend._connection(), backend._connection():  # (none leaked)
            pass
        assert await store.head() == 0


async def test_a_caller_that_runs_out_of_connect_timeout_behind_a_full_pool_says_so(pg_url: str) -> None:
    """The wait for a connection of a full pool is still bounded by connect_timeout, and says
    why; the connection it did not get is not lost (the pool's both are usable after)."""
    async with open_store(pg_url, pool_size=2, min_pool_size=2, connect_timeout=0.2) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        release = asyncio.Event()

        async def hold() -> None:
            async with backend._connection():
                await release.wait()

        holders = [asyncio.create_task(hold()) for _ in range(2)]
        await _turns()
        with pytest.raises(Exception) as caught:
            await store.head()
        assert "No connection of the pool came free within connect_timeout (0.2 s)" in str(caught.value)
        release.set()
        async with asyncio.timeout(GUARD):
            await asyncio.gather(*holders)
        async with backend._connection(), backend._connection():
            pass
        assert await store.head() == 0


async def test_a_storm_of_cancelled_callers_leaves_the_pool_whole(
    pg_url: str, loop_errors: list[str]
) -> None:
    """Callers cancelled at every point of their wait for a connection (queued, handed one as
    they were cancelled, connecting): every connection comes back, nothing is logged."""
    async with open_store(pg_url, pool_size=3, min_pool_size=0, connect_timeout=GUARD) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        pool = backend._pool
        assert pool is not None
        for round_ in range(6):
            if round_ % 2:
                await pool.expire_connections()  # (the next acquires connect anew)
            callers = [asyncio.create_task(store.head()) for _ in range(12)]
            for turn, caller in enumerate(callers):
                if turn % 3:
                    await asyncio.sleep(0.001 * (turn % 4))
                caller.cancel()
            async with asyncio.timeout(GUARD):
                await asyncio.wait(callers)
        await _until(lambda: not backend._orphans and pool.get_idle_size() == pool.get_size())
        gc.collect()
        await asyncio.sleep(0.05)
        gc.collect()
        assert loop_errors == []
        async with backend._connection(), backend._connection(), backend._connection():
            assert pool.get_size() == 3
        assert await store.head() == 0


async def test_tickets_go_in_turn_and_a_waiter_cancelled_or_timed_out_as_it_got_one_passes_it_on() -> None:
    """The tickets in front of the pool's acquire: first come, first served; a waiter cancelled
    or out of time leaves the queue; one handed a ticket in the same turn as its cancellation
    passes it to the next, so none is lost."""
    tickets = postgres._Tickets(1)
    await tickets.take(GUARD)  # (the one ticket: the rest wait)
    got: list[str] = []

    async def wait(name: str, within: float = GUARD) -> None:
        await tickets.take(within)
        got.append(name)

    a, b, c = (asyncio.create_task(wait(n)) for n in "abc")
    late = asyncio.create_task(wait("late", 0.01))
    await _turns()
    async with asyncio.timeout(GUARD):
        with pytest.raises(TimeoutError):
            await late
    b.cancel()  # (still waiting: leaves)
    await asyncio.wait([b])
    tickets.give()  # (to a)
    a.cancel()  # (the same turn: a got it, and passes it on to c)
    async with asyncio.timeout(GUARD):
        await asyncio.wait([a, c])
    assert a.cancelled() and b.cancelled() and got == ["c"]
    tickets.give()  # (c's)
    await tickets.take(GUARD)  # (not lost: there is one again, and only one)
    with pytest.raises(TimeoutError):
        await tickets.take(0.01)
