"""Races for real: many tasks, several OS processes on one SQLite file, cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import json
import logging
import os
import random
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import structlog

from evstore import (
    AllocationStore,
    CapacityExceeded,
    ConcurrentUpdate,
    ConsumerAllocations,
    ConsumerDeleted,
    DuplicateName,
    EvstoreError,
    Inventory,
    NotFound,
    StorageError,
    StoreClosed,
    open_store,
)
from evstore.log import Job
from evstore.store import make_backend
from tests.conftest import allocate, make_provider, new_uuid


async def _claim(store: AllocationStore, consumer: str, rp: str) -> bool:
    """One VCPU on ``rp`` for ``consumer``: True if accepted, False if refused for capacity."""
    try:
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        return True
    except CapacityExceeded:
        return False


async def test_hundred_tasks_race_for_ten_slots(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=10)
    consumers = [new_uuid() for _ in range(100)]
    results = await asyncio.gather(*(_claim(store, c, rp) for c in consumers))
    assert results.count(True) == 10
    assert (await store.usage(rp)).usages == {"VCPU": 10}
    winners = [c for c, ok in zip(consumers, results, strict=True) if ok]
    for c in winners:
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}
    # 10 accepted writes + provider creation + inventory: nothing else was appended
    assert await store.head() == 12
    assert (await store.audit()).clean


async def test_four_processes_share_one_sqlite_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/shared.db"
    async with open_store(url) as store:
        providers = [await make_provider(store, f"node-{i}", VCPU=Inventory(total=12)) for i in range(3)]
    n = 60
    outs = [tmp_path / f"out-{i}.jsonl" for i in range(4)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.mp_worker", url, str(seed), str(n), str(out), env=env
        )
        for seed, out in enumerate(outs)
    ]
    codes = await asyncio.gather(*(p.wait() for p in procs))
    assert codes == [0, 0, 0, 0]

    acknowledged: list[int] = []
    for out in outs:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(lines) == n
        for line in lines:
            acknowledged.extend(line.get("positions", []))
    async with open_store(url) as store:
        head = await store.head()
        events = await store.read(0, head + 10)
        positions = [e.position for e in events]
        assert positions == list(range(1, head + 1)), "positions are gap-free and in order"
        assert len({e.event_id for e in events}) == head, "no duplicated event"
        assert len(acknowledged) == len(set(acknowledged)), "no position acknowledged twice"
        assert set(acknowledged) <= set(positions), "every acknowledged event is in the log"
        # everything after setup (2 events per provider) was acknowledged to some process
        assert set(positions) - set(acknowledged) == set(range(1, 2 * len(providers) + 1))
        report = await store.audit()
        assert report.clean, report.findings  # includes: never over capacity at any position, no drift
        for p in providers:
            assert (await store.usage(p)).usages["VCPU"] <= 12


async def test_cancelled_commands_are_all_or_nothing(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=1000)
    rng = random.Random(7)
    pairs: list[tuple[str, str]] = []

    async def move(a: str, b: str) -> None:
        await store.write_allocations(
            {
                a: ConsumerAllocations(
                    allocations={rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE"
                ),
                b: ConsumerAllocations(
                    allocations={rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE"
                ),
            }
        )

    tasks = []
    for _ in range(60):
        a, b = new_uuid(), new_uuid()
        pairs.append((a, b))
        tasks.append(asyncio.create_task(move(a, b)))
    for task in tasks:
        for _ in range(rng.randint(0, 3)):
            await asyncio.sleep(0)
        if rng.random() < 0.6:
            task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    cancelled = sum(isinstance(r, asyncio.CancelledError) for r in results)
    assert 0 < cancelled < 60
    present = 0
    for a, b in pairs:
        ha, hb = (await store.allocations(a)).allocations, (await store.allocations(b)).allocations
        assert bool(ha) == bool(hb), "a command is all or nothing"
        present += bool(ha)
    assert (await store.usage(rp)).usages["VCPU"] == 3 * present
    # the store is still usable
    await allocate(store, new_uuid(), {rp: {"VCPU": 5}})
    assert (await store.audit()).clean


async def test_the_log_says_what_became_of_a_command_whose_caller_was_cancelled(
    store: AllocationStore,
) -> None:
    """Regression (helper-56): a command whose caller was cancelled (a timeout, a shutdown) once
    the writer had taken it still committed - README: "whole or absent" - but no log line said
    so: ``command.accepted`` was logged by the caller after its await, which a cancelled caller
    never reaches, and a command dropped before it began was not logged either. An operator could
    not tell from the log which it was (45 of 200 such commands committed silently on SQLite,
    138 on PostgreSQL). Now each ends in ``command.accepted`` (``caller_cancelled=True``) when it
    committed, ``command.cancelled`` when it did not run."""
    rp = await make_provider(store, VCPU=100_000)
    rng = random.Random(56)
    consumers: dict[str, str] = {}
    cancelled: set[str] = set()
    # the test session filters info logs out (conftest); let them through here
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    with contextlib.ExitStack() as stack:
        stack.callback(
            structlog.configure, wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)
        )
        logs = stack.enter_context(structlog.testing.capture_logs())
        for wave in range(20):
            tasks: dict[str, asyncio.Task[Any]] = {}
            for i in range(10):
                request_id, consumer = f"req-{wave}-{i}", new_uuid()
                consumers[request_id] = consumer
                tasks[request_id] = asyncio.create_task(
                    store.set_allocations(
                        consumer,
                        {rp: {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                        metadata={"request_id": request_id},
                    )
                )
            await asyncio.sleep(0)  # (each has queued its command)
            for task in tasks.values():
                for _ in range(rng.randint(0, 4)):
                    await asyncio.sleep(0)
                if rng.random() < 0.3:
                    await asyncio.sleep(0.001)
                task.cancel()
            for request_id, task in tasks.items():
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                if task.cancelled():
                    cancelled.add(request_id)

        def said() -> dict[str, list[dict[str, Any]]]:
            lines: dict[str, list[dict[str, Any]]] = {}
            for line in logs:
                if line.get("request_id") in cancelled:
                    lines.setdefault(line["request_id"], []).append(line)
            return lines

        async with asyncio.timeout(10):  # (the writer logs them as it finishes them)
            while len(said()) < len(cancelled):
                await asyncio.sleep(0.01)
    assert cancelled
    committed = set()
    for request_id, lines in said().items():
        assert len(lines) == 1, lines
        line = lines[0]
        assert line["caller_cancelled"] is True and line["command"] == "WriteAllocations", line
        assert line["consumer"] == [consumers[request_id]], line
        held = (await store.allocations(consumers[request_id])).allocations
        if line["event"] == "command.accepted":
            assert held == {rp: {"VCPU": 1}} and line["position"] is not None, line
            committed.add(request_id)
        else:
            assert line["event"] == "command.cancelled" and held == {}, line
    assert committed  # (those were silent)
    assert (await store.usage(rp))["VCPU"] == len(consumers) - len(cancelled) + len(committed)


async def test_timeout_around_a_command_behaves(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await allocate(store, c, {rp: {"VCPU": 1}})
    # Whether it committed or not, the store is consistent and usable afterwards.
    held = (await store.allocations(c)).allocations
    assert held in ({}, {rp: {"VCPU": 1}})
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    assert (await store.audit()).clean


async def test_subscriptions_cancelled_at_random_points_leave_the_store_usable(
    store: AllocationStore,
) -> None:
    rp = await make_provider(store, VCPU=10_000)
    rng = random.Random(11)
    seen: dict[int, list[int]] = {}

    async def follow(i: int) -> None:
        got = seen.setdefault(i, [])
        async for e in store.subscribe(after=0, batch_size=rng.randint(1, 7)):
            got.append(e.position)

    async def write(n: int) -> None:
        for _ in range(n):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})

    followers = [asyncio.create_task(follow(i)) for i in range(12)]
    writer = asyncio.create_task(write(60))
    for task in followers:
        for _ in range(rng.randint(0, 40)):
            await asyncio.sleep(0)
        task.cancel()
    await writer
    results = await asyncio.gather(*followers, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    for positions in seen.values():
        # whatever a subscriber saw before it was cancelled is a gap-free prefix, no repeats
        assert positions == list(range(1, len(positions) + 1))
    head = await store.head()
    assert head == 62
    fresh: list[int] = []
    async with asyncio.timeout(10):
        async for e in store.subscribe(after=0):
            fresh.append(e.position)
            if e.position == head:
                break
    assert fresh == list(range(1, head + 1))
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    assert (await store.audit()).clean


async def test_a_subscriber_cancelled_just_as_an_append_wakes_it_stops(store: AllocationStore) -> None:
    """Regression: asyncio.wait_for (Python 3.11) could swallow the cancellation when the awaited
    wake-up fired in the same loop iteration, and the subscriber then followed forever."""
    await make_provider(store, VCPU=1)
    positions: list[int] = []

    async def follow() -> None:
        async for e in store.subscribe(after=0):
            positions.append(e.position)

    for _ in range(5):
        task = asyncio.create_task(follow())
        while len(positions) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)  # now waiting for the next append
        store._wake_subscribers()  # the wake-up of a commit...
        task.cancel()  # ...and the cancellation, in the same iteration
        done, _ = await asyncio.wait({task}, timeout=10)  # (a hang guard: it followed forever)
        assert task in done and task.cancelled(), "the subscriber went on after being cancelled"
        positions.clear()


async def test_closing_the_store_finishes_every_command_in_flight(store_url: str) -> None:
    """Regression: close() cancelled the writer while a batch was in its transaction, and the
    callers of that batch waited forever."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=1000)
        consumers = [new_uuid() for _ in range(40)]
        tasks = [asyncio.create_task(allocate(store, c, {rp: {"VCPU": 1}})) for c in consumers]
        for _ in range(3):
            await asyncio.sleep(0)  # the batch is taken into a transaction...
    # ...and the store closes under it: every caller gets an answer
    _, pending = await asyncio.wait(tasks, timeout=10)
    assert not pending, f"{len(pending)} commands never got an answer"
    accepted = [c for c, t in zip(consumers, tasks, strict=True) if t.exception() is None]
    for t in tasks:
        assert t.exception() is None or isinstance(t.exception(), EvstoreError)
    async with open_store(store_url) as store:
        for c in accepted:
            assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}
        assert (await store.usage(rp)).usages["VCPU"] == len(accepted)
        assert (await store.audit()).clean


async def test_mixed_commands_sharing_group_commits_keep_projection_equal_to_replay(
    store: AllocationStore,
) -> None:
    """Several random workloads at once: their commands share transactions (and the writer's
    per-batch cache of providers and consumers); the projection must still equal a replay."""
    from tests.test_projections_support import random_workload

    await asyncio.gather(*(random_workload(store, seed=seed, commands=80, providers=2) for seed in range(6)))
    report = await store.audit()
    assert report.clean, report.findings
    replayed = await store.replay()
    for uuid, _ in await store.providers():
        usage = await store.usage(uuid)
        assert usage.generation == replayed.providers[uuid].generation
        assert {rc: n for rc, n in usage.usages.items() if n} == replayed.providers[uuid].usages


async def test_one_batch_sees_names_and_children_its_earlier_jobs_wrote(sqlite_url: str) -> None:
    """SQLite runs a batch's jobs in queue order in one transaction: lookups by name and parent
    see the batch's own earlier jobs (created, renamed), not only what the projection held
    before it. (PostgreSQL runs jobs on disjoint entities in parallel: no order among them.)"""
    async with open_store(sqlite_url) as store:
        await _names_and_children_in_one_batch(store)


async def _names_and_children_in_one_batch(store: AllocationStore) -> None:
    a, b, c, root = new_uuid(), new_uuid(), new_uuid(), new_uuid()
    await store.create_provider(root, "root")
    outcomes = await asyncio.gather(
        store.create_provider(a, "twin"),
        store.create_provider(b, "twin"),  # same name as a job before it in the batch
        store.rename_provider(a, "renamed"),
        store.create_provider(c, "twin", parent=root),  # the name is free again
        store.delete_provider(root),  # has a child created in this batch
        return_exceptions=True,
    )
    assert not isinstance(outcomes[0], BaseException)
    assert isinstance(outcomes[1], DuplicateName)
    assert not isinstance(outcomes[2], BaseException) and not isinstance(outcomes[3], BaseException)
    assert isinstance(outcomes[4], EvstoreError)
    assert outcomes[4].code == "placement.resource_provider.cannot_delete_parent"
    names = {p.uuid: p.name for p in (await store.replay()).providers.values()}
    assert names == {a: "renamed", c: "twin", root: "root"}
    assert (await store.audit()).clean


def _count_batches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of jobs of each SQLite group commit from now on."""
    from evstore.log import sqlite as sqlite_backend

    sizes: list[int] = []
    real = sqlite_backend.run_batch

    def counted(conn: Any, jobs: Any, *rest: Any) -> Any:
        sizes.append(len(jobs))
        return real(conn, jobs, *rest)

    monkeypatch.setattr(sqlite_backend, "run_batch", counted)
    return sizes


async def test_one_batch_sees_the_migrations_its_jobs_started_changed_or_only_read(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deleting an instance releases what its migrations hold: in one SQLite batch, the writer
    finds them among the entities the batch's earlier jobs touched by their current value - a
    migration started in the batch (by a job after others had looked it up: absent then), one
    reverted in it (holds nothing: nothing of it released), one that a rejected job only loaded
    (it changed nothing, and is as stored)."""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)
        i1, m1, i2, m2, i3, m3 = (new_uuid() for _ in range(6))
        for instance, vcpu in ((i1, 1), (i2, 2), (i3, 4)):
            await allocate(store, instance, {rp: {"VCPU": vcpu}})
        await store.start_migration(i2, m2)
        await store.start_migration(i3, m3)
        generation = (await store.allocations(m2)).generation
        assert generation is not None
        sizes = _count_batches(monkeypatch)
        outcomes = await asyncio.gather(
            allocate(store, m2, {rp: {"VCPU": 9}}, generation=generation + 1),
            store.release(m1),  # (absent: refused)
            store.delete_consumer(i2),
            store.start_migration(i1, m1),
            store.delete_consumer(i1),
            store.revert_migration(m3),
            store.delete_consumer(i3),
            return_exceptions=True,
        )
        assert sizes == [7]  # (one group commit)
        assert isinstance(outcomes[0], ConcurrentUpdate)
        assert isinstance(outcomes[1], NotFound)
        assert [o for o in outcomes[2:] if isinstance(o, BaseException)] == []
        deleted = {}
        for instance in (i1, i2, i3):
            async for recorded in store.history(instance):
                if recorded.type == "ConsumerDeleted":
                    deleted[instance] = recorded.event
        assert deleted[i1].migrations_released == {m1: {rp: {"VCPU": 1}}}
        assert deleted[i2].migrations_released == {m2: {rp: {"VCPU": 2}}}
        assert deleted[i3].migrations_released == {}
        assert deleted[i3].released == {rp: {"VCPU": 4}}
        assert (await store.usage(rp)).usages == {"VCPU": 0}
        for migration in (m1, m2, m3):
            assert (await store.allocations(migration)).allocations == {}
        assert (await store.audit()).clean


async def test_one_batch_sees_providers_it_deleted_or_renamed_by_their_current_name_and_parent(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(sqlite_url) as store:
        root, child, other = new_uuid(), new_uuid(), new_uuid()
        await store.create_provider(root, "root")
        await store.create_provider(child, "child", parent=root)
        sizes = _count_batches(monkeypatch)
        outcomes = await asyncio.gather(
            store.delete_provider(child),
            store.create_provider(other, "child"),  # the deleted one's name is free
            store.delete_provider(root),  # its only child was deleted in this batch
            store.rename_provider(other, "other"),  # (after a lookup found it by its old name)
            store.create_provider(new_uuid(), "other"),
            store.create_provider(new_uuid(), "child"),  # free again
            return_exceptions=True,
        )
        assert sizes == [6]
        assert isinstance(outcomes[4], DuplicateName)
        assert [o for i, o in enumerate(outcomes) if i != 4 and isinstance(o, BaseException)] == []
        names = sorted(p.name for p in (await store.replay()).providers.values())
        assert names == ["child", "other"]
        assert (await store.audit()).clean


async def test_a_lookup_by_instance_name_or_parent_does_not_walk_everything_the_batch_touched(
    sqlite_url: str,
) -> None:
    """The SQLite writer finds an instance's migrations, the provider holding a name and a
    provider's children among the entities its group commit has touched by their current value.
    It walked every one of them for each command that looks one up (deleting a consumer,
    creating, renaming or deleting a provider): quadratic in the batch, up to max_batch (256)
    commands. Measured (batches of 256 building, migrating and deleting instances): the writer's
    instructions per command -12%; creating, renaming and deleting providers -23%."""
    walks: list[int] = []
    loading: list[bool] = []

    class Watched(set[str]):
        def __iter__(self) -> Any:
            if loading:
                walks.append(len(self))
            return super().__iter__()

    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=1000)
        cache = store.backend._cache  # type: ignore[attr-defined]
        clean, load = cache._clean, cache.load

        def watched_clean() -> None:
            clean()
            cache.touched_consumers = Watched()
            cache.touched_providers = Watched()

        def watched_load(*args: Any) -> Any:
            loading.append(True)
            try:
                return load(*args)
            finally:
                loading.pop()

        cache._clean, cache.load = watched_clean, watched_load
        instances = [new_uuid() for _ in range(8)]
        migrations = [new_uuid() for _ in range(8)]
        await asyncio.gather(*(allocate(store, i, {rp: {"VCPU": 1}}) for i in instances))
        await asyncio.gather(
            *(store.start_migration(i, m) for i, m in zip(instances, migrations, strict=True))
        )
        providers = [new_uuid() for _ in range(8)]
        await asyncio.gather(*(store.create_provider(p, f"node-{p}", parent=rp) for p in providers))
        await asyncio.gather(
            *(store.delete_consumer(i) for i in instances),
            *(store.rename_provider(p, f"renamed-{p}") for p in providers),
        )
        await asyncio.gather(*(store.delete_provider(p) for p in providers))
        assert walks == []
        assert (await store.usage(rp)).usages == {"VCPU": 0}
        assert [name for _, name in await store.providers()] == [f"rp-{rp}"]
        assert (await store.audit()).clean


# --- the SQLite writer remembers the entities it loaded from one group commit to the next -------


async def test_a_writer_sees_what_another_connection_committed_since_its_last_group_commit(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path}/two.db"
    async with open_store(url) as a, open_store(url) as b:
        rp = await make_provider(a, VCPU=8)
        c = new_uuid()
        await allocate(a, c, {rp: {"VCPU": 1}})  # a now remembers c and rp
        g1 = (await a.allocations(c)).generation
        await allocate(b, c, {rp: {"VCPU": 3}}, generation=g1)  # b changes both behind a's back
        g2 = (await b.allocations(c)).generation
        assert g2 != g1
        with pytest.raises(ConcurrentUpdate):
            await allocate(a, c, {rp: {"VCPU": 2}}, generation=g1)
        await allocate(a, c, {rp: {"VCPU": 2}}, generation=g2)
        with pytest.raises(CapacityExceeded):  # a counts b's usage of rp too: 2 held, 7 more do not fit
            await allocate(a, new_uuid(), {rp: {"VCPU": 7}})
        assert (await a.usage(rp)).usages == {"VCPU": 2}
        assert (await a.audit()).clean


async def test_two_writers_taking_turns_on_one_file_continue_each_others_log(tmp_path: Path) -> None:
    """Two writers on one file, in runs and switches: each command continues the log where the
    other left it (contiguous positions, one hash chain), whatever either writer remembers
    between its own transactions."""
    url = f"sqlite:///{tmp_path}/turns.db"
    async with open_store(url) as a, open_store(url) as b:
        rp = await make_provider(a, VCPU=100)
        positions: list[int] = []
        for i in range(20):
            store = (a, b)[i % 3 % 2]  # a, b, a, a, b, a, ... (both runs and switches)
            receipt = await store.set_allocations(
                new_uuid(),
                {rp: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
            positions += receipt.positions
        start = positions[0]
        assert positions == list(range(start, start + 20))
        assert await a.head() == await b.head() == positions[-1]
        report = await b.audit()
        assert report.clean, report.findings


async def test_an_upgrade_waiting_for_another_connections_lock_says_so_as_a_command_does(
    tmp_path: Path,
) -> None:
    """Regression (helper-75): opening a store whose schema must be upgraded while another
    connection held the write lock failed, after busy_timeout, with a bare 'SQLite error:
    database is locked' (the open's hint, and the 'longer than busy_timeout ... retry' a command
    says, were only for errors of the connection's pragmas, not of the schema's transaction)."""
    import sqlite3

    path = tmp_path / "v2.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=8)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("ALTER TABLE p_consumers DROP COLUMN instance_type")  # (what version 2 wrote)
    conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.execute("BEGIN IMMEDIATE")  # (another process, mid-command)
    try:
        with pytest.raises(StorageError) as info:
            async with open_store(f"sqlite:///{path}?busy_timeout=0.2"):
                pass
    finally:
        conn.execute("ROLLBACK")
        conn.close()
    assert "longer than busy_timeout (0.2 s)" in str(info.value), info.value
    assert "retry, or open the store with a longer busy_timeout" in str(info.value)
    async with open_store(f"sqlite:///{path}") as store:  # (upgraded once the lock is gone)
        assert (await store.audit()).clean


async def test_a_group_commit_that_rolls_back_is_forgotten(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evstore.log import sqlite as sqlite_backend

    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        g1 = (await store.allocations(c)).generation
        real = sqlite_backend.apply_changes

        def fail_once(conn: object, cs: object, *rest: object) -> None:
            monkeypatch.setattr(sqlite_backend, "apply_changes", real)
            raise OSError("disk gone")

        monkeypatch.setattr(sqlite_backend, "apply_changes", fail_once)
        with pytest.raises(StorageError):
            await allocate(store, c, {rp: {"VCPU": 5}}, generation=g1)
        # nothing of the failed write is left, in the database or in what the writer remembers
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}
        await allocate(store, c, {rp: {"VCPU": 7}}, generation=g1)
        assert (await store.usage(rp)).usages == {"VCPU": 7}
        assert (await store.audit()).clean
        # the same once the project usage counters were counted (in the writer's memory too)
        count = sqlite_backend._count_usages

        def count_then_fail(*args: Any) -> None:
            monkeypatch.setattr(sqlite_backend, "_count_usages", count)
            count(*args)
            raise OSError("disk gone")

        monkeypatch.setattr(sqlite_backend, "_count_usages", count_then_fail)
        g2 = (await store.allocations(c)).generation
        with pytest.raises(StorageError):
            await allocate(store, c, {rp: {"VCPU": 3}}, generation=g2)
        assert (await store.usages("project")).usages == {"VCPU": 7}
        await allocate(store, c, {rp: {"VCPU": 2}}, generation=g2)
        assert (await store.usages("project")).usages == {"VCPU": 2}
        assert (await store.audit()).clean


async def test_names_and_children_stay_right_from_one_group_commit_to_the_next(store_url: str) -> None:
    async with open_store(store_url) as store:
        a, b, root = new_uuid(), new_uuid(), new_uuid()
        await store.create_provider(root, "root")
        await store.create_provider(a, "twin", parent=root)
        await store.rename_provider(a, "renamed")
        await store.create_provider(b, "twin")  # the old name is free
        with pytest.raises(DuplicateName):
            await store.create_provider(new_uuid(), "renamed")
        with pytest.raises(EvstoreError) as info:
            await store.delete_provider(root)  # a is its child
        assert info.value.code == "placement.resource_provider.cannot_delete_parent"
        await store.delete_provider(a)
        await store.delete_provider(root)
        assert set((await store.replay()).providers) == {b}
        assert (await store.audit()).clean


async def test_commands_decide_on_the_rebuilt_projection_not_on_what_the_writer_loaded_before(
    tmp_path: Path,
) -> None:
    import sqlite3

    url = f"sqlite:///{tmp_path}/damaged.db"
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        g1 = (await store.allocations(c)).generation
    with sqlite3.connect(tmp_path / "damaged.db") as db:  # the projection is damaged
        db.execute("UPDATE p_consumers SET generation = 99 WHERE uuid = ?", (c,))
    async with open_store(url) as store:
        with pytest.raises(ConcurrentUpdate):  # decided on the damaged row (the writer loads it)
            await allocate(store, c, {rp: {"VCPU": 2}}, generation=g1)
        await store.rebuild()  # on the writer's own connection
        await allocate(store, c, {rp: {"VCPU": 2}}, generation=g1)
        assert (await store.usage(rp)).usages == {"VCPU": 2}
        assert (await store.audit()).clean


async def test_one_group_commit_updates_consumers_left_in_every_state(store: AllocationStore) -> None:
    """Existing consumers of one type and project, changed in one transaction: one tombstoned
    (generation None), one rewritten (a new generation), one emptied, one migrated away."""
    rp = await make_provider(store, VCPU=16)
    a, b, c, d, mig = (new_uuid() for _ in range(5))
    for consumer in (a, b, c, d):
        await allocate(store, consumer, {rp: {"VCPU": 1}})
    gb = (await store.allocations(b)).generation
    outcomes = await asyncio.gather(
        store.delete_consumer(a),
        allocate(store, b, {rp: {"VCPU": 3}}, generation=gb),
        store.release(c),
        store.start_migration(d, mig),
        return_exceptions=True,
    )
    assert not [o for o in outcomes if isinstance(o, BaseException)], outcomes
    assert (await store.allocations(a)).allocations == {}
    assert (await store.allocations(b)).allocations == {rp: {"VCPU": 3}}
    assert (await store.allocations(b)).generation != gb
    assert (await store.allocations(c)).allocations == {}
    assert (await store.allocations(mig)).allocations == {rp: {"VCPU": 1}}
    assert (await store.usage(rp)).usages == {"VCPU": 4}
    with pytest.raises(EvstoreError):  # the tombstone holds
        await allocate(store, a, {rp: {"VCPU": 1}})
    assert (await store.audit()).clean


async def test_a_long_queue_does_not_starve_other_work_on_the_writer_connection(sqlite_url: str) -> None:
    """The SQLite writer thread takes batch after batch off the queue by itself (``drain``); it
    must still hand the connection back now and then, or a snapshot, rebuild or audit queued
    behind a long stream of commands would wait for all of them."""
    async with open_store(sqlite_url, max_batch=4) as store:
        rp = await make_provider(store, VCPU=10_000)
        start = await store.head()
        tasks = [asyncio.create_task(allocate(store, new_uuid(), {rp: {"VCPU": 1}})) for _ in range(400)]
        while not any(t.done() for t in tasks):  # the thread is draining the queue
            await asyncio.sleep(0)

        def head_now(conn: Any) -> int:
            return int(conn.execute("SELECT max(position) FROM events").fetchone()[0])

        seen = await store.backend._on_writer(head_now)  # type: ignore[attr-defined]
        await asyncio.gather(*tasks)
        assert await store.head() == start + 400
        # its turn came after a few batches of 4, not after the whole queue
        assert seen < start + 200, f"the probe waited for {seen - start} of 400 commands"


async def test_commands_fail_fast_when_the_writer_connection_is_gone(sqlite_url: str) -> None:
    """Regression guard: with its connection closed under it, the writer must answer every queued
    command (with an error) instead of trying the same queue again and again."""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        await store.backend.close()
        results = await asyncio.wait_for(
            asyncio.gather(
                *(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(5)), return_exceptions=True
            ),
            timeout=10,
        )
        assert all(isinstance(r, EvstoreError) for r in results), results
        assert {r.code for r in results if isinstance(r, EvstoreError)} == {"evstore.store.closed"}


async def test_a_cancelled_close_still_answers_every_queued_command(store_url: str) -> None:
    """Regression: close() under a shutdown deadline cancelled the writer task with it: the
    queued callers waited forever, a second close() returned at once and left the connections
    (and their non-daemon threads) open."""
    store = AllocationStore(make_backend(store_url))
    await store.open()
    rp = await make_provider(store, VCPU=100_000)
    callers = [asyncio.create_task(allocate(store, new_uuid(), {rp: {"VCPU": 1}})) for _ in range(600)]
    await asyncio.sleep(0)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.001):
            await store.close()
    done, pending = await asyncio.wait(callers, timeout=30)
    assert not pending
    await store.close()  # waits for the first one's closing
    accepted = [t for t in done if t.exception() is None]
    async with open_store(store_url) as reopened:
        assert (await reopened.usage(rp))["VCPU"] == len(accepted) > 0
        assert (await reopened.audit()).clean


async def test_a_cancelled_writer_task_fails_commands_instead_of_hanging(store_url: str) -> None:
    """Regression: a shutdown that cancels every other task cancelled the store's writer too;
    from then on every command hung with no error, and close() raised CancelledError."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        writer = store._writer
        assert writer is not None
        writer.cancel()
        await asyncio.wait([writer])
        with pytest.raises(StoreClosed, match="writer task was cancelled"):
            async with asyncio.timeout(10):
                await store.rename_provider(rp, "renamed")
    # (the async with closed it without an error)


async def test_a_writer_cancelled_mid_batch_still_answers_that_batch(store_url: str) -> None:
    """Regression (PostgreSQL): the batch running when the writer was cancelled had been taken off
    the queue and was delivered by the writer after it - which a cancelled task never reaches: up
    to max_batch callers waited forever for commands that had committed."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=100_000)
        callers = [asyncio.create_task(allocate(store, new_uuid(), {rp: {"VCPU": 1}})) for _ in range(300)]
        await asyncio.sleep(0.05)
        writer = store._writer
        assert writer is not None
        writer.cancel()
        done, pending = await asyncio.wait(callers, timeout=30)
        assert not pending
        accepted = sum(1 for t in done if t.exception() is None)
        assert all(isinstance(t.exception(), (StoreClosed, type(None))) for t in done)
    async with open_store(store_url) as reopened:
        assert (await reopened.usage(rp))["VCPU"] == accepted


async def test_close_ends_a_waiting_subscriber_at_once(sqlite_url: str) -> None:
    """Regression: a subscriber waiting for appends slept until its next poll after close()."""
    async with open_store(sqlite_url, poll_interval=60) as store:
        await make_provider(store, VCPU=8)

        async def follow() -> list[int]:
            return [e.position async for e in store.subscribe()]

        follower = asyncio.create_task(follow())
        await asyncio.sleep(0.2)
    with pytest.raises(StoreClosed):
        async with asyncio.timeout(10):
            await follower


class _BatchOnlyBackend:
    """A backend as the Backend protocol's minimum: whole batches through ``run_jobs``, without
    the SQLite writer thread's ``drain`` or PostgreSQL's per-command ``start_jobs`` (a third-party
    backend may offer neither). Everything else is the wrapped backend's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.batches: list[int] = []
        self.running = asyncio.Event()  # (set while a batch waits for ``go``)
        self.go = asyncio.Event()
        self.go.set()

    def __getattr__(self, name: str) -> Any:
        if name in ("drain", "start_jobs"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    async def run_jobs(self, jobs: Any) -> Any:
        self.batches.append(len(jobs))
        self.running.set()
        await self.go.wait()
        return await self._inner.run_jobs(jobs)


async def test_a_backend_with_only_run_jobs_gets_group_commits_all_or_nothing(store_url: str) -> None:
    """The writer's generic path (a batch per ``run_jobs``, shielded from cancellation): racing
    claims share group commits, each accepted or rejected alone, a rejected one leaves no trace,
    and a writer cancelled mid-batch still answers that batch."""
    backend = _BatchOnlyBackend(make_backend(store_url))
    store = AllocationStore(backend)
    await store.open()
    try:
        rp = await make_provider(store, VCPU=10)
        consumers = [new_uuid() for _ in range(100)]
        results = await asyncio.gather(*(_claim(store, c, rp) for c in consumers))
        assert results.count(True) == 10
        assert max(backend.batches) > 1  # (commands shared a batch)
        assert await store.head() == 12
        winners = {c for c, ok in zip(consumers, results, strict=True) if ok}
        assert {c for c in consumers if (await store.allocations(c)).allocations} == winners

        big = await make_provider(store, VCPU=100_000)
        backend.running.clear()
        backend.go.clear()
        callers = [asyncio.create_task(allocate(store, new_uuid(), {big: {"VCPU": 1}})) for _ in range(300)]
        await asyncio.wait_for(backend.running.wait(), 10)  # a batch is under way
        writer = store._writer
        assert writer is not None
        writer.cancel()
        await asyncio.wait([writer])
        backend.go.set()
        done, pending = await asyncio.wait(callers, timeout=30)
        assert not pending
        assert all(isinstance(t.exception(), (StoreClosed, type(None))) for t in done)
        accepted = sum(1 for t in done if t.exception() is None)
        assert accepted == backend.batches[-1] > 0  # (that batch ran to its end and was answered)
        assert (await store.usage(big)).usages.get("VCPU", 0) == accepted
        assert (await store.audit()).clean
    finally:
        await store.close()


_KEY_WORKER = """
import asyncio, json, sys
from evstore import EvstoreError, open_store

async def main(url, rp, consumer, vcpu, start):
    async with open_store(url) as store:
        while not __import__("os").path.exists(start):  # all processes open first, then race
            await asyncio.sleep(0.005)
        try:
            r = await store.set_allocations(
                consumer, {rp: {"VCPU": vcpu}}, project_id="p", user_id="u",
                consumer_type="INSTANCE", generation=None, idempotency_key="one-request",
            )
            print(json.dumps({"positions": list(r.positions), "replayed": r.replayed}))
        except EvstoreError as exc:
            print(json.dumps({"code": exc.code}))

asyncio.run(main(*sys.argv[1:4], int(sys.argv[4]), sys.argv[5]))
"""


@pytest.mark.parametrize("same_command", [True, False], ids=["same-command", "different-commands"])
async def test_one_idempotency_key_from_several_processes(
    store_url: str, tmp_path: Path, same_command: bool
) -> None:
    """Six OS processes send one idempotency key at once: with the same command, one appends and
    the others get its receipt; with different commands (other consumers, other amounts), exactly
    one runs and every other is refused as a conflict, leaving nothing in the log."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
    start = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    shared = new_uuid()
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _KEY_WORKER,
            store_url,
            rp,
            shared if same_command else new_uuid(),
            "1" if same_command else str(i + 1),
            str(start),
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        for i in range(6)
    ]
    await asyncio.sleep(1.0)  # (opening the store; a late one still races the others' commits)
    start.touch()
    # (the last line: evstore's info logs go to stdout too)
    outputs = [json.loads((await p.communicate())[0].splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0] * 6
    accepted = [o for o in outputs if "positions" in o and not o["replayed"]]
    assert len(accepted) == 1, outputs
    if same_command:
        assert all(o.get("positions") == accepted[0]["positions"] for o in outputs), outputs
    else:
        assert sorted(o.get("code", "") for o in outputs) == [""] + ["evstore.idempotency.conflict"] * 5
    async with open_store(store_url) as store:
        assert await store.head() == head + 1, "one command appended, once"
        assert (await store.usage(rp)).usages["VCPU"] in range(1, 7)
        assert (await store.audit()).clean


async def test_a_rejected_command_leaves_no_reference_cycle(store: AllocationStore) -> None:
    """A rejected command, its job and the group commit it was in are freed by reference
    counting. The error's traceback holds the frames it passed through (and their callers',
    through ``f_back``); the writer's frames held the batch's outcomes (the error among them)
    and the caller's the future (holding the error): every batch with a rejection was a cycle,
    kept for the cyclic collector - which then scanned it in each collection (under load, most of
    the collector's work, ~10% of a 64-task run)."""
    rp = await make_provider(store, VCPU=8)
    gone = new_uuid()
    await allocate(store, gone, {rp: {"VCPU": 1}})
    await store.delete_consumer(gone)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # (what a collection finds unreachable stays in gc.garbage)
    try:
        for _ in range(3):
            with pytest.raises(NotFound):
                await store.release(gone)
            with pytest.raises(ConsumerDeleted):
                await asyncio.gather(
                    allocate(store, gone, {rp: {"VCPU": 1}}), allocate(store, new_uuid(), {rp: {"VCPU": 1}})
                )
        gc.collect()
        kept = sorted(
            {type(o).__name__ for o in gc.garbage if isinstance(o, (Job, asyncio.Future, EvstoreError))}
        )
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was_enabled:
            gc.enable()
    assert kept == []


async def test_command_lines_carry_the_callers_structlog_context_not_another_requests(
    store_url: str,
) -> None:
    """Review 27: a service binds its request id with ``structlog.contextvars`` (structlog's way,
    merged by ``merge_contextvars``) and never passes ``metadata=``. Every ``command.*`` line still
    said ``request_id=None``: evstore wrote the key itself, and ``merge_contextvars`` only fills
    keys a line lacks. And the lines about a cancelled caller's command, logged by the writer (its
    thread, its task, PostgreSQL's done callbacks), carried the context of whoever opened the
    store - a request that opened it lazily lent its id and fields to other requests' lines - or
    none at all. Each line now carries the context of the call that issued the command."""

    async def open_in_a_request() -> AllocationStore:
        structlog.contextvars.bind_contextvars(request_id="req-opener", tenant="opener")
        return await open_store(store_url)

    store = await asyncio.create_task(open_in_a_request())
    rp = await make_provider(store, VCPU=100_000)
    rng = random.Random(27)
    config = structlog.get_config()
    capture = structlog.testing.LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )

    async def request(request_id: str, consumer: str) -> None:
        structlog.contextvars.bind_contextvars(request_id=request_id, tenant=f"tenant-{request_id}")
        await allocate(store, consumer, {rp: {"VCPU": 1}}, project_id="p", user_id="u")

    consumers: dict[str, str] = {}
    try:
        for wave in range(20):
            tasks = []
            for i in range(10):
                request_id = f"req-{wave}-{i}"
                consumers[request_id] = new_uuid()
                tasks.append(asyncio.create_task(request(request_id, consumers[request_id])))
            await asyncio.sleep(0)  # (each has queued its command)
            for task in tasks:
                for _ in range(rng.randint(0, 4)):
                    await asyncio.sleep(0)
                if rng.random() < 0.5:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        async with asyncio.timeout(10):  # (the writer logs cancelled callers' commands as it ends them)
            while len([e for e in capture.entries if e.get("consumer") != [rp]]) < len(consumers):
                await asyncio.sleep(0.01)
        await store.close()
    finally:
        structlog.configure(**config)
    by_consumer = {c: r for r, c in consumers.items()}
    lines = [e for e in capture.entries if e["event"].startswith("command.") and e.get("consumer")]
    assert len(lines) == len(consumers)
    assert {line.get("caller_cancelled", False) for line in lines} == {True, False}
    for line in lines:
        request_id = by_consumer[line["consumer"][0]]
        assert (line.get("request_id"), line.get("tenant")) == (request_id, f"tenant-{request_id}"), line


async def test_a_kept_rejection_does_not_keep_other_callers_contexts_alive(store: AllocationStore) -> None:
    """Review 27: each command carries its caller's ``contextvars`` context (for the lines the
    writer logs for a cancelled caller), and a rejection's traceback holds the writer's frames,
    which hold every job of its group commit: a caller that kept its error (an error tracker, a
    last-error field) kept alive what every other request of that group commit had bound in its
    context (a request object, a session), long after those requests had ended. A job lets go of
    the context once its caller is answered."""
    rp = await make_provider(store, VCPU=1000)
    bound: contextvars.ContextVar[object] = contextvars.ContextVar("bound")

    class Request:
        pass

    alive: list[weakref.ref[Request]] = []

    async def accepted() -> None:
        request = Request()
        bound.set(request)
        alive.append(weakref.ref(request))
        del request
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})

    async def rejected() -> ConcurrentUpdate:
        with pytest.raises(ConcurrentUpdate) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}}, generation=5)
        return caught.value

    *_, kept = await asyncio.gather(*(accepted() for _ in range(5)), rejected())
    for _ in range(5):  # (the writer's hand-offs settle)
        await asyncio.sleep(0)
    gc.collect()
    assert [ref() for ref in alive] == [None] * 5
    assert kept.code == "placement.concurrent_update"


def test_a_shutdown_that_cancels_every_task_leaves_one_line_per_command(store_url: str) -> None:
    """Review 25: a service whose shutdown deadline ran out (``close()`` cancelled, then
    ``asyncio.run`` cancelling every task left: callers, the writer, PostgreSQL's command tasks)
    lost the log line the README promises a cancelled caller's command ("command.cancelled if it
    never began"): on SQLite the commands still queued when the writer was cancelled logged
    nothing at all (1,744 of 2,000 in the review's run); on PostgreSQL each command cancelled
    while it waited for its turn was logged ``command.rejected``, "cancelled while it ran; its
    outcome is unknown", though it had not begun."""

    async def seed() -> str:
        async with open_store(store_url) as store:
            return await make_provider(store, VCPU=100_000)

    rp = asyncio.run(seed())
    request_ids = [f"req-{i}" for i in range(600)]

    async def service() -> None:
        store = await open_store(store_url, max_batch=4)
        for request_id in request_ids:
            asyncio.create_task(  # noqa: RUF006 (asyncio.run's teardown cancels them)
                store.set_allocations(
                    new_uuid(),
                    {rp: {"VCPU": 1}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                    metadata={"request_id": request_id},
                )
            )
        await asyncio.sleep(0)  # (each has queued its command)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.005):  # (the shutdown deadline)
                await store.close()

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.INFO))
    try:
        with structlog.testing.capture_logs() as logs:
            asyncio.run(service())  # (its own loop, torn down as a service's is)
    finally:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def committed() -> set[str]:
        async with open_store(store_url) as store:
            return {e.metadata.request_id or "" for e in await store.read(0, 10_000)}

    in_log = asyncio.run(committed())
    said: dict[str, list[dict[str, Any]]] = {}
    for line in logs:
        if line.get("request_id") in request_ids:
            said.setdefault(line["request_id"], []).append(line)
    silent = [r for r in request_ids if r not in said]
    assert not silent, f"{len(silent)}/{len(request_ids)} commands left no log line"
    for request_id, lines in said.items():
        assert len(lines) == 1, lines
        line = lines[0]
        if request_id in in_log:
            assert line["event"] == "command.accepted", line
        else:
            assert line["event"] in ("command.cancelled", "command.rejected"), line
    # (not begun: said so; "outcome unknown" only for those cancelled inside their transaction,
    # at most one per pooled connection)
    unknown = [x[0] for x in said.values() if x[0].get("error", "").endswith("outcome is unknown")]
    assert len(unknown) <= 10, f"{len(unknown)} commands logged as of unknown outcome: {unknown[0]}"
