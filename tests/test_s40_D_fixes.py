"""Fixes of two findings of the stop-40 acceptance probe (tests/test_s40_C_probe.py in helper C's
clone): a revert's project and user (Nova's move_allocations), and a SQLite command appended at a
lost position of the log."""

from __future__ import annotations

from evstore import AllocationStore, open_store
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
