"""The ``eventsourcing`` library (PyPI) running the same workload, modelled as aggregates.

``Provider`` aggregates hold capacity and usage per class; ``Consumer`` aggregates hold
allocations, a tombstone flag and the migration link. A command loads the aggregates it
touches from the repository, checks, triggers events and saves them all in one transaction
(``app.save(*aggregates)``): atomic across aggregates, optimistic concurrency on each
aggregate's version (a conflict retries the command). The application uses its aggregate
cache with fast-forward (``AGGREGATE_CACHE_MAXSIZE``): without it, every load of a popular
provider would replay its whole history and the comparison would be meaningless.

SQLite settings: ``PERSISTENCE_MODULE=eventsourcing.sqlite``; the library switches the file to
WAL itself and leaves ``synchronous`` at SQLite's default, FULL (checked at run time and
reported) - the same durability as evstore's default.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid as _uuid
from typing import Any

from tests.benchmarks.common import Recorder, emit
from tests.benchmarks.workload import COMMANDS_PER_OP, INVENTORY, Op, Workload

Allocs = dict[str, dict[str, int]]


class Rejected(Exception):
    pass


def build_app(db: str) -> Any:
    os.environ.update(
        {
            "PERSISTENCE_MODULE": "eventsourcing.sqlite",
            "SQLITE_DBNAME": db,
            "SQLITE_LOCK_TIMEOUT": "30",
            "AGGREGATE_CACHE_MAXSIZE": "100000",
        }
    )
    from eventsourcing.application import AggregateNotFoundError, Application
    from eventsourcing.domain import Aggregate, event

    class Provider(Aggregate):
        def __init__(self, uuid: str, capacity: dict[str, float]) -> None:
            self.capacity = capacity
            self.usage: dict[str, int] = {rc: 0 for rc in capacity}

        @staticmethod
        def create_id(uuid: str, **_: Any) -> _uuid.UUID:
            return _uuid.UUID(uuid)

        def allocate(self, resources: dict[str, int]) -> None:
            for rc, n in resources.items():
                if self.capacity[rc] < self.usage[rc] + n:
                    raise Rejected("capacity")
            self.used(resources, +1)

        @event("Used")
        def used(self, resources: dict[str, int], sign: int) -> None:
            for rc, n in resources.items():
                self.usage[rc] += sign * n

    class Consumer(Aggregate):
        def __init__(self, uuid: str, project: str, user: str, on_behalf_of: str | None = None) -> None:
            self.project = project
            self.user = user
            self.allocations: Allocs = {}
            self.generation: int | None = None
            self.deleted = False
            self.migration: str | None = None
            self.on_behalf_of = on_behalf_of

        @staticmethod
        def create_id(uuid: str, **_: Any) -> _uuid.UUID:
            return _uuid.UUID(uuid)

        @event("AllocationsReplaced")
        def replace(self, allocations: Allocs) -> None:
            self.allocations = allocations
            self.generation = (self.generation or 0) + 1 if allocations else None

        @event("MigrationLinked")
        def link(self, migration: str | None) -> None:
            self.migration = migration

        @event("Deleted")
        def delete(self) -> None:
            self.deleted = True
            self.allocations = {}
            self.generation = None

    class Allocations(Application[_uuid.UUID]):
        def setup(self, w: Workload) -> None:
            for p in w.providers:
                cap = {
                    rc: (s["total"] - s.get("reserved", 0)) * s.get("allocation_ratio", 1.0)
                    for rc, s in INVENTORY.items()
                }
                self.save(Provider(uuid=p, capacity=cap))

        def consumer(self, uuid: str) -> Any:
            try:
                return self.repository.get(_uuid.UUID(uuid))
            except AggregateNotFoundError:
                return None

        def provider(self, uuid: str) -> Any:
            return self.repository.get(_uuid.UUID(uuid))

        def write(self, consumer: str, allocs: Allocs, project: str, user: str) -> None:
            c = self.consumer(consumer)
            if c is None:
                c = Consumer(uuid=consumer, project=project, user=user)
            elif c.deleted or c.allocations:
                raise Rejected("deleted" if c.deleted else "exists")
            providers = [self.provider(p) for p in allocs]
            for prov, (_, res) in zip(providers, allocs.items(), strict=True):
                prov.allocate(res)
            c.replace(allocs)
            self.save(c, *providers)

        def start_migration(self, instance: str, migration: str) -> None:
            inst = self.consumer(instance)
            if inst is None or inst.deleted or self.consumer(migration) is not None:
                raise Rejected("state")
            mig = Consumer(uuid=migration, project=inst.project, user=inst.user, on_behalf_of=instance)
            mig.replace(inst.allocations)
            inst.replace({})
            inst.link(migration)
            self.save(inst, mig)

        def _release(self, allocs: Allocs, loaded: dict[str, Any]) -> list[Any]:
            """Release on each provider, loading it once per command (one pending version)."""
            fresh = []
            for p, res in allocs.items():
                prov = loaded.get(p)
                if prov is None:
                    prov = loaded[p] = self.provider(p)
                    fresh.append(prov)
                prov.used(res, -1)
            return fresh

        def revert(self, migration: str) -> None:
            mig = self.consumer(migration)
            if mig is None or not mig.allocations:
                raise Rejected("no migration")
            inst = self.consumer(mig.on_behalf_of)
            if inst is None or inst.deleted:
                raise Rejected("deleted")
            providers = self._release(inst.allocations, {})
            inst.replace(mig.allocations)
            inst.link(None)
            mig.replace({})
            self.save(inst, mig, *providers)

        def confirm(self, migration: str) -> None:
            mig = self.consumer(migration)
            if mig is None or not mig.allocations:
                raise Rejected("no migration")
            providers = self._release(mig.allocations, {})
            mig.replace({})
            self.save(mig, *providers)

        def delete(self, consumer: str) -> None:
            c = self.consumer(consumer)
            if c is None:
                c = Consumer(uuid=consumer, project="unknown", user="unknown")
            loaded: dict[str, Any] = {}
            providers = self._release(c.allocations, loaded)
            touched = [c]
            if c.migration is not None:
                mig = self.consumer(c.migration)
                if mig is not None and mig.allocations:
                    providers += self._release(mig.allocations, loaded)
                    mig.replace({})
                    touched.append(mig)
            c.delete()
            self.save(*touched, *providers)

        def synchronous(self) -> int:
            recorder = self.recorder
            with recorder.datastore.transaction(commit=False) as cursor:  # type: ignore[attr-defined]
                cursor.execute("PRAGMA synchronous")
                return int(cursor.fetchone()[0])

    return Allocations()


def run_op(app: Any, op: Op, owners: dict[str, tuple[str, str]]) -> str:
    from eventsourcing.persistence import RecordConflictError

    kind = op[0]
    for _attempt in range(50):
        try:
            if kind == "build":
                _, inst, prov, res, project, user = op
                owners[inst] = (project, user)
                app.write(inst, {prov: res}, project, user)
            elif kind == "migrate":
                _, inst, mig, dest, res = op
                project, user = owners[inst]
                if app.consumer(mig) is None:  # a retry must not repeat the first half
                    app.start_migration(inst, mig)
                app.write(inst, {dest: res}, project, user)
            elif kind == "revert":
                app.revert(op[2])
            elif kind == "confirm":
                app.confirm(op[2])
            elif kind == "delete":
                app.delete(op[1])
            return "ok"
        except Rejected:
            return "rejected"
        except RecordConflictError:
            continue
    return "error:conflicts"


def phase_seq(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    app = build_app(args.db)
    app.setup(w)
    owners: dict[str, tuple[str, str]] = {}
    rec = Recorder()
    if args.to_thread:
        # as an asyncio service must call a blocking library: each command on the default pool
        async def stream() -> None:
            rec.start()
            for op in w.streams[0]:
                t0 = time.perf_counter()
                outcome = await asyncio.to_thread(run_op, app, op, owners)
                rec.add(time.perf_counter() - t0, outcome, COMMANDS_PER_OP[op[0]])
            rec.stop()

        asyncio.run(stream())
    else:
        rec.start()
        for op in w.streams[0]:
            t0 = time.perf_counter()
            outcome = run_op(app, op, owners)
            rec.add(time.perf_counter() - t0, outcome, COMMANDS_PER_OP[op[0]])
        rec.stop()
    qrec = Recorder()
    qrec.start()
    for q in w.queries:
        t0 = time.perf_counter()
        if q[0] == "usage":
            _ = app.provider(q[1]).usage
        else:
            c = app.consumer(q[1])
            _ = c.allocations if c is not None else {}
        qrec.add(time.perf_counter() - t0)
    qrec.stop()
    return rec.result(queries=qrec.result(), synchronous=app.synchronous())


async def phase_conc(args: argparse.Namespace, w: Workload) -> dict[str, Any]:
    app = build_app(args.db)
    app.setup(w)
    rec = Recorder()

    async def task(stream: list[Op]) -> None:
        owners: dict[str, tuple[str, str]] = {}
        for op in stream:
            t0 = time.perf_counter()
            # the library is synchronous: run each command on the default thread pool
            outcome = await asyncio.to_thread(run_op, app, op, owners)
            rec.add(time.perf_counter() - t0, outcome, COMMANDS_PER_OP[op[0]])

    rec.start()
    await asyncio.gather(*(task(s) for s in w.streams))
    rec.stop()
    return rec.result(tasks=len(w.streams), synchronous=app.synchronous())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["seq", "conc"])
    p.add_argument("--workload", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--to-thread", action="store_true", help="seq: each command via asyncio.to_thread")
    args = p.parse_args()
    with open(args.workload) as f:
        w = Workload.from_json(json.load(f))
    result = phase_seq(args, w) if args.phase == "seq" else asyncio.run(phase_conc(args, w))
    from importlib.metadata import version

    result["system"] = "eventsourcing"
    result["version"] = version("eventsourcing")
    result["phase"] = args.phase
    emit(result)


if __name__ == "__main__":
    main()
