"""Helper D2's black-box probes (stop 46): subscribers under concurrent writers, several OS
processes racing deletes against reverts and capacity-limited builds on one SQLite file and one
PostgreSQL schema, then export/import round trips and time travel of what those races left.

Run as ``python -m tests.test_s46_D2_probe URL SEED INDEX COMMANDS OUT`` it is one racing writer.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import random
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, ConsumerDeleted, EvstoreError, Inventory, StoreClosed, open_store
from tests.pg import fresh_database_url

INSTANCES = 10
OWNER: dict[str, Any] = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
NS = uuid.UUID("6f1c3a52-9d0e-4b7a-8e55-4c2d2b7e0d46")


def _instance(i: int, epoch: int) -> str:
    return str(uuid.uuid5(NS, f"instance-{i}-{epoch}"))


def _migration(i: int, epoch: int, gen: int) -> str:
    return str(uuid.uuid5(NS, f"migration-{i}-{epoch}-{gen}"))


async def _providers(store: AllocationStore) -> list[str]:
    found = dict((name, rp) for rp, name in await store.providers())
    return [found[f"d2-cn-{i}"] for i in range(2)]


async def _setup(store: AllocationStore) -> None:
    for i in range(2):
        rp = str(uuid.uuid5(NS, f"provider-{i}"))
        await store.create_provider(rp, f"d2-cn-{i}")
        # small: builds run out of room often
        await store.set_inventories(
            rp, {"VCPU": Inventory(total=14), "MEMORY_MB": Inventory(total=7168)}, generation=0
        )


async def _race(url: str, seed: int, index: int, commands: int, out: Path) -> None:
    """One writer: builds, migrations (start, then the instance's destination allocation),
    reverts, confirms and deletes of instances every writer shares, each outcome recorded."""
    rng = random.Random(seed * 100 + index)
    records: list[dict[str, Any]] = []
    async with open_store(url) as store:
        rps = await _providers(store)
        for n in range(commands):
            # (the writers share instances by name: a new set every 20 commands, so that deletes
            # do not leave nothing but tombstones)
            i, epoch = rng.randrange(INSTANCES), n // 20
            inst = _instance(i, epoch)
            mig = _migration(i, epoch, rng.randrange(2))
            action = rng.choice(
                ["build"] * 4
                + ["migrate"] * 2
                + ["move", "revert", "revert", "confirm", "delete", "release", "swap"]
            )
            rid = f"req-{index}-{n}"
            meta = {"request_id": rid}
            try:
                if action == "build":
                    rp = rng.choice(rps)
                    view = await store.allocations(inst)
                    receipt = await store.set_allocations(
                        inst,
                        {rp: {"VCPU": rng.randint(1, 3), "MEMORY_MB": 512 * rng.randint(1, 3)}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=view.generation if view else None,
                        metadata=meta,
                    )
                elif action == "migrate":
                    receipt = await store.start_migration(inst, mig, metadata=meta)
                    records.append({"rid": rid, "action": action, "positions": list(receipt.positions)})
                    rid = f"req-{index}-{n}-dest"
                    meta = {"request_id": rid}
                    action = "dest"
                    receipt = await store.set_allocations(
                        inst,
                        {rng.choice(rps): {"VCPU": 2, "MEMORY_MB": 1024}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                        metadata=meta,
                    )
                elif action == "move":
                    # Nova's move_allocations: the instance emptied into the migration
                    view = await store.allocations(inst)
                    target = await store.allocations(mig)
                    receipt = await store.write_allocations(
                        {
                            inst: {
                                "allocations": {},
                                "project_id": "p",
                                "user_id": "u",
                                "consumer_type": "INSTANCE",
                                "consumer_generation": view.generation,
                            },
                            mig: {
                                "allocations": view.allocations,
                                "project_id": "p",
                                "user_id": "u",
                                "consumer_type": "MIGRATION",
                                "consumer_generation": target.generation,
                            },
                        },
                        metadata=meta,
                    )
                elif action == "swap":
                    # two instances' allocations exchanged in one command
                    other = _instance(rng.randrange(INSTANCES), epoch)
                    one, two = await store.allocations(inst), await store.allocations(other)
                    receipt = await store.write_allocations(
                        {
                            c: {
                                "allocations": dict(gets.allocations),
                                "project_id": "p",
                                "user_id": "u",
                                "consumer_type": "INSTANCE",
                                "consumer_generation": v.generation,
                            }
                            for c, v, gets in ((inst, one, two), (other, two, one))
                        },
                        metadata=meta,
                    )
                elif action == "release":
                    receipt = await store.release(rng.choice([inst, mig]), metadata=meta)
                elif action == "revert":
                    receipt = await store.revert_migration(mig, metadata=meta)
                elif action == "confirm":
                    receipt = await store.confirm_migration(mig, metadata=meta)
                else:
                    receipt = await store.delete_consumer(inst, metadata=meta)
            except EvstoreError as exc:
                records.append({"rid": rid, "action": action, "refused": exc.code})
                continue
            records.append({"rid": rid, "action": action, "positions": list(receipt.positions)})
    out.write_text("".join(json.dumps(r) + "\n" for r in records))


def _sqlite(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'd2.db'}"


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return _sqlite(tmp_path)
    return fresh_database_url()


async def _rows(store: AllocationStore) -> list[str]:
    return [line async for line in store.export()]


async def _check_no_leak(store: AllocationStore) -> None:
    """Audit clean, no allocation held by a tombstone or a deleted instance's migration, usage
    equal to the sum of the allocations held."""
    report = await store.audit(history=True)
    assert report.clean, report
    state = await store.replay()
    held: dict[tuple[str, str], int] = {}
    for c in state.consumers.values():
        if c.allocations:
            assert not c.deleted, f"tombstoned {c.uuid} holds {c.allocations}"
            if c.on_behalf_of is not None:
                assert not state.consumer(c.on_behalf_of).deleted, (
                    f"{c.uuid} holds for deleted {c.on_behalf_of}"
                )
            view = await store.allocations(c.uuid)
            assert not view.leaked
            for rp, rcs in c.allocations.items():
                for rc, n in rcs.items():
                    held[rp, rc] = held.get((rp, rc), 0) + n
    for rp in await _providers(store):
        usage = await store.usage(rp)
        assert dict(usage) == {rc: held.get((rp, rc), 0) for rc in usage}, rp
    # the project's counters too (every consumer of the race is project p's)
    totals: dict[str, int] = {}
    for (_, rc), n in held.items():
        totals[rc] = totals.get(rc, 0) + n
    holding = sum(1 for c in state.consumers.values() if c.allocations)
    usages = await store.usages("p")
    assert ({k: v for k, v in usages.items() if v}, usages.consumer_count) == (totals, holding)


async def _run_race(
    url: str, tmp_path: Path, processes: int, commands: int
) -> tuple[list[dict[str, Any]], list[str]]:
    seed = random.randrange(1 << 30)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    outs = [tmp_path / f"d2-w{i}.jsonl" for i in range(processes)]
    async with open_store(url) as store:
        seen: list[int] = []
        ids: list[str] = []

        async def follow() -> None:
            async for ev in store.subscribe(0, batch_size=7):
                seen.append(ev.position)
                ids.append(ev.event_id)

        follower = asyncio.create_task(follow())
        procs = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tests.test_s46_D2_probe",
                url,
                str(seed),
                str(i),
                str(commands),
                str(out),
                env=env,
                stdout=asyncio.subprocess.DEVNULL,
            )
            for i, out in enumerate(outs)
        ]
        async with asyncio.timeout(15):
            while len(seen) < 15:  # (the writers have begun)
                await asyncio.sleep(0.01)
        midway = await _rows(store)  # (an export while the writers race)
        assert [await p.wait() for p in procs] == [0] * processes, f"seed {seed}"
        head = await store.head()
        async with asyncio.timeout(15):
            while not seen or seen[-1] < head:
                await asyncio.sleep(0.05)
        follower.cancel()
        assert seen == list(range(1, head + 1)), f"seed {seed}"
        assert ids == [e.event_id for e in await store.read(0, head)]
        records = [json.loads(line) for out in outs for line in out.read_text().splitlines()]
        # every accepted command's events are in the log, under its request id
        by_position = {e.position: e for e in await store.read(0, head)}
        for r in records:
            for p in r.get("positions", []):
                assert by_position[p].metadata.request_id == r["rid"], (seed, r)
        told = {p for r in records for p in r.get("positions", [])}
        assert told == set(range(5, head + 1)), f"seed {seed}: events nobody was told about"
        await _check_no_leak(store)
    return records, midway


async def _setup_store(url: str) -> None:
    async with open_store(url) as store:
        await _setup(store)


async def test_processes_racing_deletes_reverts_and_builds_leak_nothing_and_round_trip(
    url: str, tmp_path: Path
) -> None:
    await _setup_store(url)
    records, midway = await _run_race(url, tmp_path, processes=3, commands=60)
    # the export taken while they raced is a whole log: it imports, audits clean, and its rows
    # are the first rows of the final one
    async with open_store(f"sqlite:///{tmp_path / 'midway.db'}") as early:
        await early.import_events(lambda: midway)
        assert (await early.audit(history=True)).clean
    assert any(r.get("refused") == "evstore.consumer.deleted" for r in records)
    assert any(r.get("refused") == "evstore.allocation.capacity_exceeded" for r in records)
    # export, import into a new SQLite store, export again: the same lines; the same audit
    async with open_store(url) as store:
        exported = await _rows(store)
        assert exported[1 : len(midway)] == midway[1:]
        head = await store.head()
        mid = head // 2
        at_mid = await store.state_at(mid)
        replayed = await store.replay(mid)
        assert (at_mid.state.consumers, at_mid.state.providers) == (replayed.consumers, replayed.providers)
        # replay to a time in the middle: the last event stamped at or before it
        events = await store.read(0, head)
        stamps = [e.recorded_at for e in events]
        assert stamps == sorted(stamps)
        t = stamps[mid - 1]
        last = max(e.position for e in events if e.recorded_at <= t)
        by_time = await store.state_at(at=t)
        assert by_time == await store.state_at(last)
        first_audit = await store.audit()
    # into a store of the other backend, and again into a third: the same lines each time
    copies = [
        fresh_database_url() if url.startswith("sqlite") else f"sqlite:///{tmp_path / 'copy.db'}",
        f"sqlite:///{tmp_path / 'copy2.db'}" if url.startswith("sqlite") else fresh_database_url(),
    ]
    lines = exported
    for copy in copies:
        async with open_store(copy) as other:
            await other.import_events(functools.partial(list, lines))
            assert await _rows(other) == exported
            report = await other.audit()
            assert report.clean and (report.head, report.events_checked) == (
                first_audit.head,
                first_audit.events_checked,
            )
            await _check_no_leak(other)
            again = await other.state_at(mid)
            assert (again.state.consumers, again.state.providers) == (
                at_mid.state.consumers,
                at_mid.state.providers,
            )
            assert await other.state_at(at=t) == by_time
            assert [e.to_dict() for e in await other.read(0, head)] == [e.to_dict() for e in events]
            lines = await _rows(other)
            # the imported tombstones still refuse, and new commands follow on at head + 1
            state = (await other.state_at(head)).state
            dead = sorted(c.uuid for c in state.consumers.values() if c.deleted)
            rp = str(uuid.uuid4())
            await other.create_provider(rp, "d2-new")
            assert await other.set_inventories(rp, {"VCPU": Inventory(total=4)}, generation=0) == 1
            body = {rp: {"VCPU": 1}}
            with pytest.raises(ConsumerDeleted):
                await other.set_allocations(dead[0], body, generation=None, **OWNER)
            fresh = str(uuid.uuid4())
            receipt = await other.set_allocations(fresh, body, generation=None, **OWNER)
            assert receipt.positions == (head + 3,)
            assert (await other.delete_consumer(fresh)).positions == (head + 4,)
            assert (await other.audit(history=True)).clean


async def store_read(url: str, head: int) -> list[Any]:
    async with open_store(url) as store:
        return await store.read(0, head)


async def _write_some(store: AllocationStore, rp: str, tag: str, count: int) -> None:
    """``count`` builds then deletes of consumers of this writer's own (one event each)."""
    for n in range(count):
        consumer = str(uuid.uuid5(NS, f"{tag}-{n}"))
        await store.set_allocations(
            consumer,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        await store.delete_consumer(consumer)


async def _wide_setup(url: str) -> str:
    async with open_store(url) as store:
        rp = str(uuid.uuid5(NS, "wide"))
        await store.create_provider(rp, "d2-wide")
        await store.set_inventories(rp, {"VCPU": Inventory(total=1000)}, generation=0)
        return rp


async def test_slow_raising_cancelled_and_resumed_subscribers_under_two_writing_stores(url: str) -> None:
    """Two stores write one file/schema concurrently; on a third: a slow subscriber, one whose
    handler raises at its fifth event, one cancelled mid-stream and resumed from what it
    delivered. Each sees 1..head once, in order (up to where it stopped); the store closes at once."""
    rp = await _wide_setup(url)
    async with open_store(url, poll_interval=0.02) as a, open_store(url, poll_interval=0.02) as b:
        async with open_store(url, poll_interval=0.02) as reader:
            slow: list[str] = []
            raised: list[int] = []
            resumed: list[int] = []

            async def slow_one() -> None:
                async for ev in reader.subscribe(0, batch_size=3):
                    slow.append(ev.event_id)
                    await asyncio.sleep(0.005)

            async def raising() -> None:
                async for ev in reader.subscribe(0, batch_size=3):
                    raised.append(ev.position)
                    if len(raised) == 5:
                        raise RuntimeError("handler failed")

            async def resumable(after: int) -> None:
                async for ev in reader.subscribe(after, batch_size=4):
                    resumed.append(ev.position)

            tasks = [asyncio.create_task(slow_one()), asyncio.create_task(raising())]
            first = asyncio.create_task(resumable(0))
            writers = [
                asyncio.create_task(_write_some(a, rp, "a", 40)),
                asyncio.create_task(_write_some(b, rp, "b", 40)),
            ]
            while len(resumed) < 20:
                await asyncio.sleep(0.002)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            second = asyncio.create_task(resumable(resumed[-1]))
            await asyncio.gather(*writers)
            head = await reader.head()
            with pytest.raises(RuntimeError):
                await tasks[1]
            assert raised == [1, 2, 3, 4, 5]
            async with asyncio.timeout(20):
                while len(slow) < head or not resumed or resumed[-1] < head:
                    await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)
            ids = [e.event_id for e in await reader.read(0, head)]
            assert slow == ids
            assert resumed == list(range(1, head + 1))
            loop = asyncio.get_running_loop()
            began = loop.time()
        # (closed with two subscribers still following)
        assert loop.time() - began < 2
        for task in (tasks[0], second):
            with pytest.raises(StoreClosed):
                await task


async def test_a_subscriber_sees_every_event_of_writer_processes_in_order_and_resumes(
    url: str, tmp_path: Path
) -> None:
    """Writer processes append to one file/schema; a subscriber of another store is closed
    (its store closed under it) halfway, and a new store resumes from what it delivered."""
    await _setup_store(url)
    seed = random.randrange(1 << 30)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    outs = [tmp_path / f"d2-s{i}.jsonl" for i in range(2)]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.test_s46_D2_probe",
            url,
            str(seed),
            str(i),
            "50",
            str(out),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
        )
        for i, out in enumerate(outs)
    ]
    seen: list[int] = []
    async with open_store(url, poll_interval=0.01) as store:

        async def follow() -> None:
            async for ev in store.subscribe(0, batch_size=2):
                seen.append(ev.position)

        follower = asyncio.create_task(follow())
        while len(seen) < 15:
            await asyncio.sleep(0.005)
    with pytest.raises(StoreClosed):
        await follower
    assert [await p.wait() for p in procs] == [0, 0], f"seed {seed}"
    async with open_store(url, poll_interval=0.01) as store:
        head = await store.head()
        async for ev in store.subscribe(seen[-1], batch_size=5):
            seen.append(ev.position)
            if ev.position == head:
                break
    assert seen == list(range(1, head + 1)), f"seed {seed}"


async def test_tail_while_writer_processes_append_then_resumed_from_its_last_position(
    url: str, tmp_path: Path
) -> None:
    """``evstore tail --after 0 --json --limit K`` while two writer processes append, then
    ``tail --after K --no-follow``: 1..head, once each, in order, the same events as ``read``."""
    await _setup_store(url)
    seed = random.randrange(1 << 30)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    outs = [tmp_path / f"d2-t{i}.jsonl" for i in range(2)]

    async def run(*args: str) -> list[dict[str, Any]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "evstore",
            "tail",
            "--url",
            url,
            "--json",
            *args,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        return [json.loads(line) for line in out.decode().splitlines()]

    follower = asyncio.create_task(run("--after", "0", "--limit", "20"))
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.test_s46_D2_probe",
            url,
            str(seed),
            str(i),
            "40",
            str(out),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
        )
        for i, out in enumerate(outs)
    ]
    assert [await p.wait() for p in procs] == [0, 0], f"seed {seed}"
    async with asyncio.timeout(20):
        first = await follower
    rest = await run("--after", str(first[-1]["position"]), "--no-follow")
    async with open_store(url) as store:
        head = await store.head()
        events = await store.read(0, head)
    assert len(first) == 20
    got = first + rest
    assert [e["position"] for e in got] == list(range(1, head + 1)), f"seed {seed}"
    assert [e["event_id"] for e in got] == [e.event_id for e in events]


async def test_a_subscriber_waiting_on_an_empty_store_sees_an_import_by_another_store_then_commands(
    url: str, tmp_path: Path
) -> None:
    """A subscriber of store A waits on an empty store; store B (same file/schema) imports a log,
    then both write: the subscriber sees 1..head once each, in order."""
    source = f"sqlite:///{tmp_path / 'source.db'}"
    rp = await _wide_setup(source)
    async with open_store(source) as src:
        await _write_some(src, rp, "src", 15)
        lines = await _rows(src)
    async with open_store(url, poll_interval=0.01) as a:
        seen: list[int] = []

        async def follow() -> None:
            async for ev in a.subscribe(0, batch_size=4):
                seen.append(ev.position)

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.1)
        async with open_store(url) as b:
            await b.import_events(lambda: lines)
            await asyncio.gather(_write_some(a, rp, "a", 5), _write_some(b, rp, "b", 5))
            head = await b.head()
        async with asyncio.timeout(10):
            while len(seen) < head:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        follower.cancel()
        assert seen == list(range(1, head + 1))
        assert (await a.audit()).clean


async def test_a_postgresql_subscriber_whose_connections_are_killed_repeatedly_misses_nothing() -> None:
    """The server ends the subscriber's store's connections (pg_terminate_backend) five times
    while another store writes: the subscriber reads again, 1..head once each, in order."""
    url = fresh_database_url()
    rp = await _wide_setup(url)
    app = f"d2sub{os.getpid()}"
    import asyncpg  # type: ignore[import-untyped]

    async def terminate() -> int:
        conn = await asyncpg.connect(url)
        try:
            return await conn.fetchval(  # type: ignore[no-any-return]
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                "WHERE application_name = $1 AND pid <> pg_backend_pid()",
                app,
            )
        finally:
            await conn.close()

    async with (
        open_store(url) as writer,
        open_store(f"{url}&application_name={app}", poll_interval=0.01) as reader,
    ):
        seen: list[int] = []

        async def follow() -> None:
            async for ev in reader.subscribe(0, batch_size=3):
                seen.append(ev.position)

        follower = asyncio.create_task(follow())

        killed: list[int] = []

        async def killer() -> None:
            for _ in range(5):
                await asyncio.sleep(0.15)
                killed.append(await terminate())

        await asyncio.gather(_write_some(writer, rp, "w", 40), killer())
        assert sum(killed) >= 3, killed
        head = await writer.head()
        async with asyncio.timeout(15):
            while len(seen) < head and not follower.done():
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        assert not follower.done(), follower.exception()
        follower.cancel()
        assert seen == list(range(1, head + 1))


async def test_subscribers_follow_through_full_rebuilds_snapshots_and_audits_of_another_store(
    url: str,
) -> None:
    """Store B runs rebuild(full=True), take_snapshots() and audit(history=True) while store A
    writes and a subscriber of a third store follows: 1..head once each, in order; clean."""
    rp = await _wide_setup(url)
    async with open_store(url) as a, open_store(url) as b, open_store(url, poll_interval=0.01) as reader:
        seen: list[int] = []

        async def follow() -> None:
            async for ev in reader.subscribe(0, batch_size=5):
                seen.append(ev.position)

        follower = asyncio.create_task(follow())

        async def maintain() -> None:
            for _ in range(3):
                await b.rebuild(full=True)
                b.snapshot_every = 7
                await b.take_snapshots()
                assert (await b.audit(history=True)).clean

        await asyncio.gather(_write_some(a, rp, "m", 40), maintain())
        head = await a.head()
        async with asyncio.timeout(10):
            while len(seen) < head:
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        follower.cancel()
        assert seen == list(range(1, head + 1))
        assert await reader.state_at(head // 2) == await reader.replay(head // 2)


async def test_no_event_is_delivered_after_close_returned(url: str) -> None:
    """A subscriber mid-batch when the store closes (here its own handler closes it, as a
    service's shutdown does from another task): its next step is StoreClosed, not the other
    events of the batch it had read. Regression (helper D2): up to batch_size - 1 events were
    delivered after close() returned, then StoreClosed."""
    rp = await _wide_setup(url)
    store = await open_store(url)
    await _write_some(store, rp, "c", 5)  # (positions 3..12)
    delivered_after_close: list[int] = []
    with pytest.raises(StoreClosed):
        async for ev in store.subscribe(0, batch_size=100):
            if ev.position == 3:
                await store.close()
            elif ev.position > 3:
                delivered_after_close.append(ev.position)
    assert delivered_after_close == []


if __name__ == "__main__":
    asyncio.run(_race(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])))
