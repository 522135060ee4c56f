"""Stop 44, helper A: asyncpg's errors injected at each of the PostgreSQL backend's call sites
(the pool's acquire and its connections' set-up, a command's statements, reads, subscribers),
deterministically by monkeypatching: every call fails as a typed evstore error that says what
happened - a command's whether it may have committed, a read's that the connection was lost
(``transient``) - and the store goes on."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import asyncpg
import pytest

import evstore.log.postgres as pg
from evstore import AllocationStore, CapacityExceeded, ConsumerDeleted, StorageError, open_store
from tests.conftest import make_provider, new_uuid

BODY: dict[str, Any] = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}


def _fail_set_up(monkeypatch: pytest.MonkeyPatch, error: Callable[[], BaseException]) -> dict[str, int]:
    """The pool's next ``left`` new connections fail their set-up with ``error()`` (as asyncpg
    raises it when the server ended the connection before its set-up statement ran)."""
    set_up = pg._init_connection
    failing = {"left": 0}

    async def init(conn: object, search_path: str | None = None) -> str | None:
        if failing["left"]:
            failing["left"] -= 1
            raise error()
        return await set_up(conn, search_path)

    monkeypatch.setattr(pg, "_init_connection", init)
    return failing


async def _count_events(backend: pg.PostgresBackend) -> int:
    async with backend._connection() as conn:
        return int(await conn.fetchval("SELECT count(*) FROM events"))


def _backend(store: AllocationStore) -> pg.PostgresBackend:
    backend = store.backend
    assert isinstance(backend, pg.PostgresBackend) and backend._pool is not None
    return backend


async def test_a_new_connection_closed_at_its_set_up_is_a_lost_connection_not_a_closed_store(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the sibling of the lead's InternalClientError. When asyncpg has already seen a
    new connection go (the server ended it, the network cut it) before the pool's set-up
    statement ran, that statement raises ``InterfaceError("connection is closed")``; the backend
    took every InterfaceError from the acquire whose text held "clos" for the pool's "pool is
    closed": a keyed command was told ``StoreClosed`` ("The store is closed", no
    ``outcome_unknown``), a read too, and a subscriber - which rides out a lost connection -
    ended for good, though the store was open. Now: a lost connection, transient; the command
    was not run (``outcome_unknown`` False, and nothing of it was written); the subscriber goes
    on; the store too. (``min_pool_size=0``: the pool restores no floor of connections in the
    background after the lost one - whose set-up could meet the failure meant for a call.)"""
    async with open_store(pg_url, min_pool_size=0) as store:
        backend = _backend(store)
        rp = await make_provider(store, VCPU=8)
        failing = _fail_set_up(monkeypatch, lambda: asyncpg.InterfaceError("connection is closed"))
        consumer = new_uuid()
        head = await store.head()

        failing["left"] = 1
        await backend._pool.expire_connections()  # type: ignore[union-attr] # (the next acquire opens one)
        with pytest.raises(StorageError) as failed:
            await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert failed.value.code == "evstore.storage"
        assert failed.value.details["outcome_unknown"] is False
        assert failed.value.details["transient"] is True
        assert "Lost the connection to PostgreSQL" in failed.value.message
        assert "the command was not run" in failed.value.message
        assert failing["left"] == 0 and await store.head() == head

        failing["left"] = 2  # (a read tries a second new connection: stop 45 A)
        await backend._pool.expire_connections()  # type: ignore[union-attr]
        with pytest.raises(StorageError) as read_failed:
            await store.usage(rp)
        assert read_failed.value.details["transient"] is True
        assert "Lost the connection to PostgreSQL" in read_failed.value.message

        # a subscriber following the store rides it out (a retry after ~0.25 s)
        failing["left"] = 1
        await backend._pool.expire_connections()  # type: ignore[union-attr]

        async def first_two() -> list[int]:
            got: list[int] = []
            async for event in store.subscribe(after=0):
                got.append(event.position)
                if len(got) == 2:
                    break
            return got

        assert await asyncio.wait_for(first_two(), 10) == [1, 2]
        assert failing["left"] == 0

        await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_connection_lost_as_the_store_closes_does_not_fail_the_close(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: the pool's close closes each connection gracefully; one the server ended at
    that moment fails with asyncpg's ``ConnectionDoesNotExistError`` ("connection was closed in
    the middle of operation", a PostgresError), which the backend's close did not catch: the
    caller's ``close()`` (and so ``async with open_store(...)``'s exit) raised it bare. A store
    closes all the same (asyncpg terminated the pool): close() returns, the store is closed,
    and the next open works."""
    real_close = asyncpg.connection.Connection.close
    lost = {"left": 1}

    async def close(self: asyncpg.connection.Connection, *, timeout: float | None = None) -> None:
        if lost["left"]:
            lost["left"] -= 1
            self.terminate()
            raise asyncpg.exceptions.ConnectionDoesNotExistError(
                "connection was closed in the middle of operation"
            )
        await real_close(self, timeout=timeout)

    store = await open_store(pg_url)
    rp = await make_provider(store, VCPU=8)
    monkeypatch.setattr(asyncpg.connection.Connection, "close", close)
    await store.close()
    assert lost["left"] == 0
    monkeypatch.undo()
    async with open_store(pg_url) as again:
        assert (await again.usage(rp)).usages == {"VCPU": 0}
        assert (await again.audit()).clean


@pytest.mark.parametrize("keyed", [True, False])
async def test_a_command_whose_every_connection_is_lost_at_its_begin_says_it_was_not_run(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, keyed: bool
) -> None:
    """Regression: a command whose connection is found dead at its BEGIN (nothing of it sent)
    is tried again on another, up to ``max_retries`` times; when every one was lost so (the
    server ending each session as it is handed out: a restart under way, an admin's
    pg_terminate_backend loop), the command failed "Cannot get a working connection to URL" -
    without ``outcome_unknown`` (a caller could not tell whether to look at the store first),
    without ``transient`` (a lost connection is, on commands too) and without the cause. It
    says now that it was not run, why, and that the connection was lost; nothing was written,
    and once the connections hold the same command goes through."""
    import asyncpg.transaction

    async with open_store(pg_url, max_retries=3) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
        real_start = asyncpg.transaction.Transaction.start
        lost = {"count": 0}

        async def start(self: Any) -> None:
            lost["count"] += 1
            self._connection.terminate()
            raise asyncpg.InternalClientError(
                "cannot switch to state 15; another operation (2) is in progress"
            )

        monkeypatch.setattr(asyncpg.transaction.Transaction, "start", start)
        consumer = new_uuid()
        key = "k-1" if keyed else None
        with pytest.raises(StorageError) as failed:
            await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key=key, **BODY)
        assert lost["count"] == 3
        assert failed.value.details["outcome_unknown"] is False
        assert failed.value.details["transient"] is True
        assert "the command was not run" in failed.value.message
        assert "another operation (2) is in progress" in failed.value.message
        assert "Lost the connection to PostgreSQL" in failed.value.message
        monkeypatch.setattr(asyncpg.transaction.Transaction, "start", real_start)
        assert await store.head() == head
        assert not (await store.allocations(consumer))
        await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key=key, **BODY)
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_command_that_keeps_deadlocking_says_it_was_not_run(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a command the server keeps rolling back as a deadlock's victim (or for a
    serialization failure) is tried ``max_retries`` times, then failed "Gave up after N
    attempts: deadlock detected" without ``outcome_unknown``: each try was rolled back by the
    server's answer, so the command was not run - said now (False), with what to do; nothing
    was written, and the same command goes through afterwards."""
    async with open_store(pg_url, max_retries=3) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
        real_fetch = asyncpg.connection.Connection.fetch
        victims = {"count": 0}

        async def fetch(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            if "evstore_lock_load" in query:
                victims["count"] += 1
                await real_fetch(self, query, *args, **kwargs)  # (its locks taken: then the victim)
                raise asyncpg.exceptions.DeadlockDetectedError("deadlock detected")
            return await real_fetch(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "fetch", fetch)
        consumer = new_uuid()
        with pytest.raises(StorageError) as failed:
            await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert victims["count"] == 3
        assert failed.value.details["outcome_unknown"] is False
        assert failed.value.details["sqlstate"] == "40P01"
        assert "deadlock detected" in failed.value.message
        assert "the command was not run" in failed.value.message
        monkeypatch.undo()
        assert await store.head() == head
        await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_command_that_meets_a_tombstone_to_position_and_loses_the_connection_says_not_run(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a command that finds a consumer's tombstone committed but not positioned yet
    (its writer died between its COMMIT and the sequencer) rolls back, positions it on another
    connection, and tries again; a connection lost there reached the caller as the read's error
    ("Lost the connection ... while reading events", no ``outcome_unknown``): a command's
    storage error that did not say whether it committed. It was rolled back before: it says
    so now (``outcome_unknown`` False, not run), and the same command goes on afterwards."""
    async with open_store(pg_url) as store:
        backend = _backend(store)
        rp = await make_provider(store, VCPU=8)
        deleted = new_uuid()
        await store.set_allocations(deleted, {rp: {"VCPU": 1}}, **BODY)

        async def died(conn: Any) -> None:
            raise RuntimeError("the process died between its commit and the sequencing")

        backend._after_commit = died
        with pytest.raises(StorageError):
            await store.delete_consumer(deleted)
        backend._after_commit = None
        events = await _count_events(backend)  # (not head(): it positions what it finds)

        real_fetch = asyncpg.connection.Connection.fetch
        lost = {"left": 1}

        async def fetch(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            if lost["left"] and query.startswith("SELECT seq FROM events WHERE seq = ANY"):
                lost["left"] -= 1
                self.terminate()
                raise ConnectionResetError(104, "Connection reset by peer")
            return await real_fetch(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "fetch", fetch)
        with pytest.raises(StorageError) as failed:
            await store.set_allocations(deleted, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert lost["left"] == 0
        assert failed.value.details["outcome_unknown"] is False
        assert failed.value.details["transient"] is True
        assert "Connection reset by peer" in failed.value.message
        assert "the command was not run" in failed.value.message
        monkeypatch.undo()
        assert await _count_events(backend) == events
        with pytest.raises(ConsumerDeleted):
            await store.set_allocations(deleted, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert (await store.usage(rp)).usages["VCPU"] == 0
        assert (await store.audit()).clean


@pytest.mark.parametrize(
    "lost",
    [
        lambda: asyncpg.InternalClientError(
            "cannot switch to state 15; another operation (2) is in progress"
        ),
        lambda: asyncpg.InterfaceError("connection is closed"),
        lambda: ConnectionResetError(104, "Connection reset by peer"),
        lambda: TimeoutError(),
    ],
    ids=["internal", "interface", "reset", "timeout"],
)
async def test_a_refused_command_whose_rollback_loses_the_connection_is_refused(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, lost: Callable[[], BaseException]
) -> None:
    """Regression: a command decided against its locked slice and refused (here: more than the
    provider's capacity) is rolled back; when the connection was lost at that ROLLBACK, the
    caller was told "Lost the connection to PostgreSQL while running a command ... it was
    rolled back" (transient: try again) instead of the refusal - which the same call then met,
    or, once the store changed, not. Nothing of it was written either way (the server rolls
    back a lost session's transaction): the refusal stands, and is what the caller hears; the
    store goes on."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        head = await store.head()
        real_execute = asyncpg.connection.Connection.execute
        left = {"count": 1}

        async def execute(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            if left["count"] and query.strip().upper().startswith("ROLLBACK"):
                left["count"] -= 1
                self.terminate()
                raise lost()
            return await real_execute(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "execute", execute)
        with pytest.raises(CapacityExceeded):
            await store.set_allocations(new_uuid(), {rp: {"VCPU": 100}}, idempotency_key="k-1", **BODY)
        assert left["count"] == 0
        monkeypatch.undo()
        assert await store.head() == head
        await store.set_allocations(new_uuid(), {rp: {"VCPU": 4}}, idempotency_key="k-2", **BODY)
        assert (await store.usage(rp)).usages["VCPU"] == 4
        assert (await store.audit()).clean


async def test_a_command_restarted_for_a_tombstone_whose_rollback_is_lost_restarts(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that finds a deleted consumer's tombstone not positioned yet rolls back to
    position it and starts again; when the connection was lost at that ROLLBACK, the command
    failed as a lost connection ("it was rolled back", transient) instead of starting again as
    it would have. It starts again now (on another connection) and is decided: here refused,
    the consumer being deleted."""
    async with open_store(pg_url) as store:
        backend = _backend(store)
        rp = await make_provider(store, VCPU=8)
        deleted = new_uuid()
        await store.set_allocations(deleted, {rp: {"VCPU": 1}}, **BODY)

        async def died(conn: Any) -> None:
            raise RuntimeError("the process died between its commit and the sequencing")

        backend._after_commit = died
        with pytest.raises(StorageError):
            await store.delete_consumer(deleted)
        backend._after_commit = None
        events = await _count_events(backend)

        real_execute = asyncpg.connection.Connection.execute
        lost = {"left": 1}

        async def execute(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
            if lost["left"] and query.strip().upper().startswith("ROLLBACK"):
                lost["left"] -= 1
                self.terminate()
                raise asyncpg.InternalClientError(
                    "cannot switch to state 15; another operation (2) is in progress"
                )
            return await real_execute(self, query, *args, **kwargs)

        monkeypatch.setattr(asyncpg.connection.Connection, "execute", execute)
        with pytest.raises(ConsumerDeleted):
            await store.set_allocations(deleted, {rp: {"VCPU": 2}}, idempotency_key="k-1", **BODY)
        assert lost["left"] == 0
        monkeypatch.undo()
        assert await _count_events(backend) == events
        assert (await store.usage(rp)).usages["VCPU"] == 0
        assert (await store.audit()).clean


@pytest.mark.parametrize(
    "lost",
    [
        lambda: asyncpg.InterfaceError("connection is closed"),
        lambda: asyncpg.exceptions.ConnectionDoesNotExistError(
            "connection was closed in the middle of operation"
        ),
    ],
    ids=["interface", "does_not_exist"],
)
async def test_an_open_whose_first_connection_is_closed_at_its_set_up_says_what_happened(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, lost: Callable[[], BaseException]
) -> None:
    """The lead's open whose first connection the server ended at its set-up, when asyncpg had
    seen it go already: its set-up statement raises ``InterfaceError("connection is closed")``
    (or ``ConnectionDoesNotExistError`` when it went during it), and the open said only "Cannot
    connect to PostgreSQL at URL: connection is closed" - nothing a person can act on. It says
    what its InternalClientError sibling says: the session ended as it was set up, by the
    server or the network; try again. The next open works."""
    failing = _fail_set_up(monkeypatch, lost)
    failing["left"] = 1
    with pytest.raises(StorageError) as failed:
        async with open_store(pg_url):
            pass
    assert failing["left"] == 0
    assert failed.value.message.startswith("Cannot connect to PostgreSQL at ")
    assert "the session ended as it was set up" in failed.value.message
    assert "try again" in failed.value.message
    assert "closed" in failed.value.message  # (asyncpg's words, kept)
    async with open_store(pg_url) as store:
        assert await store.head() == 0
