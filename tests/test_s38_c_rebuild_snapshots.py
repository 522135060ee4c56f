"""A rebuild forgets the time-travel snapshots with the projection it rewrites, in one
transaction: no crash leaves the snapshots of an older fold behind a rebuilt projection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from evstore import open_store
from projections.replay import replay
from projections.snapshots import encode_state
from tests.conftest import allocate, make_provider, new_uuid

ROOT = Path(__file__).resolve().parent.parent

_REBUILD_KILLED_AFTER_ITS_COMMIT = """
import asyncio, os, signal, sys
from evstore import open_store

async def main(url):
    async with open_store(url) as store:
        async def killed(self):  # (SIGKILL just after the rebuild's transaction, where it dropped them)
            os.kill(os.getpid(), signal.SIGKILL)
        type(store.backend).drop_snapshots = killed
        await store.rebuild()

asyncio.run(main(sys.argv[1]))
"""


async def test_a_rebuild_killed_after_its_commit_leaves_no_snapshot_of_an_older_fold(store_url: str) -> None:
    """Regression: a rebuild dropped the time-travel snapshots in a transaction of its own after
    its rewrite of the projection committed; SIGKILLed between the two, it left the snapshots a
    rebuild is run to forget - those an evstore whose fold differed took (stand-in here: a
    snapshot re-encoded with other allocations, its digest and its event's hash intact) - and
    time travel went on answering from them. The snapshots are now dropped in the rebuild's
    own transaction."""
    async with open_store(store_url, snapshot_every=5) as store:
        rp = await make_provider(store, VCPU=100)
        for _ in range(8):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await store.take_snapshots()
        assert 5 in await store.snapshot_positions()
        older = await replay(store.backend.read, 5)
        holder = next(c for c in older.consumers.values() if c.allocations)
        holder.allocations[rp]["VCPU"] = 3  # (what an older fold got wrong)
        older.providers[rp].usages["VCPU"] += 2
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper("DELETE FROM snapshots WHERE position <> 5")
        await tamper("UPDATE snapshots SET state = ? WHERE position = 5", (encode_state(older),))
        truth = await replay(store.backend.read, 6)
        assert (await store.state_at(position=6)).state != truth  # (proof the snapshot is used)
    done = subprocess.run(
        [sys.executable, "-c", _REBUILD_KILLED_AFTER_ITS_COMMIT, store_url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, -9), done.stderr
    async with open_store(store_url, snapshot_every=5) as store:
        assert await store.snapshot_positions() == []
        assert (await store.state_at(position=6)).state == truth
        assert (await store.audit()).clean
