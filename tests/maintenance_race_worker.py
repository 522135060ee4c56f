"""A maintenance process for ``tests/test_maintenance_races.py``:
``python -m tests.maintenance_race_worker URL SEED OPS STOP OUT``.

Until the file STOP exists, runs maintenance operations picked at random from OPS (comma-separated:
``rebuild``, ``rebuild_full``, ``snapshots``, ``audit``, ``time_travel``, ``export``, ``open_ro``,
``cancelled``: one of the others given up on at a random moment, then a command) on a store others
write, and writes one JSON line per operation to OUT: the operation, and what it found wrong
(``problem``); a command's outcome also to OUT.commands, as ``tests/xproc_race_worker.py`` writes
its own. Each open of the store is its own, so other processes see this one as any other.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any

from evstore import AllocationStore, EvstoreError, SchemaVersionError, open_store

OPS = ("rebuild", "rebuild_full", "snapshots", "audit", "time_travel", "export", "open_ro", "cancelled")


def _history_lag_from_env() -> None:
    """``EVSTORE_TEST_HISTORY_LAG``: index SQLite's history every that many events (a test's
    choice, so that this process's catch-ups interleave with other processes' work)."""
    if lag := os.environ.get("EVSTORE_TEST_HISTORY_LAG"):
        from evstore.log import sqlite

        sqlite.HISTORY_LAG = int(lag)


async def one(store: AllocationStore | None, url: str, op: str, rng: random.Random) -> dict[str, Any]:
    line: dict[str, Any] = {"op": op}
    if op == "open_ro":
        try:
            async with open_store(url, upgrade=False) as other:
                line["head"] = await other.head()
        except SchemaVersionError as exc:  # (an older store not upgraded yet: refused, nothing written)
            if exc.details.get("found") == exc.details.get("supported"):
                # (a current store refused as needing a repair: the upgrade's own refold, under
                # way in another process, which the open waits for)
                line["problem"] = f"refused a store of this version: {exc.message[:300]}"
            else:
                line["refused"] = True
        return line
    assert store is not None
    if op == "cancelled":  # another operation, given up on at a random moment; then a command
        inner = rng.choice([o for o in OPS if o not in ("cancelled", "open_ro")])
        try:
            async with asyncio.timeout(rng.uniform(0, 0.05)):
                await one(store, url, inner, rng)
        except TimeoutError:
            line["gave_up"] = inner
        rid = f"m-{uuid.uuid4()}"
        receipt = await store.delete_consumer(str(uuid.uuid4()), metadata={"request_id": rid})
        # (as tests/xproc_race_worker.py records its commands, for the outside fold's check)
        line["command"] = {
            "rid": rid,
            "op": "delete",
            "outcome": "accepted",
            "positions": list(receipt.positions),
        }
    elif op == "rebuild":
        line["folded"] = await store.rebuild(batch_size=rng.choice([7, 100, 5000]))
    elif op == "rebuild_full":
        line["folded"] = await store.rebuild(batch_size=rng.choice([7, 100, 5000]), full=True)
    elif op == "snapshots":
        line["saved"] = len(await store.take_snapshots())
    elif op == "audit":
        report = await store.audit(history=rng.random() < 0.5)
        if not report.clean:
            line["problem"] = [str(f) for f in report.findings[:5]]
    elif op == "time_travel":
        head = await store.head()
        if head:
            pos = rng.randint(1, head)
            view = await store.state_at(position=pos)
            folded = await store.replay(pos)
            if view.state != folded:
                line["problem"] = f"state_at({pos}) differs from replay({pos})"
            a = rng.randint(0, pos)
            await store.diff(a, pos)
    elif op == "export":
        positions = []
        async for text in store.export(batch_size=rng.choice([3, 1000])):
            row = json.loads(text)
            if "position" in row:
                positions.append(row["position"])
        if positions != list(range(1, len(positions) + 1)):
            line["problem"] = f"export positions not 1..n: {positions[:5]}..."
        line["rows"] = len(positions)
    return line


async def main(url: str, seed: int, ops: list[str], stop: Path, out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    cfd = os.open(out_path + ".commands", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    rng = random.Random(seed)
    # (EVSTORE_TEST_SNAPSHOT_EVERY: a test whose log grows long keeps the snapshots few)
    every = int(os.environ.get("EVSTORE_TEST_SNAPSHOT_EVERY", 0)) or rng.choice([5, 17, 50])
    # (only opened when an operation needs it: an open upgrades an older store)
    store = None if ops == ["open_ro"] else await open_store(url, snapshot_every=every)
    try:
        while not stop.exists():
            op = rng.choice(ops)
            try:
                line = await one(store, url, op, rng)
            except EvstoreError as exc:
                line = {"op": op, "problem": f"{type(exc).__name__} {exc.code}: {exc}"}
            os.write(fd, (json.dumps(line) + "\n").encode())
            if "command" in line:
                os.write(cfd, (json.dumps(line["command"]) + "\n").encode())
    finally:
        if store is not None:
            await store.close()


if __name__ == "__main__":
    _history_lag_from_env()
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3].split(","), Path(sys.argv[4]), sys.argv[5]))
