"""SQLite: the writer waits for another process's write lock in short slices, and between them
stops waiting for callers that gave up and for a store that is closing (README, busy_timeout)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evstore import Inventory, StorageError, StoreClosed, open_store
from evstore.store import AllocationStore, make_backend
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_bounded_waits import _holder


def _release(holder: subprocess.Popen[str]) -> None:
    holder.kill()
    holder.wait()


async def _store_with_provider(path: Path) -> str:
    async with open_store(f"sqlite:///{path}") as store:
        return await make_provider(store, VCPU=Inventory(total=1000))


async def test_a_command_given_up_on_while_another_process_holds_the_lock_lets_close_return(
    tmp_path: Path,
) -> None:
    """Regression: a command whose caller gave up (wait_for, 0.3 s) while another process held
    the write lock kept the writer waiting for it until busy_timeout (30 s): close() returned after
    ~30 s. It returns at once now, and the command was not run (nothing written, even once the
    lock is free)."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    store = await open_store(f"sqlite:///{path}", busy_timeout=30)
    holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), 0.3)
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 20)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
    finally:
        _release(holder)
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 2
        assert await store.usage(rp) == {"VCPU": 0}


async def test_a_command_queued_behind_one_given_up_on_commits_once_the_lock_is_free(tmp_path: Path) -> None:
    """Regression: the command behind one whose caller gave up waited for it first; and the one
    given up on was committed once the lock was free, after its caller had been told it timed
    out. Now the abandoned batch is dropped while it waits, and the waiting caller's command
    commits as soon as the other process lets the lock go."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    async with open_store(f"sqlite:///{path}", busy_timeout=30) as store:
        holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), 0.3)
            waiting = asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 2}}))
            await asyncio.sleep(0.5)
            assert not waiting.done()
        finally:
            _release(holder)
        started = time.monotonic()
        await asyncio.wait_for(waiting, 20)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
        assert await store.head() == 3  # (the given-up command was not run)
        assert await store.usage(rp) == {"VCPU": 2}


async def test_in_a_batch_waiting_for_the_lock_only_the_commands_still_waited_for_run(tmp_path: Path) -> None:
    """Regression: a group commit waiting for the lock ran every command it had taken once the
    lock was free, that of a caller that had given up (and been told it timed out) too. A
    command whose caller stops waiting before it begins is not run."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    async with open_store(f"sqlite:///{path}", busy_timeout=30) as store:
        holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
        try:
            given_up = asyncio.ensure_future(
                asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), 0.3)
            )
            waiting = asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 2}}))
            with pytest.raises(TimeoutError):
                await given_up
            await asyncio.sleep(0.3)
        finally:
            _release(holder)
        await asyncio.wait_for(waiting, 20)
        assert await store.head() == 3
        assert await store.usage(rp) == {"VCPU": 2}


async def test_close_during_an_open_waiting_for_the_lock_returns_at_once(tmp_path: Path) -> None:
    """Regression: close() while the store was being opened on a file another process held
    locked waited for the open, which waited busy_timeout (30 s) for the lock."""
    path = tmp_path / "s.db"
    await _store_with_provider(path)
    holder = _holder(path, "c.execute('PRAGMA locking_mode=EXCLUSIVE'); c.execute('BEGIN EXCLUSIVE')")
    try:
        store = AllocationStore(make_backend(f"sqlite:///{path}", busy_timeout=30))
        opening = asyncio.ensure_future(store.open())
        await asyncio.sleep(0.3)
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 20)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
        with pytest.raises(StoreClosed):
            await asyncio.wait_for(opening, 10)
    finally:
        _release(holder)


async def test_closing_answers_the_commands_still_waited_for_and_drops_the_given_up_ones(
    tmp_path: Path,
) -> None:
    """close() answers every queued command whose caller still waits (README: a graceful shutdown
    loses no work to a brief lock held by another process), while the ones given up on are not
    run: at first (helper-90) close() stopped the wait and failed them all with StoreClosed, so
    a shutdown under ordinary two-process contention turned away work it could have done."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    store = await open_store(f"sqlite:///{path}", busy_timeout=30)
    holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
    try:
        waited = [asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 1}})) for _ in range(3)]
        given_up = asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 1}}))
        await asyncio.sleep(0.3)
        given_up.cancel()
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.5)
        assert not closing.done(), "close() gave up on commands whose callers still wait"
    finally:
        _release(holder)
    await asyncio.wait_for(closing, 20)
    await asyncio.wait_for(asyncio.gather(*waited), 10)  # (each committed: no error)
    assert given_up.cancelled()
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 2 + 3


async def test_a_command_still_waited_for_fails_busy_after_busy_timeout_as_before(tmp_path: Path) -> None:
    """The outcome of a command that waited past busy_timeout is unchanged by the slices."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    async with open_store(f"sqlite:///{path}", busy_timeout=1) as store:
        holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
        try:
            started = time.monotonic()
            with pytest.raises(StorageError) as caught:
                await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), 20)
            waited = time.monotonic() - started
        finally:
            _release(holder)
        assert 0.9 < waited < 5, waited
        assert caught.value.details["sqlite_error"] == "busy"
        assert str(caught.value).startswith(
            "The database stayed locked by another connection for longer than busy_timeout (1 s): "
            "database is locked; retry"
        )
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.head() == 3


async def test_a_rebuild_given_up_on_while_the_lock_is_held_stops_waiting(tmp_path: Path) -> None:
    """Regression: a rebuild (or a snapshot save...) cancelled while it waited for another
    process's lock went on waiting on the writer thread until busy_timeout, and the store's
    commands and its close() waited behind it."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    store = await open_store(f"sqlite:///{path}", busy_timeout=30)
    holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.rebuild(), 0.5)
        started = time.monotonic()
        await asyncio.wait_for(store.close(), 20)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
    finally:
        _release(holder)
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.audit()).clean
        assert await store.usage(rp) == {"VCPU": 0}


_CANCELLED_OPEN = """
import asyncio, sys, time
from evstore import open_store

async def main():
    try:
        await asyncio.wait_for(open_store(f"sqlite:///{sys.argv[1]}?busy_timeout=30"), 0.3)
    except TimeoutError:
        print("gave up", flush=True)

started = time.monotonic()
asyncio.run(main())
print(f"returned {time.monotonic() - started:.2f}", flush=True)
"""


async def test_a_cancelled_open_on_a_locked_file_lets_the_program_end(tmp_path: Path) -> None:
    """Regression: the background close of a cancelled open waited behind the open's statement,
    which waited for the lock until busy_timeout (30 s): asyncio.run returned only then."""
    path = tmp_path / "s.db"
    await _store_with_provider(path)
    holder = _holder(path, "c.execute('PRAGMA locking_mode=EXCLUSIVE'); c.execute('BEGIN EXCLUSIVE')")
    try:
        run = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _CANCELLED_OPEN,
            str(path),
            stdout=asyncio.subprocess.PIPE,
            cwd=str(Path(__file__).parent.parent),
        )
        out, _ = await asyncio.wait_for(run.communicate(), 60)
    finally:
        _release(holder)
    assert b"gave up" in out and b"returned" in out, out
    # (asyncio.run's own time, as the program measured it: not the interpreter's start and
    # evstore's import, which took most of 8 s on a loaded machine while asyncio.run took 0.82)
    returned = float(out.split(b"returned ")[1].split()[0])
    assert returned < 10, out  # (30 s, busy_timeout, before the fix)


_TAKING_TURNS = """
import asyncio, sys, uuid
from evstore import open_store

async def main():
    async with open_store(f"sqlite:///{sys.argv[1]}", busy_timeout=20) as store:
        for _ in range(int(sys.argv[3])):
            await store.set_allocations(
                str(uuid.uuid4()), {sys.argv[2]: {"VCPU": 1}}, project_id="p", user_id="u",
                consumer_type="INSTANCE", generation=None,
            )
    print("done", flush=True)

asyncio.run(main())
"""


async def test_two_processes_taking_turns_at_the_lock_both_make_progress(tmp_path: Path) -> None:
    """Waiting in slices does not starve either of two processes writing to one file."""
    path = tmp_path / "s.db"
    rp = await _store_with_provider(path)
    runs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            _TAKING_TURNS,
            str(path),
            rp,
            "150",
            stdout=asyncio.subprocess.PIPE,
            cwd=str(Path(__file__).parent.parent),
        )
        for _ in range(2)
    ]
    outs = await asyncio.wait_for(asyncio.gather(*(r.communicate() for r in runs)), 90)
    assert [r.returncode for r in runs] == [0, 0], outs
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.usage(rp) == {"VCPU": 300}


async def test_a_cancelled_import_stops_waiting_for_the_lock(tmp_path: Path) -> None:
    """Regression (helper-95): an import whose caller gave up while another process held the lock
    went on waiting for it until busy_timeout (its cancellation reaches the writer through the
    import's own stop flag, which the wait did not look at)."""
    source = tmp_path / "a.db"
    await _store_with_provider(source)
    async with open_store(f"sqlite:///{source}") as store:
        lines = [line async for line in store.export()]
    path = tmp_path / "b.db"
    async with open_store(f"sqlite:///{path}"):
        pass
    store = await open_store(f"sqlite:///{path}", busy_timeout=30)
    holder = _holder(path, "c.execute('BEGIN IMMEDIATE')")
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(store.import_events(lambda: lines), 0.5)
        assert time.monotonic() - started < 10  # (busy_timeout: 30 s)
    finally:
        _release(holder)
    await asyncio.wait_for(store.close(), 10)
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 0
