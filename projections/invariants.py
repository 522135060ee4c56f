"""Pure predicates over the folded state, shared by the command side and the audit."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from evstore.errors import shown
from projections.state import ConsumerState, ProviderState, State
from projections.views import sorted_holdings


@dataclass(frozen=True, slots=True)
class Leak:
    consumer: str
    #: what it holds, in key order at both levels (as state and diff show allocations)
    allocations: dict[str, dict[str, int]]
    reason: str
    #: the consumer's own tombstone if it is deleted, else that of the instance it holds for
    tombstone_position: int | None
    allocated_at: int | None
    #: the instance it holds for (a migration), as state and diff name it; None for no migration
    on_behalf_of: str | None = None


def clear_leak(consumer: str, deleted: bool) -> str:
    """How a leak is cleared today, as a clause of the messages that report one: the command of
    the evstore command line that releases what ``consumer`` holds, and the API call it makes. A
    deleted consumer's allocations are released; a deleted instance's migration is confirmed,
    which releases what it holds (as the refused revert of that migration says)."""
    command, call = ("release", "release") if deleted else ("confirm-migration", "confirm_migration")
    return f"clear it with `evstore {command} {consumer}` (store.{call}('{consumer}'))"


@dataclass(frozen=True, slots=True)
class OverCapacity:
    provider: str
    resource_class: str
    used: int
    capacity: float


#: a :class:`Leak`'s ``reason`` when the consumer itself is deleted
DELETED_REASON = "consumer is deleted"


def find_leaks(state: State) -> list[Leak]:
    """Allocations held by a tombstoned consumer, or by a migration whose instance is tombstoned."""
    return [leak for c in state.consumers.values() if (leak := leak_of(state, c)) is not None]


def leak_of(state: State, c: ConsumerState) -> Leak | None:
    """The leak ``c`` is in ``state``, if it is one (what the audit reports, and diff calls
    ``leaked``): allocations held while tombstoned, or held as a migration for an instance
    that is tombstoned."""
    if not c.allocations:
        return None
    if c.deleted:
        reason, tombstone = DELETED_REASON, c.deleted_at
    elif c.on_behalf_of is not None:
        inst = state.consumers.get(c.on_behalf_of)
        if inst is None or not inst.deleted:
            return None
        reason, tombstone = f"migration holds resources for deleted instance {inst.uuid}", inst.deleted_at
    else:
        return None
    held = sorted_holdings(c.allocations)
    return Leak(c.uuid, held, reason, tombstone, c.allocated_at, c.on_behalf_of)


def over_capacity(provider: ProviderState) -> list[OverCapacity]:
    found = []
    for rc, used in provider.usages.items():
        inv = provider.inventories.get(rc)
        capacity = inv.capacity if inv is not None else 0.0
        if used > capacity:
            found.append(OverCapacity(provider.uuid, rc, used, capacity))
    return found


def format_amount(value: float | int, digits: int | None = None) -> str:
    """An amount or a capacity for a message, exactly as it is compared: a whole number without a
    fraction (``12``, ``2147483646``), any other value with every digit it has (``7.700000000000001``),
    never rounded (``:g`` turned a capacity of 2147483646 into ``2.14748e+09``).

    ``digits``: a value worked out for the reader rather than compared (an overrun, ``used -
    capacity``) to that many significant digits, so that float arithmetic's last bits do not show
    (``0.3``, not ``0.3000000000000007``)."""
    if float(value).is_integer() and abs(value) < 2**53:  # (beyond, a float's repr is exact and shorter)
        return str(int(value))
    if digits is not None:
        return f"{value:.{digits}g}"
    return repr(value)


def allocation_fits(capacity: float, used_after: int, prev_used: int | None) -> bool:
    """Placement's capacity rule with its over-capacity tolerance.

    ``used_after`` is the usage once the command's rows so far are added to what remains after
    the command's consumers let go of their old allocations; ``prev_used`` is the usage before
    the command (``None`` when nothing was allocated). A change that leaves the provider no worse
    off than before is accepted even when it stays over capacity.
    """
    if capacity >= used_after:
        return True
    return prev_used is not None and used_after <= prev_used


@dataclass(frozen=True, slots=True)
class Impossible:
    """What an event sets that every command refuses to write (see :func:`impossible_event`)."""

    #: a stable name of the rule broken: ``reserved_above_total``, ``min_unit_above_max_unit``,
    #: ``own_parent``, ``parent_cycle``, ``root_mismatch``, ``own_migration``
    #: (``inventory_invalid`` for another of ``Inventory.problems``, should it name more); what
    #: only the log before the event makes impossible (:class:`LogMemory`): ``duplicate_name``,
    #: ``nothing_to_revert``, ``revert_more_than_held``, ``empty_revert``, ``nothing_to_release``,
    #: ``nothing_to_confirm``, ``nothing_to_delete``, ``other_instance``, ``not_a_migration``
    rule: str
    #: what is wrong, for a message (``inventory VCPU of provider P: reserved (5) is greater...``)
    what: str
    details: dict[str, object]
    #: the position of the earlier event that makes this one impossible, where one does (a
    #: migration's emptying, a provider's deletion or naming), for the positions a finding cites
    since: int | None = None


def impossible_event(state: State, event_type: str, fields: Any) -> Impossible | None:
    """What the event (``fields``: the decoded payload, read as attributes) sets that no command
    writes, in ``state`` as folded up to the event before it, or ``None``. A command refuses each of
    these: an inventory ``Inventory.problems`` names (reserved above total, min_unit above max_unit:
    ``InvalidInventoryValue``), a provider created as its own parent, or under a parent whose own
    parents lead back to it (a command's parent must exist, so no tree it builds has a cycle), or
    with another root than its parent's (itself, without a parent), a consumer that is its own
    migration (``start_migration`` refuses an instance that is its migration, and nothing else makes
    a consumer hold for one). An import refuses a log holding one (a log that was valid where it was
    written holds none) and the audit reports it. Not here: what a command accepts (a step_size that
    no amount between min_unit and max_unit meets; Placement accepts it too), and what only the
    events around it make wrong (allocations on a provider absent there, a parent created after its
    child): an older, Placement-style writer's log holds those, and every fold takes them. (What
    no command writes either, but only the events before it show - a name another live provider
    holds, a release, confirm or revert of what is not held, a revert giving nothing, a confirm
    or revert naming another instance than its migration's, or a consumer that is no migration, a
    deletion of a provider absent there -, an import refuses through :class:`LogMemory`.)"""
    check = IMPOSSIBLE_CHECKS.get(event_type)
    return None if check is None else check(state, fields)


def _inventories(state: State, fields: Any) -> Impossible | None:
    provider = fields.provider
    for rc, inv in fields.inventories.items():
        problems = inv.problems()
        if not problems:
            continue
        if inv.reserved > inv.total:
            rule = "reserved_above_total"
        elif inv.min_unit > inv.max_unit:
            rule = "min_unit_above_max_unit"
        else:  # pragma: no cover - (Inventory.problems names no other)
            rule = "inventory_invalid"
        return Impossible(
            rule,
            f"inventory {rc} of provider {provider}: {'; '.join(problems)}",
            {"provider": provider, "resource_class": rc},
        )
    return None


def _provider_created(state: State, fields: Any) -> Impossible | None:
    provider, parent, root = fields.provider, fields.parent, fields.root
    if parent is None:
        if root != provider:
            return _root_mismatch(provider, f"root {root}, where a provider without a parent is its own root")
        return None
    if parent == provider:
        return Impossible(
            "own_parent", f"provider {provider} is created as its own parent", {"provider": provider}
        )
    # (up from the parent: O(depth), each provider met once)
    chain, seen = [provider, parent], {provider, parent}
    at = above = state.providers.get(parent)
    while at is not None and at.parent is not None and at.parent not in seen:
        chain.append(at.parent)
        seen.add(at.parent)
        at = state.providers.get(at.parent)
    if at is not None and at.parent == provider:
        more = " ..." if len(chain) > 10 else ""
        return Impossible(
            "parent_cycle",
            f"provider {provider} is created under {parent}, whose parents lead back to it "
            f"(a parent cycle: {' -> '.join([*chain[:10], provider])}{more})",
            {"provider": provider, "parent": parent},
        )
    if above is not None and root != above.root:  # (a parent absent here: an older writer's order)
        return _root_mismatch(
            provider, f"root {root}, where its parent {parent}'s root is {above.root}", parent=parent
        )
    return None


def _root_mismatch(provider: str, what: str, **details: object) -> Impossible:
    return Impossible(
        "root_mismatch", f"provider {provider} is created with {what}", {"provider": provider, **details}
    )


def _own_migration(consumer: str) -> Impossible:
    return Impossible(
        "own_migration",
        f"consumer {consumer} is its own migration (holds allocations on its own behalf)",
        {"consumer": consumer},
    )


def _migration(state: State, fields: Any) -> Impossible | None:
    return _own_migration(fields.migration) if fields.instance == fields.migration else None


def _held_for(state: State, fields: Any) -> Impossible | None:
    instance = fields.on_behalf_of
    return _own_migration(fields.consumer) if instance is not None and instance == fields.consumer else None


def _consumer_deleted(state: State, fields: Any) -> Impossible | None:
    if fields.consumer in fields.migrations_released:
        return _own_migration(fields.consumer)
    return _held_for(state, fields)


#: the check of each event type that may set what no command writes (see :func:`impossible_event`);
#: the audit looks a type up here, for the ~0.4 us a call of that function costs every event
IMPOSSIBLE_CHECKS: dict[str, Callable[[State, Any], Impossible | None]] = {
    "InventoriesReplaced": _inventories,
    "ProviderCreated": _provider_created,
    "MigrationStarted": _migration,
    "MigrationReverted": _migration,
    "MigrationConfirmed": _migration,
    "AllocationsReplaced": _held_for,
    "AllocationsReleased": _held_for,
    "ConsumerDeleted": _consumer_deleted,
}


# --- what only the log before an event makes impossible ------------------------------------------
#
# Each command refuses these from what the store holds when it runs: a log that was valid where it
# was written holds none. Unlike the checks above, each needs what the log did before the event (a
# name another live provider holds, what a consumer holds, a provider's earlier deletion): the
# import keeps that beside its fold (:class:`LogMemory`), the audit beside its own. Each costs an
# event of its type a dict lookup or two (a revert compares two small mappings): no scan.
# Not here, still imported (the audit reports them): allocations on a provider absent there, a
# provider deleted while it is in use, an event naming a provider absent there other than its
# deletion - an older, Placement-style writer's log holds those -, nor a revert of a migration
# holding nothing, giving allocations to its own instance deleted there (README's legacy example:
# that writer's late revert, bug 1848343, which the audit reports as the leak it makes).


Allocations = dict[str, dict[str, int]]


def _emptied(position: int | None) -> str:
    return f" (emptied at position {position})" if position else ""


def nothing_to_release(state: State, fields: Any, gone: Mapping[str, int]) -> Impossible | None:
    """An ``AllocationsReleased`` of a consumer holding nothing (``release`` refuses it:
    ``evstore.not_found``, a tombstoned consumer included; Placement's DELETE answers 404)."""
    c = state.consumers.get(fields.consumer)
    if c is not None and c.allocations:
        return None
    at = c.allocated_at if c is not None else None
    return Impossible(
        "nothing_to_release",
        f"consumer {fields.consumer} holds nothing there{_emptied(at)}, yet it is released "
        "(release refuses a consumer holding nothing: evstore.not_found)",
        {"consumer": fields.consumer, "emptied_at": at},
        at,
    )


def nothing_to_confirm(state: State, fields: Any, gone: Mapping[str, int]) -> Impossible | None:
    """A ``MigrationConfirmed`` of a migration holding nothing (``confirm_migration`` refuses it:
    ``evstore.not_found``, or ``evstore.consumer.deleted`` when its instance or itself is deleted)."""
    mig = state.consumers.get(fields.migration)
    if mig is not None and mig.allocations:
        return None
    at = mig.allocated_at if mig is not None else None
    return Impossible(
        "nothing_to_confirm",
        f"migration {fields.migration} of instance {fields.instance} holds nothing there{_emptied(at)}, "
        "yet it is confirmed (confirm_migration refuses a migration holding nothing: evstore.not_found)",
        {"migration": fields.migration, "instance": fields.instance, "emptied_at": at},
        at,
    )


def _beyond(given: Mapping[str, Mapping[str, int]], held: Mapping[str, Mapping[str, int]]) -> Allocations:
    """What ``given`` holds beyond ``held``, by provider and class (in key order)."""
    beyond: Allocations = {}
    for provider, amounts in given.items():
        had = held.get(provider, {})
        more = {rc: n - had.get(rc, 0) for rc, n in amounts.items() if n > had.get(rc, 0)}
        if more:
            beyond[provider] = more
    return sorted_holdings(beyond)


def revert_beyond_held(state: State, fields: Any, gone: Mapping[str, int]) -> Impossible | None:
    """A ``MigrationReverted`` giving its instance allocations its migration did not hold there, or
    giving it nothing: ``revert_migration`` gives back exactly what the migration holds, and
    refuses one holding nothing (``evstore.not_found``), so no evstore wrote a revert with empty
    allocations. Allocations from nowhere, no capacity checked for them: ``nothing_to_revert``
    (the migration held nothing; reverted with nothing too, it is that rule's as well) or
    ``revert_more_than_held``; ``empty_revert``: what the migration held, and what its instance
    held, dropped without a release. A revert of a migration holding nothing, giving allocations
    to an instance deleted there, is not one: an older, Placement-style writer's late revert,
    whose leak the audit reports (README's legacy example)."""
    given = fields.allocations
    mig = state.consumers.get(fields.migration)
    held: Mapping[str, Mapping[str, int]] = mig.allocations if mig is not None else {}
    if given == held and given:
        return None
    migration, instance = fields.migration, fields.instance
    if not held:
        if given:
            inst = state.consumers.get(instance)
            if inst is not None and inst.deleted:
                return None
            what = f"it gives instance {instance} {shown(dict(given), 200)}: allocations from nowhere, no "
            what += "capacity checked for them"
        else:
            what = f"it is reverted, giving instance {instance} nothing"
        at = mig.allocated_at if mig is not None else None
        return Impossible(
            "nothing_to_revert",
            f"migration {migration} held nothing there{_emptied(at)}, yet {what} "
            "(revert_migration refuses a migration holding nothing: evstore.not_found)",
            {
                "migration": migration,
                "instance": instance,
                "allocations": {p: dict(res) for p, res in given.items()},
                "emptied_at": at,
            },
            at,
        )
    if not given:
        assert mig is not None  # (it holds what it held)
        return Impossible(
            "empty_revert",
            f"migration {migration} held {shown(sorted_holdings(held), 200)} there, yet its revert gives "
            f"instance {instance} nothing: what the migration held vanishes, and what the instance held "
            "with it, neither released (revert_migration gives back exactly what the migration holds)",
            {"migration": migration, "instance": instance, "held": sorted_holdings(held)},
            mig.allocated_at,
        )
    beyond = _beyond(given, held)
    if not beyond:
        return None  # (less than it held: the rest is released, nothing made)
    return Impossible(
        "revert_more_than_held",
        f"migration {migration} held {shown(sorted_holdings(held), 200)} there, yet it gives instance "
        f"{instance} {shown(dict(given), 200)}: {shown(beyond, 200)} beyond what it held, from nowhere, "
        "no capacity checked for it (revert_migration gives back exactly what the migration holds)",
        {
            "migration": migration,
            "instance": instance,
            "allocations": {p: dict(res) for p, res in given.items()},
            "held": sorted_holdings(held),
            "beyond": beyond,
        },
        mig.allocated_at if mig is not None else None,
    )


def not_its_migration(
    state: State, event_type: str, fields: Any, unlinked: Mapping[str, str]
) -> Impossible | None:
    """A ``MigrationConfirmed`` or ``MigrationReverted`` naming another instance than the one its
    migration holds for there (``other_instance``: ``confirm_migration`` and ``revert_migration``
    name the instance the migration consumer was started for, whatever the caller says), or naming
    as a migration a consumer holding allocations for no instance (``not_a_migration``: both refuse
    it, ``evstore.not_found``). Asked once the held rules (:func:`nothing_to_confirm`,
    :func:`revert_beyond_held`) let the event pass: a migration holding nothing is theirs (and the
    legacy late revert to a deleted instance stays imported, but for another instance than its
    migration's). ``unlinked``: each consumer whose link to an instance only a plain write
    emptying it dropped, and that instance (``LogMemory.unlinked``): evstore's first version
    kept that link, so its confirm or revert of such a consumer, refilled since, named that
    instance."""
    migration, instance = fields.migration, fields.instance
    mig = state.consumers.get(migration)
    if mig is None:
        return None
    what = "confirmed" if event_type == "MigrationConfirmed" else "reverted"
    command = "confirm_migration" if event_type == "MigrationConfirmed" else "revert_migration"
    link = mig.on_behalf_of
    if link is not None:
        if link == instance:
            return None
        return Impossible(
            "other_instance",
            f"migration {migration} holds its allocations for instance {link} there, yet it is {what} "
            f"for instance {instance} ({command} acts on the instance the migration was started for)",
            {"migration": migration, "instance": instance, "held_for": link},
        )
    if not mig.allocations or unlinked.get(migration) == instance:
        return None
    return Impossible(
        "not_a_migration",
        f"consumer {migration} holds {shown(sorted_holdings(mig.allocations), 200)} there for no instance "
        f"(allocated at position {mig.allocated_at}): no migration, yet it is {what} as the migration "
        f"of instance {instance} ({command} refuses a consumer that is no migration: evstore.not_found)",
        {
            "migration": migration,
            "instance": instance,
            "held": sorted_holdings(mig.allocations),
            "allocated_at": mig.allocated_at,
        },
        mig.allocated_at,
    )


def nothing_to_delete(state: State, fields: Any, gone: Mapping[str, int]) -> Impossible | None:
    """A ``ProviderDeleted`` of a provider absent there: deleted before (and not created again),
    or never created (``delete_provider`` refuses it: ``placement.resource_provider.not_found``;
    Placement's DELETE answers 404). ``gone``: each provider deleted so far, by the position of
    its last deletion."""
    provider = fields.provider
    if provider in state.providers:
        return None
    at = gone.get(provider)
    why = f"deleted at position {at} and not created again" if at is not None else "never created"
    return Impossible(
        "nothing_to_delete",
        f"provider {provider} is deleted, which does not exist there ({why}; delete_provider refuses "
        "a provider that does not exist)",
        {"provider": provider, "deleted_at": at},
        at,
    )


#: the check of each event type that only the log before it can make impossible (see
#: :class:`LogMemory`), but for a provider's name (the import's :meth:`LogMemory.check`, the
#: audit's own index): ``(state, fields, gone)``
HELD_CHECKS: dict[str, Callable[[State, Any, Mapping[str, int]], Impossible | None]] = {
    "AllocationsReleased": nothing_to_release,
    "MigrationConfirmed": nothing_to_confirm,
    "MigrationReverted": revert_beyond_held,
    "ProviderDeleted": nothing_to_delete,
}


def duplicate_name(provider: str, name: str, holder: str, named_at: int) -> Impossible:
    """``provider`` given ``name``, which the live provider ``holder`` holds since ``named_at``
    (``create_provider`` and ``rename_provider`` refuse it: ``placement.duplicate_name``)."""
    return Impossible(
        "duplicate_name",
        f"provider {provider} is given the name {shown(name)}, which provider {holder} holds (named at "
        f"position {named_at}): two providers of one name (a command refuses a name another provider "
        "holds: placement.duplicate_name)",
        {"provider": provider, "name": name, "holder": holder, "holder_named_at": named_at},
        named_at,
    )


#: the event types :meth:`LogMemory.check` looks at (or notes): a check of a log skips the call for
#: every other type (most of a log: allocations; a plain write emptying a consumer goes to
#: :meth:`LogMemory.emptied`)
REMEMBERED_TYPES = frozenset(HELD_CHECKS) | {"ProviderCreated", "ProviderUpdated"}

#: the event types that end a migration, whose instance :func:`not_its_migration` checks
MIGRATION_ENDS = frozenset({"MigrationConfirmed", "MigrationReverted"})


@dataclass(slots=True)
class LogMemory:
    """What a check of a log in order keeps beside its fold to find an event that only the events
    before it make impossible (:data:`HELD_CHECKS`, a name another live provider holds, a confirm
    or revert of another instance or of no migration): each name a live provider holds, each
    provider deleted, and each migration link a plain write dropped. One entry per live provider,
    per provider deleted and per consumer so unlinked, none per event.

    An import stops at the first event found (``shared`` ``None``): that event is not noted, as
    it is not folded. The audit goes on (``shared`` a dict): each event is noted whatever is
    found, and a name held by more than one live provider is followed to its other holders."""

    #: each name a live provider holds: a provider holding it, and the position it took the name at
    names: dict[str, tuple[str, int]] = field(default_factory=dict)
    #: each provider deleted so far, and the position of its last deletion
    gone: dict[str, int] = field(default_factory=dict)
    #: each consumer whose link to the instance it held for only a plain write emptying it
    #: dropped, and that instance, until it is released, confirmed or reverted (see
    #: :func:`not_its_migration`): one entry per such consumer
    unlinked: dict[str, str] = field(default_factory=dict)
    #: (going on past what is found) the other live providers holding a name too, by name, each
    #: with the position it took it at (only a damaged or imported log has any)
    shared: dict[str, dict[str, int]] | None = None

    def check(self, state: State, event_type: str, fields: Any, position: int) -> Impossible | None:
        """What the event (in ``state``, folded up to the event before it) does that no command
        does there, or ``None``; and what it changes of the names, deletions and links is noted
        (stopping at what is found: only if ``None``). Call it once per event of
        :data:`REMEMBERED_TYPES`, in order, before its fold (and :meth:`emptied` for a plain
        write emptying a consumer)."""
        held = HELD_CHECKS.get(event_type)
        found = None if held is None else held(state, fields, self.gone)
        if found is not None and self.shared is None:
            return found
        if event_type in MIGRATION_ENDS:
            if found is None:
                found = not_its_migration(state, event_type, fields, self.unlinked)
                if found is None:
                    self.unlinked.pop(fields.migration, None)
        elif event_type == "AllocationsReleased":
            self.unlinked.pop(fields.consumer, None)
        elif event_type == "ProviderCreated":
            return self._name(state, fields.provider, fields.name, position)
        elif event_type == "ProviderUpdated":
            prov = state.providers.get(fields.provider)
            if prov is not None and prov.name != fields.name:  # (absent: the fold skips it)
                return self._name(state, fields.provider, fields.name, position)
        elif event_type == "ProviderDeleted":
            self._unname(state, fields.provider)
            self.gone[fields.provider] = position
        return found

    def emptied(self, state: State, consumer: str) -> None:
        """A plain write (``AllocationsReplaced``) empties ``consumer``: a link to the instance it
        held for, which the fold drops there, is noted (see :func:`not_its_migration`). Called only
        for such a write (rare: most of a log is allocations), which is all :meth:`check` would
        look at in an ``AllocationsReplaced``."""
        c = state.consumers.get(consumer)
        if c is not None and c.on_behalf_of is not None:
            self.unlinked[consumer] = c.on_behalf_of

    def _name(self, state: State, provider: str, name: str, position: int) -> Impossible | None:
        held = self.names.get(name)
        if held is not None and held[0] != provider and self.shared is None:
            return duplicate_name(provider, name, held[0], held[1])
        self._unname(state, provider)  # (its old name: renamed, or created again while it exists)
        held = self.names.get(name)
        if held is None or self.shared is None:  # (stopping at a clash: none is left here)
            self.names[name] = (provider, position)
            return None
        self.shared.setdefault(name, {})[provider] = position
        return duplicate_name(provider, name, held[0], held[1])

    def _unname(self, state: State, provider: str) -> None:
        """``provider`` (live) is about to lose its name (deleted, renamed or created again): the
        index forgets it; a name another provider holds too passes to that one."""
        prov = state.providers.get(provider)
        if prov is None:
            return
        name, names, shared = prov.name, self.names, self.shared
        others = None if shared is None else shared.get(name)
        held = names.get(name)
        if held is not None and held[0] == provider:
            if others:
                names[name] = others.popitem()
            else:
                del names[name]
        elif others is not None:
            others.pop(provider, None)
        if shared is not None and others is not None and not others:
            del shared[name]
