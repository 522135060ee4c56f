"""The seed scenarios of bug 1848343 (SPEC §6), each in both orders, on a real store.

The instance is deleted while the migration consumer holds its source allocations; then the
revert runs. evstore rejects the revert with ConsumerDeleted, appends nothing, and usage returns
to what it was before the instance existed. Revert-then-delete ends with zero usage too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from evstore import AllocationStore, ConsumerDeleted, InvalidInput, Inventory
from tests.conftest import allocate, make_provider, new_uuid

FLAVOR = {"VCPU": 2, "MEMORY_MB": 1024, "DISK_GB": 20}
NEW_FLAVOR = {"VCPU": 4, "MEMORY_MB": 2048, "DISK_GB": 40}


@dataclass(frozen=True)
class Scenario:
    name: str
    actor: str
    #: the scheduler had already claimed the destination for the instance before the failure
    destination_claimed: bool
    #: resize to the same host (source and destination are one provider)
    same_host: bool = False


SCENARIOS = [
    Scenario("conductor rollback after NoValidHost", "nova-conductor", destination_claimed=False),
    Scenario("live-migration task rollback", "nova-conductor:live_migrate", destination_claimed=True),
    Scenario(
        "compute revert after failed prep_resize claim", "nova-compute:prep_resize", True, same_host=True
    ),
    Scenario("resize_instance fails on the source host", "nova-compute:resize_instance", True),
    Scenario(
        "finish_revert_resize after the user asked to revert", "nova-compute:finish_revert_resize", True
    ),
]


async def cloud(store: AllocationStore) -> tuple[str, str]:
    inv = {"VCPU": Inventory(total=16), "MEMORY_MB": Inventory(total=32768), "DISK_GB": Inventory(total=1000)}
    src = await make_provider(store, "source-node", **inv)  # type: ignore[arg-type]
    dst = await make_provider(store, "dest-node", **inv)  # type: ignore[arg-type]
    return src, dst


async def start(store: AllocationStore, scenario: Scenario, src: str, dst: str) -> tuple[str, str, str]:
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: FLAVOR})
    await store.start_migration(
        instance, migration, metadata={"actor": "nova-conductor", "request_id": "req-move"}
    )
    target = src if scenario.same_host else dst
    if scenario.destination_claimed:
        await allocate(store, instance, {target: NEW_FLAVOR})
    return instance, migration, target


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
async def test_delete_then_revert_is_rejected_and_leaks_nothing(
    store: AllocationStore, scenario: Scenario
) -> None:
    src, dst = await cloud(store)
    before = {p: dict((await store.usage(p)).usages) for p in (src, dst)}
    instance, migration, _ = await start(store, scenario, src, dst)

    await store.delete_consumer(instance, metadata={"actor": "nova-api", "request_id": "req-delete"})
    head = await store.head()
    with pytest.raises(ConsumerDeleted) as info:
        await store.revert_migration(
            migration, metadata={"actor": scenario.actor, "request_id": "req-revert"}
        )
    assert info.value.code == "evstore.consumer.deleted"
    assert instance in info.value.message

    assert await store.head() == head, "a rejected revert must append nothing"
    for p in (src, dst):
        assert (await store.usage(p)).usages == before[p]
    assert (await store.allocations(instance)).allocations == {}
    assert (await store.allocations(instance)).deleted
    assert (await store.allocations(migration)).allocations == {}

    types = [e.type async for e in store.history(instance)]
    expected = ["AllocationsReplaced", "MigrationStarted"]
    if scenario.destination_claimed:
        expected.append("AllocationsReplaced")
    assert types == [*expected, "ConsumerDeleted"]
    deleted = [e async for e in store.history(instance)][-1]
    assert deleted.metadata.actor == "nova-api" and deleted.metadata.request_id == "req-delete"
    assert deleted.payload["migrations_released"] == {migration: {src: FLAVOR}}

    report = await store.audit()
    assert report.clean, report.findings


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
async def test_revert_then_delete_ends_with_zero_usage(store: AllocationStore, scenario: Scenario) -> None:
    src, dst = await cloud(store)
    instance, migration, _ = await start(store, scenario, src, dst)

    await store.revert_migration(migration, metadata={"actor": scenario.actor})
    assert (await store.allocations(instance)).allocations == {src: FLAVOR}
    await store.delete_consumer(instance)

    for p in (src, dst):
        assert set((await store.usage(p)).usages.values()) == {0}
    types = [e.type async for e in store.history(instance)]
    assert types[-2:] == ["MigrationReverted", "ConsumerDeleted"]
    assert (await store.audit()).clean


async def test_placement_style_revert_through_write_allocations_is_rejected_too(
    store: AllocationStore,
) -> None:
    """Nova's move_allocations sends POST /allocations with the instance's generation read as null."""
    from evstore import ConsumerAllocations

    src, _ = await cloud(store)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: FLAVOR})
    await store.start_migration(instance, migration)
    await store.delete_consumer(instance)
    mig = await store.allocations(migration)
    assert mig.allocations == {}  # released with the instance
    head = await store.head()
    with pytest.raises(ConsumerDeleted):
        await store.write_allocations(
            {
                instance: ConsumerAllocations(
                    allocations={src: FLAVOR},
                    project_id="project",
                    user_id="user",
                    consumer_type="INSTANCE",
                    consumer_generation=None,
                )
            }
        )
    assert await store.head() == head
    assert set((await store.usage(src)).usages.values()) == {0}


async def test_a_plain_write_to_the_migration_of_a_deleted_instance_is_rejected(
    store: AllocationStore,
) -> None:
    """The racing writer targets the migration consumer instead of the instance: the migration
    still acts for the deleted instance, so allocations given to it would be held for a tombstone
    (the audit's second kind of leak). Rejected, nothing appended."""
    src, _ = await cloud(store)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: FLAVOR})
    await store.start_migration(instance, migration)
    await store.delete_consumer(instance)
    head = await store.head()
    with pytest.raises(ConsumerDeleted) as caught:
        await store.set_allocations(
            migration,
            {src: FLAVOR},
            project_id="project",
            user_id="user",
            consumer_type="MIGRATION",
            generation=None,
        )
    assert caught.value.details["consumer"] == instance
    assert caught.value.details["migration"] == migration
    assert await store.head() == head
    assert set((await store.usage(src)).usages.values()) == {0}
    with pytest.raises(ConsumerDeleted):  # and there is nothing to confirm either
        await store.confirm_migration(migration)
    # nor can it become another instance's migration (a late revert of the deleted instance's
    # migration would then move that instance's allocations)
    other = new_uuid()
    await allocate(store, other, {src: FLAVOR})
    head = await store.head()
    with pytest.raises(ConsumerDeleted):
        await store.start_migration(other, migration)
    assert await store.head() == head
    assert (await store.allocations(other)).allocations == {src: FLAVOR}
    report = await store.audit()
    assert report.clean, report.findings


@pytest.mark.parametrize("via", ["start_migration", "write_allocations"])
async def test_a_revert_into_an_instance_taken_as_another_instances_migration_is_refused(
    store: AllocationStore, via: str
) -> None:
    """Regression (rev25 black-box lifecycle probe): instance B's resize is in flight (migration M
    holds B's source) when B's uuid is taken as the migration consumer of instance A. Reverting M
    then "gave back" B's source to B by replacing what B held for A: A's allocations vanished
    silently; and once A was deleted (releasing what B held for it, B still linked to A), the
    revert gave allocations to a migration of a deleted instance, a leak the audit reported. The
    revert is refused now, nothing is appended, and A's migration can still be reverted."""
    src, dst = await cloud(store)
    instance_b, migration, instance_a = new_uuid(), new_uuid(), new_uuid()
    await allocate(store, instance_b, {src: FLAVOR})
    await store.start_migration(instance_b, migration)
    await allocate(store, instance_a, {dst: NEW_FLAVOR})
    if via == "start_migration":
        await store.start_migration(instance_a, instance_b)
    else:  # Nova's move_allocations, recognised as a move
        await store.write_allocations(
            {
                instance_a: _entry({}, 1, "INSTANCE"),
                instance_b: _entry({dst: NEW_FLAVOR}, None, "MIGRATION"),
            }
        )
    assert (await store.allocations(instance_b)).on_behalf_of == instance_a
    head = await store.head()
    with pytest.raises(InvalidInput, match="itself the migration consumer of instance") as caught:
        await store.revert_migration(migration)
    assert caught.value.details["on_behalf_of"] == instance_a
    assert await store.head() == head
    assert (await store.allocations(instance_b)).allocations == {dst: NEW_FLAVOR}  # still A's
    # A's own migration comes back whole; then M's revert gives B its source again
    await store.revert_migration(instance_b)
    assert (await store.allocations(instance_a)).allocations == {dst: NEW_FLAVOR}
    await store.revert_migration(migration)
    assert (await store.allocations(instance_b)).allocations == {src: FLAVOR}
    assert (await store.audit()).clean


async def test_a_revert_into_the_released_migration_of_a_deleted_instance_does_not_leak(
    store: AllocationStore,
) -> None:
    """The second half of the regression above: A deleted while B held its allocations; the
    revert of B's own migration M gave B allocations while B was still A's migration (the audit
    found a leak: "migration holds resources for deleted instance"). Refused, nothing written."""
    src, dst = await cloud(store)
    instance_b, migration, instance_a = new_uuid(), new_uuid(), new_uuid()
    await allocate(store, instance_b, {src: FLAVOR})
    await store.start_migration(instance_b, migration)
    await allocate(store, instance_a, {dst: NEW_FLAVOR})
    await store.start_migration(instance_a, instance_b)
    await store.delete_consumer(instance_a)
    head = await store.head()
    with pytest.raises(InvalidInput) as caught:
        await store.revert_migration(migration)
    # (not only "revert or confirm migration B first": neither can run once A is deleted)
    assert f"confirm migration {migration} to release what it holds" in caught.value.message
    for undo in (store.revert_migration, store.confirm_migration):
        with pytest.raises(ConsumerDeleted):
            await undo(instance_b)
    assert await store.head() == head
    assert (await store.allocations(instance_b)).allocations == {}
    await store.confirm_migration(migration)  # (what the message says releases M's)
    assert (await store.allocations(migration)).allocations == {}
    report = await store.audit()
    assert report.clean, report.findings


def _entry(allocations: dict[str, dict[str, int]], generation: int | None, kind: str) -> dict[str, object]:
    return {
        "allocations": allocations,
        "project_id": "project",
        "user_id": "user",
        "consumer_type": kind,
        "consumer_generation": generation,
    }


async def test_a_nova_style_move_through_write_allocations_is_a_migration(store: AllocationStore) -> None:
    """SPEC: a plain write that empties one consumer and fills another is also a move; the same
    invariants apply. Nova's move_allocations (one POST /allocations) then a destination claim,
    then the instance is deleted: the migration's source allocations must be released with it
    (they leaked: the store did not know the migration held them for the instance)."""
    src, dst = await cloud(store)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: FLAVOR})
    generation = (await store.allocations(instance)).generation
    receipt = await store.write_allocations(
        {instance: _entry({}, generation, "INSTANCE"), migration: _entry({src: FLAVOR}, None, "MIGRATION")}
    )
    assert receipt.consumer_generations == {instance: None, migration: 1}
    assert [e.type async for e in store.history(migration)] == ["MigrationStarted"]
    await allocate(store, instance, {dst: NEW_FLAVOR})  # the destination claim
    await store.delete_consumer(instance)
    assert (await store.allocations(migration)).allocations == {}
    for p in (src, dst):
        assert set((await store.usage(p)).usages.values()) == {0}
    report = await store.audit()
    assert report.clean, report.findings


async def test_a_move_written_plainly_can_be_reverted_and_other_writes_stay_plain(
    store: AllocationStore,
) -> None:
    src, dst = await cloud(store)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {src: FLAVOR})
    await store.write_allocations(
        {instance: _entry({}, 1, "INSTANCE"), migration: _entry({src: FLAVOR}, None, "MIGRATION")}
    )
    await allocate(store, instance, {dst: NEW_FLAVOR})
    await store.revert_migration(migration)
    assert (await store.allocations(instance)).allocations == {src: FLAVOR}
    assert set((await store.usage(dst)).usages.values()) == {0}
    # not a move: other amounts than the source held (a resize written in one go) - plain writes
    other = new_uuid()
    generation = (await store.allocations(instance)).generation
    receipt = await store.write_allocations(
        {instance: _entry({}, generation, "INSTANCE"), other: _entry({dst: NEW_FLAVOR}, None, "INSTANCE")}
    )
    assert len(receipt.positions) == 2
    assert [e.type async for e in store.history(other)] == ["AllocationsReplaced"]
    await store.delete_consumer(instance)
    assert (await store.allocations(other)).allocations == {dst: NEW_FLAVOR}  # not held for instance
    assert (await store.audit()).clean
