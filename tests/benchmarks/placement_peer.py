"""OpenStack Placement 16.0.0 running the workload the way Nova drives it.

Executed by the Python of a separate venv, the one the differential tests use (``tests.peers.venv``
builds it once under ``~/.cache/evstore-peers/placement-16`` with ``openstack-placement==16.0.0``):
``placement-16/bin/python tests/benchmarks/placement_peer.py seq --workload W --db D``.
Placement's own WSGI app is built with ``deploy.loadapp`` (as its functional-test fixture does:
``auth_strategy=noauth2``, a SQLite database, default policy) and called in-process through
WebOb - no network, no code copied. Requests carry ``x-auth-token: admin`` and the microversion
Nova sends: 1.38 for claims (``PUT /allocations/{c}`` with ``consumer_type``), 1.28 for
``move_allocations`` (GET source and target, then ``POST /allocations`` swapping them with
consumer generations) and for deletes (GET, then ``PUT`` of ``{}`` with the generation).

Durability: Placement reaches SQLite through SQLAlchemy/oslo.db, which leaves SQLite's default
rollback journal. A SQLAlchemy ``connect`` listener sets ``journal_mode=WAL`` and
``synchronous=FULL`` on every connection, exactly evstore's default settings (checked and
reported). The first line of output is the JSON result (stdlib + placement only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import Recorder, emit  # type: ignore[import-not-found,unused-ignore]
from workload import COMMANDS_PER_OP, INVENTORY, Op, Workload  # type: ignore[import-not-found,unused-ignore]

CLAIM_VERSION = "placement 1.38"
MOVE_VERSION = "placement 1.28"


def durable_sqlite() -> None:
    from sqlalchemy import event  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from sqlalchemy.engine import Engine  # type: ignore[import-not-found,import-untyped,unused-ignore]

    @event.listens_for(Engine, "connect")  # type: ignore[untyped-decorator,misc,unused-ignore]
    def _pragmas(dbapi_con: Any, _record: Any) -> None:
        cur = dbapi_con.cursor()
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.close()


def build_app(db: str) -> Any:
    import logging

    logging.getLogger().setLevel(logging.WARNING)  # as the evstore side: no info logging
    durable_sqlite()
    from oslo_config import cfg  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from oslo_policy import opts as policy_opts  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from placement import conf as placement_conf  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from placement import db_api, deploy  # type: ignore[import-not-found,import-untyped,unused-ignore]
    from placement.db.sqlalchemy import migration  # type: ignore[import-not-found,import-untyped,unused-ignore]

    conf = cfg.ConfigOpts()
    placement_conf.register_opts(conf)
    policy_opts.set_defaults(conf)
    conf.set_override("auth_strategy", "noauth2", group="api")
    conf.set_override("connection", f"sqlite:///{db}", group="placement_database")
    conf([], default_config_files=[])
    db_api.configure(conf)
    migration.create_schema(db_api.get_placement_engine())
    return deploy.loadapp(conf)


class Client:
    """Placement's HTTP API, called in-process."""

    def __init__(self, app: Any) -> None:
        import webob  # type: ignore[import-not-found,import-untyped,unused-ignore]

        self.app = app
        self.webob = webob
        self.requests = 0

    def call(self, method: str, path: str, body: Any = None, version: str = CLAIM_VERSION) -> Any:
        headers = {"x-auth-token": "admin", "openstack-api-version": version, "accept": "application/json"}
        kwargs: dict[str, Any] = {"method": method, "headers": headers}
        if body is not None:
            headers["content-type"] = "application/json"
            kwargs["body"] = json.dumps(body).encode()
        response = self.webob.Request.blank(path, **kwargs).get_response(self.app)
        self.requests += 1
        return response

    def ok(self, method: str, path: str, body: Any = None, version: str = CLAIM_VERSION) -> Any:
        r = self.call(method, path, body, version)
        if r.status_int >= 400:
            raise RuntimeError(f"{method} {path}: {r.status} {r.text[:300]}")
        return r.json if r.body else None


class Nova:
    """What Nova's report client does for each workload operation."""

    def __init__(self, client: Client) -> None:
        self.c = client
        self.owners: dict[str, tuple[str, str]] = {}

    def claim(self, consumer: str, allocs: dict[str, dict[str, int]], project: str, user: str) -> None:
        body = {
            "allocations": {p: {"resources": res} for p, res in allocs.items()},
            "project_id": project,
            "user_id": user,
            "consumer_generation": None,
            "consumer_type": "INSTANCE",
        }
        self.c.ok("PUT", f"/allocations/{consumer}", body)

    def move_allocations(self, source: str, target: str, target_type: str) -> bool:
        """``SchedulerReportClient.move_allocations`` (nova/scheduler/client/report.py)."""
        src = self.c.ok("GET", f"/allocations/{source}", version=MOVE_VERSION)
        tgt = self.c.ok("GET", f"/allocations/{target}", version=MOVE_VERSION)
        if tgt["allocations"] and not src["allocations"]:
            return True
        if not src["allocations"]:
            return False
        body = {
            source: {
                "allocations": {},
                "project_id": src["project_id"],
                "user_id": src["user_id"],
                "consumer_generation": src["consumer_generation"],
            },
            target: {
                "allocations": src["allocations"],
                "project_id": src["project_id"],
                "user_id": src["user_id"],
                "consumer_generation": tgt.get("consumer_generation"),
            },
        }
        self.c.ok("POST", "/allocations", body, version=MOVE_VERSION)
        return True

    def delete_allocation_for_instance(self, consumer: str) -> bool:
        got = self.c.ok("GET", f"/allocations/{consumer}", version=MOVE_VERSION)
        if got["allocations"] == {}:
            return False
        got["allocations"] = {}
        self.c.ok("PUT", f"/allocations/{consumer}", got, version=MOVE_VERSION)
        return True

    def run(self, op: Op) -> str:
        kind = op[0]
        if kind == "build":
            _, inst, prov, res, project, user = op
            self.owners[inst] = (project, user)
            self.claim(inst, {prov: res}, project, user)
        elif kind == "migrate":
            _, inst, mig, dest, res = op
            project, user = self.owners[inst]
            self.move_allocations(inst, mig, "MIGRATION")  # replace_allocation_with_migration
            self.claim(inst, {dest: res}, project, user)  # the scheduler's claim on the destination
        elif kind == "revert":
            # revert_allocation_for_migration: Placement cannot tell that the instance was deleted
            self.move_allocations(op[2], op[1], "INSTANCE")
            return "leaked" if op[1] in self.deleted else "ok"
        elif kind == "confirm":
            self.delete_allocation_for_instance(op[2])
        elif kind == "delete":
            self.deleted.add(op[1])
            self.delete_allocation_for_instance(op[1])
        return "ok"

    deleted: set[str] = set()


def setup(client: Client, w: Workload) -> None:
    for uuid, name in zip(w.providers, w.provider_names, strict=True):
        client.ok("POST", "/resource_providers", {"uuid": uuid, "name": name})
        client.ok(
            "PUT",
            f"/resource_providers/{uuid}/inventories",
            {"resource_provider_generation": 0, "inventories": INVENTORY},
        )


def check_durability(db: str) -> dict[str, Any]:
    from placement import db_api  # type: ignore[import-not-found,import-untyped,unused-ignore]

    engine = db_api.get_placement_engine()
    with engine.connect() as conn:
        raw = conn.connection.dbapi_connection
        sync = raw.execute("PRAGMA synchronous").fetchone()[0]
        mode = raw.execute("PRAGMA journal_mode").fetchone()[0]
    return {"synchronous": sync, "journal_mode": mode}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("phase", choices=["seq"])
    p.add_argument("--workload", required=True)
    p.add_argument("--db", required=True)
    p.add_argument("--max-ops", type=int, default=0, help="run only the first N operations")
    args = p.parse_args()
    with open(args.workload) as f:
        w = Workload.from_json(json.load(f))
    app = build_app(args.db)
    client = Client(app)
    setup(client, w)
    nova = Nova(client)
    nova.deleted = set()
    ops = w.streams[0][: args.max_ops] if args.max_ops else w.streams[0]
    rec = Recorder()
    client.requests = 0
    rec.start()
    for op in ops:
        t0 = time.perf_counter()
        outcome = nova.run(op)
        rec.add(time.perf_counter() - t0, outcome, COMMANDS_PER_OP[op[0]])
    rec.stop()
    requests = client.requests
    qrec = Recorder()
    qrec.start()
    for q in w.queries:
        t0 = time.perf_counter()
        if q[0] == "usage":
            client.ok("GET", f"/resource_providers/{q[1]}/usages")
        else:
            client.ok("GET", f"/allocations/{q[1]}", version=MOVE_VERSION)
        qrec.add(time.perf_counter() - t0)
    qrec.stop()
    leaked = sum(
        1
        for c in sorted(nova.deleted)
        if client.ok("GET", f"/allocations/{c}", version=MOVE_VERSION)["allocations"]
    )
    from importlib.metadata import version

    result = rec.result(
        queries=qrec.result(),
        http_requests=requests,
        leaked_consumers=leaked,
        deleted_consumers=len(nova.deleted),
        durability=check_durability(args.db),
        version=version("openstack-placement"),
        operations=len(ops),
    )
    result["system"] = "placement"
    result["phase"] = "seq"
    emit(result)


if __name__ == "__main__":
    main()
