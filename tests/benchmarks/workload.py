"""The one workload every system runs, generated deterministically and shared as JSON.

A small cloud: tens of compute nodes (providers) whose popularity is skewed (Zipf-like, as
schedulers pack hot hosts), instances built on them, cold migrations started (instance ->
migration consumer, then destination allocations for the instance), reverted or confirmed,
instances deleted - sometimes while a migration holds their source allocations, immediately
followed by the racing revert (evstore, raw sqlite3 and eventsourcing reject it: tombstone;
Placement accepts it, which is the leak of Nova bug 1848343) - and usage queries.

Operations (JSON lists), with the number of commands each counts for:

- ``["build", instance, provider, {rc: n}, project, user]``        1 command
- ``["migrate", instance, migration, dest_provider, {rc: n}]``      2 (move to migration, destination write)
- ``["revert", instance, migration]``                               1
- ``["confirm", instance, migration]``                              1
- ``["delete", instance]``                                          1
- queries: ``["usage", provider]``, ``["allocations", consumer]``

Stdlib only: the Placement peer imports this module from its own venv.
"""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from typing import Any

Op = list[Any]

COMMANDS_PER_OP = {"build": 1, "migrate": 2, "revert": 1, "confirm": 1, "delete": 1}

FLAVORS = [
    {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 10},
    {"VCPU": 2, "MEMORY_MB": 2048, "DISK_GB": 20},
    {"VCPU": 4, "MEMORY_MB": 8192, "DISK_GB": 40},
    {"VCPU": 8, "MEMORY_MB": 16384, "DISK_GB": 80},
]
FLAVOR_WEIGHTS = [4, 4, 2, 1]

# Generous inventory: the workload measures the write path, not scheduling failures, and every
# system must see the same outcomes (Placement's leaked allocations must never make it run out).
INVENTORY: dict[str, dict[str, Any]] = {
    "VCPU": {"total": 1_000_000, "allocation_ratio": 4.0},
    "MEMORY_MB": {"total": 1_000_000_000, "reserved": 512},
    "DISK_GB": {"total": 100_000_000},
}


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@dataclass
class Workload:
    providers: list[str]
    provider_names: list[str]
    #: one list of operations per concurrent task (the sequential phase uses one stream)
    streams: list[list[Op]]
    queries: list[Op]
    seed: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def commands(self) -> int:
        return sum(COMMANDS_PER_OP[op[0]] for s in self.streams for op in s)

    def to_json(self) -> dict[str, Any]:
        return {
            "providers": self.providers,
            "provider_names": self.provider_names,
            "streams": self.streams,
            "queries": self.queries,
            "seed": self.seed,
            "inventory": INVENTORY,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Workload:
        return cls(
            raw["providers"], raw["provider_names"], raw["streams"], raw["queries"], raw["seed"], raw["meta"]
        )


def _stream(
    rng: random.Random,
    providers: list[str],
    weights: list[float],
    n_commands: int,
    target_live: int,
    tag: int,
) -> list[Op]:
    if len(providers) < 2:
        raise ValueError("a stream needs at least two providers (migrations move between them)")
    project = f"project-{tag % 7}"
    user = f"user-{tag % 13}"
    live: dict[str, tuple[str, dict[str, int]]] = {}  # instance -> (provider, resources)
    migrating: dict[str, str] = {}  # instance -> migration
    ops: list[Op] = []
    commands = 0

    def pick_provider(exclude: str | None = None) -> str:
        while True:
            p = rng.choices(providers, weights)[0]
            if p != exclude:
                return p

    while commands < n_commands:
        choices: list[str] = []
        w: list[float] = []
        if len(live) < target_live:
            choices.append("build")
            w.append(3.0 if len(live) < target_live // 2 else 1.5)
        idle = [i for i in live if i not in migrating]
        if idle:
            choices += ["migrate", "delete"]
            w += [1.5, 1.0]
        if migrating:
            choices += ["revert", "confirm", "delete_racing"]
            w += [1.0, 1.0, 0.4]
        kind = rng.choices(choices, w)[0]
        if kind == "build":
            inst = _uuid(rng)
            res = dict(rng.choices(FLAVORS, FLAVOR_WEIGHTS)[0])
            prov = pick_provider()
            live[inst] = (prov, res)
            ops.append(["build", inst, prov, res, project, user])
        elif kind == "migrate":
            inst = rng.choice(sorted(idle))
            src, res = live[inst]
            mig = _uuid(rng)
            dest = pick_provider(exclude=src)
            migrating[inst] = mig
            live[inst] = (dest, res)
            ops.append(["migrate", inst, mig, dest, res])
        elif kind in ("revert", "confirm"):
            inst = rng.choice(sorted(migrating))
            mig = migrating.pop(inst)
            ops.append([kind, inst, mig])
        elif kind == "delete":
            inst = rng.choice(sorted(idle))
            del live[inst]
            ops.append(["delete", inst])
        else:  # delete_racing: the instance is deleted while its migration holds the source
            inst = rng.choice(sorted(migrating))
            mig = migrating.pop(inst)
            del live[inst]
            ops.append(["delete", inst])
            ops.append(["revert", inst, mig])
        commands += (
            sum(COMMANDS_PER_OP[op[0]] for op in ops[-2:])
            if kind == "delete_racing"
            else (COMMANDS_PER_OP[ops[-1][0]])
        )
    return ops


def generate(
    *,
    n_providers: int = 40,
    streams: int = 1,
    commands_per_stream: int = 1000,
    target_live: int = 200,
    n_queries: int = 1000,
    seed: int = 1848343,
    stream_seed: int | None = None,
    disjoint: bool = False,
) -> Workload:
    """``stream_seed`` varies the operations while keeping the providers (the big log is written
    in slices); ``disjoint`` gives each stream its own share of the providers (the PostgreSQL
    scaling test: clients that never touch a common entity)."""
    rng = random.Random(seed)
    providers = [_uuid(rng) for _ in range(n_providers)]
    names = [f"compute-{i:03d}" for i in range(n_providers)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(n_providers)]  # skewed popularity
    if stream_seed is not None:
        rng = random.Random(stream_seed)
    all_streams = []
    for tag in range(streams):
        if disjoint:
            share = n_providers // streams
            mine = providers[tag * share : (tag + 1) * share]
            all_streams.append(_stream(rng, mine, weights[:share], commands_per_stream, target_live, tag))
        else:
            all_streams.append(_stream(rng, providers, weights, commands_per_stream, target_live, tag))
    consumers = [op[1] for s in all_streams for op in s if op[0] == "build"]
    queries: list[Op] = []
    for _ in range(n_queries if consumers else 0):
        if rng.random() < 0.6:
            queries.append(["usage", rng.choices(providers, weights)[0]])
        else:
            queries.append(["allocations", rng.choice(consumers)])
    return Workload(
        providers,
        names,
        all_streams,
        queries,
        seed,
        {"streams": streams, "commands_per_stream": commands_per_stream, "target_live": target_live},
    )


def expected_outcome(op: Op, deleted: set[str]) -> str:
    """What a tombstoning store must answer (a revert of a deleted instance is rejected)."""
    if op[0] == "revert" and op[1] in deleted:
        return "rejected"
    return "ok"
