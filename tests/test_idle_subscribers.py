"""Idle subscribers share one poller: a store reads the head of its log once per ``poll_interval``
for all its waiting subscribers, however many they are, and wakes them when another process (or
another store object) appended.

Before stop 31 each waiting subscriber read the log itself every ``poll_interval``: 500 idle
subscribers on PostgreSQL were 2,500 reads a second, 38% of a core, and command latency 10 -> 48 ms.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from evstore import AllocationStore, StorageError, StoreClosed, open_store
from evstore.events import RecordedEvent
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 60.0  # a hang guard, not a timing assertion: a wait that never ends fails the test here
POLLER = "evstore-subscribers-poller"


def pollers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == POLLER and not t.done()]


class Calls:
    """Counts the calls of a store's backend's ``head`` and ``read`` (wrapped on the instance)."""

    def __init__(self, store: AllocationStore, monkeypatch: pytest.MonkeyPatch) -> None:
        self.heads = 0
        self.reads = 0
        backend = store.backend
        head, read = backend.head, backend.read

        async def counted_head() -> int:
            self.heads += 1
            return await head()

        async def counted_read(after: int, limit: int) -> list[RecordedEvent]:
            self.reads += 1
            return await read(after, limit)

        monkeypatch.setattr(backend, "head", counted_head)
        monkeypatch.setattr(backend, "read", counted_read)


async def idle_subscribers(
    store: AllocationStore, n: int, after: int
) -> tuple[list[asyncio.Task[None]], list[list[int]]]:
    """``n`` subscribers following ``store`` from the head ``after``, once all of them have read
    the log (finding nothing: they wait for appends; they share one read since stop 32, so what
    is waited for is their waiting)."""
    seen: list[list[int]] = [[] for _ in range(n)]

    async def follow(got: list[int]) -> None:
        async for e in store.subscribe(after=after):
            got.append(e.position)

    waiting = len(store._idle)
    tasks = [asyncio.create_task(follow(got)) for got in seen]
    await until(lambda: len(store._idle) >= waiting + n)
    return tasks, seen


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


async def ended(tasks: list[asyncio.Task[None]]) -> list[BaseException | None]:
    async with asyncio.timeout(GUARD):
        await asyncio.wait(tasks)
    return [None if t.cancelled() else t.exception() for t in tasks]


async def test_idle_subscribers_cost_one_read_of_the_head_per_poll_interval_not_one_read_each(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    interval = 0.05
    async with open_store(store_url, poll_interval=interval) as store:
        await make_provider(store, VCPU=8)
        assert not pollers()  # (no subscriber, no poller)
        calls = Calls(store, monkeypatch)
        tasks, _ = await idle_subscribers(store, 50, await store.head())
        calls.heads = calls.reads = 0
        loop = asyncio.get_running_loop()
        start = loop.time()
        # (each subscriber polling on its own: 50 reads per interval, no head)
        await until(lambda: calls.heads >= 10 or calls.reads >= 500)
        elapsed = loop.time() - start
        assert calls.reads == 0, "an idle subscriber read the log"
        assert calls.heads <= elapsed / interval + 1, (calls.heads, elapsed)
        assert len(pollers()) == 1
        for t in tasks:
            t.cancel()
        await ended(tasks)
        # nobody waits: the poller ends at its next tick
        async with asyncio.timeout(GUARD):
            while pollers():
                await asyncio.sleep(0.01)
        heads = calls.heads
        await asyncio.sleep(3 * interval)
        assert calls.heads == heads


async def test_another_stores_commit_wakes_every_idle_subscriber(store_url: str) -> None:
    """Another store object on the same file or schema stands for another process: no commit of
    this store announces its appends, the poller finds them."""
    async with open_store(store_url, poll_interval=0.05) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=100)
        start = await store.head()
        tasks, seen = await idle_subscribers(store, 40, start)
        for _ in range(2):
            await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        await until(lambda: all(len(got) == 2 for got in seen))
        assert seen == [[start + 1, start + 2]] * 40
        for t in tasks:
            t.cancel()
        await ended(tasks)


async def test_this_stores_commits_wake_idle_subscribers_without_a_poll(store_url: str) -> None:
    async with open_store(store_url, poll_interval=3600) as store:
        rp = await make_provider(store, VCPU=100)
        start = await store.head()
        tasks, seen = await idle_subscribers(store, 20, start)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await until(lambda: all(got == [start + 1] for got in seen))
        for t in tasks:
            t.cancel()
        await ended(tasks)


async def test_a_failed_read_of_the_head_ends_every_idle_subscriber_with_its_error_and_polling_goes_on(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server gone: the poller's read of the head fails, and every waiting subscriber ends
    with that error (``evstore.storage``: what ``evstore tail --follow`` subscribes again after),
    not a silent background task that never polls again."""
    async with open_store(store_url, poll_interval=0.05) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=100)
        start = await store.head()
        tasks, _ = await idle_subscribers(store, 30, start)
        head = store.backend.head

        async def server_gone() -> int:
            raise StorageError(
                "Lost the connection to PostgreSQL while reading the head: gone", sqlstate="08006"
            )

        monkeypatch.setattr(store.backend, "head", server_gone)
        errors = await ended(tasks)
        assert all(isinstance(e, StorageError) for e in errors), errors
        assert {(e.code, e.details["sqlstate"]) for e in errors if isinstance(e, StorageError)} == {
            ("evstore.storage", "08006")
        }
        assert len({id(e) for e in errors}) == len(errors), "one exception raised in many tasks"
        assert not pollers()
        # the server is back: a subscriber that waits now is polled for again
        monkeypatch.setattr(store.backend, "head", head)
        tasks, seen = await idle_subscribers(store, 3, start)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        await until(lambda: all(got == [start + 1] for got in seen))
        for t in tasks:
            t.cancel()
        await ended(tasks)


async def test_a_cancelled_poller_does_not_leave_subscribers_waiting_for_it(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shutdown that cancels every task but the subscribers (or anything that cancels the
    poller): the subscribers it left read again, and the next to wait starts another."""
    async with open_store(store_url, poll_interval=0.05) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=100)
        start = await store.head()
        calls = Calls(store, monkeypatch)
        tasks, seen = await idle_subscribers(store, 10, start)
        (poller,) = pollers()
        reads = calls.reads
        poller.cancel()
        await asyncio.wait([poller])
        await until(lambda: calls.reads > reads and len(store._idle) == 10 and len(pollers()) == 1)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        await until(lambda: all(got == [start + 1] for got in seen))
        for t in tasks:
            t.cancel()
        await ended(tasks)


@pytest.mark.parametrize("interval", [0.05, 3600])
async def test_close_ends_every_idle_subscriber_and_the_poller(
    store_url: str, interval: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = await open_store(store_url, poll_interval=interval)
    try:
        await make_provider(store, VCPU=8)
        tasks, _ = await idle_subscribers(store, 200, await store.head())
        assert len(pollers()) == 1
    finally:
        async with asyncio.timeout(GUARD):
            await store.close()
    errors = await ended(tasks)
    assert all(isinstance(e, StoreClosed) for e in errors), {repr(e) for e in errors}
    assert not pollers()


async def test_an_append_between_a_subscribers_read_and_its_wait_is_found(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poller compares the head with what each waiting subscriber has delivered, not with
    its own previous reading: another store's append that landed after a subscriber's read and
    before the poller's first reading still wakes it."""
    async with open_store(store_url, poll_interval=0.05) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=100)
        start = await store.head()
        hold = asyncio.Event()
        read = store.backend.read

        async def slow_read(after: int, limit: int) -> list[RecordedEvent]:
            got = await read(after, limit)
            await hold.wait()  # (the other store commits while this read's answer is on its way)
            return got

        monkeypatch.setattr(store.backend, "read", slow_read)
        seen: list[int] = []

        async def follow() -> None:
            async for e in store.subscribe(after=start):
                seen.append(e.position)

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.05)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        hold.set()
        await until(lambda: seen == [start + 1])
        task.cancel()
        await ended([task])
