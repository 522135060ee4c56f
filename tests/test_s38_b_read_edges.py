"""The read side at its edges (stop 38, helper B)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from evstore import AllocationStore, InvalidInput
from tests.conftest import allocate, make_provider, new_uuid


async def test_a_diff_given_backwards_in_time_is_refused_even_with_no_event_between(
    store: AllocationStore,
) -> None:
    """Regression: ``diff(later, earlier)`` was refused ("diff needs a <= b") only when events lay
    between the two times; two times between the same events (or both before the first) gave an
    empty diff, as if the span were fine: the same mistake answered two ways, depending on the log.
    (``evstore diff`` refuses it either way, before opening the store.)"""
    rp = await make_provider(store, VCPU=8)
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    [*_, last] = await store.read(0)
    later, earlier = last.recorded_at + timedelta(days=2), last.recorded_at + timedelta(days=1)
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got times ") as caught:
        await store.diff(later, earlier)
    assert caught.value.details["field"] == "b"
    [first, *_] = await store.read(0)
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b"):
        await store.diff(first.recorded_at - timedelta(seconds=1), first.recorded_at - timedelta(seconds=2))
    same = await store.diff(later, later)  # (equal: an empty span, fine)
    head = await store.head()
    assert (same.from_position, same.to_position, same.consumers) == (head, head, [])
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got positions 2 and 1"):
        await store.diff(2, 1)
