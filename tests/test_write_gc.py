"""What commands leave for the cyclic collector while they wait and after they are written.

A tracked object that outlives a collection or two is promoted to the oldest generation, and
every ~quarter-growth of that generation costs a full collection, which scans all of it with
the GIL held. Under 64 concurrent tasks (the benchmark's group commits), the history keys the
SQLite writer keeps until its index catches up (up to ``HISTORY_LAG`` events) and the sets of
each queued command's ``Needs`` were together about a third of what was promoted (stop 36).
Timing is not asserted (flaky): the tests look at what is tracked.
"""

from __future__ import annotations

import asyncio
import gc
import sqlite3
from collections.abc import Set as AbstractSet
from contextlib import closing

import pytest

import evstore.log.sqlite as sqlite_backend
from evstore import commands as cmd
from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid

pytestmark = pytest.mark.asyncio


async def test_the_history_keys_the_writer_keeps_are_not_tracked(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=10**6)
        await asyncio.gather(*(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(50)))
        own = store.backend._cache.own  # type: ignore[attr-defined]
        assert len(own) >= 50  # (the index lags: fewer than HISTORY_LAG events were appended)
        assert len(own) < sqlite_backend.HISTORY_LAG
        gc.collect()
        tracked = [position for position, keys in own.items() if gc.is_tracked(keys)]
        assert not tracked, f"{len(tracked)} of {len(own)} events' kept history keys are tracked"
        assert all(isinstance(keys, tuple) and keys for keys in own.values())
    with closing(sqlite3.connect(sqlite_url.removeprefix("sqlite:///"))) as conn:
        assert sqlite_backend.history_through(conn) == 52  # (the close indexed the kept keys)
    async with open_store(sqlite_url) as store:
        history = [e async for e in store.history(rp)]
        assert len(history) == 52  # (created, its inventory, 50 claims)


async def test_a_command_needs_no_set_for_what_it_does_not_read() -> None:
    consumer, provider = new_uuid(), new_uuid()
    commands: list[cmd.Command] = [
        cmd.ConfirmMigration(consumer),
        cmd.DeleteConsumer(consumer),
        cmd.DeleteProvider(provider),
        cmd.Release(consumer),
    ]
    kept = [cmd.needs(c) for c in commands]  # (alive, so that no two sets share an id by reuse)
    empty = {id(field) for n in kept for field in _fields(n) if not field}
    assert len(empty) == 1  # (one shared empty set, not one per command and field)
    n = cmd.needs(cmd.DeleteConsumer(consumer))
    assert n.consumers == n.migrations_of == {consumer}
    assert not (n.providers or n.provider_names or n.children_of or n.resource_classes)


def _fields(n: cmd.Needs) -> list[AbstractSet[str]]:
    return [n.consumers, n.providers, n.provider_names, n.children_of, n.migrations_of, n.resource_classes]


async def test_needs_names_what_each_write_reads() -> None:
    rp, a, b = new_uuid(), new_uuid(), new_uuid()
    write = cmd.WriteAllocations(
        (
            cmd.ConsumerWrite(a, {rp: {"VCPU": 1, "MEMORY_MB": 10}}, "p", "u", "INSTANCE", None),
            cmd.ConsumerWrite(b, {}, "p", "u", "INSTANCE", None),
        )
    )
    n = cmd.needs(write)
    assert (n.consumers, n.providers, n.resource_classes) == ({a, b}, {rp}, {"VCPU", "MEMORY_MB"})
    assert not (n.provider_names or n.children_of or n.migrations_of)
