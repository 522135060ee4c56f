"""What changed between two points of the log, and which events did it.

:func:`diff_states` folds the events between position ``a`` and ``b`` onto the state at ``a``
(with the same :func:`evolve` as everything else) while noting which events touched which
consumer and provider; it then compares the two ends: usage deltas per provider and class, and
every consumer created, changed, released, deleted - or touched in between and holding nothing
at both ends (``transient``: created and gone again, or an event that named it without leaving it
anything), or holding what the audit calls a leak at the end (``leaked``: allocations while
deleted, or as a migration for a deleted instance - what only a log imported from an older,
Placement-style writer holds; :func:`projections.invariants.leak_of`) - each with the positions of
the events responsible (for a migration an instance's tombstone left holding, that tombstone,
although it does not name the migration).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args
from uuid import UUID

from evstore.errors import InvalidInput, shown
from evstore.events import decode_event
from projections.gcpause import gc_paused
from projections.invariants import leak_of
from projections.persisted import clone
from projections.replay import Turns, sorted_in_runs
from projections.state import ConsumerState, State, dismantle, evolve_noting_providers
from projections.views import sorted_holdings

Allocs = dict[str, dict[str, int]]
ChangeKind = Literal["created", "changed", "released", "deleted", "transient", "leaked"]
CHANGE_KINDS: tuple[str, ...] = get_args(ChangeKind)
ReadRaw = Callable[[int, int], Awaitable[list[Any]]]
#: (providers deleted in between that exist at the end, those an event in between created, and
#: those one deleted with the name each had then)
Providers = tuple[set[str], set[str], dict[str, str | None]]


@dataclass(frozen=True, slots=True)
class UsageDelta:
    provider: str
    name: str
    resource_class: str
    before: int
    after: int
    positions: tuple[int, ...]

    @property
    def delta(self) -> int:
        return self.after - self.before

    def to_dict(self) -> dict[str, Any]:
        return {
            "provider": self.provider,
            "name": self.name,
            "resource_class": self.resource_class,
            "before": self.before,
            "after": self.after,
            "delta": self.delta,
            "positions": list(self.positions),
        }


@dataclass(frozen=True, slots=True)
class ConsumerChange:
    """One consumer's change over the span: what it held at each end and the events that named it.
    ``consumer_type`` and ``on_behalf_of`` say what it is at the end; for one absent there (not
    kept: released, or created and gone again), what it was last in the span, or at its start."""

    consumer: str
    change: ChangeKind
    before: Allocs
    after: Allocs
    positions: tuple[int, ...]
    consumer_type: str | None = None
    on_behalf_of: str | None = None
    #: for one present at both ends, what it is besides its allocations that differs between
    #: them - ``project``, ``user``, ``consumer_type``, ``on_behalf_of`` -, each as
    #: ``(before, after)``: why a consumer holding the same allocations is ``changed``
    labels_changed: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "change": self.change,
            "consumer_type": self.consumer_type,
            "on_behalf_of": self.on_behalf_of,
            "before": self.before,
            "after": self.after,
            "labels_changed": {k: list(v) for k, v in self.labels_changed.items()},
            "positions": list(self.positions),
        }


@dataclass(slots=True)
class Diff:
    from_position: int
    to_position: int
    usage: list[UsageDelta] = field(default_factory=list)
    consumers: list[ConsumerChange] = field(default_factory=list)
    #: the providers absent at ``a`` and present at ``b``, or that an event in between created
    #: (and deleted): one created and deleted again in between is in both lists, as one deleted
    #: and created again is
    providers_created: list[str] = field(default_factory=list)
    providers_deleted: list[str] = field(default_factory=list)
    events_by_type: dict[str, int] = field(default_factory=dict)
    #: the name of every provider the diff names (usage, consumers' allocations, created or
    #: deleted) as it was at ``b``, or at ``a`` for one gone by then (or, for one created and
    #: deleted again in between, when it was deleted): what the usage deltas say, not what the
    #: provider is called today (it may have been renamed or deleted since)
    provider_names: dict[str, str] = field(default_factory=dict)

    def of_change(self, kind: ChangeKind) -> list[ConsumerChange]:
        """The consumers with one kind of change; a kind no change can have (a typo: "deletes")
        is refused, not answered with an empty list that reads as "none"."""
        if kind not in CHANGE_KINDS:
            raise InvalidInput(
                f"unknown kind of change {shown(kind, 40)}: one of {', '.join(CHANGE_KINDS)}", field="kind"
            )
        return [c for c in self.consumers if c.change == kind]

    def consumer(self, uuid: str | UUID) -> ConsumerChange | None:
        """The change of one consumer, ``None`` if it is not listed; the uuid in any form the
        store's queries take (a ``uuid.UUID``, any case), a malformed one ``InvalidInput``."""
        from evstore.schema import normalize_uuid

        key = normalize_uuid(uuid, "consumer uuid", "uuid")
        return next((c for c in self.consumers if c.consumer == key), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_position": self.from_position,
            "to_position": self.to_position,
            "events_by_type": dict(sorted(self.events_by_type.items())),
            "providers_created": self.providers_created,
            "providers_deleted": self.providers_deleted,
            "usage": [u.to_dict() for u in self.usage],
            "consumers": [c.to_dict() for c in self.consumers],
            "provider_names": dict(sorted(self.provider_names.items())),
        }


def _holds(c: ConsumerState | None) -> Allocs:
    """A copy of what ``c`` holds, in key order at both levels (as ``state --consumer`` shows it:
    the order the events listed them in is no part of it)."""
    return sorted_holdings(c.allocations) if c is not None else {}


def _classify(
    before: ConsumerState | None, after: ConsumerState | None, leaked_before: bool, leaked_after: bool
) -> ChangeKind | None:
    had, has = _holds(before), _holds(after)
    if leaked_after:
        # what the audit calls a leak (an imported log's revert given back to a deleted instance,
        # a migration an older writer's delete left holding): neither "created" nor "deleted"
        # says that; left out only when it was the same leak at the start
        assert after is not None
        same = leaked_before and before is not None and had == has and _labels(before) == _labels(after)
        return None if same else "leaked"
    if after is not None and after.deleted and not (before is not None and before.deleted):
        return "deleted"
    if not had and has:
        return "created"
    if had and not has:
        return "released"
    if had and has:
        assert before is not None and after is not None
        return None if had == has and _labels(before) == _labels(after) else "changed"
    return "transient"  # touched in between, holding nothing at both ends


def _labels(c: ConsumerState) -> tuple[Any, ...]:
    """What a consumer is besides its allocations (a rewrite for another project is a change).
    Not its generation: a write of exactly what it held moves only that, and leaves the consumer
    as it was - not listed, as README says, where it was called ``changed`` with equal ``before``
    and ``after`` (and one released and written again the same, back at its old generation, was
    already left out)."""
    return (c.project_id, c.user_id, c.consumer_type, c.on_behalf_of, c.deleted)


def _labels_changed(
    before: ConsumerState | None, after: ConsumerState | None
) -> dict[str, tuple[str | None, str | None]]:
    """The labels (not the allocations, nor the generation) that differ between a consumer's two
    ends, by the names ``ConsumerChange.to_dict`` and ``evstore diff`` give them."""
    if before is None or after is None:
        return {}
    pairs = {
        "project": (before.project_id, after.project_id),
        "user": (before.user_id, after.user_id),
        "consumer_type": (before.consumer_type, after.consumer_type),
        "on_behalf_of": (before.on_behalf_of, after.on_behalf_of),
    }
    return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


async def diff_states(start: State, read_raw: ReadRaw, to_position: int, batch_size: int = 5000) -> Diff:
    """Fold the events after ``start.position`` up to ``to_position`` and describe the change.

    ``start`` is folded on, and emptied at the end (a state of the caller's own to give up)."""
    # (a bulk fold with two whole states alive: the collector paused, as replay and audit pause it -
    # see projections/gcpause.py; each full collection would scan both, stalling the event loop)
    with gc_paused():
        return await _diff_states(start, read_raw, to_position, batch_size)


async def _diff_states(start: State, read_raw: ReadRaw, to_position: int, batch_size: int) -> Diff:
    # (a copy of the whole state takes seconds on a large store: on a thread, so the event loop
    # keeps getting turns - the GIL is handed over every few milliseconds)
    before = await asyncio.to_thread(clone, start)
    state = start
    touched: dict[str, list[int]] = {}  # "consumer:<uuid>" -> the events that named it
    #: "consumer:<uuid>" -> its last type, and its instance after the last event that named it and
    #: left it known (a consumer absent at the end is forgotten: what it was in between is kept here)
    seen: dict[str, tuple[str | None, str | None]] = {}
    #: (provider, class) -> the events that changed what some consumer holds of it (see _moved)
    moved: dict[tuple[str, str], list[int]] = {}
    recreated: set[str] = set()  # providers deleted in between that exist at the end
    #: the providers an event in between created or deleted (one created and deleted again is in
    #: both lists, as one deleted and created again is), and the name each deleted one had then
    created: set[str] = set()
    deleted: dict[str, str | None] = {}
    counts: dict[str, int] = {}
    after = start.position
    turns = Turns()
    while after < to_position:
        batch = await read_raw(after, min(batch_size, to_position - after))
        # (over a hole - rows deleted by hand - "the next N events" reach past to_position)
        batch = [raw for raw in batch if raw.position <= to_position]
        if not batch:
            break
        for raw in batch:
            if turns.due():
                await turns.take()  # (other tasks run between slices of the batch)
            event = decode_event(raw.type, raw.schema_version, raw.data, raw.position)
            named = event.entities()
            # (a consumer's allocations are replaced, never changed in place: kept by reference)
            held = {k[9:]: _allocations(state, k[9:]) for k in named if k.startswith("consumer:")}
            if raw.type == "ProviderDeleted":  # (its name before the event forgets it)
                gone = state.providers.get(event.provider)  # type: ignore[attr-defined]
                deleted[event.provider] = gone.name if gone is not None else None  # type: ignore[attr-defined]
                gone = None  # (no reference to the state's objects outlives the fold: see _note)
            elif raw.type == "ProviderCreated":
                created.add(event.provider)  # type: ignore[attr-defined]
            changed = evolve_noting_providers(state, event, raw.position)
            counts[raw.type] = counts.get(raw.type, 0) + 1
            for entity in named:
                if entity.startswith("consumer:"):  # (providers' events: see moved)
                    touched.setdefault(entity, []).append(raw.position)
                    _note(seen, state, entity)
            for key in _moved(state, held, changed):
                moved.setdefault(key, []).append(raw.position)
            if raw.type == "ProviderDeleted":
                recreated.add(event.provider)  # type: ignore[attr-defined]
            after = raw.position
    recreated &= state.providers.keys()
    state.position = max(state.position, to_position)  # (a hole at to_position: the state there)
    return await asyncio.to_thread(
        _described, before, state, touched, seen, moved, (recreated, created, deleted), counts
    )


def _note(seen: dict[str, tuple[str | None, str | None]], state: State, entity: str) -> None:
    """Keep what the consumer ``entity`` is after an event that named it (see ``seen``). (A
    function of its own: a local of the fold's coroutine referencing the last one noted would
    free it on the event loop, after the state was emptied on a thread - see dismantle.)"""
    c = state.consumers.get(entity[9:])
    if c is not None:
        # (a tombstone of a consumer forgotten before it has no type: the last one it had)
        typed = c.consumer_type or (seen[entity][0] if entity in seen else None)
        seen[entity] = (typed, c.on_behalf_of)


def _described(
    before: State,
    state: State,
    touched: dict[str, list[int]],
    seen: dict[str, tuple[str | None, str | None]],
    moved: dict[tuple[str, str], list[int]],
    providers: Providers,
    counts: dict[str, int],
) -> Diff:
    """:func:`_describe`, then both whole states emptied (see :func:`dismantle`): the diff holds
    copies of what it shows, and freed on the event loop at its return, the two states stalled
    it (60 ms and more on a 200k-event store). ``state`` is the caller's start, folded on."""
    try:
        return _describe(before, state, touched, seen, moved, providers, counts)
    finally:
        dismantle(before, state)


def _allocations(state: State, consumer: str) -> Allocs:
    c = state.consumers.get(consumer)
    return c.allocations if c is not None else {}


def _moved(state: State, held: dict[str, Allocs], changed: set[str]) -> set[tuple[str, str]]:
    """The (provider, class) pairs of which an event changed what some consumer holds: the
    events a usage delta names (not those that only named its provider: another class's
    allocation, a rename, an inventory change). ``held``: the named consumers' allocations
    before the event; a provider the fold changed beyond them (an imported log's event that
    does not name every consumer it moves) counts with every class."""
    out: set[tuple[str, str]] = set()
    covered: set[str] = set()
    for consumer, was in held.items():
        now = _allocations(state, consumer)
        if now is was:
            continue
        for provider in was.keys() | now.keys():
            before, after = was.get(provider, {}), now.get(provider, {})
            covered.add(provider)
            out.update(
                (provider, rc) for rc in before.keys() | after.keys() if before.get(rc) != after.get(rc)
            )
    for provider in changed - covered:
        prov = state.providers.get(provider)
        out.update((provider, rc) for rc in (prov.usages if prov is not None else ()))
    return out


def _left_holding(before: State, state: State, touched: set[str]) -> set[str]:
    """The migrations the span did not touch that hold allocations at its end for an instance it
    deleted: what an older writer's delete that did not release them leaves (the audit's leak)."""
    deleted = {
        uuid
        for uuid in touched
        if (c := state.consumers.get(uuid)) is not None
        and c.deleted
        and not ((was := before.consumers.get(uuid)) is not None and was.deleted)
    }
    if not deleted:
        return set()
    return {
        c.uuid
        for c in state.consumers.values()
        if c.on_behalf_of in deleted and c.allocations and c.uuid not in touched
    }


def _describe(
    before: State,
    state: State,
    touched: dict[str, list[int]],
    seen: dict[str, tuple[str | None, str | None]],
    moved: dict[tuple[str, str], list[int]],
    providers: Providers,
    counts: dict[str, int],
) -> Diff:
    """What changed from ``before`` to ``state`` (whole-state work: run on a thread)."""
    recreated, created, deleted = providers
    result = Diff(before.position, state.position, events_by_type=counts)
    # (created and deleted again in between: in neither state, yet in both lists)
    for uuid in sorted((created | deleted.keys()) - before.providers.keys() - state.providers.keys()):
        if uuid in created:
            result.providers_created.append(uuid)
        if uuid in deleted:
            result.providers_deleted.append(uuid)
    for uuid in sorted(before.providers.keys() | state.providers.keys()):
        old, new = before.providers.get(uuid), state.providers.get(uuid)
        if old is None or uuid in created or (new is not None and uuid in recreated):
            result.providers_created.append(uuid)
        if new is None or uuid in deleted:
            result.providers_deleted.append(uuid)  # (deleted, and created again in between)
        known_provider = new if new is not None else old
        name = known_provider.name if known_provider is not None else uuid
        old_usage = old.usages if old is not None else {}
        new_usage = new.usages if new is not None else {}
        for rc in sorted(old_usage.keys() | new_usage.keys()):
            if old_usage.get(rc, 0) != new_usage.get(rc, 0):
                result.usage.append(
                    UsageDelta(
                        uuid,
                        name,
                        rc,
                        old_usage.get(rc, 0),
                        new_usage.get(rc, 0),
                        tuple(moved.get((uuid, rc), ())),
                    )
                )
    result.usage.sort(key=lambda u: (u.name, u.resource_class))
    consumers = {key.split(":", 1)[1] for key in touched if key.startswith("consumer:")}
    consumers |= _left_holding(before, state, consumers)
    for uuid in sorted_in_runs(consumers):
        old_c, new_c = before.consumers.get(uuid), state.consumers.get(uuid)
        leak = leak_of(state, new_c) if new_c is not None else None
        was_leak = old_c is not None and leak_of(before, old_c) is not None
        kind = _classify(old_c, new_c, was_leak, leak is not None)
        if kind is None:
            continue
        key = f"consumer:{uuid}"
        positions = touched.get(key, [])
        tombstone = leak.tombstone_position if leak is not None else None
        if tombstone is not None and tombstone > before.position and tombstone not in positions:
            # (the instance's tombstone made its migration's allocations a leak, without naming it)
            positions = sorted([*positions, tombstone])
        # what it is at the end; one absent there (forgotten), what it was last in between, or
        # else at the start - and the type it had last, where a tombstone has none (a consumer
        # forgotten before it was deleted)
        seen_type, seen_behalf = seen.get(key, (None, None))
        consumer_type = (
            (new_c.consumer_type if new_c is not None else None)
            or seen_type
            or (old_c.consumer_type if old_c is not None else None)
        )
        if new_c is not None or key in seen:
            on_behalf_of = new_c.on_behalf_of if new_c is not None else seen_behalf
        else:
            on_behalf_of = old_c.on_behalf_of if old_c is not None else None
        result.consumers.append(
            ConsumerChange(
                uuid,
                kind,
                _holds(old_c),
                _holds(new_c),
                tuple(positions),
                consumer_type,
                on_behalf_of,
                _labels_changed(old_c, new_c),
            )
        )
    named = {*result.providers_created, *result.providers_deleted, *(u.provider for u in result.usage)}
    for change in result.consumers:
        named.update(change.before, change.after)
    result.providers_created.sort()
    result.providers_deleted.sort()
    for uuid in sorted(named):
        known_provider = state.providers.get(uuid) or before.providers.get(uuid)
        if known_provider is not None:
            result.provider_names[uuid] = known_provider.name
        elif (gone_name := deleted.get(uuid)) is not None:
            result.provider_names[uuid] = gone_name
    return result
