"""Stop 47, helper E: events that only the log before them makes impossible, which no command
writes, refused by an import (``evstore.log.corrupt``, ``reason`` ``invalid_value``,
``details["rule"]``, nothing written) and reported by the audit in a log that holds them anyway
(rows written behind the store's back, or an import by an older evstore): ``integrity``,
``reason`` the rule's name.

- ``duplicate_name``: a provider given a name another live provider holds (``create_provider`` and
  ``rename_provider`` refuse it, ``placement.duplicate_name``; provider names are locked entities,
  so two commands cannot race past it). Stop 46 audited it; an import took it.
- ``revert_more_than_held``: a revert giving the instance more than its (non-empty) migration held
  (``revert_migration`` gives back exactly what the migration holds): allocations from nowhere, no
  capacity checked for them. Neither refused nor audited.
- ``nothing_to_revert``: the same of a migration holding nothing (stop 46 audited it; an import
  took it), but for an instance deleted there: README's legacy leak, still imported.
- ``nothing_to_release``: ``AllocationsReleased`` of a consumer holding nothing (``release``
  refuses it, ``evstore.not_found``, a tombstoned consumer included; only ``release`` writes that
  event). Neither refused nor audited.
- ``nothing_to_confirm``: ``MigrationConfirmed`` of a migration holding nothing (``confirm_migration``
  refuses it). Neither refused nor audited.
- ``nothing_to_delete``: ``ProviderDeleted`` of a provider that does not exist there - deleted
  before, or never created (``delete_provider`` refuses it, ``placement.resource_provider.not_found``:
  not idempotent). Neither refused nor audited.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evstore import CorruptEvent, open_store
from evstore.events import GENESIS_HASH, RawEvent
from projections.exchange import ChainCheck, ExportHeader, parse_header, parse_row, row_line
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import _created, _tail, append_row, chained

Rows = list[tuple[str, str, dict[str, Any]]]
Tail = Callable[[dict[str, Any]], Rows]

_INSERT = (
    "INSERT INTO events (position, event_id, type, schema_version, data, metadata, recorded_at, hash) "
    "VALUES (?,?,?,?,?,?,?,?)"
)


async def _log(tmp_path: Path, tail: Tail) -> tuple[list[str], list[RawEvent], dict[str, Any]]:
    """An export of a store (every row written by a command) with providers ``src`` and ``dst``
    (8 VCPU each, named so), an instance ``inst`` that held 2 VCPU on src, moved to a migration
    ``mig`` (which holds them) and placed on dst, a consumer ``c`` given 1 VCPU on dst and
    released, and a consumer ``gone`` deleted (a tombstone, holding nothing); then the rows
    ``tail(ids)`` appends as an older or buggy writer would: (the export's lines, the appended
    rows, the ids with each appended row's position by its label)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        src = await make_provider(source, "src", VCPU=8)
        dst = await make_provider(source, "dst", VCPU=8)
        ids: dict[str, Any] = {"src": src, "dst": dst, "src_at": 1, "dst_at": 3}
        for label in ("inst", "mig", "c", "gone", "ghost", "b"):
            ids[label] = new_uuid()
        await allocate(source, ids["inst"], {src: {"VCPU": 2}})
        ids["started"] = (await source.start_migration(ids["inst"], ids["mig"])).position
        await allocate(source, ids["inst"], {dst: {"VCPU": 2}})
        await allocate(source, ids["c"], {dst: {"VCPU": 1}})
        ids["c_released"] = (await source.release(ids["c"])).position
        ids["gone_at"] = (await source.delete_consumer(ids["gone"])).position
        lines = [line async for line in source.export()]
        last = await _tail(source)
    rows = []
    for label, etype, data in tail(ids):
        last = chained(last, etype, data)
        rows.append(last)
        ids[label] = last.position
    return lines, rows, ids


def _revert(
    ids: dict[str, Any], allocations: dict[str, dict[str, int]], migration: str = ""
) -> dict[str, Any]:
    return {
        "migration": migration or ids["mig"],
        "instance": ids["inst"],
        "allocations": allocations,
        "replaced": {ids["dst"]: {"VCPU": 2}},
        "project_id": "project",
        "user_id": "user",
        "instance_consumer_type": "INSTANCE",
        "instance_generation": 3,
        "provider_generations": {},
    }


def _confirmed(ids: dict[str, Any]) -> dict[str, Any]:
    return {"migration": ids["mig"], "instance": ids["inst"], "released": {ids["src"]: {"VCPU": 2}}}


def _inst_deleted(ids: dict[str, Any]) -> dict[str, Any]:
    """The instance's tombstone as delete_consumer writes it (its migration's allocations released)."""
    return {
        "consumer": ids["inst"],
        "released": {ids["dst"]: {"VCPU": 2}},
        "migrations_released": {ids["mig"]: {ids["src"]: {"VCPU": 2}}},
    }


def _named(provider: str, name: str) -> dict[str, Any]:
    return {**_created(provider), "name": name}


#: each case: the rows appended, the rule the last breaks, and what it names besides (from ids)
CASES: dict[str, tuple[Tail, str, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "a provider created with a name another holds": (
        lambda ids: [("bad", "ProviderCreated", _named(ids["b"], "src"))],
        "duplicate_name",
        lambda ids: {"provider": ids["b"], "name": "src", "holder": ids["src"], "holder_named_at": 1},
    ),
    "a provider renamed to a name another holds": (
        lambda ids: [
            ("b_at", "ProviderCreated", _named(ids["b"], "b")),
            ("bad", "ProviderUpdated", {"provider": ids["b"], "name": "dst"}),
        ],
        "duplicate_name",
        lambda ids: {"provider": ids["b"], "name": "dst", "holder": ids["dst"], "holder_named_at": 3},
    ),
    "a revert giving more than the migration held": (
        lambda ids: [("bad", "MigrationReverted", _revert(ids, {ids["src"]: {"VCPU": 5}}))],
        "revert_more_than_held",
        lambda ids: {
            "migration": ids["mig"],
            "instance": ids["inst"],
            "allocations": {ids["src"]: {"VCPU": 5}},
            "held": {ids["src"]: {"VCPU": 2}},
            "beyond": {ids["src"]: {"VCPU": 3}},
        },
    ),
    "a revert giving what the migration held and more elsewhere": (
        lambda ids: [
            ("bad", "MigrationReverted", _revert(ids, {ids["src"]: {"VCPU": 2}, ids["dst"]: {"VCPU": 6}}))
        ],
        "revert_more_than_held",
        lambda ids: {
            "migration": ids["mig"],
            "instance": ids["inst"],
            "allocations": {ids["src"]: {"VCPU": 2}, ids["dst"]: {"VCPU": 6}},
            "held": {ids["src"]: {"VCPU": 2}},
            "beyond": {ids["dst"]: {"VCPU": 6}},
        },
    ),
    "a revert of a migration never seen": (
        lambda ids: [("bad", "MigrationReverted", _revert(ids, {ids["src"]: {"VCPU": 1}}, ids["ghost"]))],
        "nothing_to_revert",
        lambda ids: {
            "migration": ids["ghost"],
            "instance": ids["inst"],
            "allocations": {ids["src"]: {"VCPU": 1}},
            "emptied_at": None,
        },
    ),
    "a release of a consumer released already": (
        lambda ids: [
            ("bad", "AllocationsReleased", {"consumer": ids["c"], "released": {ids["dst"]: {"VCPU": 1}}})
        ],
        "nothing_to_release",
        lambda ids: {"consumer": ids["c"], "emptied_at": None},  # (absent: forgotten, as Placement does)
    ),
    "a release of a consumer never seen": (
        lambda ids: [("bad", "AllocationsReleased", {"consumer": ids["ghost"], "released": {}})],
        "nothing_to_release",
        lambda ids: {"consumer": ids["ghost"], "emptied_at": None},
    ),
    "a release of a deleted consumer holding nothing": (
        lambda ids: [("bad", "AllocationsReleased", {"consumer": ids["gone"], "released": {}})],
        "nothing_to_release",
        lambda ids: {"consumer": ids["gone"], "emptied_at": ids["gone_at"]},
    ),
    "a confirm of a migration confirmed already": (
        lambda ids: [
            ("confirmed", "MigrationConfirmed", _confirmed(ids)),
            ("bad", "MigrationConfirmed", _confirmed(ids)),
        ],
        "nothing_to_confirm",
        lambda ids: {"migration": ids["mig"], "instance": ids["inst"], "emptied_at": None},
    ),
    "a confirm of a migration its instance's delete released": (
        lambda ids: [
            ("deleted", "ConsumerDeleted", _inst_deleted(ids)),
            ("bad", "MigrationConfirmed", {**_confirmed(ids), "released": {}}),
        ],
        "nothing_to_confirm",
        lambda ids: {"migration": ids["mig"], "instance": ids["inst"], "emptied_at": ids["deleted"]},
    ),
    "a provider deleted twice": (
        lambda ids: [
            ("b_at", "ProviderCreated", _named(ids["b"], "b")),
            ("b_gone", "ProviderDeleted", {"provider": ids["b"]}),
            ("bad", "ProviderDeleted", {"provider": ids["b"]}),
        ],
        "nothing_to_delete",
        lambda ids: {"provider": ids["b"], "deleted_at": ids["b_gone"]},
    ),
    "a provider never created deleted": (
        lambda ids: [("bad", "ProviderDeleted", {"provider": ids["ghost"]})],
        "nothing_to_delete",
        lambda ids: {"provider": ids["ghost"], "deleted_at": None},
    ),
}

#: the earlier event each finding cites (its details' key), besides the event itself
#: (revert_more_than_held: where the migration took what it holds)
_SINCE = {"duplicate_name": "holder_named_at", "nothing_to_delete": "deleted_at"}


def _file(lines: list[str], rows: list[RawEvent]) -> list[str]:
    out = list(lines)
    for row in rows:
        append_row(out, row)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
async def test_an_import_refuses_an_event_only_the_log_before_it_makes_impossible(
    tmp_path: Path, case: str
) -> None:
    """Regression: each file was imported (fails before: no refusal). Refused with the rule, the
    event's position, type and line, and nothing written."""
    tail, rule, named = CASES[case]
    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        with pytest.raises(CorruptEvent) as refused:
            await store.import_events(lambda: iter(_file(lines, rows)))
        details = refused.value.details
        assert details == {
            "line": len(lines) + len(rows),
            "position": ids["bad"],
            "reason": "invalid_value",
            "rule": rule,
            "event_type": rows[-1].type,
            **named(ids),
        }
        message = refused.value.message
        assert f"position {ids['bad']}" in message and f"rule {rule}" in message, message
        assert "nothing was imported" in message
        assert await store.head() == 0
        # (the same log without the row: imported, and clean)
        await store.import_events(lambda: iter(_file(lines, rows[:-1])))
        assert (await store.audit()).clean


async def imported_behind(store: Any, lines: list[str]) -> None:
    """Import the export ``lines`` as an older evstore did, taking what this one refuses (an
    ``invalid_value``): the rows before the refused one imported, the rest written to the log
    directly, and the projection rebuilt from it."""
    try:
        await store.import_events(lambda: iter(lines))
        return
    except CorruptEvent as exc:
        if exc.details.get("reason") != "invalid_value":
            raise
        refused = int(exc.details["line"])
    rows = [parse_row(text, line) for line, text in enumerate(lines[1:], start=2)]
    kept, behind = rows[: refused - 2], rows[refused - 2 :]
    header = ExportHeader(len(kept), kept[-1].position, kept[-1].hash).to_line()
    await store.import_events(lambda: iter([header, *(row_line(row) for row in kept)]))
    for row in behind:
        await store.backend.tamper(_INSERT, tuple(row))
    await store.rebuild()


def importable(lines: list[str]) -> list[str]:
    """The export ``lines`` without the rows an import refuses as doing what no command does
    (``invalid_value``), each row after one dropped moved up into its place (position and hash
    chain): what a random older writer's log (a test's) becomes when it must be imported whole."""
    header = parse_header(lines[0])
    check, kept, prev = ChainCheck(), [], GENESIS_HASH
    for line, text in enumerate(lines[1:], start=2):
        if not text.strip():
            continue
        row = parse_row(text, line)._replace(position=len(kept) + 1)
        row = row._replace(hash=row.chained_hash(prev))
        try:
            check.check(row, len(kept) + 2)
        except CorruptEvent as exc:
            if exc.details.get("reason") != "invalid_value":
                raise
            continue  # (refused before its fold: the check goes on as if it were not there)
        kept.append(row)
        prev = row.hash
    return [ExportHeader(len(kept), len(kept), prev, header.version).to_line(), *map(row_line, kept)]


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_audit_reports_such_an_event_in_a_log_that_holds_it(
    tmp_path: Path, store_url: str, case: str
) -> None:
    """Regression: the audit of each log was clean (but for duplicate_name and nothing_to_revert,
    stop 46's; fails before: no finding for the others)."""
    tail, rule, named = CASES[case]
    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await imported_behind(store, _file(lines, rows))
        report = await store.audit()
        found = [f for f in report.integrity if f.details.get("reason") == rule]
        assert len(found) == 1, report.findings
        [finding] = found
        details = named(ids)
        assert finding.details == {
            "reason": rule,
            **details,
            **({"event_type": rows[-1].type} if rule == "duplicate_name" else {}),
        }
        since = ids["started"] if rule == "revert_more_than_held" else details[_SINCE.get(rule, "emptied_at")]
        assert finding.positions == tuple(p for p in (since, ids["bad"]) if p)
        assert f"{rows[-1].type} at position {ids['bad']}" in finding.message, finding.message
        # (nothing else: a confirm of an instance's migration its delete released is no leak)
        assert report.findings == [finding]


async def test_a_revert_giving_less_than_the_migration_held_is_imported(tmp_path: Path) -> None:
    """(No command writes it either, but it makes nothing: what the migration held beyond it is
    released. Left imported, and clean.)"""

    def tail(ids: dict[str, Any]) -> Rows:
        return [("bad", "MigrationReverted", _revert(ids, {ids["src"]: {"VCPU": 1}}))]

    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        await store.import_events(lambda: iter(_file(lines, rows)))
        assert (await store.audit()).clean
        assert (await store.allocations(ids["inst"])).allocations == {ids["src"]: {"VCPU": 1}}


async def test_a_late_revert_to_a_deleted_instance_is_imported_and_audited_as_its_leak(
    tmp_path: Path,
) -> None:
    """README's legacy example: the instance's delete released its migration, and an older,
    Placement-style writer's revert gave the instance the allocations back. Not refused: a leak."""

    def tail(ids: dict[str, Any]) -> Rows:
        return [
            ("deleted", "ConsumerDeleted", _inst_deleted(ids)),
            ("revert", "MigrationReverted", {**_revert(ids, {ids["src"]: {"VCPU": 2}}), "replaced": {}}),
        ]

    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        await store.import_events(lambda: iter(_file(lines, rows)))
        [leak] = (await store.audit()).findings
        assert leak.kind == "leak" and leak.positions == (ids["deleted"], ids["revert"])
        await store.release(ids["inst"])
        assert (await store.audit()).clean


async def test_logs_commands_wrote_are_imported_and_clean(tmp_path: Path, store_url: str) -> None:
    """What commands do around the new rules: a name taken again once its holder let go of it, a
    provider deleted and created again, a release, a confirm and a revert of what is held."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        a = await make_provider(source, "a", VCPU=8)
        b = await make_provider(source, "b", VCPU=8)
        await source.rename_provider(a, "a2")
        await source.rename_provider(b, "a")
        await source.rename_provider(b, "a")  # (no event)
        doomed = await make_provider(source, "doomed")
        await source.delete_provider(doomed)
        await source.create_provider(doomed, "doomed")
        await source.delete_provider(doomed)
        await source.create_provider(new_uuid(), "doomed")
        inst, mig, mig2, c = new_uuid(), new_uuid(), new_uuid(), new_uuid()
        await allocate(source, inst, {a: {"VCPU": 2}})
        await source.start_migration(inst, mig)
        await allocate(source, inst, {b: {"VCPU": 2}})
        await source.revert_migration(mig)
        await source.start_migration(inst, mig2)
        await allocate(source, inst, {a: {"VCPU": 3}})
        await source.confirm_migration(mig2)
        await allocate(source, c, {b: {"VCPU": 1}})
        await source.release(c)
        await source.delete_consumer(c)
        await source.delete_consumer(inst)
        lines = [line async for line in source.export()]
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        assert (await store.audit()).clean


async def test_importable_drops_what_an_import_refuses_and_keeps_the_rest_verbatim(tmp_path: Path) -> None:
    """(The helper the random older-writer tests of stops 40 and 41 import their logs through.)"""

    def tail(ids: dict[str, Any]) -> Rows:
        return [
            ("bad1", "ProviderCreated", _named(ids["b"], "src")),
            ("ok", "ProviderCreated", _named(ids["ghost"], "fine")),
            ("bad2", "AllocationsReleased", {"consumer": ids["c"], "released": {}}),
        ]

    lines, rows, ids = await _log(tmp_path, tail)
    kept = importable(_file(lines, rows))
    assert kept[1:-1] == lines[1:]  # (the rows before the first refused one, verbatim)
    assert len(kept) == len(lines) + 1
    moved = parse_row(kept[-1], len(kept))
    assert (moved.position, moved.event_id) == (ids["bad1"], rows[1].event_id)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        await store.import_events(lambda: iter(kept))
        assert (await store.audit()).clean
