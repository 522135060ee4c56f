"""A full disk under either backend: its own reason (``details["reason"] == "disk_full"``), nothing
committed, and the store goes on once there is room."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest
from structlog.testing import capture_logs

from evstore import AllocationStore, Receipt, StorageError, open_store
from evstore.log import postgres
from evstore.log.sqlite import SqliteBackend
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import chained

#: SQLite's largest max_page_count (the default): "the disk has room again"
ROOM = 4294967294


async def _claim(store: AllocationStore, consumer: str, rp: str) -> Receipt:
    """One VCPU of ``rp`` for a new ``consumer``, keyed by its uuid (safe to retry)."""
    return await store.set_allocations(
        consumer,
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        idempotency_key=consumer,
    )


def _says_disk_full(exc: StorageError) -> None:
    assert exc.code == "evstore.storage"
    assert exc.details["reason"] == "disk_full", exc.details
    assert exc.details["outcome_unknown"] is False, exc.details
    assert "disk" in exc.message and "full" in exc.message, exc.message
    assert "free space" in exc.message, exc.message


async def test_a_command_on_a_full_disk_says_so_commits_nothing_and_the_store_goes_on(tmp_path: Path) -> None:
    """Regression: SQLite's SQLITE_FULL ("database or disk is full") reached the caller as
    ``details["sqlite_error"] == "OperationalError"``, the class name of any SQLite error, with
    nothing said about what was committed or what to do. (The disk is made full here with SQLite's
    max_page_count on the writer's connection: a write past it fails with SQLITE_FULL, as one on
    a full disk does.)"""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        rp = await make_provider(store, VCPU=10**6)
        await backend.tamper("PRAGMA max_page_count = 1")  # (the file's size now: no page more)
        before = await store.head()
        failed = None
        for _ in range(500):  # (until a command needs a page more than the file has)
            consumer = new_uuid()
            try:
                await _claim(store, consumer, rp)
            except StorageError as exc:
                failed = exc
                break
            before = await store.head()
        assert failed is not None, "the disk never filled"
        _says_disk_full(failed)
        assert failed.details["sqlite_error"] == "disk_full"
        assert "nothing of this was written" in failed.message
        # nothing of it is in the store; a batch of commands meanwhile fails whole, the same way
        assert await store.head() == before
        assert not (await store.allocations(consumer)).allocations
        others = [new_uuid() for _ in range(8)]
        results = await asyncio.gather(
            *(allocate(store, c, {rp: {"VCPU": 1}}) for c in others), return_exceptions=True
        )
        for result in results:
            assert isinstance(result, StorageError), result
            _says_disk_full(result)
        assert await store.head() == before
        # room again: the same command, retried, goes through, and so does everything after it
        await backend.tamper(f"PRAGMA max_page_count = {ROOM}")
        await _claim(store, consumer, rp)
        for c in others:
            await allocate(store, c, {rp: {"VCPU": 1}})
        assert await store.head() == before + 1 + len(others)
        assert (await store.audit(history=True)).clean
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        assert (await store.audit(history=True)).clean
        assert (await store.allocations(consumer)).allocations == {rp: {"VCPU": 1}}


_DISK_FULL_TRIGGER = (
    "CREATE FUNCTION s38_disk_full() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN "
    "RAISE EXCEPTION 'could not extend file \"base/16384/16385\": No space left on device' "
    "USING ERRCODE = 'disk_full'; END $f$",
    "CREATE TRIGGER s38_disk_full BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION s38_disk_full()",
)


async def test_a_command_on_a_full_postgresql_disk_says_so_and_was_rolled_back(pg_url: str) -> None:
    """The same on PostgreSQL: the server's ``disk_full`` (SQLSTATE 53100, here raised by a trigger
    where a full disk raises it: writing the command's rows) is a StorageError with
    ``details["reason"] == "disk_full"``, saying to free space, and that it was rolled back; the
    store goes on once there is room. (A COMMIT that cannot write the server's WAL is no answer:
    the server stops, and the command's outcome is unknown - a lost connection at COMMIT.)"""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=100)
        before = await store.head()
        for statement in _DISK_FULL_TRIGGER:
            await store.backend.tamper(statement)  # type: ignore[attr-defined]
        consumer = new_uuid()
        with pytest.raises(StorageError) as caught:
            await _claim(store, consumer, rp)
        _says_disk_full(caught.value)
        assert caught.value.details["sqlstate"] == "53100"
        assert "it was rolled back" in caught.value.message
        assert await store.head() == before
        await store.backend.tamper("DROP TRIGGER s38_disk_full ON events")  # type: ignore[attr-defined]
        await _claim(store, consumer, rp)
        assert await store.head() == before + 1
        assert (await store.audit()).clean


def test_a_full_postgresql_disk_met_by_a_read_says_so_without_a_claim_about_commits() -> None:
    """A read (a sort's temporary file) that meets a full disk: the same reason, nothing said
    about a transaction it did not have."""
    failed = postgres._storage_error(
        asyncpg.exceptions.DiskFullError('could not write to file "base/pgsql_tmp/pgsql_tmp1.0"'),
        "reading events",
        None,
    )
    assert failed.details == {"sqlstate": "53100", "reason": "disk_full"}
    assert "disk is full" in failed.message and "rolled back" not in failed.message


async def test_a_batch_failing_at_its_end_is_not_taken_for_a_log_that_lost_events(tmp_path: Path) -> None:
    """Regression (seen on a real full disk, a 512 KiB tmpfs, where SQLite refused the batch's
    COMMIT): the writer remembered the last event of a batch that then failed as the tip of the
    events it appended, so its next transaction, not finding it in the log, warned
    ``history_index.own_keys_lost`` - the log lost events - where nothing was lost. (The failure
    is injected here at the projection's write-back, after the history keys were taken, as at a
    COMMIT.)"""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        rp = await make_provider(store, VCPU=100)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await backend.tamper(
            "CREATE TRIGGER s38_fail BEFORE INSERT ON p_consumers BEGIN SELECT RAISE(ABORT, 'injected'); END"
        )
        with pytest.raises(StorageError, match="injected"):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await backend.tamper("DROP TRIGGER s38_fail")
        with capture_logs() as logs:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert [e for e in logs if e["event"] == "history_index.own_keys_lost"] == []
        assert await store.head() == 4
        assert (await store.audit(history=True)).clean


async def test_a_failed_batch_does_not_vouch_for_the_keys_of_events_a_restore_replaced(
    tmp_path: Path,
) -> None:
    """Regression (review of the fix above): a batch that failed set the writer's tip to the log's
    last event before it - an event this writer may not have appended. After a restore that
    replaced the writer's last events under it (positions 3-4 gone, another event at 3), that tip
    was found in the log, so the kept history keys of the vanished events were trusted: the next
    index write filed position 3 (a class created) under consumer A, whose allocation the
    restore dropped - ``history(A)`` listed it and the audit found the index wrong. The tip is
    what it was before the failed batch: the lost events are noticed (``own_keys_lost``) and
    their keys forgotten."""
    a = new_uuid()
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        rp = await make_provider(store, VCPU=100)  # 1, 2
        await allocate(store, a, {rp: {"VCPU": 1}})  # 3
        # (an event of a provider only: one that changed a consumer, whose row records its
        # position, would be seen lost past the head, and commands refused: s40 D)
        await store.rename_provider(rp, "renamed")  # 4
        [second] = await backend.read_raw(1, 1)
        other = chained(second, "ResourceClassCreated", {"name": "CUSTOM_X"})
        await backend.tamper("DELETE FROM events WHERE position >= 3")
        await backend.tamper("INSERT INTO events VALUES (?,?,?,?,?,?,?,?)", tuple(other))
        await backend.tamper(
            "CREATE TRIGGER s38_fail BEFORE INSERT ON events BEGIN SELECT RAISE(ABORT, 'injected'); END"
        )
        with pytest.raises(StorageError, match="injected"):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await backend.tamper("DROP TRIGGER s38_fail")
        with capture_logs() as logs:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # 4
        assert [e["position"] for e in logs if e["event"] == "history_index.own_keys_lost"] == [4]
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        assert [(e.position, e.type) async for e in store.history(a)] == []
        assert not [f for f in (await store.audit(history=True)).findings if "index" in f.message]
