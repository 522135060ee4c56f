"""What subscribers that follow a busy log cost a store: K subscribers follow it from the head
while one task runs commands one after another and 64 tasks run commands concurrently, for
``--seconds``; then the store waits until every subscriber has delivered the last event.

    python -m tests.benchmarks.live_subscribers [--postgres URL] [--sizes 0,10,100,500] [--json PATH]

Reported per backend and K: commands/s (all 65 tasks), p50/p99 latency of the sequential task's
commands, the event loop thread's CPU share (``time.thread_time`` on the loop: decoding and
delivering there, not the SQLite reader thread's work) and the process's, the backend's ``read``
calls (per wake-up of the subscribers - one per group commit - and per event appended), and the
delivery latency of an event: from its ``recorded_at`` (taken as it was appended) to a
subscriber's receiving it, p50/p99 over up to 8 sampled subscribers and every event; "caught up"
is how long after the last command the last subscriber delivered the last event. Every
subscriber is checked to have received every event once, in order.

PostgreSQL runs when ``--postgres`` or ``EVSTORE_TEST_POSTGRES_URL`` names a server: a schema is
made for each measurement and dropped. Imports only ``evstore`` (and asyncpg), so it measures
whichever evstore is first on ``sys.path`` (``PYTHONPATH=/other/checkout`` for a before/after).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import evstore
from evstore import AllocationStore, Inventory, open_store
from tests.benchmarks.idle_subscribers import Counted, fresh_url

CONCURRENT = 64
SAMPLED = 8


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def wakeups(store: AllocationStore) -> int:
    """The store's wake-ups of its subscribers so far (one per group commit, and per poll that found
    appends of others: none here)."""
    return int(store._wakes)


async def allocate(store: AllocationStore, rp: str) -> int:
    receipt = await store.set_allocations(
        str(uuid.uuid4()),
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
    )
    assert receipt.position is not None
    return receipt.position


async def measure(url: str, k: int, seconds: float) -> dict[str, Any]:
    async with open_store(url) as store:
        providers = [str(uuid.uuid4()) for _ in range(8)]
        for i, rp in enumerate(providers):
            await store.create_provider(rp, f"live-bench-{i}")
            await store.set_inventories(rp, {"VCPU": Inventory(total=10_000_000)}, generation=0)
        start = await store.head()
        counted = Counted(store)
        delivered = [start] * k
        latencies: list[float] = []
        sampled = set(range(0, k, max(1, k // SAMPLED))) if k else set()

        async def follow(i: int) -> None:
            expected = start
            timed = i in sampled
            async for event in store.subscribe(after=start):
                expected += 1
                if event.position != expected:
                    raise AssertionError(f"subscriber {i}: got {event.position}, expected {expected}")
                if timed:
                    latencies.append(time.time() - event.recorded_at.timestamp())
                delivered[i] = expected

        subscribers = [asyncio.create_task(follow(i)) for i in range(k)]
        while len(store._idle) < k:  # (each has read the log: now they wait for appends)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        reads = counted.reads
        wakes = wakeups(store)
        stop = False
        sequential: list[float] = []
        done = 0

        async def one_by_one() -> None:
            nonlocal done
            i = 0
            while not stop:
                t0 = time.perf_counter()
                await allocate(store, providers[i % len(providers)])
                sequential.append(time.perf_counter() - t0)
                done += 1
                i += 1

        async def concurrently(j: int) -> None:
            nonlocal done
            while not stop:
                await allocate(store, providers[j % len(providers)])
                done += 1

        loop_cpu, cpu, wall = time.thread_time(), time.process_time(), time.perf_counter()
        workers = [asyncio.create_task(one_by_one())] + [
            asyncio.create_task(concurrently(j)) for j in range(CONCURRENT)
        ]
        await asyncio.sleep(seconds)
        stop = True
        await asyncio.gather(*workers)
        wall_commands = time.perf_counter() - wall
        head = await store.head()
        while any(d < head for d in delivered):
            for task in subscribers:
                if task.done():
                    task.result()  # (a subscriber that failed: its error)
            await asyncio.sleep(0.005)
        caught_up = time.perf_counter() - wall - wall_commands
        loop_cpu, cpu = time.thread_time() - loop_cpu, time.process_time() - cpu
        wall = time.perf_counter() - wall
        reads = counted.reads - reads
        wakes = wakeups(store) - wakes
        for task in subscribers:
            task.cancel()
        await asyncio.gather(*subscribers, return_exceptions=True)
    events = head - start
    return {
        "subscribers": k,
        "commands": done,
        "commands_per_s": done / wall_commands,
        "command_p50_ms": quantile(sequential, 0.5) * 1000,
        "command_p99_ms": quantile(sequential, 0.99) * 1000,
        "loop_cpu_share": loop_cpu / wall,
        "process_cpu_share": cpu / wall,
        "reads": reads,
        "events": events,
        "wakeups": wakes,
        "reads_per_wakeup": reads / max(1, wakes),
        "reads_per_event": reads / max(1, events),
        "delivery_p50_ms": quantile(latencies, 0.5) * 1000,
        "delivery_p99_ms": quantile(latencies, 0.99) * 1000,
        "caught_up_after_s": caught_up,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(s) for s in args.sizes.split(",")]
    backends = [b for b in args.backends.split(",") if b == "sqlite" or args.postgres]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for backend in backends:
            for k in sizes:
                async with fresh_url(backend, args.postgres, Path(tmp)) as url:
                    row = {"backend": backend, **await measure(url, k, args.seconds)}
                rows.append(row)
                print(
                    f"{backend:8} {k:4} subscribers: {row['commands_per_s']:7.0f} commands/s, "
                    f"p50 {row['command_p50_ms']:6.2f} ms, p99 {row['command_p99_ms']:7.2f} ms; "
                    f"loop CPU {row['loop_cpu_share']:6.1%}, process {row['process_cpu_share']:6.1%}; "
                    f"{row['reads']:6} reads ({row['reads_per_wakeup']:6.1f}/wake-up, "
                    f"{row['reads_per_event']:5.2f}/event); delivery p50 {row['delivery_p50_ms']:7.1f} ms, "
                    f"p99 {row['delivery_p99_ms']:7.1f} ms; caught up {row['caught_up_after_s']:5.2f} s",
                    flush=True,
                )
    return {"evstore": evstore.__file__, "python": sys.version.split()[0], "rows": rows}


if __name__ == "__main__":
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", default=os.environ.get("EVSTORE_TEST_POSTGRES_URL") or None)
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--sizes", default="0,10,100,500")
    parser.add_argument("--seconds", type=float, default=4.0, help="seconds of commands measured")
    parser.add_argument("--json", type=Path)
    ns = parser.parse_args()
    result = asyncio.run(main(ns))
    print(f"(evstore from {result['evstore']})")
    if ns.json is not None:
        ns.json.write_text(json.dumps(result, indent=2) + "\n")
