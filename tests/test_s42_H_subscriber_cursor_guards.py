"""Guards for the live subscriber's check of the event at its cursor (stop 42, helper H's review
of the lead's 937113d): no refusal where nothing it delivered was lost.

- the row at its cursor damaged since (a payload that is no JSON): it follows on past it;
- subscribers at one position, one that delivered the event there and one given the position by
  its caller, each get what follows (once, in order);
- a batch_size of 2**63-1 (each read asks for the event at the cursor too);
- a subscriber whose cursor is the head waits, and is woken by the next commit, not refused.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from evstore import RecordedEvent, open_store

MAX_POSITION = 2**63 - 1


async def _create(store: object, n: int) -> None:
    for _ in range(n):
        await store.create_provider(str(uuid.uuid4()), f"rp-{uuid.uuid4().hex}")  # type: ignore[attr-defined]


async def _take(events: AsyncIterator[RecordedEvent], n: int) -> list[int]:
    got = []
    async for recorded in events:
        got.append(recorded.position)
        if len(got) == n:
            break
    return got


async def test_a_subscriber_follows_on_past_a_row_at_its_cursor_damaged_since(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    async with open_store(f"sqlite:///{db}", poll_interval=0.05) as store:
        await _create(store, 3)
        events = store.subscribe(after=0, batch_size=1)
        assert await asyncio.wait_for(_take(events, 3), 10) == [1, 2, 3]
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE events SET data = 'not json' WHERE position = 3")
        await _create(store, 2)
        assert await asyncio.wait_for(_take(events, 2), 10) == [4, 5]
        await events.aclose()  # type: ignore[attr-defined]


async def test_subscribers_at_one_position_delivered_or_given_each_get_what_follows(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path / 's.db'}") as store:
        await _create(store, 2)
        following = store.subscribe(after=0, batch_size=5)
        assert await asyncio.wait_for(_take(following, 2), 10) == [1, 2]
        given = store.subscribe(after=2, batch_size=5)
        both = asyncio.gather(_take(following, 3), _take(given, 3))
        await asyncio.sleep(0)
        await _create(store, 3)
        assert await asyncio.wait_for(both, 10) == [[3, 4, 5], [3, 4, 5]]
        await following.aclose()  # type: ignore[attr-defined]
        await given.aclose()  # type: ignore[attr-defined]


async def test_a_subscriber_with_the_largest_batch_size_follows_from_a_cursor(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path / 's.db'}") as store:
        await _create(store, 3)
        events = store.subscribe(after=1, batch_size=MAX_POSITION)
        assert await asyncio.wait_for(_take(events, 2), 10) == [2, 3]
        waiting = asyncio.ensure_future(_take(events, 1))
        await asyncio.sleep(0.1)
        assert not waiting.done()  # (at the head: it waits, is not refused)
        await _create(store, 1)
        assert await asyncio.wait_for(waiting, 10) == [4]
        await events.aclose()  # type: ignore[attr-defined]
