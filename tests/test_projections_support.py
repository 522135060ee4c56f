"""A random workload driven through the public store API (helpers for projection tests)."""

from __future__ import annotations

import random

from evstore import AllocationStore, EvstoreError, Inventory
from tests.conftest import new_uuid


async def random_workload(store: AllocationStore, seed: int, commands: int, providers: int = 4) -> None:
    """Builds, rewrites, migrations (reverted/confirmed), releases, deletes, inventory shrinks.

    Rejected commands are part of the workload (they must leave no trace)."""
    rng = random.Random(seed)
    nodes = []
    for i in range(providers):
        rp = new_uuid()
        await store.create_provider(rp, f"node-{seed}-{i}")
        await store.set_inventories(rp, {"VCPU": Inventory(total=16), "MEMORY_MB": Inventory(total=8192)}, 0)
        nodes.append(rp)
    live: dict[str, int] = {}  # instance -> generation
    migrations: dict[str, str] = {}  # migration -> instance
    deleted: list[str] = []
    for _ in range(commands):
        op = rng.random()
        try:
            if op < 0.30 or not live:
                c = new_uuid()
                await store.set_allocations(
                    c,
                    {rng.choice(nodes): {"VCPU": rng.randint(1, 4), "MEMORY_MB": 512 * rng.randint(1, 4)}},
                    project_id=rng.choice(["p1", "p2"]),
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
                live[c] = 1
            elif op < 0.40:
                c = rng.choice(sorted(live))
                await store.set_allocations(
                    c,
                    {rng.choice(nodes): {"VCPU": rng.randint(1, 2)}},
                    project_id="p1",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=live[c],
                )
                live[c] += 1
            elif op < 0.55:
                c = rng.choice(sorted(live))
                m = new_uuid()
                await store.start_migration(c, m)
                migrations[m] = c
                del live[c]
                await store.set_allocations(
                    c,
                    {rng.choice(nodes): {"VCPU": 1}},
                    project_id="p1",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
                live[c] = 1
            elif op < 0.70 and migrations:
                m = rng.choice(sorted(migrations))
                c = migrations.pop(m)
                if rng.random() < 0.5:
                    await store.revert_migration(m)
                    if c in live:
                        live[c] += 1
                else:
                    await store.confirm_migration(m)
            elif op < 0.80:
                c = rng.choice(sorted(live))
                await store.delete_consumer(c)
                live.pop(c)
                deleted.append(c)
            elif op < 0.85:
                c = rng.choice(sorted(live))
                await store.release(c)
                live.pop(c)
            elif op < 0.90 and deleted:
                # a late write for a deleted consumer: must be rejected
                await store.set_allocations(
                    rng.choice(deleted),
                    {rng.choice(nodes): {"VCPU": 1}},
                    project_id="p1",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
            else:
                rp = rng.choice(nodes)
                gen = (await store.usage(rp)).generation
                total = rng.randint(4, 24)
                await store.set_inventories(rp, {"VCPU": Inventory(total=total), "MEMORY_MB": 8192}, gen)
        except EvstoreError:
            pass
