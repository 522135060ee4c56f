"""Stop 43, helper E: the debugging tools against a fold written here, from the events' payloads.

Earlier time-travel tests compare ``state_at`` with ``projections.state.evolve`` - the fold the
store itself uses - and check that ``history`` lists *at least* the events that changed an entity.
Here random command programs (claims, two-consumer writes - a command with positions inside it -,
migrations started, reverted and confirmed, deletes, releases, inventories, providers deleted,
created again and renamed, snapshots taken in between) are checked, at every position, against
``oracle_fold``: a fold of the stored payloads that shares no code with ``projections/``:

* ``state_at(p)``, ``state_at(p, consumer=c)`` and ``state_at(p, provider=r)`` agree with the
  oracle and with each other (usage, inventories, provider rows, allocations, tombstones, leaks);
* ``history`` lists exactly the events whose payload names the entity;
* ``state_at(at=t)`` is ``state_at`` at the last event recorded at or before ``t`` (ties in
  ``recorded_at`` included: the log is imported again with its times made to collide);
* ``diff(a, b)`` is the difference of the oracle's states, for every ``a <= b``; ``a > b``, a bound
  beyond the head and a negative one are refused, ``a == b`` is empty;
* the same log exported, given a legacy (Placement-style) revert to a deleted instance, and
  imported: the audit reports that one leak, at the tombstone's and the revert's positions, and
  nothing else; ``release`` clears it;
* after ``rebuild`` (which drops the snapshots) the answers are the same.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from evstore import AllocationStore, EvstoreError, InvalidInput, Inventory, open_store
from evstore.events import GENESIS_HASH, AllocationsReplaced, ConsumerDeleted, MigrationReverted, event_hash
from tests.conftest import BACKENDS

SLOW = os.environ.get("EVSTORE_SLOW") == "1"

PROVIDERS = [str(uuid.UUID(int=0xA0 + i, version=4)) for i in range(3)]
CONSUMERS = [str(uuid.UUID(int=0xC0 + i, version=4)) for i in range(5)]
PROJECTS = ["p0", "p1"]

# --- the oracle: a fold of the payloads, written for this test -----------------------------------


def oracle_fold(rows: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The state after each event (index 0: the empty log), from ``(type, payload)`` pairs."""
    providers: dict[str, dict[str, Any]] = {}
    consumers: dict[str, dict[str, Any]] = {}
    out = [_frozen(providers, consumers)]

    def consumer(c: str) -> dict[str, Any]:
        return consumers.setdefault(
            c,
            {"allocs": {}, "project": None, "user": None, "type": None, "gen": None, "deleted": False}
            | {"deleted_at": None, "behalf": None},
        )

    def holds(c: str, allocs: dict[str, Any], position: int) -> None:
        consumer(c)["allocs"] = allocs
        consumers[c]["at"] = position

    def generations(d: dict[str, Any]) -> None:
        for rp, g in d.get("provider_generations", {}).items():
            if rp in providers:
                providers[rp]["gen"] = g

    def forget(c: str) -> None:
        x = consumers[c]
        if not x["allocs"] and not x["deleted"] and x["behalf"] is None:
            del consumers[c]

    for position, (kind, d) in enumerate(rows, 1):
        if kind == "ProviderCreated":
            providers[d["provider"]] = {"name": d["name"], "parent": d.get("parent"), "root": d["root"]}
            providers[d["provider"]] |= {"gen": 0, "inv": {}}
        elif kind == "ProviderUpdated":
            providers[d["provider"]]["name"] = d["name"]
        elif kind == "ProviderDeleted":
            providers.pop(d["provider"], None)
        elif kind == "InventoriesReplaced":
            if d["provider"] in providers:
                providers[d["provider"]]["inv"] = {rc: i["total"] for rc, i in d["inventories"].items()}
                providers[d["provider"]]["gen"] = d["generation"]
        elif kind == "AllocationsReplaced":
            holds(c := d["consumer"], d["allocations"], position)
            consumers[c] |= {"project": d["project_id"], "user": d["user_id"], "type": d["consumer_type"]}
            consumers[c]["gen"] = d["generation"] if d["allocations"] else None
            if not d["allocations"]:
                consumers[c]["behalf"] = None
            generations(d)
            forget(c)
        elif kind == "AllocationsReleased":
            holds(c := d["consumer"], {}, position)
            consumers[c] |= {"gen": None, "behalf": None}
            forget(c)
        elif kind == "MigrationStarted":
            holds(i := d["instance"], {}, position)
            holds(m := d["migration"], d["allocations"], position)
            labels = {"project": d["project_id"], "user": d["user_id"]}
            consumers[i] |= labels | {"gen": None, "type": d["instance_consumer_type"]}
            consumers[m] |= labels | {"gen": d.get("migration_generation", 1), "behalf": i}
            consumers[m]["type"] = d.get("migration_consumer_type", "MIGRATION")
            generations(d)
            forget(i)
        elif kind == "MigrationReverted":
            holds(m := d["migration"], {}, position)
            holds(i := d["instance"], d["allocations"], position)
            consumers[m] |= {"gen": None, "behalf": None}
            consumers[i] |= {"project": d["project_id"], "user": d["user_id"]}
            consumers[i] |= {"type": d["instance_consumer_type"], "gen": d["instance_generation"]}
            generations(d)
            forget(m)
            forget(i)
        elif kind == "MigrationConfirmed":
            holds(m := d["migration"], {}, position)
            consumers[m] |= {"gen": None, "behalf": None}
            forget(m)
        elif kind == "ConsumerDeleted":
            x = consumer(c := d["consumer"])
            if not x["deleted"]:
                x["deleted_at"] = position
            holds(c, {}, position)
            x |= {"gen": None, "deleted": True}
            for m in d.get("migrations_released", {}):
                holds(m, {}, position)
                consumers[m]["gen"] = None
        elif kind != "ResourceClassCreated":
            raise AssertionError(f"the oracle does not know {kind}")
        out.append(_frozen(providers, consumers))
    return out


def _frozen(providers: dict[str, Any], consumers: dict[str, Any]) -> dict[str, Any]:
    usage: dict[str, dict[str, int]] = {rp: {} for rp in providers}
    for x in consumers.values():
        for rp, resources in x["allocs"].items():
            if rp in usage:
                for rc, n in resources.items():
                    usage[rp][rc] = usage[rp].get(rc, 0) + n
    return json.loads(
        json.dumps(
            {
                "providers": {rp: p | {"usage": usage[rp]} for rp, p in providers.items()},
                "consumers": consumers,
            }
        )
    )


def leaked(state: dict[str, Any], c: str) -> bool:
    x = state["consumers"].get(c)
    if x is None or not x["allocs"]:
        return False
    inst = state["consumers"].get(x["behalf"]) if x["behalf"] else None
    return bool(x["deleted"] or (inst is not None and inst["deleted"]))


def entities_of(row: Any, states: list[dict[str, Any]]) -> set[str]:
    """What ``history`` lists the event ``row`` under, and ``diff`` may list for it: the entities
    its payload names, and for an older writer's delete of an instance the migrations it left
    holding (README: the event that made their allocations a leak)."""
    entities = named_by(row.type, row.data)
    if row.type == "ConsumerDeleted":
        was = states[row.position - 1]["consumers"]
        entities |= {m for m, x in was.items() if x["behalf"] == row.data["consumer"] and x["allocs"]}
    return entities


def named_by(kind: str, d: dict[str, Any]) -> set[str]:
    """The entities an event's payload names (what ``history`` must list it under)."""
    names = {d[f] for f in ("consumer", "instance", "migration", "provider", "on_behalf_of") if d.get(f)}
    if kind in ("ProviderCreated", "ProviderDeleted") and d.get("parent"):  # (a child made or deleted)
        names.add(d["parent"])
    for f in ("allocations", "previous", "released", "replaced", "provider_generations"):
        names.update(d.get(f) or {})
    for m, allocs in (d.get("migrations_released") or {}).items():
        names.add(m)
        names.update(allocs)
    return names


# --- the programs ------------------------------------------------------------------------------

consumer_i = st.integers(0, len(CONSUMERS) - 1)
provider_i = st.integers(0, len(PROVIDERS) - 1)
OPS = st.one_of(
    st.tuples(st.just("claim"), consumer_i, provider_i, st.integers(1, 4)),
    st.tuples(st.just("claim2"), consumer_i, consumer_i, provider_i, st.integers(0, 3)),
    st.tuples(st.just("migrate"), consumer_i, consumer_i),
    st.tuples(st.just("revert"), consumer_i),
    st.tuples(st.just("confirm"), consumer_i),
    st.tuples(st.just("delete"), consumer_i),
    st.tuples(st.just("release"), consumer_i),
    st.tuples(st.just("inventory"), provider_i, st.integers(0, 12)),
    st.tuples(st.just("drop_provider"), provider_i),
    st.tuples(st.just("make_provider"), provider_i),
    st.tuples(st.just("rename"), provider_i, st.integers(0, 2)),
    st.tuples(st.just("snapshots")),
)


async def _generation(store: AllocationStore, c: str) -> int | None:
    return (await store.allocations(c)).generation


async def run_program(store: AllocationStore, program: list[tuple[Any, ...]]) -> None:
    for i, rp in enumerate(PROVIDERS):
        await store.create_provider(rp, f"rp-{i}", parent=PROVIDERS[0] if i == 1 else None)
        await store.set_inventories(rp, {"VCPU": Inventory(total=8), "DISK_GB": Inventory(total=50)}, 0)
    for op in program:
        name, args = op[0], op[1:]
        try:
            if name == "claim":
                c, rp = CONSUMERS[args[0]], PROVIDERS[args[1]]
                await store.set_allocations(
                    c, {rp: {"VCPU": args[2]}}, project_id=PROJECTS[args[0] % 2], user_id="u",
                    consumer_type="INSTANCE", generation=await _generation(store, c),
                )  # fmt: skip
            elif name == "claim2":
                a, b, rp = CONSUMERS[args[0]], CONSUMERS[args[1]], PROVIDERS[args[2]]
                if a == b:
                    continue
                body = {
                    a: {"allocations": {}, "project_id": "p0", "user_id": "u",
                        "consumer_generation": await _generation(store, a)},
                    b: {"allocations": {rp: {"DISK_GB": 5 * args[3] + 1}}, "project_id": "p1", "user_id": "u",
                        "consumer_type": "INSTANCE", "consumer_generation": await _generation(store, b)},
                }  # fmt: skip
                await store.write_allocations(body)
            elif name == "migrate":
                await store.start_migration(CONSUMERS[args[0]], CONSUMERS[args[1]])
            elif name in ("revert", "confirm", "delete", "release"):
                method = {"revert": "revert_migration", "confirm": "confirm_migration"}
                await getattr(store, method.get(name, f"{name}_consumer" if name == "delete" else name))(
                    CONSUMERS[args[0]]
                )
            elif name == "inventory":
                rp = PROVIDERS[args[0]]
                generation = (await store.provider(rp)).generation
                await store.set_inventories(rp, {"VCPU": Inventory(total=args[1])}, generation)
            elif name == "drop_provider":
                await store.delete_provider(PROVIDERS[args[0]])
            elif name == "make_provider":
                await store.create_provider(PROVIDERS[args[0]], f"rp-{args[0]}")
            elif name == "rename":
                await store.rename_provider(PROVIDERS[args[0]], f"name-{args[1]}-{args[0]}")
            else:
                await store.take_snapshots()
        except EvstoreError:
            pass


# --- the checks --------------------------------------------------------------------------------


async def rows_of(store: AllocationStore) -> list[Any]:
    return list(await store.read(0, 100_000))


async def view_of(view: Any, state: dict[str, Any], *, slices: AllocationStore | None = None) -> None:
    """``view`` (a whole state_at) against the oracle's ``state``; with ``slices``, each entity's
    slice at the same position against the whole view."""
    p = view.position
    providers = state["providers"]
    assert sorted(uuid for uuid, _name in await view.providers()) == sorted(providers), p
    for rp in PROVIDERS:
        if rp not in providers:
            with pytest.raises(EvstoreError):
                await view.usage(rp)
            continue
        want = providers[rp]
        # (Placement's view: every class of its inventory, zeros included; an imported log may
        # hold allocations of a class the provider does not stock, which diff and the audit see)
        got_usage = dict(await view.usage(rp))
        assert got_usage == {rc: want["usage"].get(rc, 0) for rc in want["inv"]}, (p, rp)
        assert {rc: i.total for rc, i in (await view.inventories(rp)).items()} == want["inv"], (p, rp)
        row = await view.provider(rp)
        assert (row.name, row.parent, row.root, row.generation) == (
            want["name"], want["parent"], want["root"], want["gen"]
        ), (p, rp)  # fmt: skip
        if slices is not None:
            one = await slices.state_at(p, provider=rp)
            for ask in ("usage", "inventories", "provider", "provider_allocations"):
                assert await getattr(one, ask)(rp) == await getattr(view, ask)(rp), (p, rp, ask)
    for c in {*CONSUMERS, *state["consumers"]}:
        got = await view.allocations(c)
        x = state["consumers"].get(c)
        if x is None:
            assert (got.allocations, got.deleted, got.on_behalf_of) == ({}, False, None), (p, c)
        else:
            assert got.allocations == x["allocs"], (p, c)
            assert (got.deleted, got.deleted_at, got.on_behalf_of) == (
                x["deleted"], x["deleted_at"], x["behalf"]
            ), (p, c)  # fmt: skip
            if x["allocs"]:
                assert (got.project_id, got.user_id, got.consumer_type, got.generation) == (
                    x["project"], x["user"], x["type"], x["gen"]
                ), (p, c)  # fmt: skip
        assert got.leaked == leaked(state, c), (p, c)
        if slices is not None:
            one = await (await slices.state_at(p, consumer=c)).allocations(c)
            assert one.to_dict() == got.to_dict() and one.leaked == got.leaked, (p, c)


async def check_log(store: AllocationStore, *, every_diff: bool) -> list[dict[str, Any]]:
    rows = await rows_of(store)
    states = oracle_fold([(r.type, r.data) for r in rows])
    head = len(rows)
    for p in range(head + 1):
        view = await store.state_at(p)
        await view_of(view, states[p], slices=store)
        assert await store.replay(p) == view.state, p  # (the fold from the first event: the same)
    # history: exactly the events whose payload names the entity
    named: dict[str, list[int]] = {}
    for r in rows:
        for entity in entities_of(r, states):
            named.setdefault(entity, []).append(r.position)
    for entity in {*PROVIDERS, *CONSUMERS, *named}:
        if entity not in named:
            continue
        listed = [e.position async for e in store.history(entity)]
        assert listed == named[entity], entity
        assert [e.position async for e in store.history(entity, batch_size=1)] == listed, entity
    # by time: the last event recorded at or before it, ties included
    for r in rows:
        for t in (r.recorded_at, r.recorded_at - timedelta(microseconds=1)):
            want = max((x.position for x in rows if x.recorded_at <= t), default=0)
            assert (await store.state_at(at=t)).position == want, t
            assert (await store.replay(at=t)).position == want, t
            assert await store.position_of(t) == want
    # diff: the oracle's difference
    pairs = [(a, b) for a in range(head + 1) for b in range(a, head + 1)]
    if not every_diff:
        pairs = [pair for i, pair in enumerate(pairs) if i % 7 == 0] + [(0, head), (head, head)]
    for a, b in pairs:
        await check_diff(store, states, rows, a, b)
    return states


async def check_diff(
    store: AllocationStore, states: list[dict[str, Any]], rows: list[Any], a: int, b: int
) -> None:
    d = await store.diff(a, b)
    before, after = states[a], states[b]
    want_usage = {}
    for rp in before["providers"].keys() | after["providers"].keys():
        old = before["providers"].get(rp, {"usage": {}})["usage"]
        new = after["providers"].get(rp, {"usage": {}})["usage"]
        for rc in old.keys() | new.keys():
            if old.get(rc, 0) != new.get(rc, 0):
                want_usage[(rp, rc)] = (old.get(rc, 0), new.get(rc, 0))
    assert {(u.provider, u.resource_class): (u.before, u.after) for u in d.usage} == want_usage, (a, b)
    for u in d.usage:  # (the events that changed what some consumer holds of that class there)

        def holdings(state: dict[str, Any], rp: str = u.provider, rc: str = u.resource_class) -> Any:
            held = {c: x["allocs"].get(rp, {}).get(rc, 0) for c, x in state["consumers"].items()}
            return {c: n for c, n in held.items() if n}

        moved = [p for p in range(a + 1, b + 1) if holdings(states[p - 1]) != holdings(states[p])]
        assert list(u.positions) == moved, (a, b, u)
    touched = {c for r in rows[a:b] for c in entities_of(r, states)}

    def seen(state: dict[str, Any], c: str) -> Any:
        x = state["consumers"].get(c)
        if x is None or not (x["allocs"] or x["deleted"]):
            return None
        return (x["allocs"], x["deleted"], x["project"], x["user"], x["type"], x["behalf"], leaked(state, c))

    listed = {ch.consumer: ch for ch in d.consumers}
    assert set(listed) <= touched, (a, b)
    for c in touched & {*before["consumers"], *after["consumers"], *CONSUMERS}:
        was, now = seen(before, c), seen(after, c)
        if was != now:
            assert c in listed, (a, b, c, was, now)
        ch = listed.get(c)
        if was is None and now is None:  # (touched, holding nothing at either end)
            assert ch is not None and ch.change == "transient", (a, b, c, ch)
        elif was != now:
            kind = (
                "leaked" if leaked(after, c)
                else "deleted" if now is not None and now[1] and not (was is not None and was[1])
                else "created" if was is None
                else "released" if now is None
                else "changed"
            )  # fmt: skip
            assert ch is not None and ch.change == kind, (a, b, c, was, now, ch)
        if ch is not None:
            events = [r.position for r in rows[a:b] if c in entities_of(r, states)]
            assert list(ch.positions) == events, (a, b, c, ch)
            had = before["consumers"].get(c, {"allocs": {}})["allocs"]
            held = after["consumers"].get(c, {"allocs": {}})["allocs"]
            assert (ch.before, ch.after) == (had, held), (a, b, c)
            assert (ch.change == "leaked") == leaked(after, c), (a, b, c, ch.change)
            if ch.change != "transient" and was == now:
                pytest.fail(f"diff({a}, {b}) lists {c} as {ch.change}, left as it was")
    kinds: dict[str, int] = {}
    for r in rows[a:b]:
        kinds[r.type] = kinds.get(r.type, 0) + 1
    assert d.events_by_type == kinds, (a, b)
    made = {r.data["provider"] for r in rows[a:b] if r.type == "ProviderCreated"}
    gone = {r.data["provider"] for r in rows[a:b] if r.type == "ProviderDeleted"}
    assert set(d.providers_created) == made | (after["providers"].keys() - before["providers"].keys()), (a, b)
    assert set(d.providers_deleted) == gone | (before["providers"].keys() - after["providers"].keys()), (a, b)
    kinds: dict[str, int] = {}
    for r in rows[a:b]:
        kinds[r.type] = kinds.get(r.type, 0) + 1
    assert d.events_by_type == kinds, (a, b)
    made = {r.data["provider"] for r in rows[a:b] if r.type == "ProviderCreated"}
    gone = {r.data["provider"] for r in rows[a:b] if r.type == "ProviderDeleted"}
    assert set(d.providers_created) == made | (after["providers"].keys() - before["providers"].keys()), (a, b)
    assert set(d.providers_deleted) == gone | (before["providers"].keys() - after["providers"].keys()), (a, b)
    named = {u.provider for u in d.usage} | set(d.providers_created) | set(d.providers_deleted)
    named |= {rp for ch in d.consumers for rp in (*ch.before, *ch.after)}
    assert set(d.provider_names) >= named, (a, b)
    for rp, name in d.provider_names.items():  # (at b; at a for one gone by then; else when deleted)
        if rp in after["providers"]:
            assert name == after["providers"][rp]["name"], (a, b, rp)
        elif rp in before["providers"]:
            assert name == before["providers"][rp]["name"], (a, b, rp)
        else:
            last = max(
                r.position for r in rows[a:b] if r.type == "ProviderDeleted" and r.data["provider"] == rp
            )
            assert name == states[last - 1]["providers"][rp]["name"], (a, b, rp)
    if a == b:
        assert (d.usage, d.consumers, d.providers_created, d.providers_deleted) == ([], [], [], [])


async def check_bounds(store: AllocationStore) -> None:
    head = await store.head()
    for a, b in [(1, 0), (head, head + 1), (head + 1, head + 1), (-1, head), (0, -1)]:
        if a > b and a <= head:
            with pytest.raises(InvalidInput):
                await store.diff(a, b)
            continue
        with pytest.raises(InvalidInput) as info:
            await store.diff(a, b)
        if max(a, b) > head:
            assert info.value.details.get("head") == head
    for bad in (head + 1, -1):
        with pytest.raises(InvalidInput):
            await store.state_at(bad)
        for scope in ({"provider": PROVIDERS[0]}, {"consumer": CONSUMERS[0]}):
            with pytest.raises(InvalidInput):
                await store.state_at(bad, **scope)  # type: ignore[arg-type]


def legacy_lines(
    lines: list[str], states: list[dict[str, Any]], tie: int
) -> tuple[list[str], dict[str, tuple[int, int]], list[tuple[str, str]]]:
    """The export ``lines`` re-timed so that ``tie`` events share each ``recorded_at`` (the hash
    chain made again), plus what a legacy (Placement-style) writer appends: a revert giving a
    deleted consumer allocations, a delete of an instance that leaves its migration holding, and
    a write to another deleted consumer.
    The leaks they make, each consumer's (allocated at, tombstone) positions sorted, and the
    commands that clear them."""
    rows = [json.loads(line) for line in lines[1:]]
    final = states[-1]["consumers"]
    leaks: dict[str, tuple[int, int]] = {}
    clear: list[tuple[str, str]] = []

    def append(event: Any) -> int:
        rows.append(
            {"position": len(rows) + 1, "event_id": str(uuid.uuid4()), "type": event.event_type,
             "schema_version": event.schema_version, "data": event.payload_json(),
             "metadata": json.dumps({"request_id": f"req-legacy-{len(rows)}", "actor": "legacy"})}
        )  # fmt: skip
        return len(rows)

    flying = [(m, x) for m, x in final.items() if x["behalf"] and x["allocs"] and not x["deleted"]]
    flying = [(m, x) for m, x in flying if not final.get(x["behalf"], {}).get("deleted")]
    if flying:  # (an older writer's delete of the instance: its migration left holding)
        migration, x = flying[0]
        instance = x["behalf"]
        held = final.get(instance, {}).get("allocs", {})
        tombstone = append(ConsumerDeleted(consumer=instance, released=held, migrations_released={}))
        leaks[migration] = (x["at"], tombstone)
        clear.append(("confirm_migration", migration))
    deleted = [c for c, x in final.items() if x["deleted"] and c not in leaks and not x["allocs"]]
    if deleted and states[-1]["providers"]:  # (the seed bug's revert, given to a deleted instance)
        instance = deleted[0]
        revert = MigrationReverted(
            migration=str(uuid.UUID(int=0xEE, version=4)), instance=instance,
            allocations={min(states[-1]["providers"]): {"VCPU": 1}}, project_id="p0", user_id="u",
            instance_consumer_type="INSTANCE", instance_generation=7,
        )  # fmt: skip
        leaks[instance] = (final[instance]["deleted_at"], append(revert))
        clear.append(("release", instance))
    if len(deleted) > 1 and states[-1]["providers"]:  # (a Placement-style PUT to a deleted one)
        consumer = deleted[1]
        write = AllocationsReplaced(
            consumer=consumer, allocations={max(states[-1]["providers"]): {"DISK_GB": 2}},
            project_id="p1", user_id="u", consumer_type="INSTANCE", generation=1,
        )  # fmt: skip
        leaks[consumer] = (final[consumer]["deleted_at"], append(write))
        clear.append(("release", consumer))
    start, prev = datetime(2026, 1, 1, tzinfo=UTC), GENESIS_HASH
    for row in rows:
        row["recorded_at"] = (start + timedelta(seconds=(row["position"] - 1) // tie)).isoformat(
            timespec="microseconds"
        )
        row.pop("hash", None)
        row["hash"] = prev = event_hash(prev, *row.values())
    header = json.loads(lines[0]) | {"events": len(rows), "head": len(rows), "head_hash": prev}
    return [json.dumps(header), *map(json.dumps, rows)], leaks, clear


async def scenario(urls: tuple[str, str], program: list[tuple[Any, ...]], every: int, tie: int) -> None:
    async with open_store(urls[0], snapshot_every=every) as store:
        await run_program(store, program)
        states = await check_log(store, every_diff=not SLOW)
        await check_bounds(store)
        report = await store.audit(history=True)
        assert [f for f in report.findings if f.kind != "over_capacity"] == []
        await store.rebuild()  # (drops the snapshots: every answer folded again)
        for p in range(0, len(states), 3):
            await view_of(await store.state_at(p), states[p])
        lines = [line async for line in store.export()]
    lines, leaks, clear = legacy_lines(lines, states, tie)
    async with open_store(urls[1], snapshot_every=every + 1) as copy:
        await copy.import_events(lambda: lines)
        exported = [json.loads(line) async for line in copy.export()]
        assert exported[1:] == [json.loads(line) for line in lines[1:]]  # (every row as imported)
        await copy.take_snapshots()
        states = await check_log(copy, every_diff=False)
        report = await copy.audit(history=True)
        found = {f.details["consumer"]: f.positions for f in report.findings if f.kind == "leak"}
        assert [f for f in report.findings if f.kind not in ("leak", "over_capacity")] == []
        assert found == leaks
        for finding in (f for f in report.findings if f.kind == "leak"):
            consumer = finding.details["consumer"]
            method = dict((c, m) for m, c in clear)[consumer]
            legacy = leaks[consumer][1]  # (the legacy row: the allocation, or the instance's delete)
            what = "allocated" if method == "release" else "deleted"
            assert finding.details[f"{what}_at"] == legacy, finding.details
            cited = finding.details["requests"][what]
            assert cited == {"request_id": f"req-legacy-{legacy - 1}", "actor": "legacy"}, finding.details
            command = "release" if method == "release" else "confirm-migration"
            assert f"`evstore {command} {consumer}`" in finding.message, finding.message
        head = await copy.head()
        for method, consumer in clear:
            await getattr(copy, method)(consumer)
        assert [f for f in (await copy.audit()).findings if f.kind != "over_capacity"] == []
        states = oracle_fold([(r.type, r.data) for r in await rows_of(copy)])
        await view_of(await copy.state_at(len(states) - 1), states[-1], slices=copy)
        cleared = {c.consumer: c.change for c in (await copy.diff(head, len(states) - 1)).consumers}
        assert {c: cleared.get(c) for c in leaks} == {c: "released" for c in leaks}, cleared
        # (and a migration's deleted instance, which the confirm names: nothing at either end)
        assert {c for c, change in cleared.items() if change != "transient"} == set(leaks), cleared


def _url(backend: str, tmp: Path, name: str) -> str:
    if backend == "sqlite":
        return f"sqlite:///{tmp / name}"
    from tests.pg import fresh_database_url

    return fresh_database_url()


@pytest.mark.parametrize("backend", BACKENDS)
@settings(
    max_examples=60 if SLOW else 3,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@example(  # (all three legacy leaks: two deleted consumers, an instance mid-migration)
    program=[("claim", 0, 0, 1), ("delete", 0), ("claim", 1, 0, 2), ("snapshots",), ("delete", 1),
             ("claim", 2, 1, 1), ("migrate", 2, 3), ("rename", 0, 1), ("claim2", 4, 2, 2, 1)],
    every=2,
    tie=3,
)  # fmt: skip
@given(
    program=st.lists(OPS, min_size=8, max_size=40 if SLOW else 18),
    every=st.one_of(st.integers(1, 6), st.just(10_000)),  # (10,000: no snapshot on these logs)
    tie=st.integers(1, 4),
)
def test_the_debugging_tools_agree_with_an_outside_fold(
    backend: str, tmp_path_factory: pytest.TempPathFactory, program: list[Any], every: int, tie: int
) -> None:
    tmp = tmp_path_factory.mktemp("s43e")
    urls = (_url(backend, tmp, "a.db"), _url(backend, tmp, "b.db"))
    asyncio.run(scenario(urls, program, every, tie))
