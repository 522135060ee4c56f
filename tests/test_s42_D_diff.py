"""diff(a, b) of a consumer whose allocations were rewritten to exactly what it held (stop 42, helper D)."""

from __future__ import annotations

import json
from pathlib import Path

from evstore import AllocationStore, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore


async def test_a_rewrite_to_the_same_allocations_is_no_change(store: AllocationStore) -> None:
    """Regression: a write of exactly what a consumer held (only its generation moves) was listed
    as ``changed`` with equal ``before`` and ``after``, and no usage delta, though README says a
    consumer left as it was is not listed - as one released and written again the same already
    was. A span that changes it and changes it back compares its two ends alike."""
    p, q = await make_provider(store, "p", VCPU=8), await make_provider(store, "q", VCPU=8)
    c, other = new_uuid(), new_uuid()
    await allocate(store, c, {p: {"VCPU": 2}, q: {"VCPU": 1}})
    start = await store.head()
    await allocate(store, c, {q: {"VCPU": 1}, p: {"VCPU": 2}}, generation=1)  # (another order)
    await allocate(store, other, {p: {"VCPU": 1}})
    d = await store.diff(start, await store.head())
    assert d.consumer(c) is None
    assert [(x.consumer, x.change) for x in d.consumers] == [(other, "created")]
    assert [(u.provider, u.delta) for u in d.usage] == [(p, 1)]
    middle = await store.head()
    await allocate(store, c, {p: {"VCPU": 3}}, generation=2)
    there = await store.head()
    await allocate(store, c, {p: {"VCPU": 2}, q: {"VCPU": 1}}, generation=3)  # (back)
    assert (await store.diff(middle, await store.head())).consumers == []
    change = (await store.diff(middle, there)).consumer(c)
    assert change is not None and change.change == "changed" and change.positions == (there,)
    # what it is besides its allocations still counts (the project's usage moved)
    start = await store.head()
    await store.release(c)
    await allocate(store, c, {p: {"VCPU": 2}, q: {"VCPU": 1}}, project_id="project-B")
    moved = (await store.diff(start, await store.head())).consumer(c)
    assert moved is not None and moved.change == "changed" and moved.before == moved.after


def test_the_command_line_leaves_an_identical_rewrite_out_of_both_outputs(tmp_path: Path) -> None:
    import asyncio

    db = tmp_path / "s.db"
    c = new_uuid()

    async def fill() -> tuple[int, int]:
        async with open_store(f"sqlite:///{db}") as store:
            p = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, c, {p: {"VCPU": 2}})
            start = await store.head()
            await allocate(store, c, {p: {"VCPU": 2}}, generation=1)
            return start, await store.head()

    a, b = asyncio.run(fill())
    done = evstore("diff", str(a), str(b), "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["consumers"] == [] and out["usage"] == []
    assert out["events_by_type"] == {"AllocationsReplaced": 1}
    text = evstore("diff", str(a), str(b), "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert c not in text.stdout and "changed" not in text.stdout
    assert "1 event (AllocationsReplaced 1)" in text.stdout


async def test_a_provider_created_and_deleted_in_between_is_in_both_lists(store: AllocationStore) -> None:
    """Regression: a provider created and deleted again inside the span was in neither list - the
    header counted a ProviderCreated and a ProviderDeleted that no line named - where one deleted
    and created again was in both. Each list is the providers its events created or deleted, by
    the name they had then (it is no longer in the store to be named)."""
    keep = await make_provider(store, "keep")
    start = await store.head()
    gone = new_uuid()
    await store.create_provider(gone, "short-lived")
    await store.rename_provider(gone, "short-lived-renamed")
    await store.delete_provider(gone)
    d = await store.diff(start, await store.head())
    assert d.events_by_type == {"ProviderCreated": 1, "ProviderUpdated": 1, "ProviderDeleted": 1}
    assert (d.providers_created, d.providers_deleted) == ([gone], [gone])
    assert d.provider_names == {gone: "short-lived-renamed"}
    assert (await store.diff(start, start + 1)).providers_created == [gone]  # (as before)
    assert (await store.diff(start + 1, start + 3)).providers_deleted == [gone]
    # created, deleted and created again: in both lists, by its name at the end
    await store.create_provider(gone, "back")
    d = await store.diff(start, await store.head())
    assert (d.providers_created, d.providers_deleted) == ([gone], [gone])
    assert d.provider_names == {gone: "back"} and keep not in d.provider_names


def test_the_command_line_names_a_provider_created_and_deleted_in_between(tmp_path: Path) -> None:
    import asyncio

    db = tmp_path / "s.db"
    gone = new_uuid()

    async def fill() -> int:
        async with open_store(f"sqlite:///{db}") as store:
            await make_provider(store, "node-1")
            start = await store.head()
            await store.create_provider(gone, "short-lived")
            await store.delete_provider(gone)
            return start

    a = asyncio.run(fill())
    done = evstore("diff", str(a), str(a + 2), "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["providers_created"], out["providers_deleted"]) == ([gone], [gone])
    assert out["provider_names"] == {gone: "short-lived"}
    text = evstore("diff", str(a), str(a + 2), "--db", str(db))
    assert text.returncode == 0, text.stderr
    flat = text.stdout.replace("\n", "")
    assert f"providers created (1): short-lived ({gone})" in flat
    assert f"providers deleted (1): short-lived ({gone})" in flat
