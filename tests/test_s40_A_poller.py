"""The subscribers' poller ends when the last waiting subscriber is cancelled, not at its next
tick up to ``poll_interval`` later (stop 40, helper A)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from evstore import AllocationStore, open_store
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 10.0  # a hang guard, not a timing assertion: poll_interval below is far longer
POLLER = "evstore-subscribers-poller"


def _pollers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == POLLER and not t.done()]


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


async def _follow(store: AllocationStore, after: int, got: list[int]) -> None:
    async for event in store.subscribe(after=after):
        got.append(event.position)


async def test_the_poller_ends_when_the_last_waiting_subscriber_is_cancelled(store_url: str) -> None:
    """Regression: the poller slept out its ``poll_interval`` (here 60 s) after the last waiting
    subscriber was cancelled before it saw none waited. It ends at once now; while one still
    waits it goes on, and the next subscriber starts another, woken by other processes' appends."""
    async with open_store(store_url, poll_interval=60) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=10)
        head = await store.head()
        got: list[list[int]] = [[], []]
        followers = [asyncio.create_task(_follow(store, head, g)) for g in got]
        await _until(lambda: len(store._idle) == 2 and len(_pollers()) == 1)
        poller = _pollers()[0]
        followers[0].cancel()
        await asyncio.wait([followers[0]])
        await asyncio.sleep(0.05)
        assert not poller.done() and len(store._idle) == 1  # (one still waits: it polls on)
        followers[1].cancel()
        await asyncio.wait([followers[1]])
        await _until(lambda: store._poller is None)
        assert poller.done() and not poller.cancelled() and poller.exception() is None
        # a later subscriber starts another, which polls as before (the other store's commit)
        store._poll_interval = 0.05
        again: list[int] = []
        follower = asyncio.create_task(_follow(store, head, again))
        await _until(lambda: len(store._idle) == 1)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        await _until(lambda: again == [head + 1])
        follower.cancel()
        await asyncio.wait([follower])
        await _until(lambda: not _pollers())
