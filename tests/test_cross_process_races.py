"""Several processes racing on the same instances and migrations, checked from the outside.

Four writer processes (``tests/xproc_race_worker.py``) share instances and migrations by name, so one
process's ``delete_consumer`` races another's ``revert_migration`` of the same migration, builds race
rewrites, moves race releases. Meanwhile this process subscribes. Afterwards the log is folded here,
by this file's own fold of the export (not evstore's projection), and checked: every acknowledged
command's events are at the positions it was told, no rejected command left an event, positions are
gap-free, no tombstoned consumer (nor a migration holding resources for one) was ever given
allocations, every payload's "before" matches the fold, capacity and provider generations hold at
every event, keyed repeats answered the original positions, and the projection (``usage``,
``allocations``, ``usages``), ``state_at`` at a few positions and the audit agree with the fold; the
subscriber saw every event once, in order.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from evstore import AllocationStore, Inventory, open_store
from tests.conftest import campaign_seed, make_provider

PROCESSES = 4
COMMANDS_PER_TASK = int(
    os.environ.get("EVSTORE_XPROC_COMMANDS", "200" if os.environ.get("EVSTORE_SLOW") == "1" else "40")
)


class Fold:
    """Allocations, tombstones and generations folded from exported rows, checking each event."""

    def __init__(self) -> None:
        self.alloc: dict[str, dict[str, dict[str, int]]] = {}
        self.owner: dict[str, tuple[str, str, str]] = {}
        self.consumer_gen: dict[str, int] = {}
        self.tomb: dict[str, int] = {}
        self.behalf: dict[str, str] = {}  # migration consumer -> instance, while it holds something
        self.inv: dict[str, dict[str, Any]] = {}
        self.provider_gen: dict[str, int] = {}
        self.usage: dict[tuple[str, str], int] = defaultdict(int)
        self.problems: list[str] = []

    def _set(self, consumer: str, allocations: dict[str, dict[str, int]]) -> None:
        for p, rcs in self.alloc.pop(consumer, {}).items():
            for rc, n in rcs.items():
                self.usage[p, rc] -= n
        if allocations:
            self.alloc[consumer] = {p: dict(r) for p, r in allocations.items()}
            for p, rcs in allocations.items():
                for rc, n in rcs.items():
                    self.usage[p, rc] += n
        else:
            self.behalf.pop(consumer, None)

    def _expect(self, pos: int, what: str, got: object, want: object) -> None:
        if got != want:
            self.problems.append(f"{pos}: {what} {got} != fold {want}")

    def capacity(self, p: str, rc: str) -> float:
        i = self.inv.get(p, {}).get(rc)
        return -1.0 if i is None else (i["total"] - i["reserved"]) * i["allocation_ratio"]

    def apply(self, pos: int, typ: str, d: dict[str, Any]) -> None:
        before = dict(self.usage)
        for p, g in (d.get("provider_generations") or {}).items():
            self._expect(pos, f"provider {p} generation", g, self.provider_gen.get(p, -99) + 1)
            self.provider_gen[p] = g
        if typ == "ProviderCreated":
            self.provider_gen[d["provider"]] = 0
        elif typ == "InventoriesReplaced":
            self._expect(pos, "inventory generation", d["generation"], self.provider_gen[d["provider"]] + 1)
            self.provider_gen[d["provider"]] = d["generation"]
            self.inv[d["provider"]] = d["inventories"]
        elif typ == "AllocationsReplaced":
            c = d["consumer"]
            if c in self.tomb and d["allocations"]:
                self.problems.append(f"{pos}: tombstoned {c} given allocations")
            self._expect(pos, "previous", d["previous"], self.alloc.get(c, {}))
            self._set(c, d["allocations"])
            self.consumer_gen[c] = d["generation"]
            self.owner[c] = (d["project_id"], d["user_id"], d["consumer_type"])
        elif typ == "MigrationStarted":
            i, m = d["instance"], d["migration"]
            if i in self.tomb or m in self.tomb or m in self.alloc:
                self.problems.append(f"{pos}: migration {m} started for tombstoned or into a held consumer")
            self._expect(pos, "moved", d["allocations"], self.alloc.get(i, {}))
            self._set(i, {})
            self._set(m, d["allocations"])
            self.behalf[m] = i
            self.consumer_gen[m] = d["migration_generation"]
            self.owner[m] = (d["project_id"], d["user_id"], d["migration_consumer_type"])
        elif typ == "MigrationReverted":
            i, m = d["instance"], d["migration"]
            if i in self.tomb:
                self.problems.append(f"{pos}: revert gave allocations to {i}, tombstoned at {self.tomb[i]}")
            self._expect(pos, "reverted", d["allocations"], self.alloc.get(m, {}))
            self._expect(pos, "replaced", d["replaced"], self.alloc.get(i, {}))
            self._set(m, {})
            self._set(i, d["allocations"])
            self.consumer_gen[i] = d["instance_generation"]
            self.owner[i] = (d["project_id"], d["user_id"], d["instance_consumer_type"])
        elif typ in ("MigrationConfirmed", "AllocationsReleased"):
            c = d["migration"] if typ == "MigrationConfirmed" else d["consumer"]
            self._expect(pos, "released", d["released"], self.alloc.get(c, {}))
            self._set(c, {})
        elif typ == "ConsumerDeleted":
            c = d["consumer"]
            self._expect(pos, "released", d["released"], self.alloc.get(c, {}))
            held = {m: self.alloc[m] for m, i in self.behalf.items() if i == c and m in self.alloc}
            self._expect(pos, "migrations_released", d["migrations_released"], held)
            self._set(c, {})
            for m in held:
                self._set(m, {})
            self.tomb.setdefault(c, pos)
        else:
            self.problems.append(f"{pos}: unexpected {typ}")
        for (p, rc), n in self.usage.items():
            if n > before.get((p, rc), 0) and n > self.capacity(p, rc):
                self.problems.append(f"{pos}: {p} {rc} over capacity: {n} > {self.capacity(p, rc)}")


async def _export_rows(store: AllocationStore) -> list[dict[str, Any]]:
    lines = [line async for line in store.export()]
    return [json.loads(line) for line in lines[1:]]


async def make_race_providers(store: AllocationStore) -> None:
    """The four compute nodes the racing processes share (cn-0 .. cn-3; the workers find them by name)."""
    for i in range(4):
        await make_provider(
            store,
            f"cn-{i}",
            VCPU=Inventory(total=16, allocation_ratio=2.0),
            MEMORY_MB=Inventory(total=8192, reserved=512, allocation_ratio=1.5),
        )


async def test_processes_racing_on_shared_instances_agree_with_an_outside_fold(
    store_url: str, tmp_path: Path
) -> None:
    seed = campaign_seed("cross-process-races")
    async with open_store(store_url) as store:
        await make_race_providers(store)
        setup_head = await store.head()
        seen: list[tuple[int, str]] = []

        async def follow() -> None:
            async for ev in store.subscribe(0):
                seen.append((ev.position, ev.event_id))

        follower = asyncio.create_task(follow())
        outs = [tmp_path / f"w{i}.jsonl" for i in range(PROCESSES)]
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.xproc_race_worker",
                store_url,
                str(seed),
                str(i),
                str(COMMANDS_PER_TASK),
                str(out),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
            )
            for i, out in enumerate(outs)
        ]
        assert [await p.wait() for p in procs] == [0] * PROCESSES, f"seed {seed}"
        head = await store.head()
        async with asyncio.timeout(30):
            while not seen or seen[-1][0] < head:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # an event past the head would show now
        follower.cancel()

        await check_against_outside_fold(store, outs, setup_head, seen, seed)


async def check_against_outside_fold(
    store: AllocationStore, outs: list[Path], setup_head: int, seen: list[tuple[int, str]], seed: int
) -> None:
    """Check the log, the projection, time travel and the audit against this file's fold of the
    export and what the writers (``tests/xproc_race_worker.py``, writing to ``outs``) were told;
    ``seen`` is what a subscriber from position 0 received."""
    head = await store.head()
    rows = await _export_rows(store)
    assert [r["position"] for r in rows] == list(range(1, head + 1)), f"seed {seed}"
    assert seen == [(r["position"], r["event_id"]) for r in rows], f"seed {seed}: subscriber"
    records = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
    by_rid = {r["rid"]: r for r in records}
    rid_at = {r["position"]: json.loads(r["metadata"] or "{}").get("request_id") for r in rows}
    accepted = [r for r in records if r["outcome"] == "accepted"]
    assert accepted and any(
        r["outcome"] == "rejected" and r["code"] == "evstore.consumer.deleted" for r in records
    )
    told: set[int] = set()
    for r in accepted:
        assert r["positions"] or r["op"] == "delete", r  # deleting a deleted consumer appends nothing
        for p in r["positions"]:
            assert rid_at[p] == r["rid"], f"seed {seed}: {r} told {p}, which holds {rid_at[p]}"
            told.add(p)
        if "again" in r:
            assert r["again"] == r["positions"] and r["replayed"], f"seed {seed}: keyed repeat {r}"
    untold = {p: rid_at[p] for p in range(setup_head + 1, head + 1) if p not in told}
    assert not untold, (
        f"seed {seed}: events of no accepted command: {[by_rid.get(r) for r in untold.values()][:3]}"
    )

    fold = Fold()
    samples = set(random.Random(seed).sample(range(1, head + 1), 5))
    at: dict[int, dict[str, dict[str, dict[str, int]]]] = {}
    for r in rows:
        fold.apply(r["position"], r["type"], json.loads(r["data"]))
        if r["position"] in samples:
            at[r["position"]] = {c: {p: dict(x) for p, x in a.items()} for c, a in fold.alloc.items()}
    assert not fold.problems, f"seed {seed}: {fold.problems[:10]}"
    for m, i in fold.behalf.items():
        assert i not in fold.tomb, f"seed {seed}: migration {m} holds {fold.alloc[m]} for deleted {i}"

    consumers = set(fold.owner) | set(fold.tomb)
    for c in consumers:
        view = await store.allocations(c)
        assert view.allocations == fold.alloc.get(c, {}), f"seed {seed}: allocations({c})"
        assert view.deleted == (c in fold.tomb)
        if c in fold.alloc:
            assert view.generation == fold.consumer_gen[c]
    for p, g in fold.provider_gen.items():
        u = await store.usage(p)
        assert u.generation == g
        assert dict(u) == {rc: fold.usage.get((p, rc), 0) for rc in fold.inv[p]}, f"seed {seed}: usage({p})"
    for project in {o[0] for o in fold.owner.values()}:
        want: dict[str, int] = defaultdict(int)
        for c, a in fold.alloc.items():
            if fold.owner[c][0] == project:
                for rcs in a.values():
                    for rc, n in rcs.items():
                        want[rc] += n
        assert dict(await store.usages(project)) == dict(want), f"seed {seed}: usages({project})"
    for pos, allocs in at.items():
        view = await store.state_at(position=pos)
        for c in consumers:
            assert (await view.allocations(c)).allocations == allocs.get(c, {}), (
                f"seed {seed}: state_at({pos})"
            )
    report = await store.audit()
    assert report.clean, f"seed {seed}: {report.findings}"
