"""rebuild() refolds the persisted projection from the log with the one fold; it equals the live one."""

from __future__ import annotations

from evstore import AllocationStore
from projections.replay import replay
from tests.test_projections_support import random_workload


async def test_rebuild_after_a_long_random_workload_equals_the_live_projection(
    store: AllocationStore,
) -> None:
    await random_workload(store, seed=20260101, commands=600, providers=6)
    live = await store.backend.load_state()
    assert live == await replay(store.backend.read)  # the inline projection is the fold of the log
    folded = await store.rebuild(batch_size=37)  # small batches: streaming across many boundaries
    assert folded == await store.head()
    assert await store.backend.load_state() == live
    assert (await store.audit()).clean


async def test_rebuild_repairs_a_tampered_projection(store: AllocationStore) -> None:
    await random_workload(store, seed=5, commands=80)
    live = await store.backend.load_state()
    tamper = getattr(store.backend, "tamper", None)
    if tamper is None:
        return  # only the SQLite backend exposes raw SQL
    await tamper("DELETE FROM p_allocations WHERE consumer IN (SELECT consumer FROM p_allocations LIMIT 2)")
    await tamper("UPDATE p_providers SET generation = generation + 7")
    assert not (await store.audit()).clean
    await store.rebuild()
    assert await store.backend.load_state() == live
    assert (await store.audit()).clean
