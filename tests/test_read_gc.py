"""Reads keep few objects for the cyclic collector to scan, and leave it no full collections to do.

A page of decoded events lives on in the caller; every tracked object in it is scanned, with the
GIL held, by each collection that reaches it - stalling the event loop whichever thread runs it
(measured on a 165k-event store: ``read(0, 50000)`` 130-280 ms on SQLite, 330-350 ms on
PostgreSQL; a subscriber catching up 19 full collections of up to 85 ms). Timing is not asserted
(flaky): the tests count the tracked objects a page holds and check where decoding runs.
"""

from __future__ import annotations

import asyncio
import gc
import threading
from typing import Any

import pytest

import evstore.events
import evstore.log.postgres
import evstore.log.sqlite
from evstore import AllocationStore, open_store
from evstore.log.postgres import DECODED_ON_LOOP
from tests.conftest import allocate, make_provider, new_uuid


def _tracked_in(page: list[Any]) -> int:
    """The tracked objects reachable from ``page`` (each once; classes are not followed)."""
    seen: set[int] = set()
    stack: list[Any] = list(page)
    tracked = 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        tracked += gc.is_tracked(obj)
        stack.extend(gc.get_referents(obj))
    return tracked


async def test_a_decoded_event_keeps_at_most_five_tracked_objects(store: AllocationStore) -> None:
    """Review 29: an AllocationsReplaced read back kept seven tracked objects alive: the
    RecordedEvent, the event model and its ``__dict__`` and allocations (a dict of dicts), the
    metadata model - and a new ``set`` of field names for each model (pydantic's fields set; a set
    is always tracked). The frozen models now share one set per set of names."""
    rp = await make_provider(store, VCPU=10**6)
    after = await store.head()
    consumers = [new_uuid() for _ in range(300)]
    await asyncio.gather(*(allocate(store, c, {rp: {"VCPU": 1}}) for c in consumers))
    page = await store.read(after, 300)
    kept = _tracked_in(page)
    assert len(page) == 300
    assert kept / len(page) <= 5.2, f"{kept} tracked objects for {len(page)} events"

    # (what the shared set must not change: each model's fields set, and copies of it)
    event = page[0].event
    assert event.model_fields_set == {f for f in type(event).model_fields if f != "on_behalf_of"} - {"type"}
    copied = event.model_copy(update={"on_behalf_of": consumers[1]})
    assert "on_behalf_of" in copied.model_fields_set
    assert "on_behalf_of" not in page[1].event.model_fields_set
    assert "on_behalf_of" not in event.model_fields_set
    assert page[0].metadata.model_fields_set == page[1].metadata.model_fields_set


async def test_a_page_read_back_leaves_the_collector_nothing_to_scan(store: AllocationStore) -> None:
    """Review 29: what a decoded event keeps is a tree of frozen models and dicts of strings and
    numbers (no cycle possible): it is untracked, for the collector not to scan it - five tracked
    objects an event before, in collections holding the GIL (the event loop) for 130-350 ms on a
    page of 50,000. A caller's own metadata holding a list keeps that event's metadata tracked."""
    rp = await make_provider(store, VCPU=10**6)
    after = await store.head()
    consumers = [new_uuid() for _ in range(300)]
    await asyncio.gather(*(allocate(store, c, {rp: {"VCPU": 1}}) for c in consumers[:299]))
    await store.set_allocations(
        consumers[299],
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        metadata={"tags": ["a", "b"]},
    )
    page = await store.read(after, 300)
    kept = _tracked_in(page)
    assert len(page) == 300
    assert kept / len(page) <= 0.5, f"{kept} tracked objects for {len(page)} events"
    assert not gc.is_tracked(page[0]) and not gc.is_tracked(page[0].event.allocations)
    last = page[-1]
    assert gc.is_tracked(last.metadata) and last.metadata.model_extra == {"tags": ["a", "b"]}
    assert last.event.allocations == {rp: {"VCPU": 1}} and last.to_dict()["metadata"]["tags"] == ["a", "b"]
    # (a dict of an untracked event is tracked again when something tracked is put in it)
    page[0].event.allocations["x"] = {"y": 1}
    assert gc.is_tracked(page[0].event.allocations)


async def test_postgres_history_is_decoded_off_the_event_loop(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 29: PostgreSQL decoded every history batch (1,000 events by default) on the event
    loop, stalling it as long as its decoding took; a large batch is decoded on a thread now, as
    read()'s pages are."""
    threads: list[int] = []
    decode = evstore.log.sqlite.decode_raw

    def watched(raw: Any, *page: Any) -> Any:
        threads.append(threading.get_ident())
        return decode(raw, *page)

    monkeypatch.setattr(evstore.log.sqlite, "decode_raw", watched)
    monkeypatch.setattr(evstore.log.postgres, "decode_raw", watched, raising=False)
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=10**6)
        n = DECODED_ON_LOOP + 50
        await asyncio.gather(*(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(n)))
        loop_thread = threading.get_ident()
        threads.clear()
        seen = [e async for e in store.history(rp)]
    assert len(seen) == n + 2
    assert len(threads) == n + 2
    assert loop_thread not in threads


@pytest.mark.parametrize("n", [DECODED_ON_LOOP - 50, DECODED_ON_LOOP + 50])
async def test_postgres_rows_are_decoded_untracked(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, n: int
) -> None:
    """Review 29: asyncpg makes a tracked Record a row, on the event loop; a page of them moved
    through the generations while fetched and decoded, counted, and set off full collections (a
    subscriber catching up on 165k events: 9 of up to 98 ms, read(0, 10**9) 342 ms on the loop).
    A page's rows are untracked as soon as they are fetched. (Not with the collector paused
    around the fetch, as c6b69b1 had it: see tests/test_read_gc_others.py.)"""
    decoded: list[bool] = []
    untracked: list[bool] = []
    decode_rows = evstore.log.postgres.decode_rows
    untrack_rows = getattr(evstore.events, "untrack_rows", lambda rows: None)  # (none before it)

    def watched_decode(rows: Any) -> Any:
        decoded.append(any(gc.is_tracked(r) for r in rows))
        return decode_rows(rows)

    def watched_untrack(rows: Any) -> None:
        untracked.append(gc.isenabled())
        untrack_rows(rows)

    monkeypatch.setattr(evstore.log.postgres, "decode_rows", watched_decode)
    monkeypatch.setattr(evstore.log.postgres, "untrack_rows", watched_untrack, raising=False)
    was = gc.isenabled()
    gc.enable()
    try:
        async with open_store(pg_url) as store:
            rp = await make_provider(store, VCPU=10**6)
            await asyncio.gather(*(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(n)))
            decoded.clear()
            untracked.clear()
            assert len(await store.read(0, n + 2)) == n + 2
            assert len([e async for e in store.history(rp)]) == n + 2
    finally:
        if not was:
            gc.disable()
    assert decoded == [False, False], "rows tracked when decoded"
    assert len(untracked) == 2
