"""Commands and the pure decision: ``decide(command, state) -> events`` or a typed error.

``decide`` never does I/O. The store loads the slice of state a command needs (see
:func:`needs`), calls ``decide``, appends the events and folds them with
:func:`projections.state.evolve`. Tests of business rules call ``decide`` directly:
given events, when command, then events or error.
"""

from __future__ import annotations

from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import NoReturn

from evstore import errors as err
from evstore import events as ev
from evstore.schema import (
    CUSTOM_PREFIX,
    STANDARD_CLASSES,
    Inventory,
    is_known_class,
    placement_class_order,
    where,
)
from projections.invariants import allocation_fits, format_amount
from projections.state import ConsumerState, ProviderState, State
from projections.views import sorted_holdings

Allocs = dict[str, dict[str, int]]


# --- commands ---------------------------------------------------------------------------------


# A refusal that needs no state is made where the command is made (``__post_init__``): a malformed
# argument is refused before the command is queued (README), not after it waited its turn behind
# the writer - up to busy_timeout for another process's write lock, to come back as a storage
# error saying "retry" - or by a closed store as StoreClosed.


@dataclass(frozen=True, slots=True)
class CreateResourceClass:
    name: str

    def __post_init__(self) -> None:
        name = self.name
        if not name.startswith(CUSTOM_PREFIX) or name == CUSTOM_PREFIX or name in STANDARD_CLASSES:
            # (Placement's pattern for a custom class: ^CUSTOM_[A-Z0-9_]+$)
            raise err.InvalidInput(
                f"Custom resource classes must be {CUSTOM_PREFIX} followed by at least one of A-Z, 0-9 "
                f"or _: {name}",
                field="name",
            )


@dataclass(frozen=True, slots=True)
class CreateProvider:
    provider: str
    name: str
    parent: str | None = None

    def __post_init__(self) -> None:
        if self.parent is not None and self.parent == self.provider:
            # (Placement's detail, its ObjectActionError's words included)
            raise err.InvalidInput(
                f'Unable to create resource provider "{self.name}", {self.provider}: Object action create '
                "failed because: parent provider UUID cannot be same as UUID. Please set parent provider "
                "UUID to None if there is no parent. (A resource provider cannot be its own parent.)",
                field="parent",
            )


@dataclass(frozen=True, slots=True)
class RenameProvider:
    provider: str
    name: str


@dataclass(frozen=True, slots=True)
class DeleteProvider:
    provider: str


@dataclass(frozen=True, slots=True)
class SetInventories:
    provider: str
    inventories: dict[str, Inventory]
    generation: int


@dataclass(frozen=True, slots=True)
class SetInventory:
    """Update or add one class (Placement's PUT /inventories/{rc}, with generation check)."""

    provider: str
    resource_class: str
    inventory: Inventory
    generation: int


@dataclass(frozen=True, slots=True)
class DeleteInventory:
    """Remove one class (Placement's DELETE /inventories/{rc}: no generation check)."""

    provider: str
    resource_class: str


@dataclass(frozen=True, slots=True)
class ConsumerWrite:
    consumer: str
    allocations: Allocs
    project_id: str
    user_id: str
    consumer_type: str
    generation: int | None


@dataclass(frozen=True, slots=True)
class WriteAllocations:
    consumers: tuple[ConsumerWrite, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for w in self.consumers:
            if w.consumer in seen:
                raise err.InvalidInput(
                    f"Consumer {w.consumer} appears twice in one command",
                    consumer=w.consumer,
                    **where("allocations", ["allocations", w.consumer]),
                )
            seen.add(w.consumer)


@dataclass(frozen=True, slots=True)
class Release:
    consumer: str


@dataclass(frozen=True, slots=True)
class StartMigration:
    instance: str
    migration: str

    def __post_init__(self) -> None:
        if self.instance == self.migration:
            raise err.InvalidInput("instance and migration must be different consumers", field="migration")


@dataclass(frozen=True, slots=True)
class RevertMigration:
    migration: str


@dataclass(frozen=True, slots=True)
class ConfirmMigration:
    migration: str


@dataclass(frozen=True, slots=True)
class DeleteConsumer:
    consumer: str


Command = (
    CreateResourceClass
    | CreateProvider
    | RenameProvider
    | DeleteProvider
    | SetInventories
    | SetInventory
    | DeleteInventory
    | WriteAllocations
    | Release
    | StartMigration
    | RevertMigration
    | ConfirmMigration
    | DeleteConsumer
)


#: what a command does not need (shared: most of a command's ``Needs`` are empty)
_NOTHING: frozenset[str] = frozenset()


@dataclass(slots=True)
class Needs:
    """What slice of state a command's decision reads (the store loads exactly this).

    Read-only sets; what a command does not need is one shared empty set: a queued command's
    ``Needs`` lives until its group commit is done, and its six sets were about a fifth of what
    the 64-task benchmark's commands had the cyclic collector promote to its oldest generation
    (and so of its full collections)."""

    consumers: AbstractSet[str] = _NOTHING
    providers: AbstractSet[str] = _NOTHING
    provider_names: AbstractSet[str] = _NOTHING
    children_of: AbstractSet[str] = _NOTHING
    migrations_of: AbstractSet[str] = _NOTHING
    resource_classes: AbstractSet[str] = _NOTHING


def needs(command: Command) -> Needs:
    """The entities ``decide`` reads for ``command``, before following consumers' allocations.

    The loader adds the providers of every loaded consumer's allocations and the consumers linked
    by migrations, so this only names the entry points.
    """
    match command:
        case CreateResourceClass():
            return Needs(resource_classes={command.name})
        case CreateProvider():
            providers = {command.provider, command.parent} if command.parent else {command.provider}
            return Needs(providers=providers, provider_names={command.name})
        case RenameProvider():
            return Needs(providers={command.provider}, provider_names={command.name})
        case DeleteProvider():
            return Needs(providers={command.provider}, children_of={command.provider})
        case SetInventories():
            return Needs(providers={command.provider}, resource_classes=set(command.inventories))
        case SetInventory() | DeleteInventory():
            return Needs(providers={command.provider}, resource_classes={command.resource_class})
        case WriteAllocations():
            consumers: set[str] = set()
            providers = set()
            classes: set[str] = set()
            for cw in command.consumers:
                consumers.add(cw.consumer)
                providers.update(cw.allocations)
                for resources in cw.allocations.values():
                    classes.update(resources)
            return Needs(consumers=consumers, providers=providers, resource_classes=classes)
        case Release():
            return Needs(consumers={command.consumer})
        case StartMigration():
            return Needs(consumers={command.instance, command.migration})
        case RevertMigration() | ConfirmMigration():
            return Needs(consumers={command.migration})
        case DeleteConsumer():
            return Needs(consumers={command.consumer}, migrations_of={command.consumer})
    return Needs()


# --- decisions --------------------------------------------------------------------------------


def decide(command: Command, state: State) -> list[ev.EventBase]:
    """Return the events ``command`` produces against ``state``, or raise a typed error."""
    match command:
        case WriteAllocations():
            return _write_allocations(state, list(command.consumers))
        case Release():
            return _release(state, command)
        case StartMigration():
            return _start_migration(state, command)
        case RevertMigration():
            return _revert_migration(state, command)
        case ConfirmMigration():
            return _confirm_migration(state, command)
        case DeleteConsumer():
            return _delete_consumer(state, command)
        case SetInventories():
            return _set_inventories(state, command.provider, command.inventories, command.generation)
        case SetInventory():
            prov = _provider(state, command.provider)
            inventories = dict(prov.inventories)
            inventories[command.resource_class] = command.inventory
            # only the class being set is checked: the others are stored, so known and valid (and
            # the slice names only this class: the loader does not know the others' custom classes)
            return _set_inventories(
                state, command.provider, inventories, command.generation, {command.resource_class}
            )
        case DeleteInventory():
            return _delete_inventory(state, command)
        case CreateProvider():
            return _create_provider(state, command)
        case RenameProvider():
            return _rename_provider(state, command)
        case DeleteProvider():
            return _delete_provider(state, command)
        case CreateResourceClass():
            return _create_resource_class(state, command)
    raise err.InvalidInput(f"Unknown command {type(command).__name__}")  # pragma: no cover


def _provider(state: State, uuid: str) -> ProviderState:
    prov = state.providers.get(uuid)
    if prov is None:
        raise err.ProviderNotFound(f"No resource provider with uuid {uuid} found", provider=uuid)
    return prov


def _generation_conflict(
    expected: int | None, got: int | None, consumer: str, why: str = ""
) -> err.ConcurrentUpdate:
    # Placement's wording: "expected" is the stored generation, "got" what the caller sent;
    # ``why`` follows it where the caller sent no generation (a command that takes none).
    exp = "null" if expected is None else str(expected)
    return err.ConcurrentUpdate(
        f"consumer generation conflict - expected {exp} but got {got}{why}",
        consumer=consumer,
        expected=expected,
        got=got,
    )


def _check_consumer_generation(c: ConsumerState, given: int | None) -> None:
    if c.deleted:
        raise err.ConsumerDeleted(
            f"Consumer {c.uuid} was deleted at position {c.deleted_at}; "
            "no allocations can be written for it any more",
            consumer=c.uuid,
            deleted_at=c.deleted_at,
        )
    if c.generation != given:
        raise _generation_conflict(c.generation, given, c.uuid)


def _check_instance_alive(state: State, migration: ConsumerState) -> None:
    """A migration holds its allocations for its instance: once the instance is tombstoned, a write
    that gives the migration allocations would hold them for a deleted consumer (a leak)."""
    assert migration.on_behalf_of is not None
    inst = state.consumer(migration.on_behalf_of)
    if inst.deleted:
        raise err.ConsumerDeleted(
            f"Consumer {migration.uuid} is a migration of instance {inst.uuid}, which was deleted at "
            f"position {inst.deleted_at}; no allocations can be written for it any more",
            consumer=inst.uuid,
            migration=migration.uuid,
            deleted_at=inst.deleted_at,
        )


@dataclass(slots=True)
class _Change:
    """One consumer's replacement inside an allocation command (shared by writes and migrations)."""

    consumer: str
    new: Allocs
    #: ``False`` skips the generation check (the command already checked its own preconditions).
    check_generation: bool = True
    generation: int | None = None


def _held(consumer: ConsumerState) -> Allocs:
    """What a consumer holds, in the order ``allocations()`` shows it, for the rows and payloads
    of the commands that take it from the state: the state holds it in the order it was folded
    or loaded in (a write's order in the SQLite writer's cache, sorted when read from either
    database), so one command named another class in a refusal, and recorded another payload
    text, by backend and by cache."""
    return sorted_holdings(consumer.allocations)


def _check_and_plan(state: State, changes: list[_Change], written: bool = False) -> list[str]:
    """Placement's check order for a replace of several consumers at once.

    Returns the providers named by the command's rows, in first-seen order (each gets one
    generation bump). Raises the first error Placement would report. ``written``: the changes
    are a ``WriteAllocations``' (an unknown class is named where ``write_allocations``' argument
    has it; ``set_allocations`` shortens the path to its own argument's).
    """
    # 1. generations of all consumers, in the order given.
    for ch in changes:
        c = state.consumer(ch.consumer)
        if ch.check_generation:
            _check_consumer_generation(c, ch.generation)
            if ch.new and c.on_behalf_of is not None:
                _check_instance_alive(state, c)
        elif c.deleted:
            _check_consumer_generation(c, c.generation)
    # Rows: new allocations; a consumer being emptied contributes its current ones at amount 0.
    rows: list[tuple[str, str, int]] = []
    for ch in changes:
        if ch.new:
            rows.extend((p, rc, amt) for p, res in ch.new.items() for rc, amt in res.items())
        else:
            current = _held(state.consumer(ch.consumer))
            rows.extend((p, rc, 0) for p, res in current.items() for rc in res)
    named: list[str] = list(dict.fromkeys(p for p, _, _ in rows))
    # 2. every provider named exists.
    for p in named:
        if p not in state.providers:
            raise err.ProviderNotFound(
                f"Allocation for resource provider '{p}' that does not exist.", provider=p
            )
    # 3. every class named exists.
    classes = list(dict.fromkeys(rc for _, rc, _ in rows))
    for rc in classes:
        if not is_known_class(rc, state.custom_classes) and not _in_use(state, rc, changes, named):
            # (Placement's PUT /allocations/{c} wording, naming the first consumer asking for it)
            asking, provider = next(
                ((ch.consumer, p) for ch in changes for p, res in ch.new.items() if rc in res),
                (changes[0].consumer, None),
            )
            at = {}
            if written and provider is not None:
                at = where("allocations", ["allocations", asking, "allocations", provider, rc])
            raise err.UnknownResourceClass(
                f"Unable to allocate inventory for consumer {asking}: No such resource class {rc}.",
                resource_class=rc,
                consumer=asking,
                **at,
            )
    # 4. every provider has inventory of at least one class of the command.
    class_set = set(classes)
    missing = [p for p in named if not class_set & state.providers[p].inventories.keys()]
    if missing:
        raise err.InvalidInventory(
            f"Unable to allocate inventory: Inventory for '{_listed(classes, 'resource_classes')}' on "
            f"resource provider '{_listed(missing, 'providers')}' invalid.",
            providers=missing,
            resource_classes=classes,
        )
    # 5. row by row: inventory, constraints, capacity (after the old allocations are removed).
    prev_used: dict[tuple[str, str], int] = {}
    used: dict[tuple[str, str], int] = {}
    for p, rc, _ in rows:
        u = state.providers[p].usages.get(rc, 0)
        prev_used[(p, rc)] = u
        used[(p, rc)] = u
    for ch in changes:
        for p, res in state.consumer(ch.consumer).allocations.items():
            for rc, amt in res.items():
                if (p, rc) in used:
                    used[(p, rc)] -= amt
    running: dict[tuple[str, str], int] = {}
    for p, rc, amount in rows:
        key = (p, rc)
        running[key] = running.get(key, 0) + amount
        if amount == 0:
            continue
        inv = state.providers[p].inventories.get(rc)
        if inv is None:
            raise err.InvalidInventory(
                f"Unable to allocate inventory: Inventory for '{rc}' on resource provider '{p}' invalid.",
                provider=p,
                resource_class=rc,
                # (the keys of the refusal above, where several providers or classes can be named)
                providers=[p],
                resource_classes=[rc],
            )
        if amount < inv.min_unit or amount > inv.max_unit or amount % inv.step_size:
            raise err.ConstraintViolation(
                f"Unable to allocate inventory: Unable to create allocation for '{rc}' on resource "
                f"provider '{p}'. The requested amount would violate inventory constraints. "
                f"(min_unit {inv.min_unit}, max_unit {inv.max_unit}, step_size {inv.step_size}; "
                f"requested {amount})",
                provider=p,
                resource_class=rc,
                amount=amount,
                min_unit=inv.min_unit,
                max_unit=inv.max_unit,
                step_size=inv.step_size,
            )
        capacity = inv.capacity
        # Placement refuses when capacity < used + amount or < used + running sum; the running
        # sum includes this row, so the second test implies the first.
        if not allocation_fits(capacity, used[key] + running[key], prev_used[key] or None):
            before = prev_used[key]
            # (over capacity already, e.g. after an inventory shrink: Placement's tolerance accepts a
            # change that leaves the usage no higher than before; say so, or 10 looks as hopeless as 12)
            tolerance = (
                f"; the provider is already over capacity, so only a change that leaves its {rc} "
                f"usage at or below {before}, its usage before this command, is accepted"
                if before > capacity
                else ""
            )
            raise err.CapacityExceeded(
                f"Unable to allocate inventory: Unable to create allocation for '{rc}' on resource "
                f"provider '{p}'. "
                f"The requested amount would exceed the capacity. "
                f"(capacity {format_amount(capacity)}, used {used[key]}, requested {running[key]}"
                f"{tolerance})",
                provider=p,
                resource_class=rc,
                capacity=capacity,
                used=used[key],
                requested=running[key],
                used_before=before,
            )
    return named


def _bumps(state: State, named: list[str], already: set[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for p in named:
        if p not in already:
            already.add(p)
            out[p] = state.providers[p].generation + 1
    return out


def _named_by(ch: _Change, state: State) -> list[str]:
    return list(ch.new) if ch.new else sorted(state.consumer(ch.consumer).allocations)


def _write_allocations(state: State, writes: list[ConsumerWrite]) -> list[ev.EventBase]:
    # (a consumer named twice was refused when the command was made: WriteAllocations.__post_init__)
    changes = [_Change(w.consumer, w.allocations, True, w.generation) for w in writes]
    named = _check_and_plan(state, changes, written=True)
    move = _as_move(state, writes)
    if move is not None:
        src, to = move
        return [_migration_started(state, src, to.consumer, to.consumer_type, named)]
    events: list[ev.EventBase] = []
    bumped: set[str] = set()
    for w, ch in zip(writes, changes, strict=True):
        c = state.consumer(w.consumer)
        if not w.allocations and not c.allocations:
            continue  # emptying an absent consumer: nothing happens, no orphan is created
        new_gen = None if not w.allocations else (c.generation or 0) + 1
        events.append(
            ev.AllocationsReplaced(
                consumer=w.consumer,
                allocations=w.allocations,
                previous=_held(c),
                project_id=w.project_id,
                user_id=w.user_id,
                consumer_type=w.consumer_type,
                generation=new_gen,
                provider_generations=_bumps(state, _named_by(ch, state), bumped),
                on_behalf_of=c.on_behalf_of,
            )
        )
    return events


def _as_move(state: State, writes: list[ConsumerWrite]) -> tuple[ConsumerState, ConsumerWrite] | None:
    """A plain write that is a move (SPEC: the same invariants apply): what Nova's
    ``move_allocations`` sends - one consumer emptied, and exactly its allocations given, for the
    same project and user, to another consumer that holds nothing. It is recorded as a
    ``MigrationStarted``: the target then holds them on the source's behalf, so deleting the source
    releases them, and a revert or confirm works on it as on any migration. The source's and the
    target's outcome (allocations, generations, provider generations) is the same as the plain
    write's. Anything else (more consumers, other amounts, a source that is itself a migration)
    stays a plain write."""
    if len(writes) != 2:
        return None
    emptied = [w for w in writes if not w.allocations]
    filled = [w for w in writes if w.allocations]
    if len(emptied) != 1 or len(filled) != 1:
        return None
    src, to = state.consumer(emptied[0].consumer), filled[0]
    dst = state.consumer(to.consumer)
    if not src.allocations or src.on_behalf_of is not None or src.deleted:
        return None
    if dst.allocations or dst.on_behalf_of is not None or dst.deleted:
        return None
    if to.allocations != src.allocations or (to.project_id, to.user_id) != (src.project_id, src.user_id):
        return None
    return src, to


def _release(state: State, command: Release) -> list[ev.EventBase]:
    c = state.consumer(command.consumer)
    if not c.allocations:
        # SPEC: NotFound when it holds nothing, a tombstoned consumer included (it never can).
        gone = f" (deleted at position {c.deleted_at})" if c.deleted else ""
        raise err.NotFound(
            f"No allocations for consumer '{c.uuid}'{gone}",
            consumer=c.uuid,
            deleted=c.deleted,
            deleted_at=c.deleted_at,  # (ConsumerDeleted's key for the tombstone's position)
        )
    return [ev.AllocationsReleased(consumer=c.uuid, released=_held(c), on_behalf_of=c.on_behalf_of)]


def _start_migration(state: State, command: StartMigration) -> list[ev.EventBase]:
    # (an instance that is its own migration was refused when the command was made)
    inst = state.consumer(command.instance)
    mig = state.consumer(command.migration)
    if inst.deleted:
        _check_consumer_generation(inst, inst.generation)
    if mig.deleted:
        _check_consumer_generation(mig, None)
    if mig.on_behalf_of is not None and mig.on_behalf_of != inst.uuid and not mig.allocations:
        # the migration of an instance deleted since: refused as a write to it is (a late revert
        # of that instance's migration must not find it holding another instance's allocations);
        # one still holding some (only in an imported leaking log) is a generation conflict first,
        # as Placement's check order has it
        _check_instance_alive(state, mig)
    if not inst.allocations:
        raise err.NotFound(
            f"Instance {inst.uuid} holds no allocations to move to migration {mig.uuid}",
            consumer=inst.uuid,
            migration=mig.uuid,
        )
    if mig.allocations:
        raise _generation_conflict(
            mig.generation,
            None,
            mig.uuid,
            f": the migration consumer {mig.uuid} already holds allocations; start_migration needs "
            "one that holds nothing",
        )
    if inst.on_behalf_of is not None:
        raise err.InvalidInput(
            f"Consumer {inst.uuid} is itself a migration; it cannot be migrated", field="instance"
        )
    changes = [_Change(inst.uuid, {}, False), _Change(mig.uuid, _held(inst), False)]
    named = _check_and_plan(state, changes)
    return [_migration_started(state, inst, mig.uuid, "MIGRATION", named)]


def _migration_started(
    state: State, inst: ConsumerState, migration: str, migration_type: str, named: list[str]
) -> ev.MigrationStarted:
    """Every allocation of ``inst`` moved to the (empty) consumer ``migration``, held for ``inst``."""
    assert inst.generation is not None and inst.project_id and inst.user_id
    return ev.MigrationStarted(
        instance=inst.uuid,
        migration=migration,
        allocations=_held(inst),
        project_id=inst.project_id,
        user_id=inst.user_id,
        instance_consumer_type=inst.consumer_type or "INSTANCE",
        instance_generation=inst.generation,
        migration_consumer_type=migration_type,
        migration_generation=1,
        provider_generations=_bumps(state, named, set()),
    )


def _migration_and_instance(
    state: State, migration: str, giving_back: bool = True
) -> tuple[ConsumerState, ConsumerState]:
    """The migration and its instance; ``giving_back``: the command gives the migration's
    allocations to the instance (a revert), which a tombstoned instance must refuse. A confirm only
    releases them, which frees what a deleted instance's migration may still hold (a log written
    before this rule, or imported)."""
    mig = state.consumer(migration)
    if mig.deleted:
        held = (
            "it still holds allocations: a leak" if mig.allocations else "whatever it held was released then"
        )
        raise err.ConsumerDeleted(
            f"Consumer {migration} was deleted at position {mig.deleted_at} ({held}): there is no "
            f"migration of it to {'revert' if giving_back else 'confirm'}",
            consumer=migration,
            migration=migration,  # (as the refusal for a deleted instance names it)
            deleted_at=mig.deleted_at,
        )
    if mig.on_behalf_of is None:
        raise err.NotFound(
            f"Consumer {migration} holds no allocations for a migration in progress", consumer=migration
        )
    inst = state.consumer(mig.on_behalf_of)
    if inst.deleted and (giving_back or not mig.allocations):
        # (a confirm of a deleted instance's migration still holding allocations releases them)
        if not giving_back:
            why = "has nothing left to confirm (its allocations were released with the instance)"
        elif mig.allocations:  # (a log written before delete released migrations, or imported)
            why = (
                "cannot give allocations back to it; it still holds them (the delete did not "
                f"release them): confirm migration {migration} to release them"
            )
        else:
            why = "cannot give allocations back to it (they were released with the instance)"
        raise err.ConsumerDeleted(
            f"Instance {inst.uuid} was deleted at position {inst.deleted_at}; "
            f"its migration {migration} {why}",
            consumer=inst.uuid,
            migration=migration,
            deleted_at=inst.deleted_at,
        )
    if not mig.allocations:
        raise err.NotFound(f"Migration {migration} holds no allocations", consumer=migration)
    if giving_back and inst.on_behalf_of is not None:
        # The instance was taken as the migration consumer of another instance since (its uuid
        # given to start_migration, or a move written into it): giving it allocations would
        # replace what it holds for that instance, or, that instance deleted, leak them.
        # (whether that instance is deleted is not known here: a command loads one link of the
        # chain. Deleted, its migration can be neither reverted nor confirmed - both refused as
        # ConsumerDeleted - and only a confirm of this migration releases what it holds.)
        then = (
            f"revert or confirm migration {inst.uuid} first; if instance {inst.on_behalf_of} was "
            f"deleted, neither can run any more: confirm migration {migration} to release what it holds"
        )
        raise err.InvalidInput(
            f"Instance {inst.uuid} of migration {migration} is itself the migration consumer of "
            f"instance {inst.on_behalf_of}; it cannot take allocations back while it is one ({then})",
            consumer=inst.uuid,
            migration=migration,
            on_behalf_of=inst.on_behalf_of,
            field="migration",
        )
    return mig, inst


def _revert_migration(state: State, command: RevertMigration) -> list[ev.EventBase]:
    mig, inst = _migration_and_instance(state, command.migration)
    changes = [_Change(mig.uuid, {}, False), _Change(inst.uuid, _held(mig), False)]
    named = _check_and_plan(state, changes)
    assert mig.project_id and mig.user_id
    # Nova's move_allocations(migration -> instance) writes the instance with the project and
    # user of the migration (the source of the move), whatever the instance holds (destination
    # allocations claimed for another project, say): Placement then counts the allocations given
    # back under the migration's project. The consumer type is not sent (microversion 1.28), so
    # an instance holding allocations keeps its own; an absent instance's remembered attributes
    # are leftovers, not facts: the migration carries the type it took over from the instance.
    holding = bool(inst.allocations)
    return [
        ev.MigrationReverted(
            migration=mig.uuid,
            instance=inst.uuid,
            allocations=_held(mig),
            replaced=_held(inst),
            project_id=mig.project_id,
            user_id=mig.user_id,
            instance_consumer_type=(inst.consumer_type if holding else mig.instance_type) or "INSTANCE",
            instance_generation=(inst.generation or 0) + 1,
            provider_generations=_bumps(state, named, set()),
        )
    ]


def _confirm_migration(state: State, command: ConfirmMigration) -> list[ev.EventBase]:
    mig, inst = _migration_and_instance(state, command.migration, giving_back=False)
    return [ev.MigrationConfirmed(migration=mig.uuid, instance=inst.uuid, released=_held(mig))]


def _delete_consumer(state: State, command: DeleteConsumer) -> list[ev.EventBase]:
    c = state.consumer(command.consumer)
    if c.deleted:
        return []  # a tombstone is permanent; deleting again changes nothing
    return [
        ev.ConsumerDeleted(
            consumer=c.uuid,
            released=_held(c),
            migrations_released={
                m.uuid: _held(m) for m in sorted(state.migrations_for(c.uuid), key=lambda m: m.uuid)
            },
            on_behalf_of=c.on_behalf_of,
        )
    ]


def _in_use(state: State, rc: str, changes: list[_Change], named: list[str]) -> bool:
    """Whether a class is held by a consumer of the command or stocked by a provider it names.

    Classes are never deleted, so such a class exists. A backend loads the custom classes a
    command names, not those it only carries along: emptying, migrating or reverting a consumer
    that holds ``CUSTOM_*`` resources names none of them (each row comes from what is held).
    """
    if any(rc in state.providers[p].inventories for p in named):
        return True
    return any(rc in res for ch in changes for res in state.consumer(ch.consumer).allocations.values())


def _inventory_where(rc: str, single: bool, what: str = "inventory") -> dict[str, object]:
    """Where an inventory refusal is in the arguments: ``set_inventory``'s (``single``) ``what``
    (``inventory`` or ``resource_class``), or ``set_inventories``' ``inventories`` at ``rc``."""
    return where(what) if single else where("inventories", ["inventories", rc])


def _check_inventories(
    state: State, provider: str, inventories: dict[str, Inventory], single: bool = False
) -> None:
    """Placement's order after the generation: reserved above total (Placement checks each
    record's capacity as it reads the body), then unknown classes. The messages begin with
    Placement's detail for the same refusal. (What only evstore refuses comes after everything
    Placement checks, the classes in use too: see :func:`_check_sanity`.)"""
    for rc, inv in inventories.items():
        if inv.reserved > inv.total:
            problems = "; ".join(inv.problems())
            _refuse_inventory(
                provider,
                rc,
                inv,
                f"Invalid inventory for '{rc}' on resource provider '{provider}'. "
                f"The reserved value is greater than total. ({problems})",
                single,
            )
    for rc in inventories:
        if not is_known_class(rc, state.custom_classes):
            raise err.UnknownResourceClass(
                f"Unknown resource class in inventory for resource provider {provider}: "
                f"No such resource class {rc}.",
                provider=provider,
                resource_class=rc,
                **_inventory_where(rc, single, "resource_class"),
            )


def _check_sanity(provider: str, inventories: dict[str, Inventory], single: bool = False) -> None:
    """evstore's own refusals (``min_unit > max_unit``), which Placement accepts: checked last, so
    that a command Placement refuses is refused for Placement's reason."""
    for rc, inv in inventories.items():
        if inv.problems():
            problems = "; ".join(inv.problems())
            _refuse_inventory(
                provider,
                rc,
                inv,
                f"Invalid inventory for '{rc}' on resource provider '{provider}': {problems}",
                single,
            )


def _refuse_inventory(provider: str, rc: str, inv: Inventory, what: str, single: bool) -> NoReturn:
    raise err.InvalidInventoryValue(
        f"Unable to update inventory for resource provider {provider}: {what}",
        provider=provider,
        resource_class=rc,
        problems=inv.problems(),
        **_inventory_where(rc, single),
    )


#: the most names a refusal's message lists (Placement's wording joins them all: 10,000 classes
#: or providers made a message, and its ``command.rejected`` log line, of 170-370 KB)
_MOST_LISTED = 20


def _listed(names: list[str], key: str) -> str:
    """``names`` joined as Placement's messages join them, the first ``_MOST_LISTED`` of a longer
    list followed by how many more, and the ``details`` key that holds them all."""
    if len(names) <= _MOST_LISTED:
        return ", ".join(names)
    more = len(names) - _MOST_LISTED
    return f'{", ".join(names[:_MOST_LISTED])}, ... and {more} more (all in details["{key}"])'


def _set_inventories(
    state: State,
    provider: str,
    inventories: dict[str, Inventory],
    generation: int,
    changed: set[str] | None = None,
) -> list[ev.EventBase]:
    """Replace the provider's inventory; ``changed``: the classes to check (default: all)."""
    # Placement's order: provider generation, then unknown classes, then classes in use.
    prov = _provider(state, provider)
    if prov.generation != generation:
        raise err.ConcurrentUpdate(
            f"resource provider generation conflict - expected {prov.generation} but got {generation}",
            provider=provider,
            expected=prov.generation,
            got=generation,
        )
    checked = inventories if changed is None else {rc: inventories[rc] for rc in changed}
    _check_inventories(state, provider, checked, changed is not None)
    removed_in_use = sorted(rc for rc in prov.inventories if rc not in inventories and prov.usages.get(rc))
    if removed_in_use:
        named = _listed(sorted(removed_in_use, key=placement_class_order), "resource_classes")
        raise err.InventoryInUse(  # (Placement's PUT .../inventories detail)
            f"update conflict: Inventory for '{named}' on resource provider '{provider}' in use.",
            provider=provider,
            resource_classes=removed_in_use,
        )
    _check_sanity(provider, checked, changed is not None)
    return [
        ev.InventoriesReplaced(provider=provider, inventories=inventories, generation=prov.generation + 1)
    ]


def _delete_inventory(state: State, command: DeleteInventory) -> list[ev.EventBase]:
    prov = _provider(state, command.provider)
    rc = command.resource_class
    if rc not in prov.inventories:
        raise err.NotFound(
            f"No inventory of class {rc} found for delete", provider=prov.uuid, resource_class=rc
        )
    if prov.usages.get(rc):
        raise err.InventoryInUse(  # (Placement's DELETE .../inventories/{rc} detail)
            f"Unable to delete inventory of class {rc}: Inventory for '{rc}' on resource provider "
            f"'{prov.uuid}' in use.",
            provider=prov.uuid,
            resource_class=rc,
            resource_classes=[rc],  # (the key set_inventories' refusal names them by)
        )
    inventories = {k: v for k, v in prov.inventories.items() if k != rc}
    return [
        ev.InventoriesReplaced(provider=prov.uuid, inventories=inventories, generation=prov.generation + 1)
    ]


def _name_taken(state: State, name: str, other_than: str | None = None) -> bool:
    return any(p.name == name and p.uuid != other_than for p in state.providers.values())


def _create_provider(state: State, command: CreateProvider) -> list[ev.EventBase]:
    # (Placement's order: the parent, then uniqueness)
    root = command.provider
    if command.parent is not None:
        # (the refusals begin with Placement's detail for them, its ObjectActionError's words included;
        # a provider that is its own parent was refused when the command was made)
        cannot = (
            f'Unable to create resource provider "{command.name}", {command.provider}: '
            "Object action create failed because: "
        )
        parent = state.providers.get(command.parent)
        if parent is None:
            raise err.ProviderNotFound(
                f"{cannot}parent provider UUID does not exist. (The parent provider {command.parent} of "
                f"resource provider {command.provider} does not exist.)",
                provider=command.parent,
            )
        root = parent.root
    duplicates = [f"uuid: {command.provider}"] if command.provider in state.providers else []
    if _name_taken(state, command.name):
        duplicates.append(f"name: {command.name}")
    if duplicates:  # (Placement's wording on create: the column(s) and the value(s) taken)
        raise err.DuplicateName(
            f"Conflicting resource provider {', '.join(duplicates)} already exists.",
            provider=command.provider,
            name=command.name,
        )
    return [
        ev.ProviderCreated(provider=command.provider, name=command.name, parent=command.parent, root=root)
    ]


def _rename_provider(state: State, command: RenameProvider) -> list[ev.EventBase]:
    prov = _provider(state, command.provider)
    if prov.name == command.name:
        return []
    if _name_taken(state, command.name, command.provider):
        raise err.DuplicateName(
            f"Conflicting resource provider {command.name} already exists.",
            provider=command.provider,
            name=command.name,
        )
    return [ev.ProviderUpdated(provider=prov.uuid, name=command.name)]


def _delete_provider(state: State, command: DeleteProvider) -> list[ev.EventBase]:
    prov = state.providers.get(command.provider)
    if prov is None:  # (Placement's DELETE wording)
        raise err.ProviderNotFound(
            f"No resource provider with uuid {command.provider} found for delete", provider=command.provider
        )
    # (Placement's order: children first, then allocations)
    if any(p.parent == prov.uuid for p in state.providers.values()):
        raise err.CannotDeleteParent(
            f"Unable to delete parent resource provider {prov.uuid}: It has child resource providers.",
            provider=prov.uuid,
        )
    if prov.usages:
        raise err.ProviderInUse(
            f"Unable to delete resource provider {prov.uuid}: Resource provider has allocations.",
            provider=prov.uuid,
        )
    return [ev.ProviderDeleted(provider=prov.uuid, parent=prov.parent)]


def _create_resource_class(state: State, command: CreateResourceClass) -> list[ev.EventBase]:
    # (a name that is no custom class was refused when the command was made)
    if command.name in state.custom_classes:
        return []
    return [ev.ResourceClassCreated(name=command.name)]
