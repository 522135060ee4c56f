"""Stop 43, helper E: a provider's time-travel slice snapshot is used only for that provider.

A slice snapshot's digest covers its text, not the row's ``provider`` key: a row whose key was
altered by hand (or copied to another provider) carries another provider's slice, and
``state_at(p, provider=)`` answered from it - the provider asked about "not found", or another
provider's usage as its own. Such a slice is skipped, as one whose text was altered is, and the
provider folded from its history.
"""

from __future__ import annotations

from typing import Any

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid


async def test_a_slice_snapshot_filed_under_another_provider_is_not_used(sqlite_url: str) -> None:
    async with open_store(sqlite_url, snapshot_every=2) as store:
        a = await make_provider(store, "a", VCPU=8)
        b = await make_provider(store, "b", VCPU=8, DISK_GB=100)
        await allocate(store, new_uuid(), {a: {"VCPU": 3}})
        await allocate(store, new_uuid(), {b: {"VCPU": 1, "DISK_GB": 10}})
        await store.take_snapshots()
        head = await store.head()
        whole = await store.state_at(head)
        backend: Any = store.backend
        # b's slices lost, a's filed under b's uuid too: a row altered by hand, or a copy
        await backend.tamper("DELETE FROM provider_snapshots WHERE provider = ?", (b,))
        await backend.tamper(
            "INSERT INTO provider_snapshots SELECT ?, position, event_hash, format, state "
            "FROM provider_snapshots WHERE provider = ?",
            (b, a),
        )
        for rp in (a, b):
            for p in range(3, head + 1):
                sliced = await store.state_at(p, provider=rp)
                view = await store.state_at(p)
                for ask in ("usage", "inventories", "provider", "provider_allocations"):
                    assert await getattr(sliced, ask)(rp) == await getattr(view, ask)(rp), (rp, p, ask)
        assert dict(await (await store.state_at(head, provider=b)).usage(b)) == dict(await whole.usage(b))
