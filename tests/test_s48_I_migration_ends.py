"""Stop 48, helper I: a confirm or revert that no evstore wrote, given the log before it, refused
by an import (``evstore.log.corrupt``, ``reason`` ``invalid_value``, ``details["rule"]``, nothing
written) and reported by the audit in a log that holds it anyway (``integrity``, ``reason`` the
rule). Stop 47 imported each of these, and its audit was clean.

- ``other_instance``: a ``MigrationConfirmed`` or ``MigrationReverted`` naming another instance than
  the one its migration holds for (``confirm_migration`` and ``revert_migration`` take the instance
  from the migration consumer's link, whatever the caller says) - a late revert of a deleted
  instance's migration to another deleted instance too (README's legacy revert gives back to the
  migration's own instance, still imported).
- ``not_a_migration``: one naming as its migration a consumer that holds allocations for no instance
  (both commands refuse it, ``evstore.not_found``: ``... holds no allocations for a migration in
  progress``). Not refused: the confirm or revert of a consumer whose link only a plain write
  emptying it dropped, refilled since, naming that instance - evstore's first version (4864e12,
  before 27798e2) kept that link, and its commands wrote them.
- ``empty_revert``: a ``MigrationReverted`` with empty allocations of a migration holding some
  (``revert_migration`` gives back exactly what it holds: what both consumers held vanished,
  unreleased); of a migration holding nothing, ``nothing_to_revert`` (stop 47's rule, extended: it
  let a revert through whose allocations equalled the nothing held).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evstore import CorruptEvent, open_store
from tests.test_s47_E_impossible_history import (
    Rows,
    Tail,
    _confirmed,
    _file,
    _inst_deleted,
    _log,
    _revert,
    imported_behind,
)


def _other(ids: dict[str, Any], key: str = "ghost") -> dict[str, Any]:
    return {"migration": ids["mig"], "instance": ids[key], "held_for": ids["inst"]}


def _plain(consumer: str, allocations: dict[str, dict[str, int]], previous: dict[str, Any]) -> dict[str, Any]:
    """An ``AllocationsReplaced`` as ``set_allocations`` writes it for ``consumer``."""
    return {
        "consumer": consumer,
        "allocations": allocations,
        "previous": previous,
        "project_id": "project",
        "user_id": "user",
        "consumer_type": "MIGRATION",
        "generation": 1 if allocations else None,
        "provider_generations": {},
    }


def _unlinked(ids: dict[str, Any]) -> Rows:
    """The migration emptied by a plain write (which drops its link), then given what it held again."""
    held = {ids["src"]: {"VCPU": 2}}
    return [
        ("emptied", "AllocationsReplaced", _plain(ids["mig"], {}, held)),
        ("refilled", "AllocationsReplaced", _plain(ids["mig"], held, {})),
    ]


#: each case: the rows appended, the rule the last breaks, what it names besides (from ids), and
#: the label of the earlier event the audit's finding cites (None: none)
CASES: dict[str, tuple[Tail, str, Callable[[dict[str, Any]], dict[str, Any]], str | None]] = {
    "a confirm naming another instance": (
        lambda ids: [("bad", "MigrationConfirmed", {**_confirmed(ids), "instance": ids["ghost"]})],
        "other_instance",
        _other,
        None,
    ),
    "a revert naming another instance": (
        lambda ids: [
            (
                "bad",
                "MigrationReverted",
                {**_revert(ids, {ids["src"]: {"VCPU": 2}}), "instance": ids["ghost"]},
            )
        ],
        "other_instance",
        _other,
        None,
    ),
    "a late revert to a deleted instance not the migration's": (
        lambda ids: [
            ("deleted", "ConsumerDeleted", _inst_deleted(ids)),
            (
                "bad",
                "MigrationReverted",
                {**_revert(ids, {ids["src"]: {"VCPU": 2}}), "instance": ids["gone"], "replaced": {}},
            ),
        ],
        "other_instance",
        lambda ids: _other(ids, "gone"),
        None,
    ),
    "a confirm of a consumer that is no migration": (
        lambda ids: [
            (
                "bad",
                "MigrationConfirmed",
                {"migration": ids["inst"], "instance": ids["ghost"], "released": {ids["dst"]: {"VCPU": 2}}},
            )
        ],
        "not_a_migration",
        lambda ids: {
            "migration": ids["inst"],
            "instance": ids["ghost"],
            "held": {ids["dst"]: {"VCPU": 2}},
            "allocated_at": ids["started"] + 1,
        },
        "inst_at",
    ),
    "a revert of a consumer that is no migration": (
        lambda ids: [
            (
                "bad",
                "MigrationReverted",
                {
                    **_revert(ids, {ids["dst"]: {"VCPU": 2}}, ids["inst"]),
                    "instance": ids["ghost"],
                    "replaced": {},
                },
            )
        ],
        "not_a_migration",
        lambda ids: {
            "migration": ids["inst"],
            "instance": ids["ghost"],
            "held": {ids["dst"]: {"VCPU": 2}},
            "allocated_at": ids["started"] + 1,
        },
        "inst_at",
    ),
    "a confirm of a former migration, confirmed and refilled since": (
        lambda ids: [
            ("confirmed", "MigrationConfirmed", _confirmed(ids)),
            ("refilled", "AllocationsReplaced", _plain(ids["mig"], {ids["src"]: {"VCPU": 2}}, {})),
            ("bad", "MigrationConfirmed", _confirmed(ids)),
        ],
        "not_a_migration",
        lambda ids: {
            "migration": ids["mig"],
            "instance": ids["inst"],
            "held": {ids["src"]: {"VCPU": 2}},
            "allocated_at": ids["refilled"],
        },
        "refilled",
    ),
    "a confirm of an unlinked migration naming another instance than its old one": (
        lambda ids: [
            *_unlinked(ids),
            ("bad", "MigrationConfirmed", {**_confirmed(ids), "instance": ids["ghost"]}),
        ],
        "not_a_migration",
        lambda ids: {
            "migration": ids["mig"],
            "instance": ids["ghost"],
            "held": {ids["src"]: {"VCPU": 2}},
            "allocated_at": ids["refilled"],
        },
        "refilled",
    ),
    "an empty revert of a migration holding allocations": (
        lambda ids: [("bad", "MigrationReverted", _revert(ids, {}))],
        "empty_revert",
        lambda ids: {"migration": ids["mig"], "instance": ids["inst"], "held": {ids["src"]: {"VCPU": 2}}},
        "started",
    ),
    "an empty revert of a migration holding nothing": (
        lambda ids: [("bad", "MigrationReverted", _revert(ids, {}, ids["ghost"]))],
        "nothing_to_revert",
        lambda ids: {
            "migration": ids["ghost"],
            "instance": ids["inst"],
            "allocations": {},
            "emptied_at": None,
        },
        None,
    ),
    "an empty late revert to the deleted instance": (
        lambda ids: [
            ("deleted", "ConsumerDeleted", _inst_deleted(ids)),
            ("bad", "MigrationReverted", {**_revert(ids, {}), "replaced": {}}),
        ],
        "nothing_to_revert",
        lambda ids: {
            "migration": ids["mig"],
            "instance": ids["inst"],
            "allocations": {},
            "emptied_at": ids["deleted"],
        },
        "deleted",
    ),
}


def _ids_at(ids: dict[str, Any]) -> dict[str, Any]:
    return {**ids, "inst_at": ids["started"] + 1}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_an_import_refuses_a_confirm_or_revert_no_command_writes_there(
    tmp_path: Path, store_url: str, case: str
) -> None:
    """Regression: each file was imported (fails before: no refusal). Refused with the rule, the
    event's position, type and line, and nothing written; without that row, imported and clean."""
    tail, rule, named, _since = CASES[case]
    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        with pytest.raises(CorruptEvent) as refused:
            await store.import_events(lambda: iter(_file(lines, rows)))
        assert refused.value.details == {
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
        await store.import_events(lambda: iter(_file(lines, rows[:-1])))
        assert (await store.audit()).clean


@pytest.mark.parametrize("case", sorted(CASES))
async def test_the_audit_reports_such_a_confirm_or_revert(tmp_path: Path, store_url: str, case: str) -> None:
    """Regression: stop 47's audit found nothing of these (fails before: no finding)."""
    tail, rule, named, since = CASES[case]
    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await imported_behind(store, _file(lines, rows))
        report = await store.audit()
        found = [f for f in report.integrity if f.details.get("reason") == rule]
        assert len(found) == 1, report.findings
        [finding] = found
        assert finding.details == {"reason": rule, **named(ids)}
        at = _ids_at(ids)
        assert finding.positions == ((at[since],) if since else ()) + (ids["bad"],)
        assert f"{rows[-1].type} at position {ids['bad']}" in finding.message, finding.message


async def _imported_clean(tmp_path: Path, store_url: str, tail: Tail) -> dict[str, Any]:
    lines, rows, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(_file(lines, rows)))
        report = await store.audit()
        assert report.clean, report.findings
        ids["held"] = {
            label: (await store.allocations(ids[label])).allocations for label in ("inst", "mig", "ghost")
        }
    return ids


@pytest.mark.parametrize("end", ["MigrationConfirmed", "MigrationReverted"])
async def test_an_end_of_a_migration_unlinked_by_a_plain_write_naming_its_instance_is_imported(
    tmp_path: Path, store_url: str, end: str
) -> None:
    """What evstore's first version wrote: its fold kept a migration's link when a plain write
    emptied it, so its confirm or revert of the consumer refilled since named that instance.
    Imported, and clean (not ``not_a_migration``)."""

    def tail(ids: dict[str, Any]) -> Rows:
        data = _confirmed(ids) if end == "MigrationConfirmed" else _revert(ids, {ids["src"]: {"VCPU": 2}})
        return [*_unlinked(ids), ("end", end, data)]

    ids = await _imported_clean(tmp_path, store_url, tail)
    gave_back = {ids["src"]: {"VCPU": 2}} if end == "MigrationReverted" else {ids["dst"]: {"VCPU": 2}}
    assert ids["held"] == {"inst": gave_back, "mig": {}, "ghost": {}}


@pytest.mark.parametrize("end", ["MigrationConfirmed", "MigrationReverted"])
async def test_ends_of_a_migration_commands_wrote_are_imported_and_clean(
    tmp_path: Path, store_url: str, end: str
) -> None:
    """The confirm and the revert of the migration, each naming its own instance."""

    def tail(ids: dict[str, Any]) -> Rows:
        data = _confirmed(ids) if end == "MigrationConfirmed" else _revert(ids, {ids["src"]: {"VCPU": 2}})
        return [("end", end, data)]

    ids = await _imported_clean(tmp_path, store_url, tail)
    gave_back = {ids["src"]: {"VCPU": 2}} if end == "MigrationReverted" else {ids["dst"]: {"VCPU": 2}}
    assert ids["held"] == {"inst": gave_back, "mig": {}, "ghost": {}}
