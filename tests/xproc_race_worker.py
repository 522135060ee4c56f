"""A writer process for ``tests/test_cross_process_races.py``:
``python -m tests.xproc_race_worker URL SEED PROC N OUT``.

Four tasks race on instances and migrations that every process names alike (``inst-K``, ``mig-K-J``):
builds and rewrites with the generation just read, migrations started, reverted and confirmed, Nova's
move written as ``write_allocations``, releases and deletes - so one process's delete races another's
revert of the same migration. Every command carries a request id of its own, and what the store
answered (positions, or the error's code) is written to OUT, one JSON line per command, flushed.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from evstore import ConsumerAllocations, EvstoreError, Metadata, Receipt, open_store

NS = uuid.UUID("5d2c1a8e-9b7f-4c3d-8e6a-0f1b2c3d4e5f")
INSTANCES = 24


def _history_lag_from_env() -> None:
    """``EVSTORE_TEST_HISTORY_LAG``: index SQLite's history every that many events (a test's
    choice, so that this process's catch-ups interleave with other processes' work)."""
    if lag := os.environ.get("EVSTORE_TEST_HISTORY_LAG"):
        from evstore.log import sqlite

        sqlite.HISTORY_LAG = int(lag)


def shared_id(name: str) -> str:
    return str(uuid.uuid5(NS, name))


async def main(url: str, seed: int, proc: int, n: int, out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    counter = iter(range(1, 1 << 30))

    async with open_store(url) as store:
        providers = [u for u, _ in await store.providers()]

        async def run(
            op: str, fn: Callable[[Metadata | dict[str, Any], str | None], Awaitable[Receipt]]
        ) -> None:
            rid = f"x-{proc}-{next(counter)}"
            key = f"key-{rid}" if rng.random() < 0.2 else None
            line: dict[str, Any] = {"rid": rid, "op": op}
            try:
                receipt = await fn({"request_id": rid, "actor": f"proc-{proc}"}, key)
            except EvstoreError as exc:
                line.update(outcome="rejected", code=exc.code)
            else:
                line.update(outcome="accepted", positions=list(receipt.positions))
                if key is not None:  # the same command again, with the same key, from another request
                    again = await fn({"request_id": f"{rid}-again"}, key)
                    line.update(again=list(again.positions), replayed=again.replayed)
            os.write(fd, (json.dumps(line) + "\n").encode())

        async def task(t: int) -> None:
            trng = random.Random(seed * 7919 + proc * 101 + t)
            for _ in range(n):
                await step(trng)
                await asyncio.sleep(0)

        async def step(trng: random.Random) -> None:
            k = trng.randrange(INSTANCES)
            inst, mig = shared_id(f"inst-{seed}-{k}"), shared_id(f"mig-{seed}-{k}-{trng.randrange(2)}")
            project, user = f"project-{k % 3}", f"user-{k % 2}"
            op = trng.choices(
                ["write", "start", "revert", "confirm", "move", "release", "delete"],
                [30, 20, 20, 10, 8, 6, 4],
            )[0]
            if op == "write":
                try:
                    generation = (await store.allocations(inst)).generation
                except EvstoreError:
                    return
                allocs = {trng.choice(providers): {"VCPU": trng.choice([1, 2]), "MEMORY_MB": 512}}
                await run(
                    op,
                    lambda m, key: store.set_allocations(
                        inst,
                        allocs,
                        project_id=project,
                        user_id=user,
                        consumer_type="INSTANCE",
                        generation=generation,
                        metadata=m,
                        idempotency_key=key,
                    ),
                )
            elif op == "start":
                await run(
                    op, lambda m, key: store.start_migration(inst, mig, metadata=m, idempotency_key=key)
                )
            elif op == "revert":
                await run(op, lambda m, key: store.revert_migration(mig, metadata=m, idempotency_key=key))
            elif op == "confirm":
                await run(op, lambda m, key: store.confirm_migration(mig, metadata=m, idempotency_key=key))
            elif op == "release":
                await run(op, lambda m, key: store.release(inst, metadata=m, idempotency_key=key))
            elif op == "delete":
                await run(op, lambda m, key: store.delete_consumer(inst, metadata=m, idempotency_key=key))
            else:  # Nova's move_allocations: the instance emptied into the migration consumer
                view = await store.allocations(inst)
                if not view.allocations:
                    return
                body = {
                    inst: ConsumerAllocations(
                        allocations={},
                        project_id=project,
                        user_id=user,
                        consumer_type="INSTANCE",
                        consumer_generation=view.generation,
                    ),
                    mig: ConsumerAllocations(
                        allocations={p: dict(r) for p, r in view.allocations.items()},
                        project_id=project,
                        user_id=user,
                        consumer_type="MIGRATION",
                    ),
                }
                await run(op, lambda m, key: store.write_allocations(body, metadata=m, idempotency_key=key))

        rng = random.Random(seed * 31 + proc)
        await asyncio.gather(*(task(t) for t in range(4)))


if __name__ == "__main__":
    _history_lag_from_env()
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
