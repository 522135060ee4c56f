"""PostgreSQL's resource shortages (SQLSTATE class 53) that pass by themselves are ridden out by
subscribers (stop 40, helper A): the server out of memory (53200) or of another resource (53000)
says ``transient`` as a refused connection slot (53300) did; a configuration limit (53400) and a
full disk (53100) do not, and end a subscriber at once with their reason."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
import structlog

from evstore import AllocationStore, StorageError, open_store
from evstore.log.postgres import PostgresBackend, _storage_error
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 10.0  # a hang guard, not a timing assertion

PASSING = [
    ("53000", asyncpg.exceptions.InsufficientResourcesError, "insufficient_resources"),
    ("53200", asyncpg.exceptions.OutOfMemoryError, "out_of_memory"),
]
LASTING = [
    ("53100", asyncpg.exceptions.DiskFullError, "disk_full"),
    ("53400", asyncpg.exceptions.ConfigurationLimitExceededError, "configuration_limit_exceeded"),
]


@pytest.mark.parametrize(("sqlstate", "cls", "reason"), PASSING + LASTING)
def test_the_shortages_that_pass_by_themselves_are_transient(
    sqlstate: str, cls: type[asyncpg.PostgresError], reason: str
) -> None:
    """Regression: only 53300 (too many connections) said ``transient``; the server out of memory
    (53200) or short of another resource (53000) ended a subscriber at its first error."""
    for committing in (None, False, True):
        failed = _storage_error(cls("out of it"), "reading", committing)
        assert failed.details["sqlstate"] == sqlstate and failed.details["reason"] == reason
        if (sqlstate, cls, reason) in PASSING:
            assert failed.details.get("transient") is True, failed.details
        else:
            assert "transient" not in failed.details, failed.details
        if committing is not None:  # (the server answered: rolled back, also at COMMIT)
            assert failed.details["outcome_unknown"] is False


def _short_for(backend: PostgresBackend, error: asyncpg.PostgresError, times: int) -> Callable[[], int]:
    """Makes the next ``times`` reads of ``backend`` (the poller's of the head, a subscriber's of
    the log) meet ``error`` from the server; answers how many did."""
    real = backend._read
    met = 0

    async def short(doing: str, work: Callable[[Any], Awaitable[Any]]) -> Any:
        nonlocal met
        if met < times:
            met += 1

            async def refused(conn: Any) -> Any:
                raise error

            return await real(doing, refused)
        return await real(doing, work)

    backend._read = short  # type: ignore[method-assign]
    return lambda: met


async def _followed(store: AllocationStore, after: int, got: list[int]) -> None:
    async for event in store.subscribe(after=after):
        got.append(event.position)


@pytest.mark.parametrize(("sqlstate", "cls", "reason"), PASSING)
async def test_a_subscriber_rides_out_the_server_short_of_memory(
    pg_url: str, sqlstate: str, cls: type[asyncpg.PostgresError], reason: str
) -> None:
    """Regression: a subscriber ended at the server's first "out of memory" (or other passing
    shortage) of its read of the head or of the log; it now retries with its back-off, logged as
    a warning, and gets every event."""
    async with open_store(pg_url, poll_interval=0.05) as store, open_store(pg_url) as writer:
        rp = await make_provider(writer, VCPU=100)
        start = await store.head()
        got: list[int] = []
        follower = asyncio.create_task(_followed(store, start, got))
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        with structlog.testing.capture_logs() as logs:
            met = _short_for(backend, cls("out of memory"), 2)
            await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
            async with asyncio.timeout(GUARD):
                while len(got) < 1 and not follower.done():
                    await asyncio.sleep(0.01)
        assert met() == 2 and not follower.done(), follower
        assert got == [start + 1]
        retries = [e for e in logs if e["event"] in ("subscribe.read_retry", "subscribe.poll_retry")]
        assert retries and all(e["log_level"] == "warning" for e in retries), logs
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


@pytest.mark.parametrize(("sqlstate", "cls", "reason"), LASTING)
async def test_a_lasting_shortage_still_ends_a_subscriber_at_once(
    pg_url: str, sqlstate: str, cls: type[asyncpg.PostgresError], reason: str
) -> None:
    """A configuration limit or a full disk is not waited out: the subscriber ends with it."""
    async with open_store(pg_url, poll_interval=0.05) as store, open_store(pg_url) as writer:
        rp = await make_provider(writer, VCPU=100)
        got: list[int] = []
        follower = asyncio.create_task(_followed(store, await store.head(), got))
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        _short_for(backend, cls("out of it"), 1)
        await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
        async with asyncio.timeout(GUARD):
            with pytest.raises(StorageError) as ended:
                await follower
        assert ended.value.details["sqlstate"] == sqlstate and ended.value.details["reason"] == reason
        assert got == []
