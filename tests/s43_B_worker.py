"""Clients for the history checker of ``tests/test_s43_B_histories.py``.

``python -m tests.s43_B_worker URL SEED PROC TASKS N OUT``: TASKS asyncio clients in one store,
each issuing N random commands on entities every client and process names alike (so they race),
each command written to OUT as one JSON line, flushed: what was asked (``op`` and ``args``), the
request id it carried, when it was invoked and when its answer came (``time.monotonic_ns()``:
CLOCK_MONOTONIC, one clock for every process of the machine), and the answer - positions (and
``replayed``), or the error's code. The test runs the same clients in its own process too
(``client``), on one store or several.

An instance slot's instance, once a client finds it deleted, is followed by a new one (its
migrations too), so that deletes do not leave nothing to race on. The mix: claims
(``set_allocations`` with the generation just read, or none; a few under a key of their own,
sent twice at once and then once more), migrations started (``start_migration``, and Nova's move
written as ``write_allocations``), reverted and confirmed, releases, deletes (half of them under
an idempotency key every client shares, so keyed deletes race each other), inventory changes
with a generation (``set_inventories``, ``set_inventory``: totals shrinking below usage,
``max_unit`` lowered, a class dropped) and without one
(``delete_inventory``), and spare providers created and deleted. A few commands are given a short
deadline (``asyncio.timeout``) and a key of their own; one that times out is recorded so
(``outcome`` "timeout") and repeated with its key, as README says a caller learns its outcome.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from evstore import AllocationStore, ConsumerAllocations, EvstoreError, Inventory, Receipt, open_store

NS = uuid.UUID("0b5e4c2a-43b0-4d6e-9f1a-5a43b0000000")
INSTANCES = 8
COMPUTES = 3
SPARES = 2
#: each command's weight in the mix
MIX = {"claim": 26, "start": 12, "move": 5, "revert": 12, "confirm": 6, "release": 3, "delete": 6}
MIX.update(setinv=9, setone=4, delinv=4, create=3, delprov=3)
#: the share of the commands below given a deadline (``asyncio.timeout``) and a key of their own:
#: one that times out is repeated with its key, which tells what became of it
TIMED = 0.08
TIMED_OPS = ("claim", "start", "move", "revert", "confirm", "release", "create", "delprov")


def shared_id(seed: int, name: str) -> str:
    return str(uuid.uuid5(NS, f"{seed}-{name}"))


def computes(seed: int) -> list[str]:
    return [shared_id(seed, f"cn-{i}") for i in range(COMPUTES)]


def spares(seed: int) -> list[str]:
    return [shared_id(seed, f"sp-{i}") for i in range(SPARES)]


def spare_name(seed: int, provider: str) -> str:
    return f"spare-{seed}-{spares(seed).index(provider)}"


def inventories(vcpu_total: int = 8, vcpu_max: int = 2147483647, disk: bool = True) -> dict[str, Inventory]:
    out = {
        "VCPU": Inventory(total=vcpu_total, max_unit=vcpu_max),
        "MEMORY_MB": Inventory(total=4096, reserved=512),
    }
    if disk:
        out["DISK_GB"] = Inventory(total=100, step_size=10)
    return out


async def set_up(store: AllocationStore, seed: int) -> None:
    """The compute nodes (permanent) and the first spare provider."""
    for i, p in enumerate(computes(seed)):
        await store.create_provider(p, f"cn-{seed}-{i}")
        await store.set_inventories(p, inventories(), generation=0)
    sp = spares(seed)[0]
    await store.create_provider(sp, spare_name(seed, sp))
    await store.set_inventories(sp, inventories(), generation=0)


def _inventory_args(invs: dict[str, Inventory]) -> dict[str, dict[str, Any]]:
    return {rc: inv.model_dump() for rc, inv in invs.items()}


async def client(
    store: AllocationStore, seed: int, name: str, n: int, sink: Callable[[dict[str, Any]], None]
) -> None:
    """N random commands, each recorded by ``sink``."""
    rng = random.Random(f"{seed}-{name}")
    counter = iter(range(1, 1 << 30))
    providers = computes(seed) + spares(seed)

    async def run(
        op: str, args: dict[str, Any], fn: Callable[..., Awaitable[Receipt | int]], key: str | None = None
    ) -> None:
        rid = f"h-{name}-{next(counter)}"
        deadline = None
        if key is None and op in TIMED_OPS and rng.random() < TIMED:
            key, deadline = f"timed-{rid}", rng.choice([0.0, 0.0002, 0.001, 0.005])
        line: dict[str, Any] = {"rid": rid, "client": name, "op": op, "args": args, "key": key}
        metadata = {"request_id": rid, "actor": name}
        line["inv"] = time.monotonic_ns()
        try:
            async with asyncio.timeout(deadline):
                answer = await fn(metadata=metadata, idempotency_key=key)
        except TimeoutError:  # (only with a deadline: its outcome unknown, learnt by repeating it)
            line.update(resp=time.monotonic_ns(), outcome="timeout")
            sink(line)
            await run(op, args, fn, key)
            return
        except EvstoreError as exc:
            line["resp"] = time.monotonic_ns()
            line.update(outcome="rejected", code=exc.code, message=str(exc)[:300])
            if exc.code == "evstore.storage":  # (whether it may have committed)
                line["details"] = {
                    k: exc.details.get(k) for k in ("outcome_unknown", "committed", "transient", "sqlstate")
                }
        except Exception as exc:  # (recorded: the checker fails on it, naming it)
            line["resp"] = time.monotonic_ns()
            line.update(outcome="crashed", code=type(exc).__name__, message=repr(exc)[:300])
        else:
            line["resp"] = time.monotonic_ns()
            line["outcome"] = "accepted"
            if isinstance(answer, int):  # an inventory command: the provider's new generation
                line.update(generation=answer, positions=None)
            else:
                line.update(positions=list(answer.positions), replayed=answer.replayed)
        sink(line)

    async def read(op: str, args: dict[str, Any], fn: Callable[[], Awaitable[Any]]) -> Any:
        """A read, recorded as a command is (``outcome`` "read", ``answer`` what it said)."""
        line: dict[str, Any] = {"rid": f"h-{name}-{next(counter)}", "client": name, "op": op, "args": args}
        line.update(key=None, inv=time.monotonic_ns())
        try:
            view = await fn()
        except EvstoreError as exc:
            line.update(resp=time.monotonic_ns(), outcome="read", answer={"code": exc.code})
            sink(line)
            raise
        except Exception as exc:  # (recorded: the checker fails on it, naming it)
            line.update(resp=time.monotonic_ns(), outcome="crashed", code=type(exc).__name__)
            line["message"] = repr(exc)[:300]
            sink(line)
            raise
        line.update(resp=time.monotonic_ns(), outcome="read")
        if op == "read_consumer":
            line["answer"] = {
                "allocations": view.allocations,
                "generation": view.generation,
                "deleted": view.deleted,
            }
        elif op == "read_inventories":
            line["answer"] = {"generation": view.generation, "inventories": view.to_dict()["inventories"]}
        else:  # read_usage
            line["answer"] = {"generation": view.generation, "usages": dict(view)}
        sink(line)
        return view

    def consumer(c: str) -> Awaitable[Any]:
        return read("read_consumer", {"consumer": c}, lambda: store.allocations(c))

    epoch = [0] * INSTANCES  # a slot's instance, once deleted, is followed by a new one

    async def step() -> None:
        k = rng.randrange(INSTANCES)
        inst = shared_id(seed, f"inst-{k}-{epoch[k]}")
        if (await consumer(inst)).deleted:
            epoch[k] += 1
            inst = shared_id(seed, f"inst-{k}-{epoch[k]}")
        mig = shared_id(seed, f"mig-{k}-{epoch[k]}-{rng.randrange(2)}")
        op = rng.choices(list(MIX), list(MIX.values()))[0]
        if op == "claim":
            generation = (await consumer(inst)).generation
            if rng.random() < 0.15:
                generation = None  # blind: "I expect it absent"
            allocs: dict[str, dict[str, int]] = {
                rng.choice(providers): {"VCPU": rng.randint(1, 4), "MEMORY_MB": rng.choice([256, 512, 1024])}
            }
            if rng.random() < 0.3:
                allocs[rng.choice(providers)] = {"DISK_GB": 10}
            args = {"consumer": inst, "allocations": allocs, "generation": generation}

            def claim(**kw: Any) -> Awaitable[Receipt]:
                return store.set_allocations(
                    inst,
                    allocs,
                    project_id=f"project-{k % 2}",
                    user_id="user",
                    consumer_type="INSTANCE",
                    generation=generation,
                    **kw,
                )

            if rng.random() < 0.12:  # under a key of its own: twice at once, then once more
                key = f"claim-{name}-{rng.getrandbits(48)}"
                await asyncio.gather(run(op, args, claim, key), run(op, args, claim, key))
                await run(op, args, claim, key)
            else:
                await run(op, args, claim)
        elif op == "start":
            await run(
                op, {"instance": inst, "migration": mig}, lambda **kw: store.start_migration(inst, mig, **kw)
            )
        elif op == "move":  # Nova's move_allocations: the instance emptied into the migration
            view = await consumer(inst)
            if not view.allocations or view.project_id is None or view.user_id is None:
                return
            held = {p: dict(r) for p, r in view.allocations.items()}
            body = {
                inst: ConsumerAllocations(
                    allocations={},
                    project_id=view.project_id,
                    user_id=view.user_id,
                    consumer_type="INSTANCE",
                    consumer_generation=view.generation,
                ),
                mig: ConsumerAllocations(
                    allocations=held,
                    project_id=view.project_id,
                    user_id=view.user_id,
                    consumer_type="MIGRATION",
                ),
            }
            args = {"instance": inst, "migration": mig, "allocations": held, "generation": view.generation}
            await run(op, args, lambda **kw: store.write_allocations(body, **kw))
        elif op == "revert":
            await run(op, {"migration": mig}, lambda **kw: store.revert_migration(mig, **kw))
        elif op == "confirm":
            await run(op, {"migration": mig}, lambda **kw: store.confirm_migration(mig, **kw))
        elif op == "release":
            await run(op, {"consumer": inst}, lambda **kw: store.release(inst, **kw))
        elif op == "delete":
            key = f"del-{inst}" if rng.random() < 0.5 else None
            await run(op, {"consumer": inst}, lambda **kw: store.delete_consumer(inst, **kw), key)
        elif op in ("setinv", "setone"):
            p = rng.choice(providers)
            try:
                generation = (
                    await read("read_inventories", {"provider": p}, lambda: store.inventories(p))
                ).generation
            except EvstoreError:
                generation = 0  # (a spare provider deleted: refused, ProviderNotFound)
            if op == "setinv":
                invs = inventories(
                    vcpu_total=rng.choice([2, 4, 8, 8, 12]),
                    vcpu_max=rng.choice([2, 2147483647, 2147483647]),
                    disk=rng.random() < 0.7,
                )
                args = {"provider": p, "inventories": _inventory_args(invs), "generation": generation}
                await run(op, args, lambda **kw: store.set_inventories(p, invs, generation, **kw))
            else:
                inv = Inventory(total=rng.choice([50, 100]), step_size=10)
                args = {
                    "provider": p,
                    "resource_class": "DISK_GB",
                    "inventory": inv.model_dump(),
                    "generation": generation,
                }
                await run(op, args, lambda **kw: store.set_inventory(p, "DISK_GB", inv, generation, **kw))
        elif op == "delinv":
            p = rng.choice(providers)
            args = {"provider": p, "resource_class": "DISK_GB"}
            await run(op, args, lambda **kw: store.delete_inventory(p, "DISK_GB", **kw))
        elif op == "create":
            p = rng.choice(spares(seed))
            nm = spare_name(seed, p)
            await run(op, {"provider": p, "name": nm}, lambda **kw: store.create_provider(p, nm, **kw))
        else:  # delprov
            p = rng.choice(spares(seed))
            await run(op, {"provider": p}, lambda **kw: store.delete_provider(p, **kw))

    async def usage() -> None:
        p = rng.choice(providers)
        try:
            await read("read_usage", {"provider": p}, lambda: store.usage(p))
        except Exception:
            pass  # (recorded)

    for _ in range(n):
        if rng.random() < 0.2:
            await usage()
        try:
            await step()
        except EvstoreError as exc:  # a read before the command failed (recorded): skip it
            if exc.code != "evstore.storage":
                raise
        except Exception:  # (a read's bare error, recorded as "crashed": the checker names it)
            pass
        await asyncio.sleep(0)


async def main(url: str, seed: int, proc: int, tasks: int, n: int, out_path: str) -> None:
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)

    def sink(line: dict[str, Any]) -> None:
        os.write(fd, (json.dumps(line) + "\n").encode())

    try:
        async with open_store(url) as store:
            await asyncio.gather(*(client(store, seed, f"p{proc}t{t}", n, sink) for t in range(tasks)))
    finally:
        os.close(fd)


def history_lag_from_env() -> None:
    """``EVSTORE_TEST_HISTORY_LAG``: index SQLite's history every that many events (so that the
    processes' catch-ups interleave with each other's appends)."""
    if lag := os.environ.get("EVSTORE_TEST_HISTORY_LAG"):
        from evstore.log import sqlite

        sqlite.HISTORY_LAG = int(lag)


if __name__ == "__main__":
    history_lag_from_env()
    a = sys.argv
    asyncio.run(main(a[1], int(a[2]), int(a[3]), int(a[4]), int(a[5]), a[6]))
