"""Issue 3 point 1 ("``rebuild()`` ... streaming in batches, memory bounded no matter how long the
log is") and issue 6 point 6 (a long log "appended, rebuilt, audited and exported with bounded
memory"), as a test rather than a benchmark's record: four times the events, the fold staying
one provider, and each of rebuild, export and a subscriber's catch-up (and, with EVSTORE_SLOW=1,
a full rebuild, audit and replay, which read in larger batches) peaks no higher (Python's
allocations, traced). tests/benchmarks records the 1M-event peaks; only import
had such a test (tests/test_import_memory.py), whose synthetic log this reuses."""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from evstore import AllocationStore, open_store
from tests.test_import_memory import synthetic_export

SLOW = bool(os.environ.get("EVSTORE_SLOW"))


async def _drain_export(store: AllocationStore) -> None:
    async for _ in store.export(batch_size=100):
        pass


async def _catch_up(store: AllocationStore) -> None:
    head = await store.head()
    async for event in store.subscribe(0, batch_size=100):
        if event.position == head:
            break


async def _full_rebuild(store: AllocationStore) -> None:
    await store.rebuild(batch_size=100, full=True)


async def _rebuild(store: AllocationStore) -> None:
    await store.rebuild(batch_size=100)


async def _audit(store: AllocationStore) -> None:
    assert (await store.audit()).clean


async def _replay(store: AllocationStore) -> None:
    await store.replay()


Operation = Callable[[AllocationStore], Awaitable[None]]
#: name -> (operation, events in the shorter log, in the longer): the operations that take a batch
#: size read in batches of 100 and run in the CI profile; audit and replay read in batches of
#: 5,000 (one read ahead), so their shorter log must hold several: the slow profile runs them
OPERATIONS: dict[str, tuple[Operation, int, int]] = {
    "rebuild": (_rebuild, 1_500, 6_000),
    "export": (_drain_export, 1_500, 6_000),
    "subscribe": (_catch_up, 1_500, 6_000),
    **(
        {
            "rebuild-full": (_full_rebuild, 2_000, 8_000),
            "audit": (_audit, 15_000, 45_000),
            "replay": (_replay, 15_000, 45_000),
        }
        if SLOW
        else {}
    ),
}


async def _import(store: AllocationStore, lines: list[str]) -> None:
    await store.import_events(lambda: iter(lines))


async def _peak(url: str, events: int, operation: Operation) -> int:
    async with open_store(url) as store:
        await _import(store, synthetic_export(events))
        await operation(store)  # once untraced: caches, prepared statements, lazy imports
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            await operation(store)
            return tracemalloc.get_traced_memory()[1] - before
        finally:
            tracemalloc.stop()


@pytest.mark.parametrize("name", sorted(OPERATIONS))
async def test_four_times_the_events_take_no_more_memory(
    name: str, backend_name: str, tmp_path: Path
) -> None:
    urls = []
    for label in ("small", "large"):
        if backend_name == "sqlite":
            urls.append(f"sqlite:///{tmp_path}/{label}.db")
        else:
            from tests.pg import fresh_database_url

            urls.append(fresh_database_url())
    operation, shorter, longer = OPERATIONS[name]
    small = await _peak(urls[0], shorter, operation)
    large = await _peak(urls[1], longer, operation)
    # thousands more events: ~2.7 KB each decoded, so keeping them would be many MB more
    assert large - small < max(1_000_000, small // 2), (name, small, large)
