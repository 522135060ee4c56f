"""Stop 45, helper C: a provider's stored usage damaged below zero (a row edited by hand) was
loaded by the writer as it stood, and a command decided capacity against it: with the usage of a
full provider (4 of 4 VCPU) edited to -4, a second consumer was given 4 more (8 on a capacity of
4), and the log kept that decision. Now it is ``evstore.projection.corrupt`` naming the provider
and the class, as a generation that is no count is; queries refuse it as well, the audit names
it, and ``evstore rebuild`` repairs it."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, CapacityExceeded, Inventory, ProjectionCorrupt, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def _damage_usage(
    store: AllocationStore, backend_name: str, store_url: str, rp: str, usages: str
) -> None:
    """The provider's stored usage set to ``usages`` (JSON), by hand: on SQLite by another
    connection (as a person with the sqlite3 shell would), on PostgreSQL by plain SQL."""
    if backend_name == "sqlite":
        conn = sqlite3.connect(Path(store_url.removeprefix("sqlite:///")))
        with conn:
            conn.execute("UPDATE p_providers SET usages = ? WHERE uuid = ?", (usages, rp))
        conn.close()
    else:
        await store.backend.tamper("UPDATE p_providers SET usages = ? WHERE uuid = ?", (usages, rp))


@pytest.mark.parametrize("damaged", ['{"VCPU":-4}', '{"VCPU":-1,"MEMORY_MB":-2048}'])
async def test_a_usage_damaged_below_zero_is_refused_not_decided_against(
    backend_name: str, store_url: str, damaged: str
) -> None:
    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=4, MEMORY_MB=4096)
        await allocate(store, new_uuid(), {rp: {"VCPU": 4}})
        head = await store.head()
        await _damage_usage(store, backend_name, store_url, rp, damaged)
        with pytest.raises(ProjectionCorrupt, match="below zero") as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 4}})
        assert caught.value.code == "evstore.projection.corrupt"
        assert caught.value.details["provider"] == rp
        assert rp in str(caught.value) and "evstore rebuild" in str(caught.value)
        assert await store.head() == head  # (nothing of it written)
        with pytest.raises(ProjectionCorrupt, match="below zero"):
            await store.usage(rp)  # (a query does not answer it as the usage either)
        report = await store.audit()
        assert not report.clean
        assert any(rp in f.message and "below zero" in f.message for f in report.drift), [
            f.message for f in report.findings
        ]
        await store.rebuild()
        assert (await store.usage(rp)).usages == {"VCPU": 4, "MEMORY_MB": 0}
        with pytest.raises(CapacityExceeded):
            await allocate(store, new_uuid(), {rp: {"VCPU": 4}})
        await allocate(store, new_uuid(), {rp: {"MEMORY_MB": 4096}})
        assert (await store.audit()).clean


async def test_a_usage_damaged_to_another_shape_is_still_refused(sqlite_url: str) -> None:
    """(As before: amounts that are no integers are refused; a count of 0 or above is the
    audit's to compare with the log.)"""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, "rp", VCPU=4)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await _damage_usage(store, "sqlite", sqlite_url, rp, '{"VCPU":"1"}')
        with pytest.raises(ProjectionCorrupt, match="not a mapping of amounts"):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})


async def test_a_release_a_recreated_provider_never_counted_leaves_its_usage_at_zero(
    tmp_path: Path, store_url: str
) -> None:
    """An imported log deletes a provider while a consumer holds allocations on it; created again,
    the provider counts none of them (the audit's ``usage_not_held``). Their release took its usage
    to -1 - a count no sum of allocations is, which commands then decided against (5 VCPU given on
    a capacity of 4), and which a row damaged by hand is refused for. The fold keeps a usage at 0
    or above: the release leaves it at 0, which is again what the consumers hold, and the fifth
    VCPU is refused."""
    from tests.test_audit_findings import _tail, append_row, chained

    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=4)
        c = new_uuid()
        await allocate(source, c, {rp: {"VCPU": 1}})
        lines = [line async for line in source.export()]
        append_row(lines, chained(await _tail(source), "ProviderDeleted", {"provider": rp}))
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        await store.create_provider(rp, "rp-again")
        await store.set_inventories(rp, {"VCPU": Inventory(total=4)}, generation=0)
        [found] = [f for f in (await store.audit()).integrity if f.details.get("reason") == "usage_not_held"]
        assert found.details["held"] == {"VCPU": 1} and found.details["counted"] == {}
        released = await store.release(c)
        assert (await store.usage(rp)).usages == {"VCPU": 0}
        # (counted 0, held 0: the audit names only the release of what was never counted)
        [found] = (await store.audit()).findings
        assert found.details["reason"] == "usage_not_held" and found.positions == released.positions
        for _ in range(4):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        with pytest.raises(CapacityExceeded):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        head = await store.head()
        assert (await (await store.state_at(position=head)).usage(rp)).usages == {"VCPU": 4}
        assert (await (await store.state_at(position=head, provider=rp)).usage(rp)).usages == {"VCPU": 4}
        assert (await store.replay()).providers[rp].usages == {"VCPU": 4}
        await store.rebuild()
        assert [f.details for f in (await store.audit()).findings] == [found.details]


async def test_an_imported_log_releasing_what_a_provider_created_later_never_counted(tmp_path: Path) -> None:
    """(The log alone: allocations on a provider not created yet, then released. Its usage read
    -3 - from every fold alike - and now reads 0, the sum of what is held there.)"""
    from tests.test_audit_findings import BUGGY_TAILS, _tail, append_row, chained

    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=8)
        lines = [line async for line in source.export()]
        last = await _tail(source)
    ghost = new_uuid()
    for etype, data in BUGGY_TAILS["allocated before it was created, then released"](rp, new_uuid(), ghost):
        last = chained(last, etype, data)
        append_row(lines, last)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        await store.import_events(lambda: iter(lines))
        assert (await store.replay()).providers[ghost].usages == {}
        assert (await store.usage(ghost)).usages == {}  # (read, not refused as a damaged row)
        await store.set_inventories(ghost, {"VCPU": Inventory(total=2)}, generation=0)
        with pytest.raises(CapacityExceeded):  # (decided against 0, not -3)
            await allocate(store, new_uuid(), {ghost: {"VCPU": 3}})
        assert not (await store.audit()).drift


async def test_a_provider_generation_damaged_past_the_largest_is_refused(
    backend_name: str, store_url: str
) -> None:
    """(Probing the same load, stop 45: a provider row's generation edited past 2**62, the largest
    a log may hold, was bumped by the next command into an event an import refuses - the log
    could no longer be exported and imported - and the audit then reported every such event. It
    is refused as a consumer's is.)"""
    from evstore.events import MAX_GENERATION

    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=4)
        head = await store.head()
        sql = "UPDATE p_providers SET generation = ? WHERE uuid = ?"
        if backend_name == "sqlite":
            conn = sqlite3.connect(Path(store_url.removeprefix("sqlite:///")))
            with conn:
                conn.execute(sql, (MAX_GENERATION + 1, rp))
            conn.close()
        else:
            await store.backend.tamper(sql, (MAX_GENERATION + 1, rp))
        with pytest.raises(ProjectionCorrupt, match=f"generation {MAX_GENERATION + 1}") as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert caught.value.details["provider"] == rp
        with pytest.raises(ProjectionCorrupt):
            await store.set_inventories(rp, {"VCPU": Inventory(total=5)}, generation=MAX_GENERATION + 1)
        assert await store.head() == head
        await store.rebuild()
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert (await store.audit()).clean


async def test_a_snapshot_of_the_earlier_fold_is_not_answered_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import projections.snapshots
    import projections.state
    from tests.test_audit_findings import BUGGY_TAILS, _tail, append_row, chained

    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=8)
        lines = [line async for line in source.export()]
        last = await _tail(source)
    ghost = new_uuid()
    for etype, data in BUGGY_TAILS["allocated before it was created, then released"](rp, new_uuid(), ghost):
        last = chained(last, etype, data)
        append_row(lines, last)

    def earlier_take_usage(state: Any, allocs: Any, position: int) -> None:
        earlier_add_usage(state.providers, allocs, -1)

    def earlier_add_usage(providers: Any, allocs: Any, sign: int = 1) -> None:  # (before stop 45)
        for provider, resources in allocs.items():
            prov = providers.get(provider)
            if prov is not None:
                for rc, amount in resources.items():
                    used = prov.usages.get(rc, 0) + sign * amount
                    prov.usages[rc] = used
                    if not used:
                        del prov.usages[rc]

    async with open_store(f"sqlite:///{tmp_path}/imported.db", snapshot_every=1) as store:
        await store.import_events(lambda: iter(lines))
        head = await store.head()
        with monkeypatch.context() as earlier:
            earlier.setattr(projections.state, "_add_usage", earlier_add_usage)
            earlier.setattr(projections.state, "_take_usage", earlier_take_usage)
            earlier.setattr(projections.snapshots, "SNAPSHOT_FORMAT", 6)  # (stop 44's)
            await store.take_snapshots()
            assert (await store.state_at(position=head)).state.providers[ghost].usages == {"VCPU": -3}
        assert (await store.replay()).providers[ghost].usages == {}
        assert (await store.state_at(position=head)).state.providers[ghost].usages == {}
