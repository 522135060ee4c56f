"""Backend-neutral pieces of the persisted projection.

A backend loads the slice of state a command needs into a :class:`State`, folds the command's
events into it with the shared ``evolve``, and writes back only what changed: :func:`changes`
computes that set of row changes from the slice before and after, and the ``*_row`` helpers fix
the row encoding every backend stores.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from evstore.errors import ProjectionCorrupt, shown
from evstore.events import MAX_GENERATION, sorted_json
from evstore.schema import MAX_INT, Inventory
from projections.state import ConsumerState, ProviderState, State


def clone_provider(p: ProviderState) -> ProviderState:
    return ProviderState(p.uuid, p.name, p.parent, p.root, p.generation, dict(p.inventories), dict(p.usages))


def clone_consumer(c: ConsumerState) -> ConsumerState:
    return ConsumerState(
        c.uuid,
        c.project_id,
        c.user_id,
        c.consumer_type,
        c.generation,
        {p: dict(r) for p, r in c.allocations.items()},
        c.deleted,
        c.deleted_at,
        c.on_behalf_of,
        c.allocated_at,
        c.instance_type,
    )


def clone(state: State) -> State:
    """A copy cheap enough for every command (deepcopy is several times slower)."""
    return State(
        state.position,
        {k: clone_provider(v) for k, v in state.providers.items()},
        {k: clone_consumer(v) for k, v in state.consumers.items()},
        set(state.custom_classes),
    )


@dataclass(slots=True)
class ChangeSet:
    upsert_providers: list[ProviderState] = field(default_factory=list)
    delete_providers: list[str] = field(default_factory=list)
    upsert_consumers: list[ConsumerState] = field(default_factory=list)
    delete_consumers: list[str] = field(default_factory=list)
    #: consumers whose allocation rows are rewritten (delete all, insert current)
    replace_allocations: list[ConsumerState] = field(default_factory=list)
    add_classes: list[str] = field(default_factory=list)
    #: a hint: providers in ``upsert_providers`` of which only generation and usages changed
    #: (the common case of an allocation write); a backend may update just those columns.
    counters_only: set[str] = field(default_factory=set)
    #: a hint: consumers in ``replace_allocations`` that held no allocation rows before
    held_nothing: set[str] = field(default_factory=set)
    #: what the changed consumers add to (or take from) the project usage counters:
    #: ``{key: [consumer count, {class: amount}]}``, only the keys that change
    usage_deltas: dict[UsageKey, list[Any]] = field(default_factory=dict)


def changes(before: State, after: State, count_usages: bool = False) -> ChangeSet:
    """The row changes that make ``before`` (as stored) into ``after``; with ``count_usages``,
    also what they do to the usage counters (``usage_deltas``: only a backend that keeps them)."""
    cs = ChangeSet()
    for uuid, prov in after.providers.items():
        old = before.providers.get(uuid)
        if old != prov:
            cs.upsert_providers.append(prov)
            if (
                old is not None
                and (old.name, old.parent, old.root) == (prov.name, prov.parent, prov.root)
                and old.inventories == prov.inventories
            ):
                cs.counters_only.add(uuid)
    cs.delete_providers = [u for u in before.providers if u not in after.providers]
    deltas: dict[UsageKey, list[Any]] = {}
    for uuid, cons in after.consumers.items():
        was = before.consumers.get(uuid)
        if was != cons:
            cs.upsert_consumers.append(cons)
            if was is None or was.allocations != cons.allocations:
                cs.replace_allocations.append(cons)
                if was is None or not was.allocations:
                    cs.held_nothing.add(uuid)
            if count_usages:
                if was is not None:
                    add_project_usage(deltas, was, -1)
                add_project_usage(deltas, cons, +1)
    cs.delete_consumers = [u for u in before.consumers if u not in after.consumers]
    if count_usages:
        for uuid in cs.delete_consumers:
            add_project_usage(deltas, before.consumers[uuid], -1)
        cs.usage_deltas = {k: d for k, d in deltas.items() if d[0] or any(d[1].values())}
    cs.add_classes = sorted(after.custom_classes - before.custom_classes)
    return cs


# --- project usage counters -----------------------------------------------------------------

#: A consumer's place in the project usage counters: its project, user and type, ``""`` for no
#: user or no type (names are never empty). ``usages(project, user, type)`` sums these.
UsageKey = tuple[str, str, str]


def usage_key(c: ConsumerState) -> UsageKey | None:
    """Where a consumer counts (None: it holds nothing, or has no project to be asked by)."""
    if not c.allocations or not isinstance(c.project_id, str):
        return None
    user, ctype = c.user_id, c.consumer_type
    return (c.project_id, user if isinstance(user, str) else "", ctype if isinstance(ctype, str) else "")


def add_project_usage(into: dict[UsageKey, list[Any]], c: ConsumerState, sign: int) -> None:
    """Add (``sign`` 1) or take away (-1) what ``c`` holds to its counter in ``into``."""
    key = usage_key(c)
    if key is None:
        return
    entry = into.get(key)
    if entry is None:
        entry = into[key] = [0, {}]
    entry[0] += sign
    amounts: dict[str, int] = entry[1]
    for resources in c.allocations.values():
        for rc, used in resources.items():
            amounts[rc] = amounts.get(rc, 0) + sign * used


def project_usage_totals(consumers: Iterable[ConsumerState]) -> dict[UsageKey, tuple[int, dict[str, int]]]:
    """Every counter of a whole state: ``{key: (consumer count, {class: amount})}``."""
    into: dict[UsageKey, list[Any]] = {}
    for c in consumers:
        if c.allocations:  # (most consumers of a long log are tombstones, which count nowhere)
            add_project_usage(into, c, +1)
    return {k: (n, amounts) for k, (n, amounts) in into.items()}


# --- row encoding -------------------------------------------------------------------------------

INVENTORY_FIELDS = ("total", "reserved", "min_unit", "max_unit", "step_size", "allocation_ratio")


# Both encodings sort their keys: one state, one row (a rebuild compares rows to find what changed).
# (one encoder: json.dumps with options builds a new one per call, ~6 us of a provider row's write)
_ROW_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True).encode


def inventories_json(inventories: dict[str, Inventory]) -> str:
    return _ROW_JSON({rc: [getattr(inv, f) for f in INVENTORY_FIELDS] for rc, inv in inventories.items()})


def inventories_from_json(text: str) -> dict[str, Inventory]:
    # Every command re-reads the inventories of the providers it touches and they rarely
    # change: validate each distinct encoding once. Inventory is frozen; the dict is copied.
    return dict(_parse_inventories(text))


@functools.lru_cache(maxsize=4096)
def _parse_inventories(text: str) -> dict[str, Inventory]:
    raw: dict[str, list[Any]] = json.loads(text)
    return {
        rc: Inventory.model_validate(dict(zip(INVENTORY_FIELDS, vals, strict=True)))
        for rc, vals in raw.items()
    }


def _counts_json(value: Any) -> str:
    """A row's JSON of class names (ASCII), consumer types and counts (ints: loaded rows are
    checked, see :func:`check_loaded_consumer`), as :data:`_ROW_JSON` writes it; through
    :func:`~evstore.events.sorted_json` (~3x faster: the write-back encodes about two per command)."""
    text = sorted_json(value)
    return _ROW_JSON(value) if text is None else text


def usages_json(usages: dict[str, int]) -> str:
    return _counts_json(usages)


def provider_row(p: ProviderState) -> tuple[Any, ...]:
    return (
        p.uuid,
        p.name,
        p.parent,
        p.root,
        p.generation,
        inventories_json(p.inventories),
        usages_json(p.usages),
    )


def provider_from_row(row: tuple[Any, ...]) -> ProviderState:
    uuid, name, parent, root, generation, inventories, usages = row
    try:
        used = json.loads(usages)
        if not isinstance(used, dict):
            raise ValueError("usages is not a mapping of amounts")
        for amount in used.values():  # (a loop: ~0.3 us a row less than all() and a pass for the sign)
            if type(amount) is not int or amount < 0:
                _refuse_usages(used)
        if type(generation) is not int or generation < 0:
            raise ValueError(f"generation {shown(generation, 40)} is not a count")
        if generation > MAX_GENERATION:  # (the next command's bump: an event no import takes)
            raise ValueError(f"generation {generation} is past the largest a log holds ({MAX_GENERATION})")
        return ProviderState(uuid, name, parent, root, generation, inventories_from_json(inventories), used)
    except _UsageBelowZero as exc:
        raise ProjectionCorrupt(
            f"The projection row of provider {uuid} holds usage {exc}, below zero, which no sum of "
            "allocations is: the projection is damaged (or an earlier evstore version folded an imported "
            "log's release of allocations the provider never counted); `evstore rebuild` refolds it "
            "from the log. No command is decided against it",
            provider=uuid,
            resource_classes=exc.classes,
        ) from None
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        raise ProjectionCorrupt(
            f"The projection row of provider {uuid} cannot be read ({_first_line(exc)}): the "
            "projection is damaged; `evstore rebuild` refolds it from the log",
            provider=uuid,
        ) from None


def _refuse_usages(used: dict[Any, Any]) -> NoReturn:
    """Raise what is wrong with a provider row's usages (an amount that is no integer, or below zero)."""
    if not all(type(amount) is int for amount in used.values()):
        raise ValueError("usages is not a mapping of amounts")
    # A usage is a sum of allocations, none below 1: one below zero is no sum of them, and a
    # command decided against it put more on the provider than its capacity (a full provider's
    # usage edited to -4 took 4 more). (A stored 0 is not written, but harmless: left to the audit.)
    below = sorted(rc for rc, amount in used.items() if amount < 0)
    raise _UsageBelowZero(", ".join(f"{rc} {used[rc]}" for rc in below), below)


class _UsageBelowZero(ValueError):
    """(A provider row's usage below zero, ``str()`` the classes and amounts: its own message.)"""

    def __init__(self, message: str, classes: list[str]) -> None:
        super().__init__(message)
        self.classes = classes


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def consumer_row(c: ConsumerState) -> tuple[Any, ...]:
    return (
        c.uuid,
        c.project_id,
        c.user_id,
        c.consumer_type,
        c.generation,
        1 if c.deleted else 0,
        c.deleted_at,
        c.on_behalf_of,
        c.allocated_at,
        c.instance_type,
    )


def consumer_from_row(row: tuple[Any, ...]) -> ConsumerState:
    (
        uuid,
        project_id,
        user_id,
        consumer_type,
        generation,
        deleted,
        deleted_at,
        on_behalf_of,
        allocated_at,
        instance_type,
    ) = row
    if deleted not in (0, 1):  # (True and False included: PostgreSQL's column is a boolean)
        raise ProjectionCorrupt(
            f"The projection row of consumer {uuid} has deleted = {shown(deleted, 40)}, neither 0 nor 1: the "
            "projection is damaged; `evstore rebuild` refolds it from the log",
            consumer=uuid,
        )
    return ConsumerState(
        uuid,
        project_id,
        user_id,
        consumer_type,
        generation,
        {},
        bool(deleted),
        deleted_at,
        on_behalf_of,
        allocated_at,
        instance_type,
    )


def check_loaded_consumer(c: ConsumerState) -> None:
    """Raise :class:`ProjectionCorrupt` unless a consumer loaded for a command (its row and its
    allocation rows) holds values evstore writes: a command deciding against a generation that is
    text, or an amount of 0 or below, would commit a decision the log then keeps (a drift a
    rebuild cannot undo). Values of the right kind but wrong (a changed amount, a cleared
    tombstone) only the audit finds, against the log."""
    bad = None
    # (0 is Placement's generation for the consumers it makes: imported logs hold it)
    if not (c.generation is None or (type(c.generation) is int and 0 <= c.generation <= MAX_GENERATION)):
        bad = f"generation {shown(c.generation, 40)}"
    elif not (c.deleted_at is None or type(c.deleted_at) is int):
        bad = f"deleted_at {shown(c.deleted_at, 40)}"
    elif not (c.on_behalf_of is None or type(c.on_behalf_of) is str):
        bad = f"on_behalf_of {shown(c.on_behalf_of, 40)}"
    elif not (c.instance_type is None or type(c.instance_type) is str):
        bad = f"instance_type {shown(c.instance_type, 40)}"
    else:
        for provider, resources in c.allocations.items():
            for rc, amount in resources.items():
                if type(amount) is not int or not 1 <= amount <= MAX_INT:
                    bad = f"an allocation of {shown(amount, 40)} {rc} on provider {provider}"
                    break
    if bad is not None:
        raise _never_written(c.uuid, bad)


def check_held_amount(consumer: str, provider: str, rc: str, amount: Any) -> None:
    """Raise :class:`ProjectionCorrupt` unless ``amount``, read from the projection row of what
    ``consumer`` holds of ``rc`` on ``provider``, is one evstore writes, as
    :func:`check_loaded_consumer` checks a consumer's for a command: a query summing or listing
    it answered a damaged row as a holding (``-5``)."""
    if type(amount) is not int or not 1 <= amount <= MAX_INT:
        raise _never_written(
            consumer, f"an allocation of {shown(amount, 40)} {rc} on provider {provider}", provider=provider
        )


def _never_written(consumer: str, bad: str, **details: Any) -> ProjectionCorrupt:
    return ProjectionCorrupt(
        f"The projection rows of consumer {consumer} hold {bad}, which evstore never writes: the "
        "projection is damaged (`evstore rebuild` refolds it from the log), or the log holds it "
        "(imported from another writer; `evstore audit` names the event)",
        consumer=consumer,
        **details,
    )


def allocation_rows(c: ConsumerState) -> list[tuple[str, str, str, int]]:
    return [(c.uuid, p, rc, amt) for p, res in c.allocations.items() for rc, amt in res.items()]


def resources_json(resources: dict[str, int]) -> str:
    """What a consumer holds of one provider, as one row stores it (``{class: amount}``)."""
    return _counts_json(resources)


def holding_rows(c: ConsumerState) -> list[tuple[str, str, str]]:
    """One ``(consumer, provider, {class: amount} as JSON)`` row per provider the consumer holds."""
    return [(c.uuid, p, _counts_json(res)) for p, res in c.allocations.items()]


def resources_from_json(consumer: str, provider: str, text: Any) -> dict[str, int]:
    """A holding row's classes and amounts; :class:`ProjectionCorrupt` for text that is not a
    mapping (the amounts are :func:`check_loaded_consumer`'s to check, as a command loads them)."""
    try:
        found = json.loads(text)
        if not isinstance(found, dict) or not found:
            raise ValueError("not a mapping of resource classes to amounts")
        return found
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProjectionCorrupt(
            f"The projection row of consumer {consumer}'s allocations on provider {provider} cannot be "
            f"read ({_first_line(exc)}): the projection is damaged; `evstore rebuild` refolds it from "
            "the log",
            consumer=consumer,
            provider=provider,
        ) from None


#: one (project, user)'s counters: ``{consumer type: (consumer count, {class: amount})}``
UserCounters = dict[str, tuple[int, dict[str, int]]]


def user_counters_json(counters: UserCounters) -> str:
    """A (project, user)'s counters as its row stores them: ``[[type, count, {class: amount}], ...]``
    in type order (``""`` for no type)."""
    return _counts_json([[t, n, amounts] for t, (n, amounts) in sorted(counters.items())])


def user_counters_from_json(project: str, user: str, text: Any, answered: bool = False) -> UserCounters:
    """A (project, user)'s counters from its row; :class:`ProjectionCorrupt` for what evstore
    never writes - with ``answered`` (a query's answer: ``usages``) also for counts below zero,
    sums of holdings that never are; the audit's load takes them, to compare with the fold."""
    try:
        entries = json.loads(text)
        if not isinstance(entries, list):
            raise ValueError("not a list of counters")
        found: UserCounters = {}
        for entry in entries:
            ctype, count, amounts = entry
            if not (isinstance(ctype, str) and type(count) is int):
                raise ValueError(f"a counter {shown(entry, 80)}")
            if not isinstance(amounts, dict) or not all(type(v) is int for v in amounts.values()):
                raise ValueError(f"usages {shown(amounts, 80)} are not a mapping of amounts")
            if answered and (count < 0 or any(v < 0 for v in amounts.values())):
                raise ValueError(f"a counter below zero {shown(entry, 80)}")
            found[ctype] = (count, amounts)
        return found
    except (ValueError, TypeError, RecursionError) as exc:
        raise ProjectionCorrupt(
            f"The usage counters of project {shown(project, 80)}, user {shown(user, 80)} cannot be read "
            f"({_first_line(exc)}): the projection is damaged; `evstore rebuild` refolds it from the log",
            project_id=project,
            user_id=user or None,
        ) from None


def orphan_allocations(consumer: str) -> ProjectionCorrupt:
    """The error for allocation rows whose consumer has no row (the projection lost it)."""
    return ProjectionCorrupt(
        f"The projection holds allocations of consumer {consumer} but no row for that consumer: it is "
        "damaged (`evstore audit` says where; `evstore rebuild` refolds it from the log)",
        consumer=consumer,
    )
