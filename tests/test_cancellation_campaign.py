"""Cancellation campaign: callers that give up at any moment never poison the store.

Storms: many tasks issue every kind of public call (commands of every kind, reads, the log's
iterators, time travel, diff, audit, replay, snapshots, rebuild) against several stores sharing one
database, each under a random ``asyncio.timeout`` (0 to 20 ms) while another task cancels random
running calls (and, in one variant, PostgreSQL's command jobs, as a shutdown does). Then: every
pooled PostgreSQL connection is idle on the server (not 'idle in transaction', not 'active'), the
stores work and audit clean, a command whose caller heard success is in the log with exactly its
receipt's positions, one rejected left nothing, and one whose caller gave up is either wholly in or
wholly out (repeating it with its idempotency key answers the positions the log holds for the key).
A shutdown that cancels every task at once mid-storm is checked the same way on reopened stores.

Deterministic variants cancel a representative read and command at each of asyncpg's entry points
in turn (before the call, while it waits for the server, right after it answered, and twice), an
``open_store`` likewise, and SQLite's calls at each hop to a connection's thread.

CI runs short storms, on fresh connections only; ``EVSTORE_SLOW=1`` runs many longer storms, and
the entry points on warm connections (statements found in the cache) too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from evstore import (
    AllocationStore,
    ConsumerAllocations,
    EvstoreError,
    Inventory,
    Receipt,
    StorageError,
    open_store,
)
from tests.conftest import new_uuid

SLOW = os.environ.get("EVSTORE_SLOW") == "1"
SEEDS = range(12) if SLOW else range(2)
CALLS = 1500 if SLOW else 300  # per storm
IN_FLIGHT = 16
GUARD = 60.0  # a hang guard, not a timing assertion
DELAYS: tuple[float | None, ...] = (None, None, None, 0, 0.0001, 0.0003, 0.001, 0.002, 0.005, 0.01, 0.02)


@dataclass
class Ledger:
    """What each keyed command's caller heard."""

    ok: dict[str, Any] = field(default_factory=dict)  # key -> Receipt or int
    rejected: dict[str, EvstoreError] = field(default_factory=dict)
    gave_up: dict[str, Callable[[str], Awaitable[Any]]] = field(default_factory=dict)
    unexpected: list[str] = field(default_factory=list)


class _StoreOf:
    """One of a storm's stores, looked up at each call: a command repeated once the stores were
    reopened (after a shutdown) runs on the new ones."""

    def __init__(self, storm: Storm, index: int) -> None:
        self._storm, self._index = storm, index

    def __getattr__(self, name: str) -> Any:
        stores = self._storm.stores
        return getattr(stores[self._index % len(stores)], name)


class Storm:
    def __init__(self, stores: list[AllocationStore], rng: random.Random, cancel_jobs: bool = False) -> None:
        self.stores = stores
        self.rng = rng
        #: also cancel the commands' jobs (PostgreSQL runs each in a task of its own), as a
        #: shutdown cancelling every task does
        self.cancel_jobs = cancel_jobs
        self.jobs_cancelled = 0
        self.ledger = Ledger()
        self.providers: list[str] = []
        self.spare_providers: list[str] = []
        self.consumers: list[str] = []
        self.migrations: list[str] = []
        self.classes = 0
        self.keys = 0

    @property
    def store(self) -> AllocationStore:
        return self.rng.choice(self.stores)

    def provider(self) -> str:
        return self.rng.choice(self.providers)

    def consumer(self) -> str:
        return self.rng.choice(self.consumers) if self.consumers else new_uuid()

    def alloc(self) -> dict[str, dict[str, int]]:
        return {self.provider(): {"VCPU": self.rng.randint(1, 2)}}

    # --- the calls --------------------------------------------------------------------------

    def command(self) -> tuple[str, Callable[[str], Awaitable[Any]]]:
        """A random command, as a function of its idempotency key."""
        rng = self.rng
        s: Any = _StoreOf(self, rng.randrange(len(self.stores)))
        kind = rng.choice(
            [
                "create_provider",
                "rename_provider",
                "delete_provider",
                "set_inventories",
                "set_inventory",
                "delete_inventory",
                "create_resource_class",
                "set_allocations",
                "set_allocations",
                "write_allocations",
                "release",
                "start_migration",
                "revert_migration",
                "confirm_migration",
                "delete_consumer",
            ]
        )
        if kind == "create_provider":
            rp = new_uuid()
            self.spare_providers.append(rp)
            return kind, lambda k: s.create_provider(rp, f"spare-{rp[:8]}", idempotency_key=k)
        if kind == "rename_provider":
            rp = self.provider()
            name = f"rp-{uuid.uuid4().hex[:12]}"
            return kind, lambda k: s.rename_provider(rp, name, idempotency_key=k)
        if kind == "delete_provider":
            rp = rng.choice(self.spare_providers) if self.spare_providers else new_uuid()
            return kind, lambda k: s.delete_provider(rp, idempotency_key=k)
        if kind in ("set_inventories", "set_inventory", "delete_inventory"):
            rp = self.provider()
            total = rng.randint(60, 80)

            read: list[int] = []  # (the generation first read: a retry repeats the same command)

            async def inventory(k: str) -> int:
                if not read:
                    read.append((await s.inventories(rp)).generation)
                generation = read[0]
                if kind == "set_inventories":
                    invs = {
                        "VCPU": Inventory(total=total, allocation_ratio=16.0),
                        "DISK_GB": Inventory(total=100),
                    }
                    return await s.set_inventories(rp, invs, generation, idempotency_key=k)
                if kind == "set_inventory":
                    return await s.set_inventory(
                        rp, "DISK_GB", Inventory(total=total), generation, idempotency_key=k
                    )
                return await s.delete_inventory(rp, "DISK_GB", idempotency_key=k)

            return kind, inventory
        if kind == "create_resource_class":
            self.classes += 1
            name = f"CUSTOM_STORM_{self.classes}"
            return kind, lambda k: s.create_resource_class(name, idempotency_key=k)
        if kind == "set_allocations":
            known = rng.random() < 0.3 and self.consumers
            c = self.consumer() if known else new_uuid()
            self.consumers.append(c)
            body = self.alloc()

            read_: list[int | None] = []

            async def put(k: str) -> Receipt:
                if not read_:
                    read_.append((await s.allocations(c)).generation if known else None)
                generation = read_[0]
                return await s.set_allocations(
                    c,
                    body,
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=generation,
                    idempotency_key=k,
                )

            return kind, put
        if kind == "write_allocations":
            a, b = new_uuid(), new_uuid()
            self.consumers += [a, b]
            body = {
                c: ConsumerAllocations(
                    allocations=self.alloc(), project_id="p", user_id="u", consumer_type="INSTANCE"
                )
                for c in (a, b)
            }
            return kind, lambda k: s.write_allocations(body, idempotency_key=k)
        if kind == "release":
            c = self.consumer()
            return kind, lambda k: s.release(c, idempotency_key=k)
        if kind == "start_migration":
            c, m = self.consumer(), new_uuid()
            self.migrations.append(m)
            return kind, lambda k: s.start_migration(c, m, idempotency_key=k)
        if kind in ("revert_migration", "confirm_migration"):
            m = rng.choice(self.migrations) if self.migrations else new_uuid()
            if kind == "revert_migration":
                return kind, lambda k: s.revert_migration(m, idempotency_key=k)
            return kind, lambda k: s.confirm_migration(m, idempotency_key=k)
        c = self.consumer()
        return kind, lambda k: s.delete_consumer(c, idempotency_key=k)

    def read(self) -> tuple[str, Callable[[], Awaitable[Any]]]:
        s, rng = self.store, self.rng
        rp, c = self.provider(), self.consumer()

        async def drain(it: AsyncIterator[Any], most: int) -> int:
            n = 0
            async with contextlib.aclosing(it):  # type: ignore[type-var]
                async for _ in it:
                    n += 1
                    if n >= most:
                        break
            return n

        async def subscribe() -> int:
            head = await s.head()
            return await drain(s.subscribe(max(0, head - 20)), 20)

        async def state_at(slice_: str) -> Any:
            head = await s.head()
            position = rng.randint(1, max(1, head))
            if slice_ == "provider":
                return await s.state_at(position, provider=rp)
            if slice_ == "consumer":
                return await s.state_at(position, consumer=c)
            return await s.state_at(position)

        async def diff() -> Any:
            head = await s.head()
            a = rng.randint(0, max(0, head))
            return await s.diff(a, rng.randint(a, max(a, head)))

        calls: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("usage", lambda: s.usage(rp)),
            ("inventories", lambda: s.inventories(rp)),
            ("provider", lambda: s.provider(rp)),
            ("allocations", lambda: s.allocations(c)),
            ("provider_allocations", lambda: s.provider_allocations(rp)),
            ("usages", lambda: s.usages("p")),
            ("providers", lambda: s.providers()),
            ("head", lambda: s.head()),
            ("read", lambda: s.read(rng.randint(0, 50), 200)),
            ("history", lambda: drain(s.history(rp), 10_000)),
            ("history_consumer", lambda: drain(s.history(c), 10_000)),
            ("subscribe", subscribe),
            ("export", lambda: drain(s.export(batch_size=50), 300)),
            ("state_at", lambda: state_at("whole")),
            ("state_at_provider", lambda: state_at("provider")),
            ("state_at_consumer", lambda: state_at("consumer")),
            ("diff", diff),
            ("stats", lambda: s.stats()),
            ("position_of", lambda: s.position_of(1)),
        ]
        rare: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
            ("audit", lambda: s.audit()),
            ("replay", lambda: s.replay()),
            ("take_snapshots", lambda: s.take_snapshots()),
            ("rebuild", lambda: s.rebuild()),
        ]
        return rng.choice(rare) if rng.random() < 0.06 else rng.choice(calls)

    # --- running them -------------------------------------------------------------------------

    async def one(self) -> None:
        delay = self.rng.choice(DELAYS)
        if self.rng.random() < 0.5:
            self.keys += 1
            key = f"storm-{self.keys}-{uuid.uuid4().hex[:8]}"
            kind, call = self.command()
            self.ledger.gave_up[key] = call  # (until the caller hears otherwise)
            try:
                async with asyncio.timeout(delay):
                    result = await call(key)
            except (TimeoutError, asyncio.CancelledError):
                return
            except StorageError as exc:
                # (its job cancelled, as a shutdown cancels every task: before it began, not run,
                # or while it ran, which it may have committed)
                cancelled = exc.details.get("not_run") or "cancelled while it ran" in exc.message
                if not (self.cancel_jobs and cancelled):
                    self.ledger.unexpected.append(f"{kind} {key}: {exc!r}")
                return
            except EvstoreError as exc:
                del self.ledger.gave_up[key]
                self.ledger.rejected[key] = exc
                return
            except Exception as exc:
                self.ledger.unexpected.append(f"{kind} {key}: {exc!r}")
                return
            del self.ledger.gave_up[key]
            self.ledger.ok[key] = result
            return
        kind, read = self.read()
        try:
            async with asyncio.timeout(delay):
                await read()
        except (TimeoutError, asyncio.CancelledError):
            return
        except StorageError as exc:
            self.ledger.unexpected.append(f"{kind}: {exc!r}")
        except EvstoreError:
            return  # (a provider deleted meanwhile, a consumer never written, a rebuild's fence...)
        except Exception as exc:
            self.ledger.unexpected.append(f"{kind}: {exc!r}")

    async def run(self, calls: int) -> None:
        running: set[asyncio.Task[None]] = set()
        started = 0

        async def canceller() -> None:
            while True:
                await asyncio.sleep(self.rng.uniform(0, 0.005))
                if running and self.rng.random() < 0.3:
                    self.rng.choice(sorted(running, key=id)).cancel()
                if self.cancel_jobs and self.rng.random() < 0.1:
                    jobs = [job for s in self.stores for job in s._running]
                    if jobs:
                        self.jobs_cancelled += self.rng.choice(sorted(jobs, key=id)).cancel()

        cancelling = asyncio.ensure_future(canceller())
        try:
            while started < calls or running:
                while started < calls and len(running) < IN_FLIGHT:
                    task = asyncio.ensure_future(self.one())
                    running.add(task)
                    task.add_done_callback(running.discard)
                    started += 1
                await asyncio.wait(set(running), return_when=asyncio.FIRST_COMPLETED)
        finally:
            cancelling.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await cancelling


async def settle(store: AllocationStore) -> None:
    """Wait for the commands whose callers gave up (their jobs go on) and the pool's releases."""
    while store._running:
        await asyncio.wait(list(store._running))
    pool = getattr(store.backend, "_pool", None)
    if pool is not None:
        while pool.get_idle_size() < pool.get_size():
            await asyncio.sleep(0.01)


async def pool_states(store: AllocationStore, url: str) -> dict[int, str | None]:
    """Each live pooled connection's state on the server."""
    import asyncpg

    pool = store.backend._pool  # type: ignore[attr-defined]
    pids = [h._con.get_server_pid() for h in pool._holders if h._con is not None and not h._con.is_closed()]
    monitor = await asyncpg.connect(url)
    try:
        rows = await monitor.fetch("SELECT pid, state FROM pg_stat_activity WHERE pid = ANY($1::int[])", pids)
    finally:
        await monitor.close()
    states: dict[int, str | None] = dict.fromkeys(pids)
    states.update({r["pid"]: r["state"] for r in rows})
    return states


async def check_after(storm: Storm, url: str, postgres: bool) -> None:
    stores = storm.stores
    ledger = storm.ledger
    assert not ledger.unexpected, ledger.unexpected[:10]
    async with asyncio.timeout(GUARD):
        for s in stores:
            await settle(s)
    if postgres:
        for s in stores:
            states = await pool_states(s, url)
            assert all(state == "idle" for state in states.values()), states
    async with asyncio.timeout(GUARD):
        # every connection of every pool, at once: a REPEATABLE READ read and a command each
        for s in stores:
            await asyncio.gather(*(s.usage(rp) for rp in storm.providers for _ in range(2)))
            await s.set_allocations(
                new_uuid(),
                {storm.providers[0]: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
        # a command whose caller gave up: repeated with its key, it answers what the log holds
        retried: dict[str, Any] = {}
        for key, call in ledger.gave_up.items():
            try:
                retried[key] = await call(key)
            except StorageError:
                raise
            except EvstoreError as exc:
                retried[key] = exc
        by_key: dict[str, list[int]] = {}
        commands: dict[str, set[str | None]] = {}
        after = 0
        while batch := await stores[0].read(after, 1000):
            for e in batch:
                logged_key = e.metadata.idempotency_key
                if logged_key is not None:
                    by_key.setdefault(logged_key, []).append(e.position)
                    commands.setdefault(logged_key, set()).add(e.metadata.command_id)
            after = batch[-1].position
    for key, result in [*ledger.ok.items(), *retried.items()]:
        if isinstance(result, Receipt):
            assert tuple(by_key.get(key, [])) == result.positions, (key, result)
        elif isinstance(result, EvstoreError):
            assert key not in by_key, (key, result)  # (rejected now, so never committed)
    for key in ledger.rejected:
        assert key not in by_key, (key, ledger.rejected[key])
    assert all(len(ids) == 1 for ids in commands.values())  # (one command's events, one run)
    for s in stores:
        report = await s.audit()
        assert report.clean, report


async def storm_on(
    url: str, seed: int, stores: int, postgres: bool, cancel_jobs: bool = False, **options: Any
) -> Storm:
    rng = random.Random(seed)
    async with contextlib.AsyncExitStack() as stack:
        opened = [await stack.enter_async_context(open_store(url, **options)) for _ in range(stores)]
        storm = Storm(opened, rng, cancel_jobs)
        s = opened[0]
        for i in range(4):
            rp = new_uuid()
            await s.create_provider(rp, f"rp-{i}-{rp}")
            await s.set_inventories(rp, {"VCPU": Inventory(total=64, allocation_ratio=16.0)}, generation=0)
            storm.providers.append(rp)
        for _ in range(20):
            c = new_uuid()
            await s.set_allocations(
                c, storm.alloc(), project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
            )
            storm.consumers.append(c)
        await storm.run(CALLS)
        await check_after(storm, url, postgres)
    return storm


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_cancellation_storm_on_sqlite_leaves_the_stores_sound(tmp_path: Path, seed: int) -> None:
    await storm_on(f"sqlite:///{tmp_path}/storm.db", seed, stores=2, postgres=False)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("jobs", ["callers", "callers_and_jobs"])
async def test_a_cancellation_storm_on_postgres_leaves_every_connection_idle(
    pg_url: str, seed: int, jobs: str
) -> None:
    await storm_on(pg_url, seed, stores=3, postgres=True, cancel_jobs=jobs == "callers_and_jobs", pool_size=3)


# --- cancelled at each of asyncpg's entry points in turn -----------------------------------------

#: the asyncpg Connection methods evstore's calls go through (a simple query; a prepare; a bound
#: statement's execution; a COPY), each an await on the server
ENTRY_POINTS = ("execute", "_get_statement", "_do_execute", "copy_records_to_table")


class CancelAt:
    """Cancels the first task to reach an entry point while armed (the caller of a read, the job
    of a command) at its ``k``-th entry: before the call, while it waits for the server (the
    cancellation lands at its first suspension), right after it answered, or while it waits at
    the ``k``-th entry and again at the next."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from asyncpg.connection import Connection

        self.k, self.mode = -1, ""
        self.seen = 0
        self.fired = False
        self.target: asyncio.Task[Any] | None = None
        self.armed = False
        for name in ENTRY_POINTS:
            monkeypatch.setattr(Connection, name, self._wrap(getattr(Connection, name)))

    def arm(self, k: int, mode: str) -> None:
        self.k, self.mode, self.seen, self.fired, self.target, self.armed = k, mode, 0, False, None, True

    def _wrap(self, original: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def entry(conn: Any, *args: Any, **kwargs: Any) -> Any:
            task = asyncio.current_task()
            hit = False
            if self.armed and task is not None:
                if self.target is None:
                    self.target = task
                if task is self.target:
                    # (twice: while it waits at the k-th entry, and again at the next one - the
                    # cleanup of the first cancellation, a ROLLBACK, or the next statement)
                    hit = self.seen == self.k or (self.mode == "twice" and self.seen == self.k + 1)
                    self.seen += 1
            if hit:
                self.fired = True
                assert task is not None
                if self.mode == "before":
                    task.cancel()
                    await asyncio.sleep(0)
                elif self.mode in ("during", "twice"):
                    asyncio.get_running_loop().call_soon(task.cancel)
            result = await original(conn, *args, **kwargs)
            if hit and self.mode == "after":
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)
            return result

        return entry


@pytest.mark.parametrize("call", ["read", "usage", "command"])
async def test_a_call_cancelled_at_each_asyncpg_entry_point_leaves_its_connection_idle(
    pg_url: str, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the log (no transaction), a provider's usage (a REPEATABLE READ transaction) and
    a command (its job's transaction, the sequencer; a job is cancelled by a shutdown that cancels
    every task) are cancelled at their k-th call into asyncpg, for every k, before the call, while
    it waits and right after it answered. Each time the pool's one connection goes back idle on the
    server, the next read and command work, a cancelled command is wholly in or out, and the audit
    is clean."""
    import asyncpg

    cancel = CancelAt(monkeypatch)
    monitor = await asyncpg.connect(pg_url)
    fired = 0
    try:
        async with open_store(pg_url, pool_size=1) as store:  # (one connection: the next call gets it)
            rp = new_uuid()
            await store.create_provider(rp, "rp")
            await store.set_inventories(rp, {"VCPU": Inventory(total=10_000)}, generation=0)
            pool = store.backend._pool  # type: ignore[attr-defined]
            held = 0
            # (fresh: on a new connection, whose statements are prepared anew - Parse, Describe -
            # rather than found in its statement cache)
            for fresh, mode in itertools.product(
                (True, False) if SLOW else (True,), ("before", "during", "after", "twice")
            ):
                for k in range(200):
                    key = f"{fresh}-{mode}-{k}"
                    c = new_uuid()

                    async def command(key: str = key, c: str = c) -> Any:
                        return await store.set_allocations(
                            c,
                            {rp: {"VCPU": 1}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                            idempotency_key=key,
                        )

                    work = {
                        "read": lambda: store.read(0, 100),
                        "usage": lambda: store.usage(rp),
                        "command": command,
                    }[call]
                    if fresh:
                        await pool.expire_connections()
                    cancel.arm(k, mode)
                    try:
                        async with asyncio.timeout(GUARD):
                            await asyncio.ensure_future(work())
                    except asyncio.CancelledError:
                        pass
                    except StorageError as exc:  # (a command's job cancelled: its outcome is unknown)
                        assert call == "command" and exc.details.get("outcome_unknown") is not False, exc
                    finally:
                        cancel.armed = False
                    if not cancel.fired:  # (k is past the call's last entry point: it ran whole)
                        held += call == "command"
                        break
                    fired += 1
                    async with asyncio.timeout(GUARD):
                        await settle(store)
                        states = await pool_states(store, pg_url)
                        assert all(s == "idle" for s in states.values()), (fresh, mode, k, states)
                        if call == "command":
                            receipt = await command()  # (the same key: replayed if it was in)
                            logged = [
                                e.position
                                for e in await store.read(0, 10_000)
                                if e.metadata.idempotency_key == key
                            ]
                            assert tuple(logged) == receipt.positions, (mode, k, receipt)
                            held += 1
                        assert (await store.usage(rp))["VCPU"] == held, (mode, k)
                        await store.set_allocations(
                            new_uuid(),
                            {rp: {"VCPU": 1}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                        )
                        held += 1
                else:
                    raise AssertionError("more than 200 entry points: raise the bound")
            assert (await store.audit()).clean
    finally:
        await monitor.close()
    assert fired >= 3, "no cancellation landed: asyncpg's entry points changed"


class CancelOnThreadHop:
    """SQLite's counterpart of :class:`CancelAt`: cancels the caller at its ``k``-th hop to a
    connection's thread (``_on_thread``: each unit of work is one), before it, while it runs
    there (the work goes on without its caller), right after it, or while it runs and again at
    the next hop."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from evstore.log import sqlite

        self.k, self.mode, self.seen, self.fired = -1, "", 0, False
        self.target: asyncio.Task[Any] | None = None
        original = sqlite._on_thread

        async def hop(conn: Any, fn: Callable[[Any], Any]) -> Any:
            # (the hops of any task while armed - an import's run its own, which its caller
            # shields - but the caller is the one cancelled)
            task = self.target
            hit = False
            if task is not None:
                hit = self.seen == self.k or (self.mode == "twice" and self.seen == self.k + 1)
                self.seen += 1
            if hit:
                self.fired = True
                assert task is not None
                if self.mode == "before":
                    task.cancel()
                    await asyncio.sleep(0)
                elif self.mode in ("during", "twice"):
                    asyncio.get_running_loop().call_soon(task.cancel)
            result = await original(conn, fn)
            if hit and self.mode == "after":
                assert task is not None
                task.cancel()
                await asyncio.sleep(0)
            return result

        monkeypatch.setattr(sqlite, "_on_thread", hop)

    async def run(self, k: int, mode: str, call: Callable[[], Awaitable[Any]]) -> None:
        async def target() -> None:
            self.target = asyncio.current_task()
            await call()

        self.k, self.mode, self.seen, self.fired = k, mode, 0, False
        try:
            await asyncio.ensure_future(target())
        except asyncio.CancelledError:
            pass
        finally:
            self.target = None


@pytest.mark.parametrize(
    "call", ["read", "usage", "state_at", "take_snapshots", "rebuild", "audit", "import"]
)
async def test_a_call_cancelled_at_each_sqlite_thread_hop_leaves_the_store_sound(
    tmp_path: Path, call: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of these calls is cancelled at its k-th hop to a connection's thread, for every k, in
    each way. Each time another store on the same file writes at once (no transaction left open on
    the cancelled store's connections), and the store reads, runs a command and audits clean; an
    import cancelled anywhere left the store wholly imported or empty."""
    cancel = CancelOnThreadHop(monkeypatch)
    url = f"sqlite:///{tmp_path}/hops.db"
    fired = 0
    async with open_store(url) as store, open_store(url, busy_timeout=5) as other:
        rp = new_uuid()
        await store.create_provider(rp, "rp")
        await store.set_inventories(rp, {"VCPU": Inventory(total=10_000)}, generation=0)
        for _ in range(30):
            await store.set_allocations(
                new_uuid(),
                {rp: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
        exported = [line async for line in store.export()]
        held = 30
        for mode in ("before", "during", "after", "twice"):
            for k in range(100):
                target = store
                if call == "import":
                    target = await open_store(f"sqlite:///{tmp_path}/import-{mode}-{k}.db")
                work: Callable[[], Awaitable[Any]] = {
                    "read": lambda: store.read(0, 100),
                    "usage": lambda: store.usage(rp),
                    "state_at": lambda: store.state_at(10),
                    "take_snapshots": lambda: store.take_snapshots(),
                    "rebuild": lambda: store.rebuild(),
                    "audit": lambda: store.audit(),
                    "import": lambda target=target: target.import_events(lambda: iter(exported)),
                }[call]
                async with asyncio.timeout(GUARD):
                    await cancel.run(k, mode, work)
                    if call == "import":
                        try:
                            imported = await target.head()
                            assert imported in (0, len(exported) - 1), (
                                mode,
                                k,
                                imported,
                            )  # (less the header)
                            assert (await target.audit()).clean
                        finally:
                            await target.close()
                    if not cancel.fired:
                        break  # (k is past the call's last hop)
                    fired += 1
                    await other.set_allocations(  # (another connection's write lock: free)
                        new_uuid(),
                        {rp: {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                    )
                    await store.set_allocations(
                        new_uuid(),
                        {rp: {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                    )
                    held += 2
                    assert (await store.usage(rp))["VCPU"] == held, (mode, k)
            else:
                raise AssertionError("more than 100 hops: raise the bound")
        assert (await store.audit()).clean
        assert (await other.audit()).clean
    assert fired >= 3, "no cancellation landed: evstore no longer hops through _on_thread"


async def test_an_open_cancelled_at_each_asyncpg_entry_point_leaves_no_connection(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``open_store`` (the pool's connections, their set-up, the schema's creation or check) is
    cancelled at each of its calls into asyncpg in turn, in each way: no connection of it is left
    on the server, and the store then opens and works."""
    import asyncpg

    name = f"evs_open_{uuid.uuid4().hex[:12]}"
    url = pg_url + ("&" if "?" in pg_url else "?") + f"application_name={name}"
    async with open_store(url) as store:  # (the schema created: the opens below check it)
        rp = new_uuid()
        await store.create_provider(rp, "rp")
    cancel = CancelAt(monkeypatch)
    monitor = await asyncpg.connect(pg_url)
    fired = 0
    try:
        for mode in ("before", "during", "after", "twice"):
            for k in range(200):
                cancel.arm(k, mode)
                opened: AllocationStore | None = None
                try:
                    async with asyncio.timeout(GUARD):
                        opened = await asyncio.ensure_future(open_store(url, min_pool_size=2, pool_size=2))
                except asyncio.CancelledError:
                    pass
                finally:
                    cancel.armed = False
                if opened is not None:
                    await opened.close()
                if not cancel.fired:
                    break
                fired += 1
                async with asyncio.timeout(GUARD):  # (a closed connection leaves the list soon after)
                    while await monitor.fetchval(
                        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
                    ):
                        await asyncio.sleep(0.01)
            else:
                raise AssertionError("more than 200 entry points: raise the bound")
    finally:
        await monitor.close()
    async with open_store(url) as store:
        assert (await store.provider(rp)).name == "rp"
        assert (await store.audit()).clean
    assert fired >= 3, "no cancellation landed: asyncpg's entry points changed"


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_shutdown_cancelling_every_task_mid_storm_loses_nothing_accepted(
    store_url: str, seed: int
) -> None:
    """A storm, then a shutdown's cancellation of every task at once (asyncio.run's way: the
    callers, the stores' writers, PostgreSQL's jobs, the task that holds the stores open). The
    stores close, no PostgreSQL connection of theirs is left on the server, and once reopened a
    command whose caller heard success is in the log, a rejected one is not, one given up is
    wholly in or out, and the audit is clean."""
    import asyncpg

    postgres = not store_url.startswith("sqlite")
    name = f"evs_shutdown_{uuid.uuid4().hex[:12]}"
    url = store_url + (("&" if "?" in store_url else "?") + f"application_name={name}" if postgres else "")
    options: dict[str, Any] = {"pool_size": 3} if postgres else {}
    rng = random.Random(seed)
    storms: list[Storm] = []
    spared = asyncio.all_tasks()

    async def hold_open() -> None:
        async with contextlib.AsyncExitStack() as stack:
            opened = [
                await stack.enter_async_context(open_store(url, **options))
                for _ in range(3 if postgres else 2)
            ]
            storm = Storm(opened, rng, cancel_jobs=postgres)
            storms.append(storm)
            for i in range(4):
                rp = new_uuid()
                await opened[0].create_provider(rp, f"rp-{i}-{rp}")
                await opened[0].set_inventories(
                    rp, {"VCPU": Inventory(total=64, allocation_ratio=16.0)}, generation=0
                )
                storm.providers.append(rp)
            await storm.run(10**9)

    holder = asyncio.ensure_future(hold_open())
    async with asyncio.timeout(GUARD):
        while not storms or len(storms[0].ledger.ok) < 10 + rng.randrange(40):
            assert not holder.done(), holder
            await asyncio.sleep(0.001)
        for task in asyncio.all_tasks() - spared:
            task.cancel()
        while pending := [t for t in asyncio.all_tasks() - spared if not t.done()]:
            await asyncio.wait(pending)
    assert holder.cancelled() or holder.exception() is None, holder
    if postgres:
        monitor = await asyncpg.connect(store_url)
        try:
            async with asyncio.timeout(GUARD):  # (a closed connection leaves the list soon after)
                while await monitor.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
                ):
                    await asyncio.sleep(0.01)
        finally:
            await monitor.close()
    storm = storms[0]
    async with open_store(url, **options) as reopened:
        storm.stores = [reopened]
        await check_after(storm, url, postgres)
