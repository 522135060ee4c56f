"""Stop 46, helper E: allocations held on a provider absent there, in an imported log.

Import runs none of the commands' invariants (only the per-event checks of
``projections.invariants.impossible_event``), so an imported log can delete a provider while
consumers hold allocations on it - every command refuses that - and release them later. No
provider counted them from the deletion on, yet the audit was clean: once released, nothing in the
state shows them. Nor was an allocation on a provider that did not exist (never created, or not
yet) found once released before the provider was there. The audit now names each (``integrity``,
``reason`` ``unknown_provider``: the provider, the consumers, the deletion and the events that
took them away); one still held names the deletion too (it said "which no provider of the log
is", with only the allocation's position)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import _created, _held, _tail, append_row, chained
from tests.test_s44_C_cli import _in_process


def _absent(report: Any) -> list[Any]:
    return [f for f in report.integrity if f.details.get("reason") == "unknown_provider"]


async def _log(tmp_path: Path, tail: Any) -> tuple[list[str], dict[str, Any]]:
    """An export of a store with a provider ``rp`` (8 VCPU) and two consumers ``c1``, ``c2``
    holding 1 and 2 VCPU on it (positions 3 and 4), then the rows ``tail(ids)`` appends as an older
    or buggy writer would: (lines, ids with each appended row's position by its label)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=8)
        ids: dict[str, Any] = {"rp": rp, "c1": new_uuid(), "c2": new_uuid(), "ghost": new_uuid()}
        await allocate(source, ids["c1"], {rp: {"VCPU": 1}})
        await allocate(source, ids["c2"], {rp: {"VCPU": 2}})
        lines = [line async for line in source.export()]
        last = await _tail(source)
    for label, etype, data in tail(ids):
        last = chained(last, etype, data)
        append_row(lines, last)
        ids[label] = last.position
    return lines, ids


def _deleted_then_released(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    rp, c1, c2 = ids["rp"], ids["c1"], ids["c2"]
    return [
        ("delete", "ProviderDeleted", {"provider": rp}),
        ("release1", "AllocationsReleased", {"consumer": c1, "released": {rp: {"VCPU": 1}}}),
        (
            "release2",
            "ConsumerDeleted",
            {"consumer": c2, "released": {rp: {"VCPU": 2}}, "migrations_released": {}},
        ),
    ]


async def test_a_provider_deleted_while_held_then_released_is_an_integrity_finding(
    tmp_path: Path, store_url: str
) -> None:
    """Regression: the audit of this log was clean (fails before: no finding)."""
    lines, ids = await _log(tmp_path, _deleted_then_released)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        assert not report.drift and not report.leaks, report.findings
        [found] = _absent(report)
        assert report.findings == [found]
        assert found.positions == (ids["delete"], ids["release1"], ids["release2"])
        assert found.details == {
            "reason": "unknown_provider",
            "provider": ids["rp"],
            "deleted_at": ids["delete"],
            "consumers": sorted([ids["c1"], ids["c2"]]),
            "held": [
                {"consumer": ids["c1"], "allocated_at": 3, "released_at": ids["release1"]},
                {"consumer": ids["c2"], "allocated_at": 4, "released_at": ids["release2"]},
            ],
        }
        for words in (ids["rp"], ids["c1"], ids["c2"], f"deleted at position {ids['delete']}", "in use"):
            assert str(words) in found.message, found.message
        await store.rebuild()
        assert _absent(await store.audit()) == [found]


async def test_a_provider_deleted_while_held_and_still_held_names_its_deletion(
    tmp_path: Path, store_url: str
) -> None:
    """Found before, but as "which no provider of the log is", citing only the allocation: the
    deletion, which no command makes while something is held, was not named."""

    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        return [_deleted_then_released(ids)[0], _deleted_then_released(ids)[1]]

    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        taken, held = sorted(_absent(report), key=lambda f: "consumer" in f.details)
        assert report.findings == [held, taken] and not report.drift
        assert taken.details["consumers"] == [ids["c1"]] and taken.positions == (
            ids["delete"],
            ids["release1"],
        )
        assert held.details["consumer"] == ids["c2"] and held.details["providers"] == [ids["rp"]]
        assert held.details["deleted_at"] == {ids["rp"]: ids["delete"]}
        assert held.positions == (4, ids["delete"])
        assert f"deleted at position {ids['delete']}" in held.message and "no provider of" not in held.message


def _never_created(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    c, ghost = ids["c1"], ids["ghost"]
    return [
        ("allocated", "AllocationsReplaced", _held(c, {ghost: {"VCPU": 3}})),
        ("released", "AllocationsReleased", {"consumer": c, "released": {ghost: {"VCPU": 3}}}),
    ]


def _released_before_it_was_created(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [*_never_created(ids), ("created", "ProviderCreated", _created(ids["ghost"]))]


def _allocated_after_its_deletion(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    rp, c = ids["rp"], new_uuid()
    return [
        ("released1", "AllocationsReleased", {"consumer": ids["c1"], "released": {rp: {"VCPU": 1}}}),
        ("released2", "AllocationsReleased", {"consumer": ids["c2"], "released": {rp: {"VCPU": 2}}}),
        ("delete", "ProviderDeleted", {"provider": rp}),  # (as a command deletes it: nothing held)
        ("allocated", "AllocationsReplaced", _held(c, {rp: {"VCPU": 3}})),
        (
            "released",
            "ConsumerDeleted",
            {"consumer": c, "released": {rp: {"VCPU": 3}}, "migrations_released": {}},
        ),
    ]


@pytest.mark.parametrize(
    "tail",
    [_never_created, _released_before_it_was_created, _allocated_after_its_deletion],
    ids=["never created", "released before it was created", "allocated after its deletion"],
)
async def test_allocations_on_a_provider_absent_where_written_then_released_are_found(
    tmp_path: Path, store_url: str, tail: Any
) -> None:
    """Regression: each of these logs audited clean (fails before: no finding)."""
    lines, ids = await _log(tmp_path, tail)
    provider = ids["rp"] if "delete" in ids else ids["ghost"]
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        [found] = _absent(report)
        assert report.findings == [found]
        assert found.positions == (ids["allocated"], ids["released"])
        assert found.details["provider"] == provider and found.details["deleted_at"] is None
        assert [h["released_at"] for h in found.details["held"]] == [ids["released"]]
        assert provider in found.message and "did not exist" in found.message


async def test_a_provider_deleted_as_commands_delete_it_leaves_the_audit_clean(
    tmp_path: Path, store_url: str
) -> None:
    """(Nothing held on it at its deletion: no finding, and the later events are not suspected.)"""
    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=8)
        other = await make_provider(store, "other", VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        await store.release(c)
        await store.delete_provider(rp)
        for _ in range(3):
            consumer = new_uuid()
            await allocate(store, consumer, {other: {"VCPU": 1}})
            await store.delete_consumer(consumer)
        assert (await store.audit()).clean


def test_the_audit_command_names_a_provider_deleted_while_held(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store_url: str, logging_as_it_was: None
) -> None:
    lines, ids = asyncio.run(_log(tmp_path, _deleted_then_released))
    export = tmp_path / "deleted-while-held.jsonl"
    export.write_text("\n".join(lines) + "\n")
    done = _in_process(capsys, "import", str(export), "--url", store_url, "--json")
    assert done.returncode == 3, done  # (imported; the audit that follows has a finding)
    done = _in_process(capsys, "audit", "--url", store_url, "--json")
    assert done.returncode == 3 and done.stderr == "", done
    report = json.loads(done.stdout)
    assert report["counts"] == {"integrity": 1}, report
    [finding] = report["findings"]
    assert finding["positions"] == [ids["delete"], ids["release1"], ids["release2"]]
    assert finding["details"]["reason"] == "unknown_provider"
    assert finding["details"]["provider"] == ids["rp"] and finding["details"]["deleted_at"] == ids["delete"]
    assert finding["details"]["consumers"] == sorted([ids["c1"], ids["c2"]])


async def _checked_pass(store: Any, batch_size: int) -> Any:
    from projections.audit import AuditReport, _Replay

    replay = _Replay(AuditReport())
    replay.state.usages_deferred = True  # (as the audit's)
    await replay.run(store.backend.read_raw, batch_size)
    return replay


async def test_what_the_checked_pass_notes_does_not_depend_on_its_batches(tmp_path: Path) -> None:
    """The pass looks at the events that take allocations away only while a deleted provider may
    still be held (between batches it drops those nothing is held on): with a batch of one row, the
    suspect provider is looked over after its deletion and kept until its allocations are taken
    away; a provider deleted as commands delete it is dropped at the next look."""
    lines, ids = await _log(tmp_path, _deleted_then_released)
    async with open_store(f"sqlite:///{tmp_path}/imported.db") as store:
        await store.import_events(lambda: iter(lines))
        whole, one_by_one = await _checked_pass(store, 5000), await _checked_pass(store, 1)
        assert whole.absent_taken == one_by_one.absent_taken
        assert [(p, c) for p, _, c, _, _ in whole.absent_taken] == [
            (ids["release1"], ids["c1"]),
            (ids["release2"], ids["c2"]),
        ]
        assert one_by_one.suspects == set()  # (released: dropped at the look after)
        other = await make_provider(store, "other", VCPU=8)
        await store.delete_provider(other)
        watched = await _checked_pass(store, 1)
        assert watched.suspects == set() and watched.gone[other] == await store.head()


async def test_a_provider_deleted_under_its_children_is_an_integrity_finding(
    tmp_path: Path, store_url: str
) -> None:
    """Regression: a log deleting a provider that has a child (every command refuses that) was
    imported and audited clean, the child's parent and root naming no provider."""

    def tail(ids: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
        rp, child = ids["rp"], ids["ghost"]
        return [
            ("child", "ProviderCreated", {"provider": child, "name": "child", "parent": rp, "root": rp}),
            *_deleted_then_released(ids)[1:],
            ("delete", "ProviderDeleted", {"provider": rp}),
        ]

    lines, ids = await _log(tmp_path, tail)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        [found] = report.findings
        assert found.kind == "integrity" and found.positions == (ids["delete"],)
        assert found.details == {
            "reason": "unknown_parent",
            "provider": ids["ghost"],
            "parent": ids["rp"],
            "root": ids["rp"],
            "deleted_at": {ids["rp"]: ids["delete"]},
        }
        assert f"deleted at position {ids['delete']}" in found.message


async def test_a_tree_deleted_leaves_first_is_clean(store_url: str) -> None:
    async with open_store(store_url) as store:
        root = await make_provider(store, "root")
        child = await make_provider(store, "child", parent=root)
        await make_provider(store, "kept")
        await store.delete_provider(child)
        await store.delete_provider(root)
        assert (await store.audit()).clean
