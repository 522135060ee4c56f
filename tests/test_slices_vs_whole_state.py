"""The store decides each command on a *slice* of the state (what ``needs(command)`` names, loaded
from the projection or the writer's cache, in group commits); the pure core decides on the whole
state. Both must agree on every outcome, and every query must equal the fold.

A random workload of every command (providers created, renamed and deleted, custom classes,
inventories replaced and updated one class at a time, single and multi-consumer writes, moves,
releases, migrations started, reverted and confirmed, deletions) runs against a real store; the
same commands, in the order the store ran them, go through ``decide``/``evolve`` on the whole
state. A command the store judges differently from the whole state means the slice missed
something ``decide`` reads (set_inventory on a provider holding a custom class was such a bug).
On SQLite the commands of a round are gathered (they share group commits, in submission order);
on PostgreSQL they run one by one (there, independent commands of a batch commit in parallel and
may be ordered differently). ``EVSTORE_SLOW=1`` runs more seeds and rounds.
"""

from __future__ import annotations

import asyncio
import os
import random
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from evstore import AllocationStore, ConsumerAllocations, EvstoreError, Inventory
from evstore.commands import Command, decide
from projections.state import State, evolve
from projections.views import (
    RESERVED_CONSUMER_TYPES,
    ConsumerView,
    ProjectUsages,
    ProviderUsage,
    groups_from_rows,
    project_usage_rows,
    provider_allocations,
    reserved_type_usages,
)

SLOW = bool(os.environ.get("EVSTORE_SLOW"))
SEEDS = range(12) if SLOW else range(3)
ROUNDS = 150 if SLOW else 35

CLASSES = ["VCPU", "MEMORY_MB", "DISK_GB", "CUSTOM_A", "CUSTOM_B"]
#: (UNKNOWN: what Placement's reserved type "unknown" selects, with consumers of no type)
PROJECTS, USERS, TYPES = ["pa", "pb"], ["ua", "ub"], ["INSTANCE", "MIGRATION", "OTHER", "UNKNOWN"]


class Workload:
    def __init__(self, store: AllocationStore, seed: int) -> None:
        self.store = store
        self.rnd = random.Random(seed)
        self.providers = [str(uuid.UUID(int=self.rnd.getrandbits(128), version=4)) for _ in range(8)]
        self.consumers = [str(uuid.UUID(int=self.rnd.getrandbits(128), version=4)) for _ in range(80)]

    def generation(self, current: int | None) -> int | None:
        """Usually the right one; sometimes stale, to exercise the conflicts."""
        if self.rnd.random() < 0.93:
            return current
        return (current or 0) + 1

    def allocations(self) -> dict[str, dict[str, int]]:
        rnd = self.rnd
        return {
            # (custom classes too: emptying, moving or reverting a consumer carries its classes
            # along without naming them)
            p: {rc: rnd.choice([1, 2, 4, 8]) for rc in rnd.sample(CLASSES[:4], rnd.choice([1, 2]))}
            for p in rnd.sample(self.providers, rnd.choice([1, 1, 2]))
        }

    def entry(self, allocations: dict[str, dict[str, int]], generation: int | None) -> ConsumerAllocations:
        rnd = self.rnd
        return ConsumerAllocations(
            allocations=allocations,
            project_id=rnd.choice(PROJECTS),
            user_id=rnd.choice(USERS),
            consumer_type=rnd.choice(TYPES),
            consumer_generation=generation,
        )

    def command(self, model: State) -> Awaitable[Any]:
        """One random command, its arguments read off the whole state so that most are accepted."""
        s, rnd = self.store, self.rnd
        p, c = rnd.choice(self.providers), rnd.choice(self.consumers)
        prov, cons = model.providers.get(p), model.consumer(c)
        pgen = self.generation(prov.generation if prov else 0) or 0
        migrations = [m.uuid for m in model.consumers.values() if m.on_behalf_of] or self.consumers
        k = rnd.random()
        if k < 0.03:
            return s.create_provider(
                p, f"node-{rnd.randrange(12)}", rnd.choice([None, None, *self.providers])
            )
        if k < 0.07:
            return s.rename_provider(p, f"node-{rnd.randrange(12)}")
        if k < 0.08:
            return s.delete_provider(p)
        if k < 0.10:
            return s.create_resource_class(rnd.choice(CLASSES[3:]))
        if k < 0.16:
            inventories = {
                rc: Inventory(
                    total=rnd.choice([16, 64, 256]),
                    reserved=rnd.choice([0, 0, 2]),
                    allocation_ratio=rnd.choice([1.0, 1.5]),
                    step_size=rnd.choice([1, 1, 2]),
                    max_unit=rnd.choice([8, 64]),
                )
                for rc in rnd.sample(CLASSES, rnd.randint(1, 4))
            }
            return s.set_inventories(p, inventories, generation=pgen)
        if k < 0.21:
            return s.set_inventory(p, rnd.choice(CLASSES), Inventory(total=rnd.choice([2, 32, 128])), pgen)
        if k < 0.23:
            return s.delete_inventory(p, rnd.choice(CLASSES))
        if k < 0.45:
            e = self.entry(self.allocations() if rnd.random() < 0.9 else {}, self.generation(cons.generation))
            return s.set_allocations(
                c,
                e.allocations,
                project_id=e.project_id,
                user_id=e.user_id,
                consumer_type=e.consumer_type,
                generation=e.consumer_generation,
            )
        if k < 0.53:
            chosen = rnd.sample(self.consumers, rnd.choice([2, 2, 3]))
            src, dst = model.consumer(chosen[0]), model.consumer(chosen[1])
            if rnd.random() < 0.5 and src.allocations:  # Nova's move_allocations
                labels = {"project_id": src.project_id or "pa", "user_id": src.user_id or "ua"}
                body = {
                    src.uuid: ConsumerAllocations(
                        allocations={}, consumer_type="INSTANCE", consumer_generation=src.generation, **labels
                    ),
                    dst.uuid: ConsumerAllocations(
                        allocations=src.allocations,
                        consumer_type="MIGRATION",
                        consumer_generation=dst.generation,
                        **labels,
                    ),
                }
            else:
                body = {
                    x: self.entry(self.allocations(), self.generation(model.consumer(x).generation))
                    for x in chosen
                }
            return s.write_allocations(body)
        if k < 0.58:
            return s.release(c)
        if k < 0.70:
            return s.start_migration(c, rnd.choice(self.consumers))
        if k < 0.78:
            return s.revert_migration(rnd.choice(migrations))
        if k < 0.83:
            return s.confirm_migration(rnd.choice(migrations))
        target = model.consumers.get(rnd.choice(migrations))
        if target is not None and target.on_behalf_of and rnd.random() < 0.5:
            return s.delete_consumer(target.on_behalf_of)  # an instance mid-migration
        return s.delete_consumer(c)


async def _compare_queries(store: AllocationStore, w: Workload, model: State) -> None:
    replayed = await store.replay()
    for name, ref in (("replay", replayed), ("whole state", model)):
        for p in w.providers:
            if p not in ref.providers:
                with pytest.raises(EvstoreError):
                    await store.usage(p)
                continue
            usage = await store.usage(p)
            assert usage == ProviderUsage.of(ref.providers[p]), (name, p)
            assert await store.provider_allocations(p) == provider_allocations(ref, p), (name, p)
        for c in w.consumers:
            assert await store.allocations(c) == ConsumerView.in_state(c, ref), (name, c)
        for project in PROJECTS:
            for user in [*USERS, None]:
                for kind in [*TYPES, None]:
                    expected = ProjectUsages.from_rows(project_usage_rows(ref, project, user, kind))
                    assert await store.usages(project, user, kind) == expected, (name, project, user, kind)
                every = groups_from_rows(project_usage_rows(ref, project, user, None))
                for kind in RESERVED_CONSUMER_TYPES:  # (SQLite: from the counters' groups, not rows)
                    expected = reserved_type_usages(every, kind)
                    assert await store.usages(project, user, kind) == expected, (name, project, user, kind)
        by_name = sorted(((p.uuid, p.name) for p in ref.providers.values()), key=lambda t: t[1])
        assert await store.providers() == by_name, name


@pytest.mark.parametrize("seed", SEEDS)
async def test_the_store_decides_on_slices_as_the_core_decides_on_the_whole_state(
    store: AllocationStore, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    w = Workload(store, seed)
    ran: list[tuple[Command, Any]] = []  # (command, receipt or error), in the order they were queued
    submit: Callable[..., Awaitable[Any]] = store._submit

    async def recording(command: Command, *args: Any) -> Any:
        entry: list[Any] = [command, None]
        ran.append(entry)  # type: ignore[arg-type]
        try:
            entry[1] = await submit(command, *args)
        except EvstoreError as exc:
            entry[1] = exc
            raise
        return entry[1]

    monkeypatch.setattr(store, "_submit", recording)
    await store.create_resource_class(CLASSES[3])
    for i, p in enumerate(w.providers):  # a populated start, so that most commands are accepted
        await store.create_provider(p, f"start-{i}")
        inventories = {rc: Inventory(total=w.rnd.choice([64, 256]), max_unit=64) for rc in CLASSES[:4]}
        await store.set_inventories(p, inventories, generation=0)
    gather = store.backend.url.startswith("sqlite")
    model = State()
    position = checked = 0

    def check() -> None:
        """Run what the store ran since the last check through the whole state; same outcomes."""
        nonlocal position, checked
        for command, outcome in ran[checked:]:
            expected: tuple[int, ...] | EvstoreError
            try:
                events = decide(command, model)
            except EvstoreError as exc:
                expected = exc
            else:
                for event in events:
                    position += 1
                    evolve(model, event, position)
                expected = tuple(range(position - len(events) + 1, position + 1))
            if isinstance(expected, EvstoreError):
                assert isinstance(outcome, EvstoreError), (command, outcome, expected)
                assert outcome.code == expected.code, (command, outcome, expected)
            else:
                assert not isinstance(outcome, EvstoreError), (command, outcome, expected)
                if gather:  # (on PostgreSQL positions follow commit order)
                    assert outcome.positions == expected, command
        checked = len(ran)

    check()
    for _ in range(ROUNDS):
        commands = [w.command(model) for _ in range(w.rnd.randint(1, 20))]
        if gather:
            await asyncio.gather(*commands, return_exceptions=True)
        else:
            for one in commands:
                try:
                    await one
                except EvstoreError:
                    pass
        check()
    assert await store.head() == position
    await _compare_queries(store, w, model)
    report = await store.audit()
    # (shrinking an inventory below its usage is allowed, as in Placement: the audit reports it)
    assert [f for f in report.findings if f.kind != "over_capacity"] == []
