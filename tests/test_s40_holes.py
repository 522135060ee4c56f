"""Stop 40: time travel does not fold over a hole in the log (found by helper 165's probe).

With a tombstone's row deleted by hand, ``read``, ``export`` and ``rebuild`` refused the hole
(evstore.log.corrupt at the missing position), but ``replay``, ``state_at`` (the whole store) and
``diff`` folded over it and showed the deleted instance alive, holding its allocations: a state
the log never had, with no word of the damage. They now refuse it as the others do; before the
hole they answer.
"""

from __future__ import annotations

import pytest

from evstore import AllocationStore, CorruptEvent
from tests.conftest import make_provider, new_uuid

OWNER = {"project_id": "proj", "user_id": "user", "consumer_type": "INSTANCE"}


async def test_time_travel_across_a_lost_tombstone_is_refused_as_rebuild_refuses_it(
    store: AllocationStore,
) -> None:
    store.snapshot_every = 2
    inst = new_uuid()
    rp = await make_provider(store, VCPU=8)
    await store.set_allocations(inst, {rp: {"VCPU": 2}}, generation=None, **OWNER)
    tombstone = (await store.delete_consumer(inst)).position
    assert tombstone is not None
    await make_provider(store)  # (an event after it: the hole is not at the head)
    head = await store.head()
    backend = store.backend
    q = "?" if store.url.startswith("sqlite") else "$1"
    await backend.tamper(f"DELETE FROM events WHERE position = {q}", (tombstone,))  # type: ignore[attr-defined]
    with pytest.raises(CorruptEvent):
        await store.rebuild()  # (as it was)
    for fold in (
        store.replay(head),
        store.state_at(head),
        store.diff(0, head),
        store.diff(tombstone - 1, head),
    ):
        with pytest.raises(CorruptEvent, match=f"Position {tombstone} is missing") as raised:
            await fold
        assert raised.value.code == "evstore.log.corrupt"
        assert raised.value.details == {"position": tombstone, "reason": "position_gap"}
    # before the hole, the log is whole: those answer (the instance holding, as it then was)
    before = await store.state_at(tombstone - 1)
    assert await before.allocations(inst) == {rp: {"VCPU": 2}}
    assert (await store.replay(tombstone - 1)).consumers[inst].allocations == {rp: {"VCPU": 2}}
    assert (await store.diff(0, tombstone - 1)).to_position == tombstone - 1
