"""Maintenance operations against live writers, on both backends.

Writer processes (``tests/xproc_race_worker.py``) race builds, migrations started, reverted and
confirmed, moves, releases and deletes on shared instances, while maintenance runs against the same
database: in this process (on the store whose subscriber follows the log from position 0) and in
maintenance processes of their own (``tests/maintenance_race_worker.py``) - ``rebuild()``,
``rebuild(full=True)``, ``take_snapshots()``, ``audit(history=True)`` (clean at every moment),
``state_at`` (saving snapshots on the way) against ``replay``, ``diff``, ``export`` (gap-free) and
``open_store(upgrade=False)``. Afterwards the log and the projection are checked against an outside
fold (``check_against_outside_fold``): nothing accepted lost, nothing rejected kept, positions
gap-free, the subscriber saw every event once, the projection equals the fold, the audit is clean.

CI runs one short campaign per backend; ``EVSTORE_SLOW=1`` runs more seeds, longer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from evstore import Inventory, open_store
from evstore.log.postgres import PROJECTION_TABLES
from tests.conftest import allocate, campaign_seed, make_provider, new_uuid
from tests.maintenance_race_worker import OPS
from tests.test_cross_process_races import check_against_outside_fold, make_race_providers

SLOW = os.environ.get("EVSTORE_SLOW") == "1"
WRITERS = 3
COMMANDS_PER_TASK = 120 if SLOW else 30
GUARD = 240.0 if SLOW else 90.0  # a hang guard, not a timing assertion
ROOT = Path(__file__).resolve().parent.parent


_SPAWNED: list[asyncio.subprocess.Process] = []


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *args, env=env, stdout=asyncio.subprocess.DEVNULL
    )
    _SPAWNED.append(proc)
    return proc


@pytest.fixture(autouse=True)
async def _no_process_left() -> AsyncIterator[None]:
    """A test that failed leaves no process running (a maintenance process runs until told to stop)."""
    yield
    while _SPAWNED:
        proc = _SPAWNED.pop()
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize("seed", range(4) if SLOW else [campaign_seed("maintenance-writers")])
async def test_maintenance_in_every_process_while_writers_race_loses_nothing(
    store_url: str, tmp_path: Path, seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evstore.log import sqlite
    from tests.maintenance_race_worker import one

    rng = random.Random(seed)
    lag = rng.choice([3, 40, sqlite.HISTORY_LAG])  # (SQLite's history index caught up that often)
    monkeypatch.setenv("EVSTORE_TEST_HISTORY_LAG", str(lag))
    monkeypatch.setattr(sqlite, "HISTORY_LAG", lag)
    async with open_store(store_url, snapshot_every=rng.choice([3, 20])) as store:
        await make_race_providers(store)
        setup_head = await store.head()
        seen: list[tuple[int, str]] = []

        async def follow() -> None:
            async for ev in store.subscribe(0):
                seen.append((ev.position, ev.event_id))

        follower = asyncio.create_task(follow())
        stop = tmp_path / "stop"
        outs = [tmp_path / f"w{i}.jsonl" for i in range(WRITERS)]
        mouts = [tmp_path / f"m{i}.jsonl" for i in range(2)]
        async with asyncio.timeout(GUARD):
            writers = [
                await _spawn(
                    "tests.xproc_race_worker", store_url, str(seed), str(i), str(COMMANDS_PER_TASK), str(o)
                )
                for i, o in enumerate(outs)
            ]
            keepers = [
                await _spawn(
                    "tests.maintenance_race_worker",
                    store_url,
                    str(seed + i),
                    ",".join(OPS),
                    str(stop),
                    str(o),
                )
                for i, o in enumerate(mouts)
            ]
            done = asyncio.gather(*(p.wait() for p in writers))
            here: list[dict[str, object]] = []

            async def maintain(task: int) -> None:  # (several at once on this one store)
                trng = random.Random(seed * 13 + task)
                while not done.done():
                    here.append(await one(store, store_url, trng.choice(OPS), trng))

            await asyncio.gather(*(maintain(t) for t in range(3)))
            assert await done == [0] * WRITERS, f"seed {seed}"
            stop.touch()
            assert [await p.wait() for p in keepers] == [0, 0], f"seed {seed}"
            head = await store.head()
            while not seen or seen[-1][0] < head:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # an event past the head would show now
        follower.cancel()
        lines = here + [json.loads(t) for o in mouts for t in o.read_text().splitlines()]
        commands = tmp_path / "here.commands"  # (the commands the maintenance ran, for the fold's check)
        commands.write_text(
            "".join(json.dumps(line["command"]) + "\n" for line in lines if "command" in line)
        )
        problems = [line for line in lines if "problem" in line]
        assert not problems, f"seed {seed}: {problems[:5]}"
        ran = {str(line["op"]) for line in lines}
        print(f"seed {seed}: {len(lines)} maintenance operations ({sorted(ran)}), head {head}")
        await check_against_outside_fold(store, [*outs, commands], setup_head, seen, seed)
        assert await store.rebuild() == head
        assert (await store.audit(history=True)).clean


async def _as_older_store(url: str) -> None:
    """Give the (closed) store at ``url`` the tables and schema version 4 an older evstore wrote."""
    if url.startswith("sqlite:///"):
        from tests.test_store import _as_version_4

        _as_version_4(Path(url.removeprefix("sqlite:///")))
        return
    from tests.test_postgres import _downgrade_to_v4_sql

    async with open_store(url) as store:
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]


@pytest.mark.parametrize("seed", range(3) if SLOW else [campaign_seed("maintenance-readers")])
async def test_an_older_store_opened_by_writers_upgraders_and_read_only_opens_at_once(
    store_url: str, tmp_path: Path, seed: int
) -> None:
    # Every writer process's open upgrades the store (one does; the others wait, then find it
    # done), while maintenance processes open it too - with upgrade=False, refused until it is
    # upgraded, then reading - and this process opens it as the writers begin.
    rng = random.Random(seed)
    async with open_store(store_url) as store:
        await make_race_providers(store)
        setup_head = await store.head()
    await _as_older_store(store_url)
    stop = tmp_path / "stop"
    outs = [tmp_path / f"w{i}.jsonl" for i in range(WRITERS)]
    mouts = [tmp_path / f"m{i}.jsonl" for i in range(2)]
    async with asyncio.timeout(GUARD):
        keepers = [
            await _spawn(
                "tests.maintenance_race_worker", store_url, str(seed + i), "open_ro", str(stop), str(o)
            )
            for i, o in enumerate(mouts[:1])
        ]
        while not mouts[0].exists() or not mouts[0].read_text():  # it has been refused once
            await asyncio.sleep(0.02)
        writers = [
            await _spawn(
                "tests.xproc_race_worker", store_url, str(seed), str(i), str(COMMANDS_PER_TASK), str(o)
            )
            for i, o in enumerate(outs)
        ]
        await asyncio.sleep(rng.random() * 0.5)
        async with open_store(store_url) as store:
            keepers.append(
                await _spawn(
                    "tests.maintenance_race_worker",
                    store_url,
                    str(seed + 1),
                    ",".join(OPS),
                    str(stop),
                    str(mouts[1]),
                )
            )
            seen: list[tuple[int, str]] = []

            async def follow() -> None:
                async for ev in store.subscribe(0):
                    seen.append((ev.position, ev.event_id))

            follower = asyncio.create_task(follow())
            assert [await p.wait() for p in writers] == [0] * WRITERS, f"seed {seed}"
            stop.touch()
            assert [await p.wait() for p in keepers] == [0, 0], f"seed {seed}"
            head = await store.head()
            while not seen or seen[-1][0] < head:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # an event past the head would show now
            follower.cancel()
            lines = [json.loads(t) for o in mouts for t in o.read_text().splitlines()]
            problems = [line for line in lines if "problem" in line]
            assert not problems, f"seed {seed}: {problems[:5]}"
            refused = sum("refused" in line for line in lines)
            assert refused, "the read-only opens were refused before the upgrade"
            print(f"seed {seed}: {len(lines)} maintenance operations, {refused} refused")
            commands = [Path(f"{o}.commands") for o in mouts if Path(f"{o}.commands").exists()]
            await check_against_outside_fold(store, [*outs, *commands], setup_head, seen, seed)
            assert await store.rebuild() == head
            assert (await store.audit(history=True)).clean


async def test_a_full_rebuild_on_postgresql_does_not_deadlock_with_reads(pg_url: str) -> None:
    """Regression: ``rebuild(full=True)`` reindexed the projection's tables one after the other
    inside its transaction (each REINDEX locks the table's indexes exclusively), while reads -
    transactions that lock the tables they read one statement at a time, in another order - held
    one and waited for the next: PostgreSQL found a deadlock within a second and failed one side,
    the rebuild or the read ("deadlock detected", a StorageError), about every other rebuild with
    four readers. The rebuild now takes every projection table at once before touching them, in
    short attempts that give way to the reads (as the fence does), so no wait forms a cycle."""
    async with open_store(pg_url) as store:
        providers = [await make_provider(store, VCPU=64) for _ in range(3)]
        consumers = [new_uuid() for _ in range(12)]
        for i, c in enumerate(consumers):
            await allocate(store, c, {providers[i % 3]: {"VCPU": 1}}, project_id="p")
        async with open_store(pg_url) as reader:
            stop = asyncio.Event()
            reads = 0

            async def read() -> None:
                nonlocal reads
                while not stop.is_set():  # (each a transaction of several statements)
                    await reader.usages("p")
                    await reader.allocations(random.choice(consumers))
                    await reader.provider_allocations(random.choice(providers))
                    reads += 1

            tasks = [asyncio.create_task(read()) for _ in range(4)]
            try:
                async with asyncio.timeout(GUARD):
                    for _ in range(8):
                        assert await store.rebuild(full=True) == await store.head()
                        await asyncio.sleep(0)
            finally:
                stop.set()
                results = await asyncio.gather(*tasks, return_exceptions=True)
            assert results == [None] * 4, results  # no read failed either
            assert reads
        assert (await store.audit(history=True)).clean


KILLS = 15 if SLOW else 4
OWNER: dict[str, Any] = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}


async def test_sigkill_mid_rebuild_or_snapshots_leaves_the_store_sound(
    store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A writer (tests/crash_worker.py, acknowledging each command it was told committed) and a
    # maintenance process (rebuilds, full rebuilds, snapshots, time travel saving snapshots) are
    # SIGKILLed together at random moments; the store then reopens sound: every acknowledged
    # consumer holds its allocations, the audit (history index too) is clean, each snapshot kept
    # agrees with a replay to its position, and a rebuild changes nothing.
    import signal

    rng = random.Random(1859496)
    monkeypatch.setenv("EVSTORE_TEST_SNAPSHOT_EVERY", "2000")  # (the writer appends thousands a second)
    async with open_store(store_url) as store:
        for i in range(4):
            await make_provider(store, f"node-{i}", VCPU=Inventory(total=10**9))
    ack = tmp_path / "ack.jsonl"
    ops = "rebuild,rebuild_full,snapshots,time_travel"
    acks_read = 0
    for kill in range(KILLS):
        mout = tmp_path / f"m{kill}.jsonl"
        writer = await _spawn("tests.crash_worker", store_url, str(ack), str(kill))
        keeper = await _spawn(
            "tests.maintenance_race_worker", store_url, str(kill), ops, str(tmp_path / "x"), str(mout)
        )
        async with asyncio.timeout(GUARD):
            while not mout.exists() or not mout.read_text():
                await asyncio.sleep(0.01)
            await asyncio.sleep(rng.uniform(0.0, 0.4))
            for proc in (keeper, writer):
                proc.send_signal(signal.SIGKILL)
                await proc.wait()
        problems = [t for t in mout.read_text().splitlines() if "problem" in t]
        assert not problems, problems[:3]
        text = ack.read_text() if ack.exists() else ""
        lines = [x for x in text.splitlines() if x.endswith("}")]
        acked = [json.loads(x) for x in lines[acks_read:]]  # (those of earlier kills were checked)
        acks_read = len(lines)
        async with asyncio.timeout(GUARD), open_store(store_url) as store:
            # (the audit first: it takes the fence exclusive, so that a killed writer's commit
            # the server was still finishing - its backend completes a COMMIT the client sent
            # before it died - has ended; a head read before it was behind the rebuild's count,
            # 314 where the rebuild folded 319, PostgreSQL, slow profile under load)
            report = await store.audit(history=True)
            assert report.clean, f"kill {kill}: {report.findings[:3]}"
            head = await store.head()
            for entry in acked:
                assert max(entry["positions"]) <= head, "an acknowledged command was lost"
                for c in entry["consumers"][1:]:  # (the first may have been deleted since)
                    assert (await store.allocations(c)).allocations, f"kill {kill}: {c} lost"
            for pos in (await store.snapshot_positions())[-3:]:
                assert (await store.state_at(position=pos)).state == await store.replay(pos)
            assert await store.rebuild() == head
    assert acks_read, "the writer was killed mid-stream, not before it wrote"


@pytest.mark.parametrize("seed", range(12) if SLOW else range(3))
async def test_imports_racing_each_other_and_writers_into_one_empty_store(
    store_url: str, tmp_path: Path, seed: int
) -> None:
    # Two imports of one export (one here, one by `evstore import` in another process) race
    # writers on another connection, into one empty store: at most one import lands, whole, at
    # positions 1..n, and only into a store nothing was written to; a command accepted is either
    # before every import (which are then refused) or decided against all of the imported log (the
    # export's tombstoned consumer is never given allocations, its provider's name never taken twice).
    from evstore import EvstoreError, InvalidInput
    from tests.test_import import _source

    rng = random.Random(seed)
    lines, rp, deleted = await _source(tmp_path, consumers=300)
    export = tmp_path / "export.jsonl"
    export.write_text("\n".join(lines) + "\n")
    n = len(lines) - 1
    accepted: list[int] = []
    async with open_store(store_url) as store, open_store(store_url) as other:
        stop = asyncio.Event()

        async def write() -> None:
            while not stop.is_set():
                c, mine = new_uuid(), new_uuid()
                alloc = {rp: {"VCPU": 1}}
                for call in (
                    other.create_provider(mine, f"w-{mine}"),
                    other.create_provider(new_uuid(), "rp"),  # (the export's provider's name)
                    other.set_allocations(deleted, alloc, **OWNER),  # (tombstoned in the export)
                    other.set_allocations(c, alloc, **OWNER),
                ):
                    try:
                        receipt = await call
                    except EvstoreError:
                        continue
                    accepted.extend(receipt.positions)
                await asyncio.sleep(0)

        async with asyncio.timeout(GUARD):
            cli = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "evstore.cli", "import", str(export), "--url", store_url,
                cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
            )  # fmt: skip

            async def write_later() -> None:
                await asyncio.sleep(rng.uniform(0, 1.5))
                await write()

            writer = asyncio.create_task(write_later())
            await asyncio.sleep(rng.uniform(0, 0.8))
            try:
                here = await store.import_events(lambda: iter(lines), batch_size=rng.choice([50, 1000]))
            except InvalidInput as exc:
                assert "empty store" in str(exc)
                here = 0
            _, err_text = await cli.communicate()
            await asyncio.sleep(0.3)  # (commands decided against the imported log, if one landed)
            stop.set()
            await writer
        assert cli.returncode in (0, 1), err_text
        landed = [here == n, cli.returncode == 0]
        assert sum(landed) <= 1, "two imports landed"
        if cli.returncode:
            assert b"empty store" in err_text, err_text
        head = await store.head()
        assert head == n * sum(landed) + len(accepted)
        assert sorted(accepted) == list(range(head - len(accepted) + 1, head + 1)), "writes were interleaved"
        if any(landed):
            rows = await store.backend.read_raw(0, n)
            assert [json.loads(line)["event_id"] for line in lines[1:]] == [r.event_id for r in rows]
            assert not (await store.allocations(deleted)).allocations
            assert [name for _, name in await store.providers()].count("rp") == 1
        report = await store.audit(history=True)
        assert report.clean, report.findings[:3]
        assert await store.rebuild() == head
        print(f"seed {seed}: imports landed {landed}, {len(accepted)} positions written by the writer")


async def test_an_import_into_postgresql_killed_midway_leaves_the_store_empty_or_whole(
    pg_url: str, tmp_path: Path
) -> None:
    # (SQLite's: tests/test_import.py) `evstore import` SIGKILLed at random moments: the store
    # holds none of the log or all of it, never a part, and a new import into it then works.
    import signal

    from tests.test_import import _source

    lines, rp, _ = await _source(tmp_path, consumers=3000)
    export = tmp_path / "export.jsonl"
    export.write_text("\n".join(lines) + "\n")
    rng = random.Random(1848343)
    outcomes = []
    for _ in range(3):
        async with open_store(pg_url) as store:
            if await store.head():
                await store.backend.tamper("TRUNCATE events, event_entities, " + ", ".join(PROJECTION_TABLES))  # type: ignore[attr-defined]
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "evstore.cli", "import", str(export), "--url", pg_url,
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.sleep(rng.uniform(0.8, 2.6))  # (a whole import takes ~2.5 s here)
        with contextlib.suppress(ProcessLookupError):
            cli.send_signal(signal.SIGKILL)
        await cli.wait()
        async with asyncio.timeout(GUARD), open_store(pg_url) as store:
            head = await store.head()
            assert head in (0, len(lines) - 1)
            outcomes.append(head)
            if head == 0:
                assert (await store.audit()).clean
                assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
            assert (await store.usage(rp))["VCPU"] == 2999
            assert (await store.audit(history=True)).clean
    print(f"heads after the kills: {outcomes}")


async def test_an_upgrade_killed_midway_leaves_a_store_that_opens_upgraded_and_sound(
    store_url: str, tmp_path: Path
) -> None:
    # `evstore upgrade` of an older store (version 4: refolded into version 5's shape on SQLite,
    # its migrations' instance types on PostgreSQL) SIGKILLed at random moments: the next open
    # upgrades it (or finds it upgraded), nothing is lost, the audit is clean, commands go on.
    import signal

    from tests.test_import import _source

    lines, rp, _ = await _source(tmp_path, consumers=3000)
    rng = random.Random(1848343)
    heads = []
    for _ in range(3):
        async with open_store(store_url) as store:
            if not await store.head():
                assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
            head, used = await store.head(), (await store.usage(rp))["VCPU"]
        await _as_older_store(store_url)
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "evstore.cli", "upgrade", "--url", store_url,
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.sleep(rng.uniform(0.6, 2.0))
        with contextlib.suppress(ProcessLookupError):
            cli.send_signal(signal.SIGKILL)
        await cli.wait()
        heads.append(cli.returncode)
        async with asyncio.timeout(GUARD), open_store(store_url) as store:
            assert await store.head() == head
            assert (await store.usage(rp))["VCPU"] == used
            report = await store.audit(history=True)
            assert report.clean, report.findings[:3]
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    print(f"upgrade exit codes: {heads}")


async def test_a_full_rebuild_waiting_for_a_reader_that_never_pauses_gives_up_after_command_timeout(
    pg_url: str,
) -> None:
    # The full rebuild's wait for the projection's tables (see the deadlock test above) is bounded
    # as the fence's is: a client stuck inside a read (here a transaction left open holding
    # p_providers) fails it after command_timeout, with nothing done, and commands then go on.
    import asyncpg

    from evstore import StorageError
    from tests.test_postgres import _search_path

    async with open_store(pg_url, command_timeout=1.0) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
        reader = await asyncpg.connect(pg_url, server_settings={"search_path": await _search_path(store)})
        try:
            async with reader.transaction():
                await reader.fetch("SELECT * FROM p_providers")
                with pytest.raises(StorageError, match="could not reindex it; nothing was done: retry"):
                    async with asyncio.timeout(GUARD):
                        await store.rebuild(full=True)
                async with asyncio.timeout(GUARD):  # (the fence was let go of)
                    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        finally:
            await reader.close()
        assert await store.rebuild(full=True) == head + 1
        assert (await store.audit(history=True)).clean
