"""The folded state and the one fold, :func:`evolve`.

The write path (on the small slice of state a command touches), rebuild, time travel and the
audit all fold events with this same function, so they cannot disagree.
``State`` may hold the whole store or just the entities one command needs.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from evstore import events as ev
from evstore.schema import Inventory

Allocs = dict[str, dict[str, int]]
#: An event's fields as attributes (see :data:`FOLDS`): an event model, or the struct a replay
#: decodes straight from the stored JSON.
Payload = Any


@dataclass(slots=True)
class ProviderState:
    uuid: str
    name: str
    parent: str | None
    root: str
    generation: int = 0
    inventories: dict[str, Inventory] = field(default_factory=dict)
    #: used amount per class; only classes with a non-zero usage appear.
    usages: dict[str, int] = field(default_factory=dict)

    def usage_view(self) -> dict[str, int]:
        """Placement's view: one key per inventory class, 0 where unused."""
        return {rc: self.usages.get(rc, 0) for rc in self.inventories}


@dataclass(slots=True)
class ConsumerState:
    uuid: str
    project_id: str | None = None
    user_id: str | None = None
    consumer_type: str | None = None
    #: ``None`` while the consumer holds nothing (absent, in Placement's words).
    generation: int | None = None
    allocations: Allocs = field(default_factory=dict)
    #: tombstone: permanent, never compacted away.
    deleted: bool = False
    deleted_at: int | None = None
    #: for a migration consumer: the instance it holds (or held) resources for.
    on_behalf_of: str | None = None
    #: position of the event that last changed this consumer's allocations.
    allocated_at: int | None = None
    #: for a migration consumer: the consumer type its instance had when the migration started
    #: (a revert gives it back to an instance that is absent by then, and so forgotten).
    instance_type: str | None = None

    @property
    def absent(self) -> bool:
        return not self.allocations

    def worth_keeping(self) -> bool:
        """Absent consumers are forgotten (as Placement does) unless they carry a tombstone or a link."""
        return bool(self.allocations) or self.deleted or self.on_behalf_of is not None


@dataclass(slots=True)
class State:
    position: int = 0
    providers: dict[str, ProviderState] = field(default_factory=dict)
    consumers: dict[str, ConsumerState] = field(default_factory=dict)
    custom_classes: set[str] = field(default_factory=set)
    #: set by a bulk fold of the whole store (replay, rebuild): providers' ``usages`` are not kept
    #: up to date event by event but recounted once at the end (:meth:`recount_usages`).
    usages_deferred: bool = False
    #: while usages are deferred: providers deleted so far (see :meth:`recount_usages`)
    deferred_gone: set[str] = field(default_factory=set, compare=False, repr=False)
    #: a persisted projection's stored project usage counters, where its backend keeps them
    #: (``persisted.project_usage_totals`` of the consumers, as stored; the audit checks them)
    project_usages: dict[tuple[str, str, str], tuple[int, dict[str, int]]] | None = field(
        default=None, compare=False, repr=False
    )
    #: set to a list by the audit: each release the fold kept from taking a provider's usage below
    #: zero - ``(position, provider, resource class, amount never counted)`` - (see :func:`_add_usage`)
    uncounted: list[tuple[int, str, str, int]] | None = field(default=None, compare=False, repr=False)

    def copy(self) -> State:
        return copy.deepcopy(self)

    def consumer(self, uuid: str) -> ConsumerState:
        """The consumer, or a fresh absent one (not stored)."""
        found = self.consumers.get(uuid)
        return found if found is not None else ConsumerState(uuid)

    def migrations_for(self, instance: str) -> list[ConsumerState]:
        return [c for c in self.consumers.values() if c.on_behalf_of == instance and c.allocations]

    def recount_usages(self) -> None:
        """Set every provider's usage to the sum of the allocations held on it, and go back to
        keeping it event by event.

        A bulk fold of the whole store defers the usage (``usages_deferred``): adding and
        subtracting every allocation as events go by is ~40% of a replay's fold, summing what is
        held at the end is one pass over the consumers. The two agree as long as every allocation
        names a provider that exists, and stays, while it is held - always so in a log ``decide``
        wrote. A log that breaks this (an import of a buggy writer's log: an allocation naming a
        provider not created yet or deleted, a provider created twice or created again after
        its deletion) makes the deferred fold recount at that event, before folding it, and
        continue event by event, so every fold gives the same numbers as :func:`evolve`.
        """
        for prov in self.providers.values():
            prov.usages = {}
        providers = self.providers
        for c in self.consumers.values():
            if c.allocations:
                _add_usage(providers, c.allocations)
        self.usages_deferred = False
        self.deferred_gone = set()


def dismantle(*states: State | None) -> None:
    """Empty whole states an entry at a time: run on a thread (``asyncio.to_thread``) by the bulk
    folds for the states they are done with.

    Freeing a whole state in one go - its dict of consumers dropped - is C code that holds the
    GIL from start to end (30-55 ms for 78,000 consumers), which the event loop waits for,
    whichever thread drops it; emptied in Python, the interpreter hands the GIL over every few
    milliseconds. (A state returned by a database thread is also referenced there until its next
    job, which then freed it: emptied, what is left is small.)"""
    for state in states:
        if state is None:
            continue
        for table in (state.consumers, state.providers, state.project_usages or {}):
            pop = table.popitem
            while table:
                pop()


def _add_usage(providers: dict[str, ProviderState], allocs: Allocs) -> None:
    """Count ``allocs`` in the providers' usages (see :func:`_take_usage`)."""
    for provider, resources in allocs.items():
        prov = providers.get(provider)
        if prov is None:
            # Replay of a log written by a buggy writer may reference a deleted provider: keep
            # folding (the audit reports it) rather than crash.
            continue
        usages = prov.usages
        for rc, amount in resources.items():
            used = usages.get(rc, 0) + amount
            if used > 0:
                usages[rc] = used
            else:  # (no amount is below 1: see _take_usage)
                usages.pop(rc, None)


def _take_usage(state: State, allocs: Allocs, position: int) -> None:
    """Take the allocations a consumer held until ``position`` (``allocs``) out of the providers'
    usages - never below zero: a usage is a sum of allocations. Only a log no command wrote takes
    away what a provider never counted - allocations held since before it was created, or created
    again (the audit's ``usage_not_held``) - and a count of -1 let commands put capacity + 1 on
    it; 0 is again what is held there once they are released. (A stored usage below zero is
    therefore damage: ``persisted`` refuses it.) What was never counted is noted in
    ``state.uncounted`` where it is a list (the audit's, which reports it)."""
    providers = state.providers
    for provider, resources in allocs.items():
        prov = providers.get(provider)
        if prov is None:
            continue  # (as _add_usage)
        usages = prov.usages
        for rc, amount in resources.items():
            used = usages.get(rc, 0) - amount
            if used > 0:
                usages[rc] = used
            else:
                usages.pop(rc, None)
                if used and state.uncounted is not None:
                    state.uncounted.append((position, provider, rc, -used))


def _set_allocations(state: State, consumer: str, allocs: Allocs, position: int) -> ConsumerState:
    c = state.consumers.get(consumer)
    if c is None:
        c = state.consumers[consumer] = ConsumerState(consumer)
    if state.usages_deferred and allocs and not allocs.keys() <= state.providers.keys():
        state.recount_usages()  # an allocation on a provider the state does not have: see there
    if not state.usages_deferred:
        if c.allocations:
            _take_usage(state, c.allocations, position)
        if allocs:
            _add_usage(state.providers, allocs)
    # Shared with the (frozen) event, never mutated in place: state changes replace the dict.
    c.allocations = allocs
    c.allocated_at = position
    return c


def _bump(state: State, generations: dict[str, int]) -> None:
    for provider, generation in generations.items():
        prov = state.providers.get(provider)
        if prov is not None:
            prov.generation = generation


def _forget_if_empty(state: State, c: ConsumerState) -> None:
    # ConsumerState.worth_keeping, inlined: this runs for most events of a replay
    if not (c.allocations or c.deleted or c.on_behalf_of is not None):
        state.consumers.pop(c.uuid, None)


#: Project, user and consumer type are labels shared by many consumers: each decoded payload carries
#: its own copies of them (msgspec, unlike pydantic's string cache, does not share equal strings), and a
#: state that kept them all held 765k strings (35 MiB) at 255k consumers. Interned, each label is kept once.
_label = sys.intern

# One small fold per event type, found by the event's class (a dict lookup instead of walking a
# chain of isinstance checks: replay, rebuild and the audit run this for every event).


def _allocations_replaced(state: State, e: Payload, position: int) -> None:
    allocs = e.allocations
    c = _set_allocations(state, e.consumer, allocs, position)
    c.project_id, c.user_id = _label(e.project_id), _label(e.user_id)
    c.consumer_type = _label(e.consumer_type)
    if e.provider_generations:
        _bump(state, e.provider_generations)
    if allocs:
        c.generation = e.generation
    else:
        # emptied by a plain write (e.g. Nova's move_allocations): no longer holding
        # anything for anyone
        c.generation = None
        c.on_behalf_of = c.instance_type = None
        _forget_if_empty(state, c)


def _allocations_released(state: State, e: Payload, position: int) -> None:
    c = _set_allocations(state, e.consumer, {}, position)
    c.generation = None
    c.on_behalf_of = c.instance_type = None
    _forget_if_empty(state, c)


def _migration_started(state: State, e: Payload, position: int) -> None:
    inst = _set_allocations(state, e.instance, {}, position)
    inst.generation = None
    inst.project_id, inst.user_id = _label(e.project_id), _label(e.user_id)
    inst.consumer_type = _label(e.instance_consumer_type)
    mig = _set_allocations(state, e.migration, e.allocations, position)
    mig.project_id, mig.user_id = inst.project_id, inst.user_id
    mig.consumer_type = _label(e.migration_consumer_type)
    mig.generation = e.migration_generation
    mig.on_behalf_of = e.instance
    mig.instance_type = inst.consumer_type
    _bump(state, e.provider_generations)
    _forget_if_empty(state, inst)


def _migration_reverted(state: State, e: Payload, position: int) -> None:
    mig = _set_allocations(state, e.migration, {}, position)
    mig.generation = None
    mig.on_behalf_of = mig.instance_type = None
    inst = _set_allocations(state, e.instance, e.allocations, position)
    inst.project_id, inst.user_id = _label(e.project_id), _label(e.user_id)
    inst.consumer_type = _label(e.instance_consumer_type)
    inst.generation = e.instance_generation
    _bump(state, e.provider_generations)
    _forget_if_empty(state, mig)
    _forget_if_empty(state, inst)


def _migration_confirmed(state: State, e: Payload, position: int) -> None:
    mig = _set_allocations(state, e.migration, {}, position)
    mig.generation = None
    mig.on_behalf_of = mig.instance_type = None
    _forget_if_empty(state, mig)


def _consumer_deleted(state: State, e: Payload, position: int) -> None:
    c = _set_allocations(state, e.consumer, {}, position)
    c.generation = None
    if not c.deleted:
        # (the tombstone is the first delete: an older writer's log may delete it again, which
        # this evstore does not record, and that second one did not delete it)
        c.deleted_at = position
    c.deleted = True
    for migration in e.migrations_released:
        # The link is kept: a later revert of this migration must learn that its
        # instance is gone (ConsumerDeleted), not that the migration is unknown.
        m = _set_allocations(state, migration, {}, position)
        m.generation = None


def _inventories_replaced(state: State, e: Payload, position: int) -> None:
    prov = state.providers.get(e.provider)
    if prov is None:
        # Only a damaged or imported log names a provider that does not exist here: keep folding
        # (the audit reports the event) rather than crash every reader of the log.
        return
    prov.inventories = dict(e.inventories)
    prov.generation = e.generation


def _provider_created(state: State, e: Payload, position: int) -> None:
    if state.usages_deferred and (e.provider in state.providers or e.provider in state.deferred_gone):
        state.recount_usages()  # created twice, or again after its deletion: see there
    state.providers[e.provider] = ProviderState(uuid=e.provider, name=e.name, parent=e.parent, root=e.root)


def _provider_updated(state: State, e: Payload, position: int) -> None:
    prov = state.providers.get(e.provider)
    if prov is not None:  # (as _inventories_replaced)
        prov.name = e.name


def _provider_deleted(state: State, e: Payload, position: int) -> None:
    state.providers.pop(e.provider, None)
    if state.usages_deferred:
        state.deferred_gone.add(e.provider)


def _resource_class_created(state: State, e: Payload, position: int) -> None:
    state.custom_classes.add(e.name)


#: The fold of each event type, by its ``type`` name. A fold reads the event's fields as attributes:
#: of the model (``evolve``) or of the msgspec struct a replay decodes straight from the stored JSON
#: (``evstore.events.PAYLOAD_DECODERS``) - the same fields, so one fold serves both. (Read as a dict,
#: which each struct had to be turned into, ~0.5 us of a replay's ~2.6 us per event.)
FOLDS: dict[str, Callable[[State, Payload, int], None]] = {
    "AllocationsReplaced": _allocations_replaced,
    "AllocationsReleased": _allocations_released,
    "MigrationStarted": _migration_started,
    "MigrationReverted": _migration_reverted,
    "MigrationConfirmed": _migration_confirmed,
    "ConsumerDeleted": _consumer_deleted,
    "InventoriesReplaced": _inventories_replaced,
    "ProviderCreated": _provider_created,
    "ProviderUpdated": _provider_updated,
    "ProviderDeleted": _provider_deleted,
    "ResourceClassCreated": _resource_class_created,
}
assert set(FOLDS) == set(ev.EVENT_TYPES), "every event type needs a fold"


def evolve(state: State, event: ev.EventBase, position: int) -> State:
    """Fold one event into ``state`` (in place, for speed) and return it."""
    fold_one = FOLDS.get(event.__dict__.get("type", ""))
    if fold_one is None:
        raise TypeError(f"evolve does not know {type(event).__name__}")
    state.position = position
    fold_one(state, event, position)
    return state


def evolve_noting_providers(state: State, event: ev.EventBase, position: int) -> set[str]:
    """:func:`evolve`, returning the providers on which the fold changed what a consumer holds.

    evstore's own events name every such provider in their payload (``entities()``); an
    imported log's need not (a version-1 AllocationsReplaced has no ``previous``; another writer's
    revert or delete may list other providers than the consumer held): history and diff take
    these from the fold itself.
    """
    fold_one = FOLDS.get(event.__dict__.get("type", ""))
    if fold_one is None:
        raise TypeError(f"evolve does not know {type(event).__name__}")
    return fold_noting_providers(state, fold_one, event, position)


def fold_noting_providers(
    state: State, fold_one: Callable[[State, Payload, int], None], fields: Payload, position: int
) -> set[str]:
    """:func:`evolve_noting_providers` on an event's fields (as a replay decodes them)."""
    consumers = [
        c for f in ("consumer", "instance", "migration") if (c := getattr(fields, f, None)) is not None
    ]
    consumers += list(getattr(fields, "migrations_released", None) or ())
    held = state.consumers
    before = {c: held[c].allocations if c in held else {} for c in consumers}
    state.position = position
    fold_one(state, fields, position)
    changed: set[str] = set()
    for c, was in before.items():
        now = held[c].allocations if c in held else {}
        if now is not was:  # (allocations are replaced, never changed in place)
            changed.update(p for p in was.keys() | now.keys() if was.get(p) != now.get(p))
    return changed


def fold(events: list[tuple[int, ev.EventBase]], state: State | None = None) -> State:
    state = state if state is not None else State()
    for position, event in events:
        evolve(state, event, position)
    return state
