"""What changed between two points of the log, and which events did it.

:func:`diff_states` folds the events between position ``a`` and ``b`` onto the state at ``a``
(with the same :func:`evolve` as everything else) while noting which events touched which
consumer and provider; it then compares the two ends: usage deltas per provider and class, and
every consumer created, changed, released, deleted - or created and gone again in between
(``transient``) - each with the positions of the events responsible.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from evstore.events import decode_event
from projections.persisted import clone
from projections.replay import FOLD_SLICE
from projections.state import ConsumerState, State, evolve_noting_providers

Allocs = dict[str, dict[str, int]]
ChangeKind = Literal["created", "changed", "released", "deleted", "transient"]
ReadRaw = Callable[[int, int], Awaitable[list[Any]]]


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
    consumer: str
    change: ChangeKind
    before: Allocs
    after: Allocs
    positions: tuple[int, ...]
    consumer_type: str | None = None
    on_behalf_of: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "consumer": self.consumer,
            "change": self.change,
            "consumer_type": self.consumer_type,
            "on_behalf_of": self.on_behalf_of,
            "before": self.before,
            "after": self.after,
            "positions": list(self.positions),
        }


@dataclass(slots=True)
class Diff:
    from_position: int
    to_position: int
    usage: list[UsageDelta] = field(default_factory=list)
    consumers: list[ConsumerChange] = field(default_factory=list)
    providers_created: list[str] = field(default_factory=list)
    providers_deleted: list[str] = field(default_factory=list)
    events_by_type: dict[str, int] = field(default_factory=dict)

    def of_change(self, kind: ChangeKind) -> list[ConsumerChange]:
        return [c for c in self.consumers if c.change == kind]

    def consumer(self, uuid: str) -> ConsumerChange | None:
        return next((c for c in self.consumers if c.consumer == uuid), None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "from_position": self.from_position,
            "to_position": self.to_position,
            "events_by_type": dict(sorted(self.events_by_type.items())),
            "providers_created": self.providers_created,
            "providers_deleted": self.providers_deleted,
            "usage": [u.to_dict() for u in self.usage],
            "consumers": [c.to_dict() for c in self.consumers],
        }


def _holds(c: ConsumerState | None) -> Allocs:
    return {p: dict(r) for p, r in c.allocations.items()} if c is not None else {}


def _classify(before: ConsumerState | None, after: ConsumerState | None) -> ChangeKind | None:
    had, has = _holds(before), _holds(after)
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
    """What a consumer is besides its allocations (a rewrite for another project is a change)."""
    return (c.generation, c.project_id, c.user_id, c.consumer_type, c.on_behalf_of, c.deleted)


async def diff_states(start: State, read_raw: ReadRaw, to_position: int, batch_size: int = 5000) -> Diff:
    """Fold the events after ``start.position`` up to ``to_position`` and describe the change."""
    # (a copy of the whole state takes seconds on a large store: on a thread, so the event loop
    # keeps getting turns - the GIL is handed over every few milliseconds)
    before = await asyncio.to_thread(clone, start)
    state = start
    touched: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    after = start.position
    while after < to_position:
        batch = await read_raw(after, min(batch_size, to_position - after))
        if not batch:
            break
        for i, raw in enumerate(batch, start=1):
            if i % FOLD_SLICE == 0:
                await asyncio.sleep(0)  # (other tasks run between slices of the batch)
            event = decode_event(raw.type, raw.schema_version, raw.data, raw.position)
            changed = evolve_noting_providers(state, event, raw.position)
            counts[raw.type] = counts.get(raw.type, 0) + 1
            for entity in event.entities() | {f"provider:{p}" for p in changed}:
                touched.setdefault(entity, []).append(raw.position)
            after = raw.position
    return await asyncio.to_thread(_describe, before, state, touched, counts)


def _describe(before: State, state: State, touched: dict[str, list[int]], counts: dict[str, int]) -> Diff:
    """What changed from ``before`` to ``state`` (whole-state work: run on a thread)."""
    result = Diff(before.position, state.position, events_by_type=counts)
    for uuid in sorted(before.providers.keys() | state.providers.keys()):
        old, new = before.providers.get(uuid), state.providers.get(uuid)
        if old is None:
            result.providers_created.append(uuid)
        elif new is None:
            result.providers_deleted.append(uuid)
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
                        tuple(touched.get(f"provider:{uuid}", ())),
                    )
                )
    result.usage.sort(key=lambda u: (u.name, u.resource_class))
    consumers = {key.split(":", 1)[1] for key in touched if key.startswith("consumer:")}
    for uuid in sorted(consumers):
        old_c, new_c = before.consumers.get(uuid), state.consumers.get(uuid)
        kind = _classify(old_c, new_c)
        if kind is None:
            continue
        known = new_c or old_c
        result.consumers.append(
            ConsumerChange(
                uuid,
                kind,
                _holds(old_c),
                _holds(new_c),
                tuple(touched[f"consumer:{uuid}"]),
                known.consumer_type if known is not None else None,
                known.on_behalf_of if known is not None else None,
            )
        )
    return result
