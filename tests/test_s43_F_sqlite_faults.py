"""SQLite under what an operator or another process does to an open store (stop 43, helper F):
another process holding the write lock past ``busy_timeout``, the store's directory renamed or
its -wal deleted under a burst with a subscriber following. A command succeeds, or fails as
``evstore.storage`` saying whether it may have committed (``details["outcome_unknown"]``);
what was acknowledged is in the log, what failed is not."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pytest

from evstore import AllocationStore, EvstoreError, StorageError, open_store
from tests.conftest import make_provider

SLOW = os.environ.get("EVSTORE_SLOW") == "1"


async def _claim(store: AllocationStore, rp: str, key: str) -> list[int]:
    receipt = await store.set_allocations(
        str(uuid.uuid5(uuid.NAMESPACE_URL, key)),
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        idempotency_key=key,
    )
    return list(receipt.positions)


async def test_a_command_refused_busy_or_for_a_file_replaced_says_nothing_was_committed(
    tmp_path: Path,
) -> None:
    """Regression: SQLite's refusals that commit nothing - busy (another process held the write
    lock past ``busy_timeout``) and ``file_replaced`` (the -wal deleted, the directory renamed) -
    said so in words only: ``details`` had no ``outcome_unknown``, which PostgreSQL's clean
    failures, SQLite's ``read_only`` and ``disk_full`` carry (False), so a caller could not tell
    them from an error that may have committed without reading the message."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}", busy_timeout=0.3) as store:
        rp = await make_provider(store, VCPU=10**6)
        await _claim(store, rp, "k0")
        holder = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
                "c.execute('BEGIN EXCLUSIVE'); print('held', flush=True); sys.stdin.read()",
                str(path),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            with pytest.raises(StorageError) as busy:
                await _claim(store, rp, "k1")
        finally:
            holder.communicate("", timeout=10)
        assert busy.value.details["sqlite_error"] == "busy"
        assert busy.value.details["outcome_unknown"] is False
        assert await _claim(store, rp, "k1")  # (the same store goes on)
        os.rename(tmp_path, tmp_path.with_name(tmp_path.name + "-moved"))
        try:
            with pytest.raises(StorageError) as moved:
                await _claim(store, rp, "k2")
        finally:
            os.rename(tmp_path.with_name(tmp_path.name + "-moved"), tmp_path)
        assert moved.value.details["sqlite_error"] == "file_replaced"
        assert moved.value.details["outcome_unknown"] is False
        assert await _claim(store, rp, "k2")  # (put back: it goes on, not reopened)
        os.unlink(f"{path}-wal")
        with pytest.raises(StorageError) as wal:
            await _claim(store, rp, "k3")
        assert wal.value.details["sqlite_error"] == "file_replaced"
        assert wal.value.details["outcome_unknown"] is False
    async with open_store(f"sqlite:///{path}") as store:
        keys = [e.metadata.idempotency_key for e in await store.read(0, 100)]
        assert keys == [None, None, "k0", "k1", "k2"]
        assert (await store.audit(history=True)).clean


@pytest.mark.parametrize("fault", ["wal_deleted", "directory_renamed", "locked_past_busy_timeout"])
async def test_an_operators_hand_under_a_burst_loses_and_doubles_nothing(tmp_path: Path, fault: str) -> None:
    """16 tasks run commands and a subscriber follows while an operator deletes the -wal (the
    store refuses every command after, until it is reopened), renames the store's directory
    for a while (refused while it is away, taken again once it is back), or another process
    holds the write lock (``BEGIN EXCLUSIVE``) past ``busy_timeout``: what was acknowledged
    is in the log once reopened, what failed is not, the subscriber saw the log in order, each
    event once, and the audit is clean."""
    directory = tmp_path / "store"
    directory.mkdir()
    path = directory / "s.db"
    ended: dict[str, list[int] | None] = {}
    failures: Counter[tuple[object, object]] = Counter()
    seen: list[int] = []
    stop = asyncio.Event()
    async with open_store(f"sqlite:///{path}", busy_timeout=0.2) as store:
        providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(4)]

        async def client(n: int) -> None:
            for i in range(10**9):
                if stop.is_set():
                    return
                key = f"k{n}.{i}"
                try:
                    ended[key] = await _claim(store, providers[n % 4], key)
                except StorageError as exc:
                    ended[key] = None
                    failures[(exc.details.get("sqlite_error"), exc.details.get("outcome_unknown"))] += 1
                    await asyncio.sleep(0.01)

        async def follow() -> None:
            with pytest.raises(EvstoreError):  # (file_replaced, or the store closed)
                async for event in store.subscribe():
                    seen.append(event.position)

        follower = asyncio.create_task(follow())
        clients = [asyncio.create_task(client(n)) for n in range(16)]
        await asyncio.sleep(0.3)
        if fault == "wal_deleted":
            os.unlink(f"{path}-wal")
            await asyncio.sleep(0.3)
        elif fault == "locked_past_busy_timeout":
            holder = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                "import sqlite3, sys, time; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
                "c.execute('BEGIN EXCLUSIVE'); time.sleep(0.8); c.execute('COMMIT')",
                str(path),
            )
            assert await asyncio.wait_for(holder.wait(), 30) == 0
            await asyncio.sleep(0.3)
        else:
            away = tmp_path / "away"
            directory.rename(away)
            await asyncio.sleep(0.3)
            away.rename(directory)
            await asyncio.sleep(0.3)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 30)
    await asyncio.wait_for(follower, 10)
    assert set(failures) == {("busy" if fault.startswith("locked") else "file_replaced", False)}, failures
    async with open_store(f"sqlite:///{path}") as store:
        events = await store.read(0, 10**6)
        assert [e.position for e in events] == list(range(1, len(events) + 1))
        by_key = {e.metadata.idempotency_key: [e.position] for e in events if e.metadata.idempotency_key}
        for key, positions in ended.items():
            assert by_key.get(key) == positions, key
        assert seen == list(range(1, len(seen) + 1))
        assert (await store.audit(history=True)).clean
