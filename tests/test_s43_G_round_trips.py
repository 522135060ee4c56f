"""Issue 2 point 13, read literally: "a command should cost one round-trip to the database
thread, not one per statement". Counted at aiosqlite's one door to its thread
(``Connection._execute``, which every aiosqlite call goes through): sequential commands take at
most one hop each, and commands queued together share one (group commit)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiosqlite
import pytest

from evstore import AllocationStore, Inventory, open_store
from tests.conftest import make_provider, new_uuid


def _count_hops(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    hops: list[int] = []
    through = aiosqlite.Connection._execute

    async def counting(self: aiosqlite.Connection, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        hops.append(id(self))
        return await through(self, fn, *args, **kwargs)  # type: ignore[no-untyped-call]

    monkeypatch.setattr(aiosqlite.Connection, "_execute", counting)
    return hops


def _build(store: AllocationStore, rp: str) -> Awaitable[object]:
    return store.set_allocations(
        new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )


async def test_a_command_is_one_hop_to_the_database_thread(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=Inventory(total=1000))
        for _ in range(3):  # warm: the writer's first transactions read the store's settings
            await _build(store, rp)
        hops = _count_hops(monkeypatch)
        for _ in range(20):
            await _build(store, rp)
        assert len(hops) <= 20, f"{len(hops)} hops to the database thread for 20 sequential commands"
        instance, migration = new_uuid(), new_uuid()
        del hops[:]
        await store.set_allocations(
            instance,
            {rp: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        await store.start_migration(instance, migration)
        await store.revert_migration(migration)
        await store.delete_consumer(instance)
        assert len(hops) <= 4, f"{len(hops)} hops for 4 commands"
        del hops[:]
        await asyncio.gather(*(_build(store, rp) for _ in range(64)))
        assert len(hops) <= 4, f"{len(hops)} hops for 64 commands queued together"
        assert (await store.usage(rp)).usages["VCPU"] == 3 + 20 + 64
