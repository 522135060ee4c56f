"""Stop 43, the lead: small things the helpers' reports asked for."""

from __future__ import annotations

import pytest

from evstore import AllocationStore, IdempotencyConflict
from tests.conftest import make_provider, new_uuid


async def test_an_idempotency_conflict_says_what_to_do(store: AllocationStore) -> None:
    """A key reused for another command is refused, and the message says what a key is for (a
    retry repeats its command exactly) and what to do (a new key for a new command); nothing is
    written."""
    rp = await make_provider(store, VCPU=8)
    consumer = new_uuid()
    body = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}
    await store.set_allocations(consumer, {rp: {"VCPU": 1}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
    head = await store.head()
    with pytest.raises(IdempotencyConflict) as refused:
        await store.set_allocations(new_uuid(), {rp: {"VCPU": 2}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
    assert refused.value.code == "evstore.idempotency.conflict"
    assert "a retry repeats its command exactly; give a new command a new key" in str(refused.value)
    assert refused.value.details["idempotency_key"] == "k-1"
    assert await store.head() == head
