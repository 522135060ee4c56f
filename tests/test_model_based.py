"""Model-based testing: hypothesis drives the real store against a small reference model.

The model below is written for the test, independently of ``evstore.commands``: plain dicts and
the rules of SPEC §2 spelled out the simple way. After every step the store's usages,
allocations and generations must equal the model's; no allocation may belong to a tombstoned
consumer; usage stays within capacity unless an inventory shrink caused it; and the persisted
projection must equal a fresh replay of the log.

CI runs a bounded number of examples; ``EVSTORE_SLOW=1`` runs thousands.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import evstore
from evstore import AllocationStore, ConsumerAllocations, Inventory, open_store
from projections.audit import compare_states

SLOW = os.environ.get("EVSTORE_SLOW") == "1"
PROVIDERS = [f"00000000-0000-0000-0000-00000000010{i}" for i in range(3)]
CONSUMERS = [f"00000000-0000-0000-0000-00000000020{i}" for i in range(6)]
CLASSES = ["VCPU", "DISK_GB"]


@dataclass
class MInv:
    total: int
    reserved: int = 0
    min_unit: int = 1
    max_unit: int = 2147483647
    step_size: int = 1
    ratio: float = 1.0

    @property
    def capacity(self) -> float:
        return (self.total - self.reserved) * self.ratio


@dataclass
class MConsumer:
    gen: int | None = None
    allocs: dict[str, dict[str, int]] = field(default_factory=dict)
    deleted: bool = False
    behalf: str | None = None


@dataclass
class Model:
    providers: dict[str, dict[str, MInv]] = field(default_factory=dict)
    pgen: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, MConsumer] = field(default_factory=dict)
    shrunk: set[tuple[str, str]] = field(default_factory=set)

    def c(self, uuid: str) -> MConsumer:
        return self.consumers.setdefault(uuid, MConsumer())

    def used(self, p: str, rc: str, skip: set[str] = frozenset()) -> int:  # type: ignore[assignment]
        return sum(c.allocs.get(p, {}).get(rc, 0) for u, c in self.consumers.items() if u not in skip)

    def write(self, writes: list[tuple[str, dict[str, dict[str, int]], int | None]]) -> str:
        """Apply a replace of several consumers; return the outcome kind."""
        for uuid, allocs, gen in writes:
            c = self.c(uuid)
            if c.deleted:
                return "ConsumerDeleted"
            if c.gen != gen:
                return "ConcurrentUpdate"
            if allocs and c.behalf is not None and self.c(c.behalf).deleted:
                return "ConsumerDeleted"  # a migration of a deleted instance gets nothing
        rows = []
        for uuid, allocs, _ in writes:
            if allocs:
                rows += [(p, rc, n) for p, res in allocs.items() for rc, n in res.items()]
            else:
                rows += [(p, rc, 0) for p, res in self.c(uuid).allocs.items() for rc in res]
        if any(p not in self.providers for p, _, _ in rows):
            return "ProviderNotFound"
        classes = {rc for _, rc, _ in rows}
        if any(not classes & self.providers[p].keys() for p, _, _ in rows):
            return "InvalidInventory"
        skip = {u for u, _, _ in writes}
        running: dict[tuple[str, str], int] = {}
        for p, rc, n in rows:
            running[(p, rc)] = running.get((p, rc), 0) + n
            if n == 0:
                continue
            inv = self.providers[p].get(rc)
            if inv is None:
                return "InvalidInventory"
            if n < inv.min_unit or n > inv.max_unit or n % inv.step_size:
                return "ConstraintViolation"
            after = self.used(p, rc, skip) + running[(p, rc)]
            before = self.used(p, rc)
            if after > inv.capacity and not (before and after <= before):
                return "CapacityExceeded"
        named = []
        for p, _, _ in rows:
            if p not in named:
                named.append(p)
        # a move (one consumer emptied, exactly its allocations to one holding nothing): the target
        # holds them on the source's behalf, as after start_migration (same project and user here)
        emptied = [u for u, a, _ in writes if not a]
        filled = [(u, a) for u, a, _ in writes if a]
        move_to = None
        if len(writes) == 2 and len(emptied) == 1 and len(filled) == 1:
            src, (dst, allocs) = self.c(emptied[0]), filled[0]
            target = self.c(dst)
            if src.allocs and src.behalf is None and not target.allocs and target.behalf is None:
                if allocs == src.allocs:
                    move_to = dst
        for uuid, allocs, _ in writes:
            c = self.c(uuid)
            if not allocs and not c.allocs:
                continue
            c.gen = (c.gen or 0) + 1 if allocs else None
            c.allocs = {p: dict(r) for p, r in allocs.items()}
            if not allocs:
                c.behalf = None  # emptied by a plain write: no longer holding for anyone
        if move_to is not None:
            self.c(move_to).behalf = emptied[0]
        for p in named:
            self.pgen[p] += 1
        return "ok"


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.cm = open_store(self.store_url())
        self.store: AllocationStore = self.loop.run_until_complete(self.cm.__aenter__())
        self.model = Model()

    def store_url(self) -> str:
        return "sqlite://"

    def teardown(self) -> None:
        self.loop.run_until_complete(self.cm.__aexit__(None, None, None))
        self.loop.close()

    def run(self, coro: object) -> str:
        try:
            self.loop.run_until_complete(coro)  # type: ignore[arg-type]
        except evstore.EvstoreError as exc:
            return type(exc).__name__
        return "ok"

    @initialize()
    def providers(self) -> None:
        for i, p in enumerate(PROVIDERS):
            assert self.run(self.store.create_provider(p, f"node-{i}")) == "ok"
            self.model.providers[p] = {}
            self.model.pgen[p] = 0

    @rule(
        p=st.sampled_from(PROVIDERS),
        vcpu=st.one_of(st.none(), st.integers(1, 12)),
        disk=st.one_of(st.none(), st.integers(2, 40)),
        ratio=st.sampled_from([1.0, 1.5, 0.5]),
        stale=st.booleans(),
    )
    def set_inventories(self, p: str, vcpu: int | None, disk: int | None, ratio: float, stale: bool) -> None:
        invs: dict[str, MInv] = {}
        if vcpu is not None:
            invs["VCPU"] = MInv(vcpu, ratio=ratio)
        if disk is not None:
            invs["DISK_GB"] = MInv(disk, step_size=2, max_unit=20)
        gen = self.model.pgen[p] + (1 if stale else 0)
        real = {
            rc: Inventory(
                total=i.total,
                reserved=i.reserved,
                max_unit=i.max_unit,
                step_size=i.step_size,
                allocation_ratio=i.ratio,
            )
            for rc, i in invs.items()
        }
        got = self.run(self.store.set_inventories(p, real, gen))
        if stale:
            expected = "ConcurrentUpdate"
        elif any(self.model.used(p, rc) for rc in self.model.providers[p] if rc not in invs):
            expected = "InventoryInUse"
        else:
            expected = "ok"
            self.model.providers[p] = invs
            self.model.pgen[p] += 1
            for rc, inv in invs.items():
                if self.model.used(p, rc) > inv.capacity:
                    self.model.shrunk.add((p, rc))
        assert got == expected

    @rule(
        data=st.data(),
        consumers=st.lists(st.sampled_from(CONSUMERS), min_size=1, max_size=3, unique=True),
    )
    def write_allocations(self, data: st.DataObject, consumers: list[str]) -> None:
        writes = []
        for uuid in consumers:
            allocs: dict[str, dict[str, int]] = {}
            for p in data.draw(st.lists(st.sampled_from(PROVIDERS), max_size=2, unique=True)):
                res = data.draw(st.dictionaries(st.sampled_from(CLASSES), st.integers(1, 8), min_size=1))
                allocs[p] = res
            c = self.model.c(uuid)
            gen = data.draw(st.sampled_from([c.gen, None, (c.gen or 0) + 1]))
            writes.append((uuid, allocs, gen))
        body = {
            u: ConsumerAllocations(
                allocations=a, project_id="p", user_id="u", consumer_type="INSTANCE", consumer_generation=g
            )
            for u, a, g in writes
        }
        got = self.run(self.store.write_allocations(body))
        assert got == self.model.write(writes)

    @rule(c=st.sampled_from(CONSUMERS))
    def release(self, c: str) -> None:
        m = self.model.c(c)
        got = self.run(self.store.release(c))
        if not m.allocs:  # a tombstoned consumer holds nothing: NotFound, as SPEC says
            assert got == "NotFound"
        else:
            assert got == "ok"
            m.allocs, m.gen, m.behalf = {}, None, None

    @rule(inst=st.sampled_from(CONSUMERS), mig=st.sampled_from(CONSUMERS))
    def start_migration(self, inst: str, mig: str) -> None:
        got = self.run(self.store.start_migration(inst, mig))
        i, m = self.model.c(inst), self.model.c(mig)
        if inst == mig:
            assert got == "InvalidInput"
        elif i.deleted or m.deleted:
            assert got == "ConsumerDeleted"
        elif m.behalf is not None and m.behalf != inst and self.model.c(m.behalf).deleted:
            assert got == "ConsumerDeleted"  # the migration of an instance deleted since
        elif not i.allocs:
            assert got == "NotFound"
        elif m.allocs:
            assert got == "ConcurrentUpdate"
        elif i.behalf is not None:
            assert got == "InvalidInput"
        else:
            assert got == "ok"
            m.allocs, m.gen, m.behalf = i.allocs, 1, inst
            i.allocs, i.gen = {}, None
            for p in m.allocs:
                self.model.pgen[p] += 1

    def _migration_outcome(self, mig: str, giving_back: bool) -> tuple[str, MConsumer | None]:
        m = self.model.c(mig)
        if m.deleted:
            return "ConsumerDeleted", None
        if m.behalf is None:
            return "NotFound", None
        inst = self.model.c(m.behalf)
        if inst.deleted:
            return "ConsumerDeleted", None
        if not m.allocs:
            return "NotFound", None
        if giving_back and inst.behalf is not None:
            return "InvalidInput", None  # the instance is now another instance's migration
        return "ok", inst

    @rule(mig=st.sampled_from(CONSUMERS))
    def revert_migration(self, mig: str) -> None:
        expected, inst = self._migration_outcome(mig, giving_back=True)
        got = self.run(self.store.revert_migration(mig))
        assert got == expected
        if inst is not None:
            m = self.model.c(mig)
            for p in m.allocs:
                self.model.pgen[p] += 1
            inst.allocs, inst.gen = m.allocs, (inst.gen or 0) + 1
            m.allocs, m.gen, m.behalf = {}, None, None

    @rule(mig=st.sampled_from(CONSUMERS))
    def confirm_migration(self, mig: str) -> None:
        expected, inst = self._migration_outcome(mig, giving_back=False)
        got = self.run(self.store.confirm_migration(mig))
        assert got == expected
        if inst is not None:
            m = self.model.c(mig)
            m.allocs, m.gen, m.behalf = {}, None, None

    @precondition(lambda self: sum(c.deleted for c in self.model.consumers.values()) < 3)
    @rule(c=st.sampled_from(CONSUMERS))
    def delete_consumer(self, c: str) -> None:
        assert self.run(self.store.delete_consumer(c)) == "ok"
        m = self.model.c(c)
        if not m.deleted:
            for other in self.model.consumers.values():
                if other.behalf == c and other.allocs:
                    other.allocs, other.gen = {}, None
            m.allocs, m.gen, m.deleted = {}, None, True

    @invariant()
    def store_equals_model(self) -> None:
        async def check() -> None:
            for p in PROVIDERS:
                usage = await self.store.usage(p)
                assert usage.generation == self.model.pgen[p]
                expected = {rc: self.model.used(p, rc) for rc in self.model.providers[p]}
                assert usage.usages == expected
                for rc, inv in self.model.providers[p].items():
                    if (p, rc) not in self.model.shrunk:
                        assert expected[rc] <= inv.capacity
            for uuid in CONSUMERS:
                view = await self.store.allocations(uuid)
                m = self.model.c(uuid)
                assert view.allocations == m.allocs
                assert view.generation == (m.gen if m.allocs else None)
                assert view.deleted == m.deleted
                if view.deleted:
                    assert not view.allocations
            replayed = await self.store.replay()
            persisted = await self.store.backend.load_state()
            assert compare_states(replayed, persisted) == []

        self.loop.run_until_complete(check())


def _settings(examples: int, steps: int, slow_examples: int, slow_steps: int) -> settings:
    return settings(
        max_examples=slow_examples if SLOW else examples,
        stateful_step_count=slow_steps if SLOW else steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


StoreMachine.TestCase.settings = _settings(60, 25, 2000, 40)
TestStoreMachine = StoreMachine.TestCase


class PostgresStoreMachine(StoreMachine):
    """The same rules against PostgreSQL's write path (server-side functions), a fresh schema each."""

    def store_url(self) -> str:
        from tests.pg import fresh_database_url

        return fresh_database_url()


if os.environ.get("EVSTORE_TEST_POSTGRES_URL"):
    PostgresStoreMachine.TestCase.settings = _settings(15, 20, 300, 30)  # a schema per example
    TestPostgresStoreMachine = PostgresStoreMachine.TestCase
