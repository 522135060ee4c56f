"""A writer process for the multi-process tests: ``python -m tests.mp_worker URL SEED N OUT``.

Hammers the shared providers named in the store with random builds, moves, releases, migrations
and deletes, and writes what the store acknowledged to OUT (JSON lines, flushed per command), so
the parent can check that nothing acknowledged was lost.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import uuid

from evstore import ConsumerAllocations, EvstoreError, open_store


async def main(url: str, seed: int, n: int, out_path: str) -> None:
    rng = random.Random(seed)
    with open(out_path, "w") as out:
        async with open_store(url) as store:
            providers = [u for u, _ in await store.providers()]
            live: list[str] = []
            migrations: dict[str, str] = {}

            async def one(i: int) -> None:
                op = rng.random()
                try:
                    if op < 0.45 or not live:
                        c = str(uuid.uuid4())
                        p = rng.choice(providers)
                        r = await store.set_allocations(
                            c,
                            {p: {"VCPU": rng.randint(1, 3)}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                            idempotency_key=f"{seed}-{i}",
                        )
                        live.append(c)
                    elif op < 0.6:
                        c = rng.choice(live)
                        m = str(uuid.uuid4())
                        migrations[m] = c
                        r = await store.start_migration(c, m)
                    elif op < 0.7 and migrations:
                        m = rng.choice(list(migrations))
                        migrations.pop(m, None)
                        r = await (
                            store.revert_migration(m) if rng.random() < 0.5 else store.confirm_migration(m)
                        )
                    elif op < 0.85:
                        c = rng.choice(live)
                        live.remove(c)
                        r = await store.delete_consumer(c)
                    else:
                        a, b = str(uuid.uuid4()), str(uuid.uuid4())
                        p = rng.choice(providers)
                        r = await store.write_allocations(
                            {
                                a: ConsumerAllocations(
                                    allocations={p: {"VCPU": 1}},
                                    project_id="p",
                                    user_id="u",
                                    consumer_type="INSTANCE",
                                    consumer_generation=None,
                                ),
                                b: ConsumerAllocations(
                                    allocations={p: {"VCPU": 1}},
                                    project_id="p",
                                    user_id="u",
                                    consumer_type="INSTANCE",
                                    consumer_generation=None,
                                ),
                            }
                        )
                        live.extend((a, b))
                except (EvstoreError, ValueError) as exc:
                    if not isinstance(exc, EvstoreError):
                        raise
                    out.write(json.dumps({"i": i, "rejected": exc.code}) + "\n")
                    return
                out.write(json.dumps({"i": i, "positions": list(r.positions)}) + "\n")
                out.flush()

            # a few concurrent tasks per process, so group commit and cross-process locking mix
            for start in range(0, n, 4):
                await asyncio.gather(*(one(i) for i in range(start, min(n, start + 4))))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
