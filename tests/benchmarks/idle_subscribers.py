"""What idle subscribers cost a store: the process's CPU share and the backend reads per second
while N subscribers wait for appends and nothing is appended, then the latency of occasional
commands with them (a command every ``--gap`` seconds, so the reads each commit's wake-up
causes are over before the next one).

    python -m tests.benchmarks.idle_subscribers [--postgres URL] [--sizes 0,100,500] [--json PATH]

PostgreSQL runs when ``--postgres`` or ``EVSTORE_TEST_POSTGRES_URL`` names a server: a schema is
made for each measurement and dropped. Imports only ``evstore`` (and asyncpg), so it measures
whichever evstore is first on ``sys.path`` (``PYTHONPATH=/other/checkout`` for a before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import evstore
from evstore import AllocationStore, Inventory, open_store


class Counted:
    """Counts the store's backend's ``read`` and ``head`` calls (wrapped on the instance)."""

    def __init__(self, store: AllocationStore) -> None:
        self.reads = self.heads = 0
        backend: Any = store.backend
        read, head = backend.read, backend.head

        async def counted_read(after: int, limit: int) -> Any:
            self.reads += 1
            return await read(after, limit)

        async def counted_head() -> int:
            self.heads += 1
            return int(await head())

        backend.read = counted_read
        backend.head = counted_head


@asynccontextmanager
async def fresh_url(backend: str, pg: str | None, workdir: Path) -> AsyncIterator[str]:
    if backend == "sqlite":
        yield f"sqlite:///{workdir}/{uuid.uuid4().hex}.db"
        return
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    assert pg is not None
    schema = f"evbench_idle_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(pg)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        parts = urlsplit(pg)
        query = [(k, v) for k, v in parse_qsl(parts.query) if k != "search_path"] + [("search_path", schema)]
        yield urlunsplit(parts._replace(query=urlencode(query)))
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


async def measure(url: str, n: int, idle_seconds: float, commands: int, gap: float) -> dict[str, Any]:
    async with open_store(url) as store:
        rp = str(uuid.uuid4())
        await store.create_provider(rp, "idle-bench")
        await store.set_inventories(rp, {"VCPU": Inventory(total=1_000_000)}, generation=0)
        head = await store.head()

        async def follow() -> None:
            async for _ in store.subscribe(after=head):
                pass

        counted = Counted(store)
        subscribers = [asyncio.create_task(follow()) for _ in range(n)]
        while len(store._idle) < n:  # (each has read the log: now they wait for appends)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.5)
        reads, heads = counted.reads, counted.heads
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.sleep(idle_seconds)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        reads, heads = counted.reads - reads, counted.heads - heads
        latencies: list[float] = []
        for _ in range(commands):
            await asyncio.sleep(gap)
            t0 = time.perf_counter()
            await store.set_allocations(
                str(uuid.uuid4()),
                {rp: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
            latencies.append(time.perf_counter() - t0)
        for task in subscribers:
            task.cancel()
        await asyncio.gather(*subscribers, return_exceptions=True)
    latencies.sort()
    return {
        "subscribers": n,
        "idle_cpu_share": cpu / wall,
        "idle_reads_per_s": reads / wall,
        "idle_heads_per_s": heads / wall,
        "command_p50_ms": statistics.median(latencies) * 1000,
        "command_p90_ms": latencies[int(0.9 * (len(latencies) - 1))] * 1000,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = ["sqlite"] + (["postgres"] if args.postgres else [])
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            for n in sizes:
                async with fresh_url(backend, args.postgres, Path(tmp)) as url:
                    row = {"backend": backend, **await measure(url, n, args.idle, args.commands, args.gap)}
                rows.append(row)
                print(
                    f"{backend:8} {n:4} idle subscribers: CPU {row['idle_cpu_share']:6.1%} of a core, "
                    f"{row['idle_reads_per_s']:7.1f} reads/s, {row['idle_heads_per_s']:5.1f} heads/s; "
                    f"command p50 {row['command_p50_ms']:6.2f} ms, p90 {row['command_p90_ms']:6.2f} ms",
                    flush=True,
                )
    return {"evstore": evstore.__file__, "python": sys.version.split()[0], "rows": rows}


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", default=os.environ.get("EVSTORE_TEST_POSTGRES_URL") or None)
    parser.add_argument("--sizes", default="0,100,500")
    parser.add_argument("--idle", type=float, default=3.0, help="seconds measured idle")
    parser.add_argument("--commands", type=int, default=20)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between commands")
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    print(f"(evstore from {result['evstore']})")
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=2) + "\n")
