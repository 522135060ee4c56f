"""The export file format (JSON lines) and the checks an import makes before trusting a file.

Line 1 is a header: ``{"format": "evstore-export", "version": 1, "events": N, "head": N,
"head_hash": "..."}``. Every other line is one stored row, verbatim: position, event_id, type,
schema_version, ``data`` and ``metadata`` as the exact JSON *text* that was hashed, recorded_at,
hash. Keeping the text (not re-serialised JSON) is what lets an import reproduce the hash chain
bit for bit. :class:`ChainCheck` refuses anything that is not a complete, unbroken log.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from evstore.errors import CorruptEvent, InvalidInput, shown
from evstore.events import (
    GENESIS_HASH,
    AllocationsReplaced,
    Metadata,
    RawEvent,
    ValueCheck,
    decode_event,
    describe_error,
)
from evstore.schema import CANONICAL_UUID
from projections.invariants import REMEMBERED_TYPES, LogMemory, impossible_event
from projections.state import State, evolve_noting_providers

EXPORT_FORMAT = "evstore-export"
#: 2: the same lines; its events may carry the optional payload fields an evstore that writes version
#: 1 refuses (a migration consumer's ``on_behalf_of``, a deleted child provider's ``parent``): such
#: an evstore refuses the file by its header, instead of calling its events corrupt at their lines
EXPORT_VERSION = 2
#: what this evstore imports (version 1: any export an earlier evstore wrote)
IMPORTED_EXPORT_VERSIONS = (1, 2)
_HEX64 = re.compile("[0-9a-f]{64}")
ROW_FIELDS = ("position", "event_id", "type", "schema_version", "data", "metadata", "recorded_at", "hash")


#: one stored event row, exactly as exported (the backend's raw row)
ExportRow = RawEvent


@dataclass(frozen=True, slots=True)
class ExportHeader:
    events: int
    head: int
    head_hash: str
    version: int = EXPORT_VERSION

    def to_line(self) -> str:
        return json.dumps(
            {
                "format": EXPORT_FORMAT,
                "version": self.version,
                "events": self.events,
                "head": self.head,
                "head_hash": self.head_hash,
            },
            separators=(",", ":"),
        )


def row_line(row: Any) -> str:
    """One row as a JSON line (``row`` is any object with the raw row's attributes)."""
    try:
        return json.dumps({name: getattr(row, name) for name in ROW_FIELDS}, separators=(",", ":"))
    except (TypeError, ValueError):  # a damaged row (e.g. a BLOB where text belongs)
        raise CorruptEvent(
            f"The row at position {row.position} cannot be exported: a field is stored with another "
            "type than evstore writes (`evstore audit` names it)",
            position=row.position,
            reason="undecodable",
        ) from None


_TOO_DEEP = "is JSON nested too deeply to read"


def _kind(value: object) -> str:
    """What a line that is no text is, for a message: ``bytes``, ``a list``..."""
    name = type(value).__name__
    return name if isinstance(value, bytes | bytearray) else f"a {name}"


def _corrupt(message: str, line: int, **details: Any) -> CorruptEvent:
    return CorruptEvent(f"line {line}: {message}", line=line, **details)


def parse_header(text: str) -> ExportHeader:
    text = text.removeprefix("\ufeff")  # (a byte-order mark an editor added when saving the file)
    try:
        raw = json.loads(text)
    except ValueError:
        raise _corrupt("not an evstore export (the first line is not JSON)", 1, reason="header") from None
    except RecursionError:  # (see parse_row)
        raise _corrupt(f"not an evstore export (the first line {_TOO_DEEP})", 1, reason="header") from None
    if not isinstance(raw, dict) or raw.get("format") != EXPORT_FORMAT:
        raise _corrupt(f"not an evstore export (no {EXPORT_FORMAT!r} header)", 1, reason="header")
    version = raw.get("version")
    if type(version) is not int or version not in IMPORTED_EXPORT_VERSIONS:
        raise _corrupt(
            f"export format version {version!r}; this evstore reads versions "
            f"{', '.join(map(str, IMPORTED_EXPORT_VERSIONS))} (a newer evstore wrote it? upgrade evstore)",
            1,
            reason="header",
        )
    events, head, head_hash = raw.get("events"), raw.get("head"), raw.get("head_hash")
    # (as evstore writes them: counts are JSON integers, the hash a string; "7", 7.9 or true
    # are a header something else wrote, not coerced into one)
    if not (
        all(type(v) is int and v >= 0 for v in (events, head))
        and isinstance(head_hash, str)
        and _HEX64.fullmatch(head_hash)
    ):
        raise _corrupt(
            "malformed export header (events and head must be integers, head_hash a 64-digit hex hash)",
            1,
            reason="header",
        )
    assert isinstance(events, int) and isinstance(head, int)  # (for mypy)
    return ExportHeader(events, head, head_hash, version)


def parse_row(text: str, line: int) -> ExportRow:
    try:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not an object")
        missing = next((name for name in ROW_FIELDS if name not in raw), None)
        if missing is not None:  # (a second header, a row cut by hand: named by what it lacks)
            raise ValueError(f"it has no {missing!r} field")
        values = [raw[name] for name in ROW_FIELDS]
    except ValueError as exc:
        raise _corrupt(f"not an event row ({exc})", line, reason="undecodable") from None
    except RecursionError:
        # (JSON nested deeper than Python's recursion limit, which no row is: a damaged or hostile
        # file's fault, not a bug of evstore's - it escaped the import as a bare RecursionError)
        raise _corrupt(f"not an event row (it {_TOO_DEEP})", line, reason="undecodable") from None
    position, event_id, etype, version, data, metadata, recorded_at, digest = values
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (position, version))
    strs_ok = all(isinstance(v, str) for v in (event_id, etype, data, metadata, recorded_at, digest))
    if not (ints_ok and strs_ok):
        raise _corrupt("an event row field has the wrong type", line, reason="undecodable")
    return ExportRow(position, event_id, etype, version, data, metadata, recorded_at, digest)


@dataclass(slots=True)
class ChainCheck:
    """Re-validates rows in order: gap-free positions from 1, the hash chain, decodable events of
    known types and versions, text the databases can store, recorded times in evstore's form
    (UTC, microseconds) that never go backwards, and (``fold``) that every event folds, as the
    rebuild after the import will fold it. ``fold=False`` is a second pass over a file already
    checked: it keeps no state, and ``ends_at`` (the first pass's final hash) makes sure it reads
    the same rows (the chain covers every field of every row), so what the first pass found
    holds for them too.

    That event ids are unique is not checked here: a set of every id read grew with the log
    (~120 bytes an event, ~1.2 GB for 10M events). The import finds a repeated id as it writes
    the rows, in the database (:func:`duplicate_id`), inside the transaction that a refused
    file rolls back. Nor does it keep the history keys of events whose fold changes holdings on
    providers their payload does not name (~360 bytes such an event): the write pass finds them
    from its own fold of the rows it writes."""

    fold: bool = True
    #: the hash the chain must end at (a second pass: the first pass's ``prev_hash``)
    ends_at: str | None = None
    expected: int = 1
    prev_hash: str = GENESIS_HASH
    last_time: datetime | None = None
    #: (usage is not needed to fold: deferred, as a replay defers it)
    state: State = field(default_factory=lambda: State(usages_deferred=True))
    values: ValueCheck = field(default_factory=ValueCheck)
    #: the names live providers hold, the providers deleted and the migration links a plain write
    #: dropped, beside the fold (see LogMemory)
    memory: LogMemory = field(default_factory=LogMemory)

    def check(self, row: ExportRow, line: int) -> None:
        if row.position != self.expected:
            raise _corrupt(
                f"position {row.position} where {self.expected} was expected (positions must be 1, 2, 3...)",
                line,
                position=row.position,
                reason="position_gap",
            )
        digest = row.chained_hash(self.prev_hash)
        if digest != row.hash:
            raise _corrupt(
                f"hash chain broken at position {row.position}: the row was altered, or one before it",
                line,
                position=row.position,
                reason="hash_chain",
            )
        if not CANONICAL_UUID.match(row.event_id):
            raise _corrupt(
                f"event id {shown(row.event_id, 80)} of position {row.position} is not a uuid in canonical "
                "form (lower case, with dashes), as every event id evstore writes is",
                line,
                position=row.position,
                reason="envelope",
            )
        try:
            event = decode_event(row.type, row.schema_version, row.data, row.position)
            Metadata.model_validate_json(row.metadata)  # as readers decode it
            recorded = datetime.fromisoformat(row.recorded_at)
        except CorruptEvent as exc:
            raise _corrupt(exc.message, line, **exc.details) from None
        except ValueError as exc:
            raise _corrupt(
                f"bad envelope at position {row.position}: {describe_error(exc, 'metadata')}",
                line,
                position=row.position,
                reason="envelope",
            ) from None
        if "\\u" in row.data and not _storable(row.data):
            raise _corrupt(
                f"the payload at position {row.position} holds text that is not valid unicode (a lone "
                "surrogate escape): no database can store it",
                line,
                position=row.position,
                reason="undecodable",
            )
        if recorded.tzinfo is None:
            raise _corrupt(
                f"recorded_at of position {row.position} has no time zone (evstore's form is UTC with "
                "microseconds, e.g. 2026-01-02T03:04:05.000006+00:00)",
                line,
                position=row.position,
                reason="naive_time",
            )
        # Readers find positions by time comparing the stored text (it sorts as the times do only
        # in one form), and the hash covers the text: a time in any other form is refused.
        try:
            in_utc = recorded.astimezone(UTC).isoformat(timespec="microseconds")
        except OverflowError:  # (an offset that takes it before year 1 or past 9999 in UTC)
            in_utc = None
        if in_utc != row.recorded_at:
            raise _corrupt(
                f"recorded_at of position {row.position} is {row.recorded_at!r}, not in evstore's form "
                "(UTC with microseconds, e.g. 2026-01-02T03:04:05.000006+00:00)",
                line,
                position=row.position,
                reason="envelope",
            )
        if self.last_time is not None and recorded < self.last_time:
            raise _corrupt(
                f"recorded_at goes backwards at position {row.position}",
                line,
                position=row.position,
                reason="time_order",
            )
        if self.fold:
            bad = self.values.problem(row.type, event.__dict__)
            if bad is not None:
                raise _corrupt(
                    f"the event at position {row.position} holds a value no evstore command writes: {bad}",
                    line,
                    position=row.position,
                    reason="invalid_value",
                )
            if "\\u0000" in row.data and (field_name := _nul_in(row.data)) is not None:
                # (no command writes one, and PostgreSQL cannot store one in the projection: refused
                # here alike on both backends, where SQLite imported it and PostgreSQL failed as it
                # wrote the rows, naming neither the line nor the event)
                raise _corrupt(
                    f"the event at position {row.position} holds a value no evstore command writes: "
                    f"{field_name} holds a NUL character (every command refuses one: PostgreSQL cannot "
                    "store it)",
                    line,
                    position=row.position,
                    reason="invalid_value",
                )
            found = impossible_event(self.state, row.type, event)
            if found is None and row.type in REMEMBERED_TYPES:  # (what only the log before it rules out)
                found = self.memory.check(self.state, row.type, event, row.position)
            elif found is None and isinstance(event, AllocationsReplaced) and not event.allocations:
                self.memory.emptied(self.state, event.consumer)
            if found is not None:
                # (every command refuses it: a log that was valid where it was written holds none)
                raise _corrupt(
                    f"the {row.type} event at position {row.position} sets what no evstore command "
                    f"writes: {found.what} (rule {found.rule}); nothing was imported",
                    line,
                    position=row.position,
                    reason="invalid_value",
                    rule=found.rule,
                    event_type=row.type,
                    **found.details,
                )
            self._fold(event, row.position, line)
        self.last_time = recorded
        self.prev_hash = row.hash
        self.expected = row.position + 1

    def _fold(self, event: Any, position: int, line: int) -> None:
        # (folded as the write pass folds it, noting the providers whose holdings change: see
        # evstore.log.sqlite.imported_keys)
        try:
            evolve_noting_providers(self.state, event, position)
        except Exception as exc:  # (every fold is meant to take any decodable event)
            raise _corrupt(
                f"the event at position {position} cannot be folded: {exc!r}",
                line,
                position=position,
                reason="unfoldable",
            ) from None


def duplicate_id(event_id: str, position: int, line: int | None = None) -> CorruptEvent:
    """The refusal of an export whose row at ``position`` repeats an earlier row's event id.

    A backend's import raises it without ``line`` (it sees rows, not lines), the id in its
    details: the import then reads the file once more to name the line (:func:`second_row_of`)."""
    if line is None:
        return CorruptEvent(
            f"event id {event_id} appears twice", position=position, reason="duplicate_id", event_id=event_id
        )
    return _corrupt(f"event id {event_id} appears twice", line, position=position, reason="duplicate_id")


def second_row_of(lines: Iterable[str], event_id: str) -> tuple[int, int] | None:
    """The line and position of the second row of an export holding ``event_id`` (None if fewer
    hold it): the row that first repeats it. A backend names the id its import found repeated
    first, and may not know which row of a batch repeats it (PostgreSQL: an id of an earlier
    batch held twice by the last one); one id is all this keeps."""
    seen = False
    for line_no, text in enumerate(lines, start=1):
        if not isinstance(text, str) or (event_id not in text and "\\u" not in text):
            continue  # (parsed only if it may hold the id, spelled out or escaped)
        try:
            row = parse_row(text, line_no)
        except CorruptEvent:
            continue
        if row.event_id == event_id:
            if seen:
                return line_no, row.position
            seen = True
    return None


def _storable(data: str) -> bool:
    """Whether every string in the JSON text ``data`` encodes as UTF-8 (no lone surrogate)."""
    try:
        json.dumps(json.loads(data), ensure_ascii=False).encode()
    except (ValueError, RecursionError):  # (UnicodeEncodeError is a ValueError)
        return False
    return True


def _nul_in(data: str) -> str | None:
    """The payload field of the JSON text ``data`` (already decoded once: well formed, of its
    event's shape) holding a NUL character in a string or a key, None when none does."""

    def holds(value: Any) -> bool:
        if isinstance(value, str):
            return "\x00" in value
        if isinstance(value, dict):
            return any(holds(k) or holds(v) for k, v in value.items())
        if isinstance(value, list):
            return any(holds(v) for v in value)
        return False

    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return None  # (decoding said what is wrong with it)
    if not isinstance(payload, dict):
        return None
    return next((str(k) for k, v in payload.items() if holds(k) or holds(v)), None)


def read_export(lines: Iterable[str], check: ChainCheck | None = None) -> Iterator[ExportRow]:
    """Parse and validate an export, yielding rows; raises :class:`CorruptEvent` at the first problem.

    The header's counts and final hash are checked after the last row, so a truncated file is
    refused too (consume the whole iterator before trusting any row). ``check`` (a fresh
    :class:`ChainCheck` by default) is what validates, and what it learnt stays readable there.
    """
    header: ExportHeader | None = None
    check = check if check is not None else ChainCheck()
    count = 0
    line_no = 0
    try:
        for line_no, text in enumerate(lines, start=1):
            if not isinstance(text, str):
                raise InvalidInput(
                    f"line {line_no} of the export is {_kind(text)}, not text: open the file in text "
                    "mode (open(path), not open(path, 'rb')), or decode the lines",
                    field="open_lines",
                )
            if not text.strip():
                continue
            if header is None:
                header = parse_header(text)
                continue
            row = parse_row(text, line_no)
            check.check(row, line_no)
            count += 1
            yield row
    except UnicodeDecodeError:
        # (raised by a text file the lines are read from - `lambda: open(path)` - as it decodes
        # them, a chunk ahead of the lines read: no line to name)
        raise InvalidInput(
            "the export is not UTF-8 text: not an evstore export, or a damaged one (nothing was imported)",
            field="open_lines",
        ) from None
    if header is None:
        if check.ends_at is not None:  # (a second pass: the first one read a whole export)
            raise InvalidInput(
                "open_lines() gave no lines the second time it was called: it is called twice (to "
                "validate, then to import) and must return the export's lines anew each time (e.g. "
                "`lambda: open(path)`, not an open file or a generator): nothing was imported",
                field="open_lines",
            )
        raise InvalidInput("the export file is empty", field="open_lines", reason="empty")
    if check.ends_at is not None and check.prev_hash != check.ends_at:
        raise _corrupt(
            "the file changed while it was imported (its hash chain ends elsewhere than when it was "
            "validated): nothing was imported",
            line_no,
            reason="changed",
        )
    if count == header.events and check.expected - 1 == header.head and check.prev_hash != header.head_hash:
        raise _corrupt(
            f"the file's {count} events end with hash {check.prev_hash}, but its header's head_hash is "
            f"{header.head_hash}: the header or the last row was altered",
            line_no,
            reason="truncated",
        )
    if count != header.events or check.expected - 1 != header.head or check.prev_hash != header.head_hash:
        raise _corrupt(
            f"the file ends after {count} events at position {check.expected - 1}, but its header promises "
            f"{header.events} events up to position {header.head}: it is truncated or was altered",
            line_no,
            reason="truncated",
        )
