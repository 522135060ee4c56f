"""Subscribers outlive an outage of the database that passes: a PostgreSQL restart, a failover, a
pooled connection reset. A read of the log or of the head that fails for a reason that may pass
(``details["transient"]``: a connection lost, refused or timed out) is tried again with growing
pauses, for up to ``_OUTAGE_RETRY_FOR`` seconds of failures; only a failure that lasts longer,
or another kind (a damaged row, a permission refused, a closed store), ends the subscribers.

Before stop 33 one failed read of the head ended every waiting subscriber of the store, and one
failed read of a page the subscriber reading it: a service following the log with
``async for event in store.subscribe(...)`` died at a server restart, though the next poll would
have succeeded.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest
import structlog

import evstore.store
from evstore import AllocationStore, StorageError, open_store
from evstore.events import RecordedEvent
from evstore.log.postgres import _storage_error
from tests.conftest import allocate, make_provider, new_uuid

GUARD = 60.0  # a hang guard, not a timing assertion: a wait that never ends fails the test here
POLLER = "evstore-subscribers-poller"


class _Restartable:
    """A TCP relay in front of the server that can go down as a restarting server does: the
    connections it relays are reset, new ones refused, until it is up again (on the same port)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            pytest.skip("the server's URL names no TCP host and port to relay")
        self._upstream = (parts.hostname, parts.port)
        self._parts = parts
        self._server: asyncio.Server | None = None
        self._port = 0
        self._relayed: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", self._port)
        self._port = self._server.sockets[0].getsockname()[1]

    def down(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._relayed):
            writer.transport.abort()  # (a reset, as a server killed by a restart leaves)
        self._relayed.clear()

    @property
    def url(self) -> str:
        netloc = self._parts.netloc.rsplit("@", 1)
        netloc[-1] = f"127.0.0.1:{self._port}"
        return urlunsplit(self._parts._replace(netloc="@".join(netloc)))

    async def __aenter__(self) -> _Restartable:
        await self.up()
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.down()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            self._relayed.update((writer, up_writer))
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.transport.abort()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            self._relayed.discard(writer)
            writer.transport.abort()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(GUARD):
        while not condition():
            await asyncio.sleep(0.01)


def pollers() -> list[asyncio.Task[Any]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == POLLER and not t.done()]


class Followers:
    """``n`` subscribers of ``store`` from ``after``, each recording the positions it got."""

    def __init__(self, store: AllocationStore, n: int, after: int, batch_size: int = 500) -> None:
        self.seen: list[list[int]] = [[] for _ in range(n)]
        self.tasks = [asyncio.create_task(self._follow(store, got, after, batch_size)) for got in self.seen]

    @staticmethod
    async def _follow(store: AllocationStore, got: list[int], after: int, batch_size: int) -> None:
        async for e in store.subscribe(after=after, batch_size=batch_size):
            got.append(e.position)

    def failures(self) -> list[BaseException | None]:
        return [t.exception() if t.done() and not t.cancelled() else None for t in self.tasks]

    async def stop(self) -> list[BaseException | None]:
        for t in self.tasks:
            t.cancel()
        async with asyncio.timeout(GUARD):
            await asyncio.wait(self.tasks)
        return [None if t.cancelled() else t.exception() for t in self.tasks]


@pytest.fixture
async def relay(pg_url: str) -> AsyncIterator[_Restartable]:
    async with _Restartable(pg_url) as relayed:
        yield relayed


async def test_subscribers_outlive_a_server_restart_and_get_every_event_once(
    pg_url: str, relay: _Restartable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (stop 33): the server restarts (every connection reset, new ones refused for a
    while) under idle subscribers and under one catching up; commits go on meanwhile through
    another client. Every subscriber ends with every event once, in order, none ended by the
    restart; the retries are logged as warnings with their attempt."""
    async with open_store(pg_url) as writer, open_store(relay.url, poll_interval=0.05) as store:
        rp = await make_provider(writer, VCPU=1000)
        for _ in range(30):
            await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
        start = await store.head()
        idle = Followers(store, 5, start)
        await until(lambda: len(store._idle) == 5)
        # a subscriber catching up from the start, in pages of 4, whose read of its third page
        # meets the restart (a real refused connection: the relay is down when it connects)
        read = store.backend.read
        reads = 0

        async def read_into_the_restart(after: int, limit: int) -> list[RecordedEvent]:
            nonlocal reads
            reads += 1
            if reads == 3:
                relay.down()
            return await read(after, limit)

        with structlog.testing.capture_logs() as logs:
            monkeypatch.setattr(store.backend, "read", read_into_the_restart)
            catching_up = Followers(store, 1, 0, batch_size=4)
            await until(lambda: reads >= 3)
            for _ in range(5):  # committed while the server is away for this store
                await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
            await asyncio.sleep(1.0)
            assert idle.failures() == [None] * 5 and catching_up.failures() == [None]
            await relay.up()
            for _ in range(5):
                await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
            head = await writer.head()
            everything = list(range(1, head + 1))
            await until(
                lambda: (
                    (all(got == everything[start:] for got in idle.seen) and catching_up.seen == [everything])
                    or any(idle.failures() + catching_up.failures())
                )
            )
        assert idle.failures() == [None] * 5 and catching_up.failures() == [None]
        assert idle.seen == [everything[start:]] * 5 and catching_up.seen == [everything]
        retries = [e for e in logs if e["event"] in ("subscribe.read_retry", "subscribe.poll_retry")]
        assert {e["event"] for e in retries} == {"subscribe.read_retry", "subscribe.poll_retry"}, logs
        assert all(e["log_level"] == "warning" and e["attempt"] >= 1 for e in retries)
        await idle.stop()
        await catching_up.stop()


async def test_an_outage_that_lasts_ends_the_subscribers_with_a_transient_storage_error(
    pg_url: str, relay: _Restartable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server stays away longer than subscribers retry for: each ends with the failure
    (``evstore.storage``, ``transient``: what to subscribe again after), and the poller ends."""
    monkeypatch.setattr(evstore.store, "_OUTAGE_RETRY_FOR", 0.5, raising=False)
    async with open_store(relay.url, poll_interval=0.05) as store:
        await make_provider(store, VCPU=8)
        head = await store.head()
        followers = Followers(store, 4, head)
        await until(lambda: len(store._idle) == 4)
        relay.down()
        await until(lambda: all(t.done() for t in followers.tasks))
        errors = followers.failures()
        assert all(isinstance(e, StorageError) for e in errors), errors
        assert all(e.details.get("transient") is True for e in errors if isinstance(e, StorageError))
        assert all("Lost the connection to PostgreSQL" in str(e) for e in errors), errors
        assert not pollers()
        await relay.up()  # back: the store serves again, a new subscriber follows
        again = Followers(store, 1, 0)
        await until(lambda: again.seen == [list(range(1, head + 1))])
        await again.stop()


@pytest.mark.parametrize("where", ["head", "read"])
async def test_a_transient_failure_is_retried_and_another_ends_the_subscribers_at_once(
    store_url: str, where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On either backend (the failures made by hand: SQLite has no transient failure of its
    own), a StorageError marked ``transient`` of the poller's read of the head, or of a
    subscriber's read, is tried again and the subscribers see every event; one not marked ends
    them at once, as before (tests/test_idle_subscribers.py, test_live_subscribers.py)."""
    async with open_store(store_url, poll_interval=0.05) as store, open_store(store_url) as other:
        rp = await make_provider(other, VCPU=100)
        start = await store.head()
        followers = Followers(store, 3, start)
        await until(lambda: len(store._idle) == 3)
        real = getattr(store.backend, where)
        failures = 0

        async def failing(*args: Any) -> Any:
            nonlocal failures
            if failures < 3:
                failures += 1
                raise StorageError("Lost the connection: reset by peer", sqlstate=None, transient=True)
            return await real(*args)

        monkeypatch.setattr(store.backend, where, failing)
        await allocate(other, new_uuid(), {rp: {"VCPU": 1}})
        if where == "read":
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # (wakes them: they read)
        await until(
            lambda: (
                all(len(got) == 2 - (where == "head") for got in followers.seen) or any(followers.failures())
            )
        )
        assert failures == 3 and followers.failures() == [None] * 3

        async def refused(*args: Any) -> Any:
            raise StorageError("PostgreSQL error while reading: permission denied", sqlstate="42501")

        monkeypatch.setattr(store.backend, where, refused)
        await allocate(store if where == "read" else other, new_uuid(), {rp: {"VCPU": 1}})
        async with asyncio.timeout(GUARD):
            await asyncio.wait(followers.tasks)
        errors = followers.failures()
        assert {getattr(e, "details", {}).get("sqlstate") for e in errors} == {"42501"}, errors


def test_a_lost_connection_is_transient_and_an_answer_of_the_server_is_not() -> None:
    """What the subscribers retry: PostgreSQL's connection lost, refused or timed out, the server
    shutting down or full - not an error the server answered with (a permission, a missing table,
    a statement_timeout), which the same read would meet again."""
    transient = [
        ConnectionRefusedError(111, "Connect call failed"),
        ConnectionResetError(104, "reset by peer"),
        TimeoutError(),
        FileNotFoundError(2, "No such file or directory"),  # (a Unix socket: its server stopped)
        socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"),
        socket.gaierror(socket.EAI_NONAME, "Name or service not known"),  # (a DNS failover)
        asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
        asyncpg.exceptions.CannotConnectNowError("the database system is starting up"),
        asyncpg.exceptions.TooManyConnectionsError("sorry, too many clients already"),
    ]
    answered = [
        asyncpg.exceptions.InsufficientPrivilegeError("permission denied for table events"),
        asyncpg.exceptions.UndefinedTableError('relation "events" does not exist'),
        asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
        asyncpg.exceptions.InvalidPasswordError("password authentication failed"),
        asyncpg.exceptions.InvalidCatalogNameError('database "evstore" does not exist'),
    ]
    # (connects refused for good, until a person changes something: not retried - helper s36_P)
    lasting = [
        PermissionError(13, "Permission denied"),
        ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate"),
    ]
    for committing in (None, False, True):
        for exc in transient:
            assert _storage_error(exc, "reading", committing).details["transient"] is True, exc
        for exc in answered + (lasting if committing is not True else []):  # (True: no connect's)
            assert "transient" not in _storage_error(exc, "reading", committing).details, exc
    for exc in lasting:
        failed = _storage_error(exc, f"connecting to {exc!r}", None)
        assert failed.message.startswith("Cannot connect to PostgreSQL") and "does not pass" in failed.message


async def test_a_connect_refused_for_good_ends_the_subscribers_at_once(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper s36_P): every OSError of a connect was transient, so a subscriber whose
    pool's next connection was refused for good - PermissionError (a Unix socket's permissions,
    a firewall's EPERM) - was retried with warnings for 30 s before it ended, as after a server
    restart. It now ends at once, with an error that says it will not pass by itself."""
    async with open_store(pg_url, poll_interval=0.05) as store:
        rp = await make_provider(store, VCPU=100)
        followers = Followers(store, 2, await store.head())
        await until(lambda: len(store._idle) == 2)
        backend = store.backend
        await backend._pool.expire_connections()  # type: ignore[attr-defined]

        async def refused(pool: Any) -> Any:
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(backend, "_acquire", refused)
        with structlog.testing.capture_logs() as logs:  # (the poller's next read of the head fails)
            async with asyncio.timeout(GUARD):
                await asyncio.wait(followers.tasks)
        errors = followers.failures()
        assert all(isinstance(e, StorageError) and "transient" not in e.details for e in errors), errors
        assert all("does not pass by itself" in str(e) for e in errors), errors
        assert not [e for e in logs if e["event"].endswith("_retry")], logs
        with pytest.raises(StorageError, match="does not pass by itself"):  # (a command: not run)
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})


async def test_a_subscriber_resumed_during_an_outage_waits_for_it_too(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review 33, helper-R): ``subscribe(after=N)`` first reads the head (to refuse an
    ``after`` beyond it), and that read was not retried: a transient failure ended the subscriber
    at its first iteration - the very subscriber the README says to start, ``after=`` the last
    position delivered, once an outage that lasted ended the previous one."""
    async with open_store(store_url, poll_interval=0.05) as store:
        rp = await make_provider(store, VCPU=100)
        start = await store.head()
        real = store.backend.head
        failures = 0

        async def failing() -> int:
            nonlocal failures
            if failures < 2:
                failures += 1
                raise StorageError("Lost the connection: refused", sqlstate=None, transient=True)
            return await real()

        monkeypatch.setattr(store.backend, "head", failing)
        with structlog.testing.capture_logs() as logs:
            followers = Followers(store, 1, start)
            await until(lambda: failures == 2 or any(followers.failures()))
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
            await until(lambda: followers.seen == [[start + 1]] or any(followers.failures()))
        assert followers.failures() == [None] and followers.seen == [[start + 1]]
        assert any(e["event"] == "subscribe.read_retry" for e in logs), logs
        # an after beyond the head is still refused at the first iteration, once the head is read
        with pytest.raises(evstore.InvalidInput, match="beyond the head"):
            async for _ in store.subscribe(after=start + 5):
                pass
        await followers.stop()


@pytest.mark.parametrize("how", ["deleted", "replaced"])
async def test_a_sqlite_subscriber_of_a_file_deleted_or_replaced_ends_with_file_replaced(
    tmp_path: Path, how: str
) -> None:
    """Regression (helper s36_P): a SQLite store whose file was deleted (or replaced) under it
    refuses every commit (file_replaced), so no append can come to the file it opened; its
    subscribers read the old file's head at each poll and waited for ever, saying nothing. The
    poller now checks the path first, and they end with that error (not transient: it does not
    pass by itself - the file put back, or the store opened again)."""
    db = tmp_path / "s.db"
    async with open_store(f"sqlite:///{db}", poll_interval=0.05) as store:
        rp = await make_provider(store, VCPU=100)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        followers = Followers(store, 2, 0)
        await until(lambda: len(store._idle) == 2)
        db.rename(tmp_path / "moved.db")
        if how == "replaced":
            async with open_store(f"sqlite:///{db}") as other:  # (a new store at the same path)
                await make_provider(other, VCPU=1)
        with structlog.testing.capture_logs() as logs:
            async with asyncio.timeout(GUARD):
                await asyncio.wait(followers.tasks)
        errors = followers.failures()
        assert all(
            isinstance(e, StorageError) and e.details["sqlite_error"] == "file_replaced" for e in errors
        )
        assert all("transient" not in e.details for e in errors if isinstance(e, StorageError)), errors
        assert [len(got) for got in followers.seen] == [3, 3]  # (what the file held, then the end)
        assert not [e for e in logs if e["event"].endswith("_retry")], logs
