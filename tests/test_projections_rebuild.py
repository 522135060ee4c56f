"""rebuild() refolds the persisted projection from the log with the one fold; it equals the live one."""

from __future__ import annotations

from typing import Any

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


async def test_rebuild_folds_what_was_appended_while_it_folded_outside_the_lock(store_url: str) -> None:
    # Both backends fold the log before holding writers back (SQLite's write lock, PostgreSQL's
    # fence); events appended in between (here by another store on the same database, the moment
    # the fold has found the end of the log) are folded before the projection is rewritten.
    from evstore import open_store
    from tests.conftest import allocate, make_provider, new_uuid

    async with open_store(store_url) as store:
        await random_workload(store, seed=3, commands=120)
        backend = store.backend
        read = backend.read_payloads
        late: list[str] = []

        async def read_then_append(after: int, limit: int) -> list[Any]:
            rows = await read(after, limit)
            if not rows and not late:  # the fold has seen the end of the log
                async with open_store(store_url) as other:
                    rp = await make_provider(other, "late-node", VCPU=8)
                    late.append(new_uuid())
                    await allocate(other, late[0], {rp: {"VCPU": 3}})
            return rows

        backend.read_payloads = read_then_append  # type: ignore[method-assign]
        try:
            folded = await store.rebuild(batch_size=50)
        finally:
            del backend.read_payloads
        assert late, "the append happened during the rebuild's fold"
        assert folded == await store.head()
        assert await store.backend.load_state() == await replay(store.backend.read)
        assert (await store.allocations(late[0])).allocations  # the late consumer is in the projection
        assert (await store.audit()).clean


async def test_rebuild_reports_progress_up_to_the_head(store: AllocationStore) -> None:
    await random_workload(store, seed=8, commands=150)
    head = await store.head()
    seen: list[tuple[int, int]] = []
    assert await store.rebuild(batch_size=40, progress=lambda done, total: seen.append((done, total))) == head
    assert len(seen) >= head // 40  # at least once per batch
    assert [d for d, _ in seen] == sorted(d for d, _ in seen), "progress never goes back"
    assert all(0 < done <= total for done, total in seen), "the total never falls behind"
    assert seen[-1] == (head, head)
