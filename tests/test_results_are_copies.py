"""What the store answers, and what it was given, is the caller's own: mutating it changes nothing
in the store (its projection, the SQLite writer's cache of entities kept between transactions,
snapshots, the log) nor in what it answers next.

From stop 31 (helper B): every result and every argument mutated below, then the same questions
asked again, a command run on the same entities, and an audit. No sharing was found; this test
keeps it so.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from evstore import AllocationStore, Inventory
from tests.conftest import make_provider, new_uuid


def _scramble(value: Any, seen: set[int] | None = None) -> None:
    """Mutate every dict and list reachable from ``value``: through containers, and the fields of
    objects (dataclasses with slots, pydantic models, plain objects), frozen ones included."""
    seen = set() if seen is None else seen
    if id(value) in seen or isinstance(value, (str, bytes, int, float, type(None))):
        return
    seen.add(id(value))
    if isinstance(value, dict):
        for key in list(value):
            _scramble(value[key], seen)
            if isinstance(value[key], int) and not isinstance(value[key], bool):
                value[key] = value[key] + 1000
        value["scrambled"] = 1
    elif isinstance(value, list):
        for item in value:
            _scramble(item, seen)
        value.append("scrambled")
    elif isinstance(value, (tuple, set, frozenset)):
        for item in value:
            _scramble(item, seen)
    else:
        names = set(getattr(value, "__dict__", {}))
        for klass in type(value).__mro__:
            names.update(n for n in getattr(klass, "__slots__", ()) if not n.startswith("__"))
        for name in names:
            _scramble(getattr(value, name, None), seen)


async def _answers(store: AllocationStore, rp: str, instance: str) -> dict[str, Any]:
    """Every read the API has about these entities, as plain values."""
    head = await store.head()
    events = await store.read(0, 100)
    history = [e async for e in store.history(instance)]
    view = await store.state_at(position=head)
    sliced = await store.state_at(position=head, provider=rp)
    return {
        "usage": (await store.usage(rp)).to_dict(),
        "inventories": (await store.inventories(rp)).to_dict(),
        "provider": (await store.provider(rp)).to_dict(),
        "allocations": (await store.allocations(instance)).to_dict(),
        "provider_allocations": await store.provider_allocations(rp),
        "usages": (await store.usages("acme")).to_dict(),
        "usages_all": (await store.usages("acme", consumer_type="all")).to_dict(),
        "providers": await store.providers(),
        "events": [e.to_dict() for e in events],
        "history": [e.to_dict() for e in history],
        "state_at": ((await view.usage(rp)).to_dict(), (await view.allocations(instance)).to_dict()),
        "slice": (await sliced.usage(rp)).to_dict(),
        "diff": (await store.diff(0, head)).to_dict(),
        "audit": (await store.audit()).clean,
    }


async def test_results_and_arguments_mutated_by_the_caller_leave_the_store_as_it_was(
    store: AllocationStore,
) -> None:
    rp = await make_provider(store, "node-1", VCPU=Inventory(total=16), MEMORY_MB=4096)
    instance, migration = new_uuid(), new_uuid()
    allocations = {rp: {"VCPU": 2, "MEMORY_MB": 512}}
    metadata = {"request_id": "req-1"}
    receipt = await store.set_allocations(
        instance, allocations, project_id="acme", user_id="alice", consumer_type="INSTANCE",
        generation=None, metadata=metadata, idempotency_key="k-1",
    )  # fmt: skip
    before = await _answers(store, rp, instance)
    kept = copy.deepcopy(before)
    receipt_kept = receipt.to_dict()

    # mutate what it was given, what it answered, and every answer above (their objects, not
    # their plain copies: each read is made again)
    _scramble(allocations)
    _scramble(metadata)
    _scramble(receipt)
    for result in (
        await store.usage(rp),
        await store.inventories(rp),
        await store.allocations(instance),
        await store.provider_allocations(rp),
        await store.usages("acme"),
        await store.providers(),
        await store.read(0, 100),
        [e async for e in store.history(instance)],
        await store.diff(0, await store.head()),
        await store.audit(),
    ):
        _scramble(result)
    _scramble(await store.state_at(position=await store.head()))
    _scramble(await store.state_at(position=await store.head(), provider=rp))
    inventories = (await store.inventories(rp)).inventories
    inventories.pop("VCPU")

    assert await _answers(store, rp, instance) == kept
    assert json.dumps(kept, default=str)  # (the answers stay JSON-ready)
    # a repeat of the command answers its original receipt; new commands see the store as it was
    again = await store.set_allocations(
        instance, {rp: {"VCPU": 2, "MEMORY_MB": 512}}, project_id="acme", user_id="alice",
        consumer_type="INSTANCE", generation=None, idempotency_key="k-1",
    )  # fmt: skip
    assert again.replayed and {**again.to_dict(), "replayed": False} == receipt_kept
    await store.start_migration(instance, migration)
    assert await store.allocations(migration) == {rp: {"MEMORY_MB": 512, "VCPU": 2}}
    assert (await store.usage(rp)).to_dict()["usages"] == {"MEMORY_MB": 512, "VCPU": 2}
    await store.revert_migration(migration)
    generation = (await store.allocations(instance)).generation
    await store.set_allocations(
        instance, {rp: {"VCPU": 16}}, project_id="acme", user_id="alice", consumer_type="INSTANCE",
        generation=generation,
    )  # fmt: skip  # (all 16 VCPU: capacity as the store has it, not as the mutated views said)
    assert (await store.usage(rp)).to_dict()["usages"] == {"MEMORY_MB": 0, "VCPU": 16}
    assert (await store.audit()).clean
