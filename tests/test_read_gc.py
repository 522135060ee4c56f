"""Reads keep few objects for the cyclic collector to scan, and leave it no full collections to do.

A page of decoded events lives on in the caller; every tracked object in it is scanned, with the
GIL held, by each collection that reaches it - stalling the event loop whichever thread runs it
(measured on a 165k-event store: ``read(0, 50000)`` 130-280 ms, a subscriber catching up 19 full
collections of up to 85 ms). Timing is not asserted (flaky): the tests count tracked objects and
check where the page's objects end up.
"""

from __future__ import annotations

import asyncio
import gc

from evstore import AllocationStore
from tests.conftest import allocate, make_provider, new_uuid


def _tracked_since(before: set[int]) -> int:
    return sum(1 for o in gc.get_objects() if id(o) not in before)


async def test_a_decoded_event_keeps_at_most_five_tracked_objects(store: AllocationStore) -> None:
    """Review 29: an AllocationsReplaced read back kept seven tracked objects alive: the
    RecordedEvent, the event model and its ``__dict__`` and allocations (a dict of dicts), the
    metadata model - and a new ``set`` of field names for each model (pydantic's fields set; a set
    is always tracked). The frozen models now share one set per set of names."""
    rp = await make_provider(store, VCPU=10**6)
    after = await store.head()
    consumers = [new_uuid() for _ in range(300)]
    await asyncio.gather(*(allocate(store, c, {rp: {"VCPU": 1}}) for c in consumers))
    await store.read(after, 1)  # (anything a first read builds once)
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    page = await store.read(after, 300)
    kept = _tracked_since(before)
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
