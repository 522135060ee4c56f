"""Stop 46, helper E2: two more things an imported log holds that every command refuses.

Import runs none of the commands' invariants, and the audit was clean for both:
- a second live provider given a name another live provider holds (``ProviderCreated`` or
  ``ProviderUpdated``; ``create_provider``/``rename_provider`` refuse it, ``placement.duplicate_name``):
  now ``integrity``, ``reason`` ``duplicate_name``, naming both providers, the name and both positions;
- a ``MigrationReverted`` of a migration holding nothing that gives its instance allocations
  (``revert_migration`` refuses it, ``evstore.not_found``): allocations from nowhere, no capacity
  checked for them; now ``integrity``, ``reason`` ``nothing_to_revert``. A late revert to a deleted
  instance (an older, Placement-style writer's, README's legacy example) stays the leak it was.

(Stop 47: an import refuses both, rule ``duplicate_name`` and ``nothing_to_revert``; these logs are
imported as an older evstore imported them, ``imported_behind``.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from evstore import NotFound, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import _created, _tail, append_row, chained
from tests.test_s44_C_cli import _in_process
from tests.test_s47_E_impossible_history import imported_behind

Tail = Callable[[dict[str, Any]], list[tuple[str, str, dict[str, Any]]]]


def _reason(report: Any, reason: str) -> list[Any]:
    return [f for f in report.integrity if f.details.get("reason") == reason]


async def _log(tmp_path: Path, tail: Tail) -> tuple[list[str], dict[str, Any]]:
    """An export of a store with providers ``src`` and ``dst`` (8 VCPU each, named "src" and
    "dst"), an instance ``inst`` that held 2 VCPU on src, moved to a migration ``mig`` and placed
    on dst, the migration confirmed (it holds nothing), then the rows ``tail(ids)`` appends as an
    older or buggy writer would: (lines, ids with each appended row's position by its label)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        src = await make_provider(source, "src", VCPU=8)
        dst = await make_provider(source, "dst", VCPU=8)
        ids: dict[str, Any] = {"src": src, "dst": dst, "inst": new_uuid(), "mig": new_uuid(), "b": new_uuid()}
        ids["src_at"], ids["dst_at"] = 1, 3  # (make_provider: a creation, then its inventory)
        await allocate(source, ids["inst"], {src: {"VCPU": 2}})
        await source.start_migration(ids["inst"], ids["mig"])
        await allocate(source, ids["inst"], {dst: {"VCPU": 2}})
        ids["confirmed"] = (await source.confirm_migration(ids["mig"])).position
        with pytest.raises(NotFound, match="holds no allocations"):  # (what a command says of the revert)
            await source.revert_migration(ids["mig"])
        lines = [line async for line in source.export()]
        last = await _tail(source)
    for label, etype, data in tail(ids):
        last = chained(last, etype, data)
        append_row(lines, last)
        ids[label] = last.position
    return lines, ids


def _named(provider: str, name: str) -> dict[str, Any]:
    return {**_created(provider), "name": name}


def _created_as_src(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [("dup", "ProviderCreated", _named(ids["b"], "src"))]


def _renamed_to_src(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        ("created", "ProviderCreated", _named(ids["b"], "b")),
        ("dup", "ProviderUpdated", {"provider": ids["b"], "name": "src"}),
    ]


@pytest.mark.parametrize("tail", [_created_as_src, _renamed_to_src], ids=["created", "renamed"])
async def test_a_second_provider_given_a_name_another_holds_is_an_integrity_finding(
    tmp_path: Path, store_url: str, tail: Tail
) -> None:
    """Regression: the audit of each log was clean (fails before: no finding)."""
    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await imported_behind(store, lines)
        report = await store.audit()
        [found] = report.findings
        event_type = "ProviderCreated" if tail is _created_as_src else "ProviderUpdated"
        assert found.kind == "integrity" and found.positions == (ids["src_at"], ids["dup"])
        assert found.details == {
            "reason": "duplicate_name",
            "name": "src",
            "provider": ids["b"],
            "holder": ids["src"],
            "holder_named_at": ids["src_at"],
            "event_type": event_type,
        }
        for words in (
            ids["b"],
            ids["src"],
            "'src'",
            f"{event_type} at position {ids['dup']}",
            "duplicate_name",
        ):
            assert str(words) in found.message, found.message
        await store.rebuild()
        assert (await store.audit()).findings == [found]


async def test_a_name_taken_again_after_its_holder_let_go_of_it_is_clean(store_url: str) -> None:
    """(Commands give a name that was freed - its holder renamed or deleted - to another provider:
    no finding; a provider renamed to its own name, or created again as it was, holds it still.)"""
    async with open_store(store_url) as store:
        a = await make_provider(store, "a")
        await store.rename_provider(a, "a2")
        await make_provider(store, "a")
        doomed = await make_provider(store, "doomed")
        await store.delete_provider(doomed)
        await make_provider(store, "doomed")
        assert (await store.audit()).clean


async def test_the_name_index_follows_a_shared_name_to_its_other_holder(
    tmp_path: Path, store_url: str
) -> None:
    """Three providers named "src" (two imported duplicates, one finding each); the first holder
    deleted, a fourth given the name is a duplicate of the one still holding it; once all are
    gone, a fifth takes the name freely."""

    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        ids["c"], ids["d"], ids["e"] = new_uuid(), new_uuid(), new_uuid()
        return [
            ("b_at", "ProviderCreated", _named(ids["b"], "src")),
            ("c_at", "ProviderCreated", _named(ids["c"], "src")),
            ("src_gone", "ProviderDeleted", {"provider": ids["src"]}),
            ("d_at", "ProviderCreated", _named(ids["d"], "src")),
            ("b_gone", "ProviderDeleted", {"provider": ids["b"]}),
            ("c_gone", "ProviderDeleted", {"provider": ids["c"]}),
            ("d_gone", "ProviderDeleted", {"provider": ids["d"]}),
            ("e_at", "ProviderCreated", _named(ids["e"], "src")),
        ]

    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await imported_behind(store, lines)
        report = await store.audit()
        found = _reason(report, "duplicate_name")
        assert report.findings == found
        assert [(f.details["provider"], f.details["holder"], f.positions) for f in found] == [
            (ids["b"], ids["src"], (ids["src_at"], ids["b_at"])),
            (ids["c"], ids["src"], (ids["src_at"], ids["c_at"])),
            (ids["d"], ids["c"], (ids["c_at"], ids["d_at"])),
        ]


def _reverted_after_confirm(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [("revert", "MigrationReverted", _revert(ids["mig"], ids["inst"], {ids["src"]: {"VCPU": 2}}))]


def _reverted_unknown_migration(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    ids["ghost"] = new_uuid()
    return [("revert", "MigrationReverted", _revert(ids["ghost"], ids["inst"], {ids["src"]: {"VCPU": 3}}))]


def _revert(migration: str, instance: str, allocations: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {
        "migration": migration,
        "instance": instance,
        "allocations": allocations,
        "replaced": {},
        "project_id": "project",
        "user_id": "user",
        "instance_consumer_type": "INSTANCE",
        "instance_generation": 5,
        "provider_generations": {},
    }


@pytest.mark.parametrize(
    "tail", [_reverted_after_confirm, _reverted_unknown_migration], ids=["after its confirm", "never seen"]
)
async def test_a_revert_of_a_migration_holding_nothing_is_an_integrity_finding(
    tmp_path: Path, store_url: str, tail: Tail
) -> None:
    """Regression: the audit of each log was clean (fails before: no finding), though the revert
    gave the instance allocations on src that no consumer held - no capacity checked for them."""
    lines, ids = await _log(tmp_path, tail)
    migration = ids.get("ghost", ids["mig"])
    amount = 3 if "ghost" in ids else 2
    async with open_store(store_url) as store:
        await imported_behind(store, lines)
        assert (await store.usage(ids["src"]))["VCPU"] == amount  # (from nowhere)
        report = await store.audit()
        [found] = report.findings
        assert found.kind == "integrity" and found.positions == (ids["revert"],)
        assert found.details == {
            "reason": "nothing_to_revert",
            "migration": migration,
            "instance": ids["inst"],
            "allocations": {ids["src"]: {"VCPU": amount}},
            "emptied_at": None,  # (the confirm forgot it: absent, nothing links it)
        }
        for words in (
            migration,
            ids["inst"],
            f"position {ids['revert']}",
            "held nothing",
            "evstore.not_found",
        ):
            assert str(words) in found.message, found.message
        await store.rebuild()
        assert (await store.audit()).findings == [found]


async def test_a_revert_of_a_migration_emptied_but_kept_names_where_it_was_emptied(
    tmp_path: Path, store_url: str
) -> None:
    """A migration emptied by a release (an older writer's) that keeps its link: the finding
    cites the release."""

    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        ids["mig2"] = new_uuid()
        src, inst, mig2 = ids["src"], ids["inst"], ids["mig2"]
        moved = {
            "instance": inst,
            "migration": mig2,
            "allocations": {ids["dst"]: {"VCPU": 2}},
            "project_id": "project",
            "user_id": "user",
            "instance_consumer_type": "INSTANCE",
            "instance_generation": 3,
        }
        return [
            ("started", "MigrationStarted", moved),
            ("emptied", "ConsumerDeleted", {"consumer": mig2, "released": {}, "migrations_released": {}}),
            ("revert", "MigrationReverted", _revert(mig2, inst, {src: {"VCPU": 1}})),
        ]

    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await imported_behind(store, lines)
        report = await store.audit()
        [found] = _reason(report, "nothing_to_revert")
        assert found.details["emptied_at"] == ids["emptied"]
        assert found.positions == (ids["emptied"], ids["revert"])
        assert f"emptied at position {ids['emptied']}" in found.message


async def test_a_late_revert_to_a_deleted_instance_is_still_only_its_leak(
    tmp_path: Path, store_url: str
) -> None:
    """README's legacy example: the instance's delete released its migration, and an older writer's
    revert gave the instance the allocations back - a leak, which release clears (the audit is then
    clean, as README says), not a second finding."""

    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        inst, mig2 = ids["inst"], new_uuid()
        moved = {
            "instance": inst,
            "migration": mig2,
            "allocations": {ids["dst"]: {"VCPU": 2}},
            "project_id": "project",
            "user_id": "user",
            "instance_consumer_type": "INSTANCE",
            "instance_generation": 3,
        }
        deleted = {"consumer": inst, "released": {}, "migrations_released": {mig2: {ids["dst"]: {"VCPU": 2}}}}
        return [
            ("started", "MigrationStarted", moved),
            ("deleted", "ConsumerDeleted", deleted),
            ("revert", "MigrationReverted", _revert(mig2, inst, {ids["dst"]: {"VCPU": 2}})),
        ]

    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        [leak] = report.findings
        assert leak.kind == "leak" and leak.positions == (ids["deleted"], ids["revert"])
        await store.release(ids["inst"])
        assert (await store.audit()).clean


async def test_reverts_and_renames_made_by_commands_are_clean(store_url: str) -> None:
    async with open_store(store_url) as store:
        src = await make_provider(store, "src", VCPU=8)
        dst = await make_provider(store, "dst", VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}})
        await store.start_migration(inst, mig)
        await allocate(store, inst, {dst: {"VCPU": 2}})
        await store.revert_migration(mig)
        await store.rename_provider(dst, "dst2")
        await store.rename_provider(dst, "dst2")
        assert (await store.audit()).clean


def test_the_audit_command_names_a_duplicate_name_and_a_revert_of_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store_url: str, logging_as_it_was: None
) -> None:
    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        return [*_created_as_src(ids), *_reverted_after_confirm(ids)]

    lines, ids = asyncio.run(_log(tmp_path, tail))
    export = tmp_path / "imported.jsonl"
    export.write_text("".join(line if line.endswith("\n") else line + "\n" for line in lines))
    done = _in_process(capsys, "import", str(export), "--url", store_url, "--json")
    assert done.returncode == 1 and "rule duplicate_name" in done.stderr, done  # (stop 47: refused)

    async def behind() -> None:
        async with open_store(store_url) as store:
            await imported_behind(store, lines)

    asyncio.run(behind())
    done = _in_process(capsys, "audit", "--url", store_url, "--json")
    assert done.returncode == 3 and done.stderr == "", done
    report = json.loads(done.stdout)
    assert report["counts"] == {"integrity": 2}, report
    by_reason = {f["details"]["reason"]: f for f in report["findings"]}
    assert by_reason["duplicate_name"]["positions"] == [ids["src_at"], ids["dup"]]
    assert by_reason["duplicate_name"]["details"]["holder"] == ids["src"]
    assert by_reason["nothing_to_revert"]["positions"] == [ids["revert"]]
    assert by_reason["nothing_to_revert"]["details"]["migration"] == ids["mig"]
