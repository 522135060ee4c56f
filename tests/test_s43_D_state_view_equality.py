"""Stop 43, helper D: what ``state_at`` answers, compared as the README's guarantee reads.

The README's guarantees say "``state_at(p)`` (with snapshots) equals a naive replay to ``p``";
a check written from that - ``await store.state_at(position=p) == await store.replay(p)`` -
fails: ``state_at`` answers a ``StateView`` (projections/replay.py), which has no ``__eq__``, so
it equals nothing but itself - not the replay, not another ``state_at`` of the same position -
though its ``.state`` equals the replay. (Fixed by the lead: ``StateView.__eq__`` compares
``.state`` - with a ``State``, or a view of the same scope - and ``__hash__`` is None.)"""

from __future__ import annotations

import pytest

from evstore import AllocationStore
from tests.conftest import make_provider, new_uuid


async def test_state_at_equals_a_replay_to_the_same_position(store: AllocationStore) -> None:
    store.snapshot_every = 2
    rp = await make_provider(store, VCPU=10)
    for _ in range(3):
        await store.set_allocations(
            new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="I", generation=None
        )
    view = await store.state_at(position=4)
    replayed = await store.replay(4)
    assert view.state == replayed  # (what holds today)
    assert view == replayed and view == await store.state_at(position=4) and replayed == view
    assert view != await store.state_at(position=3)
    sliced = await store.state_at(position=4, provider=rp)
    assert sliced != replayed and sliced == await store.state_at(position=4, provider=rp)
    with pytest.raises(TypeError):
        hash(view)
