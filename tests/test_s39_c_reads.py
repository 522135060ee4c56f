"""Stop 39, helper C: the read side against a log an older, Placement-style writer left.

A random workload of commands is exported, an older writer's rows are added (a deleted consumer
deleted again or given allocations, an instance deleted while its migration holds, a revert to a
deleted instance, providers deleted while allocated and created again), and the file imported;
more commands run on the imported store. Then, at every position: ``state_at`` (whole, and each
provider's and consumer's slice) equals ``replay`` and a naive fold, with snapshots every few
events, after ``rebuild`` and after another export and import; each ``diff(a, b)`` applied to
the state at ``a`` gives the state at ``b``; ``history`` lists every event that named or moved
the entity.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, EvstoreError, Inventory, ProviderNotFound, open_store
from evstore.log import RawEvent
from projections.replay import StateView, replay
from projections.state import State, evolve_noting_providers
from projections.views import ConsumerView
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import append_row, chained
from tests.test_slices_vs_whole_state import CLASSES, Workload


def _url(backend_name: str, tmp_path: Path, name: str) -> str:
    if backend_name == "sqlite":
        return f"sqlite:///{tmp_path}/{name}.db"
    from tests.pg import fresh_database_url

    return fresh_database_url()


async def _run(store: AllocationStore, w: Workload, count: int) -> None:
    w.store = store
    for _ in range(count):
        model = await store.replay()
        try:
            await w.command(model)
        except EvstoreError:
            pass


def _older_writers_rows(
    rnd: random.Random, w: Workload, state: State, last: RawEvent, count: int
) -> list[RawEvent]:
    """Rows only an older, Placement-style writer appends (chained after ``last``)."""
    rows = []
    for _ in range(count):
        deleted = sorted(c.uuid for c in state.consumers.values() if c.deleted) or w.consumers
        migrations = sorted((c for c in state.consumers.values() if c.on_behalf_of), key=lambda c: c.uuid)
        holders = sorted((c for c in state.consumers.values() if c.allocations), key=lambda c: c.uuid)
        p = rnd.choice(w.providers)
        held = {q: {"VCPU": rnd.randint(1, 3)} for q in rnd.sample(w.providers, rnd.randint(1, 2))}
        labels = {"project_id": "pa", "user_id": "ua"}
        kind = rnd.randrange(9)
        data: dict[str, Any]
        if kind == 0:  # a deleted consumer deleted again
            etype, data = "ConsumerDeleted", {"consumer": rnd.choice(deleted), "migrations_released": {}}
        elif kind == 1 and migrations:  # an instance deleted, its migration left holding
            m = rnd.choice(migrations)
            etype, data = "ConsumerDeleted", {"consumer": m.on_behalf_of, "migrations_released": {}}
        elif kind == 2 and migrations:  # a revert after the delete (bug 1848343)
            m = rnd.choice(migrations)
            etype = "MigrationReverted"
            data = {
                "migration": m.uuid,
                "instance": m.on_behalf_of,
                "allocations": m.allocations or held,
                "instance_consumer_type": "INSTANCE",
                "instance_generation": 7,
                **labels,
            }
        elif kind == 3:  # allocations given to a deleted consumer
            etype = "AllocationsReplaced"
            data = {
                "consumer": rnd.choice(deleted),
                "allocations": held,
                "consumer_type": "INSTANCE",
                "generation": 3,
            }
            data.update(labels)
        elif kind == 4:  # a provider deleted, whatever it holds
            etype, data = "ProviderDeleted", {"provider": p}
        elif kind == 5:  # created (again)
            etype, data = "ProviderCreated", {"provider": p, "name": f"legacy-{rnd.randrange(99)}", "root": p}
        elif kind == 6 and holders:
            c = rnd.choice(holders)
            etype = "MigrationStarted"
            data = {
                "instance": c.uuid,
                "migration": rnd.choice(w.consumers),
                "allocations": c.allocations,
                "instance_consumer_type": "INSTANCE",
                "instance_generation": 2,
                **labels,
            }
        elif kind == 7:  # a delete naming what it released otherwise than it was held
            etype = "ConsumerDeleted"
            data = {
                "consumer": rnd.choice(w.consumers),
                "released": held,
                "migrations_released": {rnd.choice(w.consumers): held},
            }
        elif kind == 8 and migrations:
            etype = "MigrationConfirmed"
            data = {
                "migration": rnd.choice(migrations).uuid,
                "instance": rnd.choice(w.consumers),
                "released": {},
            }
        else:
            etype = "AllocationsReplaced"
            data = {
                "consumer": rnd.choice(w.consumers),
                "allocations": held,
                "consumer_type": "OTHER",
                "generation": 1,
            }
            data.update(project_id="pb", user_id="ub")
        last = chained(last, etype, data)
        rows.append(last)
    return rows


async def _check(store: AllocationStore, w: Workload, consumers: list[str]) -> list[State]:
    """Every read path at every position against a naive fold; the states, by position."""
    head = await store.head()
    states: list[State] = []
    for p in range(head + 1):
        naive = await replay(store.backend.read, p)  # (event by event, from decoded events)
        assert (await store.state_at(p)).state == naive, p
        assert await store.replay(p) == naive, p
        truth = StateView(naive)
        for u in w.providers:
            sliced = await store.state_at(p, provider=u)
            if u not in naive.providers:
                with pytest.raises(ProviderNotFound):
                    await sliced.usage(u)
                continue
            for query in ("usage", "inventories", "provider", "provider_allocations"):
                assert await getattr(sliced, query)(u) == await getattr(truth, query)(u), (p, u, query)
        for c in consumers:
            assert await (await store.state_at(p, consumer=c)).allocations(c) == await truth.allocations(c), (
                p,
                c,
            )
        states.append(naive)
    # history: every event that names the entity or moves what a consumer holds on it
    folded, named = State(), dict[str, list[int]]()
    for recorded in await store.read(0, head + 1):
        moved = evolve_noting_providers(folded, recorded.event, recorded.position)
        for uuid in {key.partition(":")[2] for key in recorded.event.entities()} | moved:
            named.setdefault(uuid, []).append(recorded.position)
    for uuid in [*w.providers, *consumers]:
        listed = [e.position async for e in store.history(uuid)]
        assert listed == sorted(set(listed)), uuid
        assert set(named.get(uuid, [])) <= set(listed), uuid
        # (and, beyond those, only a tombstone of its instance that left a migration holding)
        assert all(states[x].consumers[uuid].on_behalf_of for x in set(listed) - set(named.get(uuid, [])))
    rnd = random.Random(head)
    for _ in range(25):
        a, b = sorted(rnd.randint(0, head) for _ in range(2))
        d = await store.diff(a, b)
        assert sum(d.events_by_type.values()) == b - a
        usage = {(u, rc): n for u, prov in states[a].providers.items() for rc, n in prov.usages.items()}
        for delta in d.usage:
            assert usage.get((delta.provider, delta.resource_class), 0) == delta.before, (a, b, delta)
            usage[(delta.provider, delta.resource_class)] = delta.after
        want = {(u, rc): n for u, prov in states[b].providers.items() for rc, n in prov.usages.items()}
        assert {k: n for k, n in usage.items() if n} == {k: n for k, n in want.items() if n}, (a, b)
        changes = {change.consumer: change for change in d.consumers}
        for c in consumers:
            before, after = ConsumerView.in_state(c, states[a]), ConsumerView.in_state(c, states[b])
            if c in changes:
                assert (changes[c].before, changes[c].after) == (before.allocations, after.allocations), (
                    a,
                    b,
                    c,
                )
            else:
                assert before == after, (a, b, c)
    return states


# (fixed seeds: each a different mix; the workload is random, its checks exhaustive)
@pytest.mark.parametrize("seed", [2, 6])
async def test_every_read_path_agrees_at_every_position_of_an_older_writers_log(
    backend_name: str, tmp_path: Path, seed: int
) -> None:
    rnd, every = random.Random(seed), 2 + seed % 3
    async with open_store(_url(backend_name, tmp_path, "a"), snapshot_every=every) as a:
        w = Workload(a, seed)
        await a.create_resource_class(CLASSES[3])
        for i, p in enumerate(w.providers):
            await a.create_provider(p, f"start-{i}")
            await a.set_inventories(p, {rc: Inventory(total=256, max_unit=64) for rc in CLASSES[:4]}, 0)
        await _run(a, w, 30)
        lines = [line async for line in a.export()]
        [last] = await a.backend.read_raw(await a.head() - 1, 1)
        state = await a.replay()
    for row in _older_writers_rows(rnd, w, state, last, 10):
        append_row(lines, row)
    async with open_store(_url(backend_name, tmp_path, "b"), snapshot_every=every) as b:
        await b.import_events(lambda: iter(lines))
        await _run(b, w, 15)  # (commands decided against what the older writer left)
        named = {c for c in w.consumers if [e async for e in b.history(c)]}
        consumers = [*sorted(named)[:12], new_uuid()]  # (and one no event names)
        report = await b.audit()
        assert report.leaks or report.integrity, "the older writer's rows left nothing to find"
        found = await _check(b, w, consumers)
        await b.take_snapshots()
        assert await _check(b, w, consumers) == found
        await b.rebuild()
        report = await b.audit(history=True)
        assert not report.drift
        assert {f.details.get("reason") for f in report.integrity} <= {"usage_not_held", "unknown_provider"}
        assert await _check(b, w, consumers) == found
        exported = [line async for line in b.export()]
    async with open_store(_url(backend_name, tmp_path, "c"), snapshot_every=every) as c:
        await c.import_events(lambda: iter(exported))
        assert [line async for line in c.export()] == exported
        assert await _check(c, w, consumers) == found


async def _instance_deleted_after_an_earlier_migration_was(url: str, tmp_path: Path) -> dict[str, Any]:
    """An instance whose first migration was deleted (this evstore's delete records the instance
    as ``on_behalf_of``: the event is in the instance's history), then migrated again and deleted
    by an older writer, which left the second migration holding: a leak."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "node", VCPU=64)
        instance, first, second = new_uuid(), new_uuid(), new_uuid()
        await allocate(source, instance, {rp: {"VCPU": 2}})
        await source.start_migration(instance, first)
        first_deleted = (await source.delete_consumer(first)).position
        await allocate(source, instance, {rp: {"VCPU": 3}})
        started = (await source.start_migration(instance, second)).position
        lines = [line async for line in source.export()]
        [last] = await source.backend.read_raw(await source.head() - 1, 1)
    tombstone = chained(last, "ConsumerDeleted", {"consumer": instance, "migrations_released": {}})
    append_row(lines, tombstone)
    return {
        "lines": lines,
        "instance": instance,
        "second": second,
        "first_deleted": first_deleted,
        "started": started,
        "tombstone": tombstone.position,
    }


async def test_a_migrations_slice_and_history_find_its_instances_own_tombstone(
    store_url: str, tmp_path: Path
) -> None:
    """Regression: ``state_at(consumer=)`` of a migration and its ``history`` took the first
    ``ConsumerDeleted`` the instance's history lists as the instance's tombstone; that is also the
    delete of an earlier migration of it (which records the instance as ``on_behalf_of``), or of a
    consumer that released it as its migration. The slice failed with a bare ``KeyError`` (or, for
    the latter, said the leak was none), and the history left out the delete that made the leak,
    which the audit and ``diff`` cite."""
    ids = await _instance_deleted_after_an_earlier_migration_was(store_url, tmp_path)
    second, tombstone = ids["second"], ids["tombstone"]
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(ids["lines"]))
        [leak] = (await store.audit()).leaks
        assert leak.positions == (ids["started"], tombstone)
        whole = await (await store.state_at(tombstone)).allocations(second)
        assert whole.leaked
        assert await (await store.state_at(tombstone, consumer=second)).allocations(second) == whole
        assert [e.position async for e in store.history(second)] == [ids["started"], tombstone]
        instance_history = [e.position async for e in store.history(ids["instance"])]
        assert ids["first_deleted"] in instance_history and tombstone in instance_history
