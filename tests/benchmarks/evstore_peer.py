"""evstore's side of the benchmark: ``python -m tests.benchmarks.evstore_peer PHASE ...``.

Each phase runs in its own process (clean peak RSS, no warm caches shared between systems) and
prints one JSON line. Phases: ``seq`` (one command at a time, then queries), ``conc`` (one task
per stream, all at once: group commit), ``biglog`` (write a large log fast, not measured),
``rebuild``, ``replay``, ``timetravel``, ``audit`` (on the big log), ``pgclient`` (one client of
the PostgreSQL scaling test).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import sys
import time
import uuid as _uuid
from typing import Any

import structlog

import evstore
from evstore import AllocationStore, Inventory, open_store
from tests.benchmarks.common import Recorder, emit, peak_rss_mb
from tests.benchmarks.workload import COMMANDS_PER_OP, INVENTORY, Op, Workload, generate


def configure_logging(info: bool) -> None:
    if info:
        # structlog's defaults (dev console renderer) at info level, written to /dev/null: what a
        # host that leaves logging unconfigured pays per command.
        structlog.configure(
            logger_factory=structlog.PrintLoggerFactory(file=open(os.devnull, "w")),
            wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        )
    else:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def load_workload(path: str) -> Workload:
    with open(path) as f:
        return Workload.from_json(json.load(f))


async def setup(store: AllocationStore, w: Workload) -> None:
    inventories = {rc: Inventory(**spec) for rc, spec in INVENTORY.items()}
    for uuid, name in zip(w.providers, w.provider_names, strict=True):
        await store.create_provider(uuid, name)
        await store.set_inventories(uuid, inventories, generation=0)


class Driver:
    """Runs workload operations against a store, recording each command's latency."""

    def __init__(self, store: AllocationStore, rec: Recorder) -> None:
        self.store = store
        self.rec = rec
        self.owners: dict[str, tuple[str, str]] = {}
        self.deleted: set[str] = set()  # instances deleted (the racing reverts must not revive them)

    async def run(self, op: Op) -> None:
        s = self.store
        kind = op[0]
        t0 = time.perf_counter()
        outcome = "ok"
        try:
            if kind == "build":
                _, inst, prov, res, project, user = op
                self.owners[inst] = (project, user)
                await s.set_allocations(
                    inst,
                    {prov: res},
                    project_id=project,
                    user_id=user,
                    consumer_type="INSTANCE",
                    generation=None,
                )
            elif kind == "migrate":
                _, inst, mig, dest, res = op
                project, user = self.owners[inst]
                await s.start_migration(inst, mig)
                await s.set_allocations(
                    inst,
                    {dest: res},
                    project_id=project,
                    user_id=user,
                    consumer_type="INSTANCE",
                    generation=None,
                )
            elif kind == "revert":
                await s.revert_migration(op[2])
            elif kind == "confirm":
                await s.confirm_migration(op[2])
            elif kind == "delete":
                self.deleted.add(op[1])
                await s.delete_consumer(op[1])
            else:
                raise ValueError(kind)
        except evstore.ConsumerDeleted:
            outcome = "rejected"
        except evstore.EvstoreError as exc:
            outcome = f"error:{exc.code}"
        self.rec.add(time.perf_counter() - t0, outcome, COMMANDS_PER_OP[kind])

    async def query(self, op: Op) -> None:
        t0 = time.perf_counter()
        if op[0] == "usage":
            await self.store.usage(op[1])
        else:
            await self.store.allocations(op[1])
        self.rec.add(time.perf_counter() - t0)


async def phase_seq(args: argparse.Namespace) -> dict[str, Any]:
    w = load_workload(args.workload)
    url = args.url or f"sqlite:///{args.db}"
    options: dict[str, Any] = {} if url.startswith("postgres") else {"synchronous": args.synchronous}
    async with open_store(url, **options) as store:
        await setup(store, w)
        rec = Recorder()
        driver = Driver(store, rec)
        rec.start()
        for op in w.streams[0]:
            await driver.run(op)
        rec.stop()
        qrec = Recorder()
        qdriver = Driver(store, qrec)
        qrec.start()
        for op in w.queries:
            await qdriver.query(op)
        qrec.stop()
        head = await store.head()
        # bug 1848343, counted as the Placement peer counts it: deleted instances holding allocations
        leaked = sum([1 for c in sorted(driver.deleted) if await store.allocations(c)])
    return rec.result(
        queries=qrec.result(), head=head, leaked_consumers=leaked, deleted_consumers=len(driver.deleted)
    )


async def phase_conc(args: argparse.Namespace) -> dict[str, Any]:
    w = load_workload(args.workload)
    url = args.url or f"sqlite:///{args.db}"
    options: dict[str, Any] = {} if url.startswith("postgres") else {"synchronous": args.synchronous}
    async with open_store(url, **options) as store:
        await setup(store, w)
        rec = Recorder()

        async def task(stream: list[Op]) -> None:
            driver = Driver(store, rec)
            for op in stream:
                await driver.run(op)

        rec.start()
        await asyncio.gather(*(task(s) for s in w.streams))
        rec.stop()
        head = await store.head()
    return rec.result(head=head, tasks=len(w.streams))


async def phase_pgclient(args: argparse.Namespace) -> dict[str, Any]:
    """One client process of the PostgreSQL scaling test: its own stream on its own providers."""
    w = load_workload(args.workload)
    stream = w.streams[args.stream]
    async with open_store(args.url) as store:
        rec = Recorder()
        driver = Driver(store, rec)
        # wait for the runner's start signal so that all clients overlap
        sys.stdout.write("ready\n")
        sys.stdout.flush()
        await asyncio.to_thread(sys.stdin.readline)
        cpu = time.process_time()
        rec.start()
        for op in stream:
            await driver.run(op)
        rec.stop()
        cpu = time.process_time() - cpu  # (this process's own CPU: the server's is not in it)
    return rec.result(cpu_s=cpu)


async def phase_pgsetup(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh schema in the given database (runs never collide), with the providers created."""
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    schema = f"evstore_bench_{os.getpid()}_{int(time.time())}"
    conn = await asyncpg.connect(args.url)
    try:
        await conn.execute(f"CREATE SCHEMA {schema}")
        settings = {
            name: await conn.fetchval(f"SHOW {name}")
            for name in ("fsync", "synchronous_commit", "server_version")
        }
    finally:
        await conn.close()
    sep = "&" if "?" in args.url else "?"
    url = f"{args.url}{sep}search_path={schema}"
    if args.workload:
        async with open_store(url) as store:
            await setup(store, load_workload(args.workload))
    return {"url": url, "schema": schema, "server": settings}


async def phase_pgcheck(args: argparse.Namespace) -> dict[str, Any]:
    """Can the runner use this server? One connection; why not, as one line (no traceback)."""
    try:
        import asyncpg  # type: ignore[import-untyped,unused-ignore]

        conn = await asyncpg.connect(args.url, timeout=30)
        try:
            version = await conn.fetchval("SHOW server_version")
        finally:
            await conn.close()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"server_version": version}


async def phase_pgdrop(args: argparse.Namespace) -> dict[str, Any]:
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    conn = await asyncpg.connect(args.url)
    try:
        await conn.execute(f"DROP SCHEMA IF EXISTS {args.schema} CASCADE")
    finally:
        await conn.close()
    return {"dropped": args.schema}


async def phase_biglog(args: argparse.Namespace) -> dict[str, Any]:
    """Write a large log quickly (synchronous=OFF, 64 tasks): the input of the read phases.

    The operations are generated slice by slice (same providers, new consumers) so that a
    million events never sit in memory as one workload.
    """
    t0 = time.perf_counter()
    async with open_store(f"sqlite:///{args.db}", synchronous="OFF", max_batch=1024) as store:
        rec = Recorder()
        head = 0
        sliced = 0
        while head < args.events:
            w = generate(streams=64, commands_per_stream=200, target_live=8, n_queries=0, stream_seed=sliced)
            if sliced == 0:
                await setup(store, w)

            async def task(stream: list[Op]) -> None:
                driver = Driver(store, rec)
                for op in stream:
                    await driver.run(op)

            await asyncio.gather(*(task(s) for s in w.streams))
            head = await store.head()
            sliced += 1
            if args.progress:
                print(f"biglog: {head} events", file=sys.stderr, flush=True)
    return {"head": head, "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


async def phase_rebuild(args: argparse.Namespace) -> dict[str, Any]:
    async with open_store(f"sqlite:///{args.db}") as store:
        t0 = time.perf_counter()
        n = await store.rebuild()
        dt = time.perf_counter() - t0
    return {"events": n, "seconds": dt, "events_per_s": n / dt, "peak_rss_mb": peak_rss_mb()}


async def phase_replay(args: argparse.Namespace) -> dict[str, Any]:
    async with open_store(f"sqlite:///{args.db}") as store:
        t0 = time.perf_counter()
        state = await store.replay()
        dt = time.perf_counter() - t0
    return {
        "events": state.position,
        "seconds": dt,
        "events_per_s": state.position / dt,
        "peak_rss_mb": peak_rss_mb(),
        "consumers": len(state.consumers),
    }


async def phase_export(args: argparse.Namespace) -> dict[str, Any]:
    """Stream the whole log out as JSON lines (to /dev/null): memory must not grow with the log."""
    async with open_store(f"sqlite:///{args.db}") as store:
        t0 = time.perf_counter()
        lines = 0
        with open(os.devnull, "w") as sink:
            async for line in store.export():
                sink.write(line)
                lines += 1
        dt = time.perf_counter() - t0
    events = lines - 1  # the first line is the header
    return {"events": events, "seconds": dt, "events_per_s": events / dt, "peak_rss_mb": peak_rss_mb()}


async def phase_audit(args: argparse.Namespace) -> dict[str, Any]:
    async with open_store(f"sqlite:///{args.db}") as store:
        t0 = time.perf_counter()
        report = await store.audit()
        dt = time.perf_counter() - t0
    return {
        "events": report.events_checked,
        "seconds": dt,
        "events_per_s": report.events_checked / dt if dt else 0.0,
        "clean": report.clean,
        "findings": len(report.findings),
        "peak_rss_mb": peak_rss_mb(),
    }


async def phase_timetravel(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with open_store(f"sqlite:///{args.db}") as store:
        head = await store.head()
        providers = [u for u, _ in await store.providers()]
        samples: dict[str, list[float]] = {"consumer_at": [], "provider_at": [], "state_at": []}
        for _ in range(args.consumer_samples):
            # a consumer that exists somewhere in the log, asked about at a random position
            batch = await store.read(after=rng.randint(0, head - 1), limit=20)
            named = [getattr(r.event, "consumer", None) or getattr(r.event, "instance", None) for r in batch]
            consumer = rng.choice([c for c in named if c] or [str(_uuid.uuid4())])
            pos = rng.randint(1, head)
            # the public API a user calls: the consumer's slice folded from its own history
            t0 = time.perf_counter()
            view = await store.state_at(position=pos, consumer=consumer)
            await view.allocations(consumer)
            samples["consumer_at"].append(time.perf_counter() - t0)
        extra: dict[str, Any] = {}
        # cold: no snapshot yet (a store that keeps snapshots saves them on the way)
        pos = rng.randint(head // 2, head)
        t0 = time.perf_counter()
        await store.state_at(position=pos)
        samples["state_at_cold"] = [time.perf_counter() - t0]
        if hasattr(store, "take_snapshots"):
            t0 = time.perf_counter()
            taken = await store.take_snapshots()
            extra["take_snapshots_s"] = time.perf_counter() - t0
            extra["snapshots"] = len(taken)
        for _ in range(args.state_samples):
            pos = rng.randint(1, head)
            t0 = time.perf_counter()
            await store.state_at(position=pos)
            samples["state_at"].append(time.perf_counter() - t0)
        for _ in range(max(args.state_samples, 30)):
            # one provider: its slice snapshot plus the events that touch it (state_at(provider=))
            pos, provider = rng.randint(1, head), rng.choice(providers)
            t0 = time.perf_counter()
            view = await store.state_at(position=pos, provider=provider)
            await view.usage(provider)
            samples["provider_at"].append(time.perf_counter() - t0)
    out: dict[str, Any] = {"head": head, "peak_rss_mb": peak_rss_mb(), **extra}
    for name, values in samples.items():
        values.sort()
        out[name] = {
            "n": len(values),
            "mean_ms": 1000 * sum(values) / len(values) if values else 0.0,
            "median_ms": 1000 * values[len(values) // 2] if values else 0.0,
            "max_ms": 1000 * values[-1] if values else 0.0,
        }
    return out


async def phase_logcost(args: argparse.Namespace) -> dict[str, Any]:
    """What one ``command.accepted`` log call costs (the store makes one per command).

    Measured directly because the end-to-end difference is smaller than run-to-run noise.
    """
    logger = structlog.get_logger("evstore")  # a lazy proxy, as evstore/store.py holds it
    context = {"command": "WriteAllocations", "request_id": None, "consumer": [str(_uuid.uuid4())]}
    out: dict[str, Any] = {}
    for name, info in (("info_default_config_us", True), ("filtered_warning_us", False)):
        configure_logging(info)
        n = 20000
        t0 = time.perf_counter()
        for i in range(n):
            logger.info("command.accepted", positions=[i], position=i, replayed=False, **context)
        out[name] = (time.perf_counter() - t0) / n * 1e6
    return out


PHASES = {
    "seq": phase_seq,
    "conc": phase_conc,
    "biglog": phase_biglog,
    "rebuild": phase_rebuild,
    "export": phase_export,
    "replay": phase_replay,
    "audit": phase_audit,
    "timetravel": phase_timetravel,
    "pgclient": phase_pgclient,
    "pgsetup": phase_pgsetup,
    "pgcheck": phase_pgcheck,
    "pgdrop": phase_pgdrop,
    "logcost": phase_logcost,
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=sorted(PHASES))
    p.add_argument("--workload")
    p.add_argument("--db")
    p.add_argument("--url")
    p.add_argument("--synchronous", default="FULL")
    p.add_argument("--log-info", action="store_true")
    p.add_argument("--events", type=int, default=0)
    p.add_argument("--stream", type=int, default=0)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--consumer-samples", type=int, default=50)
    p.add_argument("--state-samples", type=int, default=3)
    p.add_argument("--progress", action="store_true")
    p.add_argument("--schema")
    args = p.parse_args()
    configure_logging(args.log_info)
    result = asyncio.run(PHASES[args.phase](args))
    result["system"] = "evstore"
    result["phase"] = args.phase
    emit(result)


if __name__ == "__main__":
    main()
