"""A live subscriber whose cursor the log goes back under.

README: a position beyond the head - "a cursor from another store, from before a restore" - is
refused by ``subscribe`` (``evstore.invalid_input``, the head in ``details["head"]``), and on
PostgreSQL with ``synchronous_commit = off`` "events a subscriber has seen, can be lost in a server
crash (a subscriber's cursor is then past the head and refused as such, by ``read`` too: subscribe
again from the head)"; and "``read``, ``subscribe`` and ``history`` never skip or repeat an event".

Regression (stop 42, helper F's finding, fixed by the lead): a subscriber *already following*
when the log went back under its cursor (SQLite: an older backup restored into the live file in
place, as ``sqlite3 cloud.db ".restore backup.db"`` does - same inode, so no ``file_replaced``;
PostgreSQL: the last events lost, as in that crash) was not refused: it waited, and once the new
events' positions passed its cursor it delivered those past it, silently skipping the new events
written at the positions it had already delivered (``read`` of the same cursor was refused
meanwhile, and a new ``subscribe`` too). Now each of its reads takes the event at its cursor too
and checks it is the one it delivered: gone, it is refused as beyond the head; another event there
(the new ones passed it between two polls), refused as ``cursor_rewritten``.
"""

from __future__ import annotations

import asyncio
import sqlite3
import uuid
from pathlib import Path

import pytest

from evstore import AllocationStore, EvstoreError, InvalidInput, open_store
from tests.test_s39_d_storage import _Server, own_server  # noqa: F401 (a fixture)


def _copy(source: Path, target: Path) -> None:
    """SQLite's backup API from ``source`` into ``target`` in place (as ``sqlite3 db ".backup"`` and
    ``".restore"`` do: into a live file, its inode kept)."""
    src, dst = sqlite3.connect(source), sqlite3.connect(target, timeout=10)
    try:
        src.backup(dst)
    finally:
        src.close()
        dst.close()


async def _providers(store: AllocationStore, n: int) -> list[str]:
    names = []
    for _ in range(n):
        name = f"rp-{uuid.uuid4().hex}"
        await store.create_provider(str(uuid.uuid4()), name)
        names.append(name)
    return names


async def _follow(store: AllocationStore, seen: list[tuple[int, str]]) -> None:
    async for event in store.subscribe(0):
        seen.append((event.position, event.data["name"]))


async def _until(condition: object, task: asyncio.Task[None]) -> None:
    async with asyncio.timeout(10):  # (against a hang only)
        while not (task.done() or condition()):  # type: ignore[operator]
            await asyncio.sleep(0.02)


async def test_a_live_subscriber_is_refused_when_an_older_backup_is_restored_into_the_sqlite_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "cloud.db"
    url = f"sqlite:///{path}"
    async with open_store(url, poll_interval=0.05) as store, open_store(url, poll_interval=0.05) as follower:
        await _providers(store, 5)
        backup = tmp_path / "backup.db"
        _copy(path, backup)
        await _providers(store, 5)

        async def restore() -> None:
            # (sqlite3's ".restore": SQLite's backup API writing into the live file, in place)
            _copy(backup, path)

        await _check_never_skips_after(store, follower, restore, already=10)


async def _check_never_skips_after(
    store: AllocationStore, follower: AllocationStore, lose: object, already: int
) -> None:
    """``already`` (10) events delivered to a live subscriber of ``follower``; ``lose()`` takes the
    log back to its first 5; 9 new events (positions 6 to 14). The subscriber must not hand out 11
    to 14 having skipped the new 6 to 10: it is refused, as a new subscription at 10 is."""
    seen: list[tuple[int, str]] = []
    task = asyncio.create_task(_follow(follower, seen))
    try:
        await _until(lambda: len(seen) == already, task)
        assert [p for p, _ in seen] == list(range(1, already + 1))
        await lose()  # type: ignore[operator]
        assert await store.head() == 5
        with pytest.raises(InvalidInput) as refused:  # (a new cursor at 10: refused, as README says)
            await store.read(after=10)
        assert refused.value.details["head"] == 5
        again = await _providers(store, 9)  # positions 6..14
        await _until(lambda: len(seen) >= 14, task)
        after_loss = seen[already:]
        if task.done():
            exc = task.exception()
            assert isinstance(exc, EvstoreError) and exc.code == "evstore.invalid_input", exc
            assert exc.details.get("head", 0) >= 5
            assert after_loss == [], "it delivered events past the loss before being refused"
        else:
            pytest.fail(
                f"the subscriber went on after the log went back under its cursor: it delivered positions "
                f"{[p for p, _ in after_loss]} and skipped the new events at 6..10 "
                f"({[n for p, n in after_loss if n in again[:5]] or 'none of them delivered'})"
            )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_live_postgresql_subscriber_is_refused_when_the_log_loses_its_last_events() -> None:
    import asyncpg

    from tests.pg import fresh_database_url, server_url

    url = fresh_database_url()
    schema = dict(p.split("=", 1) for p in url.split("?", 1)[1].split("&"))["search_path"]
    async with open_store(url, poll_interval=0.05) as store, open_store(url, poll_interval=0.05) as follower:
        await _providers(store, 10)

        async def lose() -> None:
            # (what a crash under synchronous_commit = off does to the log: its last committed events
            # are gone; the providers they created are other names than the new ones')
            conn = await asyncpg.connect(server_url())
            try:
                await conn.execute(f'DELETE FROM "{schema}".events WHERE position > 5')
            finally:
                await conn.close()

        await _check_never_skips_after(store, follower, lose, already=10)


async def test_a_live_postgresql_subscriber_outliving_a_crash_that_lost_asynchronous_commits_is_refused(
    own_server: _Server,  # noqa: F811 (the fixture imported above)
) -> None:
    """README's own case: ``synchronous_commit = off`` (here in the writer's URL), a server crash
    (``pg_ctl stop -m immediate``) loses the last commits, which a subscriber had seen; the
    subscriber outlives the outage (a transient error, retried) and must then be refused, its
    cursor past the head - not skip the events the next commands write at those positions."""
    import asyncpg

    conn = await asyncpg.connect(own_server.url)
    try:  # (the WAL writer flushes asynchronous commits every 10 s: the crash comes before)
        await conn.execute("ALTER SYSTEM SET wal_writer_delay = '10s'")
        await conn.execute("ALTER SYSTEM SET wal_writer_flush_after = '64MB'")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()
    url = own_server.url
    async with open_store(url, connect_timeout=2) as store:
        await _providers(store, 5)  # (flushed: synchronous commits)
    async with open_store(url, poll_interval=0.05, connect_timeout=2) as follower:
        seen: list[tuple[int, str]] = []
        task = asyncio.create_task(_follow(follower, seen))
        try:
            async with open_store(f"{url}?synchronous_commit=off", connect_timeout=2) as fast:
                await _providers(fast, 5)
                await _until(lambda: len(seen) == 10, task)
                proc = await asyncio.create_subprocess_exec(
                    *own_server.as_user,
                    str(own_server.bin / "pg_ctl"),
                    "-D",
                    str(own_server.root / "data"),
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                    stdout=asyncio.subprocess.DEVNULL,
                )
                assert await proc.wait() == 0
            await asyncio.to_thread(own_server.start)
            async with open_store(url, connect_timeout=2) as store:
                head = await store.head()
                if head >= 10:
                    pytest.skip(f"the crash lost no commit this time (head {head}): nothing to check")
                again = await _providers(store, 14 - head)  # positions head+1..14, some at or under 10
                now = {e.position: e.data["name"] for e in await store.read(0, 100)}
                assert [now[p] for p in range(head + 1, 11)] == again[: 10 - head]  # (new events there)
                assert [now[p] for p in range(head + 1, 11)] != [n for _, n in seen[head:10]]
                async with asyncio.timeout(30):  # (the subscriber's retries pause up to 5 s)
                    while not (task.done() or len(seen) >= 14):
                        await asyncio.sleep(0.05)
            if task.done():
                exc = task.exception()
                assert isinstance(exc, EvstoreError) and exc.code == "evstore.invalid_input", exc
                assert seen[10:] == []
            else:
                pytest.fail(
                    f"the subscriber delivered positions {[p for p, _ in seen[10:]]} after the crash, "
                    f"skipping the new events at {head + 1}..10"
                )
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_a_live_subscriber_passed_by_new_events_at_its_positions_says_they_were_rewritten(
    tmp_path: Path,
) -> None:
    """The log goes back under a live subscriber (an older backup restored in place) and new events
    pass its cursor before it looks again (the poller's interval is long): the head is beyond its
    cursor, so only the event at it tells - another than it delivered. Refused, ``cursor_rewritten``,
    with nothing of the new events delivered (stop 42, the lead)."""
    path = tmp_path / "cloud.db"
    url = f"sqlite:///{path}"
    async with open_store(url) as store, open_store(url, poll_interval=3) as follower:
        await _providers(store, 5)
        backup = tmp_path / "backup.db"
        _copy(path, backup)
        await _providers(store, 5)
        seen: list[tuple[int, str]] = []
        task = asyncio.create_task(_follow(follower, seen))
        try:
            await _until(lambda: len(seen) == 10, task)
            await asyncio.sleep(0.1)  # (it waits for the poller now)
            _copy(backup, path)
            await _providers(store, 9)  # positions 6..14, before the poller's next look
            assert await store.head() == 14
            async with asyncio.timeout(10):
                with pytest.raises(InvalidInput) as refused:
                    await task
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert [p for p, _ in seen] == list(range(1, 11))
    assert refused.value.details["reason"] == "cursor_rewritten" and refused.value.details["head"] == 14
    assert "subscribe again" in refused.value.message
