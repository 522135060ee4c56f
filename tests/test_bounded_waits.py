"""What bounds each wait the README names (command_timeout, busy_timeout, a caller's own deadline)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evstore import Inventory, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_postgres import _another_client_holding


@pytest.mark.parametrize("fenced", ["audit", "rebuild"])
async def test_a_fenced_call_given_up_on_behind_a_stuck_client_holds_nothing(
    pg_url: str, fenced: str
) -> None:
    """README: audit and rebuild wait for a client stuck inside a command until it is gone;
    cancelled (asyncio.timeout), they stop waiting and hold nothing: commands go on, and the next
    audit runs as soon as the stuck client is gone."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=Inventory(total=100))
        async with _another_client_holding(pg_url, store, "!fence", shared=True) as (_, tr):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await getattr(store, fenced)()
            assert time.monotonic() - started < 10  # (a wait that did not stop: until the rollback below)
            await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), timeout=10)
            await tr.rollback()
        report = await asyncio.wait_for(store.audit(), timeout=10)
        assert report.clean and report.head == 3


def _holder(path: Path, script: str) -> subprocess.Popen[str]:
    """Another process holding a SQLite lock on ``path`` until it is killed."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sqlite3, time\nc = sqlite3.connect({str(path)!r}, isolation_level=None)\n"
            f"{script}\nprint('held', flush=True)\ntime.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _exclusive_holder(path: Path) -> subprocess.Popen[str]:
    """Another process holding ``path`` exclusively locked after a write (a rollback journal,
    locking_mode=EXCLUSIVE: the lock kept after the write), until it is killed."""
    return _holder(
        path,
        "c.execute('PRAGMA journal_mode=DELETE'); c.execute('PRAGMA locking_mode=EXCLUSIVE')\n"
        "c.execute('CREATE TABLE other (x)')",
    )


async def test_an_open_given_up_on_while_another_process_locks_the_file_returns_at_once(
    tmp_path: Path,
) -> None:
    """Regression: ``asyncio.wait_for(open_store(url), 0.5)`` on a file another process held
    locked returned after busy_timeout (6 s there, 30 s here), not 0.5 s: the cancelled open closed its
    connection by waiting behind the statement still waiting for the lock on its thread."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=Inventory(total=10))
    holder = _holder(path, "c.execute('PRAGMA locking_mode=EXCLUSIVE'); c.execute('BEGIN EXCLUSIVE')")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(open_store(f"sqlite:///{path}?busy_timeout=30"), 0.5)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
    finally:
        holder.kill()
        holder.wait()
    async with open_store(f"sqlite:///{path}") as store:  # (and nothing was left holding the file)
        assert await store.head() == 2


async def test_an_open_refused_by_a_lock_says_busy_as_a_command_does(tmp_path: Path) -> None:
    """Regression: opening a file that another connection was writing to (with a rollback
    journal: SQLite refuses the change to WAL at once) raised a StorageError with empty
    ``details``, where the README promises ``details["sqlite_error"] == "busy"`` for a lock, and
    its message said the lock was held longer than busy_timeout (it failed in milliseconds)."""
    path = tmp_path / "other.db"
    holder = _holder(
        path,
        "c.execute('CREATE TABLE other (x)'); c.execute('BEGIN IMMEDIATE')\n"
        "c.execute('INSERT INTO other VALUES (1)')",
    )
    try:
        with pytest.raises(StorageError) as caught:
            await asyncio.wait_for(open_store(f"sqlite:///{path}?busy_timeout=1"), 30)
    finally:
        holder.kill()
        holder.wait()
    assert caught.value.code == "evstore.storage"
    assert caught.value.details["sqlite_error"] == "busy"
    assert "refused without waiting" in str(caught.value)  # (not "longer than busy_timeout": it did not wait)


@pytest.mark.parametrize("busy_timeout", [0, 0.2])
@pytest.mark.parametrize("options", ["", "&create=false", "&upgrade=false", "&create=false&upgrade=false"])
async def test_an_open_of_a_locked_file_is_refused_after_busy_timeout_not_5_s_per_look(
    tmp_path: Path, busy_timeout: float, options: str
) -> None:
    """Regression: the read-only looks made before an open (is there a store, is it damaged, would
    it be changed: create=False, upgrade=False) each waited sqlite3's default 5 s for a lock,
    whatever busy_timeout said: a store another process held exclusively locked (a rollback
    journal, locking_mode=EXCLUSIVE after a write) was refused after 10 s with busy_timeout=0 or
    0.2 - 11-13 s with 1, 40 s with the default 30. The open's waits share one deadline, derived
    from busy_timeout, and it is refused with the error it got before."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=Inventory(total=10))
    holder = _exclusive_holder(path)
    try:
        started = time.monotonic()
        with pytest.raises(StorageError) as caught:
            await asyncio.wait_for(open_store(f"sqlite:///{path}?busy_timeout={busy_timeout}{options}"), 30)
        took = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    assert caught.value.code == "evstore.storage"
    assert caught.value.details["sqlite_error"] == "busy"
    assert f"longer than busy_timeout ({busy_timeout:g} s)" in str(caught.value)
    assert took < 4.5, took  # (before one look's 5 s: 10 s before the fix; slack for a loaded machine)
    async with open_store(f"sqlite:///{path}", create=False) as store:  # (nothing was changed)
        assert await store.head() == 2


async def test_an_open_given_up_on_during_its_read_only_look_leaves_no_thread_waiting(tmp_path: Path) -> None:
    """The read-only looks before an open wait for a lock until the open's deadline (busy_timeout,
    30 s here), in slices: an open given up on stops its look's thread at the next slice, where
    the thread went on waiting (5 s then, sqlite3's default; the whole busy_timeout now) and an
    ``asyncio.run`` ending waited for it."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=Inventory(total=10))
    holder = _exclusive_holder(path)
    loop = asyncio.get_running_loop()
    looks = concurrent.futures.ThreadPoolExecutor(2)  # (the looks' threads, to wait for below)
    loop.set_default_executor(looks)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(open_store(f"sqlite:///{path}?busy_timeout=30&create=false"), 0.5)
        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1) as other:
            await loop.run_in_executor(other, looks.shutdown)  # (waits for the look's thread)
        assert time.monotonic() - started < 10  # (30 s, busy_timeout, before the fix)
    finally:
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())
        holder.kill()
        holder.wait()


async def test_a_call_waiting_for_a_busy_pool_gives_up_after_connect_timeout(pg_url: str) -> None:
    """Regression: waiting for one of the pool's connections was unbounded, where ``_acquire``'s
    docstring (and connect_timeout) bound it: with pool_size=2 and command_timeout=2, eight reads
    behind a locked table failed at 2, 2, 4, 4, 6, 6, 8 and 8 s - each waited for the calls ahead of
    it - and without command_timeout they would have waited for ever."""
    import asyncpg  # type: ignore[import-untyped,unused-ignore]

    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=Inventory(total=10))
    holder = await asyncpg.connect(pg_url)
    try:
        async with holder.transaction():
            await holder.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            store = await open_store(pg_url, pool_size=2, command_timeout=2, connect_timeout=1)
            started = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(store.head() for _ in range(8)), return_exceptions=True), timeout=30
            )
            took = time.monotonic() - started
    finally:
        await holder.close()
    try:
        assert all(isinstance(r, StorageError) for r in results), results
        # two ran and timed out (command_timeout); the others gave up waiting for a connection
        assert took < 7, took  # (8 s before the fix: the last two waited for six ahead of them)
        pool_waits = [r for r in results if isinstance(r, StorageError) and "came free" in r.message]
        assert len(pool_waits) >= 4, [str(r) for r in results]
        assert "all 2 were busy" in pool_waits[0].message
        assert await store.head() == 2  # (and the store works once the lock is gone)
    finally:
        await store.close()


@pytest.mark.parametrize("holder", ["command", "audit"])
@pytest.mark.parametrize("fenced", ["audit", "rebuild"])
async def test_a_fenced_call_behind_a_stuck_client_fails_after_command_timeout(
    pg_url: str, fenced: str, holder: str
) -> None:
    """Regression: audit and rebuild waited for a client stuck inside a command for as long as it
    stayed, whatever command_timeout said (still waiting after 20 s with command_timeout=2). With
    command_timeout set they fail after it, having done nothing, and say what may hold them: a
    client inside a command (the lock shared) or another process's audit, rebuild or import
    (exclusive; helper-88: the message first named only the former)."""
    async with open_store(pg_url, command_timeout=1) as store:
        rp = await make_provider(store, VCPU=Inventory(total=100))
        shared = holder == "command"
        async with _another_client_holding(pg_url, store, "!fence", shared=shared) as (_, tr):
            started = time.monotonic()
            with pytest.raises(StorageError) as caught:
                await asyncio.wait_for(getattr(store, fenced)(), timeout=20)
            assert 1 <= time.monotonic() - started < 10  # (still waiting at 20 s before the fix)
            assert caught.value.details["sqlstate"] == "55P03"
            assert (
                "command_timeout (1 s)" in caught.value.message and "nothing was done" in caught.value.message
            )
            assert "audit, rebuild or import holds it exclusive" in caught.value.message
            assert "stuck inside a command holds it shared" in caught.value.message
            await tr.rollback()
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        report = await store.audit()
        assert report.clean and report.head == 3


@pytest.mark.parametrize("how", ["delete", "replace", "move"])
async def test_a_database_file_deleted_or_replaced_under_an_open_store_fails_commands(
    tmp_path: Path, how: str
) -> None:
    """Regression (helper-87): with its file deleted, moved or replaced, an open store went on
    acknowledging commands (and audits were clean) - into the file SQLite had opened, which no path
    named any more: reopened, the store had lost them (head 0, or 7 of 9). Now such a command fails,
    nothing committed, and says why; put back, the file takes commands again."""
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=100))
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        if how == "delete":
            for suffix in ("", "-wal", "-shm"):
                Path(f"{path}{suffix}").unlink(missing_ok=True)
        elif how == "replace":
            path.rename(tmp_path / "old.db")
            async with open_store(f"sqlite:///{path}") as other:
                await make_provider(other, VCPU=Inventory(total=1))
        else:
            path.rename(tmp_path / "moved.db")
        with pytest.raises(StorageError) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert caught.value.details["sqlite_error"] == "file_replaced"
        assert str(path) in caught.value.message and "nothing was committed" in caught.value.message
        if how == "move":
            (tmp_path / "moved.db").rename(path)  # (put back: its -wal and -shm are beside it still)
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    if how == "move":
        async with open_store(f"sqlite:///{path}") as reopened:
            assert await reopened.head() == 4 and (await reopened.usage(rp))["VCPU"] == 2


async def test_time_travel_does_not_wait_busy_timeout_to_save_a_snapshot_on_the_way(tmp_path: Path) -> None:
    """Regression (helper-87): state_at and diff save the snapshots they pass, and each save waited
    busy_timeout (30 s by default) while another process held the write lock - the answer, and this
    store's commands queued behind the save on the writer, with it. A save on the way to an answer
    now gives up after ~0.1 s and the answer comes without it; take_snapshots, whose job the saves
    are, still waits busy_timeout and says busy. (busy_timeout is 30 s for the answers, against a
    10 s bound: at 3 s, against 2.5, the margin was one a loaded machine could eat; the store
    that shows take_snapshots waiting and saying busy has 1 s.)"""
    path = tmp_path / "s.db"
    async with (
        open_store(f"sqlite:///{path}", busy_timeout=30, snapshot_every=5) as store,
        open_store(f"sqlite:///{path}", busy_timeout=1, snapshot_every=5) as saver,
    ):
        rp = await make_provider(store, VCPU=Inventory(total=100))
        for _ in range(10):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
        try:
            started = time.monotonic()
            state = await store.state_at(position=12)
            answered = time.monotonic() - started
            assert await state.usage(rp) == {"VCPU": 10}
            started = time.monotonic()
            changes = await store.diff(2, 12)
            assert time.monotonic() - started < 10 and answered < 10, answered
            assert changes.to_position == 12
            assert await store.snapshot_positions() == []  # (none could be saved)
            started = time.monotonic()
            with pytest.raises(StorageError) as caught:
                await saver.take_snapshots()
            assert caught.value.details["sqlite_error"] == "busy"
            assert time.monotonic() - started >= 0.9  # (it waited busy_timeout)
        finally:
            holder.kill()
            holder.wait()
        assert await store.take_snapshots() == [5, 10]


async def test_a_store_opened_by_a_relative_path_takes_commands_after_the_process_changes_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file check above looks at the path the store opened, made absolute at open: SQLite
    keeps the full path, so a later chdir (a daemon's) changes nothing, and must not fail commands."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///relative.db") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        monkeypatch.chdir(tmp_path / "elsewhere")
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.head() == 3
    assert not (tmp_path / "elsewhere" / "relative.db").exists()
