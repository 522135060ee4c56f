"""The embedded SQLite backend: log and persisted projection in one file.

WAL mode, ``BEGIN IMMEDIATE`` for writes (several processes can share a file safely), durable by
default (``synchronous=FULL``). Each batch of commands costs one round trip to aiosqlite's worker
thread: the whole transaction - idempotency check, loading the decision context, ``decide``,
append, projection update, commit - runs there as one function, instead of one awaited call per
statement (each costs ~100 µs on small machines). Positions are assigned under the write lock,
so they are gap-free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import itertools
import math
import operator
import os
import re
import shlex
import sqlite3
import stat
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiosqlite

from evstore import errors as err
from evstore.commands import CreateResourceClass, Needs, decide
from evstore.errors import shown
from evstore.events import (
    EVENT_TYPES,
    EventBase,
    Metadata,
    RecordedEvent,
    decode_event,
    describe_error,
    share_fields_set,
    untrack_recorded,
)
from evstore.log import (
    GENESIS_HASH,
    HISTORY_EXAMPLES,
    MAX_POSITION,
    CallbackFailed,
    HistoryCheck,
    Job,
    LostTail,
    Outcome,
    PayloadRow,
    RawEvent,
    Rebuilt,
    Receipt,
    SchemaRepair,
    event_hash,
    follows_on,
    random_bits,
    store_keyword_hint,
)
from evstore.logs import get_logger
from evstore.schema import flag_option_from_url, validate_flag_option
from projections import persisted
from projections.exchange import duplicate_id
from projections.gcpause import gc_paused
from projections.replay import fold_payloads, payload_fields, replay, sorted_in_runs
from projections.state import FOLDS, ConsumerState, State, dismantle, evolve, fold_noting_providers
from projections.views import UsageGroup

#: 2: the history index may lag the log (meta ``history_through``); the events' ``event_id`` is
#: no longer a unique index in new stores (ids are time-ordered, with 74 random bits)
#: 3: a migration's instance type (a column of p_consumers, refolded on open);
#: 4: no table changes - events may carry payload fields an evstore of version 3 or older refuses
#: (on_behalf_of, a ProviderDeleted's parent): the version closes such a store to it, which would
#: otherwise call those events corrupt;
#: 5: p_allocations holds one row per consumer and provider (its classes as JSON), and per-project
#: and per-user usage counters (p_usages) replace the index of consumers by project (refolded on open)
SCHEMA_VERSION = 5
log = get_logger("evstore.sqlite")
#: the history index (``event_entities``) is brought up to date once it lags this many events
#: behind the log; reads look at the (at most this many) newest events themselves
HISTORY_LAG = 1000
#: a uuid in a damaged row's text (see _history_of)
_UUID_IN_TEXT = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
T = TypeVar("T")
B = TypeVar("B")

DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    position INTEGER PRIMARY KEY,
    event_id TEXT NOT NULL,
    type TEXT NOT NULL,
    schema_version INTEGER NOT NULL,
    data TEXT NOT NULL,
    metadata TEXT NOT NULL,
    recorded_at TEXT NOT NULL,
    hash TEXT NOT NULL
);
DROP INDEX IF EXISTS events_recorded_at;
CREATE TABLE IF NOT EXISTS event_entities (
    entity TEXT NOT NULL, position INTEGER NOT NULL, PRIMARY KEY (entity, position)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS idempotency (
    key TEXT PRIMARY KEY, fingerprint TEXT NOT NULL, receipt TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS p_providers (
    uuid TEXT PRIMARY KEY, name TEXT NOT NULL, parent TEXT, root TEXT NOT NULL,
    generation INTEGER NOT NULL, inventories TEXT NOT NULL, usages TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS p_providers_name ON p_providers (name);
CREATE INDEX IF NOT EXISTS p_providers_parent ON p_providers (parent);
CREATE TABLE IF NOT EXISTS p_consumers (
    uuid TEXT PRIMARY KEY, project_id TEXT, user_id TEXT, consumer_type TEXT, generation INTEGER,
    deleted INTEGER NOT NULL, deleted_at INTEGER, on_behalf_of TEXT, allocated_at INTEGER,
    instance_type TEXT
) WITHOUT ROWID;
DROP INDEX IF EXISTS p_consumers_behalf;
DROP INDEX IF EXISTS p_consumers_project;
CREATE INDEX IF NOT EXISTS p_consumers_migrations ON p_consumers (on_behalf_of)
    WHERE on_behalf_of IS NOT NULL;
CREATE TABLE IF NOT EXISTS p_allocations (
    consumer TEXT NOT NULL, provider TEXT NOT NULL, resources TEXT NOT NULL,
    PRIMARY KEY (consumer, provider)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS p_usages (
    project_id TEXT NOT NULL, user_id TEXT NOT NULL, counters TEXT NOT NULL, PRIMARY KEY (project_id, user_id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS p_allocations_provider ON p_allocations (provider);
CREATE TABLE IF NOT EXISTS p_classes (name TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS snapshots (
    position INTEGER PRIMARY KEY, event_hash TEXT NOT NULL, format INTEGER NOT NULL, state TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS provider_snapshots (
    provider TEXT NOT NULL, position INTEGER NOT NULL, event_hash TEXT NOT NULL, format INTEGER NOT NULL,
    state TEXT NOT NULL, PRIMARY KEY (provider, position)
) WITHOUT ROWID;
"""

PROJECTION_TABLES = ("p_providers", "p_consumers", "p_allocations", "p_classes", "p_usages")
#: Columns later schema versions added to a table, last in it (an older store gets them on open,
#: and its projection is refolded to fill them): 3 added a migration's instance type.
ADDED_COLUMNS: dict[str, dict[str, str]] = {"p_consumers": {"instance_type": "TEXT"}}
#: Projection tables a later schema version reshaped, with their columns before (an older
#: store's are made again on open and refolded from the log; see _ensure_schema): 5 made
#: p_allocations one row per consumer and provider (one B-tree entry and one index entry per claim
#: instead of one per class).
RESHAPED_TABLES: dict[str, tuple[tuple[str, ...], int]] = {
    "p_allocations": (("consumer", "provider", "rc", "used"), 5),
}
PROJECTION_INDEXES = {
    name: sql
    for sql in (s.strip() for s in DDL.split(";"))
    if sql.startswith("CREATE INDEX") and (name := sql.split()[5]).startswith("p_")
}
EVENT_COLUMNS = "position, event_id, type, schema_version, data, metadata, recorded_at, hash"
#: a page of the log after a position (read_raw, read)
READ_PAGE = f"SELECT {EVENT_COLUMNS} FROM events WHERE position > ? ORDER BY position LIMIT ?"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


def parse_time(text: str) -> datetime:
    return datetime.fromisoformat(text)


def decode_raw(raw: RawEvent, page: list[Any] | None = None) -> RecordedEvent:
    """A stored row as a reader returns it.

    Every tracked object a decoded event keeps alive is scanned by the cyclic collector, with the
    GIL held, when a large page is collected: the event and its metadata share the set of their
    field names (``share_fields_set``), an ``InventoriesReplaced``'s inventories too, and the
    events of one command (rows in a row of one page with the same metadata text) share one
    metadata model; then the collector is told to leave the whole event alone
    (``untrack_recorded``). ``page``: ``[text, model]`` of the metadata of the page's row before
    this one (:func:`decode_rows`), replaced by this row's. Not shared between pages: a caller
    changing a list in one read's metadata changed every later read of it (a module global).
    """
    event = decode_event(raw.type, raw.schema_version, raw.data, raw.position)
    share_fields_set(event)
    if raw.type == "InventoriesReplaced":
        for inventory in event.__dict__["inventories"].values():
            share_fields_set(inventory)
    try:
        if page is not None and raw.metadata == page[0]:
            metadata = page[1]
        else:
            metadata = Metadata.model_validate_json(raw.metadata)
            share_fields_set(metadata)
            if page is not None:
                page[:] = raw.metadata, metadata
        recorded_at = parse_time(raw.recorded_at)
    except ValueError as exc:
        raise err.CorruptEvent(
            # (each field and what is wrong with it, as the audit says: not pydantic's first
            # line, "1 validation error for Metadata", which names neither)
            f"Cannot decode the envelope at position {raw.position}: {describe_error(exc, 'metadata')}",
            position=raw.position,
            reason="undecodable",
        ) from None
    recorded = RecordedEvent(raw.position, raw.event_id, recorded_at, metadata, event)
    untrack_recorded(recorded)
    return recorded


def decode_rows(rows: Sequence[Sequence[Any]]) -> list[RecordedEvent]:
    """Rows of ``EVENT_COLUMNS`` decoded (see :func:`decode_raw`)."""
    page: list[Any] = [None, None]  # (no metadata text is None)
    return [decode_raw(RawEvent._make(r), page) for r in rows]


@dataclass(slots=True)
class _Tail:
    position: int
    hash: str
    recorded_at: str
    #: the write transaction's clock (read once per batch): every event it appends is recorded at it
    now: str
    #: event and history-index rows appended by this transaction: the events are inserted together
    #: at its end (``insert_appended``), one statement per transaction instead of per command; the
    #: history rows go to :func:`index_history`
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    #: each appended event's position and history keys
    entity_rows: list[tuple[int, set[str]]] = field(default_factory=list)


@functools.lru_cache(maxsize=1024)  # (most queries name 1-3 keys)
def _in_clause(n: int) -> str:
    return ",".join("?" * n)


def _chunks(items: list[str], size: int = 500) -> Iterable[list[str]]:
    if len(items) <= size:
        return (items,)
    return (items[i : i + size] for i in range(0, len(items), size))


# --- work done on the database thread ---------------------------------------------------------


def _load_consumers(conn: sqlite3.Connection, state: State, uuids: set[str]) -> None:
    for chunk in _chunks(sorted(uuids)):
        marks = _in_clause(len(chunk))
        found = []
        for row in conn.execute(
            "SELECT uuid, project_id, user_id, consumer_type, generation, deleted, deleted_at, on_behalf_of, "
            f"allocated_at, instance_type FROM p_consumers WHERE uuid IN ({marks})",
            chunk,
        ):
            c = persisted.consumer_from_row(row)
            state.consumers[c.uuid] = c
            found.append(c.uuid)
        if not found:
            continue  # a consumer with allocations always has a row: new consumers cost one query
        marks = _in_clause(len(found))
        held = f"SELECT consumer, provider, resources FROM p_allocations WHERE consumer IN ({marks})"
        for consumer, provider, resources in conn.execute(held, found):
            state.consumers[consumer].allocations[provider] = persisted.resources_from_json(
                consumer, provider, resources
            )
        for uuid in found:
            persisted.check_loaded_consumer(state.consumers[uuid])


def apply_changes(
    conn: sqlite3.Connection,
    cs: persisted.ChangeSet,
    usage_counters: dict[tuple[str, str], persisted.UserCounters] | None = None,
) -> None:
    if cs.delete_providers:
        conn.executemany("DELETE FROM p_providers WHERE uuid = ?", [(u,) for u in cs.delete_providers])
    if cs.upsert_providers:
        counters = [p for p in cs.upsert_providers if p.uuid in cs.counters_only]
        whole = [p for p in cs.upsert_providers if p.uuid not in cs.counters_only]
        if counters:
            # cheaper than a REPLACE: no secondary index (name, parent) is touched
            conn.executemany(
                "UPDATE p_providers SET generation = ?, usages = ? WHERE uuid = ?",
                [(p.generation, persisted.usages_json(p.usages), p.uuid) for p in counters],
            )
        if whole:
            conn.executemany(
                "INSERT OR REPLACE INTO p_providers VALUES (?,?,?,?,?,?,?)",
                [persisted.provider_row(p) for p in whole],
            )
    gone = cs.delete_consumers + [c.uuid for c in cs.replace_allocations if c.uuid not in cs.held_nothing]
    if gone:
        conn.executemany("DELETE FROM p_allocations WHERE consumer = ?", [(u,) for u in gone])
    if cs.delete_consumers:
        conn.executemany("DELETE FROM p_consumers WHERE uuid = ?", [(u,) for u in cs.delete_consumers])
    # Rows go in primary-key order: B-tree appends instead of random inserts (rebuild writes
    # every row at once).
    if cs.upsert_consumers:
        conn.executemany(
            "INSERT OR REPLACE INTO p_consumers VALUES (?,?,?,?,?,?,?,?,?,?)",
            sorted(persisted.consumer_row(c) for c in cs.upsert_consumers),
        )
    rows = sorted(r for c in cs.replace_allocations for r in persisted.holding_rows(c))
    if rows:
        conn.executemany("INSERT INTO p_allocations VALUES (?,?,?)", rows)
    if cs.add_classes:
        conn.executemany("INSERT OR IGNORE INTO p_classes VALUES (?)", [(n,) for n in cs.add_classes])
    if cs.usage_deltas:
        _count_usages(conn, cs.usage_deltas, usage_counters)


def _count_usages(
    conn: sqlite3.Connection,
    deltas: dict[persisted.UsageKey, list[Any]],
    known: dict[tuple[str, str], persisted.UserCounters] | None = None,
) -> None:
    """Add what a write changed to the usage counters: one row per project and user (its counters
    per consumer type inside), few and hot rows where an index of consumers by project took a
    random page per new consumer, and each as small as one user's consumer types (a row per
    project grew with its users: every write rewrote all of them). ``known``: counters as
    stored, kept by the writer between its transactions (read here for the keys it lacks, and
    updated)."""
    known = {} if known is None else known
    _load_usage_counters(conn, {(project, user) for project, user, _ in deltas}, known)
    # (each (project, user) looked up once per batch, not once per consumer type; a type it did
    # not count yet starts from what the delta adds, not from a copy of an empty dict)
    changed: dict[tuple[str, str], persisted.UserCounters] = {}
    for (project, user, ctype), (count, amounts) in deltas.items():
        key = (project, user)
        counters = changed.get(key)
        if counters is None:
            counters = changed[key] = known[key]
        had = counters.get(ctype)
        if had is None:
            total, merged = count, {rc: amount for rc, amount in amounts.items() if amount}
        else:
            total, merged = had[0] + count, dict(had[1])
            for rc, amount in amounts.items():
                if amount:
                    if v := merged.get(rc, 0) + amount:
                        merged[rc] = v
                    else:
                        del merged[rc]
        if total == 0 and not merged:
            counters.pop(ctype, None)
        else:
            counters[ctype] = (total, merged)
    gone: list[tuple[str, str]] = []
    rows: list[tuple[str, str, str]] = []
    for key in sorted(changed):
        counters = changed[key]
        if counters:
            rows.append((*key, persisted.user_counters_json(counters)))
        else:
            gone.append(key)
    if gone:
        conn.executemany("DELETE FROM p_usages WHERE project_id = ? AND user_id = ?", gone)
    if rows:
        conn.executemany("INSERT OR REPLACE INTO p_usages VALUES (?,?,?)", rows)


def _load_usage_counters(
    conn: sqlite3.Connection,
    keys: set[tuple[Any, Any]],
    known: dict[tuple[str, str], persisted.UserCounters],
) -> None:
    """Read the stored counters of the (project, user) ``keys`` missing from ``known`` into it,
    all or none (:class:`ProjectionCorrupt` for a row that cannot be read: a key left out of
    ``known``, not taken for one without counters)."""
    # (not ``keys - known.keys()``: a set minus a view walks the whole view, every counter the
    # writer keeps - up to its cache's 20,000 entities - for each command)
    unknown = [key for key in keys if key not in known]
    if not unknown:
        return
    missing = sorted(k for k in unknown if isinstance(k[0], str) and isinstance(k[1], str))
    loaded: dict[tuple[str, str], persisted.UserCounters] = {}
    for start in range(0, len(missing), 400):
        chunk = missing[start : start + 400]
        sql = (
            "SELECT project_id, user_id, counters FROM p_usages "
            f"WHERE (project_id, user_id) IN (VALUES {','.join(['(?,?)'] * len(chunk))})"
        )
        for key in chunk:
            loaded[key] = {}
        for project, user, text in conn.execute(sql, [part for key in chunk for part in key]):
            loaded[(project, user)] = persisted.user_counters_from_json(project, user, text)
    known.update(loaded)


def _counters_touched(state: State, events: Sequence[Any]) -> set[tuple[Any, Any]]:
    """The (project, user) keys whose usage counters ``events`` may change, folded into ``state``
    (the slice they were decided on): those of the slice's consumers (holding something now, or
    given something back, as a reverted migration's instance), and those the events give
    consumers. (A key no counter can have - a consumer without a project - is skipped by
    :func:`_load_usage_counters`.)"""
    keys = {(c.project_id, c.user_id or "") for c in state.consumers.values()}
    for e in events:
        # (the model's fields, read from its __dict__: ``getattr`` with a default goes through
        # pydantic's ``__getattr__`` for an event without the field - a release, a deletion, a
        # revert - which builds and raises an AttributeError, ~4 us against ~0.1 us)
        fields = e.__dict__
        project = fields.get("project_id")
        if project is not None:
            keys.add((project, fields.get("user_id") or ""))
    return keys


def _read_tail(conn: sqlite3.Connection) -> _Tail:
    row = conn.execute(
        "SELECT position, hash, recorded_at FROM events ORDER BY position DESC LIMIT 1"
    ).fetchone()
    if row is None:
        return _Tail(0, GENESIS_HASH, "", now_iso())
    return _Tail(row[0], row[1], _time_or_nothing(row[2]), now_iso())


def _time_or_nothing(text: Any) -> str:
    """The last event's time as the writer takes it over (times never go backwards: each new event
    is recorded at the later of the clock and it, compared as text): "" for a row whose time is no
    time in evstore's form (damaged by hand: "yesterday" sorts after any "2026-..."), which every
    event appended after it then copied - accepted, and unreadable or not importable. The damaged
    row stays for the audit.

    The last time a writer appended at (:func:`append_events`), or found in that form here, is
    remembered (one entry; only texts in that form): a writer's next transaction finds the time
    its own last one wrote, and the parse and format (~2.5 us) are a string comparison."""
    if isinstance(text, str):
        if text == _time_in_form[0]:
            return text
        try:
            # (in evstore's own form only: a time written otherwise - another offset, no
            # microseconds - was edited by hand too, and its text would be copied as it is)
            if datetime.fromisoformat(text).astimezone(UTC).isoformat(timespec="microseconds") == text:
                _time_in_form[0] = text
                return text
        except (ValueError, OverflowError):
            pass
    return ""


#: the last text :func:`_time_or_nothing` found, or :func:`append_events` wrote, that is a time in
#: evstore's form ("" is none: it answers "" for it either way); replaced whole, so a writer
#: thread of another store reading it meanwhile sees one text or the other, each such a time
_time_in_form: list[str] = [""]


def _time_ordered_uuid() -> str:
    """A version-7-style uuid (48-bit millisecond time, then 74 random bits): ids of successive
    events sort together (an index on event_id, which stores of schema version 1 have, appends
    instead of touching a random page per event)."""
    value = (time.time_ns() // 1_000_000) << 80 | random_bits(80)
    value = (value & ~(0xF << 76)) | (0x7 << 76)  # version 7
    value = (value & ~(0x3 << 62)) | (0x2 << 62)  # RFC 4122 variant
    h = f"{value:032x}"  # (formatted by hand: a UUID object costs 3x as much)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def append_events(tail: _Tail, events: list[EventBase], meta_json: str) -> list[tuple[int, EventBase]]:
    """Append events after ``tail`` (advancing it) with hash chain and entity index, to be inserted
    by :func:`insert_appended` before the transaction commits; ``meta_json`` is the command's
    metadata as stored (``Job.metadata_json``)."""
    now = tail.now
    recorded_at = now if now > tail.recorded_at else tail.recorded_at  # never goes backwards
    # (the clock's text, or a last time _time_or_nothing took over: in evstore's form either way,
    # and the time the writer's next transaction finds on the last event)
    _time_in_form[0] = recorded_at
    rows = tail.rows
    entity_rows = tail.entity_rows
    out = []
    for event in events:
        position = tail.position + 1
        event_id = _time_ordered_uuid()
        etype = event.event_type
        data = event.payload_json()
        digest = event_hash(
            tail.hash, position, event_id, etype, event.SCHEMA_VERSION, data, meta_json, recorded_at
        )
        rows.append((position, event_id, etype, event.SCHEMA_VERSION, data, meta_json, recorded_at, digest))
        entity_rows.append((position, event.entities()))
        tail.position, tail.hash, tail.recorded_at = position, digest, recorded_at
        out.append((position, event))
    return out


def insert_appended(conn: sqlite3.Connection, tail: _Tail) -> None:
    """Insert the event rows :func:`append_events` collected in this transaction."""
    if tail.rows:
        conn.executemany(f"INSERT INTO events ({EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)", tail.rows)
        tail.rows = []


def _stored_history_through(conn: sqlite3.Connection) -> int | None:
    """meta ``history_through`` as stored (0 when absent; None when damaged: not a number)."""
    row = conn.execute("SELECT value FROM meta WHERE key = 'history_through'").fetchone()
    try:
        return int(row[0]) if row is not None else 0
    except (TypeError, ValueError):
        return None


def history_through(conn: sqlite3.Connection) -> int:
    """The position through which the history index (``event_entities``) is complete."""
    through = _stored_history_through(conn)
    if through is None:
        return 0  # (damaged: reads then look at every event themselves, which is only slower)
    if through > 0:
        head = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
        if through > head:
            # Damaged (evstore never indexes past the head): trusted, reads would never look at the
            # events after the head, and the writer would never index them. Nothing is taken as
            # indexed; the writer indexes everything again (INSERT OR IGNORE).
            log.warning("history_index.through_past_head", history_through=through, head=head)
            return 0
    return through


def drop_history_past_head(conn: sqlite3.Connection, head: int) -> None:
    """In a write transaction, before it appends: a history index past the head of the log (the
    log lost its last events - rows deleted, an older copy restored) holds the rows of events that
    are gone. They are dropped, and the index taken as complete through the head (the events up to
    it are the ones it indexed): else the events appended next at those positions would be taken
    as indexed once the head passed the old ``history_through``, and a history read (and the
    slices of ``state_at``) would find the vanished events' entities there instead of theirs."""
    through = _stored_history_through(conn)
    if through is not None and through > head:  # (damaged, None: history_through answers 0)
        log.warning("history_index.past_head_dropped", history_through=through, head=head)
        conn.execute("DELETE FROM event_entities WHERE position > ?", (head,))
        conn.execute("UPDATE meta SET value = ? WHERE key = 'history_through'", (str(head),))


def _history_of(
    conn: sqlite3.Connection, after: int, upto: int, known: Mapping[int, Collection[str]]
) -> list[tuple[str, int]]:
    """The history rows of the events in ``(after, upto]``: ``known`` keys where given (the events
    this writer appended), else read off the events. A row that cannot be decoded (damaged since
    it was written) is indexed under every id its text still holds, as consumer and provider: the
    history reads of those entities then fail on it with CorruptEvent, as they would had the index
    reached it before the damage."""
    inside = [p for p in known if after < p <= upto]
    out = [(entity, p) for p in inside for entity in known[p]]
    if len(inside) == upto - after:
        return out  # (all known: nothing to read)
    sql = "SELECT position, type, schema_version, data FROM events WHERE position > ? AND position <= ?"
    for position, etype, version, data in conn.execute(sql, (after, upto)):
        if position in known:
            continue
        try:
            keys = decode_event(etype, version, data, position).entities()
        except err.CorruptEvent:
            keys = _damaged_row_keys(data)
        out.extend((entity, position) for entity in keys)
    return out


def _damaged_row_keys(data: object) -> set[str]:
    """The history keys of a row that cannot be decoded: every id its text still holds, as
    consumer and provider (see _history_of)."""
    ids = set(_UUID_IN_TEXT.findall(data)) if isinstance(data, str) else set()
    return {f"{kind}:{uuid}" for uuid in ids for kind in ("consumer", "provider")}


def index_history(conn: sqlite3.Connection, cache: _WriterCache, tail: _Tail, force: bool = False) -> None:
    """Bring the history index up to date once it lags :data:`HISTORY_LAG` events (``force``: at
    all), in this write transaction, after its events are inserted.

    Every event's history rows cost a random B-tree page or two (a consumer's key is a random
    uuid); written once per many events, sorted, the rows of hot providers share their pages and
    each command dirties ~3.5 fewer pages (WAL frames). Until then the writer keeps the keys of the
    events it appended (:attr:`_WriterCache.own`); those another connection appended are read off
    the events.
    """
    if cache.history_through is None:  # (another connection wrote since, or first here)
        _forget_own_if_lost(conn, cache)
        cache.history_through = history_through(conn)
        cache.drop_own(upto=cache.history_through)  # (another connection indexed them meanwhile)
    if tail.entity_rows:
        for position, keys in tail.entity_rows:
            # (a tuple: a set stays tracked by the cyclic collector, and kept for up to
            # HISTORY_LAG events every one is promoted to its oldest generation - about a third
            # of what a group commit's 64 tasks promoted, and so of its full collections)
            cache.own[position] = tuple(keys)
        cache.own_tip = (tail.position, tail.hash)
        tail.entity_rows = []
    through = cache.history_through
    if tail.position <= through or (tail.position - through < HISTORY_LAG and not force):
        return
    rows = _history_of(conn, through, tail.position, cache.own)
    conn.executemany("INSERT OR IGNORE INTO event_entities VALUES (?,?)", sorted(rows))
    conn.execute("UPDATE meta SET value = ? WHERE key = 'history_through'", (str(tail.position),))
    cache.history_through = tail.position
    cache.drop_own(upto=tail.position)


def _forget_own_if_lost(conn: sqlite3.Connection, cache: _WriterCache) -> None:
    """Forget the kept history keys (:attr:`_WriterCache.own`) unless the last event this writer
    appended is still in the log, hash and all (the chain: so are all before it). Else the log
    lost them (rows deleted, an older copy restored) and other events may stand at their
    positions now: indexed under the kept keys, a history read would find the vanished events'
    entities there instead of theirs. (Forgotten, the keys are read off the events.)"""
    if not cache.own:
        return
    tip = cache.own_tip
    row = (
        None
        if tip is None
        else conn.execute("SELECT hash FROM events WHERE position = ?", (tip[0],)).fetchone()
    )
    if tip is None or row is None or row[0] != tip[1]:
        if tip is not None:
            log.warning("history_index.own_keys_lost", position=tip[0])
        cache.own = {}
        cache.own_tip = None


def flush_history(conn: sqlite3.Connection, cache: _WriterCache) -> None:
    """Index the events this writer appended, whatever the lag (the store is closing: reads after
    it find everything in the index). Skipped if another connection holds the write lock."""
    if not cache.own:
        return
    _end_leftover(conn)
    try:  # (the writer's busy handler waits one slice, BUSY_SLICE_MS, for another's lock)
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError:
        return  # (busy: the next writer's catch-up does it)
    try:
        cache.history_through = None  # (read again under the lock)
        head = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
        index_history(conn, cache, _Tail(head, "", "", ""), force=True)
        conn.execute("COMMIT")
    except BaseException:
        cache.forget()
        cache.own = {}
        _rollback(conn)
        raise


class _WriterCache:
    """The projection's entities as this writer connection knows them, kept from one write
    transaction (group commit) to the next, and what the current transaction's jobs did to them.

    A hot provider or consumer is loaded once, not once per job or per batch: between this
    connection's transactions the cache equals the stored rows as long as no other connection
    commits, which ``PRAGMA data_version`` tells at the start of each transaction (it changes
    exactly when another connection committed). Anything else that could make the two differ
    drops the cache: a transaction that rolls back, any other work on this connection
    (:meth:`SqliteBackend._on_writer`), or growing past :attr:`LIMIT` entities.

    The projection rows are written once per transaction (``flush``), or before a job that
    creates a class. ``before`` holds a copy, taken when a job first touches it, of each entity
    the transaction touched, as stored: the write-back is exactly the difference. Entities found
    through a secondary index (provider names, children, an instance's migrations) are looked
    up in the stored rows, which are current for every entity this transaction has not touched,
    and among the touched ones by their current value, which the cache indexes by those columns
    (:meth:`_touched_with`).
    """

    #: past this many remembered entities (present or known absent), start again: memory stays
    #: bounded by the working set, not by the store
    LIMIT = 20_000

    def __init__(self) -> None:
        self.data_version: int | None = None
        #: the stored ``history_through`` (None: read it in this transaction)
        self.history_through: int | None = None
        #: position -> history keys of the events this writer appended that the index does not
        #: hold yet. Facts about the log, not the projection: kept when the rest is forgotten,
        #: except the positions of a transaction that rolled back (drop_own).
        self.own: dict[int, tuple[str, ...]] = {}
        #: the position and hash of the last event whose keys ``own`` took: while the log holds
        #: it, it holds every event ``own`` names (see _forget_own_if_lost)
        self.own_tip: tuple[int, str] | None = None
        #: the database file as opened: path, device and inode (None: in memory). A fact about
        #: the connection, not the projection: kept when the rest is forgotten.
        self.file: tuple[str, int, int] | None = None
        #: its -wal and -shm files as opened, likewise (none while the file is not in WAL mode)
        self.wal_files: tuple[tuple[str, int, int], ...] = ()
        #: the head of the log a write transaction of this connection last found, once the
        #: projection was found recording no change past it (None: not yet). A fact about the
        #: log, kept when the rest is forgotten: see check_log_not_behind.
        self.head_seen: int | None = None
        self.forget()

    def forget(self) -> None:
        """Drop everything remembered (the next transaction loads what it needs again)."""
        self.now = State()
        #: uuids whose presence (in ``now``) or absence is known
        self.known_consumers: set[str] = set()
        self.known_providers: set[str] = set()
        #: custom classes known to be stored
        self.stored_classes: set[str] = set()
        #: project usage counters known as stored (see _count_usages)
        self.usage_counters: dict[tuple[str, str], persisted.UserCounters] = {}
        self.data_version = None
        self.history_through = None
        self._clean()

    def drop_own(self, upto: int | None = None, after: int | None = None) -> None:
        """Forget the history keys of the events at ``upto`` and before, or after ``after``."""
        self.own = {
            p: keys
            for p, keys in self.own.items()
            if (upto is None or p > upto) and (after is None or p <= after)
        }

    def _clean(self) -> None:
        self.before = State()
        self.touched_consumers: set[str] = set()
        self.touched_providers: set[str] = set()
        #: column -> value -> the touched entities whose current value it is (None is not
        #: indexed: no lookup asks for it), for the lookups of ``load`` by on_behalf_of (consumers),
        #: name and parent (providers); brought up to date only when a lookup needs it
        #: (:meth:`_touched_with`; a column's entry made by its first lookup: most transactions
        #: make none, and each makes these afresh)
        self._by_value: dict[str, dict[str, set[str]]] = {}
        #: column -> uuid -> the value it is indexed under in ``_by_value``
        self._indexed_as: dict[str, dict[str, str]] = {}
        #: the touched entities whose value may have changed since they were last indexed: each
        #: one that a job first touches (``_take``) and each one a job's fold went through (``settle``)
        self._unindexed_consumers: list[str] = []
        self._unindexed_providers: list[str] = []

    def begin(self, conn: sqlite3.Connection) -> None:
        """First thing in each write transaction: keep what is remembered only if no other
        connection has committed since this one's last transaction, and it is not too big."""
        version = conn.execute("PRAGMA data_version").fetchone()[0]
        known = len(self.known_consumers) + len(self.known_providers) + len(self.usage_counters)
        if version != self.data_version or known > self.LIMIT:
            self.forget()
        self.data_version = version
        self._clean()

    def check_log_not_behind(self, conn: sqlite3.Connection, head: int) -> None:
        """First in each write transaction, before it appends at ``head + 1``: refused
        (CorruptEvent, the audit's ``log_truncated``) while the projection records changes past
        the head - the log lost its last events (rows deleted, an older copy of its events
        restored). Appended there, a command's events would take the lost ones' positions: the
        audit would no longer see the loss, and a rebuild without force would forget the lost
        events (a tombstone among them). The projection is looked at (a scan of its consumers)
        only in this connection's first write transaction and when the head went back: positions
        are never taken back by a commit, so the head found lower than before is the only sign
        of events lost since. Otherwise this costs one comparison."""
        if self.head_seen is not None and head >= self.head_seen:
            self.head_seen = head
            return
        lost = _lost_tail(conn)
        if lost is not None:
            log.error("log.truncated_commands_refused", **lost.details())
            raise err.CorruptEvent(
                "Commands are refused: one appended now would take the position of an event the log "
                f"lost. {lost.message()}",
                **lost.details(),
            )
        self.head_seen = head

    def check_file(self, wal_files: bool = True) -> None:
        """Before a commit (and before any other work on the writer: an import, a rebuild, a
        snapshot): the path still names the file this connection writes to. SQLite goes
        on writing to a file deleted, renamed or replaced under it (its inode), so commands would
        be acknowledged into a file no one can open again. ``wal_files``: its -wal and -shm
        files too (a stat each: a batch checks them only before its commit)."""
        if self.file is None:
            return
        path, device, inode = self.file
        found = _look_up(path, "database file", path)
        if found is None or (found.st_dev, found.st_ino) != (device, inode):
            raise err.StorageError(
                f"The database file {path} was {'deleted or moved' if found is None else 'replaced'} "
                "while this store had it open: SQLite would go on writing to the file it opened, "
                "which the path no longer names, so nothing was committed. Put the file back, or "
                "close the store and open it again (commands acknowledged before were written to "
                "the file that was opened)",
                sqlite_error="file_replaced",
                path=path,
                outcome_unknown=False,
            )
        # The -wal file holds the commits not yet copied into the database file, and the -shm
        # file the locks of every connection writing it: with either deleted or replaced, another
        # process's open makes new ones - reading the store as it was before the log, writing
        # under a lock this connection does not see - while this one would go on committing into
        # files only it has open.
        for name, device, inode in self.wal_files if wal_files else ():
            found = _look_up(name, "file", path)
            if found is None or (found.st_dev, found.st_ino) != (device, inode):
                raise err.StorageError(
                    f"The file {name}, which SQLite keeps beside the database file (its write-ahead "
                    f"log and its index, the lock of every process writing it), was "
                    f"{'deleted or moved' if found is None else 'replaced'} while this store had it "
                    "open: another process opening the store would not see the commits this store "
                    "made since the log's last copy into the database file, nor wait for its "
                    "writes, so nothing was committed. Close every process that has the store "
                    "open (the last to close copies the log into the database file), then open it "
                    "again",
                    sqlite_error="file_replaced",
                    path=path,
                    outcome_unknown=False,
                )

    def flush(self, conn: sqlite3.Connection) -> None:
        now = self.now
        after = State(
            providers={u: now.providers[u] for u in self.touched_providers if u in now.providers},
            consumers={u: now.consumers[u] for u in self.touched_consumers if u in now.consumers},
            custom_classes=now.custom_classes,
        )
        self.before.custom_classes = self.stored_classes
        apply_changes(conn, persisted.changes(self.before, after, count_usages=True), self.usage_counters)
        self.stored_classes = set(now.custom_classes)
        self._clean()

    def _take(self, conn: sqlite3.Connection, kind: str, wanted: set[str], into: State) -> None:
        consumers = kind == "consumers"
        known = self.known_consumers if consumers else self.known_providers
        touched = self.touched_consumers if consumers else self.touched_providers
        current = getattr(self.now, kind)
        stored = getattr(self.before, kind)
        clone = persisted.clone_consumer if consumers else persisted.clone_provider
        missing = wanted - known
        if missing:
            loaded = State()
            if consumers:
                _load_consumers(conn, loaded, missing)
            else:
                _load_providers(conn, loaded, missing)
            known |= missing
            current.update(getattr(loaded, kind))
        first = wanted - touched
        for uuid in first:  # first touched by this transaction: keep it as stored
            if uuid in current:
                stored[uuid] = clone(current[uuid])
        touched |= first
        (self._unindexed_consumers if consumers else self._unindexed_providers).extend(first)
        target = getattr(into, kind)
        for uuid in wanted:
            if uuid in current:
                target[uuid] = current[uuid]

    def load(self, conn: sqlite3.Connection, command: Any, n: Needs) -> State:
        """The slice ``decide(command)`` reads (``n = needs(command)``), sharing this cache's objects.

        A command that creates a class first flushes the cache.
        """
        consumers = set(n.consumers)
        providers = set(n.providers)
        if isinstance(command, CreateResourceClass):
            self.flush(conn)
        for column, values, into in (
            ("on_behalf_of", n.migrations_of, consumers),
            ("name", n.provider_names, providers),
            ("parent", n.children_of, providers),
        ):
            if not values:
                continue
            if column == "on_behalf_of":
                table, touched = "p_consumers", self.touched_consumers
            else:
                table, touched = "p_providers", self.touched_providers
            for chunk in _chunks(sorted(values)):
                sql = f"SELECT uuid FROM {table} WHERE {column} IN ({_in_clause(len(chunk))})"
                into.update(r[0] for r in conn.execute(sql, chunk) if r[0] not in touched)
            into.update(self._touched_with(column, values))
        state = State()
        self._take(conn, "consumers", consumers, state)
        # a migration's decision reads its instance too
        linked = {c.on_behalf_of for c in state.consumers.values() if c.on_behalf_of} - state.consumers.keys()
        if linked:
            self._take(conn, "consumers", linked, state)
        for c in state.consumers.values():
            providers.update(c.allocations)
        self._take(conn, "providers", providers, state)
        custom = {rc for rc in n.resource_classes if rc.startswith("CUSTOM_")}
        unknown = sorted(custom - self.now.custom_classes)
        if unknown:
            sql = f"SELECT name FROM p_classes WHERE name IN ({_in_clause(len(unknown))})"
            found = {r[0] for r in conn.execute(sql, unknown)}
            self.stored_classes |= found
            self.now.custom_classes |= found
        state.custom_classes = custom & self.now.custom_classes
        return state

    def prefetch_consumers(self, conn: sqlite3.Connection, jobs: Sequence[Job]) -> None:
        """Load the consumers a batch's jobs name that this cache does not know, in one query:
        a lookup by key costs ~7.5 us alone and ~0.75 us per uuid in one ``IN (...)`` (a group
        commit of new consumers' claims: one lookup each). Only entry points (``needs``); what
        they lead to (migrations, providers) is loaded as each job asks. Sound in any order: the
        write lock is held, so a consumer loaded now is as stored until a job of this batch
        changes it, and the cache records that change (``settle``)."""
        if len(jobs) < 2:
            return
        missing = {u for job in jobs for u in job.needs.consumers} - self.known_consumers
        if len(missing) > 1:
            loaded = State()
            try:
                _load_consumers(conn, loaded, missing)
            except err.EvstoreError:
                return  # (a damaged row: the job that names it loads it and fails alone)
            self.known_consumers |= missing
            self.now.consumers.update(loaded.consumers)

    def settle(self, loaded_consumers: Iterable[str], loaded_providers: Iterable[str], after: State) -> None:
        """Record what a job's fold did to its slice (entities created, changed or forgotten):
        ``loaded_*``, the uuids of the slice as loaded, and ``after``, the slice as folded."""
        consumers = after.consumers.keys() | loaded_consumers
        for uuid in consumers:
            self.known_consumers.add(uuid)
            self.touched_consumers.add(uuid)
            if uuid in after.consumers:
                self.now.consumers[uuid] = after.consumers[uuid]
            else:
                self.now.consumers.pop(uuid, None)
        self._unindexed_consumers.extend(consumers)
        providers = after.providers.keys() | loaded_providers
        for uuid in providers:
            self.known_providers.add(uuid)
            self.touched_providers.add(uuid)
            if uuid in after.providers:
                self.now.providers[uuid] = after.providers[uuid]
            else:
                self.now.providers.pop(uuid, None)
        self._unindexed_providers.extend(providers)
        self.now.custom_classes |= after.custom_classes

    def _touched_with(self, column: str, values: Collection[str]) -> list[str]:
        """The entities this transaction touched whose current ``column`` (``on_behalf_of`` of a
        consumer, ``name`` or ``parent`` of a provider) is one of ``values``, those it forgot
        (deleted, absent) left out. From the index kept by value, not a walk of every touched
        entity: a lookup costs what it finds, and the commands of a group commit that look one
        up (a consumer's deletion, a provider's creation, renaming or deletion) were quadratic in
        its size (up to ``max_batch``)."""
        current: Mapping[str, Any]
        columns: tuple[str, ...]
        if column == "on_behalf_of":
            pending, current, columns = self._unindexed_consumers, self.now.consumers, ("on_behalf_of",)
        else:
            pending, current, columns = self._unindexed_providers, self.now.providers, ("name", "parent")
        if pending:
            for indexed in columns:
                by_value = self._by_value.setdefault(indexed, {})
                indexed_as = self._indexed_as.setdefault(indexed, {})
                for uuid in pending:
                    entity = current.get(uuid)
                    value = None if entity is None else getattr(entity, indexed)
                    old = indexed_as.get(uuid)
                    if value == old:
                        continue
                    if old is not None:
                        by_value[old].discard(uuid)
                    if value is None:
                        del indexed_as[uuid]
                    else:
                        indexed_as[uuid] = value
                        by_value.setdefault(value, set()).add(uuid)
            pending.clear()
        found = self._by_value.get(column)
        if not found:  # (nothing touched is indexed under it)
            return []
        return [uuid for value in values for uuid in found.get(value, ())]


def _load_providers(conn: sqlite3.Connection, state: State, uuids: set[str]) -> None:
    for chunk in _chunks(sorted(uuids)):
        for row in conn.execute(
            "SELECT uuid, name, parent, root, generation, inventories, usages FROM p_providers "
            f"WHERE uuid IN ({_in_clause(len(chunk))})",
            chunk,
        ):
            prov = persisted.provider_from_row(row)
            state.providers[prov.uuid] = prov


def _process(conn: sqlite3.Connection, tail: _Tail, job: Job, cache: _WriterCache) -> Receipt:
    key = job.idempotency_key
    if key is not None:
        row = conn.execute("SELECT fingerprint, receipt FROM idempotency WHERE key = ?", (key,)).fetchone()
        if row is not None:
            if not job.same_command(row[0]):
                raise err.IdempotencyConflict(
                    f"Idempotency key {key!r} was already used for a different command (a retry repeats "
                    "its command exactly; give a new command a new key)",
                    idempotency_key=key,
                )
            return Receipt.stored(key, row[1], tail.position)
    n = job.needs
    try:
        state = cache.load(conn, job.command, n)
        events = decide(job.command, state)
        # (read now, so that a damaged counter row fails this job alone, not its whole batch
        # when the write-back meets it: see run_batch)
        _load_usage_counters(conn, _counters_touched(state, events), cache.usage_counters)
    except (err.EvstoreError, sqlite3.Error, MemoryError, OSError):
        # (SQLite's own failures - SQLITE_NOMEM is a MemoryError - fail the batch: SQLite may have
        # rolled its transaction back, see run_batch)
        raise
    except Exception as exc:
        # Nothing written yet: this job fails alone, not every job of its group commit.
        raise err.StorageError(
            f"Cannot run {type(job.command).__name__}: {shown(exc, 200)} (if the projection is damaged, "
            "`evstore audit` says where and `evstore rebuild` refolds it from the log)",
            outcome_unknown=False,
        ) from exc
    # From here on the job writes: nothing may reject it any more (see run_batch).
    try:
        # (the slice's keys before the fold: what settle records besides what the fold left)
        loaded_consumers, loaded_providers = list(state.consumers), list(state.providers)
        appended = append_events(tail, events, job.metadata_json) if events else []
        for position, event in appended:
            evolve(state, event, position)
        cache.settle(loaded_consumers, loaded_providers, state)
        consumers, providers = state.consumers, state.providers
        receipt = Receipt(
            tuple([p for p, _ in appended]),
            {c: _generation(consumers.get(c)) for c in sorted(n.consumers | consumers.keys())},
            {u: providers[u].generation for u in sorted(providers)},
        )
        if key is not None:
            conn.execute("INSERT INTO idempotency VALUES (?,?,?)", (key, job.fingerprint, receipt.to_json()))
    except err.EvstoreError as exc:
        raise BatchAborted(f"job failed after it started writing: {exc}") from exc
    return receipt


def _generation(consumer: ConsumerState | None) -> int | None:
    """A consumer's generation in a receipt (None: absent, as ``State.consumer`` makes it)."""
    return None if consumer is None else consumer.generation


class _CommitFailed(Exception):
    """The COMMIT of a batch failed with ``error`` (not busy): whether it committed is unknown - a
    failed write or sync of the log's last frame can leave the commit in the -wal file, which the
    next open's recovery finds (see :func:`_commit_failed_error`). ``outcomes``: each job's, as
    the batch decided them (set by :func:`run_batch`): a refused job wrote nothing, whatever
    became of the COMMIT, so it keeps its refusal; only the accepted ones' outcome is unknown."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error
        self.outcomes: list[Outcome] | None = None


def _commit(conn: sqlite3.Connection) -> None:
    """COMMIT a write transaction; a failure other than busy raised as :class:`_CommitFailed`."""
    try:
        conn.execute("COMMIT")
    except sqlite3.OperationalError as exc:
        if _is_busy(exc):  # (the transaction is still open, not committed: rolled back and retried whole)
            raise
        raise _CommitFailed(exc) from exc
    except (sqlite3.Error, MemoryError, OSError) as exc:
        raise _CommitFailed(exc) from exc


class BatchAborted(RuntimeError):
    """A job failed after writing; the whole batch is rolled back (a bug or a storage fault)."""


def _ask_box(wanted: Callable[[B], list[bool]], box: list[B]) -> list[bool]:
    """``wanted`` of the batch in ``box`` (emptied once the batch is delivered: none then)."""
    return wanted(box[0]) if box else []


def _not_run() -> err.StorageError:
    """The outcome of a job whose caller stopped waiting before it began (only logged: no one hears it)."""
    return err.StorageError("Not run: its caller stopped waiting before it began", not_run=True)


def run_batch(
    conn: sqlite3.Connection,
    jobs: Sequence[Job],
    cache: _WriterCache,
    wanted: Callable[[], list[bool]] | None = None,
) -> list[Outcome]:
    """One write transaction for a batch of jobs (group commit), each job all-or-nothing.

    A job is rejected (EvstoreError) only before it writes anything: the idempotency check,
    loading and ``decide`` all come first. So a rejected job needs no savepoint to leave no
    trace; an unexpected failure after a job started writing rolls the whole batch back and
    every job in it fails (none was acknowledged).

    ``wanted``: whether each job's caller still waits, asked once the write lock is taken (the
    writer may have waited for it): a job whose caller stopped waiting is not run, and its
    outcome says so (``not_run``).
    """
    outcomes: list[Outcome] = []
    start: int | None = None
    own_tip = cache.own_tip  # (what it was, for a batch that fails: see there)
    cache.check_file(wal_files=False)  # (and again, with its -wal and -shm, before the commit)
    _end_leftover(conn)
    conn.execute("BEGIN IMMEDIATE")
    try:
        keep = None if wanted is None else wanted()
        if keep is not None and not all(keep):
            jobs = [job for job, kept in zip(jobs, keep, strict=True) if kept]
        cache.begin(conn)
        tail = _read_tail(conn)
        cache.check_log_not_behind(conn, tail.position)
        start = tail.position
        if cache.history_through is None:  # (first in this connection, or another one wrote since)
            drop_history_past_head(conn, start)
        cache.prefetch_consumers(conn, jobs)
        for job in jobs:
            try:
                outcomes.append(_process(conn, tail, job, cache))
            except err.EvstoreError as exc:
                if isinstance(exc, err.StorageError):
                    # (a damaged projection row, a damaged receipt: found before the job wrote
                    # anything - see _process -, so nothing of it is written, as for any error
                    # before a COMMIT)
                    exc.details.setdefault("outcome_unknown", False)
                outcomes.append(exc)
            if not conn.in_transaction:
                # SQLite rolls a transaction back itself on some errors (SQLITE_FULL, SQLITE_IOERR,
                # SQLITE_NOMEM, ...): the next statements would each commit on their own - the
                # jobs after this one, half a batch - so the batch stops here, rolled back whole.
                raise BatchAborted(
                    f"SQLite rolled the transaction back under {type(job.command).__name__} "
                    f"({shown(outcomes[-1], 200)})"
                )
        if keep is not None and len(jobs) < len(keep):
            ran, not_run = iter(outcomes), _not_run()
            outcomes = [next(ran) if kept else not_run for kept in keep]
        insert_appended(conn, tail)
        if tail.position > start:
            index_history(conn, cache, tail)
        if not conn.in_transaction:  # (as above: nothing written outside the batch's transaction)
            raise BatchAborted("SQLite rolled the transaction back while the batch wrote")
        try:
            cache.flush(conn)
        except sqlite3.IntegrityError as exc:
            raise err.ProjectionCorrupt(
                f"Writing the projection failed ({exc}): it holds rows the store did not expect, so it is "
                "damaged (`evstore audit` says where; `evstore rebuild` refolds it from the log)"
            ) from None
        cache.check_file()
        try:
            _commit(conn)
        except _CommitFailed as failed:
            # (each job's outcome goes with it: see _batch_error. And no longer this frame's,
            # which the rejections' tracebacks hold: see the end of this function)
            failed.outcomes, outcomes = outcomes, []
            raise
        cache.head_seen = tail.position
    except BaseException:
        cache.forget()  # (it holds what was rolled back)
        if start is not None:
            cache.drop_own(after=start)
            # (the tip of what it keeps is what it was before this batch, not the batch's own
            # last event: that one, not in the log, read as events the log lost. Nor the log's
            # last event before the batch, which this writer may not have appended: after a
            # restore replaced its events, that tip would vouch for the keys of events the log
            # no longer holds)
            cache.own_tip = own_tip if cache.own else None
        _rollback(conn)
        raise
    # A rejection's traceback holds this frame (and its callers', through ``f_back``), and the
    # outcomes hold the rejection: were this frame to keep them, the batch (its jobs, receipts,
    # slices, and on the loop their futures) would be a reference cycle, left for the cyclic
    # collector - which would scan it in every collection meanwhile. The frame lets them go.
    try:
        return outcomes
    finally:
        del outcomes


# --- the async facade -------------------------------------------------------------------------


def parse_sqlite_url(url: str) -> tuple[str, dict[str, str]]:
    """``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``sqlite://`` (memory); ``?k=v`` options."""
    if not url.startswith("sqlite://"):
        raise err.InvalidInput(
            f"Not a SQLite URL: {err.redact_url(url)!r}: give sqlite:///relative.db, sqlite:////abs.db or "
            "sqlite:// (in memory)"
        )
    rest = url[len("sqlite://") :]
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
    # (a key without ``=`` is a key with an empty value, checked as any other: ``?create`` and a
    # misspelt ``?synchronus`` were dropped without a word, and the store opened with defaults)
    pairs = [part.split("=", 1) if "=" in part else [part, ""] for part in query.split("&") if part]
    options = dict(pairs)
    if len(options) < len(pairs):
        twice = sorted({k for k, _ in pairs if [n for n, _ in pairs].count(k) > 1})
        raise err.InvalidInput(
            f"The SQLite URL {err.redact_url(url)!r} sets {', '.join(twice)} more than once", field=twice[0]
        )
    if rest in ("", "/", "/:memory:"):
        return ":memory:", options
    if not rest.startswith("/"):
        raise err.InvalidInput(
            f"SQLite URL must look like sqlite:///relative.db or sqlite:////abs.db: {err.redact_url(url)!r}"
        )
    return rest[1:], options


#: what ``open_store(sqlite_url, **options)`` (or ``?k=v`` in the URL) may set on this backend
OPTIONS = ("synchronous", "busy_timeout", "create", "upgrade")


def _check_keyword_options(options: dict[str, Any]) -> None:
    """Keywords are typed, as PostgreSQL's are: only the URL's ``?k=v`` are text to parse (a
    keyword ``create="false"`` or ``create=0`` refused a missing store here but is refused itself
    on PostgreSQL; ``busy_timeout="30"`` opened here where ``command_timeout="30"`` is refused)."""
    for name in ("create", "upgrade"):
        validate_flag_option(options.get(name, False), name)
    timeout = options.get("busy_timeout", 0)
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise _bad_busy_timeout(timeout)
    _sync_mode(options.get("synchronous", "FULL"))


def _bad_busy_timeout(given: object) -> err.InvalidInput:
    """The refusal of a ``busy_timeout`` that is no duration SQLite can wait."""
    return err.InvalidInput(
        "busy_timeout must be a number of seconds: 0 (do not wait for another connection's lock) or from "
        "0.001 (SQLite waits whole milliseconds: less would be 0, no wait) to 86400, "
        f"got {shown(given, 40)}",
        field="busy_timeout",
    )


def _busy_timeout_ok(seconds: float) -> bool:
    """0, or a millisecond to a day (nan and inf refused: see :func:`_bad_busy_timeout`)."""
    return seconds == 0 or 0.001 <= seconds <= 86_400


def _sync_mode(value: object) -> str:
    """``synchronous`` (a keyword's, or the URL's text) as SQLite's mode name."""
    mode = value.upper() if isinstance(value, str) else value
    if mode not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise err.InvalidInput(
            f"synchronous must be OFF, NORMAL, FULL or EXTRA, got {shown(mode, 40)}", field="synchronous"
        )
    return str(mode)


def _option_from_url(name: str, text: str) -> Any:
    """A ``?k=v`` option of the URL, from its text."""
    if name == "synchronous":
        return _sync_mode(text)
    if name == "busy_timeout":
        try:
            seconds = float(text)
        except ValueError:
            seconds = math.nan
        if not _busy_timeout_ok(seconds):  # (here too: a keyword may replace it, unchecked below)
            raise _bad_busy_timeout(text)
        return seconds
    if name in ("create", "upgrade"):
        return flag_option_from_url(text, name)
    return text


class SqliteBackend:
    """Log and projection in one SQLite file; one writer connection, one reader connection."""

    def __init__(self, url: str, **options: Any) -> None:
        self.url = url
        path, url_options = parse_sqlite_url(url)
        _check_keyword_options(options)
        unknown = sorted((set(url_options) | set(options)) - set(OPTIONS))
        if unknown:
            raise err.InvalidInput(
                f"Unknown SQLite store option(s) {', '.join(unknown)}; known: {', '.join(OPTIONS)}"
                + store_keyword_hint(unknown),
                field=unknown[0],
            )
        # (the URL's values are checked also where a keyword overrides them: `--url
        # 'sqlite:///x.db?create=maybe'` opened, the CLI's create=False winning unchecked)
        chosen = {name: _option_from_url(name, text) for name, text in url_options.items()}
        chosen.update(options)
        self.path = path
        #: the file as the process's current directory names it now (SQLite keeps the full path).
        #: Joined, not normalized: ``link/..`` is the parent of the link's target for the kernel
        #: and SQLite, where ``os.path.abspath`` drops both (another file, or none)
        self._abs_path = path if os.path.isabs(path) else os.path.join(os.getcwd(), path)
        self._parent_dir = os.path.dirname(os.path.abspath(path))
        self.synchronous = _sync_mode(chosen.get("synchronous", "FULL"))
        busy_timeout = float(chosen.get("busy_timeout", 30.0))
        if not _busy_timeout_ok(busy_timeout):  # (also refuses nan and inf)
            raise _bad_busy_timeout(busy_timeout)
        self.busy_timeout_ms = int(busy_timeout * 1000)
        #: seconds: how long a transaction waits for another connection's write lock, in all
        self.busy_timeout = busy_timeout
        #: False: refuse a database that holds no store instead of creating the tables in it
        self.create = bool(chosen.get("create", True))
        #: False: refuse a store an older evstore wrote instead of upgrading it (which closes it
        #: to the older evstore processes still using it)
        self.upgrade = bool(chosen.get("upgrade", True))
        #: the schema version this open upgraded the store from (None: it was current, or new)
        self.upgraded_from: int | None = None
        #: what this open repaired in a store of the current version (None: nothing to repair)
        self.repaired: SchemaRepair | None = None
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        #: True while a store this open may not change (``upgrade`` False) stays in the
        #: rollback-journal mode its file came in (a ``VACUUM INTO`` copy, a backup tool's): the
        #: switch to WAL rewrites the file's header, so it waits for the first write (see
        #: :meth:`_wal_before_write`); what only reads leaves the file byte for byte as it was
        self._wal_deferred = False
        #: used on the writer's thread only
        self._cache = _WriterCache()
        #: set when the store closes (or its open is given up): waits for another connection's
        #: lock stop at their next slice. One per open: a background close of a cancelled open's
        #: connections must not stop the next open's waits
        self._stop = threading.Event()

    @property
    def memory(self) -> bool:
        return self.path == ":memory:"

    async def _connect(
        self, stop: threading.Event, deadline: float, writer: bool = False
    ) -> aiosqlite.Connection:
        """A connection to the file, in WAL mode (unless the switch waits for the first write,
        :attr:`_wal_deferred`: a connection finds a file switched since by its header). Its
        pragmas wait for another connection's lock in slices (see :data:`BUSY_SLICE_MS`), until
        the open's ``deadline`` (``time.monotonic()``), and stop waiting once ``stop`` is set (the
        open was cancelled, the store closes). The writer's busy handler keeps waiting one slice
        at a time (its waits are retried by :func:`_retry_busy`); another connection's, the whole
        busy_timeout."""
        pending = aiosqlite.connect(self.path, isolation_level=None)
        # A daemon thread: a store its program never closed must not keep the process from
        # exiting (aiosqlite's thread is not one, and once the loop is gone nothing can close the
        # connection: the interpreter waited for it for ever). Ending then is a crash of an idle
        # writer, which SQLite's WAL recovers from on the next open; commands still queued had no
        # one left to answer. (``_thread``: aiosqlite's, pinned in pyproject as ``_execute`` is;
        # before 0.22 the connection was itself the thread.)
        thread = pending if isinstance(pending, threading.Thread) else getattr(pending, "_thread", None)
        if isinstance(thread, threading.Thread):
            thread.daemon = True
        conn = await pending
        timeout, memory, synchronous = max(0.0, deadline - time.monotonic()), self.memory, self.synchronous
        wal = not (memory or self._wal_deferred)
        sliced = min(self.busy_timeout_ms, BUSY_SLICE_MS)
        whole = self.busy_timeout_ms

        stopped = _stopper(stop)

        def setup() -> None:
            c = conn._conn
            c.execute(f"PRAGMA busy_timeout = {sliced}")
            if wal:
                # (a lock refused without waiting fails at once, as before: the open's error says so)
                _wait_busy(lambda: c.execute("PRAGMA journal_mode = WAL"), timeout, stopped, quick=False)
            c.execute(f"PRAGMA synchronous = {synchronous}")
            if not writer:
                c.execute(f"PRAGMA busy_timeout = {whole}")

        try:
            await conn._execute(setup)  # type: ignore[no-untyped-call]
        except asyncio.CancelledError:
            # (its caller gave up: closing waits on the connection's thread behind the pragma
            # still waiting there for the lock - a slice at most, once told to stop - so it
            # closes in the background)
            stop.set()
            _close_later(conn)
            raise
        except BaseException:
            # (closed, not left to the daemon thread: its file handle and thread would stay
            # until the process ends)
            await conn.close()
            raise
        return conn

    async def open(self) -> None:
        # (first, before anything awaits: a close() from now on stops this open's waits)
        self._stop = stop = threading.Event()
        # (one deadline for every wait of the open, its read-only looks' included: each waits what
        # is left of busy_timeout, where each look waited sqlite3's default 5 s besides)
        began = time.monotonic()
        deadline = began + self.busy_timeout

        async def look(check: Callable[[str, float, threading.Event], T]) -> T:
            try:
                return await asyncio.to_thread(check, self.path, deadline, stop)
            except asyncio.CancelledError:
                stop.set()  # (its thread stops waiting at its next slice)
                raise
            except (MemoryError, OSError) as exc:  # (as the writer's connection says them, below)
                raise _cannot_open(self.url, exc) from None

        if not self.memory:
            parent = self._parent_dir
            if not await asyncio.to_thread(os.path.isdir, parent):
                # (NotFound, as every missing path is, export's -o directory included: README)
                raise err.NotFound(f"Cannot open {self.url}: directory {parent} does not exist")
            kind = await asyncio.to_thread(not_a_regular_file, self.path)
            if kind is not None:  # (SQLite would wait for ever on a FIFO's other end)
                raise err.InvalidInput(
                    f"Cannot open {self.url}: {self.path} {kind}, not a database file (a SQLite store is a "
                    "regular file, made on first open)"
                )
            missing = await asyncio.to_thread(_link_target_dir_missing, self.path)
            if missing is not None:
                target, directory = missing
                raise err.NotFound(
                    f"Cannot open {self.url}: directory {directory} does not exist ({self.path} is a "
                    f"symbolic link to {target})"
                )
        if not self.create and self.memory:
            raise err.NotFound(
                f"No evstore store in {self.url}: an in-memory store starts empty, so there is nothing "
                "to open (give a database file, e.g. sqlite:///path.db)"
            )
        if not self.create and await look(_holds_no_store):
            # checked read-only first: opening for writing would already turn the file into a database
            reason = await look(_no_store_reason)
            if reason is None:
                # (tables of evstore's names but other columns are another application's, and a
                # store that lost its meta table or schema version is damaged: said as the open
                # that would create the store says it)
                await look(_refuse_damaged)
            # (another process may have created the store since the first look - its tables and
            # version are committed together: a look now that finds them is no damage, it opens)
            if await look(_holds_no_store):
                if reason is None:
                    raise err.SchemaVersionError(
                        f"{self.path} has evstore's tables but no schema version (its meta row is gone): "
                        "the file was damaged; evstore does not guess its version",
                        found=None,
                    )
                raise err.NotFound(
                    f"No evstore store in {self.path}: {reason} (check the path, or create a store, e.g. "
                    "with `evstore demo --db ...`)"
                )
        if not self.upgrade and not self.memory:
            # (read-only, before the writer's connection: its PRAGMA journal_mode = WAL rewrites
            # the header of a file in rollback-journal mode - a copy made with VACUUM INTO - so
            # a refusal there would not be "nothing written")
            try:
                self._wal_deferred = await look(_refuse_changes_read_only)
            except err.SchemaVersionError:
                # Another process's open may be upgrading or repairing the store, in a transaction
                # that holds the write lock: wait for it as a writer would, then look again (a
                # store still older, or still lacking objects, is refused as before).
                await look(_wait_for_writer)
                self._wal_deferred = await look(_refuse_changes_read_only)

        def schema(conn: sqlite3.Connection) -> tuple[int | None, SchemaRepair | None]:
            # (a store to create or change after all - made empty, or damaged, since the look
            # above - is switched to WAL first, as every store written to is)
            if self._wal_deferred and not _snapshot(conn, lambda: _schema_state(conn, self.path)):
                self._wal_before_write(conn)
            return _ensure_schema(conn, self.create, self.path, self.upgrade)

        try:
            self._writer = await self._connect(stop, deadline, writer=True)
            # (creating or upgrading the schema waits for the write lock as a command does, and
            # says so as a command does when it waited longer than busy_timeout: the hint below
            # is for the connection's pragmas, whose errors _on_writer does not convert)
            self.upgraded_from, self.repaired = await self._on_writer(
                lambda conn: _retry_busy(
                    lambda: schema(conn), max(0.0, deadline - time.monotonic()), said=self.busy_timeout
                ),
                writes=False,
            )
            if not self.memory:
                given = self._abs_path
                cache = self._cache
                cache.file = await _on_thread(self._writer, lambda conn: _file_opened(conn, given))
                cache.wal_files = await _on_thread(self._writer, _wal_files_opened)
            self._reader = self._writer if self.memory else await self._connect(stop, deadline)
        except sqlite3.Error as exc:
            await self.close()
            # (as a command's error says it: which SQLite error, "busy" for a lock that stayed)
            details = {"sqlite_error": type(exc).__name__, **_damage_reason(exc)}
            hint = _damage_hint(exc)
            if "readonly" in str(exc) or "unable to open" in str(exc):
                hint = (
                    " (evstore needs to write the file and its directory, for its -wal and -shm files, "
                    "even to read it: work on a writable copy)"
                )
            elif "locked" in str(exc) or "busy" in str(exc):
                details["sqlite_error"] = "busy"
                if time.monotonic() - began >= self.busy_timeout:
                    hint = (
                        f" (another connection held it locked for longer than busy_timeout "
                        f"({self.busy_timeout:g} s): retry, or open the store with a longer busy_timeout)"
                    )
                else:  # (SQLite refuses some locks at once, for a file written with a rollback journal)
                    hint = (
                        " (another connection holds it locked, and SQLite refused without waiting, as it "
                        "does while another connection writes to a file that is not in WAL mode: retry "
                        "once that connection is done)"
                    )
            if _is_disk_full(exc):  # (an upgrade's refold, a new store's tables: found no room)
                raise _disk_full_error(f"Cannot open {self.url}: {exc}") from None
            raise err.StorageError(f"Cannot open {self.url}: {exc}{hint}", **details) from None
        except (MemoryError, OSError) as exc:
            # (SQLite's SQLITE_NOMEM, which sqlite3 raises as MemoryError, at a pragma of a
            # connection: typed, as SQLite's other errors are)
            await self.close()
            raise _cannot_open(self.url, exc) from None
        except asyncio.CancelledError:
            # (as in _connect: not waited for, the writer's thread may still wait for the lock,
            # until its next slice)
            stop.set()
            for conn in {id(c): c for c in (self._reader, self._writer) if c is not None}.values():
                _close_later(conn)
            self._reader = self._writer = None
            raise
        except BaseException:
            await self.close()
            raise

    def stop_waiting(self) -> None:
        """Work on the writer that waits for another connection's write lock stops waiting (at
        the end of its current slice, ~50 ms) and fails with StoreClosed, nothing written; work
        that holds the lock goes on to its end. Called by the store's close() for an open still
        in progress, and by this backend's close() (the store's writer is done by then: commands
        whose callers wait are answered first, within busy_timeout)."""
        self._stop.set()

    async def close(self) -> None:
        self.stop_waiting()
        try:
            if self._writer is not None and self._cache.own:
                cache = self._cache
                try:
                    await _on_thread(self._writer, lambda conn: flush_history(conn, cache))
                except Exception as exc:  # (only the index's lag is at stake: reads still find everything)
                    log.warning("history.flush_failed", error=repr(exc))
        finally:
            # (even if the flush is cancelled: aiosqlite's threads are not daemons, and an open
            # connection would keep the process from exiting)
            try:
                for conn in {id(c): c for c in (self._reader, self._writer) if c is not None}.values():
                    try:
                        await conn.close()
                    except (sqlite3.Error, MemoryError, OSError) as exc:
                        # (each connection closed whatever the other's close said; what they
                        # committed stays committed - in the file, or in its -wal file, which the
                        # next open recovers - so the close goes on: logged, as the flush's failure)
                        log.warning("store.close_failed", url=self.url, error=shown(exc, 200))
            finally:
                self._reader = self._writer = None
                self._cache = _WriterCache()  # (a reopened store must not trust what this one remembered)

    def abandon(self) -> None:
        self._stop.set()
        for conn in {id(c): c for c in (self._reader, self._writer) if c is not None}.values():
            _close_unheard(conn)
        self._reader = self._writer = None

    def _wal_before_write(self, conn: sqlite3.Connection) -> None:
        """On the writer's thread, before a write (outside a transaction): the switch to WAL an
        open left for the first write (:attr:`_wal_deferred`), so that every store written to is
        in WAL mode, its durability and concurrency what they are for any other. Busy while
        another connection reads the file: raised as SQLite's busy error, for :func:`_retry_busy`."""
        if not self._wal_deferred:
            return
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise err.StorageError(
                f"Cannot write to {self.url}: SQLite left its file in journal mode {mode!r} instead of "
                "switching it to WAL, which evstore writes in (nothing was written)"
            )
        self._wal_deferred = False
        conn.execute("SELECT count(*) FROM sqlite_master")  # (in WAL mode now: a read opens its files)
        if self._cache.file is not None:  # (at the open: it looks once the file is known)
            self._cache.wal_files = _wal_files_opened(conn)

    def _wal_then(self, conn: sqlite3.Connection, fn: Callable[[], T]) -> T:
        """``fn`` (a write transaction) after :meth:`_wal_before_write`, for :func:`_retry_busy`."""
        self._wal_before_write(conn)
        return fn()

    async def _on_writer(self, fn: Callable[[sqlite3.Connection], T], writes: bool = True) -> T:
        """Run ``fn`` on the writer's thread. Its waits for another connection's lock
        (:func:`_retry_busy`) stop at the next slice once its caller gives up (cancelled) or the
        store closes: the writer does one thing at a time, and what is queued behind - commands,
        the close - would have waited up to busy_timeout for work no one waits for. ``writes``:
        the file is switched to WAL first, if its open left that for the first write."""
        cache = self._cache
        gave_up = threading.Event()
        between = self._stop_when(gave_up)

        def call(conn: sqlite3.Connection) -> T:
            cache.forget()  # (``fn`` may write: what the command path remembers may go stale)
            # (an import, a rebuild, a snapshot: acknowledged into a file the path no longer
            # names, as a command would be; see _WriterCache.check_file)
            cache.check_file()
            _waits.between = between
            try:
                _end_leftover(conn)
                if writes and self._wal_deferred:
                    _retry_busy(lambda: self._wal_before_write(conn), self.busy_timeout)
                return fn(conn)
            finally:
                _waits.between = None

        try:
            return await _on_thread(self._writer, call)
        except asyncio.CancelledError:
            gave_up.set()
            raise

    def _stop_when(
        self, gave_up: threading.Event | None = None, wanted: Callable[[], list[bool]] | None = None
    ) -> Callable[[], None]:
        """What a wait for another connection's lock asks between slices: it stops, with nothing
        written, once the store closes, or no caller waits any more (``gave_up`` is set, or
        ``wanted`` says none of a batch's callers still waits)."""
        stop = self._stop

        def between() -> None:
            if stop.is_set():
                raise err.StoreClosed(
                    "The store was closed while this waited for another connection's write lock: "
                    "it was not run (nothing was written)",
                    not_run=True,
                )
            if (gave_up is not None and gave_up.is_set()) or (wanted is not None and not any(wanted())):
                raise _not_run()

        return between

    async def _on_reader(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def read(conn: sqlite3.Connection) -> T:
            # (a read transaction a failed COMMIT left open would show every later read the data of
            # that moment: see _snapshot)
            _end_leftover(conn)
            return fn(conn)

        return await _on_thread(self._reader, read)

    async def run_jobs(self, jobs: Sequence[Job]) -> list[Outcome]:
        cache = self._cache
        between = self._stop_when()

        def run(conn: sqlite3.Connection) -> list[Outcome]:
            try:
                return _retry_busy(
                    lambda: self._wal_then(conn, lambda: run_batch(conn, jobs, cache)),
                    self.busy_timeout,
                    between,
                )
            except Exception as exc:
                failed = _batch_error(exc, jobs)
                if isinstance(failed, list):
                    return failed
                raise failed from None

        return await _on_thread(self._writer, run)

    #: batches one ``drain`` runs before it lets other work on the writer connection have a turn
    DRAIN_BATCHES = 8

    async def drain(
        self,
        take: Callable[[], tuple[list[Job], B] | None],
        deliver: Callable[[B, list[Outcome] | BaseException], None],
        wanted: Callable[[B], list[bool]] | None = None,
    ) -> None:
        """Run queued batches on the writer's thread until the queue is empty.

        ``take`` (called on the writer thread) pops the next batch and a token for it; each
        batch's outcomes, or the exception that failed the whole batch, go to ``deliver(token,
        ...)`` on the event loop as soon as the batch commits, while the thread goes on with the
        next batch. After :attr:`DRAIN_BATCHES` batches it returns, so other work queued for the
        writer connection (snapshots, rebuilds) is not starved under load; the caller drains again.

        ``wanted(token)``: whether each job's caller still waits (read on the writer thread: a
        future's ``done()``, which only the loop changes). While a batch waits for another
        connection's write lock, it is given up once none waits (each job's outcome ``not_run``),
        and once the lock is taken the jobs whose callers gave up are left out; the store
        closing gives it up too (StoreClosed, ``not_run``).
        """
        loop = asyncio.get_running_loop()
        cache = self._cache

        def work(conn: sqlite3.Connection) -> None:
            for _ in range(self.DRAIN_BATCHES):
                taken = take()
                if taken is None:
                    return
                jobs, token = taken
                # (the batch reached through a box emptied once it is delivered: the frames a
                # rejection's traceback keeps - run_batch's, the retries' - must not hold its
                # futures, which hold the rejection: a reference cycle, see the end of run_batch)
                box = [token]
                still = None if wanted is None else functools.partial(_ask_box, wanted, box)
                result: list[Outcome] | BaseException
                try:
                    result = _retry_busy(
                        functools.partial(
                            self._wal_then, conn, functools.partial(run_batch, conn, jobs, cache, still)
                        ),
                        self.busy_timeout,
                        self._stop_when(wanted=still),
                    )
                except Exception as exc:
                    result = _batch_error(exc, jobs)
                box.clear()
                loop.call_soon_threadsafe(deliver, token, result)
                del taken, jobs, token, result  # (not kept by this frame: see the end of run_batch)

        await _on_thread(self._writer, work)

    async def settle(self) -> None:
        """Wait until the writer connection's thread has done what it was given before this call
        (a drain whose caller was cancelled goes on: see ``AllocationStore._write_queued``). Its
        calls run in order, so a call that does nothing ends after them."""
        with contextlib.suppress(err.StoreClosed):
            await _on_thread(self._writer, _nothing)

    async def check_followable(self) -> None:
        """The path still names the file this store opened (``file_replaced`` if not, as a
        command would be refused): every commit checks that first, so no append can come to a
        file deleted, moved or replaced under the store, and a subscriber would wait for ever."""
        cache = self._cache
        await self._on_reader(lambda conn: cache.check_file())

    async def head(self) -> int:
        def q(conn: sqlite3.Connection) -> int:
            row = conn.execute("SELECT max(position) FROM events").fetchone()
            return int(row[0] or 0)

        return await self._on_reader(q)

    async def read_raw(self, after: int, limit: int) -> list[RawEvent]:
        def q(conn: sqlite3.Connection) -> list[RawEvent]:
            return list(map(RawEvent._make, conn.execute(READ_PAGE, (after, limit)).fetchall()))

        return await self._on_reader(q)

    async def read_payloads(self, after: int, limit: int) -> list[PayloadRow]:
        def q(conn: sqlite3.Connection) -> list[PayloadRow]:
            sql = (
                "SELECT position, type, schema_version, data FROM events "
                "WHERE position > ? ORDER BY position LIMIT ?"
            )
            return conn.execute(sql, (after, limit)).fetchall()

        return await self._on_reader(q)

    async def read(self, after: int, limit: int) -> list[RecordedEvent]:
        def q(conn: sqlite3.Connection) -> list[RecordedEvent]:
            # (decoded on the reader's thread, as history is: a large page decoded on the event
            # loop stalled it, e.g. 183 ms for read(0, 10**9) on 50k events)
            cursor = conn.execute(READ_PAGE, (after, limit))
            out: list[RecordedEvent] = []
            # (fetchall holds the GIL for the whole page: a slice at a time. The collector is left
            # on: what a decoded event keeps is untracked, see decode_raw)
            while rows := cursor.fetchmany(1000):
                out.extend(decode_rows(rows))
            return out

        return await self._on_reader(q)

    async def read_entities(
        self,
        entities: Sequence[str],
        after: int,
        limit: int,
        until: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]:
        """The events naming one of ``entities`` in ``(after, until]``, in order, at most ``limit``;
        with ``types``, only those of these types (the others are not decoded)."""
        keys = list(entities)
        last = until if until is not None else MAX_POSITION
        only = list(types) if types is not None else None
        of_type = "" if only is None else f"AND e.type IN ({_in_clause(len(only))}) "

        def q(conn: sqlite3.Connection) -> list[RecordedEvent]:
            through = history_through(conn)
            found: list[RecordedEvent] = []
            if after < through:  # the indexed part
                upto = min(last, through)
                rows = conn.execute(
                    f"SELECT {', '.join('e.' + c.strip() for c in EVENT_COLUMNS.split(','))} FROM events e "
                    "WHERE e.position IN (SELECT DISTINCT position FROM event_entities "
                    f"WHERE entity IN ({_in_clause(len(keys))}) AND position > ? AND position <= ?) "
                    f"{of_type}ORDER BY e.position LIMIT ?",
                    (*keys, after, upto, *(only or ()), limit),
                ).fetchall()
                found = decode_rows(rows)
            if len(found) < limit and last > through:
                found += _scan_unindexed(conn, keys, max(after, through), last, limit - len(found), only)
            return found

        return await self._on_reader(lambda conn: _snapshot(conn, lambda: q(conn)))

    async def last_positions(self, entities: Sequence[str], upto: int) -> dict[str, int]:
        """The position of the last event at or before ``upto`` naming each entity (``provider:<u>``,
        ``consumer:<u>``), for those some event names (what the audit cites for a drift)."""
        keys = list(entities)

        def q(conn: sqlite3.Connection) -> dict[str, int]:
            through = min(history_through(conn), upto)
            found: dict[str, int] = {}
            for chunk in _chunks(keys):
                sql = (
                    "SELECT entity, max(position) FROM event_entities "
                    f"WHERE entity IN ({_in_clause(len(chunk))}) AND position <= ? GROUP BY entity"
                )
                found.update((k, int(p)) for k, p in conn.execute(sql, (*chunk, through)) if p is not None)
            if upto > through and keys:  # (the newest events, not indexed yet: as _scan_unindexed)
                wanted = set(keys)
                columns = "position, type, schema_version, data"
                for position, etype, version, data in _rows_naming(conn, columns, keys, through, upto):
                    try:
                        named = decode_event(etype, version, data, position).entities() & wanted
                    except err.CorruptEvent:
                        continue  # (the audit reports the row itself)
                    found.update(dict.fromkeys(named, position))
            return found

        return await self._on_reader(lambda conn: _snapshot(conn, lambda: q(conn)))

    async def position_at(self, at: datetime) -> int:
        stamp = at.astimezone(UTC).isoformat(timespec="microseconds")

        def q(conn: sqlite3.Connection) -> int:
            # recorded_at never goes backwards along positions (the writer and import enforce it),
            # so a binary search over the primary key replaces an index every append would pay for.
            def time_of(position: int) -> str:
                sql = "SELECT recorded_at FROM events WHERE position = ?"
                row = conn.execute(sql, (position,)).fetchone()
                return str(row[0]) if row else ""

            head = int(conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0)
            low, high = 0, head  # invariant: time_of(low) <= stamp (0 stands for "before the log")
            while low < high:
                mid = (low + high + 1) // 2
                if time_of(mid) <= stamp:
                    low = mid
                else:
                    high = mid - 1
            return low

        return await self._on_reader(lambda conn: _snapshot(conn, lambda: q(conn)))

    async def load_state(self) -> State:
        return await self._on_reader(load_all)

    async def query(self, name: str, *args: Any) -> Any:
        fn = QUERIES[name]
        return await self._on_reader(lambda conn: _snapshot(conn, lambda: fn(conn, *args)))

    async def tamper(self, sql: str, params: Sequence[Any] = ()) -> None:
        """Run raw SQL on the writer (tests and repair tools only)."""
        await self._on_writer(lambda conn: conn.execute(sql, params))

    # --- snapshots (a cache of folded states; see projections/snapshots.py) -------------------

    async def save_snapshot(
        self,
        position: int,
        event_hash: str,
        fmt: int,
        state: str,
        wait: bool = True,
        tombstones: str | None = None,
    ) -> bool:
        """``wait``: for another connection's write lock up to busy_timeout (else ~0.1 s: see
        :meth:`_save_on_writer`); ``tombstones``: the snapshot's tombstone segment (see
        :meth:`load_tombstones`), saved in the same transaction. False when left unsaved without
        an error (see :meth:`_save_on_writer`)."""
        return await self.save_provider_snapshots(position, event_hash, fmt, (), wait, state, tombstones)

    async def _save_on_writer(self, write: Callable[[sqlite3.Connection], None], wait: bool) -> bool:
        """A snapshot's write. One saved on the way to answering a question (``wait`` False: time
        travel, diff) waits ~0.1 s at most for another process's write lock, then fails busy (the
        caller goes on without saving): it waited busy_timeout, 30 s by default, before the answer
        - and this store's commands, queued behind it on the writer, with it. False when it was
        left unsaved without an error: the caller's chain of tombstone segments (see
        projections/snapshots.py) must not name a segment that was not saved."""
        if not wait and self._wal_deferred:
            # (a cache, on the way to an answer: not worth turning a file that is only read out of
            # its rollback-journal mode - see _wal_deferred - so left unsaved, as when busy)
            log.debug("snapshot.not_saved", reason="rollback_journal_file")
            return False
        timeout = self.busy_timeout if wait else min(self.busy_timeout, 0.1)

        def run(conn: sqlite3.Connection) -> None:
            # (the writer's busy handler waits slices of BUSY_SLICE_MS: the retries bound the whole)
            _retry_busy(lambda: write(conn), timeout)

        await self._on_writer(run)
        return True

    async def load_snapshot(self, at_most: int, fmt: int) -> tuple[int, str] | None:
        """The latest snapshot at or before ``at_most`` whose event is still the one it was taken at."""

        def q(conn: sqlite3.Connection) -> tuple[int, str] | None:
            row = conn.execute(
                "SELECT s.position, s.state FROM snapshots s JOIN events e "
                "ON e.position = s.position AND e.hash = s.event_hash "
                "WHERE s.position <= ? AND s.format = ? ORDER BY s.position DESC LIMIT 1",
                (at_most, fmt),
            ).fetchone()
            return None if row is None else (int(row[0]), str(row[1]))

        return await self._on_reader(q)

    async def snapshot_positions(self) -> list[int]:
        """Positions of the snapshots (of any format; see :meth:`snapshot_headers` for those a fold
        can use)."""

        def q(conn: sqlite3.Connection) -> list[int]:
            # (not the tombstone segments, kept at minus their position: see load_tombstones)
            sql = "SELECT position FROM snapshots WHERE position > 0 ORDER BY position"
            return [int(r[0]) for r in conn.execute(sql)]

        return await self._on_reader(q)

    async def load_tombstones(self, at_most: int, fmt: int) -> list[tuple[int, str]]:
        """The tombstone segments (see projections/snapshots.py) of the snapshots at or before
        ``at_most`` whose event is still the one they were taken at, as ``(position, text)``.

        A segment is kept in the snapshots table at minus its snapshot's position: a cache needs
        no table of its own, and so no schema change (an older evstore of this schema version
        ignores them: it reads its own format, at positive positions, and drops them with the rest)."""

        def q(conn: sqlite3.Connection) -> list[tuple[int, str]]:
            rows = conn.execute(
                "SELECT e.position, s.state FROM snapshots s JOIN events e "
                "ON e.position = -s.position AND e.hash = s.event_hash "
                "WHERE s.position < 0 AND s.position >= -? AND s.format = ? ORDER BY s.position DESC",
                (at_most, fmt),
            )
            return [(int(r[0]), str(r[1])) for r in rows]

        return await self._on_reader(lambda conn: _snapshot(conn, lambda: q(conn)))

    async def snapshot_headers(self, at_most: int, fmt: int) -> list[tuple[int, str]]:
        """The first line (the header: see projections/snapshots.py) of each snapshot at or before
        ``at_most`` of format ``fmt`` whose event is still the one it was taken at, as
        ``(position, line)`` in position order: what take_snapshots' check of the chains, and a
        question passing over snapshots whose chain broke, need of them - not the state after it.

        Read by incremental blob I/O (a row's first page or so), where a SELECT of any part of
        the text, substr() included, loads all of it: 0.3 ms against 12-27 ms for the 30
        snapshots (37 MB) of a 309,699-event log."""

        def q(conn: sqlite3.Connection) -> list[tuple[int, str]]:
            rows = conn.execute(
                "SELECT s.position FROM snapshots s JOIN events e "
                "ON e.position = s.position AND e.hash = s.event_hash "
                "WHERE s.position > 0 AND s.position <= ? AND s.format = ? ORDER BY s.position",
                (at_most, fmt),
            ).fetchall()
            utf8 = conn.execute("PRAGMA encoding").fetchone()[0] == "UTF-8"
            return [(int(r[0]), _first_line(conn, int(r[0]), utf8)) for r in rows]

        return await self._on_reader(lambda conn: _snapshot(conn, lambda: q(conn)))

    async def drop_snapshots(self) -> None:
        """Both kinds, in one transaction: a failure between them (a crash, a full disk) must not
        leave the provider slices of the state a rebuild meant to forget."""

        def w(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")  # (the only busy statement: retried whole)
            try:
                conn.execute("DELETE FROM snapshots")
                conn.execute("DELETE FROM provider_snapshots")
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

        await self._on_writer(lambda conn: _retry_busy(lambda: w(conn), self.busy_timeout))

    async def save_provider_snapshots(
        self,
        position: int,
        event_hash: str,
        fmt: int,
        states: Sequence[tuple[str, str]],
        wait: bool = True,
        whole: str | None = None,
        tombstones: str | None = None,
    ) -> bool:
        """One provider's slice of the state (see projections/snapshots.py) per provider, at a
        position (``wait``: as :meth:`save_snapshot`), and with ``whole`` the whole-store snapshot
        there and ``tombstones`` its tombstone segment: all in one transaction. (Until stop 39
        each slice was a transaction of its own, an fsync each: 40 providers' slices took
        0.09-0.17 s of wall a position, and a failure between them left some of a position's
        slices written.) False when left unsaved without an error (see :meth:`_save_on_writer`)."""

        def w(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")  # (the only busy statement: retried whole)
            try:
                sql = "INSERT OR REPLACE INTO snapshots (position, event_hash, format, state) "
                sql += "VALUES (?,?,?,?)"
                if whole is not None:
                    conn.execute(sql, (position, event_hash, fmt, whole))
                if tombstones is not None:
                    conn.execute(sql, (-position, event_hash, fmt, tombstones))  # (see load_tombstones)
                conn.executemany(
                    "INSERT OR REPLACE INTO provider_snapshots VALUES (?,?,?,?,?)",
                    [(provider, position, event_hash, fmt, state) for provider, state in states],
                )
                conn.execute("COMMIT")
            except BaseException:
                _rollback(conn)
                raise

        return await self._save_on_writer(w, wait)

    async def load_provider_snapshot(self, provider: str, at_most: int, fmt: int) -> tuple[int, str] | None:
        def q(conn: sqlite3.Connection) -> tuple[int, str] | None:
            row = conn.execute(
                "SELECT s.position, s.state FROM provider_snapshots s JOIN events e "
                "ON e.position = s.position AND e.hash = s.event_hash "
                "WHERE s.provider = ? AND s.position <= ? AND s.format = ? ORDER BY s.position DESC LIMIT 1",
                (provider, at_most, fmt),
            ).fetchone()
            return None if row is None else (int(row[0]), str(row[1]))

        return await self._on_reader(q)

    async def import_all(
        self,
        rows: Iterator[RawEvent],
        batch_size: int,
        progress: Callable[[int], None] | None = None,
    ) -> int:
        """Load a validated export into this empty store: every row verbatim (positions, ids,
        hashes, times), their history index (:func:`imported_keys`) and the projection folded
        from them, in one write transaction.

        ``rows`` is consumed on the writer's thread (it reads the file). Nobody, in this process
        or another, decides a command against a half-imported store, and an import that fails or
        is killed leaves the store as empty as it was.
        """
        report = None if progress is None else _on_the_loop(asyncio.get_running_loop(), progress)
        stop = threading.Event()
        callers_rows = _callers_rows(rows)

        def work(conn: sqlite3.Connection) -> int:
            # (the caller's cancellation sets ``stop``, not _on_writer's own flag: it is shielded,
            # below, so that it waits for the rollback. A wait for another process's lock stops on
            # it too, at the next slice, instead of after busy_timeout)
            outer = getattr(_waits, "between", None)

            def between() -> None:
                if stop.is_set():
                    raise _ImportStopped()
                if outer is not None:
                    outer()

            try:
                return _retry_busy(
                    lambda: _import_all(conn, callers_rows, batch_size, report, stop),
                    self.busy_timeout,
                    between,
                )
            except _CommitFailed as exc:
                raise _import_commit_failed(exc.error) from None
            finally:
                self._cache.forget()  # (the projection was written behind its back)

        running = asyncio.ensure_future(self._on_writer(work))
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # The thread would go on and commit the whole import after its caller gave up
            # (Ctrl-C): tell it to roll back, and wait until it has, so that an interrupted
            # import leaves the store empty, as one that failed does.
            stop.set()
            try:
                await running
            except Exception as exc:  # (rolled back; the caller hears of its cancellation, not this)
                log.debug("import.cancelled", error=repr(exc))
            raise

    async def rebuild(
        self, batch_size: int, progress: Callable[[int, int], None] | None = None, full: bool = False
    ) -> Rebuilt:
        # The long part, folding the whole log, runs outside the write lock (reader connection,
        # read-ahead): writers are held back only while the events appended meanwhile are
        # folded and the projection is rewritten (~30% of a rebuild instead of all of it).
        head = await self.head()

        async def read(after: int, limit: int) -> list[PayloadRow]:
            return follows_on(after, await self.read_payloads(after, limit))

        state = await replay(
            read,
            batch_size=batch_size,
            progress=None if progress is None else (lambda done: progress(done, max(done, head))),
        )
        report = None if progress is None else _on_the_loop(asyncio.get_running_loop(), progress)
        folded: Rebuilt = await self._on_writer(
            lambda conn: _retry_busy(
                lambda: _rebuild(conn, state, batch_size, report, full, self.busy_timeout),
                self.busy_timeout,
            )
        )
        # (freed on a thread a piece at a time: dropped on the event loop at the return, the
        # whole state stalled it for as long as freeing it takes - see dismantle)
        await asyncio.to_thread(dismantle, state)
        return folded

    async def lost_tail(self) -> LostTail | None:
        """The newest change the projection records past the end of the log (see
        :class:`LostTail`), else None. The projection is read before the head, so a command
        committing between them only raises the head."""

        return await self._on_reader(_lost_tail)

    async def check_history(self, batch_size: int) -> HistoryCheck:
        """The history index against the log (see :class:`HistoryCheck`), up to the position it
        is complete to (newer events are found by reads in their text, by design). The expected
        rows are made as ``rebuild(full=True)`` makes them, into a TEMP table of a connection of
        its own (the reader stays free for queries), then compared by SQLite."""

        def work(c: sqlite3.Connection) -> HistoryCheck:
            staged = _StagedHistory()
            staged.stage(c, batch_size)
            try:
                return _snapshot(c, lambda: _compare_history(c, min(staged.through, history_through(c))))
            finally:
                c.execute("DROP TABLE temp.staged_entities")

        if self.memory:  # (another connection would open another, empty, database)
            return await self._on_writer(work)
        conn = await self._connect(threading.Event(), time.monotonic() + self.busy_timeout)
        try:
            return await _on_thread(conn, work)
        finally:
            await conn.close()

    async def stats(self) -> dict[str, Any]:
        def q(conn: sqlite3.Connection) -> dict[str, Any]:
            counts = dict(conn.execute("SELECT type, count(*) FROM events GROUP BY type").fetchall())
            head = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
            out: dict[str, Any] = {"head": head, "events_by_type": counts}
            if not self.memory:
                size = 0
                for suffix in ("", "-wal", "-shm"):
                    with contextlib.suppress(OSError):
                        size += os.path.getsize(self.path + suffix)
                out["db_bytes"] = size
            return out

        return await self._on_reader(q)


def _main_file(conn: sqlite3.Connection) -> bytes | None:
    """The path of ``conn``'s database file as SQLite keeps it (None: in memory). As bytes, which
    sqlite3 had from os.fsencode: a path need not be UTF-8 - a Latin-1 directory name - and sqlite3
    decoding it as text refused to. A file whose text is UTF-16 (its encoding chosen by hand before
    evstore's first open) gives its text's bytes in UTF-16 there, so it is read as text: UTF-16
    holds no undecodable path either."""
    if conn.execute("PRAGMA encoding").fetchone()[0] == "UTF-8":
        row = conn.execute(
            "SELECT CAST(file AS BLOB) FROM pragma_database_list WHERE name = 'main'"
        ).fetchone()
        return bytes(row[0]) if row is not None and row[0] else None
    row = conn.execute("SELECT file FROM pragma_database_list WHERE name = 'main'").fetchone()
    return os.fsencode(str(row[0])) if row is not None and row[0] else None


def _file_opened(conn: sqlite3.Connection, given: str) -> tuple[str, int, int] | None:
    """The file ``conn`` writes to, for :meth:`_WriterCache.check_file`: its path, device and
    inode (None: none, in memory). The path is ``given`` (absolute: SQLite keeps the full path,
    whatever the process's cwd becomes) when it names that file - so a symlink swapped to another
    file later is noticed - else SQLite's own name for it (a ``file:`` URI it parsed, which no
    ``os.stat`` of the given text finds)."""
    path = _main_file(conn)
    if path is None:
        return None
    name = os.fsdecode(path)
    opened = os.stat(name)
    try:
        found: os.stat_result | None = os.stat(given)
    except OSError:
        found = None
    if found is not None and (found.st_dev, found.st_ino) == (opened.st_dev, opened.st_ino):
        name = given
    return name, opened.st_dev, opened.st_ino


def _look_up(name: str, what: str, path: str) -> os.stat_result | None:
    """``os.stat(name)`` for :meth:`_WriterCache.check_file` (None: no such file); a failure that
    says nothing of whether it is there is raised as such, nothing committed."""
    try:
        return os.stat(name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:  # (it may still be there: say what is known)
        raise err.StorageError(
            f"The {what} {name} could not be looked up ({exc.strerror}), so whether the "
            "path still names the file this store writes to is unknown: nothing was committed "
            "(retry once the path can be looked up)",
            sqlite_error="file_replaced",
            path=path,
            outcome_unknown=False,
        ) from None


def _wal_files_opened(conn: sqlite3.Connection) -> tuple[tuple[str, int, int], ...]:
    """The -wal and -shm files of ``conn``'s database file as they are now, for
    :meth:`_WriterCache.check_file`: none in memory or unless ``conn`` is in WAL mode. Named as
    SQLite names them, beside the file it opened (through a symlink: beside its target). Called
    once ``conn`` has read the file in WAL mode, so it has them open: they stay the same files as
    long as a connection of this store is open (SQLite deletes them only as the last one closes)."""
    path = _main_file(conn)
    if path is None or str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal":
        return ()
    found = []
    for suffix in (b"-wal", b"-shm"):
        name = os.fsdecode(path + suffix)
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            info = os.stat(name)
            found.append((name, info.st_dev, info.st_ino))
    return tuple(found)


#: connections closing in the background (the loop keeps only weak references to tasks)
_closing: set[asyncio.Task[None]] = set()


def _close_later(conn: aiosqlite.Connection) -> None:
    """Close ``conn`` without waiting for it (a caller that gave up must not wait for the close)."""
    task = asyncio.ensure_future(conn.close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


def _close_unheard(conn: aiosqlite.Connection) -> None:
    """Close ``conn`` on its own thread and end that thread, telling no event loop (the store
    was dropped unclosed: its loop may be closed, and a thread calling into a closed loop dies
    with a traceback at exit). Queued behind whatever the thread is running."""
    from aiosqlite import core

    stop: Any = core._STOP_RUNNING_SENTINEL

    def close() -> object:
        inner, conn._connection = conn._connection, None
        if inner is not None:
            inner.close()
        return stop  # (aiosqlite 0.22: the thread ends after this)

    conn._running = False
    if isinstance(conn, threading.Thread):  # (aiosqlite < 0.22: the connection is the thread)
        tx: Any = conn._tx  # (a queue of (future, call) pairs and this sentinel)
        tx.put_nowait((_Unheard(), close))
        tx.put_nowait(stop)
    else:
        conn._tx.put_nowait((None, close))


class _Unheard:
    """A stand-in for the future aiosqlite < 0.22 answers each call to: no one waits."""

    def get_loop(self) -> _Unheard:
        return self

    def call_soon_threadsafe(self, *args: object) -> None:
        return None


def _on_the_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` (a caller's ``progress``) made callable from the writer's thread: each call runs on
    the event loop's thread, where an asyncio caller's callback belongs (one setting an
    ``asyncio.Event`` or feeding a queue is unsafe on another), and the writer waits for it, so
    that an exception it raises ends the work - rolled back, raised to the caller - as on
    PostgreSQL, whose rebuild and import call ``progress`` on the loop inside their transaction.
    (Handed over without the wait, its exception went to asyncio's handler and an import
    committed regardless.)"""

    def call(*args: Any) -> None:
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:
                done.set_exception(exc)
                if not isinstance(exc, Exception):
                    raise  # (KeyboardInterrupt, SystemExit: the loop's to handle as well)
            else:
                done.set_result(None)

        loop.call_soon_threadsafe(run)
        # (waited for, not ``done.result(timeout)``: a TimeoutError ``fn`` raised is not the wait's)
        while not concurrent.futures.wait([done], timeout=0.1).done:
            if loop.is_closed():  # (it will never run: no wait for ever on the thread)
                raise err.StoreClosed("The event loop closed during the work")
        failed = done.exception()
        if isinstance(failed, Exception):
            raise CallbackFailed(failed)  # (past _on_thread's conversions: see CallbackFailed)
        if failed is not None:
            raise failed

    return call


def _nothing(conn: sqlite3.Connection) -> None:
    """A call on a connection's thread that does nothing (see ``SqliteBackend.settle``)."""


async def _on_thread(conn: aiosqlite.Connection | None, fn: Callable[[sqlite3.Connection], T]) -> T:
    if conn is None:
        raise err.StoreClosed("The store is closed")
    # (``fn`` reached through a box emptied when it runs: aiosqlite's thread keeps the last
    # call it ran until the next, and a drain's ``fn`` holds the store, which then lived on -
    # unclosed, never warned of - after its program dropped it)
    box = [fn]

    def call() -> T:
        # aiosqlite's worker thread owns the sqlite3 connection; we run the whole unit of work
        # there in one hop. ``_execute`` is aiosqlite's own primitive for that (every public
        # method is built on it); the version range in pyproject pins it.
        return box.pop()(conn._conn)

    try:
        return await conn._execute(call)  # type: ignore[no-any-return,no-untyped-call]
    except CallbackFailed as exc:
        raise exc.error from None
    except sqlite3.ProgrammingError as exc:
        if "closed database" in str(exc):
            # (queued on the connection's thread just behind its close: aiosqlite forgets the
            # connection only after closing it)
            raise err.StoreClosed("The store is closed") from None
        raise _storage_error(exc) from None
    except sqlite3.DatabaseError as exc:
        raise _storage_error(exc) from None
    except ValueError as exc:
        if "closed" in str(exc).lower() or "no active connection" in str(exc).lower():
            raise err.StoreClosed("The store is closed") from None
        raise
    except (sqlite3.Error, MemoryError, OSError) as exc:
        # (sqlite3's InterfaceError, SQLite's SQLITE_NOMEM - which sqlite3 raises as MemoryError -
        # an OSError of the file checks: typed, as SQLite's other errors are, not left bare)
        raise _unexpected_error(exc) from None


def _storage_error(exc: sqlite3.DatabaseError) -> err.StorageError:
    """What a caller sees of an error SQLite raised while running its work."""
    if _is_disk_full(exc):
        return _disk_full_error(f"SQLite error: {exc}")
    if (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == sqlite3.SQLITE_READONLY:
        return err.StorageError(
            f"SQLite error: {exc} ({READ_ONLY_HINT})",
            sqlite_error=type(exc).__name__,
            reason="read_only",
            outcome_unknown=False,
        )
    return err.StorageError(
        f"SQLite error: {exc}{_damage_hint(exc)}", sqlite_error=type(exc).__name__, **_damage_reason(exc)
    )


#: what SQLite running out of memory (``SQLITE_NOMEM``, raised by sqlite3 as ``MemoryError``) means
OUT_OF_MEMORY_HINT = (
    "the process ran out of memory (SQLite's SQLITE_NOMEM, or Python's own): free memory - a smaller "
    "batch_size for an import or a rebuild, fewer concurrent reads - or raise the process's memory limit, "
    "then retry"
)


def _unexpected_error(exc: BaseException) -> err.StorageError:
    """What a caller sees of a failure of the work on a connection's thread that is neither
    SQLite's ``DatabaseError`` (see :func:`_storage_error`) nor evstore's own: sqlite3's
    ``InterfaceError`` (a misuse of its API), ``MemoryError`` (SQLite's SQLITE_NOMEM, or Python's),
    an ``OSError`` (the file checks: ``stat`` of the store's files) - typed, with what to do, not
    "Storage failure: <repr>"."""
    if isinstance(exc, sqlite3.DatabaseError):
        return _storage_error(exc)
    if isinstance(exc, MemoryError):
        return err.StorageError(
            f"Out of memory: {shown(exc, 200)} ({OUT_OF_MEMORY_HINT})",
            sqlite_error="out_of_memory",
            reason="out_of_memory",
        )
    if isinstance(exc, OSError):
        return err.StorageError(
            f"I/O error on the store's files: {exc} (check the disk and the files' permissions, then retry; "
            "if it goes on, `evstore audit` says whether the store is whole)",
            sqlite_error="os_error",
            errno=exc.errno,
        )
    if isinstance(exc, sqlite3.Error):
        return err.StorageError(
            f"SQLite error: {exc} (sqlite3 refused a call evstore made: a bug of evstore's, or of the "
            "sqlite3 module in use - please report it with this message; the store's file is not harmed)",
            sqlite_error=type(exc).__name__,
        )
    return err.StorageError(f"SQLite backend failure: {type(exc).__name__}: {shown(exc, 200)}")


def _cannot_open(url: str, exc: MemoryError | OSError) -> err.StorageError:
    """An open's failure that is not SQLite's ``sqlite3.Error`` - a ``MemoryError`` (SQLite's
    SQLITE_NOMEM at a connection's pragmas or a look at the file), an ``OSError`` - typed, as
    SQLite's errors are there ("Cannot open URL: ...")."""
    failed = _unexpected_error(exc)
    return err.StorageError(f"Cannot open {url}: {failed.message}", **failed.details)


def _import_commit_failed(exc: BaseException) -> err.StorageError:
    """An import whose COMMIT failed: as a command's (:func:`_commit_failed_error`), it may have
    been committed - the store then holds the whole log, not part of it."""
    failed = _unexpected_error(exc)
    if failed.details.get("reason") in ("disk_full", "read_only"):
        failed.details["outcome_unknown"] = False
        return failed
    return err.StorageError(
        f"The COMMIT of the import failed: {failed.message}. It may have been committed, whole (a failed "
        "write or sync of the -wal file can leave its commit there, for the next open to find): look at "
        "the store's head (`evstore stats`) before importing again - a store that holds the events needs "
        "no second import",
        **{**failed.details, "outcome_unknown": True},
    )


def _batch_error(exc: Exception, jobs: Sequence[Job]) -> Exception | list[Outcome]:
    """What each caller of a batch that failed whole hears: evstore's own errors as they are (a
    busy lock, the store closed, a file replaced, a damaged projection: each says what became of
    the command); SQLite's and the other failures of storage typed (:func:`_unexpected_error`),
    saying whether the command may have committed - ``outcome_unknown`` True only when its COMMIT
    failed (:class:`_CommitFailed`), False when it failed before: the batch was rolled back. Any
    other exception is a bug, left to the store, which says its outcome is unknown.

    A batch whose COMMIT failed answers each job its own outcome (a list): the jobs refused by
    an invariant, or not run, wrote nothing, whatever became of the COMMIT, and keep their
    refusal; each accepted job (a replayed receipt too: its key's row may be this batch's own)
    hears that it may have been committed."""
    if isinstance(exc, err.StorageError):
        # (raised before the COMMIT - a COMMIT's failure comes as _CommitFailed - so rolled back:
        # a damaged projection, a log that lost its tail, a file that would not switch to WAL)
        exc.details.setdefault("outcome_unknown", False)
        return exc
    if isinstance(exc, err.EvstoreError) or not isinstance(
        exc, (sqlite3.Error, MemoryError, OSError, BatchAborted, _CommitFailed)
    ):
        return exc
    if isinstance(exc, _CommitFailed):
        outcomes, exc.outcomes = exc.outcomes, None
        if outcomes is None or len(outcomes) != len(jobs):
            return _commit_failed_error(exc.error, jobs)
        accepted = [job for job, outcome in zip(jobs, outcomes, strict=True) if isinstance(outcome, Receipt)]
        if not accepted:
            return outcomes
        unknown = _commit_failed_error(exc.error, accepted)
        cause = _unexpected_error(exc.error)
        answers: list[Outcome] = []
        changed = False  # (whether a job before this one appended events: the state it was decided on)
        for outcome in outcomes:
            if isinstance(outcome, Receipt):
                answers.append(unknown)
                changed = changed or (bool(outcome.positions) and not outcome.replayed)
            elif changed and isinstance(outcome, err.EvstoreError) and not isinstance(outcome, _NO_DECISION):
                # (a refusal by an invariant; a damaged row's, or a job not run, is no decision)
                answers.append(_refused_after(outcome, cause))
            else:
                answers.append(outcome)
        return answers
    if isinstance(exc, BatchAborted):
        failed = err.StorageError(
            f"This command's group commit was rolled back whole, nothing of it written: {exc}; retry it (if "
            "it goes on, `evstore audit` says whether the store is damaged, and `evstore rebuild` refolds "
            "its projection)"
        )
    else:
        failed = _unexpected_error(exc)
    failed.details.setdefault("outcome_unknown", False)  # (it failed before its COMMIT: rolled back)
    return failed


#: the errors of a job that are no refusal decided against the state (see _batch_error)
_NO_DECISION = (err.StorageError, err.StoreClosed)


def _refused_after(refusal: err.EvstoreError, cause: err.StorageError) -> err.StorageError:
    """The answer to a job of a batch whose COMMIT failed (``failed``: its accepted jobs' error),
    refused against what the accepted jobs before it in the batch had written - a state that may
    never have reached the log: its refusal may not hold (a capacity they took, a consumer they
    deleted). Nothing of it was written, whatever became of the COMMIT: it is to be retried.
    (PostgreSQL never answers so: a command there waits for those before it on its entities to
    commit or roll back.) ``cause``: the COMMIT's failure."""
    return err.StorageError(
        f"This command was refused ({refusal.message}) against the commands before it in its group "
        f"commit, whose COMMIT then failed ({cause.message}): what they wrote may not be in the log, so "
        "the refusal may not hold; nothing of it was written: retry it",
        **{
            **cause.details,
            "outcome_unknown": False,
            "refused": refusal.code,
            "refusal_details": dict(refusal.details),
        },
    )


def _commit_failed_error(exc: BaseException, jobs: Sequence[Job]) -> err.StorageError:
    """The error of a batch whose COMMIT failed: SQLite's answer said nothing of it was written for
    a full disk (``disk_full``) and a file it may not write (``read_only``) - they fail before the
    frame that commits is written - but for any other failure (``disk I/O error``: a write or an
    ``fsync`` of the -wal file that failed; a lost file; out of memory) the commit frame may be in
    the -wal file, where the next open's recovery finds it: ``outcome_unknown`` True."""
    failed = _unexpected_error(exc)
    if failed.details.get("reason") in ("disk_full", "read_only"):
        failed.details["outcome_unknown"] = False
        return failed
    keys = {job.idempotency_key is not None for job in jobs}  # (one error for every caller of the batch)
    retry = "retry it with the same idempotency_key, which answers the original receipt if it was"
    look = "look at the log (`evstore tail`, `store.history`) before running it again"
    what = (
        retry
        if keys == {True}
        else f"it had no idempotency_key: {look}"
        if keys == {False}
        else f"{retry}; one without an idempotency_key: {look}"
    )
    return err.StorageError(
        f"The COMMIT of this command failed: {failed.message}. It may have been committed (a failed write or "
        f"sync of the -wal file can leave its commit there, for the next open to find): {what}",
        **{**failed.details, "outcome_unknown": True},
    )


def _is_disk_full(exc: sqlite3.Error) -> bool:
    """SQLite's ``SQLITE_FULL``: a write found no room (the disk or the file system full)."""
    return (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF == sqlite3.SQLITE_FULL


#: what SQLite's ``SQLITE_READONLY`` means for the caller: the store opened (a file this process may
#: read, in a directory where its -wal and -shm files could be made, reads as any other), but a
#: write found the file, or its -wal or -shm, not writable - its mode or owner, or a file system
#: mounted read-only. SQLite refuses before it writes a frame: nothing of the command was written.
READ_ONLY_HINT = (
    "this process may not write the database file, or its -wal or -shm file: nothing of it was written; "
    "check the files' permissions (mode and owner) and that their file system is not mounted read-only, "
    "or work on a writable copy - the store's reads still answer"
)


#: what a full disk means for the caller (see _disk_full_error)
DISK_FULL_HINT = (
    "the disk holding the database, its -wal file or SQLite's temporary files is full: nothing of "
    "this was written (a write transaction that finds no room is rolled back whole: the store is "
    "as it was, consistent); free space on that disk, then retry - the store goes on as before"
)


def _disk_full_error(lead: str) -> err.StorageError:
    """The error for ``SQLITE_FULL``: its own reason, ``disk_full`` (not the exception's class
    name), and that nothing was committed - a write that finds no room fails before the frame
    that would commit it is written (in WAL mode, and with a rollback journal the journal undoes
    it), so ``outcome_unknown`` is False."""
    return err.StorageError(
        f"{lead} ({DISK_FULL_HINT})", sqlite_error="disk_full", reason="disk_full", outcome_unknown=False
    )


def _damage_hint(exc: sqlite3.Error) -> str:
    """What to do about a database file SQLite found damaged (``database disk image is
    malformed``: a page it cannot make sense of) or not a database at all (``file is not a
    database``: its header is not SQLite's), said after its error; "" for any other error."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code == sqlite3.SQLITE_NOTADB:
        return (
            " (the file is not a SQLite database, or its first page is damaged: check that the path "
            "names the store's file; if it does, restore it from a backup)"
        )
    if code != sqlite3.SQLITE_CORRUPT:
        return ""
    return (
        " (the database file is damaged: restore it from a backup; or, if `evstore export` can still "
        "read its log, import that export into a new file with `evstore import`)"
    )


def _damage_reason(exc: sqlite3.Error) -> dict[str, str]:
    """``details["reason"]`` for a damaged file (``"damaged"``) or one that is not a database
    (``"not_a_database"``), the stable word for what :func:`_damage_hint` says; {} otherwise."""
    code = (getattr(exc, "sqlite_errorcode", None) or 0) & 0xFF
    if code == sqlite3.SQLITE_NOTADB:
        return {"reason": "not_a_database"}
    return {"reason": "damaged"} if code == sqlite3.SQLITE_CORRUPT else {}


#: how long the writer's own busy handler waits for another connection's lock (its connection's
#: busy_timeout, in ms) before it answers busy and Python asks whether anyone still waits: the
#: store's busy_timeout is waited in slices of this (Python's sqlite3 cannot cut a busy wait
#: short - ``interrupt()`` does not - so a caller that gave up, or a store closing, would have
#: kept the writer thread waiting for the whole busy_timeout). Within a slice SQLite's handler
#: tries again after 1, 2, 5, 10, 15 and 20 ms: a waiting writer tries at least as often as it
#: did with one long wait (SQLite's handler then tries every 100 ms), and sleeps between tries,
#: as before, so another process's writer still gets its turn.
BUSY_SLICE_MS = 50

#: per connection thread: what a wait for another connection's lock asks between slices (it
#: raises to stop waiting); set around the work of :meth:`SqliteBackend._on_writer`
_waits = threading.local()


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def _busy_error(timeout: float, exc: sqlite3.OperationalError) -> err.StorageError:
    return err.StorageError(
        f"The database stayed locked by another connection for longer than busy_timeout "
        f"({timeout:g} s): {exc}; retry, or open the store with a longer busy_timeout",
        sqlite_error="busy",
        outcome_unknown=False,  # (in WAL mode a write waits for the lock at BEGIN, never at COMMIT)
    )


def _wait_busy(
    fn: Callable[[], T], timeout: float, between: Callable[[], None] | None, quick: bool = True
) -> T:
    """Run ``fn`` again while SQLite answers busy, for at most ``timeout`` seconds in all; the
    last busy answer is raised. ``between`` runs after each busy answer (it raises to stop).
    ``quick``: retry a busy answer given without waiting (else it is raised at once)."""
    deadline = time.monotonic() + timeout
    refused = 0
    while True:
        began = time.monotonic()
        try:
            return fn()
        except sqlite3.OperationalError as exc:
            if not _is_busy(exc):
                raise
            now = time.monotonic()
            waited = now - began >= BUSY_SLICE_MS / 2000
            if now >= deadline or not (waited or quick):
                raise
            if between is not None:
                between()
            if not waited:  # (refused without waiting: SQLite's handler did not sleep, so this does)
                refused += 1
                time.sleep(min(0.05 * refused, BUSY_SLICE_MS / 1000, deadline - now))
                if between is not None:
                    between()


def _retry_busy(
    fn: Callable[[], T],
    timeout: float,
    between: Callable[[], None] | None = None,
    said: float | None = None,
) -> T:
    """Run ``fn`` (a transaction), again while SQLite answers busy, for at most ``timeout``
    seconds (``busy_timeout``) in all, then fail busy. The writer's busy handler waits one slice
    (:data:`BUSY_SLICE_MS`) per try, so ``fn`` must do its expensive work after its ``BEGIN``.
    Between tries ``between`` (by default what the writer thread's current work set, see
    :meth:`SqliteBackend._on_writer`) may stop the wait: its caller gave up, the store closes.
    ``said``: the busy_timeout the error names, when ``timeout`` is what an open left of it."""
    if between is None:
        between = getattr(_waits, "between", None)
    try:
        return _wait_busy(fn, timeout, between)
    except sqlite3.OperationalError as exc:
        if not _is_busy(exc):
            raise
        raise _busy_error(timeout if said is None else said, exc) from None


def _stopper(stop: threading.Event) -> Callable[[], None]:
    """What a wait for another connection's lock asks between slices: it raises StoreClosed once
    ``stop`` is set (the open was given up, the store closes)."""

    def stopped() -> None:
        if stop.is_set():
            raise err.StoreClosed("The store was closed, or its opening given up, while it waited for a lock")

    return stopped


def looking_mode(path: Path) -> str:
    """The URI mode of a look at the existing file ``path`` that changes nothing (the connection
    also writes nothing: ``query_only``). A read-only one (``mode=ro``) on a file in WAL mode makes
    its -wal and -shm files where there were none and cannot remove them, so a look at another
    application's file the open then refused left them beside it. Where there is neither a -wal
    nor a -journal file and the file and its directory are writable, the look is read-write
    (``rw``: never creates the file), and removes them on closing as the last connection to a
    file does, having nothing to copy into the file. Otherwise read-only as before: a -wal or
    -journal is its writer's (or a crash's, which a read-write connection would roll back), and a
    read-only connection leaves the files byte for byte; a file or directory without write
    permission is opened so that no -wal or -shm need be made (evstore/cli.py's _only_reading
    follows the same rule)."""
    if Path(f"{path}-wal").exists() or Path(f"{path}-journal").exists():
        return "ro"
    if not (os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)):
        return "ro"
    return "rw"


def _look(path: str, fn: Callable[[sqlite3.Connection], T], deadline: float, stop: threading.Event) -> T:
    """``fn`` on a read-only connection to the file at ``path`` (its connect's errors raised as
    they are), run again while another connection holds the file locked, in slices (see
    :data:`BUSY_SLICE_MS`), until ``deadline`` (``time.monotonic()``: the open's, derived from
    busy_timeout, which its looks share) or ``stop`` is set (StoreClosed); then the last busy
    answer is raised. With sqlite3's default timeout each look waited 5 s of its own, whatever
    busy_timeout said, and could not be stopped."""
    left = max(0.0, deadline - time.monotonic())
    resolved = Path(path).resolve()
    conn = sqlite3.connect(
        f"{resolved.as_uri()}?mode={looking_mode(resolved)}",
        uri=True,
        timeout=min(left, BUSY_SLICE_MS / 1000),
    )
    try:
        conn.execute("PRAGMA query_only = ON")
        return _wait_busy(lambda: fn(conn), left, _stopper(stop))
    finally:
        conn.close()


def _scan_unindexed(
    conn: sqlite3.Connection,
    keys: Sequence[str],
    after: int,
    last: int,
    limit: int,
    types: Sequence[str] | None = None,
) -> list[RecordedEvent]:
    """The events in ``(after, last]`` that name one of ``keys``, found without the history index
    (the newest events, which it does not hold yet: fewer than :data:`HISTORY_LAG`). An event
    names an entity only through its payload, so the entity's id is in its stored text: only
    those rows are decoded (a damaged one fails the read with CorruptEvent, as through the index),
    and with ``types`` only those of these types."""
    wanted = set(keys)
    found: list[RecordedEvent] = []
    for row in _rows_naming(conn, EVENT_COLUMNS, keys, after, last):
        raw = RawEvent._make(row)
        if types is not None and raw.type not in types:
            continue
        recorded = decode_raw(raw)
        if recorded.event.entities() & wanted:
            found.append(recorded)
            if len(found) == limit:
                break
    return found


def _rows_naming(
    conn: sqlite3.Connection, columns: str, keys: Sequence[str], after: int, last: int
) -> sqlite3.Cursor:
    """``columns`` of the events in ``(after, last]`` whose stored text holds the id of one of
    ``keys`` (``provider:<u>``...), in position order: the candidates that may name them."""
    names = [key.split(":", 1)[-1] for key in keys]
    sql = (
        f"SELECT {columns} FROM events WHERE position > ? AND position <= ? AND ("
        + " OR ".join("instr(data, ?) > 0" for _ in names)
        + ") ORDER BY position"
    )
    return conn.execute(sql, (after, last, *names))


def _link_target_dir_missing(path: str) -> tuple[str, str] | None:
    """For ``path`` a symbolic link to nothing (dangling): its target and the target's directory
    when that directory does not exist (a volume not mounted, a data directory moved), which SQLite
    reports only as "unable to open database file"; ``None`` otherwise (no link, a link to a file,
    or to one yet to be made where its directory exists: SQLite makes it there)."""
    if not os.path.islink(path) or os.path.exists(path):
        return None
    target = os.path.realpath(path)
    directory = os.path.dirname(target)
    return None if os.path.isdir(directory) else (target, directory)


def not_a_regular_file(path: str) -> str | None:
    """What ``path`` is when it exists and is not a regular file (symbolic links followed), as a
    message says it ("is a FIFO (named pipe)"); ``None`` for a file or nothing. SQLite would
    wait for ever on a FIFO's other end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # (SQLite: "unable to open database file"; Path.resolve: RuntimeError)
            return "is a symbolic link loop (following it leads back to a link on the way)"
        return None  # (absent: made on open, or refused there with the reason)
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe)"
    return "is not a regular file (a device or socket)"


def _table_names(path: str, busy_timeout: float) -> list[str]:
    """The tables of the existing database at ``path``, read without a write lock or creating
    anything; another connection's lock is waited for up to ``busy_timeout`` seconds, in slices
    (see :func:`_look`: sqlite3's default waited 5 s, whatever the store's busy_timeout said).
    Raises ``sqlite3.Error`` when it cannot be opened or read (the last busy answer, for a file
    that stayed locked)."""

    def names(conn: sqlite3.Connection) -> list[str]:
        return [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]

    return _look(path, names, time.monotonic() + busy_timeout, threading.Event())


def _no_store_reason(path: str, deadline: float, stop: threading.Event) -> str | None:
    """Why ``path`` (for which :func:`_holds_no_store` holds) is no store; None when it has
    evstore's tables but lost its schema version, or its meta table (damage, not absence), or
    tables of evstore's names that :func:`_refuse_damaged` says are another application's. A
    lock is waited for until ``deadline`` (see :func:`_look`)."""
    if not os.path.exists(path):
        return "the file does not exist"

    def look(conn: sqlite3.Connection) -> tuple[set[str], tuple[str, ...]]:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        return tables, tuple(r[1] for r in conn.execute("PRAGMA table_info(events)"))

    try:
        tables, events = _look(path, look, deadline, stop)
    except sqlite3.Error as exc:
        return f"the file cannot be read ({exc})"
    # (an events table alone is evstore's by its columns: another application's is no store here)
    if {"meta", "events"} <= tables or events == _schema_objects()[0]["events"]:
        return None
    return "the database holds no evstore tables"


def _refuse_damaged(path: str, deadline: float, stop: threading.Event) -> None:
    """What the open that creates or upgrades the store refuses (:func:`_schema_state`), in the
    database at ``path``, read-only: a table of evstore's name that is not evstore's
    ("Not an evstore database"), a store that lost its meta table or its schema version. A file
    it cannot read (locked, gone since) is left to the open, which reports it as a StorageError
    or, under the write lock, refuses the same. A lock is waited for until ``deadline`` (see
    :func:`_look`)."""
    try:
        _look(path, lambda conn: _snapshot(conn, lambda: _schema_state(conn, path)), deadline, stop)
    except sqlite3.Error:
        return


def _holds_no_store(path: str, deadline: float, stop: threading.Event) -> bool:
    """Whether ``path`` is missing, or a SQLite database without evstore's tables (read-only check;
    a file that is not a database at all, that this process may not read, or that stayed locked
    until ``deadline`` - see :func:`_look` -, is left to the normal open, which reports it)."""
    if path == ":memory:":
        return True

    def look(conn: sqlite3.Connection) -> bool:
        meta = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'")
        if meta.fetchone() is None:
            return True
        # (another application's meta table: only evstore's holds a schema version)
        try:
            version = conn.execute("SELECT 1 FROM meta WHERE key = 'schema_version'")
        except sqlite3.OperationalError as exc:  # (no key column; a lock is waited for)
            if _is_busy(exc):
                raise
            return True
        return version.fetchone() is None

    try:
        return _look(path, look, deadline, stop)
    except sqlite3.Error:
        # (missing; or there and unreadable - its permissions -, not a database - the open fails
        # with that message - or locked, which is no "No evstore store")
        return not os.path.exists(path)


def foreign_tables(url: str) -> list[str]:
    """The tables of the existing SQLite database of the store ``url`` that are not evstore's
    (another application's: an import must not write evstore's tables beside them); empty when
    the file is missing, empty, an evstore store or not a regular file (read-only check). A lock
    another connection holds is waited for up to the URL's busy_timeout (30 s by default), as the
    store's open waits; a file that stays locked longer, or cannot be read (not a database,
    damaged), raises StorageError as the open says it - never "no other tables" (after sqlite3's
    default 5 s), which let the import go on to an open that refused the file with another code."""
    path, options = parse_sqlite_url(url)
    busy_timeout = (
        float(_option_from_url("busy_timeout", options["busy_timeout"]))
        if "busy_timeout" in options
        else 30.0
    )
    if path == ":memory:" or not_a_regular_file(path) is not None or not os.path.exists(path):
        return []  # (a FIFO would be waited on for ever: the store's open refuses it with the reason)
    try:
        tables = _table_names(path, busy_timeout)
    except sqlite3.Error as exc:
        if not os.path.exists(path):
            return []  # (removed since: the import creates it)
        if isinstance(exc, sqlite3.OperationalError) and _is_busy(exc):
            raise err.StorageError(
                f"Cannot open {url}: {exc} (another connection held it locked for longer than "
                f"busy_timeout ({busy_timeout:g} s): retry, or open the store with a longer busy_timeout)",
                sqlite_error="busy",
            ) from None
        raise err.StorageError(
            f"Cannot open {url}: {exc}{_damage_hint(exc)}",
            sqlite_error=type(exc).__name__,
            **_damage_reason(exc),
        ) from None
    ours = _schema_objects()[0].keys()
    return sorted(t for t in tables if t not in ours and not t.startswith("sqlite_"))


@functools.cache
def _schema_objects() -> tuple[dict[str, tuple[str, ...]], frozenset[str]]:
    """The columns of each table this version defines, and its index names (from the DDL itself)."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript(DDL)
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        columns = {t: tuple(r[1] for r in conn.execute(f"PRAGMA table_info({t})")) for t in tables}
        indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
        return columns, frozenset(i for i in indexes if not i.startswith("sqlite_autoindex"))
    finally:
        conn.close()


def _schema_state(conn: sqlite3.Connection, path: str = "") -> bool:
    """Whether the store's schema is there and current; raises if the database is someone else's,
    newer than this evstore, or a store at ``path`` that lost its schema version. Reads only:
    opening a store takes no write lock when nothing is to be created or migrated."""
    columns, indexes = _schema_objects()
    found = {r[0]: r[1] for r in conn.execute("SELECT name, type FROM sqlite_master")}
    _refuse_newer(conn, found)  # (first: a newer evstore's tables differ, and that is why)
    _refuse_foreign(found)
    outdated, reshaped_in = _check_columns(conn, found)
    # (evstore's events table - _check_columns refused one of other columns - is a store's, whatever
    # became of its meta table: evstore writes both in one transaction)
    store = found.get("events") == "table"
    version: int | None = None
    if found.get("meta") != "table" and store:
        raise _lost_version(path, "table", None, _version_of_tables(outdated, reshaped_in))
    if found.get("meta") == "table":
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is None and store:
            raise _lost_version(path, "row", None, _version_of_tables(outdated, reshaped_in))
        if row is None:
            # evstore writes its tables and the version in one transaction: a meta table without
            # one, beside no log, is another application's
            raise err.StorageError(
                "Not an evstore database: it has a meta table without evstore's schema version "
                "(another application's?). Use another file for the store."
            )
        version = parse_version(row[0])
        if version is None or version < 1:
            if store:
                raise _lost_version(path, "value", row[0], _version_of_tables(outdated, reshaped_in))
            raise err.SchemaVersionError(
                f"This database's schema version is {shown(row[0], 40)}, not one evstore writes, and it "
                "holds no evstore log: it was not written by evstore (another application's meta "
                "table?). Use another file for the store.",
                found=row[0],
            )
        if version > SCHEMA_VERSION:
            raise err.SchemaVersionError(
                f"This database has schema version {version}; this evstore understands up to "
                f"{SCHEMA_VERSION}. Upgrade evstore to open it.",
                found=version,
                supported=SCHEMA_VERSION,
            )
    if (outdated and version is not None and version >= 3) or (
        reshaped_in is not None and version is not None and version >= reshaped_in
    ):
        raise err.StorageError(
            f"This store says schema version {version} but its tables are of an older one: it was "
            "damaged, or written by another program",
            found=version,
        )
    return (
        not outdated
        and reshaped_in is None
        and version == SCHEMA_VERSION
        and columns.keys() <= found.keys()
        and indexes <= found.keys()
        and not RETIRED_INDEXES & found.keys()
    )


#: indexes older versions made, which the DDL drops
RETIRED_INDEXES = frozenset({"events_recorded_at", "p_consumers_behalf", "p_consumers_project"})


def parse_version(value: object) -> int | None:
    """A schema version as meta holds it: the decimal text evstore writes (a sign allowed, for the
    message that says a version below 1 is none of evstore's); None for anything else ('1.1', 'x',
    but also ' 5' or '5_0', which int() would take, and numbers of more digits than int() reads:
    its ValueError escaped the open)."""
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,1000}", value, re.ASCII):
        return int(value)
    return None


def _version_of_tables(outdated: bool, reshaped_in: int | None) -> int:
    """The newest schema version whose tables are shaped as a store's (``_check_columns``'
    answer): the version its lost one is to be given again, from which the open upgrades it."""
    if outdated:
        return 2  # (version 3 added ADDED_COLUMNS' columns)
    if reshaped_in is not None:
        return reshaped_in - 1
    return SCHEMA_VERSION


def _lost_version(
    path: str, lost: Literal["table", "row", "value"], value: object, shaped: int
) -> err.SchemaVersionError:
    """The error for a store (its events table is there) that lost its meta table (``lost``
    "table"), its schema version row ("row"), or whose version is not one evstore writes
    ("value": ``value``): evstore does not guess the version. The message says how to put back
    ``shaped``, the version its tables have (:func:`_version_of_tables`)."""
    store = f"The store {path}" if path else "This store"
    if lost == "table":
        what = (
            f"{store} has lost its meta table, which holds its schema version (its events and "
            "other tables are there): it was dropped by hand, or a copy or restore left it out"
        )
        fix = (
            "restore the file from a backup, or make the table again"
            f"{_as_shaped(shaped)}, with the sqlite3 shell or any SQLite client, evstore's processes "
            "stopped: `CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL); INSERT INTO meta "
            f"VALUES ('schema_version', '{shaped}'), ('history_through', '0')` (history_through 0: "
            "evstore indexes its history again)"
        )
    elif lost == "row":
        what = (
            f"{store} has evstore's tables but no schema version (its meta table lost its "
            "schema_version row): it was deleted by hand, or the file was damaged"
        )
        fix = (
            f"restore the file from a backup, or put the row back{_as_shaped(shaped)}, with the sqlite3 "
            "shell or any SQLite client, evstore's processes stopped: `INSERT INTO meta VALUES "
            f"('schema_version', '{shaped}')`"
        )
    else:
        number = parse_version(value)
        what = (
            f"{store}: its schema version is {shown(value, 40)}, not a number"
            if number is None
            else f"{store}: its schema version is {number}: evstore numbers its versions from 1"
        ) + ", so it was changed by hand, or the file was damaged"
        fix = (
            f"restore the file from a backup, or set the version{_as_shaped(shaped)}, with the sqlite3 "
            "shell or any SQLite client, evstore's processes stopped: `UPDATE meta SET value = "
            f"'{shaped}' WHERE key = 'schema_version'`"
        )
    return err.SchemaVersionError(
        f"{what}. evstore does not guess the version of a store: {fix}. Nothing was written.",
        path=path,
        found=value if lost == "value" else None,
        supported=SCHEMA_VERSION,
    )


def _as_shaped(shaped: int) -> str:
    """How a lost version's message names ``shaped``, the version the store's tables have."""
    if shaped == SCHEMA_VERSION:
        return f" (its tables are those of schema version {shaped}, this evstore's)"
    return (
        f" (its tables are those of schema version {shaped} or older: this evstore upgrades it "
        f"to {SCHEMA_VERSION} on its next open)"
    )


def _check_columns(conn: sqlite3.Connection, found: dict[str, str]) -> tuple[bool, int | None]:
    """Whether evstore's tables that ``found`` (sqlite_master's names and types) holds are of an
    older version (columns to add), and the version that reshaped one this store has as before;
    raises ``StorageError`` ("Not an evstore database") for a table of evstore's name that is not
    evstore's (other columns, or a view): another application's."""
    columns = _schema_objects()[0]
    outdated = False
    reshaped_in: int | None = None  # (the version that reshaped a table this store has as before)
    for table, want in columns.items():
        if found.get(table) == "table":
            have = tuple(r[1] for r in conn.execute(f"PRAGMA table_info({table})"))
            if have != want and have + tuple(ADDED_COLUMNS.get(table, ())) == want:
                outdated = True  # (a store of an older version: the open adds the columns)
            elif have != want and table in RESHAPED_TABLES and have == RESHAPED_TABLES[table][0]:
                reshaped_in = RESHAPED_TABLES[table][1]  # (the open makes it again, refolded)
            elif have != want:
                raise err.StorageError(
                    f"Not an evstore database: its table {table!r} has the columns ({', '.join(have)}), "
                    f"evstore's has ({', '.join(want)}). Use another file for the store.",
                    table=table,
                )
        elif table in found:
            raise err.StorageError(f"Not an evstore database: {table!r} is a {found[table]}, not a table")
    return outdated, reshaped_in


def _refuse_foreign(found: dict[str, str]) -> None:
    """``StorageError`` for a database that holds tables, none of them evstore's: another
    application's, which opening it would fill with evstore's tables (as ``evstore import``
    refuses it). An empty file, or a database without tables, is made a store."""
    ours = _schema_objects()[0].keys()
    tables = sorted(n for n, kind in found.items() if kind == "table" and not n.startswith("sqlite_"))
    if tables and not ours & set(tables):
        shown = ", ".join(tables[:5]) + (", ..." if len(tables) > 5 else "")
        raise err.StorageError(
            f"Not an evstore database: it holds another application's tables ({shown}) and none of "
            "evstore's; evstore does not add its tables to it. Use a new file for the store (a path "
            "that does not exist yet, or an empty file).",
            tables=tables,
        )


def _refuse_newer(conn: sqlite3.Connection, found: dict[str, str]) -> None:
    """SchemaVersionError for a store a newer evstore wrote (its tables may have columns this one
    does not know: "not an evstore database" would send the reader the wrong way)."""
    if found.get("meta") != "table":
        return
    if tuple(r[1] for r in conn.execute("PRAGMA table_info(meta)")) != ("key", "value"):
        return  # (another application's meta table: the column checks say so)
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    version = parse_version(row[0]) if row is not None else None
    if version is not None and version > SCHEMA_VERSION:
        raise err.SchemaVersionError(
            f"This database has schema version {version}; this evstore understands up to "
            f"{SCHEMA_VERSION}. Upgrade evstore to open it.",
            found=version,
            supported=SCHEMA_VERSION,
        )


def _ensure_schema(
    conn: sqlite3.Connection, create: bool = True, path: str = "", upgrade: bool = True
) -> tuple[int | None, SchemaRepair | None]:
    """Create or migrate the store's schema (``create`` False: only migrate a store that is
    there, at ``path``; a database without one is refused, as the read-only check before the
    open refuses it; ``upgrade`` False: refuse a store of an older schema version rather than
    upgrade it). Returns the version it upgraded the store from (None: current, or new) and
    what it repaired in a current store that lacked schema objects (None: nothing)."""
    if _snapshot(conn, lambda: _schema_state(conn, path)):
        return None, None  # (nothing to create: no write lock, so a busy or read-only file still opens)
    if not upgrade:  # (before the write lock: a refusal need not wait for writers)
        _snapshot(conn, lambda: _refuse_changes(conn, path))
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _schema_state(conn, path):  # (again, under the lock: another process may have changed it)
            conn.execute("COMMIT")  # (made whole meanwhile - created, upgraded: nothing to write)
            return None, None
        if not create:
            _refuse_no_store(conn, path)
        if not upgrade:
            _refuse_changes(conn, path)
        older = _older_version(conn)
        gaps = _schema_gaps(conn) if older is None else None
        refolded = False
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        reshaped: list[str] = []
        for table, (before, _) in RESHAPED_TABLES.items():
            if table in tables and tuple(r[1] for r in conn.execute(f"PRAGMA table_info({table})")) == before:
                # Set aside, in case the log is not refolded (see below), and dropped at the end;
                # its indexes go now, so that the DDL makes the new table's under their names.
                indexes = conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ? "
                    "AND sql IS NOT NULL",
                    (table,),
                ).fetchall()
                for (index,) in indexes:
                    conn.execute(f"DROP INDEX {index}")
                conn.execute(f"ALTER TABLE {table} RENAME TO {table}_before")
                tables.discard(table)
                reshaped.append(table)
        added = []
        for table, added_columns in ADDED_COLUMNS.items():
            if table in tables:
                have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})")}
                for name, kind in added_columns.items():
                    if name not in have:
                        conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")
                        added.append(f"{table}.{name}")
        for statement in DDL.split(";"):
            if statement.strip():
                conn.execute(statement)
        # A new store, or one of schema version 1, whose history index is complete: it holds the
        # rows of every event (version 1 wrote them with each event). _schema_state refused newer.
        head = conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0
        missing = [t for t in PROJECTION_TABLES if t not in tables]
        if head and missing:
            # (an older store's reshaped tables, or tables lost: the log folded again fills them)
            why = "projection.reshaped" if reshaped else "projection.tables_missing"
            refolded = _refold_lost_projection(conn, missing, head, why=why)
            if not refolded and "p_allocations" in reshaped:
                _convert_older_holdings(conn, conn.execute("SELECT * FROM p_allocations_before"))
        elif head and added:
            # (the new columns hold what the fold knows and older versions did not keep)
            _refold_lost_projection(conn, added, head, why="projection.columns_added")
        for table in reshaped:
            conn.execute(f"DROP TABLE {table}_before")
        conn.execute("INSERT OR IGNORE INTO meta VALUES ('history_through', ?)", (str(head),))
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
        conn.execute("COMMIT")
    except BaseException:
        _rollback(conn)
        raise
    if gaps is None or not (gaps[0] or gaps[1]):
        return older, None
    return older, SchemaRepair(made_again=tuple(gaps[0]), dropped=tuple(gaps[1]), refolded=refolded)


def _older_version(conn: sqlite3.Connection) -> int | None:
    """The schema version of a store an older evstore wrote (after :func:`_schema_state`, which
    refused a newer, damaged or foreign one); None for a current store or a database without one."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return None
    row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    version = parse_version(row[0]) if row is not None else None
    return version if version is not None and 1 <= version < SCHEMA_VERSION else None


def _refuse_upgrade(conn: sqlite3.Connection, path: str) -> None:
    """For ``upgrade=False``: ``SchemaVersionError`` when the store is of an older schema version."""
    found = _older_version(conn)
    if found is None:
        return
    raise err.SchemaVersionError(
        f"{path} is a store of schema version {found}, written by an older evstore: opening it "
        f"would upgrade it to {SCHEMA_VERSION}, which closes it to the older evstore processes still "
        "using it, and this open says not to (upgrade=False, as evstore's commands open a store, all "
        "but upgrade, rebuild and snapshot). Once no older evstore uses it, run "
        f"`evstore upgrade --db {shlex.quote(path)}` or open it with upgrade=True (nothing was written)",
        found=found,
        supported=SCHEMA_VERSION,
        path=path,
    )


def _schema_gaps(conn: sqlite3.Connection) -> tuple[list[str], list[str]] | None:
    """A current store's schema objects the open would make again (missing: dropped by hand, left
    out of a copy) and the indexes of an earlier version it would drop (retired); None for a
    database that holds no store yet."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return None
    if conn.execute("SELECT 1 FROM meta WHERE key = 'schema_version'").fetchone() is None:
        return None  # (_schema_state refused a store that lost it: a meta table alone is no store)
    columns, indexes = _schema_objects()
    found = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
    return sorted(columns.keys() - found) + sorted(indexes - found), sorted(RETIRED_INDEXES & found)


def _refuse_repair(conn: sqlite3.Connection, path: str) -> None:
    """For ``upgrade=False``, after :func:`_refuse_upgrade`: ``SchemaVersionError`` when the store
    lacks tables or indexes of its (current) version - dropped by hand, left out of a copy - or
    keeps an index the DDL drops: the open would make them (refolding the log into a lost
    projection table), a change of the store's schema this open says not to make. A database
    holding no store yet is left to the open, which creates one (``create`` permitting)."""
    gaps = _schema_gaps(conn)
    if gaps is None or not (gaps[0] or gaps[1]):
        return
    missing, retired = gaps
    lost = [t for t in missing if t in PROJECTION_TABLES]
    what = " and ".join(
        ([f"lacks {', '.join(missing)}"] if missing else [])
        + ([f"keeps {', '.join(retired)}"] if retired else [])
    )
    raise err.SchemaVersionError(
        f"{path} is a store of schema version {SCHEMA_VERSION} that {what} (dropped or made by hand, "
        "or a copy or restore left them out): opening it would make its schema whole again"
        + (" and refold the lost projection from the log" if lost else "")
        + ", and this open says not to (upgrade=False, as evstore's commands open a store, all but "
        f"upgrade, rebuild and snapshot). Run `evstore upgrade --db {shlex.quote(path)}` or open it "
        "with upgrade=True, which repairs it (nothing was written)",
        found=SCHEMA_VERSION,
        supported=SCHEMA_VERSION,
        path=path,
        missing=missing,
        retired=retired,
        refold_pending=False,  # (PostgreSQL's key: an upgrade here refolds in its own transaction)
    )


def _refuse_changes(conn: sqlite3.Connection, path: str) -> None:
    """For ``upgrade=False``: what an open may not change, refused (nothing written): an older
    schema version (:func:`_refuse_upgrade`), schema objects to make again (:func:`_refuse_repair`)."""
    _refuse_upgrade(conn, path)
    _refuse_repair(conn, path)


def _refuse_changes_read_only(path: str, deadline: float, stop: threading.Event) -> bool:
    """For ``upgrade=False``, before the open: :func:`_refuse_changes` on a read-only connection
    to the file at ``path``; then, on the same connection, whether the store is in a
    rollback-journal mode (its header's bytes 18 and 19 are 1; 2 is WAL), for
    :attr:`SqliteBackend._wal_deferred`. Read through SQLite, not by opening the file: closing a
    descriptor of the file drops every POSIX lock this process holds on it, those of its other
    connections to it too. A file this look cannot read (absent, locked, in a directory it cannot
    make the -shm file in) is left to the open, whose looks refuse the same: False. A lock is
    waited for until ``deadline`` (see :func:`_look`)."""
    if not os.path.isfile(path):
        return False

    def in_rollback_mode(conn: sqlite3.Connection) -> bool:
        def look() -> None:
            _schema_state(conn, path)  # (a damaged or foreign file is refused as the open refuses it)
            _refuse_changes(conn, path)

        _snapshot(conn, look)  # (which read the header)
        return str(conn.execute("PRAGMA journal_mode").fetchone()[0]).lower() != "wal"

    try:
        return _look(path, in_rollback_mode, deadline, stop)
    except sqlite3.Error:
        return False


def _wait_for_writer(path: str, deadline: float, stop: threading.Event) -> None:
    """For ``upgrade=False``, before a refusal: wait until no other connection holds the write
    lock of the store at ``path`` - another process's open upgrading or repairing it - until the
    open's ``deadline`` (``time.monotonic()``), in slices, until ``stop`` is set, without writing
    anything (the lock is taken and let go of at once). Only a file in WAL mode: an open that
    upgrades a store switches it to WAL first, and a file in a rollback-journal mode is left byte
    for byte as it was (see :attr:`SqliteBackend._wal_deferred`). A file this cannot lock is left
    to the caller's look."""

    def in_wal_mode(look: sqlite3.Connection) -> bool:
        def read() -> bool:
            look.execute("SELECT count(*) FROM sqlite_master")  # (reads the header)
            return str(look.execute("PRAGMA journal_mode").fetchone()[0]).lower() == "wal"

        return _snapshot(look, read)

    with contextlib.suppress(sqlite3.Error):
        if not _look(path, in_wal_mode, deadline, stop):
            return
        conn = sqlite3.connect(path, isolation_level=None, timeout=BUSY_SLICE_MS / 1000)
        try:
            left = max(0.0, deadline - time.monotonic())
            _wait_busy(lambda: conn.execute("BEGIN IMMEDIATE"), left, _stopper(stop))
            conn.execute("ROLLBACK")
        finally:
            conn.close()


def _refuse_no_store(conn: sqlite3.Connection, path: str) -> None:
    """For ``create=False``, under the write lock and after :func:`_schema_state` (which refuses
    a meta table without a schema version): ``NotFound`` when the database holds no store, as
    the open's read-only look refuses it. That look can miss it: a read that found the file
    locked (another connection writing to it, longer than the look waits) was taken for a file to
    open, and the open then created a store in it."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        raise err.NotFound(
            f"No evstore store in {path}: the database holds no evstore tables (check the path, or "
            "create a store, e.g. with `evstore demo --db ...`)"
        )


def _rollback(conn: sqlite3.Connection) -> None:
    """Roll back the transaction a failure interrupted, if it is still open: SQLite rolls it back
    itself on some errors (a full disk, for one), and a ROLLBACK then failed with 'cannot
    rollback - no transaction is active', which the caller read instead of what went wrong. A
    ROLLBACK that fails itself (a disk I/O error) is logged, not raised: the caller hears what
    went wrong first, and the transaction it left open - nothing of it acknowledged - is rolled
    back by the connection's next work (:func:`_end_leftover`)."""
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except (sqlite3.Error, MemoryError, OSError) as exc:
            log.warning("sqlite.rollback_failed", error=shown(exc, 200), still_open=conn.in_transaction)


def _end_leftover(conn: sqlite3.Connection) -> None:
    """Before a connection's next work: roll back a transaction a failed ROLLBACK left open (see
    :func:`_rollback`; nothing of it was acknowledged). Left open, every later BEGIN failed with
    "cannot start a transaction within a transaction", a read saw the data of that moment for
    ever, and a write outside a BEGIN joined it. A ROLLBACK that fails again raises: the work is
    not run, and the next tries again."""
    if conn.in_transaction:
        log.warning("sqlite.leftover_transaction", action="rolled back")
        conn.execute("ROLLBACK")


def _convert_older_holdings(conn: sqlite3.Connection, rows: Iterable[tuple[Any, ...]]) -> None:
    """An older store whose log is not refolded (it cannot be folded, or it lost its last events:
    the audit names either): its allocation rows, one per class, written again one per consumer
    and provider, and the project usage counters counted from them - the projection it had, in
    the new shape, rather than one that holds nothing (every command would decide against that,
    and every query answer it)."""
    state = State()
    for uuid, project, user, ctype in conn.execute(
        "SELECT uuid, project_id, user_id, consumer_type FROM p_consumers"
    ):
        state.consumers[uuid] = ConsumerState(uuid, project, user, ctype)
    for consumer, provider, rc, used in rows:
        holder = state.consumers.get(consumer)
        if holder is None:  # (as _load_all: rows whose consumer has no row stay, for the audit)
            holder = state.consumers[consumer] = ConsumerState(consumer)
        holder.allocations.setdefault(provider, {})[rc] = used
    held = sum(1 for c in state.consumers.values() if c.allocations)
    log.warning("projection.reshape_converted", consumers=held, action="older rows kept in the new shape")
    conn.executemany("INSERT INTO p_allocations VALUES (?,?,?)", _allocation_rows(state))
    conn.executemany("INSERT INTO p_usages VALUES (?,?,?)", _usage_rows(state))


def _lost_tail(conn: sqlite3.Connection) -> LostTail | None:
    """The newest change the projection's consumers record past the end of the log, if any (see
    :class:`LostTail`)."""
    row = conn.execute(  # (max() with bare columns: those of the row holding it)
        "SELECT max(v), uuid, what FROM (SELECT deleted_at AS v, uuid, 'deleted' AS what "
        "FROM p_consumers WHERE typeof(deleted_at) = 'integer' UNION ALL SELECT allocated_at, "
        "uuid, 'allocations changed' FROM p_consumers WHERE typeof(allocated_at) = 'integer')"
    ).fetchone()
    head = int(conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0)
    if row is None or not isinstance(row[0], int) or row[0] <= head:
        return None
    return LostTail(head, int(row[0]), str(row[1]), str(row[2]))


def _refold_lost_projection(
    conn: sqlite3.Connection, missing: list[str], head: int, why: str = "projection.tables_missing"
) -> bool:
    """A store whose log holds events lost projection tables (dropped by hand, or a damaged
    file): created empty, they would make every command decide against nothing held (and every
    query answer nothing). The projection is the log folded: it is folded again, now, inside the
    open's write transaction. So is the projection of an older store given new columns. A log
    that cannot be folded is left to the audit (which names the row): the tables stay as they
    were (lost ones empty), as the audit then reports, and this returns False. So is a log that
    lost its last events (a lost tail, as a rebuild refuses to forget without force: the fold
    would forget them silently, a tombstone among them)."""
    lost = _lost_tail(conn)
    if lost is not None:
        log.error(
            "projection.refold_refused",
            tables=missing,
            head=head,
            reason="log_truncated",
            position=lost.position,
            consumer=lost.consumer,
        )
        return False
    log.warning(why, tables=missing, head=head, action="refolding from the log")
    state = State(usages_deferred=True)
    cursor = conn.execute("SELECT position, type, schema_version, data FROM events ORDER BY position")
    conn.execute("SAVEPOINT refold")
    try:
        with gc_paused():
            while rows := cursor.fetchmany(5000):
                fold_payloads(state, follows_on(state.position, rows))
        if state.usages_deferred:
            state.recount_usages()
        _replace_projection(conn, state)
    except (err.CorruptEvent, OverflowError, ValueError, TypeError) as exc:
        # (an amount beyond 64 bits cannot be stored: the open, and the audit that names the
        # event, must still work; the tables stay as they were, the lost ones empty)
        log.error("projection.refold_failed", tables=missing, error=repr(exc)[:200])
        conn.execute("ROLLBACK TO refold")
        conn.execute("RELEASE refold")
        return False
    conn.execute("RELEASE refold")
    return True


#: bytes of a time-travel snapshot's text read at a time for its first line (a header is ~240 bytes,
#: more with many custom resource classes)
HEADER_READ = 1024


def _first_line(conn: sqlite3.Connection, position: int, utf8: bool) -> str:
    """The first line of the text of the ``snapshots`` row at ``position`` (see
    :meth:`SQLiteBackend.snapshot_headers`): read from its start by blob I/O in a UTF-8 file (the
    bytes are the text's); in another, or when that read fails, by SQL, which loads the whole text."""
    if utf8:
        try:
            with conn.blobopen("snapshots", "state", position, readonly=True) as blob:
                head = bytearray()
                while part := blob.read(HEADER_READ):
                    cut = part.find(b"\n")
                    head += part if cut < 0 else part[:cut]
                    if cut >= 0:
                        break
            # (bytes that are no UTF-8: a row damaged by hand, which decoding the snapshot refuses)
            return head.decode(errors="replace")
        except sqlite3.Error:
            pass  # (SQL's answer, then)
    row = conn.execute(
        "SELECT substr(state, 1, instr(state || char(10), char(10)) - 1) FROM snapshots WHERE position = ?",
        (position,),
    ).fetchone()
    return "" if row is None else str(row[0])


def _snapshot(conn: sqlite3.Connection, fn: Callable[[], T]) -> T:
    """Run several SELECTs on one consistent snapshot (a deferred read transaction)."""
    if conn.in_transaction:
        return fn()
    conn.execute("BEGIN")
    try:
        found = fn()
    except BaseException:
        _rollback(conn)
        raise
    try:
        conn.execute("COMMIT")  # (a read's: it commits nothing)
    except BaseException:
        # (left open, the read transaction would hold this connection at this moment: every later
        # read on it would see these data, and no checkpoint could pass them)
        _rollback(conn)
        raise
    return found


def load_all(conn: sqlite3.Connection) -> State:
    """The whole persisted projection as a State (for the audit and time travel)."""
    return _snapshot(conn, lambda: _load_all(conn))


def _load_all(conn: sqlite3.Connection) -> State:
    state = State()
    row = conn.execute("SELECT max(position) FROM events").fetchone()
    state.position = int(row[0] or 0)
    for prow in conn.execute(
        "SELECT uuid, name, parent, root, generation, inventories, usages FROM p_providers"
    ):
        p = persisted.provider_from_row(prow)
        state.providers[p.uuid] = p
    for crow in conn.execute(
        "SELECT uuid, project_id, user_id, consumer_type, generation, deleted, deleted_at, on_behalf_of, "
        "allocated_at, instance_type FROM p_consumers"
    ):
        c = persisted.consumer_from_row(crow)
        state.consumers[c.uuid] = c
    for consumer, provider, resources in conn.execute(
        "SELECT consumer, provider, resources FROM p_allocations"
    ):
        holder = state.consumers.get(consumer)
        if holder is None:
            holder = state.consumers[consumer] = ConsumerState(consumer)
        holder.allocations[provider] = persisted.resources_from_json(consumer, provider, resources)
    counters = state.project_usages = {}
    for project, user, text in conn.execute("SELECT project_id, user_id, counters FROM p_usages"):
        for ctype, counter in persisted.user_counters_from_json(project, user, text).items():
            counters[(project, user, ctype)] = counter
    state.custom_classes = {r[0] for r in conn.execute("SELECT name FROM p_classes")}
    return state


def _callers_rows(rows: Iterator[RawEvent]) -> Iterator[RawEvent]:
    """An import's ``rows``, which read the caller's file on the writer's thread: what reading it
    raises, other than evstore's own refusals of its lines (an ``OSError`` of the caller's file,
    say), is the caller's, raised as it was (:class:`CallbackFailed`) - not taken for a failure of
    the store's own files."""
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except err.EvstoreError:
            raise
        except Exception as exc:
            raise CallbackFailed(exc) from exc
        yield row


class _ImportStopped(Exception):
    """The caller of an import was cancelled (Ctrl-C): the import rolls back."""


def _import_all(
    conn: sqlite3.Connection,
    rows: Iterator[RawEvent],
    batch_size: int,
    progress: Callable[[int], None] | None,
    stop: threading.Event | None = None,
) -> int:
    def check() -> None:
        if stop is not None and stop.is_set():
            raise _ImportStopped

    conn.execute("BEGIN IMMEDIATE")  # (the only statement here that can be busy, and retried)
    try:
        if conn.execute("SELECT 1 FROM events LIMIT 1").fetchone() is not None:
            raise err.InvalidInput(
                "import needs an empty store: this one already has events", reason="not_empty"
            )
        # (a log whose events were deleted by hand may have left their history rows: none is
        # the imported events', and INSERT OR IGNORE would keep them under the same positions)
        conn.execute("DELETE FROM event_entities")
        state = State(usages_deferred=True)
        expected = 1
        with gc_paused():
            while batch := list(itertools.islice(rows, batch_size)):
                check()
                names = imported_keys(state, batch, expected)  # (folds the batch)
                expected += len(batch)
                entity_rows = [
                    (entity, raw.position) for raw, keys in zip(batch, names, strict=True) for entity in keys
                ]
                conn.executemany(f"INSERT INTO events ({EVENT_COLUMNS}) VALUES (?,?,?,?,?,?,?,?)", batch)
                conn.executemany("INSERT OR IGNORE INTO event_entities VALUES (?,?)", entity_rows)
                if progress is not None:
                    progress(expected - 1)
            if state.usages_deferred:  # (a buggy writer's log may have made the fold go event by event)
                state.recount_usages()
            check()
            if (repeated := _first_repeated_id(conn)) is not None:
                raise duplicate_id(*repeated)
            check()
            _replace_projection(conn, state)
            conn.execute("UPDATE meta SET value = ? WHERE key = 'history_through'", (str(expected - 1),))
        check()
        _commit(conn)
        return expected - 1
    except BaseException:
        _rollback(conn)
        raise


def imported_keys(state: State, batch: Sequence[RawEvent], expected: int) -> list[set[str]]:
    """Fold an imported ``batch`` into ``state``, returning each row's history keys, and check
    that it continues the log at position ``expected``.

    The history of a provider is every event that changed what is held on it. evstore's own
    events name all of those providers in their payload (``entities``); an imported log's need
    not: a version-1 AllocationsReplaced has no ``previous``, a Placement-style writer moves
    allocations onto a migration consumer that holds some, a revert's or a delete's payload may
    list other providers than the consumer held. So the providers whose holdings the fold
    changes are indexed too, found from the fold itself as it writes the projection's state (as
    :func:`history_keys` does, here without its fallback for a damaged row: an import's rows were
    validated, and one that does not decode now fails the import)."""
    names = []
    for offset, raw in enumerate(batch):
        if raw.position != expected + offset:
            raise err.CorruptEvent(
                f"Imported rows must continue the log at position {expected + offset}, got {raw.position}",
                position=raw.position,
                reason="position_gap",
            )
        etype = raw.type
        fields = payload_fields(etype, raw.schema_version, raw.data, raw.position)
        changed = fold_noting_providers(state, FOLDS[etype], fields, raw.position)
        # (entities() reads attributes only: the decoded struct stands in for the model)
        keys = EVENT_TYPES[etype].entities(fields)
        if changed:
            keys |= {f"provider:{p}" for p in changed}
        names.append(keys)
    return names


def _first_repeated_id(conn: sqlite3.Connection) -> tuple[str, int] | None:
    """The first event id the imported rows repeat, and the position repeating it (the smallest
    such), else None. The import keeps no set of the ids it read (~120 bytes an event) and the
    events table has no index on them (schema 2): SQLite sorts them, spilling to temporary files
    as its sorter does (~1.5 s a million events; a second sort only for a file that repeats one)."""
    if conn.execute("SELECT 1 FROM events GROUP BY event_id HAVING count(*) > 1 LIMIT 1").fetchone() is None:
        return None
    row = conn.execute(
        "SELECT event_id, position FROM (SELECT event_id, position, "
        "row_number() OVER (PARTITION BY event_id ORDER BY position) AS n FROM events) "
        "WHERE n = 2 ORDER BY position LIMIT 1"
    ).fetchone()
    return str(row[0]), int(row[1])


def _replace_projection(conn: sqlite3.Connection, state: State) -> None:
    """Every projection row and index written again from ``state`` (inside a write transaction)."""
    for table in PROJECTION_TABLES:
        conn.execute(f"DELETE FROM {table}")
    # Building the secondary indexes once, from sorted rows, beats updating them row by row.
    for name in PROJECTION_INDEXES:
        conn.execute(f"DROP INDEX IF EXISTS {name}")
    _write_projection(conn, state)
    for sql in PROJECTION_INDEXES.values():
        conn.execute(sql)


def _provider_rows(state: State) -> Iterable[tuple[Any, ...]]:
    providers = state.providers
    return (persisted.provider_row(providers[u]) for u in sorted(providers))


# ``persisted.consumer_row`` made in C (whole-projection writes and diffs go through every
# consumer): ``deleted`` stays a bool, which SQLite stores as 1/0 and which equals 1/0 read back.
_CONSUMER_COLUMNS = (
    "uuid",
    "project_id",
    "user_id",
    "consumer_type",
    "generation",
    "deleted",
    "deleted_at",
    "on_behalf_of",
    "allocated_at",
    "instance_type",
)
_CONSUMER_ROW = operator.attrgetter(*_CONSUMER_COLUMNS)


def _consumer_rows(state: State, uuids: list[str]) -> Iterable[tuple[Any, ...]]:
    return map(_CONSUMER_ROW, map(state.consumers.__getitem__, uuids))


def _allocation_rows(state: State) -> Iterable[tuple[Any, ...]]:
    consumers = state.consumers
    holding = sorted_in_runs(u for u, c in consumers.items() if c.allocations)  # (most rows are tombstones)
    return (
        (u, provider, _resources_json(resources))
        for u in holding
        for provider, resources in sorted(consumers[u].allocations.items())
    )


def _resources_json(resources: dict[str, int]) -> str:
    """A holding row's JSON, refusing amounts beyond 64 bits as an INTEGER column did (only a log
    no command wrote holds them: the rebuild names that, and PostgreSQL's columns refuse them)."""
    if not all(-(2**63) <= used < 2**63 for used in resources.values()):
        raise OverflowError("an amount beyond 64 bits")
    return persisted.resources_json(resources)


def _usage_rows(state: State) -> Iterable[tuple[Any, ...]]:
    by_user: dict[tuple[str, str], persisted.UserCounters] = {}
    for (project, user, ctype), counter in persisted.project_usage_totals(state.consumers.values()).items():
        by_user.setdefault((project, user), {})[ctype] = counter
    return ((*key, persisted.user_counters_json(by_user[key])) for key in sorted(by_user))


def _write_projection(conn: sqlite3.Connection, state: State) -> None:
    """A whole folded state into the emptied projection tables.

    Rows go in primary-key order (B-tree appends, not random inserts) and are streamed to
    ``executemany``; sorting the keys alone is cheaper than sorting rows.
    """
    uuids = sorted_in_runs(state.consumers)  # (on the writer thread, handing the GIL over)
    conn.executemany("INSERT INTO p_providers VALUES (?,?,?,?,?,?,?)", _provider_rows(state))
    conn.executemany("INSERT INTO p_consumers VALUES (?,?,?,?,?,?,?,?,?,?)", _consumer_rows(state, uuids))
    conn.executemany("INSERT INTO p_allocations VALUES (?,?,?)", _allocation_rows(state))
    conn.executemany("INSERT INTO p_classes VALUES (?)", ((n,) for n in sorted(state.custom_classes)))
    conn.executemany("INSERT INTO p_usages VALUES (?,?,?)", _usage_rows(state))


class _TooDifferent(Exception):
    """The persisted projection is far from the fold (or not ordered as written): rewrite it whole."""


def _diff_sorted(
    current: Iterable[tuple[Any, ...]], wanted: Iterable[tuple[Any, ...]], nkey: int, budget: list[int]
) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Merge two row streams sorted by their first ``nkey`` (text) columns: the keys of the rows
    to delete and the rows to (re)write so that ``current`` becomes ``wanted``.

    Raises :class:`_TooDifferent` when the changes exceed ``budget[0]`` (shared by the tables)
    or ``current`` is not a strictly increasing sequence of text keys (a tampered row of another
    type, which SQLite orders differently from Python).
    """
    deletes: list[tuple[Any, ...]] = []
    writes: list[tuple[Any, ...]] = []
    cur, want = iter(current), iter(wanted)
    prev: tuple[Any, ...] | None = None  # the last row taken from ``current``
    while True:  # equal stretches a chunk at a time (the list comparison runs in C)
        a, b = list(itertools.islice(cur, 4096)), list(itertools.islice(want, 4096))
        if a != b:
            cur, want = itertools.chain(a, cur), itertools.chain(b, want)
            break
        if not a:
            return deletes, writes
        prev = a[-1]
    c, w = next(cur, None), next(want, None)
    while True:
        if c == w:  # the common case, kept cheap: an equal row is ordered since ``wanted`` is
            if c is None:
                break
            prev, c, w = c, next(cur, None), next(want, None)
            continue
        ck = None
        if c is not None:
            ck = c[:nkey]
            if any(type(k) is not str for k in ck) or (prev is not None and ck <= prev[:nkey]):
                raise _TooDifferent
        wk = None if w is None else w[:nkey]
        if ck is not None and (wk is None or ck < wk):
            deletes.append(ck)
            prev, c = c, next(cur, None)
        elif w is not None and (ck is None or wk < ck):  # type: ignore[operator]
            writes.append(w)
            w = next(want, None)
        else:  # same key, other values
            writes.append(w)  # type: ignore[arg-type]
            prev, c, w = c, next(cur, None), next(want, None)
        if len(deletes) + len(writes) > budget[0]:
            raise _TooDifferent
    budget[0] -= len(deletes) + len(writes)
    return deletes, writes


def _sync_projection(conn: sqlite3.Connection, state: State) -> bool:
    """Make the projection tables equal ``state`` by writing only the rows that differ.

    A rebuild of a sound projection then writes (almost) nothing: the rows are read back in key
    order and merged with the folded state's rows, which is several times cheaper than rewriting
    every row and index. Returns False, having written nothing, when the difference is large
    (an emptied or badly damaged projection): the caller rewrites the tables whole.
    """
    uuids = sorted_in_runs(state.consumers)  # (on the writer thread, handing the GIL over)
    budget = [len(uuids) // 8 + 1000]
    plan = []
    try:
        for table, columns, nkey, rows in (
            (
                "p_providers",
                "uuid, name, parent, root, generation, inventories, usages",
                1,
                _provider_rows(state),
            ),
            (
                "p_consumers",
                ", ".join(_CONSUMER_COLUMNS),
                1,
                _consumer_rows(state, uuids),
            ),
            ("p_allocations", "consumer, provider, resources", 2, _allocation_rows(state)),
            ("p_classes", "name", 1, ((n,) for n in sorted(state.custom_classes))),
            ("p_usages", "project_id, user_id, counters", 2, _usage_rows(state)),
        ):
            key = ", ".join(columns.split(", ")[:nkey])
            current = conn.execute(f"SELECT {columns} FROM {table} ORDER BY {key}")
            try:
                deletes, writes = _diff_sorted(current, rows, nkey, budget)
            finally:
                current.close()  # (an unfinished read would lock the table against the rewrite)
            plan.append((table, columns, key, deletes, writes))
    except _TooDifferent:
        return False
    except (sqlite3.OperationalError, sqlite3.DataError) as exc:
        if "locked" in str(exc) or "busy" in str(exc) or not conn.in_transaction:
            # (busy; or SQLite rolled the transaction back itself - a disk I/O error, no memory -
            # and a rewrite now would go outside it, each statement committing on its own)
            raise
        return False  # a row that cannot be read back (e.g. text that is not UTF-8): rewrite all
    for table, columns, key, deletes, writes in plan:
        if deletes:
            where = " AND ".join(f"{k} = ?" for k in key.split(", "))
            conn.executemany(f"DELETE FROM {table} WHERE {where}", deletes)
        if writes:
            marks = _in_clause(len(columns.split(", ")))
            conn.executemany(f"INSERT OR REPLACE INTO {table} ({columns}) VALUES ({marks})", writes)
    return True


def _repair_index_definitions(conn: sqlite3.Connection) -> None:
    """Recreate the projection's secondary indexes that are missing or not defined as this
    version defines them (``CREATE INDEX IF NOT EXISTS`` keeps an index of the same name)."""
    names = list(PROJECTION_INDEXES)
    sql = f"SELECT name, sql FROM sqlite_master WHERE type = 'index' AND name IN ({_in_clause(len(names))})"
    found = dict(conn.execute(sql, names))
    for name, create in PROJECTION_INDEXES.items():
        expected = create.replace("IF NOT EXISTS ", "")
        if " ".join(str(found.get(name)).split()) != " ".join(expected.split()):
            conn.execute(f"DROP INDEX IF EXISTS {name}")
            conn.execute(create)


def _rebuild(
    conn: sqlite3.Connection,
    folded: State,
    batch_size: int,
    progress: Callable[[int, int], None] | None,
    full: bool = False,
    busy_timeout: float = 0.0,
) -> Rebuilt:
    """Rewrite the projection from ``folded`` (the whole log folded up to its position), after
    folding whatever was appended since, all in one write transaction (``full``: the history
    index too, staged before it). The lock is waited for here, up to ``busy_timeout``: a
    retry of the whole call would stage the history again at each of the writer's busy slices."""
    history: _StagedHistory | None = None
    if full:
        history = _StagedHistory()
        history.stage(conn, batch_size)
    _retry_busy(lambda: conn.execute("BEGIN IMMEDIATE"), busy_timeout)  # (the only busy statement)
    try:
        state = folded
        head = int(conn.execute("SELECT max(position) FROM events").fetchone()[0] or 0)
        cursor = conn.execute(
            "SELECT position, type, schema_version, data FROM events WHERE position > ? ORDER BY position",
            (state.position,),
        )
        with gc_paused():  # (hundreds of thousands of row tuples come and go: no collection for them)
            while rows := cursor.fetchmany(batch_size):
                fold_payloads(state, follows_on(state.position, rows))
            if progress is not None:
                progress(head, head)
            if not full and _sync_projection(conn, state):
                _repair_index_definitions(conn)
            else:
                _replace_projection(conn, state)
            if history is not None:
                history.swap(conn, batch_size)
        # The time-travel snapshots go with the projection they were folded beside, in this
        # transaction: dropped in one of their own after it, a crash between the two kept the
        # snapshots of an older fold (an evstore since fixed) that the rebuild was run to forget.
        # (counted here, what this transaction drops: not before the rebuild, when a question
        # answered meanwhile - here or in another process - had still to save some on its way;
        # the tombstone segments, at minus their snapshot's position, are not counted)
        dropped = conn.execute("DELETE FROM snapshots WHERE position > 0").rowcount
        conn.execute("DELETE FROM snapshots")
        conn.execute("DELETE FROM provider_snapshots")
        count = int(conn.execute("SELECT count(*) FROM events").fetchone()[0])  # == head unless tampered
        conn.execute("COMMIT")
        return Rebuilt(count, max(dropped, 0))
    except BaseException:
        _rollback(conn)
        raise


class _StagedHistory:
    """The history index rows of the log, written to a TEMP table (``rebuild(full=True)``, for an
    index that lost entries): each event under the entities its payload names and the providers
    its fold changed holdings on (as an import indexes it).

    :meth:`stage` runs before the rebuild takes the write lock (a connection's TEMP tables take
    no lock on the store: other processes' writers go on); :meth:`swap`, under the lock, stages
    what was appended since and replaces the index with the rows in key order (one sort by
    SQLite, then B-tree appends: inserting them as read, in random key order, took 3x as long).
    """

    def __init__(self) -> None:
        self.state = State(usages_deferred=True)
        self.through = 0

    def stage(self, conn: sqlite3.Connection, batch_size: int) -> None:
        conn.execute("CREATE TEMP TABLE IF NOT EXISTS staged_entities (entity TEXT, position INTEGER)")
        conn.execute("DELETE FROM temp.staged_entities")
        self._add(conn, batch_size)

    def swap(self, conn: sqlite3.Connection, batch_size: int) -> None:
        self._add(conn, batch_size)
        conn.execute("DELETE FROM event_entities")
        conn.execute(
            "INSERT OR IGNORE INTO event_entities SELECT entity, position FROM temp.staged_entities "
            "ORDER BY entity, position"
        )
        conn.execute("UPDATE meta SET value = ? WHERE key = 'history_through'", (str(self.through),))
        conn.execute("DROP TABLE temp.staged_entities")

    def _add(self, conn: sqlite3.Connection, batch_size: int) -> None:
        state = self.state
        cursor = conn.execute(
            "SELECT position, type, schema_version, data FROM events WHERE position > ? ORDER BY position",
            (self.through,),
        )
        with gc_paused():
            while rows := cursor.fetchmany(batch_size):
                out: list[tuple[str, int]] = []
                for position, etype, version, data in rows:
                    out.extend((key, position) for key in history_keys(state, etype, version, data, position))
                    self.through = position
                conn.executemany("INSERT INTO temp.staged_entities VALUES (?,?)", out)


def history_keys(state: State, etype: str, version: int, data: str, position: int) -> set[str]:
    """The history index keys of one event of a log folded in order into ``state`` (which this
    folds it into): the entities its payload names and the providers its fold changed holdings on
    (as an import indexes it); a row that cannot be decoded, every id its text holds."""
    try:
        # (as a replay decodes: pydantic's validation of every event took twice as long as the
        # rest of the rebuild)
        fields = payload_fields(etype, version, data, position)
    except err.CorruptEvent:
        return _damaged_row_keys(data)
    changed = fold_noting_providers(state, FOLDS[etype], fields, position)
    # (entities() reads attributes only: the decoded struct stands in for the model)
    keys = EVENT_TYPES[etype].entities(fields)
    keys |= {f"provider:{p}" for p in changed}
    return keys


def _compare_history(conn: sqlite3.Connection, upto: int) -> HistoryCheck:
    staged = "SELECT entity, position FROM temp.staged_entities WHERE position <= ?"
    stored = "SELECT entity, position FROM event_entities WHERE position <= ?"
    counts, examples = [], []
    for first, second in ((staged, stored), (stored, staged)):
        difference = f"{first} EXCEPT {second}"
        counts.append(conn.execute(f"SELECT count(*) FROM ({difference})", (upto, upto)).fetchone()[0])
        rows = conn.execute(f"{difference} ORDER BY 2, 1 LIMIT {HISTORY_EXAMPLES}", (upto, upto))
        examples.append(tuple((str(e), int(p)) for e, p in rows))
    return HistoryCheck(upto, counts[0], counts[1], examples[0], examples[1])


# --- queries on the persisted projection --------------------------------------------------------


def _q_provider(conn: sqlite3.Connection, provider: str) -> Any:
    row = conn.execute(
        "SELECT uuid, name, parent, root, generation, inventories, usages FROM p_providers WHERE uuid = ?",
        (provider,),
    ).fetchone()
    return None if row is None else persisted.provider_from_row(row)


def _q_consumer(conn: sqlite3.Connection, consumer: str) -> Any:
    state = State()
    _load_consumers(conn, state, {consumer})
    return state.consumers.get(consumer)


def _q_provider_allocations(conn: sqlite3.Connection, provider: str) -> dict[str, dict[str, int]] | None:
    if conn.execute("SELECT 1 FROM p_providers WHERE uuid = ?", (provider,)).fetchone() is None:
        return None
    out: dict[str, dict[str, int]] = {}
    for consumer, resources in conn.execute(
        "SELECT consumer, resources FROM p_allocations WHERE provider = ? ORDER BY consumer", (provider,)
    ):
        out[consumer] = persisted.resources_from_json(consumer, provider, resources)
    return out


def _q_project_usages(
    conn: sqlite3.Connection, project_id: str, user_id: str | None, consumer_type: str | None
) -> list[UsageGroup]:
    """From the counters (see :func:`_count_usages`): one group per user and consumer type."""
    sql = "SELECT user_id, counters FROM p_usages WHERE project_id = ?"
    params = [project_id]
    if user_id is not None:
        sql += " AND user_id = ?"
        params.append(user_id)
    groups: list[UsageGroup] = []
    for user, text in conn.execute(sql, params).fetchall():
        for ctype, (count, amounts) in persisted.user_counters_from_json(
            project_id, user, text, answered=True
        ).items():
            if consumer_type is None or ctype == consumer_type:
                groups.append((ctype or None, count, amounts))
    return groups


def _q_providers(conn: sqlite3.Connection) -> list[tuple[str, str]]:
    return conn.execute("SELECT uuid, name FROM p_providers ORDER BY name").fetchall()


QUERIES: dict[str, Callable[..., Any]] = {
    "provider": _q_provider,
    "consumer": _q_consumer,
    "provider_allocations": _q_provider_allocations,
    "project_usages": _q_project_usages,
    "providers": _q_providers,
}
