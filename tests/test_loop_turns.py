"""The bulk operations leave the event loop free: what they did on it, stalling every other task of
the service (measured on a 200k-event SQLite store), now runs on a thread or in short slices.

Timing is not asserted (it would be flaky): each test checks the mechanism - where a piece of work
runs, or how much of it runs between two turns of another task.
"""

from __future__ import annotations

import asyncio

import pytest

from evstore import AllocationStore
from projections.state import State
from tests.conftest import allocate, make_provider, new_uuid


async def _store_of(store: AllocationStore, consumers: int) -> None:
    """Consumers holding allocations, some deleted (tombstones) and some migrated."""
    rp = await make_provider(store, VCPU=10**6)
    other = await make_provider(store, VCPU=10**6)
    held = [new_uuid() for _ in range(consumers)]
    await asyncio.gather(*(allocate(store, c, {rp: {"VCPU": 1}}) for c in held))
    await asyncio.gather(*(store.start_migration(c, new_uuid()) for c in held[: consumers // 4]))
    await asyncio.gather(*(store.delete_consumer(c) for c in held[consumers // 2 :]))
    await allocate(store, new_uuid(), {other: {"VCPU": 1}})


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


async def test_a_replay_recounts_usage_on_a_thread(
    store: AllocationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 28: a replay from the first event recounted every provider's usage at its end (one
    pass over every consumer) on the event loop: 60-80 ms a stall on a 200k-event store, at the
    end of every replay, rebuild and whole-state time travel without a snapshot. It runs on a
    thread now, as the audit's recount does; a replay that fails still leaves its state
    recounted."""
    calls: list[bool] = []
    recount = State.recount_usages

    def watched(self: State) -> None:
        calls.append(_on_loop())
        recount(self)

    monkeypatch.setattr(State, "recount_usages", watched)
    await _store_of(store, 40)
    state = await store.replay()
    assert calls == [False]
    assert sum(p.usages.get("VCPU", 0) for p in state.providers.values()) == 1 + 20
    calls.clear()
    await store.rebuild()
    assert calls == [False]
    assert (await store.audit()).clean
