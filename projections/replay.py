"""Replay: fold the log to any position, and query the result like the live store."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from uuid import UUID

from evstore.errors import CorruptEvent, InvalidInput, ProviderNotFound, StorageError
from evstore.events import PAYLOAD_DECODERS, RecordedEvent, decode_event
from evstore.log import PayloadRow
from projections.gcpause import gc_paused
from projections.state import FOLDS, ProviderState, State, evolve
from projections.views import (
    RESERVED_CONSUMER_TYPES,
    ConsumerView,
    ProjectUsages,
    ProviderInventories,
    ProviderUsage,
    ProviderView,
    groups_from_rows,
    project_usage_rows,
    provider_allocations,
    reserved_type_usages,
)

ReadEvents = Callable[[int, int], Awaitable[list[Any]]]

#: at most this many events folded between two turns of the event loop in the bulk folds
#: (replay, rebuild, audit, diff, time travel), so that other tasks are not held up for the whole
#: batch a read returns
FOLD_SLICE = 1000
#: and at most this many seconds of work: an event costs from a few microseconds (a replay's
#: fold) to ~60 (the audit's checks, diff's decoding), so a count alone left the loop waiting
#: 40-120 ms per slice on a 200k-event store
SLICE_SECONDS = 0.005
#: rows a replay folds between two looks at the clock (a look costs as much as a few percent of
#: a row's fold)
_STEP = 64


class Turns:
    """When a bulk fold gives the event loop its next turn: after :data:`SLICE_SECONDS` of work
    or :data:`FOLD_SLICE` events, whichever comes first. One per fold, across its batches (a batch
    read ahead is awaited without a turn of the loop when it is already there)."""

    __slots__ = ("_deadline", "left")

    def __init__(self) -> None:
        self._deadline = time.perf_counter() + SLICE_SECONDS
        #: events the current slice may still fold
        self.left = FOLD_SLICE

    def due(self, events: int = 1) -> bool:
        """Count ``events`` folded; whether the loop's turn has come."""
        self.left -= events
        return self.left <= 0 or time.perf_counter() >= self._deadline

    async def take(self) -> None:
        """Give the loop its turn, and start a new slice."""
        await asyncio.sleep(0)
        self._deadline = time.perf_counter() + SLICE_SECONDS
        self.left = FOLD_SLICE


#: keys sorted by one C call of :func:`sorted_in_runs` (a few milliseconds' worth)
SORT_RUN = 8192


def sorted_in_runs(keys: Iterable[str]) -> list[str]:
    """``sorted(keys)`` (of distinct keys), in sorts of at most :data:`SORT_RUN` keys each: one
    sort of every consumer of a large state (78,000-150,000 and more: diff's touched consumers, a
    rebuild's rows) is C code that holds the GIL from start to end, 20-100 ms that the event loop
    waits for although the work runs on a thread. Runs are sorted, then merged a block at a time
    (:func:`_merge_runs`); between two sorts the interpreter can hand the GIL over."""
    items = list(keys)
    if len(items) <= SORT_RUN:
        return sorted(items)
    runs = [sorted(items[at : at + SORT_RUN]) for at in range(0, len(items), SORT_RUN)]
    # (merged MERGE_FAN_IN runs at a time, in passes: a block takes at most SORT_RUN // runs keys
    # from each run, so merging every run at once took blocks of a few keys each from runs that
    # follow one another - keys given in order, as a state loaded from the database holds them -
    # a Python step per few keys for each of the runs: 2,000,000 uuids in order, 12.6 s, where
    # heapq.merge took 2.9 and one sorted() 1.4)
    group = max(2, min(MERGE_FAN_IN, SORT_RUN))
    while len(runs) > group:
        runs = [_merge_runs(runs[at : at + group]) for at in range(0, len(runs), group)]
    return _merge_runs(runs)


#: runs one merge pass of :func:`sorted_in_runs` takes (each gives a block SORT_RUN // 16 keys)
MERGE_FAN_IN = 16


def _merge_runs(runs: list[list[str]]) -> list[str]:
    """Merge sorted runs of distinct keys (at most :data:`SORT_RUN` runs) in blocks of at most
    :data:`SORT_RUN` keys: a block is every key not above the smallest of the runs' next ``step``-th
    keys (so at most ``step`` from each run, and none left in a run sorts before it), taken by
    bisection and sorted by one C call. (``heapq.merge`` of the runs is Python per key: 61 ms for
    78,000 uuids, 210 ms for 255,000; merged in blocks, 31 and 116 ms, as much as one ``sorted``.)"""
    step = max(1, SORT_RUN // len(runs))
    starts = [0] * len(runs)
    out: list[str] = []
    while True:
        pivot: str | None = None
        for run, start in zip(runs, starts, strict=True):
            if start < len(run):
                candidate = run[min(start + step, len(run)) - 1]
                if pivot is None or candidate < pivot:
                    pivot = candidate
        if pivot is None:
            return out
        block: list[str] = []
        for i, run in enumerate(runs):
            start = starts[i]
            end = bisect.bisect_right(run, pivot, start)
            if end > start:
                block += run[start:end]
                starts[i] = end
        out += sorted(block)


async def fold_payloads_yielding(state: State, rows: list[PayloadRow], turns: Turns | None = None) -> None:
    """:func:`fold_payloads`, letting the event loop run as :class:`Turns` says."""
    turns = Turns() if turns is None else turns
    done, end = 0, len(rows)
    while done < end:
        step = min(_STEP, turns.left)
        fold_payloads(state, rows[done : done + step])
        done += step
        if turns.due(step):
            await turns.take()


async def replay(
    read: ReadEvents,
    to_position: int | None = None,
    batch_size: int = 5000,
    state: State | None = None,
    progress: Callable[[int], None] | None = None,
) -> State:
    """Fold recorded events after ``state.position`` up to ``to_position`` (inclusive; ``None``: all).

    ``state`` (empty by default) must hold the whole store, not a slice. ``progress`` gets the
    position folded so far after each batch.

    ``read(after, limit)`` returns :class:`RecordedEvent`, raw rows (``RawEvent``) or, fastest,
    ``(position, type, schema_version, data)`` tuples (a backend's ``read_payloads``). The next
    batch is read while this one is folded (the database thread and the fold overlap).
    """
    state = state if state is not None else State()

    def fetch(after: int) -> asyncio.Future[list[Any]] | None:
        if to_position is not None and after >= to_position:
            return None
        limit = batch_size if to_position is None else min(batch_size, to_position - after)
        return asyncio.ensure_future(read(after, limit))

    pending = fetch(state.position)
    # From an empty state, usage is recounted once at the end (State.recount_usages) instead of
    # kept event by event; a given state keeps its own usage (it may carry a buggy log's history).
    if state.position == 0 and not state.providers and not state.consumers:
        state.usages_deferred = True
    turns = Turns()
    try:
        with gc_paused():
            while pending is not None:
                batch = await pending
                if not batch:
                    if to_position is not None and state.position < to_position:
                        raise ended_short(state.position, to_position)
                    break
                if to_position is not None and _position_of(batch[-1]) > to_position:
                    # (over a hole - rows deleted by hand - "the next N events" reach past it)
                    batch = [row for row in batch if _position_of(row) <= to_position]
                    pending = None
                    if not batch:
                        break
                if type(batch[0]) is tuple:  # (a RawEvent is a named tuple: not this case)
                    pending = None if pending is None else fetch(batch[-1][0])
                    await fold_payloads_yielding(state, batch, turns)
                    if progress is not None:
                        progress(state.position)
                    continue
                pending = None if pending is None else fetch(batch[-1].position)
                for recorded in batch:
                    if turns.due():
                        await turns.take()
                    if isinstance(recorded, RecordedEvent):
                        event = recorded.event
                    else:
                        event = decode_event(
                            recorded.type, recorded.schema_version, recorded.data, recorded.position
                        )
                    evolve(state, event, recorded.position)
                if progress is not None:
                    progress(state.position)
    except BaseException:
        if state.usages_deferred:  # (the state as a fold leaves it, also when one stops short)
            state.recount_usages()
        raise
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
    if state.usages_deferred:
        # (one pass over every consumer: 60-80 ms on a 200k-event store, which the event loop
        # waited for at the end of every replay, rebuild and whole-state time travel)
        await asyncio.to_thread(state.recount_usages)
    if to_position is not None:
        state.position = max(state.position, to_position)  # (a hole at to_position: the state there)
    return state


def ended_short(end: int, wanted: int, what: str = "fold") -> StorageError:
    """The refusal of a read that found the log ending at ``end`` before ``wanted``, a position the
    caller had found the log holding (its head, read first): the server read from holds fewer
    events than the one that answered the head - a standby behind its primary, answering after a
    reconnect - or the log lost its last events. An answer labelled ``wanted`` would lack them."""
    return StorageError(
        f"The log read ended at position {end}, before position {wanted} that this {what} was to reach "
        "(the head read first): the server read from holds fewer events than the one that answered "
        "the head (a standby behind its primary, after a reconnect), or the log lost its last events. "
        "Try again; if it persists, `evstore audit` says whether the log was truncated",
        reason="log_ended_early",
        position=end,
        wanted=wanted,
    )


def gapless(read: Callable[[int, int], Awaitable[list[Any]]]) -> Callable[[int, int], Awaitable[list[Any]]]:
    """``read`` (of rows as :func:`replay` takes them), refusing a batch that steps over a position:
    a hole left by rows deleted by hand (``CorruptEvent``, reason ``position_gap``, at the missing
    position), as ``read``, ``export`` and ``rebuild`` refuse it - a fold over it would answer
    without the missing event (a tombstone deleted by hand: the instance alive again)."""

    async def reading(after: int, limit: int) -> list[Any]:
        batch = await read(after, limit)
        if batch and _position_of(batch[-1]) - after != len(batch):
            hole, found = next(
                (p, _position_of(row)) for p, row in enumerate(batch, after + 1) if _position_of(row) != p
            )
            raise CorruptEvent(
                f"Position {hole} is missing from the log (the next event is at {found}): rows were "
                "deleted from it; `evstore audit` lists the damage",
                position=hole,
                reason="position_gap",
            )
        return batch

    return reading


def _position_of(row: Any) -> int:
    """The position of a row ``read`` returned: a tuple's (or ``RawEvent``'s) first field, or a
    :class:`RecordedEvent`'s."""
    return row.position if isinstance(row, RecordedEvent) else int(row[0])


def payload_fields(etype: str, version: int, data: str, position: int) -> Any:
    """One stored payload, its fields as attributes (a struct, or the event model), as
    :func:`fold_payloads` decodes it (which inlines this)."""
    found = PAYLOAD_DECODERS.get(etype)
    if found is not None and found[0] == version:
        try:
            return found[1](data)
        except ValueError:
            pass
    return decode_event(etype, version, data, position)


def fold_payloads(state: State, rows: list[PayloadRow]) -> None:
    """Fold ``(position, type, schema_version, data)`` rows: the replay loop.

    The common case, an event of the current schema version, is decoded straight into a struct
    of its fields (no model built) and handed to its fold; anything else goes through
    ``decode_event`` (upcasting, or a CorruptEvent that names the position).
    """
    decoders, folds = PAYLOAD_DECODERS.get, FOLDS  # (locals: this loop runs per event)
    for position, etype, version, data in rows:
        found = decoders(etype)
        fields = None
        if found is not None and found[0] == version:
            try:
                fields = found[1](data)
            except ValueError:
                pass
        if fields is None:
            fields = decode_event(etype, version, data, position)
        state.position = position
        folds[etype](state, fields, position)


class StateView:
    """A folded state with the store's query methods (what ``state_at`` returns)."""

    def __init__(self, state: State, scope: str | None = None) -> None:
        self.state = state
        #: ``provider:<u>`` / ``consumer:<u>`` when only that entity's slice was folded
        self.scope = scope

    def __eq__(self, other: object) -> bool:
        """Equal to a view of the same scope folding to an equal state, and - a whole store's
        view - to that ``State`` itself (README: ``state_at(p)`` equals a naive replay to ``p``,
        ``await store.replay(p)``)."""
        if isinstance(other, StateView):
            return self.scope == other.scope and self.state == other.state
        if isinstance(other, State):
            return self.scope is None and self.state == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (compared by value, and the state it holds changes)

    def __repr__(self) -> str:
        if self.scope is not None:
            return f"StateView(position={self.position}, scope={self.scope!r})"
        return (
            f"StateView(position={self.position}, providers={len(self.state.providers)}, "
            f"consumers={len(self.state.consumers)})"
        )

    def _in_scope(self, kind: str, uuid: str) -> None:
        if self.scope is not None and self.scope != f"{kind}:{uuid}":
            raise InvalidInput(
                f"This view was folded for {self.scope} only; ask state_at() about {kind} {uuid}",
                field=kind,  # (the argument's name: provider or consumer)
            )

    @property
    def position(self) -> int:
        return self.state.position

    def _provider(self, provider: str | UUID) -> ProviderState:
        from evstore.schema import normalize_uuid

        uuid = normalize_uuid(provider, "provider uuid", "provider")
        self._in_scope("provider", uuid)
        prov = self.state.providers.get(uuid)
        if prov is None:
            raise ProviderNotFound(
                f"No resource provider with uuid {uuid} found at position {self.position}", provider=uuid
            )
        return prov

    async def usage(self, provider: str | UUID) -> ProviderUsage:
        return ProviderUsage.of(self._provider(provider))

    async def inventories(self, provider: str | UUID) -> ProviderInventories:
        return ProviderInventories.of(self._provider(provider))

    async def provider(self, provider: str | UUID) -> ProviderView:
        return ProviderView.of(self._provider(provider))

    async def allocations(self, consumer: str | UUID) -> ConsumerView:
        from evstore.schema import normalize_uuid

        uuid = normalize_uuid(consumer, "consumer uuid", "consumer")
        self._in_scope("consumer", uuid)
        return ConsumerView.in_state(uuid, self.state)

    async def provider_allocations(self, provider: str | UUID) -> dict[str, dict[str, int]]:
        from evstore.schema import normalize_uuid

        uuid = normalize_uuid(provider, "provider uuid", "provider")
        self._in_scope("provider", uuid)
        if uuid not in self.state.providers:
            raise ProviderNotFound(
                f"No resource provider with uuid {uuid} found at position {self.position}", provider=uuid
            )
        return provider_allocations(self.state, uuid)

    async def usages(
        self, project_id: str, user_id: str | None = None, consumer_type: str | None = None
    ) -> ProjectUsages:
        from evstore.schema import validate_consumer_type, validate_name

        validate_name(project_id, "project_id")  # (the live store's checks: same answers to the same input)
        if user_id is not None:
            validate_name(user_id, "user_id")
        if consumer_type is not None and consumer_type not in RESERVED_CONSUMER_TYPES:
            validate_consumer_type(consumer_type, query=True)
        if self.scope is not None:
            raise InvalidInput(f"This view was folded for {self.scope} only; usages() needs the whole state")
        if consumer_type in RESERVED_CONSUMER_TYPES:
            rows = project_usage_rows(self.state, project_id, user_id, None)
            return reserved_type_usages(groups_from_rows(rows), consumer_type)
        return ProjectUsages.from_rows(project_usage_rows(self.state, project_id, user_id, consumer_type))

    async def providers(self) -> list[tuple[str, str]]:
        """``(uuid, name)`` of every provider in this state, by name: what ``store.providers()``
        answers (and awaited as it is).

        Raises :class:`InvalidInput` on a view folded for one entity: the providers a slice holds
        depend on how it was folded (from a snapshot or not), not on what the store held."""
        if self.scope is not None:
            raise InvalidInput(
                f"This view was folded for {self.scope} only; providers() needs the whole state"
            )
        # (by name in code point order, as both backends sort; names are unique in a state)
        return sorted(((p.uuid, p.name) for p in self.state.providers.values()), key=lambda p: (p[1], p[0]))
