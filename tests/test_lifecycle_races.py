"""The store's life cycle racing its users (review 21, helper-40; each test failed on b49bbba).

1. ``close()`` while ``open()`` runs: ``open()`` goes on, connects, and returns the store as if
   open; its connections (SQLite: two aiosqlite worker threads, non-daemon, plus the file
   handles; PostgreSQL: the asyncpg pool) are never closed.
2. A read racing ``close()`` (``head``, ``read``, ``usage``, ``export``, ``audit``...) fails
   with ``StorageError`` ("SQLite error: Cannot operate on a closed database.") instead of
   ``StoreClosed``, about half the time.
"""

from __future__ import annotations

import asyncio
import os
import threading
import uuid
from pathlib import Path

import pytest

from evstore import AllocationStore, Inventory, StoreClosed, open_store
from evstore.store import make_backend


def _sqlite_workers() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if "_connection_worker_thread" in t.name}


@pytest.mark.parametrize("delay", [0, 1, 3, 10, 40])
async def test_close_while_open_runs_leaves_no_connection_open(tmp_path: Path, delay: int) -> None:
    """A service told to stop while it starts (SIGTERM during start-up) calls close() while
    open() is still connecting. open() then finished connecting after close() had closed
    nothing, so the connections stayed open for as long as the store object lived."""
    before = _sqlite_workers()
    store = AllocationStore(make_backend(f"sqlite:///{tmp_path}/s.db"))
    opening = asyncio.create_task(store.open())
    for _ in range(delay):
        await asyncio.sleep(0)
    await asyncio.gather(opening, store.close(), return_exceptions=True)
    backend = store.backend
    assert backend._writer is None and backend._reader is None, "close() left connections open"  # type: ignore[attr-defined]
    # (a worker thread ends just after its connection closes - on a loaded machine, some time
    # after: waited for, up to 10 s; before the fix they never ended)
    for _ in range(200):
        if _sqlite_workers() <= before:
            break
        await asyncio.sleep(0.05)
    assert _sqlite_workers() <= before, "aiosqlite worker threads outlived close()"
    with pytest.raises(StoreClosed):
        await store.head()


async def test_close_while_open_runs_closes_the_postgres_pool() -> None:
    base = os.environ.get("EVSTORE_TEST_POSTGRES_URL", "").strip()
    if not base:
        pytest.skip("no PostgreSQL server (EVSTORE_TEST_POSTGRES_URL)")
    import asyncpg

    schema = f"rev21life_t_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(base)
    await admin.execute(f"CREATE SCHEMA {schema}")
    try:
        sep = "&" if "?" in base else "?"
        url = f"{base}{sep}search_path={schema}"
        leaked = []
        for delay in (0, 1, 3, 10):
            store = AllocationStore(make_backend(url))
            opening = asyncio.create_task(store.open())
            for _ in range(delay):
                await asyncio.sleep(0)
            await asyncio.gather(opening, store.close(), return_exceptions=True)
            pool = store.backend._pool  # type: ignore[attr-defined]
            if pool is not None:
                leaked.append(delay)
                await pool.close()
        assert not leaked, f"close() left the connection pool open (delays {leaked})"
    finally:
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()


async def test_reads_racing_close_raise_store_closed(tmp_path: Path) -> None:
    """The README: a closed store raises StoreClosed. A read queued on the aiosqlite thread
    after the connection's close (the connection is set to None only once both are closed) ran
    on the closed sqlite3 connection: sqlite3.ProgrammingError, a DatabaseError, turned into
    StorageError by ``_on_thread`` (which a caller may take for a storage fault and retry)."""
    url = f"sqlite:///{tmp_path}/s.db"
    rp = str(uuid.uuid4())
    async with open_store(url) as store:
        await store.create_provider(rp, "rp")
        await store.set_inventories(rp, {"VCPU": Inventory(total=8)}, generation=0)
    errors: list[str] = []

    async def reads(store: AllocationStore, kind: int) -> None:
        while True:  # (until the store is closed)
            if kind == 0:
                await store.head()
            elif kind == 1:
                await store.read(0, 5)
            else:
                await store.usage(rp)

    for _ in range(10):
        async with open_store(url) as store:
            readers = [asyncio.create_task(reads(store, k % 3)) for k in range(6)]
            await asyncio.sleep(0.01)
            await store.close()
            for outcome in await asyncio.gather(*readers, return_exceptions=True):
                if not isinstance(outcome, StoreClosed):
                    errors.append(f"{type(outcome).__name__}: {outcome}")
    assert not errors, f"{len(errors)}/60 reads racing close() were not StoreClosed: {errors[:2]}"


async def test_export_racing_close_raises_store_closed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url) as store:
        rp = str(uuid.uuid4())
        await store.create_provider(rp, "rp")
        await store.set_inventories(rp, {"VCPU": Inventory(total=10**6)}, generation=0)
        await asyncio.gather(
            *(
                store.set_allocations(
                    str(uuid.uuid4()),
                    {rp: {"VCPU": 1}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
                for _ in range(2000)
            )
        )
    errors: list[str] = []
    for _ in range(10):
        async with open_store(url) as store:

            async def export() -> int:
                return sum([1 async for _ in store.export(batch_size=5)])

            running = asyncio.create_task(export())
            await asyncio.sleep(0.02)
            await store.close()
            try:
                await running
            except StoreClosed:
                pass
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    assert not errors, f"export racing close() failed otherwise than StoreClosed: {errors[:2]}"


async def test_two_tasks_opening_one_store_both_get_it(tmp_path: Path) -> None:
    """A second open() while the first connects waits for it (it raised StoreClosed, 'being
    opened by another task', an odd answer for a store about to be open)."""
    store = AllocationStore(make_backend(f"sqlite:///{tmp_path}/s.db"))
    first, second = await asyncio.gather(store.open(), store.open())
    assert first is second is store
    assert await store.head() == 0
    await store.close()
    with pytest.raises(StoreClosed):
        await store.open()


async def test_postgres_reads_waiting_for_a_connection_when_close_begins_raise_store_closed() -> None:
    """Review 25: reads queued for a pooled connection when ``close()`` began were handed one
    by asyncpg (its ``Pool.close`` waits only for the connections held when it began) and then
    had it closed under them: ``StorageError`` ("Lost the connection to PostgreSQL ...: got
    result for unknown protocol state 3"), which a caller takes for a server fault, instead of
    ``StoreClosed`` (plus asyncpg's "Future exception was never retrieved")."""
    from tests.pg import fresh_database_url

    url = fresh_database_url()
    async with open_store(url):
        pass  # (the tables exist: the reads below only wait for connections)
    errors: list[str] = []
    for _ in range(5):
        store = await open_store(url, pool_size=2)
        reads = [asyncio.create_task(store.snapshot_positions()) for _ in range(20)]
        for _ in range(3):  # (the first two hold the connections, the others wait for them)
            await asyncio.sleep(0)
        await store.close()
        for outcome in await asyncio.gather(*reads, return_exceptions=True):
            if isinstance(outcome, BaseException) and not isinstance(outcome, StoreClosed):
                errors.append(f"{type(outcome).__name__}: {outcome}")
    assert not errors, f"{len(errors)}/100 reads racing close() were not StoreClosed: {errors[:2]}"


async def test_a_close_whose_task_a_shutdown_cancelled_before_it_began_is_done_by_the_next(
    store_url: str,
) -> None:
    """close() runs the closing in a task of its own (a cancelled close goes on in the
    background); a shutdown that cancels every task at once, right after a close() began,
    cancelled that task before its first step: nothing was closed (the writer task ran on, the
    connections stayed open), and every later close() - the ``async with``'s exit, a second try -
    raised CancelledError at once, though no one had cancelled it, and closed nothing either."""
    store = await open_store(store_url)
    await store.head()
    spared = asyncio.all_tasks()
    closing = asyncio.ensure_future(store.close())
    await asyncio.sleep(0)  # (close() made its closing task, which has not begun)
    for task in asyncio.all_tasks() - spared:
        task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.wait_for(store.close(), 60)  # (a hang guard, not a timing assertion)
    writer = store._writer
    assert writer is not None and writer.done()
    with pytest.raises(StoreClosed):
        await store.head()
