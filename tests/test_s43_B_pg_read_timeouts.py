"""Reads that run out of PostgreSQL's ``command_timeout`` fail as ``evstore.storage`` (stop 43, helper B).

Found by the history checker (``tests/test_s43_B_histories.py::test_postgres_under_tight_timeouts``):
under a short ``command_timeout``, a read (``allocations``) that ran out of it raised asyncpg's bare
``InterfaceError: cannot call Connection.terminate(): connection has been released back to the
pool`` instead of the ``StorageError`` README promises ("a read as ``evstore.storage``"): the
``StorageError`` is raised inside ``_connection``, whose handler for a timed-out statement then
terminates a connection asyncpg had already given back, and that error replaces it. (Fixed by the
lead: a connection asyncpg closed already is not terminated again.)
"""

from __future__ import annotations

import asyncio
import collections
import random
import uuid
from urllib.parse import parse_qsl, urlsplit

import asyncpg

from evstore import EvstoreError, open_store


async def test_reads_running_out_of_command_timeout_fail_as_storage_errors(pg_url: str) -> None:
    """Reads wait for a table another session locks and unlocks in turn (README: without a
    command_timeout such a read would wait for ever), so they run out of the timeout at every
    stage of a read."""
    async with open_store(pg_url) as setup:
        await setup.create_provider(str(uuid.uuid4()), "rp")
    seen: collections.Counter[str] = collections.Counter()
    bare: list[BaseException] = []
    rng = random.Random(43)
    async with open_store(pg_url, command_timeout=0.05) as store:
        await store.allocations(str(uuid.uuid4()))  # (the pool's connections made)
        locker = await asyncpg.connect(pg_url.split("?")[0], server_settings={"search_path": _schema(pg_url)})
        done = asyncio.Event()

        async def lock_and_unlock() -> None:
            while not done.is_set():
                async with locker.transaction():
                    await locker.execute("LOCK TABLE p_consumers IN ACCESS EXCLUSIVE MODE")
                    await asyncio.sleep(rng.uniform(0, 0.08))
                await asyncio.sleep(rng.uniform(0, 0.01))

        async def reader() -> None:
            for _ in range(40):
                try:
                    await store.allocations(str(uuid.uuid4()))
                    seen["answered"] += 1
                except EvstoreError as exc:
                    seen[exc.code] += 1
                except Exception as exc:
                    bare.append(exc)

        locking = asyncio.create_task(lock_and_unlock())
        try:
            async with asyncio.timeout(60):
                await asyncio.gather(*(reader() for _ in range(8)))
        finally:
            done.set()
            await locking
            await locker.close()
    assert not bare, f"{len(bare)} bare errors ({dict(seen)} besides), the first: {bare[0]!r}"


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]
