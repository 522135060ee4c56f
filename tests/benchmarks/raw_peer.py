"""The limit: plain ``sqlite3`` doing the minimum durable work the workload needs.

Same file settings as evstore (WAL, ``synchronous=FULL``), same rules (capacity, consumer
absent/tombstoned checks, migrations on behalf of an instance, tombstones reject the racing
revert), but nothing else: one event row per command (type + JSON payload), the usage counters
and the consumer rows it needs to decide, no hash chain, no entity index, no metadata, no
idempotency keys, no projection of generations. Variants:

- ``seq``: one ``BEGIN IMMEDIATE ... COMMIT`` per command, called synchronously (no asyncio);
- ``conc``: 64 asyncio tasks, one transaction per command on one writer thread;
- ``conc-group``: 64 asyncio tasks, a writer that commits every queued command in one transaction;
- ``read``: stream an evstore log's events and ``json.loads`` each payload (the rebuild/replay limit).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import json
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from tests.benchmarks.common import Recorder, emit, peak_rss_mb
from tests.benchmarks.workload import COMMANDS_PER_OP, INVENTORY, Op, Workload

DDL = """
CREATE TABLE IF NOT EXISTS events (position INTEGER PRIMARY KEY, type TEXT NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS usage (
    provider TEXT NOT NULL, rc TEXT NOT NULL, capacity REAL NOT NULL, used INTEGER NOT NULL,
    PRIMARY KEY (provider, rc)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS consumers (
    uuid TEXT PRIMARY KEY, generation INTEGER, allocations TEXT NOT NULL, project TEXT, user TEXT,
    deleted INTEGER NOT NULL DEFAULT 0, migration TEXT, on_behalf_of TEXT) WITHOUT ROWID;
"""


class Rejected(Exception):
    pass


def connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")
    conn.executescript(DDL)
    return conn


def setup(conn: sqlite3.Connection, w: Workload) -> None:
    conn.execute("BEGIN IMMEDIATE")
    for p in w.providers:
        for rc, spec in INVENTORY.items():
            cap = (spec["total"] - spec.get("reserved", 0)) * spec.get("allocation_ratio", 1.0)
            conn.execute("INSERT INTO usage VALUES (?,?,?,0)", (p, rc, cap))
        conn.execute("INSERT INTO events (type, data) VALUES ('ProviderCreated', ?)", (json.dumps([p]),))
    conn.execute("COMMIT")


Allocs = dict[str, dict[str, int]]


class Commands:
    """The workload's commands as plain SQL; each runs inside the caller's transaction."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def _consumer(self, uuid: str) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.conn.execute(
            "SELECT generation, allocations, project, user, deleted, migration, on_behalf_of "
            "FROM consumers WHERE uuid = ?",
            (uuid,),
        ).fetchone()
        return row

    def _use(self, allocs: Allocs, sign: int, check: bool) -> None:
        for provider, resources in allocs.items():
            if check:
                rows = dict(
                    (rc, (cap, used))
                    for rc, cap, used in self.conn.execute(
                        "SELECT rc, capacity, used FROM usage WHERE provider = ?", (provider,)
                    )
                )
                for rc, n in resources.items():
                    cap, used = rows[rc]
                    if cap < used + n:
                        raise Rejected("capacity")
            self.conn.executemany(
                "UPDATE usage SET used = used + ? WHERE provider = ? AND rc = ?",
                [(sign * n, provider, rc) for rc, n in resources.items()],
            )

    def _event(self, etype: str, payload: Any) -> None:
        self.conn.execute("INSERT INTO events (type, data) VALUES (?, ?)", (etype, json.dumps(payload)))

    def write(self, consumer: str, allocs: Allocs, project: str, user: str) -> None:
        """Allocate to an absent consumer (generation null)."""
        row = self._consumer(consumer)
        if row is not None and (row[4] or json.loads(row[1])):
            raise Rejected("deleted" if row[4] else "exists")
        self._use(allocs, +1, check=True)
        self._event("AllocationsReplaced", {"consumer": consumer, "allocations": allocs, "generation": 1})
        migration = row[5] if row is not None else None
        self.conn.execute(
            "INSERT OR REPLACE INTO consumers (uuid, generation, allocations, project, user, migration) "
            "VALUES (?, 1, ?, ?, ?, ?)",
            (consumer, json.dumps(allocs), project, user, migration),
        )

    def start_migration(self, instance: str, migration: str) -> None:
        row = self._consumer(instance)
        if row is None or row[4] or self._consumer(migration) is not None:
            raise Rejected("state")
        allocs = row[1]
        self._event("MigrationStarted", {"instance": instance, "migration": migration, "allocations": allocs})
        self.conn.execute(
            "INSERT INTO consumers (uuid, generation, allocations, project, user, on_behalf_of) "
            "VALUES (?, 1, ?, ?, ?, ?)",
            (migration, allocs, row[2], row[3], instance),
        )
        self.conn.execute(
            "UPDATE consumers SET generation = NULL, allocations = '{}', migration = ? WHERE uuid = ?",
            (migration, instance),
        )

    def revert(self, migration: str) -> None:
        mig = self._consumer(migration)
        if mig is None or mig[6] is None:
            raise Rejected("no migration")
        inst = self._consumer(mig[6])
        if inst is None or inst[4]:
            raise Rejected("deleted")
        self._use(json.loads(inst[1]), -1, check=False)  # the destination allocations go
        self._event("MigrationReverted", {"migration": migration, "instance": mig[6], "allocations": mig[1]})
        self.conn.execute(
            "UPDATE consumers SET generation = coalesce(generation, 0) + 1, allocations = ?, "
            "migration = NULL "
            "WHERE uuid = ?",
            (mig[1], mig[6]),
        )
        self.conn.execute("DELETE FROM consumers WHERE uuid = ?", (migration,))

    def confirm(self, migration: str) -> None:
        mig = self._consumer(migration)
        if mig is None:
            raise Rejected("no migration")
        self._use(json.loads(mig[1]), -1, check=False)
        self._event("MigrationConfirmed", {"migration": migration})
        self.conn.execute("DELETE FROM consumers WHERE uuid = ?", (migration,))
        self.conn.execute("UPDATE consumers SET migration = NULL WHERE uuid = ?", (mig[6],))

    def delete(self, consumer: str) -> None:
        row = self._consumer(consumer)
        if row is not None:
            self._use(json.loads(row[1]), -1, check=False)
            if row[5]:
                mig = self._consumer(row[5])
                if mig is not None:
                    self._use(json.loads(mig[1]), -1, check=False)
                    self.conn.execute("DELETE FROM consumers WHERE uuid = ?", (row[5],))
        self._event("ConsumerDeleted", {"consumer": consumer, "migration": row[5] if row else None})
        self.conn.execute(
            "INSERT OR REPLACE INTO consumers (uuid, generation, allocations, deleted) "
            "VALUES (?, NULL, '{}', 1)",
            (consumer,),
        )

    def usage(self, provider: str) -> dict[str, int]:
        return dict(
            self.conn.execute("SELECT rc, used FROM usage WHERE provider = ?", (provider,)).fetchall()
        )

    def allocations(self, consumer: str) -> Allocs:
        row = self._consumer(consumer)
        return json.loads(row[1]) if row else {}


def command_steps(op: Op, owners: dict[str, tuple[str, str]]) -> list[Callable[[Commands], None]]:
    """The op as a list of commands (each one transaction in the per-command variants)."""
    kind = op[0]
    if kind == "build":
        _, inst, prov, res, project, user = op
        owners[inst] = (project, user)
        return [lambda c: c.write(inst, {prov: res}, project, user)]
    if kind == "migrate":
        _, inst, mig, dest, res = op
        project, user = owners[inst]
        return [lambda c: c.start_migration(inst, mig), lambda c: c.write(inst, {dest: res}, project, user)]
    if kind == "revert":
        return [lambda c: c.revert(op[2])]
    if kind == "confirm":
        return [lambda c: c.confirm(op[2])]
    if kind == "delete":
        return [lambda c: c.delete(op[1])]
    raise ValueError(kind)


def transaction(conn: sqlite3.Connection, cmds: Commands, step: Callable[[Commands], None]) -> bool:
    conn.execute("BEGIN IMMEDIATE")
    try:
        step(cmds)
    except Rejected:
        conn.execute("ROLLBACK")
        return False
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
    return True


def phase_seq(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    conn = connect(args.db)
    setup(conn, w)
    cmds = Commands(conn)
    owners: dict[str, tuple[str, str]] = {}
    rec = Recorder()
    rec.start()
    for op in w.streams[0]:
        t0 = time.perf_counter()
        ok = all([transaction(conn, cmds, step) for step in command_steps(op, owners)])
        rec.add(time.perf_counter() - t0, "ok" if ok else "rejected", COMMANDS_PER_OP[op[0]])
    rec.stop()
    qrec = Recorder()
    qrec.start()
    for q in w.queries:
        t0 = time.perf_counter()
        cmds.usage(q[1]) if q[0] == "usage" else cmds.allocations(q[1])
        qrec.add(time.perf_counter() - t0)
    qrec.stop()
    return rec.result(queries=qrec.result())


async def _conc(args: argparse.Namespace, w: Workload, group: bool) -> dict[str, Any]:
    conn = connect(args.db)
    setup(conn, w)
    cmds = Commands(conn)
    loop = asyncio.get_running_loop()
    pool = concurrent.futures.ThreadPoolExecutor(1)  # one writer connection, one thread
    rec = Recorder()
    queue: collections.deque[tuple[Callable[[Commands], None], asyncio.Future[bool]]] = collections.deque()
    wake = asyncio.Event()

    def run_group(batch: list[Callable[[Commands], None]]) -> list[bool]:
        results = []
        conn.execute("BEGIN IMMEDIATE")
        for step in batch:
            conn.execute("SAVEPOINT s")
            try:
                step(cmds)
                results.append(True)
            except Rejected:
                conn.execute("ROLLBACK TO s")
                results.append(False)
            conn.execute("RELEASE s")
        conn.execute("COMMIT")
        return results

    async def writer() -> None:
        while True:
            if not queue:
                wake.clear()
                await wake.wait()
                continue
            batch = [queue.popleft() for _ in range(min(len(queue), 256))]
            results = await loop.run_in_executor(pool, run_group, [s for s, _ in batch])
            for (_, fut), ok in zip(batch, results, strict=True):
                fut.set_result(ok)

    async def submit(step: Callable[[Commands], None]) -> bool:
        if not group:
            return await loop.run_in_executor(pool, transaction, conn, cmds, step)
        fut: asyncio.Future[bool] = loop.create_future()
        queue.append((step, fut))
        wake.set()
        return await fut

    async def task(stream: list[Op]) -> None:
        owners: dict[str, tuple[str, str]] = {}
        for op in stream:
            t0 = time.perf_counter()
            ok = True
            for step in command_steps(op, owners):
                ok = await submit(step) and ok
            rec.add(time.perf_counter() - t0, "ok" if ok else "rejected", COMMANDS_PER_OP[op[0]])

    writer_task = asyncio.create_task(writer())
    rec.start()
    await asyncio.gather(*(task(s) for s in w.streams))
    rec.stop()
    writer_task.cancel()
    pool.shutdown()
    return rec.result(tasks=len(w.streams), group_commit=group)


def phase_read(args: argparse.Namespace) -> dict[str, Any]:
    """Read an evstore log and decode each payload: what any replay must at least do."""
    conn = sqlite3.connect(args.db)
    t0 = time.perf_counter()
    n = 0
    cursor = conn.execute("SELECT position, type, data FROM events ORDER BY position")
    while True:
        rows = cursor.fetchmany(5000)
        if not rows:
            break
        for _position, _type, data in rows:
            json.loads(data)
        n += len(rows)
    dt = time.perf_counter() - t0
    return {"events": n, "seconds": dt, "events_per_s": n / dt, "peak_rss_mb": peak_rss_mb()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["seq", "conc", "conc-group", "read"])
    p.add_argument("--workload")
    p.add_argument("--db", required=True)
    args = p.parse_args()
    if args.phase == "read":
        result = phase_read(args)
    else:
        with open(args.workload) as f:
            w = Workload.from_json(json.load(f))
        if args.phase == "seq":
            result = phase_seq(args, w)
        else:
            result = asyncio.run(_conc(args, w, group=args.phase == "conc-group"))
    result["system"] = "sqlite3"
    result["phase"] = args.phase
    emit(result)


if __name__ == "__main__":
    main()
