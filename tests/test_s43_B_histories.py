"""A history checker for concurrent runs (stop 43, helper B).

Many clients (``tests/s43_B_worker.py``) issue a random mix of commands on entities they all name
alike - claims with the generation just read (or none), migrations started, moved (Nova's
``move_allocations``), reverted and confirmed, releases, deletes racing reverts (half of them under
one shared idempotency key), inventory changes with a generation and without one, spare providers
created and deleted - each recording when it was invoked and when its answer came
(``time.monotonic_ns``: CLOCK_MONOTONIC, which every process of the machine shares) and the answer.
They run as asyncio tasks on one store, as several stores in one process (several connections),
and as several OS processes on one SQLite file or one PostgreSQL schema. The log read afterwards
is then checked against the history:

1. every accepted command's events are in the log exactly once, at the positions it was told (the
   inventory commands, which answer a generation, by their request id: one event, that generation),
   with its request id and actor; every event after the set-up belongs to an accepted command;
   at most one command ran under an idempotency key, and every one under that key invoked after
   it was answered was answered its positions, ``replayed`` (keyed deletes from every client; a
   claim under its own key, sent twice at once and then once more; a command whose caller timed
   out committed whole or not at all, and its repeat under its key, invoked after, was answered
   its positions, replayed, if and only if it had committed);
2. no rejected command left an event (nothing in the log carries its request id);
3. real-time order: when A's answer came before B was invoked, A's positions are below B's;
4. the log order is a legal sequential history: each accepted command, decided by this file's own
   model of the rules against the log's prefix just before its first event, is accepted, appending
   events of the types the model says (a move not a migration when the instance holds other
   allocations under the generation it was sent, README's narrowing); and each
   rejection is justified - at some prefix in its window (from the last position of a command
   answered before it was invoked to the last position before the first event of a command invoked
   after its answer) the model refuses it with the same code (``ConsumerDeleted``: a tombstone of
   the instance, migration or the migration's instance; ``ConcurrentUpdate``: the generation it sent
   was stale, or the migration held something; ``CapacityExceeded``, ``ConstraintViolation``,
   ``InvalidInventory``: Placement's row-by-row check against that prefix's inventories and usage;
   ``InventoryInUse``, ``ProviderInUse``, ``ProviderNotFound``, ``DuplicateName``, ``NotFound``
   likewise); a delete that appended nothing found a tombstone there;
   Reads too (``allocations``, ``inventories``, ``usage``, which the clients make before their
   commands): each answer is what the model holds at some prefix of its window;
5. each event's payload agrees with the model ("previous", "released", provider generations +1);
6. afterwards the projection equals the model (allocations, deleted, generations, usage), each
   consumer's and provider's ``history`` holds, in order, events naming it, every one naming it as
   its consumer, instance, migration or provider among them (the processes' SQLite history index
   caught up every few events, ``EVSTORE_TEST_HISTORY_LAG``), the audit
   (projection against a fresh replay) is clean, and no deleted consumer - nor a migration of a
   deleted instance - holds anything.

Small by default (a few seconds a test); ``EVSTORE_SLOW=1`` runs a bigger campaign.
``EVSTORE_S43B_SEED`` replays one seed (printed in every failure).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import random
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, open_store
from tests import s43_B_worker as worker
from tests.conftest import campaign_seed

SLOW = os.environ.get("EVSTORE_SLOW") == "1"

CD = "evstore.consumer.deleted"
CONFLICT = "placement.concurrent_update"
PNF = "placement.resource_provider.not_found"
NOT_FOUND = "evstore.not_found"
INVALID_INV = "evstore.inventory.invalid"
CONSTRAINT = "evstore.allocation.constraint_violation"
CAPACITY = "evstore.allocation.capacity_exceeded"
INV_IN_USE = "placement.inventory.inuse"
PROV_IN_USE = "placement.resource_provider.inuse"
DUPLICATE = "placement.duplicate_name"
INVALID_INPUT = "evstore.invalid_input"
STORAGE = "evstore.storage"
#: a known bare error (asyncpg's), strict-xfailed in tests/test_s43_B_pg_read_timeouts.py: a read
#: that runs out of PostgreSQL's command_timeout may raise it instead of evstore.storage
KNOWN_BARE = "connection has been released back to the pool"
NOOP = "(accepted, nothing appended)"

#: the event types each accepted command appends
EVENT_TYPES = {
    "claim": {"AllocationsReplaced"},
    "start": {"MigrationStarted"},
    "move": {"MigrationStarted", "AllocationsReplaced"},  # (which: ``Model.appends``)
    "revert": {"MigrationReverted"},
    "confirm": {"MigrationConfirmed"},
    "release": {"AllocationsReleased"},
    "delete": {"ConsumerDeleted"},
    "setinv": {"InventoriesReplaced"},
    "setone": {"InventoriesReplaced"},
    "delinv": {"InventoriesReplaced"},
    "create": {"ProviderCreated"},
    "delprov": {"ProviderDeleted"},
}


def _seed() -> int:
    return int(os.environ.get("EVSTORE_S43B_SEED") or campaign_seed("s43-histories"))


@dataclass
class Model:
    """The state a prefix of the log leaves, folded here from the exported rows, and the rules a
    command is decided by (SPEC section 2 and Placement's check order), written independently of
    evstore's ``decide``."""

    providers: dict[str, dict[str, Any]] = field(default_factory=dict)  # uuid -> name, gen, inv
    usage: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    alloc: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    gen: dict[str, int | None] = field(default_factory=dict)
    tomb: dict[str, int] = field(default_factory=dict)
    behalf: dict[str, str] = field(default_factory=dict)  # migration -> its instance
    problems: list[str] = field(default_factory=list)

    # --- the fold -------------------------------------------------------------------------

    def _set(self, c: str, allocs: dict[str, dict[str, int]]) -> None:
        for p, rcs in self.alloc.pop(c, {}).items():
            for rc, n in rcs.items():
                self.usage[p, rc] -= n
        if allocs:
            self.alloc[c] = {p: dict(r) for p, r in allocs.items()}
            for p, rcs in allocs.items():
                for rc, n in rcs.items():
                    self.usage[p, rc] += n

    def _expect(self, pos: int, what: str, got: object, want: object) -> None:
        if got != want:
            self.problems.append(f"{pos}: {what}: event says {got}, the model {want}")

    def _bump(self, pos: int, gens: dict[str, int]) -> None:
        for p, g in gens.items():
            self._expect(pos, f"provider {p} generation", g, self.providers[p]["gen"] + 1)
            self.providers[p]["gen"] = g

    def apply(self, pos: int, typ: str, d: dict[str, Any]) -> None:
        if typ == "ProviderCreated":
            self.providers[d["provider"]] = {"name": d["name"], "gen": 0, "inv": {}}
        elif typ == "ProviderDeleted":
            p = d["provider"]
            if any(self.usage[p, rc] for rc in self.providers[p]["inv"]):
                self.problems.append(f"{pos}: provider {p} deleted holding allocations")
            del self.providers[p]
        elif typ == "InventoriesReplaced":
            p = d["provider"]
            self._expect(pos, f"inventory generation of {p}", d["generation"], self.providers[p]["gen"] + 1)
            self.providers[p].update(gen=d["generation"], inv=d["inventories"])
        elif typ == "AllocationsReplaced":
            c = d["consumer"]
            self._expect(pos, f"previous of {c}", d["previous"], self.alloc.get(c, {}))
            self._set(c, d["allocations"])
            self._bump(pos, d["provider_generations"])
            self.gen[c] = d["generation"] if d["allocations"] else None
            if not d["allocations"]:
                self.behalf.pop(c, None)
        elif typ == "AllocationsReleased":
            c = d["consumer"]
            self._expect(pos, f"released of {c}", d["released"], self.alloc.get(c, {}))
            self._set(c, {})
            self.gen[c] = None
            self.behalf.pop(c, None)
        elif typ == "MigrationStarted":
            i, m = d["instance"], d["migration"]
            self._expect(pos, f"moved from {i}", d["allocations"], self.alloc.get(i, {}))
            self._set(i, {})
            self.gen[i] = None
            self._set(m, d["allocations"])
            self.gen[m] = d["migration_generation"]
            self.behalf[m] = i
            self._bump(pos, d["provider_generations"])
        elif typ == "MigrationReverted":
            i, m = d["instance"], d["migration"]
            self._expect(pos, f"reverted from {m}", d["allocations"], self.alloc.get(m, {}))
            self._expect(pos, f"replaced of {i}", d["replaced"], self.alloc.get(i, {}))
            self._set(m, {})
            self.gen[m] = None
            self.behalf.pop(m, None)
            self._set(i, d["allocations"])
            self.gen[i] = d["instance_generation"]
            self._bump(pos, d["provider_generations"])
        elif typ == "MigrationConfirmed":
            m = d["migration"]
            self._expect(pos, f"released of {m}", d["released"], self.alloc.get(m, {}))
            self._set(m, {})
            self.gen[m] = None
            self.behalf.pop(m, None)
        elif typ == "ConsumerDeleted":
            c = d["consumer"]
            self._expect(pos, f"released of {c}", d["released"], self.alloc.get(c, {}))
            held = {m: self.alloc[m] for m, i in self.behalf.items() if i == c and m in self.alloc}
            self._expect(pos, f"migrations released with {c}", d["migrations_released"], held)
            self._set(c, {})
            self.gen[c] = None
            for m in d["migrations_released"]:
                self._set(m, {})
                self.gen[m] = None  # (the link to the instance is kept)
            if c in self.tomb:
                self.problems.append(f"{pos}: {c} deleted again (first at {self.tomb[c]})")
            self.tomb.setdefault(c, pos)
        else:
            self.problems.append(f"{pos}: unexpected event type {typ}")

    # --- the rules ------------------------------------------------------------------------

    def _rows(self, changes: list[tuple[str, dict[str, dict[str, int]]]]) -> str | None:
        """Placement's checks of an allocation command's rows: providers, inventory, then row by row
        constraints and capacity after the consumers' old allocations are removed."""
        rows: list[tuple[str, str, int]] = []
        for c, new in changes:
            if new:
                rows += [(p, rc, n) for p, res in new.items() for rc, n in res.items()]
            else:
                rows += [(p, rc, 0) for p, res in self.alloc.get(c, {}).items() for rc in res]
        named = list(dict.fromkeys(p for p, _, _ in rows))
        if any(p not in self.providers for p in named):
            return PNF
        classes = {rc for _, rc, _ in rows}
        if any(not classes & self.providers[p]["inv"].keys() for p in named):
            return INVALID_INV
        before = {(p, rc): self.usage[p, rc] for p, rc, _ in rows}
        used = dict(before)
        for c, _ in changes:
            for p, res in self.alloc.get(c, {}).items():
                for rc, n in res.items():
                    if (p, rc) in used:
                        used[p, rc] -= n
        running: dict[tuple[str, str], int] = defaultdict(int)
        for p, rc, n in rows:
            running[p, rc] += n
            if n == 0:
                continue
            inv = self.providers[p]["inv"].get(rc)
            if inv is None:
                return INVALID_INV
            if n < inv["min_unit"] or n > inv["max_unit"] or n % inv["step_size"]:
                return CONSTRAINT
            capacity = (inv["total"] - inv["reserved"]) * inv["allocation_ratio"]
            after = used[p, rc] + running[p, rc]
            if capacity < after and not (before[p, rc] and after <= before[p, rc]):
                return CAPACITY
        return None

    def _dead_migration(self, m: str) -> bool:
        return m in self.behalf and self.behalf[m] in self.tomb

    def appends(self, op: str, a: dict[str, Any]) -> list[str]:
        """The types of the events an accepted command appends here. A move is recorded as a
        ``MigrationStarted`` only when the instance holds exactly what is moved (README: another
        write is a plain one, two ``AllocationsReplaced`` - or one, of the target, for an absent
        instance); the generation it was sent can match while it does not: a consumer emptied and
        written again starts again at generation 1."""
        if op != "move":
            return sorted(EVENT_TYPES[op])
        i, m = a["instance"], a["migration"]
        if self.alloc.get(i) == a["allocations"] and i not in self.behalf and m not in self.behalf:
            return ["MigrationStarted"]
        return ["AllocationsReplaced"] * (2 if self.alloc.get(i) else 1)

    def observe(self, op: str, a: dict[str, Any]) -> dict[str, Any]:
        """What a read answers here."""
        if op == "read_consumer":
            c = a["consumer"]
            return {
                "allocations": self.alloc.get(c, {}),
                "generation": self.gen.get(c),
                "deleted": c in self.tomb,
            }
        prov = self.providers.get(a["provider"])
        if prov is None:
            return {"code": PNF}
        if op == "read_inventories":
            return {"generation": prov["gen"], "inventories": prov["inv"]}
        return {
            "generation": prov["gen"],
            "usages": {rc: self.usage[a["provider"], rc] for rc in prov["inv"]},
        }

    def decide(self, op: str, a: dict[str, Any]) -> str | None:
        """The code this prefix refuses the command with; None to accept it, NOOP for a delete of a
        deleted consumer."""
        if op == "claim":
            c = a["consumer"]
            if c in self.tomb or (self._dead_migration(c) and a["allocations"]):
                return CD
            if self.gen.get(c) != a["generation"]:
                return CONFLICT
            return self._rows([(c, a["allocations"])])
        if op == "start":
            i, m = a["instance"], a["migration"]
            if i in self.tomb or m in self.tomb:
                return CD
            if self.behalf.get(m, i) != i and not self.alloc.get(m) and self._dead_migration(m):
                return CD
            if not self.alloc.get(i):
                return NOT_FOUND
            if self.alloc.get(m):
                return CONFLICT
            if i in self.behalf:
                return INVALID_INPUT
            return self._rows([(i, {}), (m, self.alloc[i])])
        if op == "move":
            i, m = a["instance"], a["migration"]
            for c, gen, new in ((i, a["generation"], {}), (m, None, a["allocations"])):
                if c in self.tomb:
                    return CD
                if self.gen.get(c) != gen:
                    return CONFLICT
                if new and self._dead_migration(c):
                    return CD
            return self._rows([(i, {}), (m, a["allocations"])])
        if op in ("revert", "confirm"):
            m = a["migration"]
            if m in self.tomb:
                return CD
            if m not in self.behalf:
                return NOT_FOUND
            i = self.behalf[m]
            if i in self.tomb and (op == "revert" or not self.alloc.get(m)):
                return CD
            if not self.alloc.get(m):
                return NOT_FOUND
            if op == "confirm":
                return None
            if i in self.behalf:
                return INVALID_INPUT
            return self._rows([(m, {}), (i, self.alloc[m])])
        if op == "release":
            return None if self.alloc.get(a["consumer"]) else NOT_FOUND
        if op == "delete":
            return NOOP if a["consumer"] in self.tomb else None
        p = a["provider"]
        if op == "create":
            taken = p in self.providers or any(q["name"] == a["name"] for q in self.providers.values())
            return DUPLICATE if taken else None
        if p not in self.providers:
            return PNF
        prov = self.providers[p]
        if op == "delprov":
            return PROV_IN_USE if any(self.usage[p, rc] for rc in prov["inv"]) else None
        if op == "delinv":
            rc = a["resource_class"]
            if rc not in prov["inv"]:
                return NOT_FOUND
            return INV_IN_USE if self.usage[p, rc] else None
        if prov["gen"] != a["generation"]:
            return CONFLICT
        if op == "setinv":
            removed = [rc for rc in prov["inv"] if rc not in a["inventories"] and self.usage[p, rc]]
            return INV_IN_USE if removed else None
        return None  # setone


@dataclass
class Check:
    """A command the model must decide as the store answered, at some prefix in [low, high]."""

    low: int
    high: int
    want: str | None
    record: dict[str, Any]
    justified: bool = False
    #: an accepted command's events' types, in the log
    types: list[str] | None = None


def check_history(
    records: list[dict[str, Any]], rows: list[dict[str, Any]], setup_head: int, seed: int
) -> tuple[list[str], Model, dict[str, Any]]:
    """Properties 1-5 of the module's docstring; answers the problems found, the model folded to the
    head, and counts for the report."""
    problems: list[str] = []
    head = len(rows)
    if [r["position"] for r in rows] != list(range(1, head + 1)):
        problems.append("positions are not 1..head")
    meta = [json.loads(r["metadata"] or "{}") for r in rows]
    by_rid: dict[str, list[int]] = defaultdict(list)
    for r, m in zip(rows, meta, strict=True):
        if r["position"] > setup_head:
            by_rid[m.get("request_id")].append(r["position"])
    rids = {rec["rid"] for rec in records}
    if len(rids) != len(records):
        problems.append("request ids repeat")
    owner: dict[int, dict[str, Any]] = {}
    accepted: list[tuple[dict[str, Any], list[int]]] = []  # (record, its positions in the log)
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for rec in records:
        rid, logged = rec["rid"], by_rid.get(rec["rid"], [])
        if rec["outcome"] == "read":
            if logged:
                problems.append(f"{rid}: a read, yet events carry its request id: {logged}")
            continue
        if rec["outcome"] == "crashed" and KNOWN_BARE in rec["message"]:
            continue  # (tests/test_s43_B_pg_read_timeouts.py: counted in the stats)
        if rec["outcome"] == "crashed":
            problems.append(f"{rid} {rec['op']} raised a bare {rec['code']}: {rec['message']}")
            continue
        if rec["key"] is not None:
            by_key[rec["key"]].append(rec)
        if rec["outcome"] == "rejected" and rec["code"] == STORAGE:
            # a failure, not a decision: rolled back (outcome_unknown False), committed, or either
            if rec["details"].get("outcome_unknown"):
                if rec["details"].get("committed") and not logged:
                    problems.append(f"{rid} {rec['op']} said committed, but appended nothing: {rec}")
                rec["outcome"] = "unknown"
            elif logged:
                problems.append(f"{rid} {rec['op']} said rolled back, yet appended {logged}: {rec}")
        if rec["outcome"] == "rejected":
            if logged:
                problems.append(f"{rid} {rec['op']} rejected ({rec['code']}) left events at {logged}")
            continue
        if rec["outcome"] in ("timeout", "unknown"):  # committed whole, or not at all
            for p in logged:
                owner[p] = rec
                if rows[p - 1]["type"] not in EVENT_TYPES[rec["op"]]:
                    problems.append(f"{rid} {rec['op']}: event {p} is a {rows[p - 1]['type']}")
            if logged:
                rec["positions"] = logged
                accepted.append((rec, logged))
            continue
        if rec.get("replayed"):
            if logged:
                problems.append(f"{rid} replayed, yet appended {logged}")
            continue
        if rec["positions"] is not None and sorted(rec["positions"]) != logged:
            problems.append(
                f"{rid} {rec['op']} told {rec['positions']}, the log holds its events at {logged}"
            )
        for p in logged:
            owner[p] = rec
            if rows[p - 1]["type"] not in EVENT_TYPES[rec["op"]]:
                problems.append(f"{rid} {rec['op']}: event {p} is a {rows[p - 1]['type']}")
            if meta[p - 1].get("actor") != rec["client"]:
                problems.append(f"{rid}: event {p} has actor {meta[p - 1].get('actor')}")
        if rec["op"] in ("setinv", "setone", "delinv"):
            gens = [json.loads(rows[p - 1]["data"]).get("generation") for p in logged]
            if gens != [rec.get("generation")]:
                problems.append(
                    f"{rid} {rec['op']} answered generation {rec.get('generation')}; its events {gens}"
                )
        elif not logged and rec["op"] != "delete":
            problems.append(f"{rid} {rec['op']} accepted with nothing appended")
        accepted.append((rec, logged))
    unowned = [p for p in range(setup_head + 1, head + 1) if p not in owner]
    if unowned:
        problems.append(f"events of no accepted command: {[(p, meta[p - 1]) for p in unowned[:5]]}")
    for key, recs in by_key.items():
        # At most one command ran under a key; once it was answered, every command under that key
        # is answered its receipt (replayed) - one refused, or appending again, would be decided
        # afresh - and a command answered as replayed was answered after that one began.
        ran = [
            r
            for r in recs
            if (r["outcome"] == "accepted" and not r.get("replayed"))
            or (r["outcome"] in ("timeout", "unknown") and r.get("positions"))
        ]
        if len(ran) > 1:
            problems.append(f"key {key}: {len(ran)} commands ran under it: {[r['rid'] for r in ran]}")
        for r in recs:
            if not ran:
                if r.get("replayed"):
                    problems.append(f"key {key}: {r['rid']} replayed, but no command under it ran")
                continue
            if r is ran[0] or r["outcome"] in ("timeout", "unknown") or r.get("code") == STORAGE:
                continue
            if r["inv"] > ran[0]["resp"] and not r.get("replayed"):
                problems.append(f"key {key}: {r['rid']} after {ran[0]['rid']} ended, yet decided again: {r}")
            if r.get("replayed") and (r["positions"] != ran[0]["positions"] or r["resp"] < ran[0]["inv"]):
                problems.append(f"key {key}: repeat {r['rid']} answered {r['positions']} of {ran[0]}")

    # 3. real-time order, and the windows of the model's checks
    # (a command whose caller timed out has no time of its answer: it is never "answered before")
    appended = sorted(
        (rec["resp"], max(pos)) for rec, pos in accepted if pos and rec["outcome"] == "accepted"
    )
    done_at = [t for t, _ in appended]
    done_max: list[int] = []
    for _, p in appended:
        done_max.append(max(p, done_max[-1] if done_max else setup_head))
    begun = sorted((owner[p]["inv"], p) for p in owner)
    begun_at = [t for t, _ in begun]
    begun_min: list[int] = [head + 1] * (len(begun) + 1)
    for j in range(len(begun) - 1, -1, -1):
        begun_min[j] = min(begun[j][1], begun_min[j + 1])

    def low(t: int) -> int:  # the last position of a command answered before t
        j = bisect.bisect_left(done_at, t)
        return done_max[j - 1] if j else setup_head

    def high(t: int) -> int:  # the last position before every event of a command invoked after t
        return begun_min[bisect.bisect_right(begun_at, t)] - 1

    checks: list[Check] = []
    rt_violations = 0
    for rec, pos in accepted:
        if pos:
            if low(rec["inv"]) >= min(pos):
                rt_violations += 1
                if rt_violations <= 5:
                    problems.append(
                        f"real time: {rec['rid']} {rec['op']} at {pos} was invoked after a command "
                        f"answered at {low(rec['inv'])} had been answered"
                    )
            types = [rows[p - 1]["type"] for p in pos]
            checks.append(Check(min(pos) - 1, min(pos) - 1, None, rec, types=types))
        else:  # a delete of a deleted consumer
            checks.append(Check(low(rec["inv"]), high(rec["resp"]), NOOP, rec))
    for rec in records:
        if rec["outcome"] == "rejected" and rec["code"] != STORAGE:
            checks.append(Check(low(rec["inv"]), high(rec["resp"]), rec["code"], rec))
        elif rec["outcome"] == "read" and rec["answer"].get("code") != STORAGE:
            checks.append(Check(low(rec["inv"]), high(rec["resp"]), None, rec))

    # 4, 5. the model along the log, each check decided at the prefixes of its window
    checks.sort(key=lambda c: c.low)
    model = Model()
    active: list[Check] = []
    nxt = 0
    for k in range(0, head + 1):
        if k:
            r = rows[k - 1]
            model.apply(k, r["type"], json.loads(r["data"]))
        while nxt < len(checks) and checks[nxt].low <= k:
            active.append(checks[nxt])
            nxt += 1
        still: list[Check] = []
        for c in active:
            if c.high < k:
                continue  # (judged below)
            op, args = c.record["op"], c.record["args"]
            if c.record["outcome"] == "read":
                c.justified = model.observe(op, args) == c.record["answer"]
            elif model.decide(op, args) == c.want and (c.types is None or model.appends(op, args) == c.types):
                c.justified = True
            if not c.justified:
                still.append(c)
        active = still
    unjustified = [c for c in checks if not c.justified]
    for c in unjustified[:8]:
        rec = c.record
        what = f"accepted, appending {c.types}," if c.want is None else c.want
        if rec["outcome"] == "read":
            what = f"answered {rec['answer']}"
        problems.append(
            f"{rec['rid']} {rec['op']} {rec['args']} {what}, which no prefix in [{c.low}, {c.high}] "
            f"justifies ({rec.get('message', '')})"
        )
    problems += model.problems[:10]
    stats = {
        "commands": sum(r["outcome"] != "read" for r in records),
        "accepted": len(accepted),
        "rejected": sum(r["outcome"] == "rejected" for r in records),
        "events": head - setup_head,
        "codes": dict(sorted(_count(r.get("code") for r in records if r["outcome"] == "rejected").items())),
        "checks": len(checks),
        "unjustified": len(unjustified),
        "wide_windows": sum(c.high > c.low for c in checks),
        "reads": sum(r["outcome"] == "read" for r in records),
        "timeouts": sum(r["outcome"] == "timeout" for r in records),
        "storage_unknown": sum(r["outcome"] == "unknown" for r in records),
        "known_bare": sorted(r["op"] for r in records if r["outcome"] == "crashed"),
        "timeouts_committed": sum(r["outcome"] == "timeout" and bool(r.get("positions")) for r in records),
        "seed": seed,
    }
    return [f"seed {seed}: {p}" for p in problems], model, stats


def _count(items: Any) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    for i in items:
        out[i] += 1
    return out


async def _rows(store: AllocationStore) -> list[dict[str, Any]]:
    return [json.loads(line) async for line in store.export()][1:]


async def check_run(
    store: AllocationStore, records: list[dict[str, Any]], setup_head: int, seed: int, both: bool = True
) -> dict[str, Any]:
    """Every property of the module's docstring; answers the counts."""
    rows = await _rows(store)
    problems, model, stats = check_history(records, rows, setup_head, seed)
    # 6. the projection, the audit, the deleted
    for c in set(model.gen) | set(model.tomb):
        view = await store.allocations(c)
        want = (model.alloc.get(c, {}), c in model.tomb, model.gen.get(c) if c in model.alloc else None)
        got = (dict(view.allocations), view.deleted, view.generation if view.allocations else None)
        if got != want:
            problems.append(f"seed {seed}: allocations({c}) {got}, the log's fold {want}")
        if (c in model.tomb or model._dead_migration(c)) and view.allocations:
            problems.append(f"seed {seed}: deleted {c} (or a migration of a deleted instance) holds {view}")
    for p, prov in model.providers.items():
        u = await store.usage(p)
        if (u.generation, dict(u)) != (prov["gen"], {rc: model.usage[p, rc] for rc in prov["inv"]}):
            problems.append(f"seed {seed}: usage({p}) {u.generation} {dict(u)}, the fold {prov}")
    # the histories: each consumer's and provider's, increasing, of events naming it, and every
    # event naming it as the consumer, instance, migration or provider of the event
    naming: dict[str, set[int]] = defaultdict(set)
    texts = {r["position"]: r["data"] for r in rows}
    for r in rows:
        d = json.loads(r["data"])
        for f in ("consumer", "instance", "migration", "provider"):
            if isinstance(d.get(f), str):
                naming[d[f]].add(r["position"])
        for p in d.get("provider_generations") or {}:
            naming[p].add(r["position"])
    for x in sorted(set(model.gen) | set(model.tomb) | set(model.providers)):
        hist = [e.position async for e in store.history(x)]
        if hist != sorted(set(hist)) or any(x not in texts.get(p, "") for p in hist):
            problems.append(f"seed {seed}: history({x}) {hist}: not increasing, or events not naming it")
        if missing := sorted(naming[x] - set(hist)):
            problems.append(f"seed {seed}: history({x}) lacks {missing}")
    # (an inventory shrunk below its usage is allowed, and the audit reports it: the providers the
    # fold has over capacity, no more, no fewer; anything else - drift, a leak - is a problem)
    report = await store.audit()
    over = {
        (p, rc)
        for p, prov in model.providers.items()
        for rc, i in prov["inv"].items()
        if model.usage[p, rc] > (i["total"] - i["reserved"]) * i["allocation_ratio"]
    }
    others = [f for f in report.findings if f.kind != "over_capacity"]
    reported = {(f.details["provider"], f.details["resource_class"]) for f in report.over_capacity}
    if others or reported != over:
        problems.append(f"seed {seed}: audit {report.findings}; the fold has {over} over capacity")
    assert not problems, "\n".join(problems[:20])
    assert not both or (stats["accepted"] and stats["rejected"]), stats
    return stats


def _sizes(default: tuple[int, int], slow: tuple[int, int]) -> tuple[int, int]:
    return slow if SLOW else default


async def test_tasks_on_one_store(store_url: str) -> None:
    """Clients as asyncio tasks sharing one store (one writer, group commits)."""
    seed = _seed()
    tasks, n = _sizes((6, 30), (12, 250))
    records: list[dict[str, Any]] = []
    async with open_store(store_url) as store:
        await worker.set_up(store, seed)
        setup_head = await store.head()
        await asyncio.gather(*(worker.client(store, seed, f"t{t}", n, records.append) for t in range(tasks)))
        stats = await check_run(store, records, setup_head, seed)
    print(stats)


async def test_several_stores_in_one_process(store_url: str) -> None:
    """Clients on three stores opened on one URL: three writers (three connections, or pools),
    racing for the file's write lock or PostgreSQL's row and advisory locks."""
    seed = _seed()
    stores_n = 3
    tasks, n = _sizes((2, 30), (4, 200))
    records: list[dict[str, Any]] = []
    async with open_store(store_url) as store:
        await worker.set_up(store, seed)
        setup_head = await store.head()
        others = [await open_store(store_url) for _ in range(stores_n - 1)]
        try:
            await asyncio.gather(
                *(
                    worker.client(s, seed, f"s{i}t{t}", n, records.append)
                    for i, s in enumerate([store, *others])
                    for t in range(tasks)
                )
            )
        finally:
            for s in others:
                await s.close()
        stats = await check_run(store, records, setup_head, seed)
    print(stats)


async def test_processes_on_one_store(store_url: str, tmp_path: Path) -> None:
    """Clients in several OS processes on one SQLite file or PostgreSQL schema; their times from
    CLOCK_MONOTONIC, which the processes share."""
    seed = _seed()
    procs_n = 3
    tasks, n = _sizes((2, 25), (3, 150))
    async with open_store(store_url) as store:
        await worker.set_up(store, seed)
        setup_head = await store.head()
        outs = [tmp_path / f"h{i}.jsonl" for i in range(procs_n)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        env["EVSTORE_TEST_HISTORY_LAG"] = str(random.Random(seed).choice([3, 7, 50]))
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.s43_B_worker",
                store_url,
                str(seed),
                str(i),
                str(tasks),
                str(n),
                str(out),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
            )
            for i, out in enumerate(outs)
        ]
        async with asyncio.timeout(600 if SLOW else 120):
            codes = [await p.wait() for p in procs]
        assert codes == [0] * procs_n, f"seed {seed}: workers exited {codes}"
        records = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
        stats = await check_run(store, records, setup_head, seed)
    print(stats)


@pytest.mark.parametrize("options", ["lock_timeout=3ms", "command_timeout=0.05"])
async def test_postgres_under_tight_timeouts(pg_url: str, tmp_path: Path, options: str) -> None:
    """PostgreSQL with a lock_timeout or command_timeout so short that commands fail as
    ``evstore.storage``: one said rolled back (``outcome_unknown`` False) left no event, one said
    committed appended its events, one of unknown outcome committed whole or not at all; the
    rest of the history checks as without them. (A read's bare asyncpg ``InterfaceError`` under
    command_timeout is tests/test_s43_B_pg_read_timeouts.py's finding: left out here, counted.)"""
    seed = _seed()
    tasks, n = _sizes((6, 25), (12, 150))
    records: list[dict[str, Any]] = []
    url = f"{pg_url}&{options}"
    async with open_store(pg_url) as setup:
        await worker.set_up(setup, seed)
        setup_head = await setup.head()
    async with open_store(url) as store:
        await asyncio.gather(*(worker.client(store, seed, f"t{t}", n, records.append) for t in range(tasks)))
    async with open_store(pg_url) as store:
        # (on a loaded machine every command may run out of the timeout: nothing accepted)
        stats = await check_run(store, records, setup_head, seed, both=False)
    print(stats)


def test_the_checker_finds_what_it_looks_for() -> None:
    """The checker itself: a clean made-up history passes; a lost event, a stray one, a reordering
    against real time, an unjustified refusal and a read of a state no prefix in its window had
    each fail it."""
    p, c, m = "11111111-1111-4111-8111-111111111111", "c" * 8, "m" * 8
    inv = {
        "VCPU": {
            "total": 4,
            "reserved": 0,
            "min_unit": 1,
            "max_unit": 4,
            "step_size": 1,
            "allocation_ratio": 1.0,
        }
    }

    def row(pos: int, typ: str, data: dict[str, Any], rid: str | None) -> dict[str, Any]:
        md = json.dumps({"request_id": rid, "actor": "x"}) if rid else "{}"
        return {"position": pos, "type": typ, "data": json.dumps(data), "metadata": md}

    rows = [
        row(1, "ProviderCreated", {"provider": p, "name": "n"}, None),
        row(2, "InventoriesReplaced", {"provider": p, "inventories": inv, "generation": 1}, None),
        row(
            3,
            "AllocationsReplaced",
            {
                "consumer": c,
                "allocations": {p: {"VCPU": 3}},
                "previous": {},
                "generation": 1,
                "provider_generations": {p: 2},
            },
            "r1",
        ),
        row(
            4,
            "ConsumerDeleted",
            {"consumer": c, "released": {p: {"VCPU": 3}}, "migrations_released": {}},
            "r3",
        ),
    ]

    def rec(rid: str, op: str, args: dict[str, Any], inv_: int, resp: int, **answer: Any) -> dict[str, Any]:
        return {
            "rid": rid,
            "client": "x",
            "op": op,
            "args": args,
            "key": None,
            "inv": inv_,
            "resp": resp,
            **answer,
        }

    claim = {"consumer": c, "allocations": {p: {"VCPU": 3}}, "generation": None}
    good = [
        rec("r1", "claim", claim, 10, 20, outcome="accepted", positions=[3], replayed=False),
        rec("r2", "claim", {**claim, "consumer": m}, 15, 25, outcome="rejected", code=CAPACITY, message=""),
        rec("r3", "delete", {"consumer": c}, 30, 40, outcome="accepted", positions=[4], replayed=False),
        rec("r4", "claim", claim, 35, 45, outcome="rejected", code=CD, message=""),
        rec(
            "r5",
            "read_usage",
            {"provider": p},
            21,
            29,
            outcome="read",
            answer={"generation": 2, "usages": {"VCPU": 3}},
        ),
        rec(
            "r6",
            "read_consumer",
            {"consumer": c},
            26,
            50,
            outcome="read",
            answer={"allocations": {}, "generation": None, "deleted": True},
        ),
    ]
    assert check_history(good, rows, 2, 0)[0] == []

    def bad(records: list[dict[str, Any]], log: list[dict[str, Any]] = rows) -> list[str]:
        return check_history(records, log, 2, 0)[0]

    assert bad(good, rows[:3])  # the delete's event lost
    assert bad(good[:2] + good[3:])  # an event of no accepted command
    assert bad([good[0], good[1], {**good[2], "inv": 5, "resp": 8}, good[3]])  # answered before r1 began
    assert bad([*good[:3], {**good[3], "inv": 21, "resp": 22}])  # refused as deleted before the delete began
    assert bad([good[0], {**good[1], "inv": 0, "resp": 5}, *good[2:]])  # full before anything was claimed
    assert bad([*good[:4], {**good[4], "inv": 41, "resp": 42}, good[5]])  # a usage the delete had ended
    assert bad([*good[:5], {**good[5], "inv": 1, "resp": 9}])  # deleted before it was claimed
    stale = {"allocations": {p: {"VCPU": 3}}, "generation": 1, "deleted": False}
    assert bad([*good[:5], {**good[5], "inv": 41, "resp": 50, "answer": stale}])  # after the delete
