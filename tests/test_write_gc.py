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
from contextlib import closing

import pytest

import evstore.log.sqlite as sqlite_backend
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
