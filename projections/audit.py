"""The audit: prove the persisted projection equals a fresh replay, and find what should not be.

Findings, each naming the positions of the events that produced it:
- ``integrity``: undecodable rows, unknown types or schema versions, position gaps or disorder,
  a broken hash chain (the first broken position), a log that lost its last events; what only
  a damaged or imported log holds: values or events no command writes, allocations held on a
  provider absent there (deleted while they were held, or never created) or not counted by it,
  a name two live providers hold, a revert giving more than its migration held, a release or a
  confirm of what holds nothing, a deletion of a provider that does not exist;
- ``drift``: every difference between the persisted projection and a replay of the log;
- ``leak``: allocations held by a tombstoned consumer, or by a migration for a tombstoned instance;
- ``over_capacity``: usage above capacity (possible after an inventory shrink), since which event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal, get_args

from evstore.errors import CorruptEvent, EvstoreError, InvalidInput, ProjectionCorrupt, shown
from evstore.events import (
    CAPACITY_PRESSURE,
    CHECKED_PAYLOAD_DECODERS,
    GENESIS_HASH,
    PAYLOAD_DECODERS,
    ValueCheck,
    check_metadata,
    decode_event,
    payload_dict,
    without_advice,
)
from projections.gcpause import gc_paused
from projections.invariants import (
    DELETED_REASON,
    IMPOSSIBLE_CHECKS,
    REMEMBERED_TYPES,
    LogMemory,
    clear_leak,
    find_leaks,
    format_amount,
    over_capacity,
)
from projections.persisted import project_usage_totals
from projections.replay import Turns
from projections.state import FOLDS, ConsumerState, State, dismantle

if TYPE_CHECKING:
    from evstore.log import HistoryCheck, LostTail


FindingKind = Literal["drift", "leak", "over_capacity", "integrity"]
FINDING_KINDS: tuple[str, ...] = get_args(FindingKind)


@dataclass(frozen=True, slots=True)
class Finding:
    kind: str  # (one of FINDING_KINDS)
    message: str
    positions: tuple[int, ...] = ()
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "message": self.message,
            "positions": list(self.positions),
            "details": self.details,
        }


@dataclass(slots=True)
class AuditReport:
    head: int = 0
    events_checked: int = 0
    findings: list[Finding] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings

    def of_kind(self, kind: FindingKind) -> list[Finding]:
        """The findings of one kind; a kind no finding can have (a typo: "leaks") is refused,
        not answered with an empty list that reads as "none found"."""
        if kind not in FINDING_KINDS:
            raise InvalidInput(
                f"unknown kind of finding {shown(kind, 40)}: one of {', '.join(FINDING_KINDS)}", field="kind"
            )
        return [f for f in self.findings if f.kind == kind]

    @property
    def drift(self) -> list[Finding]:
        return self.of_kind("drift")

    @property
    def leaks(self) -> list[Finding]:
        return self.of_kind("leak")

    @property
    def over_capacity(self) -> list[Finding]:
        return self.of_kind("over_capacity")

    @property
    def integrity(self) -> list[Finding]:
        return self.of_kind("integrity")

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.kind] = counts.get(f.kind, 0) + 1
        return {
            "clean": self.clean,
            "head": self.head,
            "events_checked": self.events_checked,
            "counts": counts,
            "findings": [f.to_dict() for f in self.findings],
        }


@dataclass(slots=True)
class _OverTracker:
    """Remembers since which position each (provider, class) has been over capacity."""

    since: dict[tuple[str, str], int] = field(default_factory=dict)
    #: only these providers (``None``: all)
    watch: set[str] | None = None

    def update(self, state: State, event_type: str, fields: Mapping[str, Any], position: int) -> None:
        # Over capacity can only begin where usage rises or capacity falls (the event names those
        # providers), and only end for providers already over: nothing else needs a look.
        pressure = CAPACITY_PRESSURE.get(event_type)
        providers = set() if pressure is None else pressure(fields)
        if self.watch is not None:
            providers &= self.watch
        if self.since:
            providers = providers | {uuid for uuid, _ in self.since}
        for uuid in providers:
            prov = state.providers.get(uuid)
            keys = {k for k in self.since if k[0] == uuid}
            if prov is not None:
                for rc, used in prov.usages.items():
                    inv = prov.inventories.get(rc)
                    cap = inv.capacity if inv is not None else 0.0
                    if used > cap:
                        self.since.setdefault((uuid, rc), position)
                        keys.discard((uuid, rc))
            for k in keys:
                del self.since[k]


ReadRows = Callable[[int, int], Awaitable[list[Any]]]


@dataclass(slots=True)
class _Replay:
    """A checked replay that can be resumed: positions, hash chain and decoding are verified.

    With ``checked=False`` it only folds (rows a checked pass has already seen: what cannot be
    decoded is skipped as that pass skipped it), and with ``over`` set it watches capacity.
    """

    report: AuditReport
    state: State = field(default_factory=State)
    over: _OverTracker | None = None
    checked: bool = True
    expected: int = 1
    prev_hash: str = GENESIS_HASH
    chain_broken: bool = False
    last_seen: int = 0
    values: ValueCheck = field(default_factory=ValueCheck)
    #: the last recorded_at text found readable and aware: a transaction's events share one
    #: (a few thousand distinct in 300,000 events), so most rows need no parse of it
    aware_time: str | None = None
    #: the names live providers hold, the providers deleted and the migration links a plain write
    #: dropped, as an import keeps them, going on past what it finds (see :meth:`_remember`)
    memory: LogMemory = field(default_factory=lambda: LogMemory(shared={}))
    #: the providers deleted that consumers may still hold allocations on: while there are any
    #: (or the fold met an allocation on a provider absent there, and stopped deferring usage),
    #: the events that take allocations away are looked at (see :data:`_HOLDING_CHECKS`);
    #: commands delete only providers nothing is held on, which :meth:`_clear_suspects` drops
    suspects: set[str] = field(default_factory=set)
    #: the number of events checked at which ``suspects`` is next looked over
    next_scan: int = 0
    #: each event that took away allocations held on a provider absent there (see
    #: :data:`_HOLDING_CHECKS`): ``(position, provider, consumer, allocated at, deleted at)``, the
    #: last the position of the provider's deletion while they were held (``None``: it was absent
    #: where they were written)
    absent_taken: list[tuple[int, str, str, int, int | None]] = field(default_factory=list)

    @property
    def gone(self) -> dict[str, int]:
        """Each provider deleted so far, and the position of its last deletion."""
        return self.memory.gone

    async def run(
        self,
        read: ReadRows,
        batch_size: int,
        until: int | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        # Read the next batch while this one is checked: the database thread and the fold overlap.
        pending = asyncio.ensure_future(read(self.last_seen, batch_size))
        turns = Turns()
        try:
            while True:
                batch = await pending
                if not batch:
                    return
                if until is None or batch[-1].position < until:
                    pending = asyncio.ensure_future(read(batch[-1].position, batch_size))
                for row in batch:
                    if until is not None and row.position > until:
                        return
                    self.check(row)
                    if turns.due():
                        await turns.take()  # (other tasks run between slices of the batch)
                if self.suspects and self.report.events_checked >= self.next_scan:
                    self._clear_suspects()
                if progress is not None:
                    progress(self.report.events_checked)
                if until is not None and self.last_seen >= until:
                    return
        finally:
            if not pending.done():
                pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending

    def check(self, row: Any) -> None:
        if row.position > self.last_seen:
            self.last_seen = row.position
        if self.checked:
            self._check_envelope(row)
        # As a replay folds (projections.replay.fold_payloads): the current schema version is
        # decoded straight into a struct of its fields; anything else goes through decode_event,
        # which upcasts or names what is wrong. The fold and ValueCheck.sound read the struct's
        # (or the model's) attributes; a dict of the same fields is made only for what reads one
        # (ValueCheck.problem, once something is found or the numbers are unchecked; the
        # capacity watch) - most events need none (~0.8 us per event).
        payload: Any = None
        numbers = True  # (whether the values' numbers are still to be checked: see ValueCheck)
        if self.checked and (found := CHECKED_PAYLOAD_DECODERS.get(row.type)) is not None:
            if found[0] == row.schema_version:
                try:
                    payload = found[1](row.data)
                    numbers = False
                except ValueError:
                    pass
        if payload is None and (found := PAYLOAD_DECODERS.get(row.type)) is not None:
            if found[0] == row.schema_version:
                try:
                    payload = found[1](row.data)
                except ValueError:
                    pass
        if payload is None:
            try:
                payload = decode_event(row.type, row.schema_version, row.data, row.position)
            except CorruptEvent as exc:
                if self.checked:
                    self.report.findings.append(
                        Finding("integrity", without_advice(exc.message), (row.position,), dict(exc.details))
                    )
                return
        self.state.position = row.position
        if (
            self.checked
            and (numbers or not self.values.sound[row.type](payload))
            and (bad := self.values.problem(row.type, payload_dict(payload))) is not None
        ):
            self.report.findings.append(
                Finding(
                    "integrity",
                    f"{row.type} at position {row.position} holds a value no evstore command writes: {bad} "
                    "(a damaged or imported log: every fold takes it as it is)",
                    (row.position,),
                    {"reason": "invalid_value"},
                )
            )
        if (
            self.checked
            and (check_impossible := IMPOSSIBLE_CHECKS.get(row.type)) is not None
            and (impossible := check_impossible(self.state, payload)) is not None
        ):
            # (what an import refuses, in a log an older evstore imported: the same words)
            self.report.findings.append(
                Finding(
                    "integrity",
                    f"{row.type} at position {row.position} sets what no evstore command writes: "
                    f"{impossible.what} (rule {impossible.rule}; a damaged or imported log: every fold "
                    "takes it as it is)",
                    (row.position,),
                    {
                        "reason": "invalid_value",
                        "rule": impossible.rule,
                        "event_type": row.type,
                        **impossible.details,
                    },
                )
            )
        if self.checked and row.type in _NAMES_A_PROVIDER and payload.provider not in self.state.providers:
            self.report.findings.append(
                Finding(
                    "integrity",
                    f"{row.type} at position {row.position} names provider {payload.provider}, which "
                    "does not exist there (a damaged or imported log: every fold skips the event)",
                    (row.position,),
                    {"reason": "unknown_provider", "provider": payload.provider},
                )
            )
        if self.checked:
            # (a log holds allocations on a provider absent there only after a provider's
            # deletion, or an allocation on one absent, which makes the fold stop deferring usage;
            # a provider's naming and deletion, a revert, a release, a confirm and a plain write
            # are remembered whatever)
            if row.type in REMEMBERED_TYPES:
                self._remember(row.type, payload, row.position)
            elif row.type == "AllocationsReplaced" and not payload.allocations:
                self.memory.emptied(self.state, payload.consumer)
            if (self.suspects or not self.state.usages_deferred) and (
                holding := _HOLDING_CHECKS.get(row.type)
            ) is not None:
                holding(self, payload, row.position)
        FOLDS[row.type](self.state, payload, row.position)
        if self.over is not None:
            self.over.update(self.state, row.type, payload_dict(payload), row.position)

    def _remember(self, event_type: str, e: Any, position: int) -> None:
        """What only the events before it make impossible (:class:`LogMemory`, as an import
        refuses it, ``details["rule"]``), in a log an older evstore imported: an integrity
        finding, ``reason`` the rule's name, citing the earlier event that makes it so (a
        migration's or consumer's emptying, a deletion, the name taken). A revert of a
        migration holding nothing to its instance deleted there is none: that is the leak of an
        older, Placement-style writer's late revert (bug 1848343), reported as a leak while held."""
        found = self.memory.check(self.state, event_type, e, position)
        if event_type == "ProviderDeleted":
            self.suspects.add(e.provider)
        if found is None:
            return
        if found.rule == "duplicate_name":
            holder, named_at = found.details["holder"], found.details["holder_named_at"]
            assert isinstance(named_at, int)
            self.report.findings.append(
                Finding(
                    "integrity",
                    f"{event_type} at position {position} gives provider {e.provider} the name "
                    f"{shown(e.name)}, which provider {holder} holds (named at position {named_at}): two "
                    "providers of one name (a command refuses a name another provider holds, "
                    "placement.duplicate_name: a damaged or imported log); renaming one of them ends the "
                    "clash, and this finding, about the log, stays",
                    tuple(sorted({named_at, position})),
                    {
                        "reason": "duplicate_name",
                        "name": e.name,
                        "provider": e.provider,
                        "holder": holder,
                        "holder_named_at": named_at,
                        "event_type": event_type,
                    },
                )
            )
            return
        self.report.findings.append(
            Finding(
                "integrity",
                f"{event_type} at position {position}: {found.what} (a damaged or imported log: every "
                "fold takes it as it is)",
                tuple(p for p in (found.since, position) if p),
                {"reason": found.rule, **found.details},
            )
        )

    def _clear_suspects(self) -> None:
        """Drop the deleted providers no consumer holds anything on (or created again: what is
        held there is the usage's, ``usage_not_held``), so that a log whose providers were deleted
        as commands delete them - nothing held on them - is not looked at event by event for the
        rest of it. One look over the consumers, at most once per as many events as there are
        consumers (a few nanoseconds an event)."""
        suspects, providers = self.suspects, self.state.providers
        held: set[str] = set()
        for c in self.state.consumers.values():
            allocations = c.allocations
            if allocations and not suspects.isdisjoint(allocations):
                held.update(p for p in allocations if p in suspects)
        self.suspects = {p for p in held if p not in providers}
        self.next_scan = self.report.events_checked + len(self.state.consumers)

    def _check_envelope(self, row: Any) -> None:
        """Position, hash chain, metadata and time of one row."""
        report = self.report
        report.events_checked += 1
        if row.position != self.expected:
            kind = "gap" if row.position > self.expected else "disorder"
            report.findings.append(
                Finding(
                    "integrity",
                    f"Position {kind}: expected {self.expected}, found {row.position}",
                    (row.position,),
                    {"reason": f"position_{kind}", "expected": self.expected},
                )
            )
        self.expected = row.position + 1
        try:
            digest = row.chained_hash(self.prev_hash)
        except (TypeError, ValueError):
            # a field stored with another type than evstore writes (e.g. a BLOB where text belongs)
            wrong = [
                f"{name} ({type(getattr(row, name)).__name__})"
                for name, want in _ROW_TYPES
                if type(getattr(row, name)) is not want
            ]
            report.findings.append(
                Finding(
                    "integrity",
                    f"Cannot decode the row at position {row.position}: "
                    f"{', '.join(wrong) or 'a field'} stored with the wrong type",
                    (row.position,),
                    {"reason": "undecodable"},
                )
            )
            digest = None
        if not self.chain_broken and digest is not None and digest != row.hash:
            self.chain_broken = True
            report.findings.append(
                Finding(
                    "integrity",
                    f"Hash chain broken at position {row.position}: this row or one before it was altered",
                    (row.position,),
                    {"reason": "hash_chain"},
                )
            )
        self.prev_hash = row.hash
        # The envelope, as every reader decodes it (evstore.log.sqlite.decode_raw): a row whose
        # metadata or time cannot be read would make read(), history and tail fail there. (A time
        # without a zone reads, but import refuses it: reported on its own.)
        recorded_at = row.recorded_at
        try:
            check_metadata(row.metadata)
            aware = recorded_at == self.aware_time or datetime.fromisoformat(recorded_at).tzinfo is not None
        except (ValueError, TypeError) as exc:
            report.findings.append(
                Finding(
                    "integrity",
                    f"Cannot decode the envelope at position {row.position}: {_why(exc)}",
                    (row.position,),
                    {"reason": "undecodable"},
                )
            )
        else:
            if aware:
                self.aware_time = recorded_at
            else:
                report.findings.append(
                    Finding(
                        "integrity",
                        f"recorded_at of position {row.position} has no time zone",
                        (row.position,),
                        {"reason": "naive_time"},
                    )
                )


#: what evstore stores in each column of a row (the audit names the ones that differ)
_ROW_TYPES = (
    ("event_id", str),
    ("type", str),
    ("schema_version", int),
    ("data", str),
    ("metadata", str),
    ("recorded_at", str),
    ("hash", str),
)

#: event types whose fold needs the provider they name to exist
_NAMES_A_PROVIDER = frozenset({"InventoriesReplaced", "ProviderUpdated"})


def _taken(replay: _Replay, consumer: str, kept: Mapping[str, Any] | tuple[()], position: int) -> None:
    """Note the allocations ``consumer`` held, before the event at ``position``, on a provider
    absent there and that the event takes away (it keeps those on the providers in ``kept``).
    Commands write none: they refuse to delete a provider in use, and an allocation on a provider
    that does not exist. Held until the end, the state shows them (``held_on_unknown_providers``);
    taken away, only this event can."""
    state = replay.state
    c = state.consumers.get(consumer)
    if c is None or not c.allocations or c.allocations.keys() <= state.providers.keys():
        return
    for provider in c.allocations:
        if provider not in state.providers and provider not in kept:
            at = c.allocated_at or 0
            deleted = replay.gone.get(provider)
            replay.absent_taken.append(
                (position, provider, consumer, at, deleted if deleted is not None and deleted > at else None)
            )


def _took_replaced(replay: _Replay, e: Any, position: int) -> None:
    _taken(replay, e.consumer, e.allocations, position)


def _took_released(replay: _Replay, e: Any, position: int) -> None:
    _taken(replay, e.consumer, (), position)


def _took_moved(replay: _Replay, e: Any, position: int) -> None:
    # (a migration's start or revert moves allocations between its two consumers: what the one
    # they go to holds is not taken away, and is noted where that one lets go of it)
    _taken(replay, e.instance, e.allocations, position)
    _taken(replay, e.migration, e.allocations, position)


def _took_confirmed(replay: _Replay, e: Any, position: int) -> None:
    _taken(replay, e.migration, (), position)


def _took_deleted(replay: _Replay, e: Any, position: int) -> None:
    _taken(replay, e.consumer, (), position)
    for migration in e.migrations_released:
        _taken(replay, migration, (), position)


#: what the checked pass looks at, before its fold, in each event that takes allocations away
#: from consumers (as the fold of its type does): the allocations held on a provider absent
#: there that it takes away (see :func:`absent_holdings`). Only while some may be held (see
#: ``_Replay.suspects``): a log with neither a provider's deletion nor an allocation on
#: a provider absent there holds none, and its events need no look.
_HOLDING_CHECKS: dict[str, Callable[[_Replay, Any, int], None]] = {
    "AllocationsReplaced": _took_replaced,
    "AllocationsReleased": _took_released,
    "MigrationStarted": _took_moved,
    "MigrationReverted": _took_moved,
    "MigrationConfirmed": _took_confirmed,
    "ConsumerDeleted": _took_deleted,
}


def _why(exc: Exception) -> str:
    """One line saying what is wrong (a validation error lists its fields)."""
    errors = getattr(exc, "errors", None)
    if callable(errors):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'metadata'}: {e['msg']}" for e in errors())
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def compare_states(replayed: State, persisted: State) -> list[Finding]:
    """Every difference between the replay (truth) and the persisted projection."""
    findings: list[Finding] = []

    def add(message: str, positions: tuple[int, ...], **details: Any) -> None:
        findings.append(Finding("drift", message, positions, details))

    # (a tampered row may have a key of another type: sorted and reported by its repr)
    for key in sorted(replayed.providers.keys() | persisted.providers.keys(), key=_label):
        uuid = _label(key)
        want, have = replayed.providers.get(key), persisted.providers.get(key)
        if want == have or (
            want is not None
            and have is not None
            and {k: v for k, v in have.usages.items() if v} == want.usages
            and dataclasses.replace(have, usages=want.usages) == want
        ):
            continue  # (a usage of 0 stored for a class means what no entry means)
        if want is None or have is None:
            add(
                f"Provider {uuid} is {'missing from' if have is None else 'extra in'} the projection",
                (),
                provider=uuid,
            )
            continue
        before = len(findings)
        for attr in ("name", "parent", "root", "generation", "inventories"):
            if getattr(want, attr) != getattr(have, attr):
                add(
                    f"Provider {uuid} {attr}{_difference(getattr(have, attr), getattr(want, attr))}",
                    (),
                    provider=uuid,
                    field=attr,
                )
        for rc in sorted(want.usages.keys() | have.usages.keys()):
            if want.usages.get(rc, 0) != have.usages.get(rc, 0):
                add(
                    f"Usage of {rc} on provider {uuid}: projection has {have.usages.get(rc, 0)}, "
                    f"replay gives {want.usages.get(rc, 0)}",
                    (),
                    provider=uuid,
                    resource_class=rc,
                    projection=have.usages.get(rc, 0),
                    replay=want.usages.get(rc, 0),
                )
        if len(findings) == before:
            add(f"Provider {uuid} differs from its replay: {_short(have)}", (), provider=uuid)
    # The keys that differ are found a consumer at a time, and only they are sorted: sorting the
    # union of every key is C code that holds the GIL (~50 ms for 78,000 consumers), which the
    # event loop waited for even with this on a thread.
    wanted, held = replayed.consumers, persisted.consumers
    differing = [key for key, c in wanted.items() if held.get(key) != c]
    differing += [key for key in held if key not in wanted]
    for key in sorted(differing, key=_label):
        uuid = _label(key)
        cw, ch = wanted.get(key), held.get(key)
        positions = tuple(p for p in ((cw.allocated_at if cw else None),) if p)
        if cw is None or ch is None:
            add(
                f"Consumer {uuid} is {'missing from' if ch is None else 'extra in'} the projection",
                positions,
                consumer=uuid,
            )
            continue
        before = len(findings)
        for attr in (
            "allocations",
            "generation",
            "deleted",
            "project_id",
            "user_id",
            "consumer_type",
            "on_behalf_of",
            "instance_type",
            "deleted_at",
            "allocated_at",
        ):
            if getattr(cw, attr) != getattr(ch, attr):
                add(
                    f"Consumer {uuid} {attr}{_difference(getattr(ch, attr), getattr(cw, attr))}",
                    positions,
                    consumer=uuid,
                    field=attr,
                )
        if len(findings) == before:
            add(f"Consumer {uuid} differs from its replay: {_short(ch)}", positions, consumer=uuid)
    if persisted.project_usages is not None:
        findings.extend(_counter_drift(replayed, persisted.project_usages))
    if replayed.custom_classes != persisted.custom_classes:
        differing = sorted(replayed.custom_classes ^ persisted.custom_classes, key=_label)
        add(
            "Custom resource classes differ: projection has "
            f"{sorted(persisted.custom_classes, key=_label)}, replay gives {sorted(replayed.custom_classes)}",
            (),
            resource_classes=[_label(name) for name in differing],
        )
    return findings


def _counter_drift(
    replayed: State, stored: dict[tuple[str, str, str], tuple[int, dict[str, int]]]
) -> list[Finding]:
    """The stored project usage counters (what ``usages()`` answers from) against the replay's."""
    findings = []
    want = project_usage_totals(replayed.consumers.values())
    for key in sorted(want.keys() | stored.keys(), key=repr):
        if want.get(key) == stored.get(key):
            continue
        project, user, ctype = (_label(k) for k in key)
        have_n, have = stored.get(key, (0, {}))
        want_n, wanted = want.get(key, (0, {}))
        findings.append(
            Finding(
                "drift",
                f"Usage counters of project {project} (user {user or '-'}, consumer type {ctype or '-'}): "
                f"projection has {have_n} consumers holding {_short(dict(sorted(have.items())))}, replay "
                f"gives {want_n} holding {_short(dict(sorted(wanted.items())))}",
                (),
                {"project_id": project, "user_id": user or None, "consumer_type": ctype or None},
            )
        )
    return findings


def _label(key: object) -> str:
    return key if isinstance(key, str) else repr(key)


def _difference(have: Any, want: Any) -> str:
    """How a projection's value differs from the replay's, to follow its name: the whole values
    when small; for mappings (inventories, allocations) only the entries that differ, and for an
    inventory only its fields that differ, so that no cut hides the difference."""
    if not (isinstance(have, Mapping) and isinstance(want, Mapping)):
        return f": projection has {_short(have)}, replay gives {_short(want)}"
    found = _entries_differing(have, want, "")
    shown = "; ".join(found[:5]) + (f"; and {len(found) - 5} more" if len(found) > 5 else "")
    return f" differ at {shown}"


_ABSENT: Any = type("_Absent", (), {"__repr__": lambda self: "nothing"})()


def _entries_differing(have: Any, want: Any, path: str) -> list[str]:
    if isinstance(have, Mapping) and isinstance(want, Mapping):
        out = []
        for key in sorted(have.keys() | want.keys(), key=_label):
            h, w = have.get(key, _ABSENT), want.get(key, _ABSENT)
            if h != w:
                out.extend(_entries_differing(h, w, f"{path}.{_label(key)}" if path else _label(key)))
        return out
    fields = getattr(type(have), "model_fields", None)
    if fields is not None and type(have) is type(want):  # (an inventory: the fields that differ)
        names = [n for n in fields if getattr(have, n) != getattr(want, n)]
        if names:
            have_text = ", ".join(f"{n}={getattr(have, n)!r}" for n in names)
            want_text = ", ".join(f"{n}={getattr(want, n)!r}" for n in names)
            return [f"{path}: projection has {have_text}, replay gives {want_text}"]
    return [f"{path}: projection has {_short(have)}, replay gives {_short(want)}"]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def leak_findings(state: State) -> list[Finding]:
    out = []
    for leak in find_leaks(state):
        positions = tuple(sorted(p for p in (leak.allocated_at, leak.tombstone_position) if p))
        out.append(
            Finding(
                "leak",
                f"Consumer {leak.consumer} holds {leak.allocations} but {leak.reason} "
                f"(allocated at position {leak.allocated_at}, tombstone at {leak.tombstone_position})",
                positions,
                {
                    "consumer": leak.consumer,
                    "allocations": leak.allocations,
                    "reason": leak.reason,
                    "allocated_at": leak.allocated_at,
                    "deleted_at": leak.tombstone_position,
                    "on_behalf_of": leak.on_behalf_of,
                    "requests": {},  # (who asked for the two events: see cite_requests)
                },
            )
        )
    return out


async def cite_requests(findings: list[Finding], read: ReadRows) -> list[Finding]:
    """Leak findings with who asked for the two events that made each leak - the one that last
    gave the allocations and the tombstone - as their request id and actor: what an operator
    looks up in the other services' logs (the positions alone sent them to ``evstore history``
    for it), in ``details["requests"]`` (``{"allocated": {...}, "deleted": {...}}``, each where
    cited; ``{}`` citing nothing). Two rows read per leak; a row whose metadata does not decode
    (its own integrity finding) or carries neither cites nothing. Each message then ends with how
    to clear the leak (:func:`~projections.invariants.clear_leak`)."""
    return [_with_clearing(finding) for finding in await _cited(findings, read)]


def _with_clearing(finding: Finding) -> Finding:
    d = finding.details
    clear = clear_leak(d["consumer"], d["reason"] == DELETED_REASON)
    return Finding(finding.kind, f"{finding.message}; {clear}", finding.positions, finding.details)


async def _cited(findings: list[Finding], read: ReadRows) -> list[Finding]:
    out = []
    for finding in findings:
        requests: dict[str, dict[str, str]] = {}
        for what, key in (("allocated", "allocated_at"), ("deleted", "deleted_at")):
            position = finding.details.get(key)
            rows = await read(position - 1, 1) if isinstance(position, int) and position > 0 else []
            if not rows or rows[0].position != position:
                continue
            try:
                meta = json.loads(rows[0].metadata)
            except (ValueError, RecursionError):
                # (a row damaged since - nested too deeply, which failed the whole audit with a
                # bare RecursionError, included - is reported by the checked pass: no citation)
                continue
            if isinstance(meta, dict):
                cited = {k: meta[k] for k in ("request_id", "actor") if isinstance(meta.get(k), str)}
                if cited:
                    requests[what] = cited
        if requests:
            said = ", ".join(f"{what} by {' / '.join(cited.values())}" for what, cited in requests.items())
            finding = Finding(
                finding.kind,
                f"{finding.message}; {said}",
                finding.positions,
                {**finding.details, "requests": requests},
            )
        out.append(finding)
    return out


def consumer_id_findings(state: State, values: ValueCheck) -> list[Finding]:
    """Consumers the fold keeps (holding something, tombstoned, or a migration's link) whose id
    is not a canonical uuid: no query can name them (the API normalises ids). The checked pass
    leaves consumer ids to this (see ``ValueCheck.sound``): one forgotten again holds nothing."""
    out = []
    for uuid, c in state.consumers.items():
        for what, value in (("consumer", uuid), ("instance", c.on_behalf_of)):
            if value is not None and (bad := values.consumer_id_problem(value)) is not None:
                at = c.allocated_at or c.deleted_at
                out.append(
                    Finding(
                        "integrity",
                        f"{bad} ({what} of a consumer the log keeps; a damaged or imported log)",
                        (at,) if at else (),
                        {"reason": "invalid_value", "consumer": uuid},
                    )
                )
    return out


def held_on_unknown_providers(state: State, gone: Mapping[str, int] | None = None) -> list[Finding]:
    """Consumers holding allocations on providers that do not exist (only a damaged or imported
    log gets there: the fold keeps them held but counts them nowhere). ``gone``: the position of
    each provider's last deletion (the checked pass's); one deleted while the consumer held what
    it holds there is named with it - commands refuse to delete a provider in use."""
    out = []
    providers = state.providers
    gone = gone or {}
    for uuid, c in state.consumers.items():
        missing = [p for p in c.allocations if p not in providers]
        if not missing:
            continue
        at = c.allocated_at or 0
        deleted = {p: d for p in missing if (d := gone.get(p)) is not None and d > at}
        never = [p for p in missing if p not in deleted]
        said = []
        if deleted:
            said.append(
                ", ".join(f"{p!r}, deleted at position {d}" for p, d in deleted.items())[:300]
                + " while it held them (a command refuses to delete a provider in use)"
            )
        if never:
            said.append(f"{', '.join(repr(p) for p in never)[:200]}, which no provider of the log is")
        out.append(
            Finding(
                "integrity",
                f"Consumer {uuid} holds allocations on {'; and on '.join(said)} (a damaged or imported log): "
                "counted by no provider",
                tuple(sorted({*((at,) if at else ()), *deleted.values()})),
                {
                    "reason": "unknown_provider",
                    "consumer": uuid,
                    "providers": missing,
                    **({"deleted_at": deleted} if deleted else {}),
                },
            )
        )
    return out


def dangling_parents(state: State, gone: Mapping[str, int] | None = None) -> list[Finding]:
    """Providers whose parent or root is no provider (only a damaged or imported log: a command
    refuses to delete a provider that has children, and to create one under a parent that does
    not exist), citing the deletion of the missing one where the log has it (``gone``)."""
    out = []
    providers = state.providers
    gone = gone or {}
    for uuid, prov in sorted(providers.items()):
        missing = {
            what: other
            for what, other in (("parent", prov.parent), ("root", prov.root))
            if other is not None and other not in providers
        }
        if not missing:
            continue
        said = ", ".join(
            f"its {what} {other}" + (f", deleted at position {gone[other]}" if other in gone else "")
            for what, other in missing.items()
        )
        out.append(
            Finding(
                "integrity",
                f"Provider {uuid} has {said}, which is no provider (a command refuses to delete a provider "
                "that has children: a damaged or imported log); its tree is broken",
                tuple(sorted({gone[other] for other in missing.values() if other in gone})),
                {
                    "reason": "unknown_parent",
                    "provider": uuid,
                    **missing,
                    "deleted_at": {other: gone[other] for other in missing.values() if other in gone},
                },
            )
        )
    return out


def absent_holdings(taken: list[tuple[int, str, str, int, int | None]]) -> list[Finding]:
    """The allocations events took away from providers absent there (the checked pass's
    ``absent_taken``): one finding for each provider deleted while consumers held allocations on it,
    naming them, where they were allocated, the deletion and where they were taken away; one for
    each provider that was absent where consumers' allocations on it were written (never created,
    not yet, or deleted before), the same way. Commands write neither (they refuse to delete a
    provider in use, and to allocate on one that does not exist): only a damaged or imported log
    holds them, and no provider counted those allocations while they were held. Once taken away,
    nothing in the state shows them (held at the end: ``held_on_unknown_providers``)."""
    groups: dict[tuple[str, int | None], list[tuple[int, str, int]]] = {}
    for position, provider, consumer, allocated, deleted in taken:
        groups.setdefault((provider, deleted), []).append((position, consumer, allocated))
    out = []
    for (provider, deleted), episodes in sorted(groups.items(), key=lambda g: (g[0][0], g[0][1] or 0)):
        consumers = sorted({c for _, c, _ in episodes})
        named = ", ".join(f"{c} (allocated at {a}, taken away at {r})" for r, c, a in episodes[:10])
        named += f" and {len(episodes) - 10} more" if len(episodes) > 10 else ""
        who = f"consumer{'s' if len(consumers) > 1 else ''} {named}"
        if deleted is not None:
            message = (
                f"Provider {provider} was deleted at position {deleted} while {who} held allocations on it "
                "(a command refuses to delete a provider in use: a damaged or imported log); no provider "
                "counted them from its deletion until they were taken away"
            )
            positions = {deleted, *(r for r, _, _ in episodes)}
        else:
            message = (
                f"Provider {provider} did not exist where {who} held allocations on it (allocated on a "
                "provider never created, not yet created or deleted before: a damaged or imported log); "
                "no provider counted them until they were taken away"
            )
            positions = {p for r, _, a in episodes for p in (a, r)}
        out.append(
            Finding(
                "integrity",
                message,
                tuple(sorted(p for p in positions if p)),
                {
                    "reason": "unknown_provider",
                    "provider": provider,
                    "deleted_at": deleted,
                    "consumers": consumers,
                    "held": [{"consumer": c, "allocated_at": a, "released_at": r} for r, c, a in episodes],
                },
            )
        )
    return out


def usage_not_held(state: State) -> list[Finding]:
    """Providers whose usage is not the sum of the allocations held on them (SPEC: usage *is* that
    sum). Only a damaged or imported log gets there: a provider deleted while consumers held
    allocations on it and created again starts counting from nothing, so what they still hold is
    counted nowhere, and commands decided against that usage can put more on the provider than
    its capacity until it is released (the fold then keeps the count at 0, never below: see
    ``projections.state._take_usage``)."""
    held: dict[str, dict[str, int]] = {}
    holders: dict[str, list[ConsumerState]] = {}
    providers = state.providers
    for c in state.consumers.values():
        for p, res in c.allocations.items():
            if p not in providers:
                continue  # (held_on_unknown_providers reports those)
            sums = held.setdefault(p, {})
            for rc, amount in res.items():
                sums[rc] = sums.get(rc, 0) + amount
            holders.setdefault(p, []).append(c)
    out = []
    for uuid, prov in sorted(providers.items()):
        want = {rc: n for rc, n in held.get(uuid, {}).items() if n}
        counted = {rc: n for rc, n in prov.usages.items() if n}
        if want == counted:
            continue
        classes = sorted(set(want) | set(counted))
        shown = ", ".join(f"{rc} {counted.get(rc, 0)} (held {want.get(rc, 0)})" for rc in classes)
        at = sorted({c.allocated_at for c in holders.get(uuid, ()) if c.allocated_at})
        out.append(
            Finding(
                "integrity",
                f"Provider {uuid} counts usage {shown}: not the allocations consumers hold on it "
                "(held since before the provider was deleted and created again? a damaged or "
                "imported log); commands decide capacity against the count",
                tuple(at),
                {
                    "reason": "usage_not_held",
                    "provider": uuid,
                    "counted": counted,
                    "held": want,
                    "consumers": sorted(c.uuid for c in holders.get(uuid, ())),
                },
            )
        )
    return out


def releases_not_counted(uncounted: list[tuple[int, str, str, int]]) -> list[Finding]:
    """Providers from which events took away allocations their usage never counted (held since
    before the provider was created, or created again: only a damaged or imported log), one
    finding each, citing those events. The fold keeps the usage at 0 there, no count being below
    zero (see ``projections.state._take_usage``), so the end state can agree again - but the log
    held allocations its provider did not count, and commands decided capacity against that."""
    by_provider: dict[str, tuple[set[int], dict[str, int]]] = {}
    for position, provider, rc, amount in uncounted:
        positions, amounts = by_provider.setdefault(provider, (set(), {}))
        positions.add(position)
        amounts[rc] = amounts.get(rc, 0) + amount
    out = []
    for provider, (positions, amounts) in sorted(by_provider.items()):
        at = sorted(positions)
        cited = ", ".join(map(str, at[:10])) + (f" and {len(at) - 10} more" if len(at) > 10 else "")
        what = ", ".join(f"{rc} {n}" for rc, n in sorted(amounts.items()))
        out.append(
            Finding(
                "integrity",
                f"Provider {provider}: the {'event at position' if len(at) == 1 else 'events at positions'} "
                f"{cited} took away allocations its usage never counted ({what}: held since before the "
                "provider was created, or deleted and created again? a damaged or imported log); its usage "
                "was kept at 0, not below, but commands decided capacity against a count short of what "
                "was held until then",
                tuple(at),
                {
                    "reason": "usage_not_held",
                    "provider": provider,
                    "uncounted": dict(sorted(amounts.items())),
                },
            )
        )
    return out


def over_capacity_findings(state: State, over: _OverTracker) -> list[Finding]:
    out = []
    for (uuid, rc), since in sorted(over.since.items()):
        prov = state.providers.get(uuid)
        if prov is None:
            continue
        used = prov.usages.get(rc, 0)
        inv = prov.inventories.get(rc)
        cap = inv.capacity if inv is not None else 0.0
        out.append(
            Finding(
                "over_capacity",
                f"Provider {uuid} uses {used} {rc} with capacity {format_amount(cap)} "
                f"(over by {format_amount(used - cap, digits=12)}) "
                f"since position {since}",
                (since,),
                {"provider": uuid, "resource_class": rc, "used": used, "capacity": cap, "since": since},
            )
        )
    return out


#: the last position at or before a head naming each of some entities (``provider:<u>``)
LastPositions = Callable[[list[str], int], Awaitable[dict[str, int]]]


async def audit(
    read: ReadRows,
    load_persisted: Callable[[], Awaitable[State]],
    batch_size: int = 5000,
    progress: Callable[[int], None] | None = None,
    last_positions: LastPositions | None = None,
    check_history: Callable[[], Awaitable[HistoryCheck]] | None = None,
    lost_tail: Callable[[], Awaitable[LostTail | None]] | None = None,
) -> AuditReport:
    """Run the full audit: a checked replay of every stored row against the persisted projection.

    Writers may go on while the audit runs: the replay catches up to the position the persisted
    projection was read at, so both sides describe the same point of the log. ``check_history``
    (opt-in, a second pass over the log): the history index against the log as well.
    """
    report = AuditReport()
    replay = _Replay(report)
    # Usage is recounted once at the end, as a replay does (State.recount_usages): the checked
    # pass needs it only there. Capacity is watched in a second pass, over the providers found
    # over capacity at the end, and only if there are any (see over_capacity_since).
    replay.state.usages_deferred = True
    replay.state.uncounted = []  # (each release the fold kept from going below zero: see there)
    unreadable: ProjectionCorrupt | None = None
    with gc_paused():
        await replay.run(read, batch_size, progress=progress)
        try:
            persisted_state: State | None = await load_persisted()
            for _ in range(10):
                assert persisted_state is not None
                if persisted_state.position <= replay.last_seen:
                    break
                await replay.run(read, batch_size, until=persisted_state.position, progress=progress)
                if replay.last_seen < persisted_state.position:
                    persisted_state = await load_persisted()
        except ProjectionCorrupt as exc:  # (drift the projection cannot even describe)
            unreadable, persisted_state = exc, None
    replayed = replay.state
    if replayed.usages_deferred:
        # (whole-state work, as every pass below: on a thread, so the event loop keeps getting turns)
        await asyncio.to_thread(replayed.recount_usages)
    report.head = replay.last_seen
    if persisted_state is None:
        assert unreadable is not None
        report.findings.append(Finding("drift", unreadable.message, (), dict(unreadable.details)))
    else:
        # (whole-state work: on a thread, so the event loop keeps getting turns)
        drift = await asyncio.to_thread(compare_states, replayed, persisted_state)
        if last_positions is not None:
            drift = await _cite_last_events(drift, last_positions, report.head)
        if lost_tail is not None and (lost := await lost_tail()) is not None:
            report.findings.append(truncation_finding(lost))
        report.findings.extend(drift)
    leaks, held, uncounted, ids, over_capacity = await asyncio.to_thread(
        _state_findings, replayed, replay.values, replay.gone
    )
    report.findings.extend(await cite_requests(leaks, read))
    report.findings.extend(held)
    report.findings.extend(absent_holdings(replay.absent_taken))
    report.findings.extend(await asyncio.to_thread(dangling_parents, replayed, replay.gone))
    if uncounted and last_positions is not None:  # (one nobody holds anything on: its last event)
        uncounted = await _cite_last_events(uncounted, last_positions, report.head)
    report.findings.extend(uncounted)
    report.findings.extend(releases_not_counted(replayed.uncounted or []))
    report.findings.extend(ids)
    over = await over_capacity_since(read, batch_size, report.head, over_capacity)
    report.findings.extend(over_capacity_findings(replayed, over))
    # (freed on a thread a piece at a time: dropped here, the replay's state stalled the event
    # loop for as long as freeing it takes, and the projection's the reader thread's next job)
    await asyncio.to_thread(dismantle, replayed, persisted_state)
    del replayed, persisted_state, replay
    if check_history is not None:
        report.findings.extend(history_findings(await check_history()))
    return report


def _state_findings(
    replayed: State, values: ValueCheck, gone: Mapping[str, int]
) -> tuple[list[Finding], list[Finding], list[Finding], list[Finding], set[str]]:
    """The audit's passes over the whole replayed state (run on a thread: each is proportional to
    the live state, hundreds of milliseconds on a large store, which the event loop would wait)."""
    return (
        leak_findings(replayed),
        held_on_unknown_providers(replayed, gone),
        usage_not_held(replayed),
        consumer_id_findings(replayed, values),
        providers_over_capacity(replayed),
    )


def truncation_finding(lost: LostTail) -> Finding:
    """The log lost its last events (the backend's check, the one a rebuild refuses by): the hash
    chain cannot show a lost tail, and the differences alone read as drift, which a rebuild would
    "repair" by forgetting those events."""
    return Finding(
        "integrity",
        lost.message(),
        (lost.position,) if lost.position > lost.head else (),
        lost.details(),
    )


def history_findings(check: HistoryCheck) -> list[Finding]:
    """What a damaged history index means for the answers that read it."""
    out = []
    for count, examples, what in (
        (check.missing, check.missing_examples, "lacks {n} rows the log implies"),
        (check.extra, check.extra_examples, "holds {n} rows the log does not imply"),
    ):
        if not count:
            continue
        shown = ", ".join(f"{entity} at {position}" for entity, position in examples)
        out.append(
            Finding(
                "integrity",
                f"The history index {what.format(n=count)} (up to position {check.through}; e.g. {shown}): "
                "history() and state_at(provider=/consumer=) answer wrongly there; `evstore rebuild --full` "
                "writes the index again from the log",
                tuple(sorted({position for _, position in examples})),
                {"reason": "history_index", "missing": check.missing, "extra": check.extra},
            )
        )
    return out


async def _cite_last_events(
    findings: list[Finding], last_positions: LastPositions, head: int
) -> list[Finding]:
    """A drift finding the replay cannot place names the last events of what it is about (the
    projection row should show their outcome): a provider's, a consumer's (one the replay
    forgot: released, then its row put back), the resource classes'. The replay does not keep
    those per entity; the history index does."""

    def keys(f: Finding) -> list[str]:
        if f.positions:
            return []
        if "provider" in f.details:
            return [f"provider:{f.details['provider']}"]
        if "consumer" in f.details:
            return [f"consumer:{f.details['consumer']}"]
        return [f"resource_class:{name}" for name in f.details.get("resource_classes", ())]

    wanted = sorted({k for f in findings for k in keys(f)})
    if not wanted:
        return findings
    try:
        last = await last_positions(wanted, head)
    except EvstoreError:  # (the findings stand without the positions)
        return findings
    out = []
    for f in findings:
        positions = tuple(sorted({p for k in keys(f) if (p := last.get(k))}))
        out.append(dataclasses.replace(f, positions=positions) if positions else f)
    return out


def providers_over_capacity(state: State) -> set[str]:
    """Providers using more of some class than its capacity (or any of a class they have no
    inventory of)."""
    return {uuid for uuid, prov in state.providers.items() if over_capacity(prov)}


async def over_capacity_since(
    read: ReadRows, batch_size: int, head: int, providers: set[str]
) -> _OverTracker:
    """Since which position each (provider, class) of ``providers`` has been over capacity at ``head``.

    Over capacity is rare (an inventory shrunk below what is held), and watching it means keeping
    usage event by event and looking at every provider an event may push over: the audit's
    checked pass does neither, and this second pass, an unchecked fold of the same rows with the
    watch limited to ``providers``, runs only when the first found some. It finds exactly what
    watching every provider in one pass finds for them.
    """
    tracker = _OverTracker(watch=providers)
    if providers:
        watcher = _Replay(AuditReport(), over=tracker, checked=False)
        with gc_paused():
            await watcher.run(read, batch_size, until=head)
        await asyncio.to_thread(dismantle, watcher.state)  # (as the audit's own: see there)
    return tracker
