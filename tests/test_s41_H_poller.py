"""The subscribers' poller ends when the last waiting subscriber is cancelled during its read of
the head, also when that read came right after a pause a cancellation had ended (stop 41, helper H).

The poller pauses on a future (its "nap") that the last waiting subscriber's cancellation ends; a
cancellation during a read of the head ends the nap of the next pause. After a pause that a
cancellation had ended, with a subscriber waiting again, the poller made its next nap but left
the old, ended one where the subscribers find it: the last of them cancelled during the read that
followed ended nothing, and the poller paused a full ``poll_interval`` (up to an hour) with nobody
waiting, instead of ending.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from evstore import AllocationStore, open_store
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 10.0  # a hang guard, not a timing assertion


async def _until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


async def _follow(store: AllocationStore, got: list[int]) -> None:
    async for event in store.subscribe():  # (after=0: its first read is no head)
        got.append(event.position)


async def test_the_last_subscriber_cancelled_during_the_polls_read_ends_the_poller(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: subscriber B cancelled during the poller's read of the head (that read's next
    pause ends at once), C waiting again before the read ended (the poller reads again at once),
    then C cancelled during that second read: the poller began a full poll_interval pause with
    nobody waiting (here 0.5 s; an hour at most), instead of ending at once."""
    async with open_store(store_url, poll_interval=0.5) as store, open_store(store_url) as other:
        backend = store.backend
        real_head = backend.head
        reading: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()

        async def gated_head() -> int:  # (only the poller reads the head here: after=0)
            go: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            reading.put_nowait(go)
            await go
            return await real_head()

        monkeypatch.setattr(backend, "head", gated_head)

        async def poll_read() -> asyncio.Future[None]:
            async with asyncio.timeout(GUARD):
                return await reading.get()

        b = asyncio.create_task(_follow(store, []))
        await _until(lambda: len(store._idle) == 1)
        poller = store._poller
        assert poller is not None
        first = await poll_read()  # (after its first pause)
        b.cancel()
        await asyncio.wait([b])
        c = asyncio.create_task(_follow(store, []))
        await _until(lambda: len(store._idle) == 1)
        first.set_result(None)
        second = await poll_read()  # (at once: B's cancellation ended the pause, C waits)
        c.cancel()
        await asyncio.wait([c])
        assert not store._idle
        second.set_result(None)

        def pausing_for_nobody() -> bool:
            nap = store._poller_nap
            return not store._idle and nap is not None and not nap.done()

        await _until(lambda: poller.done() or pausing_for_nobody())
        assert poller.done(), "the poller began a pause with no subscriber waiting"
        assert not poller.cancelled() and poller.exception() is None
        assert reading.empty()

        # a later subscriber starts another poller, woken by the other store's commit
        monkeypatch.undo()
        store._poll_interval = 0.05
        got: list[int] = []
        d = asyncio.create_task(_follow(store, got))
        await _until(lambda: len(store._idle) == 1)
        rp = await make_provider(other, VCPU=4)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        head = await other.head()
        await _until(lambda: got == list(range(1, head + 1)))
        d.cancel()
        await asyncio.wait([d])
        await _until(lambda: store._poller is None)
