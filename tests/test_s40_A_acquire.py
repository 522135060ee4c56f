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
from evstore.log import postgres
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


class _ScriptedPool:
    """A pool whose acquires play ``script`` in turn: an error to raise, or a callable run first
    (a pause, a connection the pool opened meanwhile) before the next step."""

    def __init__(self, script: list[Any], size: int) -> None:
        self.script = script
        self.size = size

    def get_size(self) -> int:
        return self.size

    def get_idle_size(self) -> int:
        return 0

    async def acquire(self, timeout: float | None = None) -> Any:
        while True:
            step = self.script.pop(0)  # (a step too many: IndexError)
            if isinstance(step, BaseException):
                raise step
            await step()


def _refused() -> asyncpg.exceptions.TooManyConnectionsError:
    return asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already")


async def test_a_timeout_right_after_a_refusal_is_put_down_to_it() -> None:
    """The wait for a connection ran out just after the server refused one for want of a slot,
    the pool below its size: the refusal is the cause, and is what the caller gets (as before)."""
    backend = PostgresBackend("postgresql://evstore@127.0.0.1:1/evstore", pool_size=3, connect_timeout=5)
    pool = backend._pool = _ScriptedPool([_refused(), TimeoutError()], size=1)  # type: ignore[assignment]
    with pytest.raises(asyncpg.exceptions.TooManyConnectionsError):
        await backend._acquire(pool)
    assert pool.script == []


async def test_a_timeout_with_a_cause_of_its_own_is_not_put_down_to_an_earlier_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: a refusal for want of a slot was remembered for the rest of the wait: a
    timeout after it, the pool below its size, was raised as that refusal even where it had
    another cause - the server that then left a connect unanswered past the refusal's time, or
    a pool that has opened a connection since (the slots came free; its connections were busy).
    Those are the timeouts they are ("did not answer within connect_timeout")."""
    monkeypatch.setattr(postgres, "_REFUSAL_FRESH", 0.05, raising=False)
    backend = PostgresBackend("postgresql://evstore@127.0.0.1:1/evstore", pool_size=3, connect_timeout=5)

    async def unanswered() -> None:  # (a connect the server does not answer, past the refusal's time)
        await asyncio.sleep(0.2)

    pool = backend._pool = _ScriptedPool([_refused(), unanswered, TimeoutError()], size=1)  # type: ignore[assignment]
    with pytest.raises(TimeoutError):
        await backend._acquire(pool)
    assert pool.script == []

    async def opened() -> None:  # (a slot came free: the pool opened a connection, then waited)
        await backend._opened_one(_Connection())

    pool = backend._pool = _ScriptedPool([_refused(), opened, TimeoutError()], size=2)  # type: ignore[assignment]
    with pytest.raises(TimeoutError):
        await backend._acquire(pool)
    assert pool.script == []


class _Connection:
    async def execute(self, *args: Any) -> None:
        pass

    async def fetchval(self, *args: Any) -> str:  # (the first connection's search_path, asked)
        return "public"


async def test_the_pool_counts_the_connections_it_opens(pg_url: str) -> None:
    """What the refusal's rule reads: each connection the pool opens is counted."""
    async with open_store(pg_url, pool_size=3, min_pool_size=1) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend) and backend._pool is not None
        before = backend._opened
        assert before >= 1
        await backend._pool.expire_connections()
        await store.head()
        assert backend._opened == before + 1
