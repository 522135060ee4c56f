"""Pure predicates over the folded state, shared by the command side and the audit."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
    #: (``inventory_invalid`` for another of ``Inventory.problems``, should it name more)
    rule: str
    #: what is wrong, for a message (``inventory VCPU of provider P: reserved (5) is greater...``)
    what: str
    details: dict[str, object]


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
    child): an older, Placement-style writer's log holds those, and every fold takes them."""
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
