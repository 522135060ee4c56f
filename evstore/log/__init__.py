"""The storage protocol every backend implements, and what crosses it.

A backend owns the log (append-only events with positions, ids, hashes, an entity index) and
the persisted projection, and runs commands as *jobs*: for each job, inside one write
transaction, it checks the idempotency key, loads the slice of state the command needs, calls
the pure ``decide``, appends the events, folds them with ``evolve`` into the projection, and
commits. Several queued jobs may share one transaction (group commit); each still succeeds or
fails on its own.
"""

from __future__ import annotations

import contextvars
import json
import os
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from operator import itemgetter
from typing import Any, NamedTuple, Protocol, TypeVar

from evstore.commands import Command, Needs
from evstore.errors import CorruptEvent, EvstoreError, StorageError, shown
from evstore.events import GENESIS_HASH, RawEvent, RecordedEvent, event_hash
from projections.persisted import check_held_amount
from projections.state import State

#: a fingerprint as evstore stores it with an idempotency key (``store._fingerprints``)
_FINGERPRINT = re.compile(r"[0-9a-f]{64}")

#: the largest position (and count) a backend can store: SQLite INTEGER and PostgreSQL bigint
MAX_POSITION = 2**63 - 1

# Random bits for command and event ids: a generator seeded from os.urandom, evstore's own (a
# random.seed() elsewhere does not touch it) and seeded again in a forked child (which must not
# repeat its parent's ids). Not os.urandom per id: a system call releases the GIL, and taking it
# back on a busy store's event loop cost ~20 us per command (cProfile, 64 tasks) against 0.1 us.
_IDS = random.Random()
os.register_at_fork(after_in_child=_IDS.seed)
random_bits = _IDS.getrandbits


@dataclass(frozen=True, slots=True)
class HistoryCheck:
    """The history index (``history``, the entity slices of ``state_at``) against the log, up
    to ``through``: rows the log implies and the index lacks, rows it holds the log does not
    imply, and a few of each as ``(entity, position)``."""

    through: int
    missing: int = 0
    extra: int = 0
    missing_examples: tuple[tuple[str, int], ...] = ()
    extra_examples: tuple[tuple[str, int], ...] = ()


#: examples of index rows missing or extra that a history check reports
HISTORY_EXAMPLES = 10


@dataclass(frozen=True, slots=True)
class SchemaRepair:
    """What an open repaired in a store of the current schema version whose schema was not whole
    (objects dropped by hand, left out of a copy or restore; on PostgreSQL also the refold an
    interrupted upgrade left pending): the tables, indexes or view it made again, the indexes of
    an earlier version it dropped, and whether it refolded the projection from the log."""

    made_again: tuple[str, ...] = ()
    dropped: tuple[str, ...] = ()
    refolded: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"made_again": list(self.made_again), "dropped": list(self.dropped), "refolded": self.refolded}


@dataclass(frozen=True, slots=True)
class Job:
    command: Command
    metadata: dict[str, Any]
    #: ``metadata`` as stored with each event: sorted keys, compact (made once, at submit)
    metadata_json: str
    #: ``needs(command)``: what the command reads and locks (made once, at submit)
    needs: Needs
    idempotency_key: str | None = None
    fingerprint: str = ""
    #: what an older evstore recorded as ``fingerprint`` for this command, where that differs
    #: (else ""): a key it stored for the command is this command's too
    older_fingerprint: str = ""
    #: the caller's context (its ``contextvars``, e.g. structlog's bound request id) at submit: a
    #: line the writer logs for the command (its caller cancelled) is logged in it, not in the
    #: writer's, which is the context of whoever opened the store. Dropped (None) once the caller
    #: is answered: errors' tracebacks hold the writer's frames, and those every job of a batch
    context: contextvars.Context | None = field(default=None, repr=False, compare=False)

    def same_command(self, recorded: object) -> bool:
        """Whether ``recorded``, the fingerprint stored with this job's key, is this command's.
        One that is not in the form evstore writes (a SHA-256 hex digest: NULL, empty, cut,
        edited by hand) is a ``StorageError`` with ``details["reason"] == "damaged"``, as a
        damaged receipt is (:meth:`Receipt.damaged`): it names no command, so it cannot say that
        this one is another. Only a well-formed digest that is not this command's is ``False``
        (an ``IdempotencyConflict``: it cannot be told from another command's)."""
        if recorded == self.fingerprint or (recorded == self.older_fingerprint != ""):
            return True
        if type(recorded) is not str or _FINGERPRINT.fullmatch(recorded) is None:
            raise Receipt.damaged(
                self.idempotency_key or "",
                f"{'NULL' if recorded is None else shown(recorded, 76)} "
                "is not a SHA-256 digest (64 hex digits)",
                "fingerprint (the SHA-256 of the command it was used for)",
            )
        return False


@dataclass(frozen=True, slots=True)
class Receipt:
    """What an accepted command did: the positions it appended and the generations it left."""

    positions: tuple[int, ...] = ()
    consumer_generations: dict[str, int | None] = field(default_factory=dict)
    provider_generations: dict[str, int] = field(default_factory=dict)
    replayed: bool = False

    @property
    def position(self) -> int | None:
        """The last position appended (``None`` when the command appended nothing)."""
        return self.positions[-1] if self.positions else None

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain JSON-ready values."""
        return {
            "positions": list(self.positions),
            "consumer_generations": dict(self.consumer_generations),
            "provider_generations": dict(self.provider_generations),
            "replayed": self.replayed,
        }

    def to_json(self) -> str:
        """:meth:`to_dict` as JSON text (also what an idempotency key records: its reader,
        :meth:`from_json`, sets ``replayed`` itself)."""
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str, replayed: bool = True) -> Receipt:
        raw = json.loads(text)
        return cls(
            tuple(raw["positions"]),
            raw["consumer_generations"],
            raw["provider_generations"],
            replayed=replayed,
        )

    @classmethod
    def stored(cls, key: str, text: Any, last: int = MAX_POSITION) -> Receipt:
        """The receipt an idempotency key recorded, read back for a retry; a row that is not one
        evstore writes (edited by hand, a bad restore) is a ``StorageError`` saying so, with
        ``details["reason"] == "damaged"`` - not the decoder's exception from inside. ``last``:
        the largest position it may name (the head, where positions are stored; a backend that
        stores other numbers checks them itself, see :meth:`damaged`)."""
        try:
            receipt = cls.from_json(text)
            generations = receipt.consumer_generations
            if not isinstance(generations, dict) or not isinstance(receipt.provider_generations, dict):
                raise ValueError("not a receipt of positions and generations")
            if not all(type(p) is int and 1 <= p <= last for p in receipt.positions):
                raise ValueError(f"positions {shown(list(receipt.positions), 60)} name no events of the log")
            if not all(type(g) is int and g >= 0 for g in receipt.provider_generations.values()):
                raise ValueError("a provider generation that is not a count")
            if not all(g is None or (type(g) is int and g >= 0) for g in generations.values()):
                raise ValueError("a consumer generation that is not a count")
            return receipt
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise cls.damaged(key, first) from None

    @staticmethod
    def damaged(key: str, why: str, what: str = "receipt") -> StorageError:
        """The error for the stored receipt of idempotency key ``key`` (or ``what`` else its row
        holds) that is not one evstore writes (``why``)."""
        return StorageError(
            f"The {what} stored for idempotency key {shown(key, 80)} cannot be read ({why[:120]}): "
            "its row in the idempotency table was damaged (edited by hand, a bad restore). The command "
            "that key names was committed before (its events carry the key in their metadata: "
            "`evstore history` of its consumer or provider shows them), and nothing was written now; "
            "so do not run it again under another key without checking what it did. Restore the "
            "store from a backup, or delete that row to let the key be used again",
            idempotency_key=key,
            reason="damaged",
            outcome_unknown=False,
        )


Outcome = Receipt | EvstoreError


__all__ = [
    "GENESIS_HASH",
    "Backend",
    "Job",
    "Outcome",
    "PayloadRow",
    "RawEvent",
    "Receipt",
    "check_held_amount",
    "event_hash",
]

#: ``(position, type, schema_version, data)``: what a fold needs of a row (replay reads only this).
PayloadRow = tuple[int, str, int, str]


class CallbackFailed(Exception):
    """A caller's callback (a rebuild's or an import's ``progress``) raised ``error`` inside a
    backend's work: carried past the backend's conversions of its own failures (an ``OSError`` -
    a ``TimeoutError``, a broken pipe - is not the database's, a ``ValueError`` saying "closed" is
    not the store closed), and raised to the caller as it was."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


def carried(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` raising its exceptions as :class:`CallbackFailed`."""

    def call(*args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            raise CallbackFailed(exc) from None

    return call


class LostTail(NamedTuple):
    """The newest change the projection records by an event the log no longer holds: the log
    lost its last events (the audit's ``log_truncated``; a rebuild would forget them)."""

    head: int
    #: past ``head`` (SQLite, or a position a rebuild wrote), or a lost event's ``-seq`` (PostgreSQL)
    position: int
    consumer: str
    #: "deleted" or "allocations changed"
    what: str

    def details(self) -> dict[str, Any]:
        """For an error's or a finding's details: the head, the consumer, and which the lost event
        was - ``lost_position``, or ``lost_seq`` (PostgreSQL's sequence number) when the projection
        names it only so. (Not ``position``, which a CorruptEvent's readers take for a row to
        read up to.)"""
        where = (
            {"lost_position": self.position} if self.position > self.head else {"lost_seq": -self.position}
        )
        return {"reason": "log_truncated", "head": self.head, "consumer": self.consumer, **where}

    def message(self) -> str:
        # (PostgreSQL's projection names an event by its -seq until the sequencer positions it,
        # and keeps that name: whether the lost event ever had a position is not known - it came
        # after the head, as the log's positions run 1..head without a hole)
        at = (
            f"at position {self.position}"
            if self.position > self.head
            else f"by an event the log no longer holds, after position {self.head} (the projection "
            f"names it by its sequence number {-self.position}, not by a position: it may never "
            "have been given one)"
        )
        return (
            f"The log ends at position {self.head}, but the projection records that consumer "
            f"{self.consumer} was {self.what} {at}: the log lost its last events (deleted, or restored "
            "from an older copy). A rebuild would forget them for good (a tombstone among them): "
            f"restore the store from a backup that holds its events after position {self.head} (or "
            "`evstore import` an export that holds them into an empty store), or rebuild with "
            "force=True (`evstore rebuild --force`) to accept the loss"
        )


class Rebuilt(int):
    """What a rebuild answers (``AllocationStore.rebuild``, a backend's ``rebuild``): the number of
    events it folded (an ``int``, as it always was), and ``snapshots_dropped``, the time-travel
    snapshots its own transaction deleted - also any a question answered while it folded saved on
    its way."""

    snapshots_dropped: int

    def __new__(cls, events: int, snapshots_dropped: int) -> Rebuilt:
        made = super().__new__(cls, events)
        made.snapshots_dropped = snapshots_dropped
        return made  # (shown, as str() and repr(), and written to JSON as the int it is)

    def __getnewargs__(self) -> tuple[int, int]:  # type: ignore[override]
        # (copy, deepcopy and pickle make it again by __new__: int's gives the events alone)
        return int(self), self.snapshots_dropped


class Backend(Protocol):
    url: str
    #: the schema version the open upgraded the store from (None: it was current, or new)
    upgraded_from: int | None
    #: what the open repaired in a store of the current version (None: nothing, or it upgraded it)
    repaired: SchemaRepair | None

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def abandon(self) -> None:
        """Let go of the connections without the event loop (it may be closed, or this called from
        another thread): the store was collected, or left at exit, unclosed. Nothing uncommitted
        is kept; what committed is durable."""
        ...

    async def run_jobs(self, jobs: Sequence[Job]) -> list[Outcome]: ...
    async def head(self) -> int: ...
    async def read(self, after: int, limit: int) -> list[RecordedEvent]: ...
    async def read_raw(self, after: int, limit: int) -> list[RawEvent]: ...
    async def read_payloads(self, after: int, limit: int) -> list[PayloadRow]: ...
    async def read_entities(
        self,
        entities: Sequence[str],
        after: int,
        limit: int,
        until: int | None = None,
        types: Sequence[str] | None = None,
    ) -> list[RecordedEvent]: ...
    async def position_at(self, at: datetime) -> int: ...
    async def stats(self) -> dict[str, Any]: ...
    async def load_state(self) -> State: ...
    async def query(self, name: str, *args: Any) -> Any: ...
    async def rebuild(
        self, batch_size: int, progress: Callable[[int, int], None] | None = None, full: bool = False
    ) -> Rebuilt:
        """Refold the projection from the log; the time-travel snapshots are dropped in the same
        transaction. Returns the number of events folded, with the snapshots dropped."""
        ...

    async def lost_tail(self) -> LostTail | None: ...


#: options of every store, keywords of ``open_store`` (not in the URL: the store's, not the backend's)
STORE_KEYWORDS = ("max_batch", "poll_interval", "snapshot_every")


def store_keyword_hint(unknown: list[str]) -> str:
    """What to say after a backend's own options: when a URL names a store keyword, that it is
    one; else which they are (the backend's list alone would leave them out)."""
    named = [k for k in unknown if k in STORE_KEYWORDS]
    if not named:
        return f"; and keywords of open_store(url, ...) only: {', '.join(STORE_KEYWORDS)}"
    return f" ({', '.join(named)}: a keyword of open_store(url, ...), not a URL option)"


_Read = TypeVar("_Read")


def follows_on(after: int, rows: list[_Read], position: Callable[[Any], int] = itemgetter(0)) -> list[_Read]:
    """``rows`` (read after position ``after``, in order; ``position`` of one: its first item by
    default) if their positions follow on without a hole; else ``CorruptEvent`` at the first
    missing position. Positions are gap-free by construction (README, Guarantees): a hole is rows
    deleted by hand, which a reader skipping it would hide from whoever follows the log, and which
    a rebuild folding over it would forget for good (a tombstone among them). Every reader of the
    log - read, subscribe, history's pages, export, rebuild - checks with this one."""
    if not rows or position(rows[-1]) == after + len(rows):  # (positions are unique and ordered)
        return rows
    for expected, row in enumerate(rows, after + 1):
        if position(row) != expected:
            raise CorruptEvent(
                f"Position {expected} is missing from the log (the next event is at {position(row)}): "
                "rows were deleted from it; `evstore audit` lists the damage (restore the log from a "
                "backup, or an export taken before the damage)",
                position=expected,
                reason="position_gap",
            )
    return rows
