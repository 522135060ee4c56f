"""A read or command cancelled while the pool opens a connection for it (stop 40, helper A).

asyncpg 0.32 opens a connection under the default ``sslmode`` (prefer) by asking the server for
TLS first. A task cancelled while that connection is being made closes its transport, whose
protocol then sets an error nobody awaits: asyncio logs "Future exception was never retrieved
... unexpected connection_lost() call" (MagicStack/asyncpg#1211, #1310). evstore's ``_acquire``
lets the pool's acquire finish in a task of its own instead, and gives back a connection that
arrives after its caller has gone.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import asyncpg.connect_utils
import pytest

from evstore import open_store
from evstore.log.postgres import PostgresBackend

GUARD = 10.0  # a hang guard, not a timing assertion


@pytest.fixture
async def loop_errors() -> AsyncIterator[list[str]]:
    """What the running loop's exception handler was given ("never retrieved", "Task was
    destroyed", ...), as text."""
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


async def test_a_read_cancelled_while_the_pool_connects_logs_nothing_and_leaks_nothing(
    pg_url: str, loop_errors: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a read cancelled while the pool was opening a connection for it (here: just
    as the TLS request's connection was made, as a caller's timeout or a shutdown may) left
    asyncpg's "unexpected connection_lost() call" error in a future nobody awaited, logged by
    asyncio as "Future exception was never retrieved". The caller still sees its cancellation at
    once; the connection that arrives after it has gone goes back to the pool."""
    victims: list[asyncio.Task[Any]] = []
    made = asyncpg.connect_utils.TLSUpgradeProto.__init__

    def cancel_the_caller(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        if victims:  # (the next loop turn: the connection is being made, its transport not yet ready)
            asyncio.get_running_loop().call_soon(victims.pop().cancel)

    async with open_store(pg_url, pool_size=3, min_pool_size=0, connect_timeout=GUARD) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        pool = backend._pool
        assert pool is not None
        monkeypatch.setattr(asyncpg.connect_utils.TLSUpgradeProto, "__init__", cancel_the_caller)
        for _ in range(5):
            await pool.expire_connections()  # (the next acquire connects anew)
            victim = asyncio.ensure_future(store.head())
            victims.append(victim)
            async with asyncio.timeout(GUARD):
                with pytest.raises(asyncio.CancelledError):
                    await victim
            assert not victims  # (it was cancelled while connecting, as meant)
        monkeypatch.undo()
        await _until(lambda: pool.get_idle_size() == pool.get_size() and not getattr(backend, "_orphans", ()))
        gc.collect()
        await asyncio.sleep(0.05)  # (the exception handler is called soon after a collection)
        gc.collect()
        assert loop_errors == []
        # none leaked: the pool's every connection can be held at once
        async with backend._connection(), backend._connection(), backend._connection():
            assert pool.get_size() == 3
        assert await store.head() == 0
