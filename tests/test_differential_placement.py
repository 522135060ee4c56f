"""Differential test: evstore against the real OpenStack Placement 16.0.0.

Random Nova-like command sequences (single and multi-consumer writes with null, current and stale
consumer generations, two projects and two users; Nova-style swaps as ``move_allocations`` sends
them; releases; inventory replacement, one-class updates, shrinking below usage and class
deletion; a custom resource class created mid-sequence; provider creation (as roots, or children
of existing, missing or deleted providers), renames (often to a taken name) and deletion (of
parents too); evstore's first-class migration commands against the POST a Nova would send) are
applied to an evstore store and to Placement's own WSGI app (in-process, SQLite, microversion
1.39; see ``tests/peers/``). After every step the test compares:

- the **outcome**: accepted, or which kind of rejection (``concurrent_update``, ``capacity``,
  ``constraint``, ``invalid_inventory``, ``provider_not_found``, ``inventory_in_use``,
  ``cannot_delete_parent``, ...);
- the **state**: for every provider its existence, generation and usages; for every consumer its
  allocations, generation, project, user and type; after an accepted step, what it can change of
  every provider's name, parent and root, inventories and allocations (with the consumers'
  generations: ``GET /resource_providers/{u}/allocations``) and of ``GET /usages`` per project
  (by consumer type) and per project and user (``consumer_type=all``); see ``ASPECTS``.

Any difference is an evstore bug, except the deliberate departures of SPEC.md, handled here so:

- tombstones: ``delete_consumer`` is never used (Placement has nothing to compare it with);
- orphan consumers: Placement leaves a consumer record at generation 0 with no allocations after
  an empty write to a new consumer with a null generation, or after a 400 for an unknown provider.
  After each step the driver deletes consumer records that hold nothing and reports them; the test
  asserts that exactly the consumers those two documented triggers predict were purged, so any
  other orphan would still show up as a difference;
- inventory sanity: no generated inventory has ``min_unit > max_unit``; ratios are positive.

The default run does a few seeded sequences (well under a minute once the Placement venv exists);
``EVSTORE_SLOW=1`` or ``-m slow`` runs hundreds of random ones. The Placement venv is built on
first use (``python -m tests.peers.venv`` pre-builds it); without it the test is skipped, except
under ``CI=true`` where that is a failure.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import structlog
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from evstore import (
    AllocationStore,
    CannotDeleteParent,
    CapacityExceeded,
    ConcurrentUpdate,
    ConstraintViolation,
    ConsumerAllocations,
    DuplicateName,
    EvstoreError,
    InvalidInput,
    InvalidInventory,
    Inventory,
    InventoryInUse,
    NotFound,
    ProviderInUse,
    ProviderNotFound,
    open_store,
)
from evstore.errors import InvalidInventoryValue
from projections.views import ConsumerView
from tests.conftest import BACKENDS, allocate, make_provider, new_uuid
from tests.peers.placement_client import PlacementPeer

CLASSES = ("VCPU", "MEMORY_MB", "DISK_GB")
N_PROVIDERS = 3  # P0 and P1 exist from the start; P2 must be created by the sequence
N_CONSUMERS = 4
PROJECTS = ("project-a", "project-b")
USERS = ("user", "user-b")
MAX_INT = 2147483647


# --- the abstract commands ----------------------------------------------------------------------


@dataclass(frozen=True)
class InvSpec:
    total: int
    reserved: int = 0
    min_unit: int = 1
    max_unit: int = MAX_INT
    step_size: int = 1
    allocation_ratio: float = 1.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "total": self.total,
            "reserved": self.reserved,
            "min_unit": self.min_unit,
            "max_unit": self.max_unit,
            "step_size": self.step_size,
            "allocation_ratio": self.allocation_ratio,
        }


@dataclass(frozen=True)
class CreateProvider:
    p: int
    parent: int | None = None


@dataclass(frozen=True)
class RenameProvider:
    p: int
    name: int  # renamed "rp-{name}": often the name of another provider


@dataclass(frozen=True)
class DeleteProvider:
    p: int


@dataclass(frozen=True)
class SetInventories:
    p: int
    inventories: tuple[tuple[str, InvSpec], ...]
    stale: int  # 0: the current generation; else current + stale (or - if that stays >= 0)


@dataclass(frozen=True)
class ShrinkInventory:
    """Set one class's capacity to one less than its usage (over capacity), current generation."""

    p: int
    rc: str


@dataclass(frozen=True)
class DeleteInventory:
    p: int
    rc: str


@dataclass(frozen=True)
class UpdateInventory:
    """``PUT .../inventories/{rc}`` of a class the provider has (``set_inventory``)."""

    p: int
    rc: str
    inventory: InvSpec
    stale: int


@dataclass(frozen=True)
class CreateResourceClass:
    name: str


@dataclass(frozen=True)
class ConsumerSpec:
    c: int
    allocations: tuple[tuple[int, tuple[tuple[str, int], ...]], ...]  # () = remove everything
    generation: str  # "null" | "current" | "stale"
    project: str
    consumer_type: str
    user: str = USERS[0]


@dataclass(frozen=True)
class Write:
    consumers: tuple[ConsumerSpec, ...]
    post: bool  # POST /allocations even for one consumer (PUT /allocations/{c} otherwise)


@dataclass(frozen=True)
class Swap:
    """Nova's move_allocations: one POST emptying ``src`` and giving its allocations to ``dst``."""

    src: int
    dst: int
    src_generation: str
    dst_generation: str


@dataclass(frozen=True)
class Release:
    c: int


@dataclass(frozen=True)
class StartMigration:
    instance: int
    migration: int


@dataclass(frozen=True)
class RevertMigration:
    migration: int


@dataclass(frozen=True)
class ConfirmMigration:
    migration: int


Step = (
    CreateProvider
    | RenameProvider
    | DeleteProvider
    | UpdateInventory
    | CreateResourceClass
    | SetInventories
    | ShrinkInventory
    | DeleteInventory
    | Write
    | Swap
    | Release
    | StartMigration
    | RevertMigration
    | ConfirmMigration
)

SETUP: tuple[Step, ...] = (
    CreateProvider(0),
    CreateProvider(1),
    SetInventories(0, (("VCPU", InvSpec(8)), ("MEMORY_MB", InvSpec(16, 2, step_size=2))), 0),
    SetInventories(1, (("VCPU", InvSpec(4, allocation_ratio=1.5)), ("DISK_GB", InvSpec(20, max_unit=10))), 0),
    # Two instances already running, so that moves and migrations have something to move.
    Write(
        (ConsumerSpec(0, ((0, (("VCPU", 2), ("MEMORY_MB", 4))),), "null", "project-a", "INSTANCE"),), False
    ),
    Write((ConsumerSpec(1, ((1, (("VCPU", 1), ("DISK_GB", 4))),), "null", "project-b", "INSTANCE"),), True),
)


# --- strategies -----------------------------------------------------------------------------------


@st.composite
def inv_specs(draw: st.DrawFn) -> InvSpec:
    total = draw(st.integers(1, 24))
    reserved = min(draw(st.sampled_from([0, 0, 1, 2, total])), total)  # (reserved = total: capacity 0)
    min_unit = draw(st.sampled_from([1, 1, 1, 2, 3]))  # (3 with a step of 2: 4, 6... fit, 3 does not)
    max_unit = draw(st.sampled_from([MAX_INT, MAX_INT, 4, 8]))
    step_size = draw(st.sampled_from([1, 1, 1, 2]))
    # 1.15 and 0.3 make capacities a float just off a whole number (20 * 1.15 = 22.999999999999996,
    # 10 * 0.3 = 3.0000000000000004): never rounded, by either
    ratio = draw(st.sampled_from([1.0, 1.0, 1.5, 2.0, 0.5, 1.15, 0.3]))
    if ratio >= 1.0 and draw(st.integers(0, 11)) == 0:
        # Refused by both (400 / InvalidInventoryValue). Not with a ratio < 1: Placement truncates
        # int((total - reserved) * ratio), so it accepts reserved = total + 1 when the ratio is
        # below 1 (capacity int(-0.5) = 0), where SPEC.md section 1 rejects reserved > total.
        reserved = total + 1
    return InvSpec(total, reserved, min_unit, max(min_unit, max_unit), step_size, ratio)


providers = st.integers(0, N_PROVIDERS - 1)
consumers = st.integers(0, N_CONSUMERS - 1)
classes = st.sampled_from(CLASSES)
UNKNOWN_CLASS = "CUSTOM_NEVER_CREATED"
# Now and then a custom class nobody created (400 in Placement, UnknownResourceClass in evstore).
CUSTOM_CLASS = "CUSTOM_GOLD"  # unknown until a CreateResourceClass step creates it
classes_or_unknown = st.sampled_from([*CLASSES * 4, UNKNOWN_CLASS, CUSTOM_CLASS])
# Mostly the current generation, so that most writes get as far as the capacity checks.
generations = st.sampled_from(["null"] + ["current"] * 6 + ["stale"])


def _items(d: dict[Any, Any]) -> tuple[Any, ...]:
    return tuple(d.items())


# "Wild" allocations: any provider (P2 often does not exist), any class, any amount.
# Now and then an amount above 2**31-1: Placement's row checks refuse it (above any max_unit).
wild_amounts = st.sampled_from([*range(1, 11), *range(1, 11), MAX_INT + 1])
wild_resources = st.dictionaries(classes_or_unknown, wild_amounts, min_size=1, max_size=2).map(_items)
wild_allocations = st.dictionaries(providers, wild_resources, min_size=1, max_size=2).map(_items)
# "Sensible" allocations fit the SETUP inventories (classes, step sizes, max units) most of the time.
SENSIBLE_AMOUNTS = {
    0: {"VCPU": st.integers(1, 4), "MEMORY_MB": st.sampled_from([2, 4, 6, 8])},
    1: {"VCPU": st.integers(1, 3), "DISK_GB": st.integers(1, 8)},
}


@st.composite
def sensible_allocations(draw: st.DrawFn) -> tuple[Any, ...]:
    chosen = draw(st.lists(st.sampled_from([0, 1]), min_size=1, max_size=2, unique=True))
    out = []
    for p in chosen:
        amounts = SENSIBLE_AMOUNTS[p]
        names = draw(st.lists(st.sampled_from(sorted(amounts)), min_size=1, max_size=2, unique=True))
        out.append((p, tuple((rc, draw(amounts[rc])) for rc in names)))
    return tuple(out)


allocation_maps = st.one_of(
    st.just(()), sensible_allocations(), sensible_allocations(), sensible_allocations(), wild_allocations
)
consumer_specs = st.builds(
    ConsumerSpec,
    c=consumers,
    allocations=allocation_maps,
    generation=generations,
    project=st.sampled_from(PROJECTS),
    consumer_type=st.sampled_from(["INSTANCE", "INSTANCE", "MIGRATION"]),
    user=st.sampled_from(USERS),
)


@st.composite
def inventory_sets(draw: st.DrawFn, p: int) -> tuple[tuple[str, InvSpec], ...]:
    if p in SENSIBLE_AMOUNTS and draw(st.booleans()):
        names = sorted(SENSIBLE_AMOUNTS[p])  # the same classes, other amounts and constraints
    else:
        names = draw(st.lists(classes_or_unknown, max_size=3, unique=True))
    return tuple((rc, draw(inv_specs())) for rc in names)


@st.composite
def consumer_pairs(draw: st.DrawFn) -> tuple[int, int]:
    a = draw(consumers)
    return a, (a + draw(st.integers(1, N_CONSUMERS - 1))) % N_CONSUMERS


set_inventories = providers.flatmap(
    lambda p: st.builds(SetInventories, st.just(p), inventory_sets(p), st.sampled_from([0, 0, 0, 1, -1, 2]))
)
single_writes = st.builds(Write, st.lists(consumer_specs, min_size=1, max_size=1).map(tuple), st.booleans())


@st.composite
def multi_writes(draw: st.DrawFn) -> Write:
    chosen = draw(st.permutations(range(N_CONSUMERS)))[: draw(st.integers(2, 3))]
    specs = [draw(consumer_specs) for _ in chosen]
    return Write(tuple(ConsumerSpec(c, *_fields(spec)) for c, spec in zip(chosen, specs, strict=True)), True)


def _fields(spec: ConsumerSpec) -> tuple[Any, ...]:
    return spec.allocations, spec.generation, spec.project, spec.consumer_type, spec.user


swaps = st.builds(lambda pair, g1, g2: Swap(*pair, g1, g2), consumer_pairs(), generations, generations)
start_migrations = consumer_pairs().map(lambda pair: StartMigration(*pair))

# Weighted by repetition: allocation traffic dominates, provider churn is rare.
WEIGHTED_STEPS: list[st.SearchStrategy[Step]] = [
    *[single_writes] * 6,
    *[multi_writes()] * 3,
    *[swaps] * 3,
    *[st.builds(Release, consumers)] * 2,
    *[set_inventories] * 2,
    st.builds(ShrinkInventory, providers, classes),
    st.builds(DeleteInventory, providers, classes),
    *[start_migrations] * 2,
    *[st.builds(RevertMigration, consumers)] * 2,
    st.builds(ConfirmMigration, consumers),
    st.builds(CreateProvider, providers),
    # P2 (absent at first) as a child of P0 or P1, or of itself; then deleting its parent
    *[st.builds(CreateProvider, st.just(N_PROVIDERS - 1), providers)] * 2,
    st.builds(RenameProvider, providers, providers),
    *[st.builds(DeleteProvider, providers)] * 2,
    *[st.builds(UpdateInventory, providers, classes, inv_specs(), st.sampled_from([0, 0, 1]))] * 2,
    st.builds(CreateResourceClass, st.just(CUSTOM_CLASS)),
]
#: What else is compared after an accepted step of each kind, beyond every provider's generation
#: and usages and every consumer's allocations: "tree" (names, parents, roots), "inventories",
#: "allocations" (each provider's, with consumer generations, and ``GET /usages``).
ASPECTS: dict[type, frozenset[str]] = {
    CreateProvider: frozenset({"tree", "inventories"}),
    RenameProvider: frozenset({"tree"}),
    DeleteProvider: frozenset({"tree", "inventories"}),
    SetInventories: frozenset({"inventories"}),
    ShrinkInventory: frozenset({"inventories"}),
    DeleteInventory: frozenset({"inventories"}),
    UpdateInventory: frozenset({"inventories"}),
    **dict.fromkeys(
        (Write, Swap, Release, StartMigration, RevertMigration, ConfirmMigration), frozenset({"allocations"})
    ),
}
steps: st.SearchStrategy[Step] = st.sampled_from(WEIGHTED_STEPS).flatmap(lambda strategy: strategy)
programs = st.lists(steps, min_size=1, max_size=30)


# --- outcome kinds ----------------------------------------------------------------------------


def placement_kind(status: int, body: Any) -> str:
    if 200 <= status < 300:
        return "accepted"
    error = (body or {}).get("errors", [{}])[0]
    detail, code = str(error.get("detail", "")), str(error.get("code", ""))
    if status == 404:
        return "not_found"
    if status == 400 and "that does not exist" in detail:
        return "provider_not_found"
    if status == 400 and "parent provider UUID does not exist" in detail:
        return "provider_not_found"  # (Placement's 400 for a missing parent; evstore's ProviderNotFound)
    if status == 409:
        if code == "placement.resource_provider.cannot_delete_parent":
            return "cannot_delete_parent"
        if "exceed the capacity" in detail:
            return "capacity"
        if "violate inventory constraints" in detail:
            return "constraint"
        if code == "placement.inventory.inuse" or "in use" in detail:
            # DELETE /inventories/{rc} says "in use" with the code placement.concurrent_update (sic)
            return "inventory_in_use"
        if code == "placement.concurrent_update":
            return "concurrent_update"
        if "Inventory for" in detail and "invalid" in detail:
            return "invalid_inventory"
        if code == "placement.duplicate_name":
            return "duplicate"
        if code == "placement.resource_provider.inuse":
            return "provider_in_use"
    if status == 400:
        return "bad_request"
    return f"http {status} {code}: {detail.strip()[:160]}"


def evstore_kind(exc: EvstoreError | None) -> str:
    match exc:
        case None:
            return "accepted"
        case ConcurrentUpdate():
            return "concurrent_update"
        case CapacityExceeded():
            return "capacity"
        case ConstraintViolation():
            return "constraint"
        case InvalidInventoryValue():
            return "bad_request"
        case InvalidInventory():
            return "invalid_inventory"
        case InventoryInUse():
            return "inventory_in_use"
        case ProviderNotFound() if "does not exist" in exc.message:
            return "provider_not_found"
        case NotFound():
            return "not_found"
        case DuplicateName():
            return "duplicate"
        case ProviderInUse():
            return "provider_in_use"
        case CannotDeleteParent():
            return "cannot_delete_parent"
        case InvalidInput():
            return "bad_request"
    return f"evstore {exc.code}: {exc.message[:160]}"


# --- running a sequence on both ------------------------------------------------------------------


class Mismatch(AssertionError):
    pass


class Sequence:
    """One sequence on a fresh evstore store and a fresh Placement database."""

    def __init__(self, store: AllocationStore, peer: PlacementPeer) -> None:
        self.store = store
        self.peer = peer
        self.providers = [str(uuid.uuid4()) for _ in range(N_PROVIDERS)]
        self.consumers = [str(uuid.uuid4()) for _ in range(N_CONSUMERS)]
        self.names = {u: f"P{i}" for i, u in enumerate(self.providers)}
        self.names.update({u: f"C{i}" for i, u in enumerate(self.consumers)})
        self.trace: list[str] = []

    # ---- helpers over evstore's view (equal to Placement's, or the test has already failed) ----

    async def provider_generation(self, p: str) -> int | None:
        try:
            return (await self.store.usage(p)).generation
        except ProviderNotFound:
            return None

    async def find(self, start: int, wanted: Callable[[ConsumerView], bool]) -> ConsumerView:
        """The first consumer from index ``start`` on (cyclically) that is ``wanted``, else ``start``."""
        for k in range(N_CONSUMERS):
            view = await self.store.allocations(self.consumers[(start + k) % N_CONSUMERS])
            if wanted(view):
                return view
        return await self.store.allocations(self.consumers[start])

    def consumer_generation(self, choice: str, current: int | None) -> int | None:
        if choice == "null":
            return None
        if choice == "current":
            return current
        return 0 if current is None else current + 1

    def allocs(self, spec: ConsumerSpec) -> dict[str, dict[str, int]]:
        return {self.providers[p]: dict(res) for p, res in spec.allocations}

    @staticmethod
    def placement_allocs(allocs: dict[str, dict[str, int]]) -> dict[str, Any]:
        return {p: {"resources": res} for p, res in allocs.items()}

    # ---- one step ----

    async def apply(self, step: Step) -> None:
        plan = await self.translate(step)
        if plan is None:
            self.trace.append(f"{step}  -> skipped (precondition)")
            if hypothesis.currently_in_test_context():
                hypothesis.event(f"{type(step).__name__}: skipped")
            return
        method, path, body, run_evstore, new_null = plan
        status, answer = await self.peer.acall(method, path, body)
        p_kind = placement_kind(status, answer)
        try:
            await run_evstore()
            e_kind = evstore_kind(None)
        except EvstoreError as exc:
            e_kind = evstore_kind(exc)
        self.trace.append(f"{self.show(step)}  -> placement {p_kind} / evstore {e_kind}")
        if hypothesis.currently_in_test_context():
            hypothesis.event(f"{type(step).__name__}: {p_kind}")  # --hypothesis-show-statistics
        if p_kind != e_kind:
            self.fail(f"outcome differs: Placement {p_kind!r} ({status} {answer}), evstore {e_kind!r}")
        # Orphans: Placement keeps a null-generation new consumer at generation 0 after an empty
        # write or a 400 for an unknown provider (SPEC.md, deliberate departures).
        expected_orphans = {
            c for c, empty in new_null if (p_kind == "accepted" and empty) or p_kind == "provider_not_found"
        }
        purged = set(await asyncio.to_thread(self.peer.purge_orphans))
        if purged != expected_orphans:
            self.fail(
                f"Placement orphans {sorted(map(self.show_uuid, purged))} but the documented "
                f"departures predict {sorted(map(self.show_uuid, expected_orphans))}"
            )
        # The queries beyond usage and allocations only after a change a step can make (a refusal
        # changes nothing: the base state shows a trace); keeps the default run short.
        await self.compare_state(
            ASPECTS.get(type(step), frozenset()) if p_kind == "accepted" else frozenset()
        )

    async def translate(self, step: Step) -> Any:
        """``(method, path, body, evstore coroutine factory, [(new consumer, empty)])`` or None."""
        store = self.store
        match step:
            case CreateProvider(p, parent):
                u = self.providers[p]
                parent_uuid = None if parent is None else self.providers[parent]
                created: dict[str, Any] = {"uuid": u, "name": f"rp-{p}"}
                if parent_uuid is not None:
                    created["parent_provider_uuid"] = parent_uuid
                return (
                    "POST",
                    "/resource_providers",
                    created,
                    lambda: store.create_provider(u, f"rp-{p}", parent_uuid),
                    [],
                )
            case RenameProvider(p, n):
                u = self.providers[p]
                return (
                    "PUT",
                    f"/resource_providers/{u}",
                    {"name": f"rp-{n}"},
                    lambda: store.rename_provider(u, f"rp-{n}"),
                    [],
                )
            case UpdateInventory(p, rc, spec, stale):
                u = self.providers[p]
                status, body = await self.peer.acall("GET", f"/resource_providers/{u}/inventories")
                if status != 200 or not body["inventories"]:
                    return None
                if rc not in body["inventories"]:  # (evstore adds it, where Placement says 400)
                    names = sorted(body["inventories"])
                    rc = names[len(rc) % len(names)]  # (the hint: one the provider has)
                gen = body["resource_provider_generation"] + stale
                return (
                    "PUT",
                    f"/resource_providers/{u}/inventories/{rc}",
                    {"resource_provider_generation": gen, **spec.as_dict()},
                    lambda: store.set_inventory(u, rc, spec.as_dict(), gen),
                    [],
                )
            case CreateResourceClass(name):
                return (
                    "PUT",
                    f"/resource_classes/{name}",
                    None,
                    lambda: store.create_resource_class(name),
                    [],
                )
            case DeleteProvider(p):
                u = self.providers[p]
                return ("DELETE", f"/resource_providers/{u}", None, lambda: store.delete_provider(u), [])
            case SetInventories(p, inventories, stale):
                u = self.providers[p]
                current = await self.provider_generation(u) or 0
                gen = current + stale if current + stale >= 0 else current + abs(stale)
                invs = {rc: spec.as_dict() for rc, spec in inventories}
                return (
                    "PUT",
                    f"/resource_providers/{u}/inventories",
                    {"resource_provider_generation": gen, "inventories": invs},
                    lambda: store.set_inventories(u, invs, gen),
                    [],
                )
            case ShrinkInventory(p, rc):
                u = self.providers[p]
                status, body = await self.peer.acall("GET", f"/resource_providers/{u}/inventories")
                if status != 200 or rc not in body["inventories"]:
                    return None
                usage = await self.store.usage(u)
                invs = dict(body["inventories"])
                shrunk = dict(invs[rc])
                shrunk.update(total=max(1, usage[rc] - 1), reserved=0, allocation_ratio=1.0)
                invs[rc] = shrunk
                gen = body["resource_provider_generation"]
                return (
                    "PUT",
                    f"/resource_providers/{u}/inventories",
                    {"resource_provider_generation": gen, "inventories": invs},
                    lambda: store.set_inventories(u, invs, gen),
                    [],
                )
            case DeleteInventory(p, rc):
                u = self.providers[p]
                return (
                    "DELETE",
                    f"/resource_providers/{u}/inventories/{rc}",
                    None,
                    lambda: store.delete_inventory(u, rc),
                    [],
                )
            case Write(specs, post):
                return await self.translate_write(specs, post)
            case Swap(src, dst, src_choice, dst_choice):
                s = await store.allocations(self.consumers[src])
                d = await store.allocations(self.consumers[dst])
                project = s.project_id or PROJECTS[0]
                user = s.user_id or USERS[0]  # Nova sends the source's project and user for both
                specs_body = {
                    s.consumer: {
                        "allocations": {},
                        "project_id": project,
                        "user_id": user,
                        "consumer_type": s.consumer_type or "INSTANCE",
                        "consumer_generation": self.consumer_generation(src_choice, s.generation),
                    },
                    d.consumer: {
                        "allocations": self.placement_allocs(s.allocations),
                        "project_id": project,
                        "user_id": user,
                        "consumer_type": "MIGRATION",
                        "consumer_generation": self.consumer_generation(dst_choice, d.generation),
                    },
                }
                return await self.post_plan_with_views(
                    specs_body, {s.consumer: {}, d.consumer: s.allocations}
                )
            case Release(c):
                u = self.consumers[c]
                return ("DELETE", f"/allocations/{u}", None, lambda: store.release(u), [])
            case StartMigration(i, m):
                # The indices are hints: the first instance holding something from i on, the first
                # absent consumer from m on (so that migrations happen often enough to matter).
                inst = await self.find(i, lambda v: bool(v.allocations) and v.on_behalf_of is None)
                mig = await self.find(m, lambda v: not v.allocations and v.consumer != inst.consumer)
                if not inst.allocations or inst.on_behalf_of is not None or mig.allocations:
                    return None
                body = {
                    inst.consumer: {
                        "allocations": {},
                        "project_id": inst.project_id,
                        "user_id": inst.user_id,
                        "consumer_type": inst.consumer_type,
                        "consumer_generation": inst.generation,
                    },
                    mig.consumer: {
                        "allocations": self.placement_allocs(inst.allocations),
                        "project_id": inst.project_id,
                        "user_id": inst.user_id,
                        "consumer_type": "MIGRATION",
                        "consumer_generation": None,
                    },
                }
                return (
                    "POST",
                    "/allocations",
                    body,
                    lambda: store.start_migration(inst.consumer, mig.consumer),
                    [],
                )
            case RevertMigration(m):
                mig = await self.find(m, lambda v: v.on_behalf_of is not None and bool(v.allocations))
                if mig.on_behalf_of is None or not mig.allocations:
                    return None
                inst = await store.allocations(mig.on_behalf_of)
                if inst.on_behalf_of is not None:
                    # the instance was taken as another instance's migration since: evstore refuses
                    # to revert into it (it would replace what it holds for that instance)
                    return None
                # Nova sends the instance's own type; evstore's migration kept it (an absent
                # instance is gone from the state): the MigrationStarted that made it a migration
                started = [r async for r in store.history(mig.consumer) if r.type == "MigrationStarted"]
                instance_type = started[-1].event["instance_consumer_type"] if started else "INSTANCE"
                body = {
                    mig.consumer: {
                        "allocations": {},
                        "project_id": mig.project_id,
                        "user_id": mig.user_id,
                        "consumer_type": mig.consumer_type,
                        "consumer_generation": mig.generation,
                    },
                    inst.consumer: {
                        "allocations": self.placement_allocs(mig.allocations),
                        # (Nova's move_allocations: the source's - the migration's - project
                        # and user, whatever the instance holds)
                        "project_id": mig.project_id,
                        "user_id": mig.user_id,
                        "consumer_type": inst.consumer_type or instance_type,
                        "consumer_generation": inst.generation,
                    },
                }
                return ("POST", "/allocations", body, lambda: store.revert_migration(mig.consumer), [])
            case ConfirmMigration(m):
                mig = await self.find(m, lambda v: v.on_behalf_of is not None and bool(v.allocations))
                if mig.on_behalf_of is None or not mig.allocations:
                    return None
                return (
                    "DELETE",
                    f"/allocations/{mig.consumer}",
                    None,
                    lambda: store.confirm_migration(mig.consumer),
                    [],
                )
        raise AssertionError(f"unknown step {step!r}")

    async def translate_write(self, specs: tuple[ConsumerSpec, ...], post: bool) -> Any:
        body: dict[str, dict[str, Any]] = {}
        new_allocs: dict[str, dict[str, dict[str, int]]] = {}
        for spec in specs:
            u = self.consumers[spec.c]
            view = await self.store.allocations(u)
            allocs = self.allocs(spec)
            new_allocs[u] = allocs
            body[u] = {
                "allocations": self.placement_allocs(allocs),
                "project_id": spec.project,
                "user_id": spec.user,
                "consumer_type": spec.consumer_type,
                "consumer_generation": self.consumer_generation(spec.generation, view.generation),
            }
        if post or len(specs) > 1:
            return await self.post_plan_with_views(body, new_allocs)
        (u,) = body
        entry = body[u]
        plan = await self.post_plan_with_views(body, new_allocs)
        store = self.store
        return (
            "PUT",
            f"/allocations/{u}",
            entry,
            lambda: store.set_allocations(
                u,
                new_allocs[u],
                project_id=entry["project_id"],
                user_id=entry["user_id"],
                consumer_type=entry["consumer_type"],
                generation=entry["consumer_generation"],
            ),
            plan[4],
        )

    async def post_plan_with_views(
        self, body: dict[str, dict[str, Any]], new_allocs: dict[str, dict[str, dict[str, int]]]
    ) -> Any:
        plan = self.post_plan(body, new_allocs)
        new_null = []
        for u, entry in body.items():
            view = await self.store.allocations(u)
            if view.generation is None and entry["consumer_generation"] is None:
                new_null.append((u, not new_allocs[u]))
        return (*plan[:4], new_null)

    def post_plan(
        self, body: dict[str, dict[str, Any]], new_allocs: dict[str, dict[str, dict[str, int]]]
    ) -> Any:
        store = self.store
        writes = {
            u: ConsumerAllocations(
                allocations=new_allocs[u],
                project_id=entry["project_id"],
                user_id=entry["user_id"],
                consumer_type=entry["consumer_type"],
                consumer_generation=entry["consumer_generation"],
            )
            for u, entry in body.items()
        }
        return ("POST", "/allocations", body, lambda: store.write_allocations(writes), [])

    # ---- state ----

    async def placement_state(self, aspects: frozenset[str]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for u in self.providers:
            status, body = await self.peer.acall("GET", f"/resource_providers/{u}/usages")
            if status == 404:
                state[self.names[u]] = None
            else:
                assert status == 200, body
                state[self.names[u]] = (body["resource_provider_generation"], body["usages"])
                if "inventories" in aspects:
                    _, invs = await self.peer.acall("GET", f"/resource_providers/{u}/inventories")
                    state[f"{self.names[u]} inventories"] = invs["inventories"]
                if "allocations" in aspects:
                    _, held = await self.peer.acall("GET", f"/resource_providers/{u}/allocations")
                    state[f"{self.names[u]} allocations"] = {
                        self.show_uuid(c): (a["resources"], a["consumer_generation"])
                        for c, a in held["allocations"].items()
                    }
        if "tree" in aspects:
            _, listed = await self.peer.acall("GET", "/resource_providers")
            state["tree"] = {
                self.show_uuid(rp["uuid"]): (
                    rp["name"],
                    self.show_uuid(rp["parent_provider_uuid"] or "-"),
                    self.show_uuid(rp["root_provider_uuid"]),
                )
                for rp in listed["resource_providers"]
            }
        for query in self.usage_queries() if "allocations" in aspects else []:
            status, body = await self.peer.acall("GET", f"/usages?{query}")
            assert status == 200, body
            state[f"usages {query}"] = body["usages"]
        for u in self.consumers:
            status, body = await self.peer.acall("GET", f"/allocations/{u}")
            assert status == 200, body
            allocs = {self.names[p]: a["resources"] for p, a in body["allocations"].items()}
            state[self.names[u]] = (
                allocs,
                body.get("consumer_generation"),
                body.get("project_id"),
                body.get("user_id"),
                body.get("consumer_type"),
            )
        return state

    async def evstore_state(self, aspects: frozenset[str]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        for u in self.providers:
            try:
                usage = await self.store.usage(u)
            except ProviderNotFound:
                state[self.names[u]] = None
            else:
                state[self.names[u]] = (usage.generation, dict(usage.usages))
                if "inventories" in aspects:
                    state[f"{self.names[u]} inventories"] = {
                        rc: inv.model_dump() for rc, inv in (await self.store.inventories(u)).items()
                    }
                if "allocations" in aspects:
                    state[f"{self.names[u]} allocations"] = {
                        self.show_uuid(c): (res, (await self.store.allocations(c)).generation)
                        for c, res in (await self.store.provider_allocations(u)).items()
                    }
        if "tree" in aspects:
            state["tree"] = {}
            for u, _ in await self.store.providers():
                rp = await self.store.provider(u)
                parent = self.show_uuid(rp.parent or "-")
                state["tree"][self.show_uuid(u)] = (rp.name, parent, self.show_uuid(rp.root))
        for query in self.usage_queries() if "allocations" in aspects else []:
            args = dict(part.split("=") for part in query.split("&"))
            usages = await self.store.usages(
                args["project_id"], args.get("user_id"), args.get("consumer_type")
            )
            state[f"usages {query}"] = usages.by_consumer_type
        for u in self.consumers:
            view = await self.store.allocations(u)
            allocs = {self.names[p]: dict(r) for p, r in view.allocations.items()}
            held = bool(allocs)
            state[self.names[u]] = (
                allocs,
                view.generation,
                view.project_id if held else None,
                view.user_id if held else None,
                view.consumer_type if held else None,
            )
        return state

    @staticmethod
    def usage_queries() -> list[str]:
        """The ``GET /usages`` queries compared after an accepted allocation step (Placement's
        answer at 1.39, per consumer type)."""
        queries = [f"project_id={project}" for project in PROJECTS]
        return queries + [
            f"project_id={project}&user_id={USERS[1]}&consumer_type=all" for project in PROJECTS
        ]

    async def compare_state(self, aspects: frozenset[str] = frozenset()) -> None:
        expected, got = await self.placement_state(aspects), await self.evstore_state(aspects)
        if expected != got:
            diff = [
                f"  {k}: Placement {expected.get(k)} / evstore {got.get(k)}"
                for k in dict.fromkeys([*expected, *got])
                if expected.get(k) != got.get(k)
            ]
            self.fail("state differs:\n" + "\n".join(diff))

    # ---- reporting ----

    def show_uuid(self, u: str) -> str:
        return self.names.get(u, u)

    def show(self, step: Step) -> str:
        return repr(step)

    def fail(self, message: str) -> None:
        history = "\n".join(f"  {i:2d}. {line}" for i, line in enumerate(self.trace, 1))
        raise Mismatch(f"{message}\nsteps so far:\n{history}")


async def run_sequence(
    peer: PlacementPeer, program: list[Step], workdir: Path, url: str | None = None
) -> None:
    await asyncio.to_thread(peer.reset, workdir / "placement.sqlite")
    async with open_store(url or f"sqlite:///{workdir}/evstore.db") as store:
        seq = Sequence(store, peer)
        for step in (*SETUP, *program):
            await seq.apply(step)


def check_program(peer: PlacementPeer, program: list[Step], backend: str = "sqlite") -> None:
    """Run ``program`` on Placement and on evstore (a fresh SQLite file, or a fresh PostgreSQL
    schema: the rules are decided in the same Python, but each backend loads the slice a command
    decides against its own way)."""
    url = None
    if backend == "postgres":
        from tests.pg import fresh_database_url

        url = fresh_database_url()
    # capture_logs keeps evstore's per-command log lines out of failure reports.
    with tempfile.TemporaryDirectory(prefix="evstore-diff-") as tmp, structlog.testing.capture_logs():
        asyncio.run(run_sequence(peer, program, Path(tmp), url))


# --- fixtures and tests ---------------------------------------------------------------------------


COMMON = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    # No "explain" phase: it reruns the failing sequence hundreds of times for little insight.
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
}


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=12, derandomize=True, **COMMON)  # type: ignore[arg-type]
@given(program=programs)
def test_evstore_matches_placement(placement_peer: PlacementPeer, backend: str, program: list[Step]) -> None:
    check_program(placement_peer, program, backend)


def _slow_enabled(config: pytest.Config) -> bool:
    return os.environ.get("EVSTORE_SLOW") == "1" or "slow" in str(config.getoption("-m") or "")


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("EVSTORE_DIFF_EXAMPLES", "400")), **COMMON)  # type: ignore[arg-type]
@given(program=st.lists(steps, min_size=5, max_size=40))
def test_evstore_matches_placement_campaign(
    pytestconfig: pytest.Config, placement_peer: PlacementPeer, program: list[Step]
) -> None:
    if not _slow_enabled(pytestconfig):
        pytest.skip("long campaign: run with EVSTORE_SLOW=1 or -m slow")
    check_program(placement_peer, program)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("EVSTORE_DIFF_EXAMPLES_PG", "100")), **COMMON)  # type: ignore[arg-type]
@given(program=st.lists(steps, min_size=5, max_size=40))
def test_evstore_on_postgresql_matches_placement_campaign(
    pytestconfig: pytest.Config, placement_peer: PlacementPeer, program: list[Step]
) -> None:
    if not _slow_enabled(pytestconfig):
        pytest.skip("long campaign: run with EVSTORE_SLOW=1 or -m slow")
    check_program(placement_peer, program, "postgres")


def test_nova_swap_scenario(placement_peer: PlacementPeer) -> None:
    """A hand-written Nova sequence: build, move to a migration, revert, confirm, release."""
    full = ConsumerSpec(0, ((0, (("VCPU", 4), ("MEMORY_MB", 8))),), "null", PROJECTS[0], "INSTANCE")
    check_program(
        placement_peer,
        [
            Write((full,), post=False),
            Swap(0, 1, "current", "null"),
            Write((ConsumerSpec(0, ((1, (("VCPU", 2),)),), "null", PROJECTS[0], "INSTANCE"),), post=False),
            StartMigration(0, 2),
            RevertMigration(2),
            Swap(0, 3, "current", "current"),
            Release(1),
            Release(1),
            ShrinkInventory(0, "VCPU"),
            Swap(3, 0, "current", "null"),
            DeleteInventory(0, "VCPU"),
            ConfirmMigration(2),
        ],
    )


def test_revert_of_an_absent_instance_of_another_type(placement_peer: PlacementPeer) -> None:
    """The campaign's case once evstore kept a migration's instance type: the instance (written
    as MIGRATION-typed here) migrates away, is absent, and the revert gives it back its type, as
    Nova, which knows its instance, sends it to Placement."""
    check_program(
        placement_peer,
        [
            Write((ConsumerSpec(1, ((1, (("VCPU", 1),)),), "null", PROJECTS[1], "INSTANCE"),), post=True),
            Write(
                (ConsumerSpec(1, ((0, (("MEMORY_MB", 2),)),), "current", PROJECTS[0], "MIGRATION"),),
                post=False,
            ),
            StartMigration(1, 2),
            RevertMigration(0),
        ],
    )


def _run_side_by_side(scenario: Callable[[AllocationStore, Path], Awaitable[None]]) -> None:
    """Run ``scenario(store, tmp)`` on a fresh evstore SQLite store, beside a Placement database in
    the same temporary directory (the scenario resets the peer onto it)."""

    async def main(tmp: Path) -> None:
        async with open_store(f"sqlite:///{tmp}/evstore.db") as store:
            await scenario(store, tmp)

    with tempfile.TemporaryDirectory(prefix="evstore-diff-") as tmp, structlog.testing.capture_logs():
        asyncio.run(main(Path(tmp)))


def test_allocation_refusals_begin_with_placements_detail(placement_peer: PlacementPeer) -> None:
    """Regression (rev24, helper-55): the capacity and missing-inventory refusals began "Unable to
    create allocation ..." and "Inventory for ...", where Placement's 409 detail (the text a caller
    written for Placement matches on) is "Unable to allocate inventory: ..." for every refusal of the
    write itself; the constraint refusal already said so. Each refusal here is made on both, and
    evstore's message must begin with Placement's detail (evstore adds the amounts after it)."""
    rp = str(uuid.uuid4())
    vcpu = {"total": 4, "max_unit": 2, "allocation_ratio": 1.5}  # capacity 6.0
    refusals = [
        {"DISK_GB": 1},  # no inventory of any class of the command on the provider
        {"DISK_GB": 1, "VCPU": 1},  # the first row's class has no inventory there
        {"VCPU": 3},  # above max_unit
        {"VCPU": 2},  # 2 + 6 held > capacity 6.0 (the row fits max_unit)
    ]

    async def scenario(store: AllocationStore, tmp: Path) -> None:
        await asyncio.to_thread(placement_peer.reset, tmp / "placement.sqlite")
        await placement_peer.acall("POST", "/resource_providers", {"uuid": rp, "name": "rp"})
        await store.create_provider(rp, "rp")
        body = {"resource_provider_generation": 0, "inventories": {"VCPU": vcpu}}
        assert (await placement_peer.acall("PUT", f"/resource_providers/{rp}/inventories", body))[0] == 200
        await store.set_inventories(rp, {"VCPU": vcpu}, 0)
        for holder in range(3):  # 3 x 2 VCPU: capacity reached
            c, entry = str(uuid.uuid4()), {"allocations": {rp: {"resources": {"VCPU": 2}}}}
            entry |= {
                "project_id": "p",
                "user_id": "u",
                "consumer_type": "INSTANCE",
                "consumer_generation": None,
            }
            assert (await placement_peer.acall("PUT", f"/allocations/{c}", entry))[0] == 204, holder
            await allocate(store, c, {rp: {"VCPU": 2}}, project_id="p", user_id="u")
        for resources in refusals:
            c, entry = str(uuid.uuid4()), {"allocations": {rp: {"resources": resources}}}
            entry |= {
                "project_id": "p",
                "user_id": "u",
                "consumer_type": "INSTANCE",
                "consumer_generation": None,
            }
            status, answer = await placement_peer.acall("PUT", f"/allocations/{c}", entry)
            assert status == 409, (resources, answer)
            detail = answer["errors"][0]["detail"].split("\n\n", 1)[1].strip()
            with pytest.raises(EvstoreError) as caught:
                await allocate(store, c, {rp: resources}, project_id="p", user_id="u")
            assert evstore_kind(caught.value) == placement_kind(status, answer)
            assert caught.value.message.startswith(detail), (caught.value.message, detail)

    _run_side_by_side(scenario)


def test_inventory_and_provider_refusals_carry_placements_detail(placement_peer: PlacementPeer) -> None:
    """Regression (rev25, helper-i): refusals outside allocation writes lost facts Placement's detail
    gives. An unknown class in ``set_inventories`` said ``Unknown resource class in inventory:
    CUSTOM_X`` and ``reserved > total`` said ``Invalid inventory for VCPU: ...``, neither naming the
    provider; an unknown class in an allocation did not name the consumer (Placement's PUT does);
    deleting a missing provider dropped Placement's "for delete". Each refusal is made on both; the
    kind must agree and evstore's message must begin with Placement's detail (evstore may add
    amounts after it)."""
    rp, consumer, missing = str(uuid.uuid4()), str(uuid.uuid4()), str(uuid.uuid4())
    entry = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "consumer_generation": None}

    async def scenario(store: AllocationStore, tmp: Path) -> None:
        await asyncio.to_thread(placement_peer.reset, tmp / "placement.sqlite")
        await placement_peer.acall("POST", "/resource_providers", {"uuid": rp, "name": "rp"})
        await store.create_provider(rp, "rp")
        body = {"resource_provider_generation": 0, "inventories": {"VCPU": {"total": 4}}}
        assert (await placement_peer.acall("PUT", f"/resource_providers/{rp}/inventories", body))[0] == 200
        await store.set_inventories(rp, {"VCPU": {"total": 4}}, 0)
        unknown = {"VCPU": {"total": 4}, "CUSTOM_NEVER_CREATED": {"total": 1}}
        over = {"VCPU": {"total": 4, "reserved": 5}}
        allocation = {"allocations": {rp: {"resources": {"CUSTOM_NEVER_CREATED": 1}}}} | entry
        refusals: list[tuple[str, str, Any, Callable[[], Any]]] = [
            (
                "PUT",
                f"/resource_providers/{rp}/inventories",
                {"resource_provider_generation": 1, "inventories": unknown},
                lambda: store.set_inventories(rp, unknown, 1),
            ),
            (
                "PUT",
                f"/resource_providers/{rp}/inventories",
                {"resource_provider_generation": 1, "inventories": over},
                lambda: store.set_inventories(rp, over, 1),
            ),
            (
                "PUT",
                f"/allocations/{consumer}",
                allocation,
                lambda: allocate(
                    store, consumer, {rp: {"CUSTOM_NEVER_CREATED": 1}}, project_id="p", user_id="u"
                ),
            ),
            ("DELETE", f"/resource_providers/{missing}", None, lambda: store.delete_provider(missing)),
        ]
        for method, path, request, run in refusals:
            status, answer = await placement_peer.acall(method, path, request)
            assert status >= 400, (path, answer)
            detail = answer["errors"][0]["detail"].split("\n\n", 1)[1].strip()
            with pytest.raises(EvstoreError) as caught:
                await run()
            assert evstore_kind(caught.value) == placement_kind(status, answer), (path, caught.value)
            assert caught.value.message.startswith(detail), (caught.value.message, detail)

    _run_side_by_side(scenario)


def test_an_amount_above_max_int_is_refused_in_placements_check_order(placement_peer: PlacementPeer) -> None:
    """Regression (session 37, s37_A): an amount above 2**31-1 was refused up front as
    ``InvalidInput``, where Placement's schema takes any integer from 1 and its row check refuses
    it - after the consumer generations and the providers - as a constraint violation (no
    ``max_unit`` can be above 2**31-1). The first refusal of each request must be of one kind."""
    rp, missing = str(uuid.uuid4()), str(uuid.uuid4())
    huge = MAX_INT + 1
    entry = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}

    async def scenario(store: AllocationStore, tmp: Path) -> None:
        await asyncio.to_thread(placement_peer.reset, tmp / "placement.sqlite")
        await placement_peer.acall("POST", "/resource_providers", {"uuid": rp, "name": "rp"})
        await store.create_provider(rp, "rp")
        vast = {"MEMORY_MB": {"total": MAX_INT, "allocation_ratio": 4.0}, "VCPU": {"total": 4}}
        body = {"resource_provider_generation": 0, "inventories": vast}
        assert (await placement_peer.acall("PUT", f"/resource_providers/{rp}/inventories", body))[0] == 200
        await store.set_inventories(rp, vast, 0)
        cases = [  # (allocations, consumer generation): the refusal Placement reports first
            ({rp: {"MEMORY_MB": huge}}, None),  # above max_unit: constraint
            ({rp: {"VCPU": 1, "MEMORY_MB": 2**62}}, None),  # the second row decides
            ({rp: {"MEMORY_MB": huge}}, 3),  # the generation first: concurrent update
            ({missing: {"MEMORY_MB": huge}}, None),  # the provider first: it does not exist
            ({rp: {"DISK_GB": huge}}, None),  # no inventory of the class
        ]
        for allocations, generation in cases:
            c = str(uuid.uuid4())
            request = {"allocations": {p: {"resources": res} for p, res in allocations.items()}}
            request |= entry | {"consumer_generation": generation}
            status, answer = await placement_peer.acall("PUT", f"/allocations/{c}", request)
            await asyncio.to_thread(placement_peer.purge_orphans)  # (the 400 for a missing provider's)
            with pytest.raises(EvstoreError) as caught:
                await store.set_allocations(c, allocations, generation=generation, **entry)
            assert evstore_kind(caught.value) == placement_kind(status, answer), (allocations, answer)
            assert status >= 400
        assert await store.usage(rp) == {"MEMORY_MB": 0, "VCPU": 0}

    _run_side_by_side(scenario)


def test_inventory_in_use_refusals_carry_placements_detail(placement_peer: PlacementPeer) -> None:
    """Regression (session 37, s37_A): removing inventory in use said ``Inventory for 'DISK_GB,
    VCPU' on resource provider ... in use.``, where Placement's ``PUT .../inventories`` says
    ``update conflict: Inventory for 'VCPU, DISK_GB' ...`` (the classes in Placement's order, by
    resource class id: the standard ones as os-resource-classes lists them) and its ``DELETE
    .../inventories/{rc}`` ``Unable to delete inventory of class VCPU: Inventory for 'VCPU' ...``.
    The kind must agree and evstore's message must begin with Placement's detail."""
    rp = str(uuid.uuid4())
    invs = {"DISK_GB": {"total": 10}, "MEMORY_MB": {"total": 10}, "VCPU": {"total": 4}}

    async def scenario(store: AllocationStore, tmp: Path) -> None:
        await asyncio.to_thread(placement_peer.reset, tmp / "placement.sqlite")
        await placement_peer.acall("POST", "/resource_providers", {"uuid": rp, "name": "rp"})
        await store.create_provider(rp, "rp")
        body = {"resource_provider_generation": 0, "inventories": invs}
        assert (await placement_peer.acall("PUT", f"/resource_providers/{rp}/inventories", body))[0] == 200
        await store.set_inventories(rp, invs, 0)
        c, held = str(uuid.uuid4()), {"DISK_GB": 1, "VCPU": 1}
        entry = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "consumer_generation": None}
        request = {"allocations": {rp: {"resources": held}}} | entry
        assert (await placement_peer.acall("PUT", f"/allocations/{c}", request))[0] == 204
        await allocate(store, c, {rp: held}, project_id="p", user_id="u")
        left = {"MEMORY_MB": {"total": 10}}
        refusals: list[tuple[str, str, Any, Callable[[], Any]]] = [
            (
                "PUT",
                f"/resource_providers/{rp}/inventories",
                {"resource_provider_generation": 2, "inventories": left},
                lambda: store.set_inventories(rp, left, 2),
            ),
            (
                "PUT",
                f"/resource_providers/{rp}/inventories",
                {"resource_provider_generation": 2, "inventories": {}},
                lambda: store.set_inventories(rp, {}, 2),
            ),
            (
                "DELETE",
                f"/resource_providers/{rp}/inventories/VCPU",
                None,
                lambda: store.delete_inventory(rp, "VCPU"),
            ),
        ]
        for method, path, request, run in refusals:
            status, answer = await placement_peer.acall(method, path, request)
            assert status == 409, (path, answer)
            detail = answer["errors"][0]["detail"].split("\n\n", 1)[1].strip()
            with pytest.raises(EvstoreError) as caught:
                await run()
            assert evstore_kind(caught.value) == placement_kind(status, answer), (path, caught.value)
            assert caught.value.message.startswith(detail), (caught.value.message, detail)

    _run_side_by_side(scenario)


# --- regression tests for evstore bugs found by the differential test --------------------------------
# Each is the minimal case of a difference from Placement 16.0.0 (checked against the real app) and
# needs no Placement peer. Found by the first campaigns; fixed in evstore (inventory checks now run
# after the provider lookup and the generation). Placement's order for PUT .../inventories is:
# provider lookup (404), generation (409 concurrent_update), unknown class (400), reserved > total
# (400), class in use (409 placement.inventory.inuse).


async def test_regression_set_inventories_checks_generation_first_in_use(store: AllocationStore) -> None:
    """Stale generation AND removing a class in use: Placement answers 409 concurrent_update."""
    rp = await make_provider(store, VCPU=8, MEMORY_MB=16)
    await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
    with pytest.raises(ConcurrentUpdate):
        await store.set_inventories(rp, {"MEMORY_MB": {"total": 16}}, generation=9)  # current is 2


async def test_regression_set_inventories_checks_generation_first_unknown_class(
    store: AllocationStore,
) -> None:
    """Stale generation AND an unknown custom class: Placement answers 409 concurrent_update."""
    rp = await make_provider(store, VCPU=8)
    with pytest.raises(ConcurrentUpdate):
        await store.set_inventories(rp, {"CUSTOM_NEVER_CREATED": {"total": 1}}, generation=0)


async def test_regression_set_inventories_checks_generation_first_reserved_over_total(
    store: AllocationStore,
) -> None:
    """Stale generation AND reserved > total: Placement answers 409 concurrent_update (its 400 for
    reserved > total comes after the generation check)."""
    rp = await make_provider(store, VCPU=8)
    with pytest.raises(ConcurrentUpdate):
        await store.set_inventories(rp, {"VCPU": {"total": 4, "reserved": 5}}, generation=0)


async def test_regression_set_inventories_checks_provider_first_reserved_over_total(
    store: AllocationStore,
) -> None:
    with pytest.raises(ProviderNotFound):
        await store.set_inventories(new_uuid(), {"VCPU": {"total": 1, "reserved": 2}}, generation=0)


async def test_regression_revert_ignores_stale_attributes_of_absent_instance(store: AllocationStore) -> None:
    """Consumer ``a`` migrates away (absent), is then reused as another instance's migration
    consumer and emptied by a plain write (its state is kept for the migration link). Reverting
    ``a``'s own migration must not restore ``a`` as a MIGRATION of project ``pb``: ConsumerView
    shows nothing for an absent consumer, and Placement gets what the caller sends."""
    rp = await make_provider(store, VCPU=8)
    a, b, mig = new_uuid(), new_uuid(), new_uuid()
    await allocate(store, a, {rp: {"VCPU": 2}}, project_id="pa")
    await allocate(store, b, {rp: {"VCPU": 1}}, project_id="pb")
    await store.start_migration(a, mig)  # a is absent, mig holds VCPU 2 on behalf of a
    await store.start_migration(b, a)  # a reused as b's migration consumer
    await allocate(store, a, {}, generation=1, project_id="pb", consumer_type="MIGRATION")
    assert (await store.allocations(a)).consumer_type is None  # absent: nothing shown
    await store.revert_migration(mig)
    restored = await store.allocations(a)
    assert restored.allocations == {rp: {"VCPU": 2}}
    assert (restored.consumer_type, restored.project_id) == ("INSTANCE", "pa")


async def test_regression_an_amount_above_max_int_is_a_constraint_violation(store: AllocationStore) -> None:
    """Placement takes any integer amount from 1 and refuses one above every ``max_unit`` in its
    row checks, after the generations and the providers (see
    ``test_an_amount_above_max_int_is_refused_in_placements_check_order``); evstore refused it up
    front as ``InvalidInput``, so a stale generation or a missing provider was reported as bad input."""
    rp = await make_provider(store, MEMORY_MB=Inventory(total=MAX_INT, allocation_ratio=4.0))
    huge = MAX_INT + 1
    with pytest.raises(ConstraintViolation) as caught:
        await allocate(store, new_uuid(), {rp: {"MEMORY_MB": huge}})
    assert caught.value.details["amount"] == huge
    with pytest.raises(ConcurrentUpdate):
        await allocate(store, new_uuid(), {rp: {"MEMORY_MB": huge}}, generation=3)
    with pytest.raises(ProviderNotFound):
        await allocate(store, new_uuid(), {new_uuid(): {"MEMORY_MB": huge}})
    with pytest.raises(InvalidInventory):
        await allocate(store, new_uuid(), {rp: {"DISK_GB": huge}})
    assert await store.head() == 2  # (the provider and its inventory: nothing else)


async def test_regression_inventory_in_use_messages_begin_with_placements_detail(
    store: AllocationStore,
) -> None:
    """The classes in Placement's order (standard classes by their os-resource-classes index, so
    VCPU before DISK_GB) and its handlers' prefixes (see
    ``test_inventory_in_use_refusals_carry_placements_detail``)."""
    rp = await make_provider(store, DISK_GB=10, VCPU=4)
    await allocate(store, new_uuid(), {rp: {"DISK_GB": 1, "VCPU": 1}})
    with pytest.raises(InventoryInUse) as caught:
        await store.set_inventories(rp, {}, generation=2)
    assert (
        caught.value.message
        == f"update conflict: Inventory for 'VCPU, DISK_GB' on resource provider '{rp}' in use."
    )
    assert caught.value.details["resource_classes"] == ["DISK_GB", "VCPU"]  # (sorted, as they were)
    with pytest.raises(InventoryInUse) as caught:
        await store.delete_inventory(rp, "DISK_GB")
    in_use = f"Inventory for 'DISK_GB' on resource provider '{rp}' in use."
    assert caught.value.message == f"Unable to delete inventory of class DISK_GB: {in_use}"
