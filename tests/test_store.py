"""The public API of the store: shapes, URLs, idempotency, metadata, events, logging, bad input."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import hashlib
import io
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

import evstore
from evstore import (
    AllocationStore,
    ConsumerAllocations,
    EvstoreError,
    IdempotencyConflict,
    InvalidInput,
    Inventory,
    NotFound,
    ProviderNotFound,
    command_metadata,
    open_store,
)
from evstore.events import AllocationsReplaced, decode_event
from evstore.log.sqlite import SCHEMA_VERSION as SQLITE_SCHEMA_VERSION
from evstore.log.sqlite import SqliteBackend
from evstore.store import make_backend
from tests.conftest import allocate, make_provider, new_uuid

FIXTURES = Path(__file__).parent / "fixtures"


def test_errors_have_stable_codes() -> None:
    assert evstore.ConcurrentUpdate.code == "placement.concurrent_update"
    assert evstore.ConsumerDeleted.code == "evstore.consumer.deleted"
    assert evstore.InventoryInUse.code == "placement.inventory.inuse"
    assert evstore.ProviderInUse.code == "placement.resource_provider.inuse"
    assert evstore.DuplicateName.code == "placement.duplicate_name"
    assert issubclass(InvalidInput, ValueError) and issubclass(InvalidInput, EvstoreError)
    codes = {
        cls.code
        for cls in vars(evstore).values()
        if isinstance(cls, type) and issubclass(cls, EvstoreError) and cls is not EvstoreError
    }
    assert all(code.startswith(("placement.", "evstore.")) for code in codes)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_batch": 0}, "max_batch"),  # hung: the writer took empty batches forever
        ({"max_batch": -3}, "max_batch"),
        ({"max_batch": True}, "max_batch"),
        ({"max_batch": 2.5}, "max_batch"),
        ({"poll_interval": 0}, "poll_interval"),
        ({"poll_interval": -1}, "poll_interval"),
        ({"poll_interval": "soon"}, "poll_interval"),
        ({"busy_timeout": -1}, "busy_timeout"),
        ({"busy_timeout": "x"}, "busy_timeout"),
        ({"busy_timeout": float("nan")}, "busy_timeout"),
        ({"foo": 1}, "foo"),
        ({"journal_mode": "DELETE"}, "journal_mode"),
    ],
)
async def test_store_options_are_checked_before_anything_runs(
    tmp_path: Path, options: dict[str, object], field: str
) -> None:
    with pytest.raises(InvalidInput, match=field):
        async with asyncio.timeout(10), open_store(f"sqlite:///{tmp_path}/o.db", **options):
            pass
    assert not (tmp_path / "o.db").exists()
    with pytest.raises(InvalidInput, match="foo"):  # in the URL too
        async with open_store(f"sqlite:///{tmp_path}/o.db?foo=1"):
            pass


@pytest.mark.parametrize(
    ("query", "says"),
    [
        ("create", "create must be true or false, got ''"),
        ("synchronous", "synchronous must be"),
        ("busy_timeout", "busy_timeout must be"),
        ("synchronus", "Unknown SQLite store option"),
        ("busy_timeout=5&foo", "Unknown SQLite store option"),
    ],
)
async def test_a_url_option_without_a_value_is_refused_not_dropped(
    tmp_path: Path, query: str, says: str
) -> None:
    """Regression (helper-56): ``sqlite:///x.db?create`` or a misspelt ``?synchronus`` (no ``=``)
    was dropped without a word and the store opened - and created the file - with the defaults;
    the same key in a PostgreSQL URL is refused."""
    with pytest.raises(InvalidInput, match=says):
        async with open_store(f"sqlite:///{tmp_path}/o.db?{query}"):
            pass
    assert not (tmp_path / "o.db").exists()
    async with open_store(f"sqlite:///{tmp_path}/o.db?&synchronous=NORMAL&") as store:  # (empty parts)
        assert await store.head() == 0


async def test_open_store_is_awaitable_and_a_plain_with_is_a_typed_error(tmp_path: Path) -> None:
    # `store = await open_store(url)` (a newcomer's first guess, as aiosqlite.connect allows) raised
    # a bare TypeError naming contextlib's private class; `with open_store(url)` another one.
    # Awaiting it now opens the store (the caller closes it); a plain `with` says what to do.
    url = f"sqlite:///{tmp_path}/o.db"
    with pytest.raises(InvalidInput, match="async with open_store"), open_store(url):
        pass
    assert not (tmp_path / "o.db").exists()  # nothing was opened
    store = await open_store(url, max_batch=8, snapshot_every=5)
    try:
        assert await store.head() == 0 and store.snapshot_every == 5
        await make_provider(store, VCPU=1)
    finally:
        await store.close()
    with pytest.raises(evstore.StoreClosed):
        await store.head()
    # (not "closed while this subscriber followed it": it never did)
    with pytest.raises(evstore.StoreClosed, match=r"^The store is closed"):
        await anext(store.subscribe())
    with pytest.raises(InvalidInput, match="snapshot_every"):
        await open_store(url, snapshot_every=0)
    async with open_store(url) as store:  # the context manager works as before
        assert await store.head() == 2
    opener = open_store(url)  # and one opener serves one block after another
    for _ in range(2):
        async with opener as store:
            assert await store.head() == 2
            with pytest.raises(InvalidInput, match="in use"):  # not two at once: one would stay open
                async with opener:
                    pass
        with pytest.raises(evstore.StoreClosed):
            await store.head()


async def test_relative_and_absolute_urls_wal_and_durability(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///rel.db") as store:
        await make_provider(store, VCPU=1)
    assert (tmp_path / "rel.db").exists()
    async with open_store(f"sqlite:///{tmp_path}/abs.db") as store:  # tmp_path is absolute: four slashes
        await make_provider(store, VCPU=1)
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        # (2 is FULL, on both connections: a commit is durable when it returns)
        for on in (backend._on_writer, backend._on_reader):
            assert await on(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0]) == 2
    conn = sqlite3.connect(tmp_path / "abs.db")
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    conn.close()
    async with open_store(f"sqlite:///{tmp_path}/n.db?synchronous=NORMAL") as store:
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        assert await backend._on_writer(lambda conn: conn.execute("PRAGMA synchronous").fetchone()[0]) == 1
    with pytest.raises(InvalidInput, match="sets synchronous more than once"):  # (the last one won)
        async with open_store(f"sqlite:///{tmp_path}/n.db?synchronous=FULL&synchronous=OFF"):
            pass
    with pytest.raises(InvalidInput):
        async with open_store("mysql://nope"):
            pass
    with pytest.raises(EvstoreError, match="does not exist"):
        async with open_store(f"sqlite:///{tmp_path}/missing-dir/x.db"):
            pass


async def test_a_path_that_is_not_a_regular_file_is_refused_at_open(tmp_path: Path) -> None:
    """Regression (stop 23, helper-47): a FIFO given as the database (``mkfifo f; evstore audit
    --db f``, or ``open_store("sqlite:///f")``) hung for ever in SQLite's open, waiting for a
    writer to the pipe; a directory was ``evstore.storage`` "unable to open database file" where
    the CLI calls it ``evstore.invalid_input``. Both are refused before SQLite opens anything."""
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    for path, says in ((fifo, "is a FIFO"), (tmp_path, "is a directory")):
        for create in (True, False):
            with pytest.raises(InvalidInput, match=says):
                async with asyncio.timeout(10), open_store(f"sqlite:///{path}", create=create):
                    pass


async def test_uuids_accept_str_or_uuid_and_come_back_lowercase(store: AllocationStore) -> None:
    rp = uuid.uuid4()
    await store.create_provider(rp, "node")
    await store.set_inventories(str(rp).upper(), {"VCPU": Inventory(total=4)}, generation=0)
    c = uuid.uuid4()
    await store.set_allocations(
        c.hex, {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )
    view = await store.allocations(c)
    assert view.allocations == {str(rp): {"VCPU": 1}}
    assert (await store.provider_allocations(rp)) == {str(c): {"VCPU": 1}}
    upper = await store.allocations(str(c).upper())  # (a query normalises as a command does)
    assert (upper.consumer, upper.allocations) == (str(c), {str(rp): {"VCPU": 1}})


async def test_usage_lists_every_inventory_class(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8, MEMORY_MB=1024, DISK_GB=100)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 2}})
    usage = await store.usage(rp)
    assert usage.usages == {"VCPU": 2, "MEMORY_MB": 0, "DISK_GB": 0}
    assert usage.generation == 2
    view = await store.allocations(c)
    assert (view.project_id, view.user_id, view.consumer_type, view.generation, view.deleted) == (
        "project",
        "user",
        "INSTANCE",
        1,
        False,
    )
    absent = await store.allocations(new_uuid())
    assert absent.allocations == {} and absent.generation is None and not absent.deleted
    with pytest.raises(ProviderNotFound):
        await store.usage(new_uuid())


async def test_a_refused_migration_names_the_same_row_whether_the_writer_had_the_instance_cached(
    store_url: str,
) -> None:
    """Regression (s35 acceptance probe, sqlite against PostgreSQL): the rows of start_migration
    came in the order the writer held the instance's allocations - its write's order while the
    SQLite writer had it cached, sorted once loaded - so the refusal named VCPU on a warm SQLite
    writer and MEMORY_MB on PostgreSQL or after a reopen. Both name the first row in the order
    ``allocations()`` shows, and record their events in it."""
    rp, instance, copy = new_uuid(), new_uuid(), new_uuid()
    refusals = []
    async with open_store(store_url) as store:
        await store.create_provider(rp, "rp")
        roomy = {"VCPU": Inventory(total=16), "MEMORY_MB": Inventory(total=2048)}
        await store.set_inventories(rp, roomy, generation=0)
        for consumer in (instance, copy):  # (VCPU first, as a scheduler may write it)
            await allocate(store, consumer, {rp: {"VCPU": 4, "MEMORY_MB": 500}})
        started = await store.start_migration(copy, new_uuid())
        [event] = await store.read(started.position - 1, 1)
        assert list(event.data["allocations"][rp]) == ["MEMORY_MB", "VCPU"]
        tight = {"VCPU": Inventory(total=16, max_unit=2), "MEMORY_MB": Inventory(total=2048, max_unit=100)}
        await store.set_inventories(rp, tight, generation=(await store.provider(rp)).generation)
        with pytest.raises(EvstoreError) as warm:
            await store.start_migration(instance, new_uuid())
        refusals.append(warm.value.details)
    async with open_store(store_url) as store:
        with pytest.raises(EvstoreError) as cold:
            await store.start_migration(instance, new_uuid())
        refusals.append(cold.value.details)
    assert refusals[0] == refusals[1]
    assert refusals[0]["resource_class"] == "MEMORY_MB"


async def test_a_tombstone_and_a_migration_link_holding_nothing_read_back_as_they_are(
    store: AllocationStore,
) -> None:
    """A deleted instance keeps its owner, type and tombstone position (and no generation); the
    link its migration keeps (released by the delete) shows no owner, type or generation - live
    and in time travel. Views compare with any object that says it equals them (as a dict does)."""
    from unittest.mock import ANY

    rp, inst, mig = await make_provider(store, VCPU=8), new_uuid(), new_uuid()
    await allocate(
        store, inst, {rp: {"VCPU": 2}}, project_id="acme", user_id="alice", consumer_type="BAREMETAL"
    )
    await store.start_migration(inst, mig)
    await allocate(
        store, inst, {rp: {"VCPU": 1}}, project_id="acme", user_id="alice", consumer_type="BAREMETAL"
    )
    deleted_at = (await store.delete_consumer(inst)).position
    for view in (store, await store.state_at(deleted_at)):
        tomb, link = await view.allocations(inst), await view.allocations(mig)
        assert (tomb.allocations, tomb.project_id, tomb.user_id, tomb.consumer_type) == (
            {},
            "acme",
            "alice",
            "BAREMETAL",
        )
        assert (tomb.generation, tomb.deleted, tomb.deleted_at) == (None, True, deleted_at)
        assert (link.allocations, link.project_id, link.user_id, link.consumer_type) == ({}, None, None, None)
        assert (link.generation, link.deleted, link.on_behalf_of) == (None, False, inst)
    assert await store.allocations(inst) == ANY and await store.usage(rp) == ANY


async def test_project_usages_by_consumer_type(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=64, DISK_GB=1000)
    await allocate(store, new_uuid(), {rp: {"VCPU": 2, "DISK_GB": 10}}, project_id="acme", user_id="alice")
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}}, project_id="acme", user_id="bob")
    await allocate(
        store, new_uuid(), {rp: {"VCPU": 4}}, project_id="acme", user_id="bob", consumer_type="MIGRATION"
    )
    await allocate(store, new_uuid(), {rp: {"VCPU": 8}}, project_id="other")
    everything = await store.usages("acme")
    assert everything.usages == {"VCPU": 7, "DISK_GB": 10}
    assert everything.consumer_count == 3
    assert everything.by_consumer_type["INSTANCE"] == {"VCPU": 3, "DISK_GB": 10, "consumer_count": 2}
    assert (await store.usages("acme", user_id="bob")).usages == {"VCPU": 5}
    assert (await store.usages("acme", consumer_type="MIGRATION")).usages == {"VCPU": 4}
    assert (await store.usages("nobody")).usages == {}
    # Placement's reserved types (1.38): "all" groups every consumer; "unknown" has none here
    grouped = await store.usages("acme", consumer_type="all")
    assert grouped.usages == everything.usages
    assert grouped.by_consumer_type == {"all": {"VCPU": 7, "DISK_GB": 10, "consumer_count": 3}}
    assert (await store.usages("acme", consumer_type="unknown")).consumer_count == 0
    then = await store.state_at(position=await store.head())
    assert (await then.usages("acme", consumer_type="all")).by_consumer_type == grouped.by_consumer_type
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}}, project_id="acme", consumer_type="UNKNOWN")
    untyped = await store.usages("acme", consumer_type="unknown")  # (what a v1 event upcasts to)
    assert untyped.by_consumer_type == {"unknown": {"VCPU": 1, "consumer_count": 1}}
    # a reserved type keeps the user filter; the arguments are checked as a command's are
    assert (await store.usages("acme", user_id="bob", consumer_type="all")).usages == {"VCPU": 5}
    for bad in ({"project_id": ""}, {"user_id": ""}, {"consumer_type": "not a type"}):
        with pytest.raises(InvalidInput):
            await store.usages(**{"project_id": "acme", **bad})
    with pytest.raises(InvalidInput, match="batch_size"):  # (0 would skip the validating pass)
        await store.import_events(lambda: iter([]), batch_size=0)


async def test_a_command_looks_up_only_its_own_usage_counters_in_the_writers_cache(sqlite_url: str) -> None:
    """The SQLite writer keeps the usage counters of every (project, user) it has read, up to its
    cache's limit (20,000 entities). A command found the few it changes by walking all of them
    (``keys - known.keys()`` iterates the view): ~3 us per command for the 91 users of the
    benchmark, ~1 ms once 20,000 were kept."""
    walks: list[str] = []

    class Watched(dict[Any, Any]):
        def keys(self) -> Any:
            walks.append("keys")
            return super().keys()

        def __iter__(self) -> Any:
            walks.append("iter")
            return super().__iter__()

        def items(self) -> Any:
            walks.append("items")
            return super().items()

        def values(self) -> Any:
            walks.append("values")
            return super().values()

    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=1000)
        users = [f"user-{i}" for i in range(40)]
        for user in users:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}}, project_id="acme", user_id=user)
        cache = store.backend._cache  # type: ignore[attr-defined]
        assert len(cache.usage_counters) == len(users)
        cache.usage_counters = watched = Watched(cache.usage_counters)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}}, project_id="acme", user_id=users[7])
        await allocate(store, new_uuid(), {rp: {"VCPU": 3}}, project_id="acme", user_id="someone-new")
        assert cache.usage_counters is watched  # (the writer went on with the cache it had)
        assert walks == []
        assert len(watched) == len(users) + 1
        assert (await store.usages("acme", user_id=users[7])).usages == {"VCPU": 3}
        assert (await store.usages("acme")).usages == {"VCPU": len(users) + 5}


async def test_idempotent_commands_append_once(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    kwargs = dict(project_id="p", user_id="u", consumer_type="INSTANCE", generation=None)
    first = await store.set_allocations(c, {rp: {"VCPU": 2}}, idempotency_key="req-1", **kwargs)  # type: ignore[arg-type]
    head = await store.head()
    again = await store.set_allocations(c, {rp: {"VCPU": 2}}, idempotency_key="req-1", **kwargs)  # type: ignore[arg-type]
    assert again.positions == first.positions and again.replayed
    assert await store.head() == head
    assert (await store.usage(rp)).usages == {"VCPU": 2}
    with pytest.raises(IdempotencyConflict):
        await store.set_allocations(c, {rp: {"VCPU": 3}}, idempotency_key="req-1", **kwargs)  # type: ignore[arg-type]
    # concurrent repeats of one key: exactly one append
    d = new_uuid()
    results = await asyncio.gather(
        *(store.set_allocations(d, {rp: {"VCPU": 1}}, idempotency_key="req-2", **kwargs) for _ in range(5))  # type: ignore[arg-type]
    )
    assert len({r.positions for r in results}) == 1
    assert await store.head() == head + 1
    # every command takes a key, including deletes
    await store.delete_consumer(d, idempotency_key="req-3")
    h = await store.head()
    await store.delete_consumer(d, idempotency_key="req-3")
    assert await store.head() == h


async def test_a_retried_write_allocations_with_its_consumers_in_another_order_is_the_same_command(
    store: AllocationStore,
) -> None:
    # Placement's POST /allocations body is a JSON object: the order of its consumers means nothing,
    # and a retry that rebuilt the body (from a set, or another JSON parse) listed them in another
    # order. The fingerprint kept that order, so the retry was refused with IdempotencyConflict
    # although the order of providers and classes within a consumer was already ignored.
    rp = await make_provider(store, VCPU=8)
    c1, c2 = new_uuid(), new_uuid()

    def body(amount: int) -> ConsumerAllocations:
        return ConsumerAllocations(
            allocations={rp: {"VCPU": amount}}, project_id="p", user_id="u", consumer_type="INSTANCE"
        )

    first = await store.write_allocations({c1: body(1), c2: body(2)}, idempotency_key="req-w")
    head = await store.head()
    again = await store.write_allocations({c2: body(2), c1: body(1)}, idempotency_key="req-w")
    assert again.replayed and again.positions == first.positions
    assert await store.head() == head
    with pytest.raises(
        IdempotencyConflict
    ):  # the same consumers with their amounts swapped is another command
        await store.write_allocations({c2: body(1), c1: body(2)}, idempotency_key="req-w")


async def test_a_key_an_older_evstore_recorded_for_a_write_allocations_still_replays(
    store: AllocationStore,
) -> None:
    # Before 81f4e10 the fingerprint of write_allocations kept its consumers in the order given;
    # since, it sorts them. A key such a store recorded for consumers not given in uuid order then
    # refused every retry of that very command, the same body in the same order, after the upgrade
    # (IdempotencyConflict, "already used for a different command"), for as long as the key lives.
    rp = await make_provider(store, VCPU=8)
    c1, c2 = sorted([new_uuid(), new_uuid()])
    body = {
        c2: ConsumerAllocations(
            allocations={rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="I"
        ),
        c1: ConsumerAllocations(
            allocations={rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="I"
        ),
    }
    first = await store.write_allocations(body, idempotency_key="req-old")
    # what the older evstore stored for it: the command hashed with its consumers as given (c2, c1)
    given = [
        {"consumer": c, "allocations": {rp: {"VCPU": a}}, "project_id": "p", "user_id": "u"}
        | {"consumer_type": "I", "generation": None}
        for c, a in ((c2, 2), (c1, 1))
    ]
    old = json.dumps(["WriteAllocations", {"consumers": given}], sort_keys=True)
    await store.backend.tamper(  # type: ignore[attr-defined]
        "UPDATE idempotency SET fingerprint = ? WHERE key = ?",
        (hashlib.sha256(old.encode()).hexdigest(), "req-old"),
    )
    head = await store.head()
    again = await store.write_allocations(body, idempotency_key="req-old")
    assert again.replayed and again.positions == first.positions
    assert await store.head() == head
    with pytest.raises(IdempotencyConflict):  # another command under that key is still refused
        await store.write_allocations({c1: body[c2], c2: body[c1]}, idempotency_key="req-old")


async def test_an_idempotency_key_that_is_not_text_is_refused_alone(store: AllocationStore) -> None:
    """A key with a lone surrogate cannot be stored: it used to fail deep in the writer, taking
    every command of its group commit down with it (StorageError)."""
    rp = await make_provider(store, VCPU=8)
    good, bad = new_uuid(), new_uuid()
    outcomes = await asyncio.gather(
        allocate(store, good, {rp: {"VCPU": 1}}),
        store.set_allocations(
            bad,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            idempotency_key="req-\ud800",
        ),
        allocate(store, new_uuid(), {rp: {"VCPU": 1}}),
        return_exceptions=True,
    )
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], InvalidInput) and "idempotency_key" in str(outcomes[1])
    assert "surrogate" in str(outcomes[1])
    assert (await store.allocations(bad)).allocations == {}
    assert (await store.usage(rp)).usages == {"VCPU": 2}
    for key in ("", "k" * 256, 5):
        with pytest.raises(InvalidInput, match=r"idempotency_key must be a string of 1\.\.255 characters"):
            await store.release(good, idempotency_key=key)  # type: ignore[arg-type]


async def test_metadata_per_command_and_from_context(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    with command_metadata(correlation_id="corr-1", actor="nova-scheduler"):
        await store.set_allocations(
            c,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            metadata={"request_id": "req-42", "causation_id": "evt-9"},
        )
    [event] = [e async for e in store.history(c)]
    assert event.metadata.request_id == "req-42"
    assert event.metadata.correlation_id == "corr-1"
    assert event.metadata.causation_id == "evt-9"
    assert event.metadata.actor == "nova-scheduler"
    assert event.type == "AllocationsReplaced" and event.schema_version == 2
    assert event.payload["allocations"] == {rp: {"VCPU": 1}}
    assert event.recorded_at.tzinfo is not None


async def test_multi_consumer_command_appends_several_events_atomically(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=4)
    a, b = new_uuid(), new_uuid()
    ca = ConsumerAllocations(
        allocations={rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE"
    )
    receipt = await store.write_allocations({a: ca, b: ca})
    assert len(receipt.positions) == 2
    head = await store.head()
    c = new_uuid()
    with pytest.raises(evstore.CapacityExceeded):
        await store.write_allocations({a: {**ca.model_dump(), "consumer_generation": 1}, c: ca})
    assert await store.head() == head
    assert (await store.allocations(c)).allocations == {}


async def test_a_subscriber_gets_every_event_before_a_damaged_row_then_the_error(tmp_path: Path) -> None:
    """Regression (helper-28): a damaged row failed the subscriber's whole batch, so `evstore
    tail` showed none of the events before it - the ones a person debugging it wants to see."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=100)
        for _ in range(20):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    with sqlite3.connect(tmp_path / "s.db") as conn:
        conn.execute("UPDATE events SET data = '{' WHERE position = 15")
    conn.close()
    async with open_store(url) as store:
        seen: list[int] = []
        with pytest.raises(evstore.CorruptEvent, match="position 15"):
            async for recorded in store.subscribe(0, batch_size=10):
                seen.append(recorded.position)
        assert seen == list(range(1, 15))
        seen.clear()
        with pytest.raises(evstore.CorruptEvent, match="position 15"):
            async for recorded in store.subscribe(14):
                seen.append(recorded.position)
        assert seen == []


def test_older_event_versions_are_upcast() -> None:
    fixture = json.loads((FIXTURES / "allocations_replaced_v1.json").read_text())
    event = decode_event(fixture["type"], fixture["schema_version"], json.dumps(fixture["data"]), position=3)
    assert isinstance(event, AllocationsReplaced)
    assert event.consumer_type == "UNKNOWN"
    assert event.schema_version == 2
    with pytest.raises(evstore.CorruptEvent, match="position 4"):
        decode_event("AllocationsReplaced", 3, "{}", position=4)
    with pytest.raises(evstore.CorruptEvent, match="Unknown event type"):
        decode_event("Nope", 1, "{}", position=5)


async def test_each_outcome_is_logged_with_context(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=1)
    # the test session filters info logs out (conftest); let them through here
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            await _log_two_outcomes(store, rp)
    finally:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    # evstore binds its logger once per configuration: each change above applied at once, and
    # this command, after capture_logs ended, is not captured
    with pytest.raises(evstore.CapacityExceeded):
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    assert len(logs) == 2
    accepted, rejected = logs
    assert accepted["event"] == "command.accepted" and accepted["position"] == 3
    assert accepted["provider"] == [rp]
    assert rejected["event"] == "command.rejected"
    assert rejected["code"] == "evstore.allocation.capacity_exceeded"
    assert rejected["request_id"] == "req-9"


@pytest.mark.parametrize("wrapper", ["generic", "stdlib", "filtering"])
async def test_a_command_logs_through_any_structlog_wrapper_class(
    store: AllocationStore, wrapper: str
) -> None:
    """Regression (8dd8d17): whether info lines are filtered was asked as
    ``getattr(bound, "is_enabled_for")``; structlog's generic ``BoundLogger`` answers any
    attribute with a method that logs, and the wrapped PrintLogger has no such method: every
    command - committed - then raised AttributeError to its caller, and logged nothing."""
    out = io.StringIO()
    saved = structlog.get_config()
    handler = logging.StreamHandler(out)
    stdlib_logger = logging.getLogger("evstore")
    level = stdlib_logger.level
    if wrapper == "generic":
        structlog.configure(
            wrapper_class=structlog.BoundLogger, logger_factory=structlog.PrintLoggerFactory(out)
        )
    elif wrapper == "stdlib":
        stdlib_logger.addHandler(handler)
        stdlib_logger.setLevel(logging.INFO)
        structlog.configure(
            wrapper_class=structlog.stdlib.BoundLogger,
            logger_factory=structlog.stdlib.LoggerFactory(),
            processors=[structlog.processors.KeyValueRenderer()],
        )
    else:
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
            logger_factory=structlog.PrintLoggerFactory(out),
        )
    try:
        rp = await make_provider(store, VCPU=1)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    finally:
        structlog.configure(**saved)
        stdlib_logger.removeHandler(handler)
        stdlib_logger.setLevel(level)
    assert (await store.usage(rp))["VCPU"] == 1
    assert out.getvalue().count("command.accepted") == 3, out.getvalue()


async def test_rejections_before_the_queue_are_logged_too(store: AllocationStore) -> None:
    """helper-37: a command refused while its arguments were checked (a zero amount, metadata
    that is not JSON, a malformed uuid) logged nothing, although every command logs its outcome;
    an accepted migration or delete logged provider=None though it changed providers' usage."""
    rp = await make_provider(store, VCPU=4)
    instance, migration, fresh = new_uuid(), new_uuid(), new_uuid()
    await allocate(store, instance, {rp: {"VCPU": 1}})
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            with pytest.raises(InvalidInput):
                await store.set_allocations(
                    fresh,
                    {rp: {"VCPU": 0}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                    metadata={"request_id": "req-amount"},
                )
            with pytest.raises(InvalidInput):
                await store.release(instance, metadata={"request_id": "req-meta", "x": float("nan")})
            with command_metadata(request_id="req-uuid"), pytest.raises(InvalidInput):
                await store.delete_consumer("not-a-uuid")
            with pytest.raises(InvalidInput):
                await store.set_inventory(
                    provider="rp-1", resource_class="VCPU", inventory=Inventory(total=1), generation=0
                )
            with pytest.raises(InvalidInput):
                await store.start_migration(instance, "m-1")
            await store.start_migration(instance, migration, metadata={"request_id": "req-ok"})
    finally:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    assert [(e["event"], e["command"], e.get("code"), e.get("request_id")) for e in logs] == [
        ("command.rejected", "WriteAllocations", "evstore.invalid_input", "req-amount"),
        ("command.rejected", "Release", "evstore.invalid_input", "req-meta"),
        ("command.rejected", "DeleteConsumer", "evstore.invalid_input", "req-uuid"),
        ("command.rejected", "SetInventory", "evstore.invalid_input", None),
        ("command.rejected", "StartMigration", "evstore.invalid_input", None),
        ("command.accepted", "StartMigration", None, "req-ok"),
    ]
    assert logs[-1]["provider"] == [rp]
    # a refused command's line names the consumer or provider its arguments gave, as given (the
    # line of an accepted or decided command names them as the writer saw them)
    assert [(e.get("consumer"), e.get("provider")) for e in logs[:5]] == [
        ([fresh], None),
        ([instance], None),
        (["not-a-uuid"], None),
        (None, ["rp-1"]),
        ([instance, "m-1"], None),
    ]


async def test_a_rejection_log_line_cannot_replace_the_rejection(store: AllocationStore) -> None:
    """Review of rev22: the rejection log's entity names were guarded against a caller's odd
    arguments, but the request id it reads from ``metadata`` was not - a metadata object whose
    ``request_id`` (or a mapping whose ``get``) raises turned the command's InvalidInput into that
    exception, raised from the logging."""
    from collections.abc import Iterator, Mapping

    class OddMapping(Mapping[str, Any]):
        def __getitem__(self, key: str) -> Any:
            return {"actor": "a"}[key]

        def __iter__(self) -> Iterator[str]:
            return iter(["actor"])

        def __len__(self) -> int:
            return 1

        def get(self, key: str, default: Any = None) -> Any:
            raise RuntimeError("odd mapping")

    class OddObject:
        @property
        def request_id(self) -> str:
            raise ValueError("odd object")

    with pytest.raises(InvalidInput, match="consumer uuid"):
        await store.release("not-a-uuid", metadata=OddMapping())
    with pytest.raises(InvalidInput, match="metadata must be"):
        await store.release(new_uuid(), metadata=OddObject())  # type: ignore[arg-type]


async def test_a_refused_request_id_not_text_cannot_replace_the_rejection(store: AllocationStore) -> None:
    """Probe of stop 32: metadata whose ``request_id`` is a lone surrogate is refused (the log
    could not store it), but the rejection's log line carried that request id as it was, and
    structlog's default renderer printing it to a UTF-8 stream - stdout, unconfigured - raised
    UnicodeEncodeError from the logging instead of the command's InvalidInput. The line carries it
    escaped, and a value that is not text as its repr (an object whose repr raises as its type)."""

    class NoRepr:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # (strict, as stdout is)
    saved = structlog.get_config()
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(out),
        processors=[structlog.dev.ConsoleRenderer(colors=False)],
    )
    try:
        with pytest.raises(InvalidInput, match=r"valid Unicode text \(no lone surrogates\)"):
            await store.release(new_uuid(), metadata={"request_id": "req-\ud800"})
        with pytest.raises(InvalidInput, match="JSON-serialisable"):
            await store.release(new_uuid(), metadata={"request_id": NoRepr()})
    finally:
        structlog.configure(**saved)
    out.seek(0)
    lines = out.buffer.getvalue().decode().splitlines()  # type: ignore[attr-defined]
    assert len(lines) == 2 and all("command.rejected" in line for line in lines), lines
    assert "request_id=req-\\ud800" in lines[0] and "request_id=NoRepr" in lines[1], lines


async def _log_two_outcomes(store: AllocationStore, rp: str) -> None:
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    with pytest.raises(evstore.CapacityExceeded):
        await store.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            metadata={"request_id": "req-9"},
        )


async def test_subscribe_catches_up_then_follows(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    seen: list[int] = []

    async def follow() -> None:
        async for e in store.subscribe(after=0):
            seen.append(e.position)
            if len(seen) == 5:
                return

    task = asyncio.create_task(follow())
    for _ in range(3):
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    await asyncio.wait_for(task, 5)
    assert seen == [1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "call",
    [
        lambda s, rp: s.create_provider("not-a-uuid", "x"),
        lambda s, rp: s.create_provider(new_uuid(), ""),
        lambda s, rp: s.create_provider(new_uuid(), "x" * 201),
        lambda s, rp: s.create_provider(new_uuid(), "caf\u00e9 \ud800"),  # a lone surrogate
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1}},
            project_id="p\udfff",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_inventories(rp, {"vcpu": Inventory(total=1)}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 0}}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4, "reserved": 5}}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4, "allocation_ratio": float("inf")}}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4}}, 2**64),  # past 64 bits
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4}}, "1"),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 0}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": -3}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 2**63}},  # (up to 2**63-1 Placement's row checks refuse it: ConstraintViolation)
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {"zzz": {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1}},
            project_id="",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="instance",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1.5}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.set_allocations(
            new_uuid(),
            {rp: {"CUSTOM_NOPE": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        ),
        lambda s, rp: s.write_allocations({}),
        lambda s, rp: s.write_allocations({new_uuid(): {"allocations": {}}}),
        # (each was accepted by a mutant of evstore.schema no other case here caught)
        lambda s, rp: _put(s, {rp: {"VCPU": True}}),  # a bool is not an amount
        lambda s, rp: _put(s, {rp: {}}),  # a provider named with no class
        lambda s, rp: s.create_resource_class("CUSTOM_" + "A" * 249),  # a name of 256 characters
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4, "reserved": -1}}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4, "step_size": 0}}, 1),
        lambda s, rp: s.set_inventories(rp, {"VCPU": {"total": 4, "allocation_ratio": True}}, 1),
        lambda s, rp: s.release(12),
        lambda s, rp: s.state_at(),
        lambda s, rp: s.read(after=-1),
    ],
)
async def test_bad_input_is_a_typed_error_that_leaves_no_trace(store: AllocationStore, call: object) -> None:
    rp = await make_provider(store, VCPU=8)
    head = await store.head()
    with pytest.raises(InvalidInput) as info:
        await call(store, rp)  # type: ignore[operator]
    assert info.value.code.startswith("evstore.")
    assert info.value.message
    assert await store.head() == head


def _put(s: AllocationStore, allocations: object, **overrides: object) -> Any:
    fields: dict[str, Any] = {
        "project_id": "p",
        "user_id": "u",
        "consumer_type": "INSTANCE",
        "generation": None,
    }
    return s.set_allocations(new_uuid(), allocations, **{**fields, **overrides})  # type: ignore[arg-type]


def _post(s: AllocationStore, entry: object) -> Any:
    return s.write_allocations({new_uuid(): entry})  # type: ignore[dict-item]


_ENTRY = {"allocations": {}, "project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}

#: input a review found accepted, or failing untyped (each fails before its fix)
SLIPPED_THROUGH: dict[str, Callable[[AllocationStore, str], Awaitable[object]]] = {
    # an accepted one wrote an event nothing could decode again: reads, time travel, rebuild broken for good
    "Inventory changed by model_copy": lambda s, rp: s.set_inventories(
        rp, {"VCPU": Inventory(total=8).model_copy(update={"total": 0})}, generation=1
    ),
    "Inventory.model_construct": lambda s, rp: s.set_inventories(
        rp, {"VCPU": Inventory.model_construct(total=-1)}, generation=1
    ),
    "ConsumerAllocations changed by model_copy": lambda s, rp: _post(
        s,
        ConsumerAllocations(allocations={rp: {"VCPU": 1}}, project_id="p", user_id="u").model_copy(
            update={"allocations": {rp: {"VCPU": 0}}, "consumer_type": "instance", "project_id": ""}
        ),
    ),
    "a class name ending in a newline": lambda s, rp: s.create_resource_class("CUSTOM_X\n"),
    "a consumer type ending in a newline": lambda s, rp: _put(
        s, {rp: {"VCPU": 1}}, consumer_type="INSTANCE\n"
    ),
    "one provider spelled twice": lambda s, rp: _put(s, {rp: {"VCPU": 1}, rp.upper(): {"VCPU": 2}}),
    "a ratio too large for a float": lambda s, rp: s.set_inventory(
        rp, "VCPU", {"total": 4, "allocation_ratio": 10**400}, generation=1
    ),
    "an inventory field that is not a string": lambda s, rp: s.set_inventory(
        rp, "VCPU", {"total": 4, 1: 2}, generation=1
    ),
    "NUL in a provider name": lambda s, rp: s.create_provider(new_uuid(), "node\x00"),
    "NUL in a project id": lambda s, rp: _put(s, {rp: {"VCPU": 1}}, project_id="p\x00"),
    "a truncated uuid after a space": lambda s, rp: s.release(" " + "1" * 31),
    "a uuid with other dashes": lambda s, rp: s.release(
        "1-2-3-4-5-6-7-8-9-0-1-2-3-4-5-6-7-8-9-0-1-2-3-4-5-6-7-8-9-0-1-2"
    ),
    "a uuid with a sign": lambda s, rp: s.release("+" + "0" * 31),
    "bytes as a project id (POST)": lambda s, rp: _post(s, {**_ENTRY, "project_id": b"p"}),
    "bytes as a consumer type (POST)": lambda s, rp: _post(
        s, {**_ENTRY, "allocations": {rp: {"VCPU": 1}}, "consumer_type": b"INSTANCE"}
    ),
    "a bytearray as a consumer type (POST)": lambda s, rp: _post(
        s, {**_ENTRY, "allocations": {rp: {"VCPU": 1}}, "consumer_type": bytearray(b"PONY")}
    ),
    "a generation past 2**62 (POST)": lambda s, rp: _post(s, {**_ENTRY, "consumer_generation": 2**64}),
    "metadata keys that are not strings": lambda s, rp: s.create_provider(
        new_uuid(),
        "n",
        metadata={("a",): 1},  # type: ignore[dict-item]
    ),
    "metadata nested too deep": lambda s, rp: s.create_provider(new_uuid(), "n", metadata={"x": _deep(1000)}),
    "an inventory field named self": lambda s, rp: s.set_inventory(
        rp, "VCPU", {"total": 4, "self": 1}, generation=1
    ),
    "an allocations entry field named self (POST)": lambda s, rp: _post(s, {**_ENTRY, "self": 1}),
    "import of a list instead of a callable": lambda s, rp: s.import_events(["{}"]),  # type: ignore[arg-type]
}


def _deep(n: int) -> object:
    value: object = []
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize("case", sorted(SLIPPED_THROUGH))
async def test_input_that_slipped_through_is_refused_with_no_trace(store: AllocationStore, case: str) -> None:
    rp = await make_provider(store, VCPU=8)  # (generation 1)
    head = await store.head()
    usage = await store.usage(rp)
    with pytest.raises(InvalidInput) as info:
        await SLIPPED_THROUGH[case](store, rp)
    assert info.value.code.startswith("evstore.") and info.value.message
    assert await store.head() == head
    assert await store.usage(rp) == usage
    assert (await store.audit()).clean


async def test_the_largest_amount_and_inventory_are_accepted(store: AllocationStore) -> None:
    most = 2**31 - 1  # (Placement's limit: an amount or inventory field above it is refused)
    rp = await make_provider(store, VCPU=Inventory(total=most, max_unit=most))
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": most}})
    assert (await store.usage(rp))["VCPU"] == most
    assert (await store.allocations(c)).allocations == {rp: {"VCPU": most}}


async def test_release_of_nothing_is_not_found(store: AllocationStore) -> None:
    with pytest.raises(NotFound):
        await store.release(new_uuid())


async def test_future_database_schema_is_refused(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url):
        pass
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    conn.commit()
    conn.close()
    with pytest.raises(evstore.SchemaVersionError, match="schema version 99"):
        async with open_store(url):
            pass


@pytest.mark.parametrize("version", ["0", "-1"])
async def test_a_schema_version_below_one_is_refused_not_upgraded(tmp_path: Path, version: str) -> None:
    """Regression (helper-28): versions 0 and -1 were taken for old ones and rewritten to the
    current version by any command that opened the file, a read-only audit included."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url):
        pass
    with sqlite3.connect(tmp_path / "s.db") as conn:
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (version,))
    conn.close()
    with pytest.raises(evstore.SchemaVersionError, match=f"schema version is {version}: evstore numbers"):
        async with open_store(url):
            pass
    with sqlite3.connect(tmp_path / "s.db") as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == (version,)
    conn.close()


async def test_closed_store_refuses_commands(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/c.db") as store:
        pass
    with pytest.raises(evstore.StoreClosed):
        await store.create_provider(new_uuid(), "late")
    assert os.path.exists(tmp_path / "c.db")


async def test_a_closed_store_is_not_reopened_and_an_open_one_opens_once(store_url: str) -> None:
    """helper-37: open() after close() opened new connections for a store that refused every
    command (and that close() never closed again); a second open() leaked a connection."""
    store = AllocationStore(make_backend(store_url))
    assert await store.open() is store
    writer = store._writer
    assert await store.open() is store and store._writer is writer  # (nothing opened twice)
    await store.create_provider(new_uuid(), "once")
    await store.close()
    with pytest.raises(evstore.StoreClosed, match="cannot be reopened"):
        await store.open()
    with pytest.raises(evstore.StoreClosed):
        await store.head()


def test_a_store_refuses_calls_from_another_event_loop(tmp_path: Path) -> None:
    """helper-37: a command awaited from a second event loop was committed and its caller never
    answered (SQLite), or failed with a bare RuntimeError (PostgreSQL). Now a typed error, before
    anything is written, and the store goes on working on its own loop."""
    url = f"sqlite:///{tmp_path}/loops.db"
    opened: dict[str, AllocationStore] = {}
    ready, done = threading.Event(), threading.Event()

    async def owner() -> int:
        async with open_store(url) as store:
            opened["store"] = store
            ready.set()
            while not done.is_set():
                await asyncio.sleep(0.01)
            await store.create_provider(new_uuid(), "from-the-owner")
            return await store.head()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        head = pool.submit(asyncio.run, owner())
        assert ready.wait(10)
        store = opened["store"]

        async def elsewhere() -> list[str]:
            codes = []
            for call in (
                lambda: store.create_provider(new_uuid(), "from-another-loop"),
                lambda: store.head(),
                lambda: store.usage(new_uuid()),
                lambda: store.close(),
            ):
                with pytest.raises(evstore.WrongEventLoop) as info:
                    await asyncio.wait_for(call(), 5)
                codes.append(info.value.code)
            return codes

        try:
            assert asyncio.run(elsewhere()) == ["evstore.store.wrong_loop"] * 4
        finally:
            done.set()
        assert head.result(10) == 1, "only the owner's command was written"


async def test_a_file_that_is_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(evstore.StorageError, match="Cannot open"):
        async with open_store(f"sqlite:///{tmp_path}/junk.db"):
            pass


def test_the_value_models_refuse_bad_values_with_typed_errors() -> None:
    with pytest.raises(InvalidInput) as info:
        Inventory(total=0)
    assert isinstance(info.value, evstore.InvalidInventory) and isinstance(info.value, ValueError)
    with pytest.raises(InvalidInput, match="project_id"):
        ConsumerAllocations(allocations={}, project_id="", user_id="u", consumer_type="INSTANCE")
    with pytest.raises(InvalidInput, match="Malformed"):
        ConsumerAllocations(
            allocations={"nope": {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE"
        )
    ca = ConsumerAllocations(
        allocations={}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=3
    )
    assert ca.consumer_generation == 3
    # (helper-72: both spellings at once were "generation: Extra inputs are not permitted")
    with pytest.raises(InvalidInput, match="consumer_generation or its alias generation, not both"):
        ConsumerAllocations(
            allocations={},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            consumer_generation=1,
            generation=2,
        )
    for wrong in (True, "2", 3.0, 2**64):  # were coerced to 1, 2 and 3 past the generation check
        with pytest.raises(InvalidInput, match="generation: Input should be"):
            ConsumerAllocations(
                allocations={}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=wrong
            )


async def test_write_allocations_refuses_what_set_allocations_refuses_as_a_generation(
    store: AllocationStore,
) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})  # generation 1
    head = await store.head()
    body = {"allocations": {rp: {"VCPU": 2}}, "project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
    for wrong in (True, "1", 1.0):
        with pytest.raises(InvalidInput) as caught:
            await store.set_allocations(
                c, {rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=wrong
            )  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match=f"consumer {c}: consumer_generation") as caught:
            await store.write_allocations({c: {**body, "consumer_generation": wrong}})
        assert "Value error" not in caught.value.message
    assert await store.head() == head


async def test_metadata_readers_could_not_decode_is_refused_and_nothing_is_written(
    store: AllocationStore,
) -> None:
    head = await store.head()
    for bad in ({"request_id": 5}, {"actor": ["a"]}, {"correlation_id": {"x": 1}}, {"request_id": "\ud800"}):
        with pytest.raises(InvalidInput, match="metadata is not valid") as info:
            await store.create_provider(new_uuid(), "node", metadata=bad)
        assert info.value.code == "evstore.invalid_input"
        if bad != {"request_id": "\ud800"}:
            assert next(iter(bad)) in info.value.message
    assert await store.head() == head
    for bad in ({"score": float("nan")}, {"limit": float("inf")}, {"x": [float("-inf")]}):
        # were stored as NaN / Infinity: not JSON, unreadable by a strict parser, forever in the log
        with pytest.raises(InvalidInput, match="NaN and Infinity"):
            await store.create_provider(new_uuid(), "node", metadata=bad)
    assert await store.head() == head
    rp = new_uuid()
    await store.create_provider(rp, "node", metadata={"request_id": "req-1", "extra": [1, 2]})
    [event] = [e async for e in store.history(rp)]
    assert event.metadata.request_id == "req-1"


async def test_a_value_out_of_range_is_refused_naming_the_range(store: AllocationStore) -> None:
    """Regression (helper-r25b): a consumer type of 256 capitals was refused as 'consumer_type
    must match ^[A-Z0-9_]+$' (it does: its length is what is wrong), and a generation above 2**62
    as 'must be a non-negative integer' (it is one): messages a person cannot act on."""
    rp = await make_provider(store, VCPU=8)
    head = await store.head()
    with pytest.raises(InvalidInput, match="at most 255 characters"):
        await _put(store, {rp: {"VCPU": 1}}, consumer_type="A" * 256)
    with pytest.raises(InvalidInput, match="at most 255 characters"):
        await store.usages("p", consumer_type="A" * 256)
    with pytest.raises(InvalidInput, match=r"from -2\*\*63 to 2\*\*63 or None, got 18446744073709551616"):
        await _put(store, {rp: {"VCPU": 1}}, generation=2**64)
    with pytest.raises(InvalidInput, match=r"from -2\*\*63 to 2\*\*63, got an integer past 64 bits"):
        await store.set_inventories(rp, {"VCPU": Inventory(total=8)}, generation=10**400)
    assert await store.head() == head


async def test_metadata_nested_too_deeply_is_refused_saying_so(store: AllocationStore) -> None:
    """Regression (helper-r25b): metadata nested 200 levels or more - which the log's readers
    cannot decode - was refused as 'a value is not valid unicode text (Invalid JSON: recursion
    limit exceeded ...)', and past Python's recursion limit as 'must be JSON-serialisable': a
    person looks for a bad character or type that is not there."""

    def nested(depth: int, kind: type) -> object:
        value: object = "leaf"
        for _ in range(depth):
            value = {"n": value} if kind is dict else [value]
        return value

    head = await store.head()
    for depth, kind in ((254, dict), (254, list), (5000, dict), (5000, list)):
        with pytest.raises(InvalidInput, match="nested too deeply") as caught:
            await store.create_provider(new_uuid(), "node", metadata={"x": nested(depth, kind)})
        assert "unicode" not in caught.value.message
    assert await store.head() == head
    rp = new_uuid()
    await store.create_provider(rp, "node", metadata={"x": nested(100, dict)})  # (deep, but readable)
    [event] = [e async for e in store.history(rp)]
    assert event.metadata.model_extra is not None and "x" in event.metadata.model_extra


async def test_set_inventory_on_a_provider_that_has_a_custom_class(store: AllocationStore) -> None:
    """Updating one class checked every class the provider holds against the custom classes the
    slice loaded - only the one named - so any provider with a CUSTOM_ inventory refused it."""
    await store.create_resource_class("CUSTOM_GPU")
    rp = new_uuid()
    await store.create_provider(rp, "gpu-node")
    gen = await store.set_inventories(
        rp, {"VCPU": Inventory(total=8), "CUSTOM_GPU": Inventory(total=2)}, generation=0
    )
    gen = await store.set_inventory(rp, "VCPU", Inventory(total=16), generation=gen)
    assert gen == 2
    gen = await store.set_inventory(rp, "MEMORY_MB", {"total": 4096}, generation=gen)
    gen = await store.delete_inventory(rp, "MEMORY_MB")
    assert (await store.usage(rp)).usages == {"VCPU": 0, "CUSTOM_GPU": 0}
    with pytest.raises(evstore.UnknownResourceClass):  # the class being set is still checked
        await store.set_inventory(rp, "CUSTOM_NOPE", Inventory(total=1), generation=gen)
    assert (await store.audit()).clean


async def test_consumers_holding_a_custom_class_can_be_emptied_moved_and_reverted(
    store: AllocationStore,
) -> None:
    """The slice a command loads listed only the custom classes the command names; emptying,
    migrating or reverting a consumer names none (its rows come from what it holds), so every
    baremetal instance (CUSTOM_BAREMETAL_*) was stuck: UnknownResourceClass."""
    gold = "CUSTOM_BAREMETAL_GOLD"
    await store.create_resource_class(gold)
    rp = new_uuid()
    await store.create_provider(rp, "ironic-1")
    await store.set_inventories(rp, {gold: Inventory(total=3, max_unit=1)}, generation=0)
    a, b, migration = new_uuid(), new_uuid(), new_uuid()
    labels = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
    for c in (a, b):
        await store.set_allocations(c, {rp: {gold: 1}}, generation=None, **labels)
    await store.set_allocations(a, {}, generation=1, **labels)  # Placement's PUT {}
    assert (await store.allocations(a)).allocations == {}
    await store.start_migration(b, migration)
    assert (await store.allocations(migration)).allocations == {rp: {gold: 1}}
    await store.revert_migration(migration)
    assert (await store.allocations(b)).allocations == {rp: {gold: 1}}
    await store.start_migration(b, migration)
    await store.delete_consumer(b)
    assert (await store.usage(rp)).usages == {gold: 0}
    assert (await store.audit()).clean


async def test_another_applications_database_is_refused_and_left_alone(tmp_path: Path) -> None:
    """Regression: a database with its own ``events`` or ``meta`` table got evstore's tables added
    (and then failed on every call with 'no such column'); a textual schema version raised a
    bare ValueError."""
    foreign = (
        ("events", "CREATE TABLE events (id INTEGER, what TEXT)"),
        ("meta", "CREATE TABLE meta (k, v)"),
        ("meta", "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)"),  # (Chromium's History)
    )
    for name, ddl in foreign:
        path = tmp_path / f"{name}.db"
        with sqlite3.connect(path) as conn:
            conn.execute(ddl)
        with sqlite3.connect(path) as conn:
            before = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
        with pytest.raises(evstore.StorageError, match="Not an evstore database"):
            async with open_store(f"sqlite:///{path}"):
                pass
        with pytest.raises(NotFound):
            async with open_store(f"sqlite:///{path}", create=False):
                pass
        with sqlite3.connect(path) as conn:
            assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == before
        path.unlink()
    path = tmp_path / "odd-version.db"
    async with open_store(f"sqlite:///{path}"):
        pass
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE meta SET value = '1.1' WHERE key = 'schema_version'")
    with pytest.raises(evstore.SchemaVersionError, match="not a number"):
        async with open_store(f"sqlite:///{path}"):
            pass


async def test_opening_a_store_takes_no_write_lock(tmp_path: Path) -> None:
    """Regression: every open ran the DDL in a write transaction, so while another process held
    one (a long rebuild or import) even a read-only open waited busy_timeout and failed."""
    path = tmp_path / "store.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=8)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        async with open_store(f"sqlite:///{path}", busy_timeout=0.2, create=False) as store:
            assert await store.head() == 2
        other.execute("ROLLBACK")
    finally:
        other.close()


async def test_creating_a_store_in_a_file_held_locked_says_busy_timeout(tmp_path: Path) -> None:
    """Regression (helper-66): a new store's first open, with another connection holding the
    file's lock past busy_timeout, failed as a bare "Cannot open ...: database is locked", where a
    command in the same situation names busy_timeout and what to change."""
    path = tmp_path / "store.db"
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")
        with pytest.raises(evstore.StorageError, match=r"longer than busy_timeout \(0\.2 s\)"):
            async with open_store(f"sqlite:///{path}", busy_timeout=0.2):
                pass
        other.execute("ROLLBACK")
    finally:
        other.close()
    async with open_store(f"sqlite:///{path}") as store:  # (the lock released: it opens)
        assert await store.head() == 0


async def test_a_command_waits_busy_timeout_for_a_held_write_lock_not_five_times_it(tmp_path: Path) -> None:
    """Regression: a command retried its whole transaction five times when another connection
    held the write lock, each attempt waiting busy_timeout in SQLite itself: busy_timeout=1 failed
    after 5.5 s, and the default 30 s after about 150 s. The wait now ends at busy_timeout (the
    retries only cover a busy answer that came back sooner), with a typed error that says so."""
    path = tmp_path / "store.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=8)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        async with open_store(f"sqlite:///{path}", busy_timeout=1) as store:
            started = time.monotonic()
            with pytest.raises(evstore.StorageError, match="locked") as caught:
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
            waited = time.monotonic() - started
            assert caught.value.code == "evstore.storage" and caught.value.details["sqlite_error"] == "busy"
            assert 0.9 < waited < 4.0, waited  # (five waits took 5.5 s; slack for a loaded machine)
            assert "longer than busy_timeout (1 s)" in caught.value.message
            other.execute("ROLLBACK")
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # the lock released: it goes through
            assert await store.head() == 3
            assert (await store.audit()).clean
    finally:
        other.close()


async def test_open_with_create_false_refuses_a_database_without_a_store(tmp_path: Path) -> None:
    blank = tmp_path / "blank.db"
    blank.write_bytes(b"")
    with pytest.raises(NotFound, match="no evstore tables"):
        async with open_store(f"sqlite:///{blank}", create=False):
            pass
    assert blank.read_bytes() == b""
    with pytest.raises(InvalidInput, match="create must be"):
        async with open_store(f"sqlite:///{blank}", create="maybe"):
            pass
    async with open_store(f"sqlite:///{blank}") as store:  # the default creates it
        await store.create_provider(new_uuid(), "node")
    async with open_store(f"sqlite:///{blank}", create=False) as store:
        assert await store.head() == 1


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///{tmp}/a\x00b.db",  # was a bare ValueError (embedded null byte) from os.stat
        "postgresql://u@127.0.0.1:1/x\x00",  # was evstore.storage: cannot connect
        "postgresql://u@127.0.0.1:1/x?search_path=a%00b",
        "postgresql://u:se\x00cret@127.0.0.1:1/x",
    ],
)
async def test_a_nul_in_the_store_url_is_invalid_input_on_every_backend(tmp_path: Path, url: str) -> None:
    """Regression (helper-r25b): a NUL in the URL - which no file name and no PostgreSQL
    connection can hold - was a bare ValueError on SQLite and a storage error (the server
    refusing the startup packet) on PostgreSQL, for what is the caller's input."""
    with pytest.raises(InvalidInput, match="contains a NUL character") as caught:
        async with asyncio.timeout(10), open_store(url.format(tmp=tmp_path)):
            pass
    assert "secret" not in caught.value.message and "cret" not in caught.value.message
    async with open_store(f"sqlite:///{tmp_path}/a%00b.db") as store:  # (SQLite: a literal name)
        assert await store.head() == 0
    assert (tmp_path / "a%00b.db").exists()


@pytest.mark.parametrize(
    ("query", "keyword", "says"),
    [
        ("create=maybe", {"create": False}, "create must be true or false, got 'maybe'"),
        ("busy_timeout=soon", {"busy_timeout": 5}, "busy_timeout must be a number of seconds"),
        # (a number out of range too: checked only after the keyword had replaced it)
        ("busy_timeout=-1", {"busy_timeout": 5}, "busy_timeout must be a number of seconds"),
        ("busy_timeout=nan", {"busy_timeout": 5}, "busy_timeout must be a number of seconds"),
        ("synchronous=fast", {"synchronous": "FULL"}, "synchronous must be OFF, NORMAL, FULL or EXTRA"),
    ],
)
async def test_a_url_option_a_keyword_overrides_is_still_checked(
    tmp_path: Path, query: str, keyword: dict[str, Any], says: str
) -> None:
    """Regression (review 32, helper-112): SQLite merged the keywords over the URL's ``?k=v``
    before checking them, so ``evstore audit --url 'sqlite:///x.db?create=maybe'`` (the CLI
    passes ``create=False``) opened the store, where PostgreSQL refuses the URL's value."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url) as store:
        await store.create_provider(new_uuid(), "node")
    with pytest.raises(InvalidInput, match=says) as refused:
        async with open_store(f"{url}?{query}", **keyword):
            pass
    assert refused.value.details.get("field") == query.split("=")[0]
    async with open_store(url, **keyword) as store:  # (the keyword alone is fine)
        assert await store.head() == 1


@pytest.mark.parametrize("create", ["false", "true", 0, 1, None])
async def test_a_create_keyword_that_is_not_a_bool_is_refused_on_every_backend(
    store_url: str, create: object
) -> None:
    """Regression (helper-r25b): the SQLite backend turned its keywords into text before parsing
    them as URL text, so ``open_store(url, create="false")`` (or ``0``, ``1``) opened a SQLite
    store - ``"false"`` refusing to create it - where PostgreSQL refuses the same keyword as
    ``create must be true or false``; ``create=None`` was reported as ``got 'none'``."""
    with pytest.raises(InvalidInput, match="create must be") as caught:
        async with open_store(store_url, create=create):
            pass
    assert repr(create) in caught.value.message


@pytest.mark.parametrize(
    ("option", "says"),
    [({"busy_timeout": "30"}, "busy_timeout must be a number"), ({"synchronous": 2}, "got 2$")],
)
async def test_sqlite_keywords_are_typed_as_postgresqls_are(
    sqlite_url: str, option: dict[str, object], says: str
) -> None:
    """Regression (helper-r25b): ``busy_timeout="30"`` opened a store, where PostgreSQL's
    ``command_timeout="30"`` and every store's ``poll_interval="0.2"`` are refused: only the
    URL's ``?k=v`` are text."""
    with pytest.raises(InvalidInput, match=says):
        async with open_store(sqlite_url, **option):
            pass
    async with open_store(sqlite_url, busy_timeout=2, synchronous="normal", create=True) as store:
        assert await store.head() == 0


async def test_events_carry_well_formed_ids_and_the_command_that_wrote_them(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    events = await store.read()
    command_ids = [e.metadata.command_id for e in events]
    for e in events:
        assert str(uuid.UUID(e.event_id)) == e.event_id  # canonical text
        assert e.metadata.command_id is not None
        cid = uuid.UUID(hex=e.metadata.command_id)
        assert cid.hex == e.metadata.command_id and cid.version == 4 and cid.variant == uuid.RFC_4122
    assert len(set(command_ids)) == len(events)  # one event per command here, each its own id
    if store.backend.url.startswith("sqlite"):  # SQLite's ids are time-ordered (version 7)
        assert all(uuid.UUID(e.event_id).version == 7 for e in events)
        assert [e.event_id[:13] for e in events] == sorted(e.event_id[:13] for e in events)


async def test_evstores_own_metadata_keys_replace_a_callers(store: AllocationStore) -> None:
    rp = new_uuid()
    claimed = {"command": "Forged", "command_id": "not-an-id", "idempotency_key": "never-used", "actor": "a"}
    with command_metadata(command=5):
        await store.create_provider(rp, "node", metadata=claimed)
        await store.rename_provider(rp, "node-2", idempotency_key="k-1", metadata=claimed)
    created, renamed = [e async for e in store.history(rp)]
    for event in (created, renamed):
        assert event.metadata.actor == "a"
        assert event.metadata.command in ("CreateProvider", "RenameProvider")
        assert event.metadata.command_id is not None and len(event.metadata.command_id) == 32
    assert created.metadata.command == "CreateProvider"
    assert "idempotency_key" not in created.metadata.model_dump(exclude_none=True)
    assert renamed.metadata.model_dump()["idempotency_key"] == "k-1"


async def test_command_metadata_is_checked_where_it_is_given(store: AllocationStore) -> None:
    """helper-45: command_metadata(request_id=5) was accepted, and every command inside it then
    failed with InvalidInput that did not name command_metadata; refused at once now."""
    with pytest.raises(InvalidInput, match="request_id"), command_metadata(request_id=5):
        pass
    with pytest.raises(InvalidInput), command_metadata(actor="a", x=float("nan")):
        pass
    with command_metadata(request_id="req-1"):
        with pytest.raises(InvalidInput), command_metadata(correlation_id=["not", "text"]):
            pass
        await store.create_provider(new_uuid(), "node")  # the outer context still applies, unharmed
    [event] = await store.read(0, 1)
    assert event.metadata.request_id == "req-1" and event.metadata.correlation_id is None


async def test_query_results_compare_and_serialise_as_mappings(store: AllocationStore) -> None:
    """Regression: the views are mappings but their dataclass equality hid it (usage == {...} was
    False even with the same items), hash() failed on their dicts, and they had no to_dict."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 2}}, project_id="acme")
    usage, held, totals = await store.usage(rp), await store.allocations(c), await store.usages("acme")
    assert usage == {"VCPU": 2} and held == {rp: {"VCPU": 2}} and totals == {"VCPU": 2}
    assert usage != {"VCPU": 3}
    assert usage == await store.usage(rp)  # a view of the same kind: every field compared
    assert usage != dataclasses.replace(usage, generation=usage.generation + 1)
    for view in (usage, held, totals):
        with pytest.raises(TypeError):
            hash(view)
        assert json.loads(json.dumps(view.to_dict())) == view.to_dict()
    assert usage.to_dict() == {"provider": rp, "generation": 2, "usages": {"VCPU": 2}}


def test_ids_do_not_repeat_across_random_seed_or_fork() -> None:
    """Command and event ids come from evstore's own generator (not os.urandom per id, a system
    call that gave up the GIL on every command): an application's random.seed() does not make
    them repeat, and a forked child does not repeat its parent's."""
    import os
    import random

    from evstore.log import random_bits
    from evstore.log.sqlite import _time_ordered_uuid
    from evstore.store import _command_id

    random.seed(7)
    first = (_command_id(), _time_ordered_uuid())
    random.seed(7)
    assert (_command_id(), _time_ordered_uuid()) != first
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next bits, then out without running the parent's clean-up
        os.write(write, random_bits(128).to_bytes(16, "big"))
        os._exit(0)
    os.close(write)
    theirs = int.from_bytes(os.read(read, 16), "big")
    os.close(read)
    os.waitpid(pid, 0)
    assert random_bits(128) != theirs


async def test_placements_allocation_shape_is_refused_with_the_shape_evstore_takes(
    store: AllocationStore,
) -> None:
    """Regression: {rp: {"resources": {...}}} (Placement's body) was refused as 'Invalid resource
    class 'resources'', which does not say what evstore expects instead."""
    rp = await make_provider(store, VCPU=8)
    with pytest.raises(
        InvalidInput, match=r"Placement's shape .*evstore takes \{provider: \{class: amount\}\}"
    ):
        await _put(store, {rp: {"resources": {"VCPU": 1}}})
    assert await store.head() == 2


def test_every_public_name_is_listed_and_importable() -> None:
    """Regression (helper-31): dir(evstore) did not list the names loaded on first use
    (open_store, AllocationStore, Receipt...), and what the queries answer (ProviderUsage, StateView,
    Diff...) could not be imported from evstore for annotations."""
    import evstore

    listed = dir(evstore)
    for name in evstore.__all__:
        assert name in listed
        assert getattr(evstore, name) is not None
    for name in (
        "open_store",
        "AllocationStore",
        "ProviderUsage",
        "ConsumerView",
        "StateView",
        "Diff",
        "State",
    ):
        assert name in evstore.__all__


async def test_awkward_arguments_of_the_debugging_calls_are_typed_errors(store: AllocationStore) -> None:
    """helper-37: rebuild(progress="x") failed with a bare TypeError deep in the backend; a
    state_at() view took UUID objects at runtime but was annotated str-only."""
    rp = await make_provider(store, VCPU=2)
    for call in (
        lambda: store.rebuild(progress="x"),  # type: ignore[arg-type]
        lambda: store.import_events(lambda: [], progress=5),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidInput, match="progress must be None or a callable"):
            await call()
    view = await store.state_at(position=await store.head())
    assert (await view.usage(uuid.UUID(rp))).usages == {"VCPU": 0}


@pytest.mark.parametrize("option", ["max_batch=5", "poll_interval=1", "snapshot_every=10"])
async def test_a_store_keyword_in_the_url_says_where_it_goes(store_url: str, option: str) -> None:
    """The SQLite message listed max_batch as a known option while refusing it in the URL;
    PostgreSQL sent it to the server, which failed the connection with "unrecognized
    configuration parameter"."""
    name = option.split("=")[0]
    with pytest.raises(InvalidInput, match=f"{name}: a keyword of open_store"):
        async with open_store(f"{store_url}{'&' if '?' in store_url else '?'}{option}"):
            pass


async def test_allocation_rows_without_their_consumer_row_are_a_corrupt_projection(
    store: AllocationStore,
) -> None:
    """helper-36: with a consumer's row gone but its allocation rows left, PostgreSQL answered
    allocations() and commands with a bare KeyError, SQLite's command failed with "UNIQUE
    constraint failed"; both are a damaged projection, which rebuild repairs."""
    rp = await make_provider(store, VCPU=4)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    await store.backend.tamper("DELETE FROM p_consumers WHERE uuid = ?", (c,))  # type: ignore[attr-defined]
    head = await store.head()
    with pytest.raises(evstore.ProjectionCorrupt, match="rebuild"):
        await allocate(store, c, {rp: {"VCPU": 2}})
    assert await store.head() == head, "nothing written"
    try:
        view = await store.allocations(c)
    except evstore.ProjectionCorrupt:
        pass  # (PostgreSQL loads the rows together; SQLite reads no row as no consumer)
    else:
        assert view.allocations == {}
    assert not (await store.audit()).clean
    await store.rebuild()
    assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}
    await allocate(store, c, {rp: {"VCPU": 2}}, generation=1)
    assert (await store.audit()).clean


async def test_a_rename_leaves_the_provider_generation_alone(store: AllocationStore) -> None:
    """SPEC's generation rules are Placement's: a rename does not bump the provider generation
    (only inventory changes and allocation writes naming it do). No test held this, and
    rename_provider's docstring said the opposite (rev22 conformance audit)."""
    rp = await make_provider(store, VCPU=4)
    before = (await store.usage(rp)).generation
    receipt = await store.rename_provider(rp, "renamed")
    assert receipt.provider_generations == {rp: before}  # (the generation after the command)
    assert (await store.usage(rp)).generation == before
    # and the generation a caller holds still works for the next inventory change
    assert await store.set_inventories(rp, {"VCPU": Inventory(total=8)}, before) == before + 1


async def test_providers_are_listed_by_name_in_code_point_order(store: AllocationStore) -> None:
    """helper-36: PostgreSQL sorted by the database's collation (in an ICU 'en' database
    '_x', '10', '9', 'a', 'A', ...), SQLite by code point; both now by code point."""
    names = ["b", "A", "a", "_x", "10", "9", "Z", "é"]
    if store.url.startswith("postgresql"):  # (the test cluster is C: make the names' collation ICU's)
        await store.backend.tamper(  # type: ignore[attr-defined]
            'ALTER TABLE p_providers ALTER COLUMN name TYPE text COLLATE "en-x-icu"'
        )
    for name in names:
        await store.create_provider(new_uuid(), name)
    assert [n for _, n in await store.providers()] == sorted(names)
    stats = await store.stats()
    assert list(stats["events_by_type"]) == sorted(stats["events_by_type"])


async def test_a_revert_gives_an_absent_instance_back_its_own_consumer_type(store: AllocationStore) -> None:
    """Regression: a revert to an instance its migration left absent (no destination claim yet:
    the scheduler found no host) restored it as INSTANCE whatever its type was - the fold forgets
    an absent consumer and the migration did not keep the type. Both ways to start a migration,
    and time travel, rebuild and the audit agree."""
    src = await make_provider(store, VCPU=16)
    started = []
    for ctype in ("BAREMETAL", "INSTANCE"):
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}}, consumer_type=ctype)
        await store.start_migration(inst, mig)
        started.append((inst, mig, ctype))
    # Nova's way: move_allocations, a plain write recognised as a move
    inst, mig = new_uuid(), new_uuid()
    await allocate(store, inst, {src: {"VCPU": 1}}, consumer_type="CUSTOM_VM")
    owner = {"project_id": "project", "user_id": "user"}
    await store.write_allocations(
        {
            inst: {"allocations": {}, "consumer_type": "CUSTOM_VM", "consumer_generation": 1, **owner},
            mig: {"allocations": {src: {"VCPU": 1}}, "consumer_type": "MIGRATION", **owner},
        }
    )
    started.append((inst, mig, "CUSTOM_VM"))
    assert (await store.allocations(mig)).on_behalf_of == inst
    mid = await store.head()
    await store.take_snapshots()  # (a snapshot taken while the migrations hold the source)
    for _, mig, _ in started:
        await store.revert_migration(mig)
    for inst, _, ctype in started:
        restored = await store.allocations(inst)
        assert (restored.consumer_type, restored.generation) == (ctype, 1), inst
        now = await store.state_at(await store.head())
        assert (await now.allocations(inst)).consumer_type == ctype
    # the instance types travel with the migrations in every fold
    before = await store.state_at(mid)
    for inst, mig, _ in started:
        assert (await before.allocations(inst)).consumer_type is None  # absent then
        assert (await before.allocations(mig)).on_behalf_of == inst
    assert (await store.audit()).clean
    await store.rebuild()
    assert (await store.audit()).clean
    assert [(await store.allocations(i)).consumer_type for i, _, _ in started] == [c for _, _, c in started]


async def test_an_older_sqlite_store_learns_its_migrations_instance_types_on_open(tmp_path: Path) -> None:
    """A store of schema version 2 has no instance_type column: the open adds it and refolds the
    projection, so a migration started before the upgrade still reverts to the right type."""
    path = tmp_path / "v2.db"
    async with open_store(f"sqlite:///{path}") as store:
        src = await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}}, consumer_type="BAREMETAL")
        await store.start_migration(inst, mig)
    conn = sqlite3.connect(path)
    with conn:  # what version 2 wrote
        conn.execute("ALTER TABLE p_consumers DROP COLUMN instance_type")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.close()
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.audit()).clean
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"
    conn = sqlite3.connect(path)
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    columns = [r[1] for r in conn.execute("PRAGMA table_info(p_consumers)")]
    conn.close()
    assert version == str(SQLITE_SCHEMA_VERSION) and columns[-1] == "instance_type"
    # a store that says it is current but lacks the column was damaged: refused, not altered
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("ALTER TABLE p_consumers DROP COLUMN instance_type")
    conn.close()
    with pytest.raises(evstore.StorageError, match="tables are of an older one"):
        async with open_store(f"sqlite:///{path}"):
            pass


def _as_version_4(path: Path) -> int:
    """Give a store the tables version 4 had (one allocation row per class, the index of
    consumers by project, no counters); the number of allocation rows."""
    conn = sqlite3.connect(path)
    with conn:
        rows = [
            (c, p, rc, used)
            for c, p, resources in conn.execute("SELECT consumer, provider, resources FROM p_allocations")
            for rc, used in json.loads(resources).items()
        ]
        conn.execute("DROP TABLE p_allocations")
        conn.execute("DROP TABLE p_usages")
        conn.execute(
            "CREATE TABLE p_allocations (consumer TEXT NOT NULL, provider TEXT NOT NULL, rc TEXT NOT NULL, "
            "used INTEGER NOT NULL, PRIMARY KEY (consumer, provider, rc)) WITHOUT ROWID"
        )
        conn.execute("CREATE INDEX p_allocations_provider ON p_allocations (provider)")
        conn.execute("CREATE INDEX p_consumers_project ON p_consumers (project_id, user_id)")
        conn.executemany("INSERT INTO p_allocations VALUES (?,?,?,?)", rows)
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    return len(rows)


async def _two_consumers_of_project_p(path: Path) -> tuple[str, str, tuple[Any, ...], int]:
    """A store at ``path`` with two consumers of project p: the provider, the first consumer,
    what usages() and provider_allocations() answer, and the head."""
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=8, MEMORY_MB=4096)
        a, b = new_uuid(), new_uuid()
        await allocate(store, a, {rp: {"VCPU": 2, "MEMORY_MB": 512}}, project_id="p", user_id="u1")
        await allocate(store, b, {rp: {"VCPU": 1}}, project_id="p", user_id="u2", consumer_type="MIGRATION")
        usages = await store.usages("p"), await store.usages("p", "u1")
        return rp, a, (*usages, await store.provider_allocations(rp)), await store.head()


async def test_a_version_4_sqlite_store_gets_its_reshaped_projection_on_open(tmp_path: Path) -> None:
    """Schema version 5 keeps one p_allocations row per consumer and provider (classes as JSON)
    and per-project usage counters instead of an index of consumers by project. A version-4 store
    (one row per class, the index, no counters) is given the new tables on open, refolded from
    its log: allocations, provider allocations and project usages answer as before, the audit is
    clean, and a store that says 5 but has the old table was damaged: refused, not altered."""
    path = tmp_path / "v4.db"
    rp, a, before, _ = await _two_consumers_of_project_p(path)
    assert _as_version_4(path) == 3
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.audit()).clean
        after = (await store.usages("p"), await store.usages("p", "u1"), await store.provider_allocations(rp))
        assert after == before
        assert before[0].usages == {"MEMORY_MB": 512, "VCPU": 3} and before[0].consumer_count == 2
        assert (await store.allocations(a)) == {rp: {"MEMORY_MB": 512, "VCPU": 2}}
        await store.delete_consumer(a)
        assert (await store.usages("p")).usages == {"VCPU": 1}
    conn = sqlite3.connect(path)
    version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0]
    indexes = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    conn.close()
    assert version == str(SQLITE_SCHEMA_VERSION) and "p_consumers_project" not in indexes
    conn = sqlite3.connect(path)
    with conn:  # says 5, holds the old table: damaged
        conn.execute("DROP TABLE p_allocations")
        conn.execute(
            "CREATE TABLE p_allocations (consumer TEXT NOT NULL, provider TEXT NOT NULL, rc TEXT NOT NULL, "
            "used INTEGER NOT NULL, PRIMARY KEY (consumer, provider, rc)) WITHOUT ROWID"
        )
    conn.close()
    with pytest.raises(evstore.StorageError, match="tables are of an older one"):
        async with open_store(f"sqlite:///{path}"):
            pass


async def test_a_version_4_store_whose_log_cannot_be_folded_keeps_its_allocations_on_open(
    tmp_path: Path,
) -> None:
    """The reshape to version 5 drops the old allocation table and refolds the projection from
    the log. A log with an event that cannot be decoded (the audit names it) made the refold
    fail and leave the new table empty: the upgraded store held nothing for anyone - allocations()
    empty, usages() zero, release() NotFound - and commands decided against that (a rewrite
    appended an event whose ``previous`` was empty). The older rows are kept, in the new shape."""
    path = tmp_path / "v4.db"
    rp, a, before, last = await _two_consumers_of_project_p(path)
    assert _as_version_4(path) == 3
    with sqlite3.connect(path) as conn:  # one event the log holds can no longer be decoded
        conn.execute("UPDATE events SET data = '{broken' WHERE position = ?", (last,))
    conn.close()
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.allocations(a)).allocations == {rp: {"MEMORY_MB": 512, "VCPU": 2}}
        after = (await store.usages("p"), await store.usages("p", "u1"), await store.provider_allocations(rp))
        assert after == before
        assert before[0].consumer_count == 2
        await store.release(a)
        assert (await store.usages("p")).usages == {"VCPU": 1}
        assert (await store.usage(rp)).usages == {"MEMORY_MB": 0, "VCPU": 1}
        assert any("Cannot decode" in f.message for f in (await store.audit()).findings)


async def test_a_version_4_store_whose_log_lost_its_tail_keeps_its_tombstone_on_open(tmp_path: Path) -> None:
    """A log that lost its last events (deleted, an older copy restored) is a lost tail: the audit
    says log_truncated and a rebuild refuses to forget them without force=True (a tombstone may be
    among them). The reshape to version 5 refolded the projection from the log regardless: the
    tail was forgotten silently - the deleted instance was no longer a tombstone, the audit came
    out clean, and a revert of its migration gave it its allocations back (bug 1848343's leak).
    The projection is kept as it was, in the new shape, and the lost tail is still reported."""
    path = tmp_path / "v4.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=8)
        a, inst, mig = new_uuid(), new_uuid(), new_uuid()
        await allocate(store, a, {rp: {"VCPU": 2}}, project_id="p")
        await allocate(store, inst, {rp: {"VCPU": 1}}, project_id="p")
        await store.start_migration(inst, mig)
        await store.delete_consumer(inst)
        deleted_at = await store.head()
    _as_version_4(path)
    with sqlite3.connect(path) as conn:  # the log loses its last event: the instance's deletion
        conn.execute("DELETE FROM events WHERE position = ?", (deleted_at,))
    conn.close()
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.allocations(inst)).deleted
        assert (await store.allocations(a)).allocations == {rp: {"VCPU": 2}}
        assert (await store.usages("p")).usages == {"VCPU": 2}
        findings = (await store.audit()).findings
        assert any(f.details.get("reason") == "log_truncated" for f in findings)
        with pytest.raises(evstore.CorruptEvent, match="lost its last events"):
            await store.rebuild()
        # (every command is refused while the log is behind its projection, s40 D: the revert
        # would have been ConsumerDeleted)
        with pytest.raises(evstore.CorruptEvent, match="lost its last events") as caught:
            await store.revert_migration(mig)
        assert caught.value.details["lost_position"] == deleted_at
        assert await store.head() == deleted_at - 1
        assert (await store.allocations(inst)).deleted
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0] == "5"
    conn.close()


def test_a_missing_asyncpg_and_a_broken_installation_are_told_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """An ImportError of evstore's own PostgreSQL module said 'needs asyncpg' whatever its cause
    (a mixed installation's missing name sent the reader to pip install asyncpg)."""
    import sys

    url = "postgresql://u@localhost:1/db"
    monkeypatch.delitem(sys.modules, "evstore.log.postgres", raising=False)
    monkeypatch.setitem(sys.modules, "asyncpg", None)  # (import asyncpg fails, as when not installed)
    with pytest.raises(evstore.InvalidInput, match="needs asyncpg"):
        make_backend(url)
    monkeypatch.setitem(sys.modules, "evstore.log.postgres", None)  # (evstore's own module fails)
    with pytest.raises(evstore.InvalidInput, match="cannot be imported") as info:
        make_backend(url)
    assert "asyncpg" not in str(info.value).split("(")[0]


async def test_reader_arguments_are_checked_at_the_call_and_after_beyond_the_head_is_refused(
    store: AllocationStore,
) -> None:
    """history(), subscribe() and export() were async generators: a bad argument raised only at the
    first iteration, away from the call that passed it. And subscribe(after=N) past the head
    waited silently, then delivered only what came after N (helper-40): a checkpoint of another
    store, or from before a restore, skipped the events appended meanwhile."""
    rp = await make_provider(store, VCPU=4)
    head = await store.head()
    for call in (
        lambda: store.history("not-a-uuid"),
        lambda: store.history(rp, batch_size=0),
        lambda: store.subscribe(after=-1),
        lambda: store.subscribe(after="3"),  # type: ignore[arg-type]
        lambda: store.export(batch_size=0),
    ):
        with pytest.raises(evstore.InvalidInput):
            call()
    following = store.subscribe(after=head + 5)
    with pytest.raises(evstore.InvalidInput, match="beyond the head"):
        await anext(following)
    caught_up = store.subscribe(after=head - 1)  # (at or before the head: followed as before)
    assert (await anext(caught_up)).position == head
    await caught_up.aclose()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


async def test_large_reads_do_not_keep_the_applications_cyclic_garbage_alive(sqlite_url: str) -> None:
    """Regression (helper-41): read() of a large page paused the collector with gc_paused(), whose
    end moved every object allocated since the last collection to the oldest generation uncounted:
    a follower polling read(head, 5000) kept every cycle the application made from ever being
    collected. A read's pause no longer promotes."""
    async with open_store(sqlite_url) as store:
        await make_provider(store, VCPU=1)
        head = await store.head()
        assert gc.isenabled()
        for _ in range(2000):
            await store.read(head, 5000)
            for _ in range(50):
                _Cycle()
        alive = sum(1 for o in gc.get_objects() if type(o) is _Cycle)
    assert alive < 20_000, f"{alive} of 100000 unreachable cycles never collected"


async def test_a_newer_store_with_columns_this_version_lacks_is_a_version_error(tmp_path: Path) -> None:
    """A store a newer evstore wrote (a column added) was refused as 'Not an evstore database: use
    another file' - the column check ran before the version's (helper-41)."""
    path = tmp_path / "newer.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=1)
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("ALTER TABLE p_consumers ADD COLUMN from_the_future TEXT")
        newer = str(SQLITE_SCHEMA_VERSION + 1)
        conn.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (newer,))
    conn.close()
    with pytest.raises(evstore.SchemaVersionError, match="Upgrade evstore"):
        async with open_store(f"sqlite:///{path}"):
            pass


async def test_a_damaged_consumer_row_fails_only_its_own_command_in_a_group_commit(tmp_path: Path) -> None:
    """Regression (stop 23, written with the batch's one-query consumer prefetch): a consumer row
    whose generation is not a number makes the command naming it ProjectionCorrupt. Loading every
    consumer of a group commit at once must not turn that into a failure of the whole batch: the
    commands queued with it, on healthy consumers, commit."""
    async with open_store(f"sqlite:///{tmp_path / 'damaged.db'}") as store:
        rp = await make_provider(store, VCPU=64)
        damaged, *healthy = [new_uuid() for _ in range(6)]
        for c in (damaged, *healthy):
            await allocate(store, c, {rp: {"VCPU": 1}})
        await store.backend.tamper(  # type: ignore[attr-defined]
            "UPDATE p_consumers SET generation = 'one' WHERE uuid = ?", (damaged,)
        )
        await store.close()
    async with open_store(f"sqlite:///{tmp_path / 'damaged.db'}") as store:  # (nothing cached)
        outcomes = await asyncio.gather(
            *(allocate(store, c, {rp: {"VCPU": 2}}, generation=1) for c in (damaged, *healthy)),
            return_exceptions=True,
        )
        assert isinstance(outcomes[0], evstore.ProjectionCorrupt)
        assert not [o for o in outcomes[1:] if isinstance(o, BaseException)], outcomes
        for c in healthy:
            assert (await store.allocations(c)).allocations == {rp: {"VCPU": 2}}


async def test_query_answers_come_in_one_order_on_every_backend_live_and_in_time_travel(
    store: AllocationStore,
) -> None:
    # The same script answered the same values in different orders: SQLite's live reads sorted
    # providers and classes (its index order), PostgreSQL's kept the order they were written in,
    # time travel the order of the events, and usages() the order of the rows - so to_dict(), JSON
    # and printed answers differed between backends and between `usage` and `state_at(...).usage`.
    # Every answer is now sorted: providers, consumers, classes and consumer types.
    a = new_uuid()
    b = new_uuid()
    first, second = sorted((a, b))
    await store.create_provider(second, "second")
    await store.create_provider(first, "first")
    await store.set_inventories(first, {"VCPU": Inventory(total=100)}, generation=0)
    await store.set_inventory(first, "DISK_GB", Inventory(total=100), generation=1)  # added after VCPU
    await store.set_inventories(
        second, {"VCPU": Inventory(total=100), "MEMORY_MB": Inventory(total=1000)}, generation=0
    )
    held = {second: {"VCPU": 1, "MEMORY_MB": 10}, first: {"VCPU": 2, "DISK_GB": 5}}  # unsorted
    consumers = sorted(new_uuid() for _ in range(2))
    await allocate(store, consumers[1], held, consumer_type="MIGRATION")
    await allocate(store, consumers[0], held, consumer_type="INSTANCE")
    receipt = await store.write_allocations(
        {
            c: ConsumerAllocations(
                allocations={},
                project_id="project",
                user_id="user",
                consumer_type="INSTANCE",
                consumer_generation=1,
            )
            for c in consumers[::-1]
        }
    )
    assert list(receipt.provider_generations) == [first, second]
    for c, t in zip(consumers[::-1], ("MIGRATION", "INSTANCE"), strict=True):
        await allocate(store, c, held, consumer_type=t)
    past = await store.state_at(position=await store.head())
    for view in (store, past):
        usage = await view.usage(first)
        assert list(usage) == ["DISK_GB", "VCPU"]
        mine = await view.allocations(consumers[0])
        assert list(mine) == [first, second]
        assert [list(mine[p]) for p in mine] == [["DISK_GB", "VCPU"], ["MEMORY_MB", "VCPU"]]
        holders = await view.provider_allocations(first)
        assert list(holders) == consumers
        assert all(list(r) == ["DISK_GB", "VCPU"] for r in holders.values())
        usages = await view.usages("project")
        assert list(usages) == ["DISK_GB", "MEMORY_MB", "VCPU"]
        assert list(usages.by_consumer_type) == ["INSTANCE", "MIGRATION"]
        assert list(usages.by_consumer_type["INSTANCE"]) == ["DISK_GB", "MEMORY_MB", "VCPU", "consumer_count"]
        assert json.dumps(usages.to_dict()) == json.dumps(
            {
                "usages": {"DISK_GB": 10, "MEMORY_MB": 20, "VCPU": 6},
                "consumer_count": 2,
                "by_consumer_type": {
                    "INSTANCE": {"DISK_GB": 5, "MEMORY_MB": 10, "VCPU": 3, "consumer_count": 1},
                    "MIGRATION": {"DISK_GB": 5, "MEMORY_MB": 10, "VCPU": 3, "consumer_count": 1},
                },
            }
        )


async def test_inventories_and_provider_read_back_what_was_written(store: AllocationStore) -> None:
    # Placement's GET /resource_providers/{uuid} and /inventories: before, a provider's totals,
    # reserved amounts, units and ratios, and its parent, could be read only by time travel.
    root, child = new_uuid(), new_uuid()
    await store.create_provider(root, "root")
    await store.create_provider(child, "child", parent=root)
    vcpu = Inventory(total=16, reserved=2, max_unit=8, allocation_ratio=4.0)
    disk = Inventory(total=1000, step_size=10, min_unit=10)
    generation = await store.set_inventories(child, {"VCPU": vcpu, "DISK_GB": disk}, generation=0)

    inv = await store.inventories(child)
    assert inv == {"DISK_GB": disk, "VCPU": vcpu}
    assert list(inv) == ["DISK_GB", "VCPU"]  # by class, whatever order they were given in
    assert (inv.provider, inv.generation) == (child, generation)
    assert inv["VCPU"].allocation_ratio == 4.0
    assert json.loads(json.dumps(inv.to_dict())) == {
        "provider": child,
        "generation": generation,
        "inventories": {"DISK_GB": disk.model_dump(), "VCPU": vcpu.model_dump()},
    }
    # the generation it answers is the one the next inventory command must give
    await store.set_inventory(child, "VCPU", Inventory(total=32), generation=inv.generation)
    after = await store.inventories(child)
    assert after["VCPU"] == Inventory(total=32) and after.generation == generation + 1
    assert await store.inventories(root) == {}

    await store.rename_provider(child, "renamed")
    view = await store.provider(child)
    assert (view.uuid, view.name, view.parent, view.root) == (child, "renamed", root, root)
    assert view.generation == after.generation  # (a rename leaves the generation, as in Placement)
    assert (await store.provider(root)).to_dict() == {
        "uuid": root,
        "name": "root",
        "generation": 0,
        "parent": None,
        "root": root,
    }

    past = await store.state_at(position=await store.head())
    for scope in (past, await store.state_at(position=await store.head(), provider=child)):
        assert await scope.inventories(child) == await store.inventories(child)
        assert list(await scope.inventories(child)) == ["DISK_GB", "VCPU"]
        assert await scope.provider(child) == view
    assert await past.provider(root) == await store.provider(root)
    missing = new_uuid()
    for query in (store.inventories, store.provider, past.inventories, past.provider):
        with pytest.raises(evstore.ProviderNotFound) as nf:
            await query(missing)
        assert nf.value.code == "placement.resource_provider.not_found" and missing in str(nf.value)
        with pytest.raises(evstore.InvalidInput):
            await query("not-a-uuid")
    assert list(await store.inventories(child)) == ["DISK_GB", "VCPU"]
    await store.delete_inventory(child, "DISK_GB")
    assert list(await store.inventories(child)) == ["VCPU"]
    await store.delete_provider(child)
    with pytest.raises(evstore.ProviderNotFound):
        await store.inventories(child)


def test_a_store_its_program_never_closed_does_not_keep_the_process_alive(tmp_path: Path) -> None:
    """Regression (helper-56): ``store = await open_store(url)`` and no ``close()`` - a program that
    forgot, or ended on an error - hung at exit for ever on SQLite: aiosqlite's connection threads
    are not daemons, and once the loop was gone nothing could close them. The process now exits;
    what was committed is there when the store is opened again."""
    db = tmp_path / "unclosed.db"
    script = (
        "import asyncio, sys\n"
        "from evstore import open_store\n"
        "async def main():\n"
        "    store = await open_store(sys.argv[1])\n"
        "    await store.create_provider('6b143df3-2c73-42b9-b8cc-a015a322dab3', 'unclosed')\n"
        "asyncio.run(main())\n"
        "print('ended', flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.run(
        [sys.executable, "-c", script, f"sqlite:///{db}"], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 0 and "ended" in proc.stdout, proc.stderr[-2000:]

    async def reopened() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            assert await store.head() == 1
            assert await store.providers() == [("6b143df3-2c73-42b9-b8cc-a015a322dab3", "unclosed")]
            assert (await store.audit()).clean

    asyncio.run(reopened())


async def test_a_store_and_a_view_say_what_they_are_when_printed(tmp_path: Path) -> None:
    """Regression (review 25, helper-h): ``repr(store)`` was ``<evstore.store.AllocationStore
    object at 0x...>`` and ``repr(await store.state_at(...))`` ``<projections.replay.StateView
    object at 0x...>``: in a debugger or a log line, nothing said which store, or which position
    and slice a view was folded for (the other results print their fields)."""
    url = f"sqlite:///{tmp_path / 'shown.db'}"
    async with open_store(url) as store:
        assert repr(store) == f"AllocationStore({url!r})"
        rp = await make_provider(store, VCPU=4)
        whole = await store.state_at(position=2)
        assert repr(whole) == "StateView(position=2, providers=1, consumers=0)"
        one = await store.state_at(position=1, provider=rp)
        assert repr(one) == f"StateView(position=1, scope='provider:{rp}')"
    assert repr(store) == f"AllocationStore({url!r}, closed)"
    hidden = evstore.AllocationStore(make_backend("postgresql://evstore:s3cret@db.example:5432/evstore"))
    assert repr(hidden) == "AllocationStore('postgresql://evstore:***@db.example:5432/evstore')"


async def test_recorded_events_hash_and_results_have_to_dict(store: AllocationStore) -> None:
    """Regression (review 25, helper-h): ``RecordedEvent`` is a frozen dataclass, so it looked
    hashable, but ``hash()`` of one raised ``TypeError: unhashable type: 'dict'`` for every event
    carrying allocations or inventories (a set of delivered events, to drop a subscriber's
    duplicates, failed on them and worked on a ProviderCreated); and of the results the README
    describes, a receipt and a recorded event had no ``to_dict()`` (``RecordedEvent.to_json()``
    answered a dict, ``Receipt.to_json()`` a string: both answer text now)."""
    rp = await make_provider(store, VCPU=4)
    receipt = await store.set_allocations(
        new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )
    first, again = await store.read(), await store.read()
    assert len({*first, *again}) == len(first) == 3
    assert [hash(e) for e in first] == [hash(e) for e in again]
    assert json.loads(json.dumps(first[-1].to_dict())) == json.loads(first[-1].to_json())
    assert json.loads(json.dumps(receipt.to_dict())) == {
        "positions": [3],
        "consumer_generations": receipt.consumer_generations,
        "provider_generations": {rp: 2},
        "replayed": False,
    }
    # (helper-121: a receipt's JSON text left out ``replayed``, which its dict has; and a replayed
    # receipt says so in both)
    assert json.loads(receipt.to_json()) == receipt.to_dict()
    keyed = new_uuid()
    replay, replayed = [
        await store.set_allocations(
            keyed,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            idempotency_key="once",
        )
        for _ in range(2)
    ]
    assert not replay.replayed and json.loads(replayed.to_json()) == {**replay.to_dict(), "replayed": True}


async def test_every_metadata_key_evstore_writes_reads_as_an_attribute(store: AllocationStore) -> None:
    """Regression (review 25, helper-h): evstore writes ``command``, ``command_id`` and
    ``idempotency_key`` into every event's metadata (README), but only the first two were
    fields of ``Metadata``: ``event.metadata.idempotency_key`` raised AttributeError on an event
    written without a key (and was a type error for mypy and pyright on every event)."""
    await store.create_provider(new_uuid(), "keyed", idempotency_key="k-1")
    await store.create_provider(new_uuid(), "plain", metadata={"tenant": "t"})
    keyed, plain = await store.read()
    assert keyed.metadata.idempotency_key == "k-1"
    assert plain.metadata.idempotency_key is None
    assert plain.metadata.command == "CreateProvider" and plain.metadata.model_extra == {"tenant": "t"}
    # (what is stored and shown is unchanged: the key only where there is one)
    assert keyed.to_dict()["metadata"]["idempotency_key"] == "k-1"
    assert "idempotency_key" not in plain.to_dict()["metadata"]


async def test_a_store_opened_by_this_version_is_closed_to_one_that_refuses_its_new_payload_fields(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (stop 26): events gained optional payload fields (a migration consumer's
    ``on_behalf_of``, a ProviderDeleted's ``parent``) that an evstore of schema version 3 refuses
    (its events forbid unknown fields): it opened a store holding them and called those events
    corrupt (CorruptEvent at their positions, in reads, history and the audit). Opening a
    version-3 store now marks it version 4, which such an evstore refuses to open, saying to
    upgrade."""
    import evstore.log.sqlite as sqlite_backend

    path = tmp_path / "v3.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=1)
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")  # (same tables)
    async with open_store(f"sqlite:///{path}") as store:
        root = await make_provider(store, "root")
        child = await make_provider(store, "child", parent=root)
        await store.delete_provider(child)  # (a payload an evstore of version 3 cannot read)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        [(version,)] = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchall()
    assert version == str(SQLITE_SCHEMA_VERSION) and SQLITE_SCHEMA_VERSION >= 4
    monkeypatch.setattr(sqlite_backend, "SCHEMA_VERSION", 3)  # (that evstore's own check)
    with pytest.raises(
        evstore.SchemaVersionError, match=f"schema version {version}; this evstore understands up to 3"
    ):
        async with open_store(f"sqlite:///{path}"):
            pass


async def test_a_generation_no_entity_can_have_is_a_generation_conflict(store: AllocationStore) -> None:
    """As in Placement 16 (checked against it: 409 ``placement.concurrent_update``, ``consumer
    generation conflict - expected 1 but got -1``; ``expected 1 but got 9223372036854775808``), a
    generation below 0 or past the largest evstore writes is a stale generation, not malformed input.
    Regression: evstore refused them as ``evstore.invalid_input`` ('must be an integer from 0 to
    2**62'), where SPEC says a mismatch is ``ConcurrentUpdate`` with Placement's message."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    head = await store.head()
    owner: dict[str, Any] = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
    for given in (-1, 2**62 + 1, 2**63):
        with pytest.raises(
            evstore.ConcurrentUpdate, match=f"consumer generation conflict - expected null but got {given}$"
        ):
            await store.set_allocations(c, {rp: {"VCPU": 1}}, **owner, generation=given)
        with pytest.raises(evstore.ConcurrentUpdate, match=f"expected null but got {given}$") as caught:
            await store.write_allocations(
                {c: {"allocations": {rp: {"VCPU": 1}}, **owner, "consumer_generation": given}}
            )
        assert caught.value.code == "placement.concurrent_update"
        with pytest.raises(
            evstore.ConcurrentUpdate,
            match=f"resource provider generation conflict - expected 1 but got {given}",
        ):
            await store.set_inventories(rp, {"VCPU": Inventory(total=9)}, generation=given)
    assert await store.head() == head  # nothing written
    await store.set_allocations(c, {rp: {"VCPU": 1}}, **owner, generation=None)
    with pytest.raises(
        evstore.ConcurrentUpdate, match=r"consumer generation conflict - expected 1 but got -1$"
    ):
        await store.set_allocations(c, {rp: {"VCPU": 2}}, **owner, generation=-1)
    assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}
