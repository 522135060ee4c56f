"""Fixes of two findings of the stop-40 acceptance probe (tests/test_s40_C_probe.py in helper C's
clone): a revert's project and user (Nova's move_allocations), and a SQLite command appended at a
lost position of the log."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from evstore import AllocationStore, CorruptEvent, open_store
from tests.conftest import make_provider, new_uuid
from tests.peers.placement_client import PlacementPeer
from tests.test_differential_placement import (
    PROJECTS,
    USERS,
    ConsumerSpec,
    RevertMigration,
    StartMigration,
    Write,
    check_program,
)

OWNER = {"project_id": "proj", "user_id": "user", "consumer_type": "INSTANCE"}


# SPEC §2 "Migrations (what Nova does with move_allocations ...)", "everything else is
# Placement-exact"; Nova's revert is move_allocations(migration -> instance), whose target entry
# carries the source's (the migration's) project_id and user_id (nova/scheduler/client/report.py,
# /work/shared/reference/placement-16-semantics.md §6), and Placement updates an existing consumer's
# project and user to what a write sends. The revert kept the instance's destination claim's owner.
async def test_revert_gives_the_allocations_back_under_the_migrations_project(store: AllocationStore) -> None:
    src = await make_provider(store, VCPU=8)
    dst = await make_provider(store, VCPU=8)
    inst, mig = new_uuid(), new_uuid()
    await store.set_allocations(inst, {src: {"VCPU": 2}}, generation=None, **OWNER)
    await store.start_migration(inst, mig)
    # the scheduler's claim on the destination, made for another project/user and type
    await store.set_allocations(
        inst,
        {dst: {"VCPU": 3}},
        generation=None,
        project_id="other",
        user_id="other-user",
        consumer_type="OTHER",
    )
    receipt = await store.revert_migration(mig)
    back = await store.allocations(inst)
    assert back.allocations == {src: {"VCPU": 2}}
    assert (back.project_id, back.user_id) == ("proj", "user")
    # (Nova sends no consumer type at 1.28: Placement keeps the instance's own)
    assert back.consumer_type == "OTHER"
    # the event says so, and the usage counters per project and user follow it
    [reverted] = await store.read(after=receipt.positions[0] - 1)
    assert (reverted.event["project_id"], reverted.event["user_id"]) == ("proj", "user")
    assert (await store.usages("proj")).usages == {"VCPU": 2}
    assert (await store.usages("proj", user_id="user")).usages == {"VCPU": 2}
    assert (await store.usages("other")).usages == {}
    assert (await store.usages("other", user_id="other-user")).usages == {}
    # a rebuild from the log and the audit agree with the live projection
    await store.rebuild()
    assert (await store.allocations(inst)).project_id == "proj"
    assert (await store.usages("proj")).usages == {"VCPU": 2}
    assert (await store.usages("other")).usages == {}
    assert (await store.audit()).clean


async def test_revert_into_an_absent_instance_keeps_the_migrations_owner_and_type(store_url: str) -> None:
    """(unchanged by the fix: an absent instance takes the migration's owner and the type its
    migration took over from it; checked across a reopen, so from the persisted projection)"""
    inst, mig = new_uuid(), new_uuid()
    async with open_store(store_url) as store:
        src = await make_provider(store, VCPU=8)
        await store.set_allocations(inst, {src: {"VCPU": 2}}, generation=None, **OWNER)
        await store.start_migration(inst, mig)
    async with open_store(store_url) as store:
        await store.revert_migration(mig)
        back = await store.allocations(inst)
        assert (back.project_id, back.user_id, back.consumer_type) == ("proj", "user", "INSTANCE")
        assert (await store.usages("proj")).usages == {"VCPU": 2}
        assert (await store.audit()).clean


def test_revert_over_another_projects_claim_matches_placement(placement_peer: PlacementPeer) -> None:
    """The same revert against the real Placement, sent as Nova's move_allocations sends it: the
    instance (C0, of project-a, set up holding on P0) migrates away, the destination claim is
    written for another project and user, and the revert gives the source back; allocations,
    owners, generations and every project's usages must agree."""
    check_program(
        placement_peer,
        [
            StartMigration(0, 2),
            Write(
                (ConsumerSpec(0, ((1, (("VCPU", 1),)),), "null", PROJECTS[1], "INSTANCE", USERS[1]),),
                post=False,
            ),
            RevertMigration(2),
        ],
    )


def _delete_event_rows(store_url: str, backend_name: str, after: int) -> None:
    """Lose the log's events after ``after`` (rows deleted by hand, an older copy restored)."""
    if backend_name == "sqlite":
        conn = sqlite3.connect(urlsplit(store_url).path)
        try:
            assert conn.execute("DELETE FROM events WHERE position > ?", (after,)).rowcount > 0
            conn.commit()
        finally:
            conn.close()
        return
    import asyncpg

    async def delete() -> None:
        pg = await asyncpg.connect(store_url)
        try:
            assert await pg.execute("DELETE FROM events WHERE position > $1", after) != "DELETE 0"
        finally:
            await pg.close()

    asyncio.run(delete())  # (called outside the test's loop: see the callers)


async def _in_thread(fn: Callable[[], None]) -> None:
    await asyncio.to_thread(fn)


# README ("evstore rebuild"): refused when the log lost its last events, "since it would forget them
# for good: restore the events after `head`, or `--force`"; SPEC §2: a tombstone is never forgotten.
# On SQLite the next command was appended at the lost tombstone's position: the audit no longer
# reported the loss and a plain rebuild forgot the tombstone (the deleted instance held its
# allocations again). (PostgreSQL names the lost event by its sequence number, never reused.)
async def test_a_command_after_lost_last_events_does_not_let_rebuild_forget_them(
    store_url: str, backend_name: str
) -> None:
    inst = new_uuid()
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        await store.set_allocations(inst, {rp: {"VCPU": 2}}, generation=None, **OWNER)
        tombstone = (await store.delete_consumer(inst)).position
        assert tombstone == await store.head()
    await _in_thread(lambda: _delete_event_rows(store_url, backend_name, tombstone - 1))
    async with open_store(store_url) as store:
        assert "integrity" in {f.kind for f in (await store.audit()).findings}
        with contextlib.suppress(CorruptEvent):  # (SQLite refuses it: see the next test)
            await make_provider(store)  # any command, e.g. the next build's
        assert [f.details["reason"] for f in (await store.audit()).integrity] == ["log_truncated"]
        with pytest.raises(CorruptEvent) as caught:
            await store.rebuild()
        assert caught.value.details["reason"] == "log_truncated"
        assert caught.value.details["consumer"] == inst
    async with open_store(store_url) as store:  # (and after a reopen: nothing was forgotten)
        with pytest.raises(CorruptEvent):
            await store.rebuild()


async def test_sqlite_refuses_commands_while_its_log_is_behind_its_projection(sqlite_url: str) -> None:
    """The refusal itself: every command, whatever it names, with the error a rebuild gives
    (evstore.log.corrupt, the audit's log_truncated details), nothing appended; after
    ``rebuild(force=True)`` accepts the loss, commands go on at the head."""
    inst = new_uuid()
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        await store.set_allocations(inst, {rp: {"VCPU": 2}}, generation=None, **OWNER)
        tombstone = (await store.delete_consumer(inst)).position
        assert tombstone is not None
    await _in_thread(lambda: _delete_event_rows(sqlite_url, "sqlite", tombstone - 1))
    async with open_store(sqlite_url) as store:
        head = await store.head()
        expected = {"reason": "log_truncated", "head": head, "consumer": inst, "lost_position": tombstone}
        [finding] = (await store.audit()).integrity
        assert finding.details == expected
        for name, command in {
            "create_provider": lambda: make_provider(store),
            "a write to another consumer": lambda: store.set_allocations(
                new_uuid(), {rp: {"VCPU": 1}}, generation=None, **OWNER
            ),
            "a write to the lost tombstone's consumer": lambda: store.set_allocations(
                inst, {rp: {"VCPU": 1}}, generation=None, **OWNER
            ),
            "delete_consumer": lambda: store.delete_consumer(new_uuid()),
        }.items():
            with pytest.raises(CorruptEvent) as caught:
                await command()
            assert caught.value.code == "evstore.log.corrupt", name
            # (a command refused so: nothing of it written - stop 44's outcome_unknown on SQLite)
            assert caught.value.details == {**expected, "outcome_unknown": False}, name
            assert "lost its last events" in caught.value.message and "--force" in caught.value.message
        assert await store.head() == head  # nothing appended
        await store.rebuild(force=True)  # (the README's way to accept the loss)
        other = new_uuid()
        receipt = await store.set_allocations(other, {rp: {"VCPU": 1}}, generation=None, **OWNER)
        assert receipt.positions == (head + 1,)
        assert (await store.audit()).clean


async def test_sqlite_refuses_commands_once_an_open_stores_log_loses_its_last_events(sqlite_url: str) -> None:
    """The same while the store stays open: the rows are deleted by another connection between two
    commands (the head goes back), and the next command is refused."""
    inst = new_uuid()
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        await store.set_allocations(inst, {rp: {"VCPU": 2}}, generation=None, **OWNER)
        tombstone = (await store.delete_consumer(inst)).position
        assert tombstone is not None
        await _in_thread(lambda: _delete_event_rows(sqlite_url, "sqlite", tombstone - 1))
        with pytest.raises(CorruptEvent) as caught:
            await make_provider(store)
        assert caught.value.details["lost_position"] == tombstone
        assert await store.head() == tombstone - 1
        with pytest.raises(CorruptEvent):
            await store.rebuild()
