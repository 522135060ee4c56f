"""Stop 40: a snapshot and its tombstone segment are two rows (see projections/snapshots.py), and a
rebuild's or drop_snapshots' DELETE of every snapshot could lock them in the other order than a
save under way: "deadlock detected" (found by test_maintenance_races under EVSTORE_SLOW=1, where a
rebuild failed with it). The DELETE now locks the table first, so it waits for the saves under way
and holds new ones back, holding no row meanwhile."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from evstore import open_store


async def test_dropping_snapshots_never_deadlocks_with_a_save_under_way(pg_url: str) -> None:
    """A save's order, played by hand: the snapshot's row locked first, then its segment's. The
    segment's row lies first in the table (saved first here), so a DELETE that scans the table and
    locks rows as it goes locks it, then waits for the snapshot's - which the save holds, while it
    waits for the segment's: a deadlock, one of the two refused after deadlock_timeout (1 s)."""
    async with open_store(pg_url) as store:
        backend: Any = store.backend
        await backend.save_snapshot(5, "h", 6, "snapshot", tombstones="segment")
        conn = await asyncpg.connect(pg_url)
        try:
            # (the segment's row first in the heap: rewritten before the snapshot's, it moves there)
            await conn.execute("UPDATE snapshots SET state = 'segment' WHERE position = -5")
            await conn.execute("UPDATE snapshots SET state = 'snapshot' WHERE position = 5")
            tx = conn.transaction()
            await tx.start()
            await conn.execute("UPDATE snapshots SET state = 'saving' WHERE position = 5")
            drop = asyncio.create_task(backend.drop_snapshots())
            await asyncio.sleep(0.5)  # (the DELETE under way: before the fix, -5 locked, 5 waited for)
            assert not drop.done()
            await asyncio.wait_for(
                conn.execute("UPDATE snapshots SET state = 'saving' WHERE position = -5"), 10
            )
            await tx.commit()
            await asyncio.wait_for(drop, 10)
        finally:
            await conn.close()
        assert await backend.snapshot_positions() == []
        assert await backend.load_tombstones(10, 6) == []
