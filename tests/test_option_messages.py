"""Messages of refused options and arguments say everything a person needs to correct them, and
docstrings' promises about what a command raises hold."""

from __future__ import annotations

import pytest

from evstore import (
    AllocationStore,
    ConstraintViolation,
    InvalidInput,
    Inventory,
    open_store,
)
from evstore.errors import shown
from tests.conftest import allocate, make_provider, new_uuid


async def test_an_unknown_keyword_names_the_stores_own_keywords_too(sqlite_url: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        await open_store(sqlite_url, max_batches=8)  # type: ignore[call-arg]
    message = str(caught.value)
    # (the backend's options alone left out the three every store takes)
    for known in ("synchronous", "busy_timeout", "create", "max_batch", "poll_interval", "snapshot_every"):
        assert known in message, message


async def test_a_store_keyword_in_the_url_is_still_said_to_be_a_keyword(sqlite_url: str) -> None:
    hint = r"max_batch: a keyword of open_store\(url, \.\.\.\), not a URL option"
    with pytest.raises(InvalidInput, match=hint):
        await open_store(f"{sqlite_url}?max_batch=8")


@pytest.mark.parametrize("value", [0, -3, 2.5, "100", True, 2**63, 2**70])
async def test_a_bad_snapshot_every_says_what_it_got(sqlite_url: str, value: object) -> None:
    with pytest.raises(InvalidInput) as caught:
        await open_store(sqlite_url, snapshot_every=value)  # type: ignore[arg-type]
    assert caught.value.details["field"] == "snapshot_every"
    assert f"got {value!r}" in str(caught.value)
    # (2**70 meant "never": a snapshot is taken at a position that is a multiple of it, and no
    # position is beyond 2**63-1, the largest the log's integer column holds)
    assert "from 1 to 9223372036854775807" in str(caught.value), caught.value


async def test_the_largest_snapshot_every_is_the_largest_position(sqlite_url: str) -> None:
    async with open_store(sqlite_url, snapshot_every=2**63 - 1) as store:
        assert store.snapshot_every == 2**63 - 1


async def test_usages_names_all_and_unknown_when_it_refuses_a_consumer_type(store: AllocationStore) -> None:
    for query in (store.usages, (await store.state_at(position=await store.head())).usages):
        with pytest.raises(InvalidInput) as caught:
            await query("project", consumer_type="lower-case")
        assert '"all" or "unknown"' in str(caught.value), caught.value
    # (a command's consumer type cannot be either: its message does not offer them)
    with pytest.raises(InvalidInput) as refused:
        await allocate(store, new_uuid(), {}, consumer_type="lower-case")
    assert '"all"' not in str(refused.value)


async def _migrated(store: AllocationStore) -> tuple[str, str, str]:
    """An instance moved from ``source`` to a destination, its migration holding 4 VCPU on the source."""
    source = await make_provider(store, VCPU=8)
    dest = await make_provider(store, VCPU=8)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {source: {"VCPU": 4}})
    await store.start_migration(instance, migration)
    await allocate(store, instance, {dest: {"VCPU": 4}})
    return source, instance, migration


async def test_a_revert_needs_no_room_on_a_source_that_shrank(store: AllocationStore) -> None:
    source, instance, migration = await _migrated(store)
    inventories = await store.inventories(source)
    await store.set_inventory(source, "VCPU", Inventory(total=2), inventories.generation)  # (4 in use)
    await store.revert_migration(migration)
    assert (await store.allocations(instance)).allocations == {source: {"VCPU": 4}}
    assert await store.usage(source) == {"VCPU": 4}


async def test_a_revert_breaking_the_sources_new_step_size_is_a_constraint_violation(
    store: AllocationStore,
) -> None:
    source, _instance, migration = await _migrated(store)
    head = await store.head()
    inventories = await store.inventories(source)
    await store.set_inventory(source, "VCPU", Inventory(total=8, step_size=3), inventories.generation)
    with pytest.raises(ConstraintViolation):
        await store.revert_migration(migration)
    assert await store.head() == head + 1  # (the inventory only: the revert wrote nothing)
    assert (await store.allocations(migration)).allocations == {source: {"VCPU": 4}}


@pytest.mark.parametrize("in_url", [False, True])
async def test_a_min_pool_size_above_pool_size_names_both_and_what_they_were(in_url: bool) -> None:
    """Regression: ``min_pool_size`` above ``pool_size`` was refused as "need pool_size >= 1, 0 <=
    min_pool_size <= pool_size, max_retries >= 1", with no ``details["field"]`` and neither value
    (each option's own range is checked, with its name and value, before: only this pair is left).
    Refused before any connection is made, so no server is needed."""
    url = "postgresql://evstore@127.0.0.1:1/none"
    with pytest.raises(InvalidInput) as caught:
        if in_url:
            await open_store(f"{url}?pool_size=2&min_pool_size=5")
        else:
            await open_store(url, pool_size=2, min_pool_size=5)
    assert caught.value.details["field"] == "min_pool_size"
    assert "min_pool_size (5)" in caught.value.message and "pool_size (2)" in caught.value.message


PG_NOWHERE = "postgresql://evstore@127.0.0.1:1/none"  # (options are refused before a connection is made)


@pytest.mark.parametrize("option", ["create", "upgrade"])
@pytest.mark.parametrize("value", ["false", 0, None, "a long text " * 10])
async def test_a_flag_option_that_is_not_a_bool_has_one_message_on_both_backends(
    sqlite_url: str, option: str, value: object
) -> None:
    """Regression: ``upgrade="false"`` (or ``create=0``) was refused as "must be True or False"
    on SQLite and "must be true or false" on PostgreSQL, which also quoted the value whole where
    SQLite cut it at 40 characters: the same mistake now reads the same on both."""
    messages = []
    for url in (sqlite_url, PG_NOWHERE):
        with pytest.raises(InvalidInput) as caught:
            await open_store(url, **{option: value})  # type: ignore[arg-type]
        assert caught.value.details["field"] == option
        messages.append(caught.value.message)
    assert messages[0] == messages[1] == f"{option} must be True or False, got {shown(value, 40)}"


@pytest.mark.parametrize("option", ["create", "upgrade"])
async def test_a_flag_option_in_the_url_has_one_message_on_both_backends(
    sqlite_url: str, option: str
) -> None:
    messages = []
    for url in (sqlite_url, PG_NOWHERE):
        with pytest.raises(InvalidInput) as caught:
            await open_store(f"{url}?{option}=maybe")
        assert caught.value.details["field"] == option
        messages.append(caught.value.message)
    assert messages[0] == messages[1] == f"{option} must be true or false, got 'maybe'"
