"""What time travel's snapshots take on disk and cost, on a copy of a large log.

    python -m tests.benchmarks.snapshot_sizes --db LOG [--questions 7] [--seed 5] [--json PATH]

LOG is written once beforehand (``python -m tests.benchmarks.evstore_peer biglog --db LOG --events
300000``) and is copied first: the copy gets the snapshots, LOG is left as it was. On the copy:
``take_snapshots`` (every 10,000 events, the default), then whole-store questions at random
positions (``state_at``; median wall and CPU); then the bytes of the whole-store snapshots, of their
tombstone segments (rows at minus their position, SNAPSHOT_FORMAT 6) and of the provider slices,
against the events' payloads. To compare two trees, run it in each with ``PYTHONPATH`` set to the
tree (see the README's trap about ``-m``). On a loaded machine the CPU numbers hold better than the
wall ones.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from evstore import open_store


async def measure(db: str, questions: int, seed: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with open_store(f"sqlite:///{db}") as store:
        head = await store.head()
        cpu, wall = time.process_time(), time.perf_counter()
        taken = await store.take_snapshots()
        out["take_snapshots_wall_s"] = time.perf_counter() - wall
        out["take_snapshots_cpu_s"] = time.process_time() - cpu
        out["snapshots"] = len(taken)
        rng = random.Random(seed)
        walls, cpus = [], []
        for _ in range(questions):
            position = rng.randint(head // 10, head)
            cpu, wall = time.process_time(), time.perf_counter()
            view = await store.state_at(position)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
            del view
        out["question_wall_median_s"] = statistics.median(walls)
        out["question_cpu_median_s"] = statistics.median(cpus)
    conn = sqlite3.connect(db)
    try:

        def total(sql: str) -> float:
            return float(conn.execute(sql).fetchone()[0] or 0) / 1e6

        out["head"] = head
        out["whole_mb"] = total("SELECT sum(length(state)) FROM snapshots WHERE position > 0")
        out["segments_mb"] = total("SELECT sum(length(state)) FROM snapshots WHERE position < 0")
        out["slices_mb"] = total("SELECT sum(length(state)) FROM provider_snapshots")
        out["payloads_mb"] = total("SELECT sum(length(data) + length(metadata)) FROM events")
    finally:
        conn.close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--db", required=True, help="the log (copied first; left as it was)")
    p.add_argument("--questions", type=int, default=7)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as work:
        copy = str(Path(work) / "copy.db")
        shutil.copyfile(args.db, copy)
        out = asyncio.run(measure(copy, args.questions, args.seed))
    for key, value in out.items():
        print(f"{key:28} {value:,.3f}" if isinstance(value, float) else f"{key:28} {value:,}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
