"""Snapshots of the folded state, so that time travel folds only the events since the last one.

A snapshot is the whole :class:`State` at a position, encoded as JSON, stored with the hash of
the event at that position: if the log is ever altered there, the snapshot no longer matches and
is ignored. Snapshots are a cache, never truth - they are re-made on demand by the same fold
(:func:`evolve`) - but they are complete: every consumer is kept, tombstones included, so a
snapshot can never make a deleted consumer come back.

Tombstones are shared, not copied: a consumer kept while it holds nothing (deleted, or a
migration kept for its instance's link) is saved once, in the *tombstone segment* of the first
snapshot after it came to hold nothing, and the snapshots after it leave it out as long as it is
unchanged (see :func:`encode_snapshot`). Each whole-store snapshot names the
last segment of its chain, and each segment the one before it; the chain is the snapshot's
complete list of tombstones. (Until stop 40 every snapshot re-encoded every tombstone so far: the
snapshots of a log grew with its square - 151.9 MB for the 30 snapshots of a 309,699-event log,
0.92x its events table, an estimated 1.6 GB at 1M events.)
"""

from __future__ import annotations

import asyncio
import hashlib
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import pydantic_core

from evstore.errors import EvstoreError, InvalidInput
from evstore.logs import get_logger
from evstore.schema import Inventory
from projections.gcpause import gc_paused
from projections.persisted import INVENTORY_FIELDS, consumer_row
from projections.replay import gapless, replay
from projections.state import ConsumerState, ProviderState, State, dismantle, evolve

log = get_logger("evstore.snapshots")

#: bump when the encoding or the fold changes (a snapshot is the fold's state at its position: one an
#: earlier fold made would answer as it folded); snapshots of another format are ignored (and re-made).
#: Whole-store snapshots and provider slices share it: slices are re-made only where whole-store
#: snapshots are.
#: 2: provider slices keep each holder's project, user, type and generation with its resources.
#: 3: a whole-store snapshot is lines (header, providers, chunks of consumers): see encode_state.
#: 4: a consumer row ends with a migration's instance type; a snapshot's first line (its header)
#: holds the SHA-256 of the rest, checked before it is used.
#: 5: the fold keeps a consumer's first tombstone as its deleted_at (0fb65ec, stop 37): a second one,
#: only in a log an older writer wrote, had moved it.
#: 6: tombstones are shared: a whole-store snapshot leaves out those its chain of tombstone segments
#: holds (see encode_snapshot).
#: 7: the fold keeps a provider's usage at 0 or above (stop 45): an imported log releasing what a
#: provider never counted had taken it below zero.
SNAPSHOT_FORMAT = 7
DEFAULT_SNAPSHOT_EVERY = 10_000


class SnapshotStore(Protocol):
    """What a backend offers to keep snapshots (both backends implement it).

    A snapshot's tombstone segment (see :func:`encode_snapshot`) is saved with it, in the same
    transaction (``tombstones``), and is loaded by :meth:`load_tombstones`, checked as a snapshot
    is: against the hash of the event at its position. :meth:`snapshot_headers` reads only the
    first line of each snapshot (its header, which names its chain): whether a chain is whole is
    known from the headers and the segments, without reading the snapshots whole."""

    async def read_raw(self, after: int, limit: int) -> list[Any]: ...
    async def read_payloads(self, after: int, limit: int) -> list[Any]: ...
    async def save_snapshot(
        self,
        position: int,
        event_hash: str,
        fmt: int,
        state: str,
        wait: bool = True,
        tombstones: str | None = None,
    ) -> bool | None: ...
    async def load_tombstones(self, at_most: int, fmt: int) -> list[tuple[int, str]]: ...
    async def snapshot_headers(self, at_most: int, fmt: int) -> list[tuple[int, str]]: ...
    async def load_snapshot(self, at_most: int, fmt: int) -> tuple[int, str] | None: ...
    async def snapshot_positions(self) -> list[int]: ...
    async def drop_snapshots(self) -> None: ...


def supports_snapshots(backend: object) -> bool:
    return all(
        callable(getattr(backend, name, None))
        for name in (
            "save_snapshot",
            "load_snapshot",
            "snapshot_positions",
            "drop_snapshots",
            "load_tombstones",
            "snapshot_headers",
        )
    )


# --- encoding ---------------------------------------------------------------------------------


def _provider_row(p: ProviderState) -> list[Any]:
    inventories = {
        rc: [getattr(inv, f) for f in INVENTORY_FIELDS] for rc, inv in sorted(p.inventories.items())
    }
    return [p.uuid, p.name, p.parent, p.root, p.generation, inventories, dict(sorted(p.usages.items()))]


def _provider_from_row(row: list[Any]) -> ProviderState:
    uuid, name, parent, root, generation, inventories, usages = row
    return ProviderState(
        uuid,
        name,
        parent,
        root,
        generation,
        {
            rc: Inventory.model_validate(dict(zip(INVENTORY_FIELDS, values, strict=True)))
            for rc, values in inventories.items()
        },
        dict(usages),
    )


def _dumps(document: Any) -> str:
    # pydantic-core's encoder: ~4x json.dumps(sort_keys=True) on a 31 MB state (0.09 s vs 0.41 s)
    return pydantic_core.to_json(document).decode()


def _loads(text: str) -> Any:
    # and its parser: ~3x json.loads (0.19 s vs 0.56 s on the same document)
    return pydantic_core.from_json(text)


#: consumers per line of a whole-store snapshot (see :func:`encode_state`)
CHUNK = 5000


def _consumer_row(c: ConsumerState) -> list[Any]:
    return [
        c.uuid,
        c.project_id,
        c.user_id,
        c.consumer_type,
        c.generation,
        c.allocations,
        c.deleted,
        c.deleted_at,
        c.on_behalf_of,
        c.allocated_at,
        c.instance_type,
    ]


def _consumer_from_row(row: list[Any]) -> ConsumerState:
    uuid, project, user, ctype, generation, held, deleted, deleted_at, behalf, allocated_at, itype = row
    return ConsumerState(
        uuid,
        project,
        user,
        ctype,
        generation,
        {p: dict(r) for p, r in held.items()},
        bool(deleted),
        deleted_at,
        behalf,
        allocated_at,
        itype,
    )


#: a consumer that holds nothing as a segment keeps it: its projection row
#: (:func:`projections.persisted.consumer_row` - uuid, project, user, type, generation, deleted,
#: deleted_at, on_behalf_of, allocated_at, instance type): a tombstone, or a migration kept for
#: the link to its instance once it holds nothing
Tombstone = tuple[Any, ...]


def _tombstone(c: ConsumerState) -> Tombstone | None:
    """``c`` as a segment keeps it, or None when it holds something (a segment keeps only what
    holds nothing: those the state keeps once absent - tombstones, and migrations for their
    instance's link - accumulate with the log, while those that hold are as many as are alive).
    (A segment saved before this was written with ``deleted`` as JSON true, where the row has 1:
    equal in the comparison with the chain, as decoded either way.)"""
    return None if c.allocations else consumer_row(c)


def _consumer_from_tombstone(t: Any) -> ConsumerState:
    uuid, project, user, ctype, generation, deleted, deleted_at, behalf, allocated_at, itype = t
    return ConsumerState(
        uuid, project, user, ctype, generation, {}, bool(deleted), deleted_at, behalf, allocated_at, itype
    )


@dataclass(slots=True)
class Tombstones:
    """The tombstones a chain of segments holds, as they hold them: those the next snapshot on
    the chain leaves out while they are unchanged. ``position``: the chain's last segment (0: none);
    ``digest``: that segment's, text and all (see :func:`_chain`)."""

    position: int = 0
    digest: str | None = None
    rows: dict[str, Tombstone] = field(default_factory=dict)


def _lines(rows: Iterable[Any]) -> list[str]:
    """Rows as lines of :data:`CHUNK` each (JSON text has no raw newline: one line each)."""
    rows = list(rows)
    return [_dumps(rows[at : at + CHUNK]) for at in range(0, len(rows), CHUNK)]


def _with_header(header: dict[str, Any], lines: list[str]) -> str:
    body = "\n".join(lines)
    return f"{_dumps({**header, 'digest': _digest(body)})}\n{body}"


def encode_state(state: State) -> str:
    """The whole state as one self-contained snapshot (every consumer in it): see
    :func:`encode_snapshot`, which time travel saves."""
    return encode_snapshot(state, None).whole


class Encoded(NamedTuple):
    """A snapshot as :func:`encode_snapshot` encodes it."""

    whole: str
    #: its tombstone segment (None without a chain: the snapshot holds every consumer), and the
    #: digest of the segment's text, as the snapshot's header names it
    segment: str | None
    digest: str | None
    #: what the segment adds to the chain it extends, and what it takes from it
    new: dict[str, Tombstone]
    gone: list[str]

    def extend(self, shared: Tombstones, position: int) -> None:
        """Make ``shared`` the chain this snapshot's segment ends (once the segment is saved)."""
        for uuid in self.gone:
            del shared.rows[uuid]
        shared.rows.update(self.new)
        shared.position, shared.digest = position, self.digest


def encode_snapshot(state: State, shared: Tombstones | None) -> Encoded:
    """The whole state as lines of compact JSON: a header (format, position, custom classes, the
    digest of the lines after it, and the position and digest of its chain's last tombstone
    segment), the providers (uuid order), then the consumers in chunks of :data:`CHUNK`; with its
    tombstone segment, and what that adds to the chain and takes from it.

    With ``shared`` (the chain of segments this snapshot extends), the consumers are those the
    chain does not hold as they are now: every consumer holding nothing that the chain holds
    unchanged is left out, and every one new since goes to this snapshot's segment (a header -
    format, position, the position and digest of the segment before it, digest - then a line of
    the uuids the chain holds that the state no longer keeps, then the new ones in chunks), which
    the caller saves with it, in one transaction. One the chain holds that changed since (holding
    again, or in a log an older writer wrote, an allocation written for a deleted consumer) is in
    the snapshot, which wins over its chain. Without ``shared``, every consumer is in the
    snapshot, and there is no segment.

    In lines because pydantic-core's encoder and parser hold the GIL for a whole call: one call for
    a 200,000-consumer state (32 MB) stalled the event loop half a second even on a thread; a
    chunk's call takes milliseconds, and the loop gets its turns between them.
    """
    providers = [_provider_row(p) for p in sorted(state.providers.values(), key=lambda p: p.uuid)]
    # (in the state's order, which the fold fixes: sorting 200,000 uuids is one C call of ~0.1 s)
    new: dict[str, Tombstone] = {}
    gone: list[str] = []
    if shared is None:
        rows = [_consumer_row(c) for c in state.consumers.values()]
    else:
        rows = []
        held = shared.rows
        for c in state.consumers.values():
            t = _tombstone(c)
            if t is not None:
                kept = held.get(c.uuid)
                if kept is None:
                    new[c.uuid] = t
                    continue
                if kept == t:
                    continue
            rows.append(_consumer_row(c))
        # (a migration kept for its link is forgotten once its link goes: so is it from the chain)
        consumers = state.consumers
        gone = [uuid for uuid in held if uuid not in consumers]
    header: dict[str, Any] = {
        "format": SNAPSHOT_FORMAT,
        "position": state.position,
        "custom_classes": sorted(state.custom_classes),
    }
    if shared is None:
        return Encoded(_with_header(header, [_dumps(providers), *_lines(rows)]), None, None, {}, [])
    segment = _with_header(
        {
            "format": SNAPSHOT_FORMAT,
            "position": state.position,
            "since": shared.position,
            "since_digest": shared.digest,
        },
        [_dumps(gone), *_lines(new.values())],
    )
    digest = _digest(segment)
    header["tombstones"] = {"position": state.position, "digest": digest}
    return Encoded(_with_header(header, [_dumps(providers), *_lines(rows)]), segment, digest, new, gone)


def _digest(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def _checked_body(text: str, what: str) -> tuple[dict[str, Any], str]:
    """A snapshot's header and the text after it, once the header's digest matches that text: a
    snapshot altered or damaged since it was taken must not answer (the caller then folds the
    log instead). A snapshot is a cache; the log is the truth."""
    first, _, body = text.partition("\n")
    header = _loads(first)
    if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT:
        found = header.get("format") if isinstance(header, dict) else None
        raise InvalidInput(f"Unsupported {what} format {found!r}")
    if header.get("digest") != _digest(body):
        raise ValueError(f"the {what}'s text does not match its digest: altered or damaged since taken")
    return header, body


def decode_state(text: str, segments: Mapping[int, str] | None = None) -> State:
    """The inverse of :func:`encode_state` (and of :func:`encode_snapshot`, given the segments of
    its chain: ``segments`` by position, as :meth:`SnapshotStore.load_tombstones` gives them)."""
    return decode_snapshot(text, segments or {})[0]


def decode_snapshot(text: str, segments: Mapping[int, str]) -> tuple[State, Tombstones]:
    """A snapshot's state, with the tombstones of its chain of segments (in ``segments``, by
    position) and that chain (which the next snapshot saved on this fold extends). A chain with a
    segment missing or damaged raises ValueError: the snapshot is then not used."""
    header, body = _checked_body(text, "snapshot")
    lines = body.split("\n")
    state = State(position=int(header["position"]), custom_classes=set(header["custom_classes"]))
    shared = Tombstones()
    through = header.get("tombstones")
    if through is not None:
        shared = _chain(int(through["position"]), str(through["digest"]), segments)
        for t in shared.rows.values():
            state.consumers[t[0]] = _consumer_from_tombstone(t)
    for row in _loads(lines[0]):
        provider = _provider_from_row(row)
        state.providers[provider.uuid] = provider
    for line in lines[1:]:
        for row in _loads(line):
            # (a tombstone of the chain that changed since: this snapshot's row wins)
            state.consumers[row[0]] = _consumer_from_row(row)
    return state, shared


def _chain(through: int, digest: str, segments: Mapping[int, str]) -> Tombstones:
    """The tombstones of the chain of segments that ends at ``through`` (the segment whose text
    has ``digest``), oldest first.

    Each link is checked by the digest of the whole segment it names: a position keeps one
    segment, and two processes folding the same log with different intervals save different ones
    there (the tombstones new since each one's own previous snapshot), the later replacing the
    earlier with its own snapshot. A snapshot whose chain was replaced under it is not used (its
    fold then starts over, and saves the chain again), rather than decoded with tombstones it did
    not leave out."""
    bodies: list[str] = []
    at, want = through, digest
    while at > 0:
        text = segments.get(at)
        if text is None:
            raise ValueError(f"its chain's tombstone segment at position {at} is missing")
        got, since, since_digest = _link(at, text)
        if got != want:
            raise ValueError(f"its chain's tombstone segment at position {at} was replaced by another fold's")
        bodies.append(text.partition("\n")[2])
        at, want = since, since_digest
    rows: dict[str, Tombstone] = {}
    for body in reversed(bodies):
        gone, *lines = body.split("\n")
        for uuid in _loads(gone):
            rows.pop(uuid, None)
        for line in lines:
            for t in _loads(line):
                rows[t[0]] = tuple(t)
    return Tombstones(through, digest, rows)


def _link(at: int, text: str) -> tuple[str, int, Any]:
    """The segment ``text`` kept at ``at``: the digest of its text, and the position and digest of
    the segment before it (ValueError: not a segment at ``at``). The digest is of the whole text,
    header and all, as the link to it names it: matched, it covers the body too, so the body's own
    digest in the header is not computed again (a question reads every segment of its chain)."""
    header = _loads(text.partition("\n")[0])
    if not isinstance(header, dict) or header.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"its chain's tombstone segment at position {at} says {_first_line(text)}")
    since, since_digest = int(header["since"]), header["since_digest"]
    if int(header["position"]) != at or not 0 <= since < at or (since > 0) != isinstance(since_digest, str):
        raise ValueError(f"its chain's tombstone segment at position {at} says {_first_line(text)}")
    return _digest(text), since, since_digest


def _first_line(text: str) -> str:
    return text.partition("\n")[0][:200]


async def load_snapshot_state(backend: SnapshotStore, at_most: int) -> State | None:
    """The state of the latest usable snapshot at or before ``at_most`` (tests, debugging)."""
    state, _, _ = await _load(backend, at_most)
    return None if not state.position else state


#: snapshots a fold reads whole and cannot use (a damaged row), at most, before it folds from the
#: start instead (those whose chain broke are passed over by their header alone, as many as there are)
PASSED_OVER = 8


async def _load(backend: SnapshotStore, at_most: int) -> tuple[State, Tombstones, list[int]]:
    """The latest usable snapshot at or before ``at_most`` with its chain of tombstones (the
    empty state and chain when there is none), and the positions of the later ones passed over,
    unusable (a damaged row, a segment of its chain missing or replaced), latest first.

    A snapshot whose chain broke is passed over for the one before it: a fold with another
    interval that saved its own segment where the chain ran (two processes with different
    ``snapshot_every``), a rebuild or drop_snapshots under a fold, breaks every later snapshot of
    that chain, and a fold of another interval never saves them again. Until stop 40's review the
    fold then started from position 0, for every question after such a snapshot, for good.

    The latest one is read whole and decoded, as a question's fold always did; once it cannot be
    used, those before it are looked at by their headers (see :meth:`SnapshotStore.snapshot_headers`)
    and their chain's links, and only one whose chain is whole is read. Until stop 41 each one was
    read whole, at most :data:`PASSED_OVER` of them, and past that the fold started from position
    0, saving at every multiple of its interval on the way - also over another interval's snapshots
    there, usable, with its own segment: that broke the other interval's chain after them, whose
    next question passed over as many, folded from 0 in its turn and broke this one's. Two
    processes with intervals 1 and 10 re-saved 19 and 10 snapshots at every round of two questions,
    for good. Now every snapshot a fold saves over is one it passed over, whose chain was broken for
    every snapshot that runs through it."""
    passed: list[int] = []
    segments: dict[int, str] | None = None
    headers: list[tuple[int, str]] | None = None
    links: dict[int, Any] = {}
    unreadable = 0
    found = await backend.load_snapshot(at_most, SNAPSHOT_FORMAT)
    while found is not None:
        if segments is None and _tombstones_through(found[1]) is not None:
            # (once: an earlier snapshot's chain is made of earlier segments)
            segments = dict(await backend.load_tombstones(found[0], SNAPSHOT_FORMAT))
        decoded = await asyncio.to_thread(_decoded_snapshot, found, segments or {})
        if decoded is not None:
            return decoded[0], decoded[1], passed
        passed.append(found[0])
        unreadable += 1
        if unreadable >= PASSED_OVER:
            break
        if headers is None:
            headers = await backend.snapshot_headers(found[0] - 1, SNAPSHOT_FORMAT)
        found = None
        while headers and found is None:
            position, header = headers.pop()  # (latest first)
            if position >= passed[-1]:
                continue
            through = _tombstones_through(header)
            if isinstance(through, dict):
                if segments is None:
                    segments = dict(await backend.load_tombstones(position, SNAPSHOT_FORMAT))
                if not await asyncio.to_thread(_links_whole, through, segments, links):
                    passed.append(position)
                    continue
            # (its chain is whole, or it has none, or its header is damaged, which decoding says)
            found = await backend.load_snapshot(position, SNAPSHOT_FORMAT)
            if found is None:
                # (none at or before it: dropped since the headers were read - a rebuild - and so
                # none below it either; asking at each header left was a query for each)
                break
    return State(), Tombstones(), passed


def _tombstones_through(text: str) -> Any:
    try:
        header = _loads(text.partition("\n")[0])
        return header.get("tombstones") if isinstance(header, dict) else None
    except ValueError:
        return None  # (decoding says what is wrong)


def _decoded_snapshot(found: tuple[int, str], segments: Mapping[int, str]) -> tuple[State, Tombstones] | None:
    """A snapshot decoded with its chain, or None when it cannot be (see :func:`_decoded`)."""
    chain: list[Tombstones] = []

    def decode(text: str) -> State:
        state, shared = decode_snapshot(text, segments)
        chain.append(shared)
        return state

    state = _decoded(decode, found, "whole store")
    return None if state is None else (state, chain[0])


# --- one provider's slice -------------------------------------------------------------------------
# Time travel for one provider must not parse the whole state: a provider's slice is its row and,
# for every consumer holding something on it, that part of its allocations. Folding the events
# that touch the provider (the entity index) onto a slice is exact for that provider: every event
# that changes a consumer's allocations on it names it, and evolve ignores providers not loaded.


def provider_slices(state: State) -> dict[str, str]:
    """Every provider's slice of ``state``, encoded (one pass over the consumers)."""
    holders: dict[str, dict[str, list[Any]]] = {uuid: {} for uuid in state.providers}
    for c in state.consumers.values():
        for provider, resources in c.allocations.items():
            if provider in holders:
                holder = [resources, c.project_id, c.user_id, c.consumer_type, c.generation]
                holders[provider][c.uuid] = holder
    out = {}
    for uuid, p in state.providers.items():
        # (as a whole-store snapshot: a header with the digest of the line after it)
        body = _dumps({"provider": _provider_row(p), "holders": holders[uuid]})
        header = {"format": SNAPSHOT_FORMAT, "position": state.position, "digest": _digest(body)}
        out[uuid] = f"{_dumps(header)}\n{body}"
    return out


def decode_provider_slice(text: str) -> State:
    header, body = _checked_body(text, "provider slice")
    raw = _loads(body)
    provider = _provider_from_row(raw["provider"])
    uuid = provider.uuid
    state = State(position=int(header["position"]))
    state.providers[uuid] = provider
    for consumer, (resources, project, user, ctype, generation) in raw["holders"].items():
        state.consumers[consumer] = ConsumerState(
            consumer, project, user, ctype, generation, allocations={uuid: dict(resources)}
        )
    return state


def _decoded(decode: Callable[[str], State], found: tuple[int, str], what: str) -> State | None:
    """A snapshot decoded, or None when it cannot be (a damaged row): a snapshot is only a cache,
    so the fold then starts from the beginning instead of failing."""
    try:
        state = decode(found[1])
        if state.position != found[0]:
            raise ValueError(f"it says position {state.position}")
        return state
    except Exception as exc:  # (any shape of damage: valid JSON of another shape raised AttributeError)
        log.warning("snapshot.unreadable", position=found[0], snapshot=what, error=repr(exc)[:200])
        return None


def supports_provider_snapshots(backend: object) -> bool:
    return all(
        callable(getattr(backend, name, None))
        for name in ("save_provider_snapshots", "load_provider_snapshot")
    )


#: ``read_entities(entities, after, limit, until)``: events of the entities in ``(after, until]``
ReadEntities = Callable[[list[str], int, int, int], Awaitable[list[Any]]]


async def fold_entity_to(
    backend: object, read_entities: ReadEntities, entity: str, position: int, batch_size: int = 2000
) -> State:
    """The slice of the state at ``position`` that answers for one ``provider:<u>`` or ``consumer:<u>``.

    A provider starts from its latest slice snapshot at or before ``position`` (when the backend
    keeps them); a consumer's own history is short, so it is folded from the start.
    """
    state = State()
    kind, _, uuid = entity.partition(":")
    if kind == "provider" and supports_provider_snapshots(backend):
        found = await backend.load_provider_snapshot(uuid, position, SNAPSHOT_FORMAT)  # type: ignore[attr-defined]

        def decode(text: str) -> State:
            # (the digest covers the text, not the row's key: a row filed under another
            # provider - its key altered, or copied - is another provider's slice)
            sliced = decode_provider_slice(text)
            if list(sliced.providers) != [uuid]:
                raise ValueError(f"it is the slice of provider {', '.join(sliced.providers)}")
            return sliced

        if found is not None:
            sliced = _decoded(decode, found, entity)
            if sliced is not None:
                state = sliced
    after = state.position
    while after < position:
        # (bounded by ``position``: rows after it would be read and decoded for nothing)
        batch = await read_entities([entity], after, batch_size, position)
        for recorded in batch:
            evolve(state, recorded.event, recorded.position)
        if not batch or batch[-1].position >= position or len(batch) < batch_size:
            break
        after = batch[-1].position
    state.position = position
    return state


# --- folding with snapshots ---------------------------------------------------------------------


async def fold_to(
    backend: SnapshotStore,
    position: int,
    every: int = DEFAULT_SNAPSHOT_EVERY,
    batch_size: int = 5000,
    save: bool = True,
    progress: Callable[[int], None] | None = None,
    start_at: int | None = None,
    taken: frozenset[int] = frozenset(),
    must_save: bool = False,
) -> State:
    """The state at ``position``: the nearest usable snapshot at or before it, plus the events
    since (a later one whose chain of tombstone segments broke is passed over, and saved again on
    the way: see :func:`_load`).

    On the way, a snapshot is saved at every multiple of ``every`` past the one it starts from
    (when ``save``), except at the positions in ``taken``, so the next question about this part
    of the log - also one before this position - is answered faster. ``start_at``: start from
    the nearest snapshot at or before that position instead (to fill the snapshots missing after
    it). A snapshot that cannot be saved (a session that cannot write: a read-only role or
    database, a hot standby; a full disk) is only a question answered slower, and the fold goes
    on without saving, unless ``must_save`` (the snapshots were what the caller asked for).

    The events are folded by :func:`replay` (payload rows, the next batch read while this one is
    folded, usage recounted once at the end of the first stretch when it starts empty), to each
    snapshot's position in turn; the hash a snapshot is saved with is read with that one row.
    (Until stop 39 a loop of its own read whole rows - hash, metadata, event id - one batch at a
    time: take_snapshots' fold took 0.73x the CPU once it went by replay, a question's 0.74x.)
    """
    if every < 1:
        raise InvalidInput("snapshot interval must be a positive number of events")
    with gc_paused():
        # (whole-state work runs on a thread: decoding or encoding a large store's state takes
        # a fraction of a second, which the event loop must not stall for)
        state, shared, passed = await _load(backend, position if start_at is None else start_at)
        # (the snapshots passed over, unusable, are saved again on the way, whatever the interval:
        # a fold of this one would never save them, and every later question would pass them over)
        again = sorted(p for p in passed if p <= position)
        # (a hole - rows deleted by hand - refuses the fold when it is read: the snapshots before
        # it are saved, none at or after it - one folded without the missing event would still
        # match its position's hash once the row is put back, and answer without it for good)
        read = gapless(backend.read_payloads)
        at = state.position - state.position % every + every  # (the next multiple)
        while True:
            # (folded to each multiple in turn, by replay; once nothing is to be saved, to the end)
            stop = min(at, again[0]) if again else at
            to = min(stop, position) if save else position
            state = await replay(read, to, batch_size, state, progress)
            redo = bool(again) and again[0] == stop
            if save and stop == to and (redo or stop not in taken):
                row = await backend.read_raw(stop - 1, 1)  # (for its hash)
                if row and row[0].position == stop:
                    try:
                        # (on the way to an answer, a save does not wait long for another
                        # process's write lock: the answer does not need it)
                        await _save(backend, state, stop, row[0].hash, wait=must_save, shared=shared)
                    except EvstoreError as exc:
                        if must_save:
                            raise
                        _not_saved(backend, stop, exc)
                        save = False
            if to >= position:
                return state
            if redo:
                again.pop(0)
            if stop == at:
                at += every


#: per backend, the reasons (``details["reason"]``, else the error's code) a save on the way to an
#: answer was refused for and warned about: the next refusal for the same reason is logged at debug
_WARNED: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()


def _not_saved(backend: object, position: int, exc: EvstoreError) -> None:
    """``snapshot.not_saved``: a warning the first time per backend and reason, then at debug (a
    reader that may not write warned at every question)."""
    why = str(exc.details.get("reason") or exc.code)
    seen = _WARNED.setdefault(backend, set())
    emit = log.debug if why in seen else log.warning
    seen.add(why)
    emit("snapshot.not_saved", position=position, reason=why, error=str(exc)[:200])


async def _save(
    backend: SnapshotStore, state: State, position: int, event_hash: str, wait: bool, shared: Tombstones
) -> None:
    """Save the snapshot of ``state`` at ``position``, its tombstone segment and (where the backend
    keeps them) its provider slices, in one transaction; then extend ``shared`` with the segment."""
    encoded = await asyncio.to_thread(encode_snapshot, state, shared)
    saved: bool | None
    if supports_provider_snapshots(backend):
        # (the whole-store snapshot and its slices in one transaction: all of them or none)
        slices = sorted((await asyncio.to_thread(provider_slices, state)).items())
        saved = await backend.save_provider_snapshots(  # type: ignore[attr-defined]
            position,
            event_hash,
            SNAPSHOT_FORMAT,
            slices,
            wait=wait,
            whole=encoded.whole,
            tombstones=encoded.segment,
        )
    else:
        saved = await backend.save_snapshot(
            position, event_hash, SNAPSHOT_FORMAT, encoded.whole, wait=wait, tombstones=encoded.segment
        )
    # (only once saved: a snapshot that failed to save, or that the backend left unsaved without
    # an error - SQLite's on the way to an answer, in a rollback-journal file - leaves the chain
    # as it was; extended, every later snapshot of this fold named a segment never saved, and was
    # never used. None: a backend that does not say, which saves or raises)
    if saved is not False:
        encoded.extend(shared, position)


async def _whole(backend: SnapshotStore, at_most: int) -> frozenset[int]:
    """The positions of the snapshots at or before ``at_most`` (whose event is unchanged) whose
    chain of tombstone segments is whole: take_snapshots saves the others again, as missing.
    (Until stop 40's review it counted a snapshot whose chain broke - another interval's fold
    saved its own segment where the chain ran, a rebuild dropped it under a fold - as taken, and
    left it unusable.) Reads each snapshot's header and each segment once. (Until stop 41 it read
    each snapshot whole: for the 30 snapshots of a 309,699-event log, 0.05-0.08 s against 0.01-0.03 s
    now on SQLite, 0.29 s against 0.05-0.07 s on PostgreSQL, most of what is left the segments.)"""
    headers = await backend.snapshot_headers(at_most, SNAPSHOT_FORMAT)
    whole: set[int] = set()
    chained: list[tuple[int, dict[str, Any]]] = []
    for position, header in headers:
        through = _tombstones_through(header)
        if isinstance(through, dict):
            chained.append((position, through))
        else:
            whole.add(position)  # (no chain: every consumer in it; or damaged, which decoding says)
    if chained:
        segments = dict(await backend.load_tombstones(chained[-1][0], SNAPSHOT_FORMAT))
        links: dict[int, Any] = {}

        def check() -> None:
            whole.update(p for p, through in chained if _links_whole(through, segments, links))

        await asyncio.to_thread(check)
    return frozenset(whole)


def _links_whole(through: dict[str, Any], segments: Mapping[int, str], links: dict[int, Any]) -> bool:
    """Whether the chain that ends at ``through`` (a snapshot header's ``tombstones``) is whole,
    as :func:`_chain` checks it, without decoding its tombstones. ``links``: each segment's digest
    and link back (None: unreadable), by position, filled in as they are read."""
    try:
        at, want = int(through["position"]), through["digest"]
        while at > 0:
            if at not in links:
                text = segments.get(at)
                links[at] = None if text is None else _link(at, text)
            link = links[at]
            if link is None or link[0] != want:
                return False
            at, want = link[1], link[2]
        return True
    except Exception:  # (any shape of damage, as _decoded: the snapshot is saved again)
        return False


async def take_snapshots(
    backend: SnapshotStore,
    head: Callable[[], Awaitable[int]],
    every: int = DEFAULT_SNAPSHOT_EVERY,
    progress: Callable[[int], None] | None = None,
) -> list[int]:
    """Fold the log to its head, saving a snapshot at each multiple of ``every`` that has none
    (also before the latest snapshot: a smaller ``every`` than before fills in between); returns
    all positions."""
    at = await head()
    taken = await _whole(backend, at)
    missing = next((p for p in range(every, at + 1, every) if p not in taken), None)
    if missing is not None:
        state = await fold_to(
            backend, at, every, progress=progress, start_at=missing, taken=taken, must_save=True
        )
        # (freed on a thread a piece at a time: dropped on the event loop, it stalled it for as
        # long as freeing the whole state takes; see dismantle)
        await asyncio.to_thread(dismantle, state)
    return await backend.snapshot_positions()
