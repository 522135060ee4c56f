"""SQLite's error paths (stop 44, helper B): faults injected at the backend's sqlite3 call sites -
SQLite's own errors with their real messages and codes, sqlite3's ``InterfaceError``,
``MemoryError`` (sqlite3 raises SQLite's SQLITE_NOMEM as one), a plain ``OSError`` - reach the
caller as a typed ``StorageError`` with what to do, never bare or as "Storage failure: <repr>"; a
command's error says ``outcome_unknown`` True exactly when its COMMIT failed (a failed write or
sync of the -wal file may have left the commit there), False when it failed before (rolled back:
nothing written); and the store goes on once the fault has passed.

The faults are injected by a proxy around each of the store's sqlite3 connections (aiosqlite's
``_connection``), which raises before or after the statements a pattern names."""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from evstore import AllocationStore, EvstoreError, Receipt, StorageError, open_store
from evstore.log.sqlite import SqliteBackend
from tests.conftest import make_provider, new_uuid


def _sqlite_error(
    cls: type[sqlite3.Error], message: str, code: int, name: str
) -> Callable[[], BaseException]:
    """SQLite's error as sqlite3 raises it: its message, and its result code and name."""

    def make() -> BaseException:
        exc = cls(message)
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
        exc.sqlite_errorname = name  # type: ignore[attr-defined]
        return exc

    return make


#: the faults, by name: what the injected statement raises
FAULTS: dict[str, Callable[[], BaseException]] = {
    "disk_io": _sqlite_error(sqlite3.OperationalError, "disk I/O error", 10, "SQLITE_IOERR"),
    "cant_open": _sqlite_error(
        sqlite3.OperationalError, "unable to open database file", 14, "SQLITE_CANTOPEN"
    ),
    "malformed": _sqlite_error(
        sqlite3.DatabaseError, "database disk image is malformed", 11, "SQLITE_CORRUPT"
    ),
    "interface": lambda: sqlite3.InterfaceError("bad parameter or other API misuse"),
    "no_memory": MemoryError,
    "os_error": lambda: OSError(5, "Input/output error"),
}

#: the faults that are not SQLite's DatabaseError (which escaped bare, or as "Storage failure")
OTHER_FAULTS = ["interface", "no_memory", "os_error"]


class _Rule:
    def __init__(self, pattern: str, fault: str, after: bool, rolls_back: bool = False) -> None:
        self.pattern, self.fault, self.after, self.left = re.compile(pattern), fault, after, 1
        #: the statement's failure rolls the transaction back, as SQLite does on some errors
        #: (SQLITE_FULL, SQLITE_IOERR, SQLITE_NOMEM...)
        self.rolls_back = rolls_back


class Faulty:
    """A sqlite3 connection that raises a fault at the first statement matching a rule's pattern
    (before running it, or ``after``: the statement took effect), once per rule."""

    def __init__(self, real: sqlite3.Connection) -> None:
        self._real = real
        self.rules: list[_Rule] = []
        self.hits: list[str] = []
        #: the writes run outside a transaction (each committing on its own)
        self.outside: list[str] = []

    def fail(self, pattern: str, fault: str, after: bool = False, rolls_back: bool = False) -> None:
        self.rules.append(_Rule(pattern, fault, after, rolls_back))

    def _check(self, sql: str, after: bool) -> None:
        for rule in self.rules:
            if rule.left and rule.after == after and rule.pattern.search(sql):
                rule.left -= 1
                self.hits.append(sql)
                if rule.rolls_back and self._real.in_transaction:
                    self._real.execute("ROLLBACK")
                raise FAULTS[rule.fault]()

    def _writes(self, sql: str) -> None:
        if not self._real.in_transaction and sql.lstrip().split(" ", 1)[0].upper() in (
            "INSERT",
            "DELETE",
            "UPDATE",
        ):
            self.outside.append(sql)

    def execute(self, sql: str, *args: Any) -> Any:
        self._check(sql, False)
        self._writes(sql)
        cursor = self._real.execute(sql, *args)
        self._check(sql, True)
        return cursor

    def executemany(self, sql: str, *args: Any) -> Any:
        self._check(sql, False)
        self._writes(sql)
        cursor = self._real.executemany(sql, *args)
        self._check(sql, True)
        return cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


async def _wrap(store: AllocationStore) -> tuple[Faulty, Faulty]:
    """The store's writer and reader connections, behind proxies (after the writer's thread is
    done with what it was given: a drain still running would go on with the real connection)."""
    backend = store.backend
    assert isinstance(backend, SqliteBackend)
    await backend.settle()
    proxies = []
    for conn in (backend._writer, backend._reader):
        assert conn is not None
        proxy = Faulty(conn._connection)  # type: ignore[arg-type]
        conn._connection = proxy  # type: ignore[assignment]
        proxies.append(proxy)
    return proxies[0], proxies[1]


async def _claim(store: AllocationStore, rp: str, consumer: str | None = None, keyed: bool = True) -> Receipt:
    consumer = consumer or new_uuid()
    return await store.set_allocations(
        consumer,
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        idempotency_key=consumer if keyed else None,
    )


@contextlib.asynccontextmanager
async def _held(store: AllocationStore, writer: Faulty) -> AsyncIterator[None]:
    """The writer's thread held by other work (a statement that waits) until the block ends: the
    commands queued meanwhile are then run as one batch."""
    backend = store.backend
    assert isinstance(backend, SqliteBackend)
    entered, release = threading.Event(), threading.Event()
    real_execute = writer.execute

    def pausing(sql: str, *args: Any) -> Any:
        if sql == "SELECT 'pause'":
            entered.set()
            release.wait(10)
        return real_execute(sql, *args)

    writer.execute = pausing  # type: ignore[method-assign]
    holding = asyncio.ensure_future(backend.tamper("SELECT 'pause'"))
    assert await asyncio.to_thread(entered.wait, 10)
    try:
        yield
    finally:
        release.set()
        await holding
        writer.execute = real_execute  # type: ignore[method-assign]


async def _queued(store: AllocationStore, n: int) -> None:
    """Until ``n`` commands wait in the store's queue (bounded)."""
    for _ in range(1000):
        if len(store._queue) >= n:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"{len(store._queue)} commands queued, not {n}")


def _typed(exc: BaseException) -> StorageError:
    """``exc`` is a typed storage error that says what happened, not Python's repr of a bare one."""
    assert isinstance(exc, StorageError), repr(exc)
    assert exc.code == "evstore.storage"
    assert not exc.message.startswith("Storage failure"), exc.message
    assert "sqlite_error" in exc.details, exc.details
    return exc


async def _goes_on(store: AllocationStore, rp: str, head: int) -> None:
    """The store is whole and takes commands again: the head as expected, a clean audit."""
    assert await store.head() == head
    assert (await store.audit(history=True)).clean
    receipt = await _claim(store, rp)
    assert receipt.position == head + 1


@pytest.mark.parametrize("keyed", [True, False], ids=["keyed", "unkeyed"])
@pytest.mark.parametrize("committed", [False, True], ids=["not-committed", "committed"])
async def test_a_commit_that_fails_says_the_outcome_is_unknown(
    tmp_path: Path, committed: bool, keyed: bool
) -> None:
    """Regression: a COMMIT that failed with SQLite's "disk I/O error" (a write or an fsync of the
    -wal file that failed, which can leave the commit frame there for the next open's recovery)
    reached the caller without ``outcome_unknown``, as an error before the COMMIT does, though the
    command may have committed (``committed``: here it did). Now it is True, and the message says
    to retry with the same idempotency key (or, unkeyed, to look at the log first)."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("^COMMIT", "disk_io", after=committed)
        consumer = new_uuid()
        with pytest.raises(StorageError) as caught:
            await _claim(store, rp, consumer, keyed)
        failed = _typed(caught.value)
        assert failed.details["outcome_unknown"] is True, failed.details
        assert "disk I/O error" in failed.message
        assert "may have been committed" in failed.message
        assert ("same idempotency_key" if keyed else "look at the log") in failed.message, failed.message
        assert await store.head() == head + committed
        if keyed:  # (the retry the message asks for: the original receipt, or the command run now)
            retried = await _claim(store, rp, consumer, keyed)
            assert retried.replayed is committed
            assert retried.position == head + 1
            head += 1
        elif committed:
            head += 1
        await _goes_on(store, rp, head)


@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_a_command_that_fails_before_its_commit_says_nothing_was_written(
    tmp_path: Path, fault: str
) -> None:
    """Regression: a command whose statement failed before its COMMIT got, for SQLite's own errors,
    no ``outcome_unknown`` at all (README: "a StorageError says whether to retry"), and for
    sqlite3's InterfaceError, SQLite's SQLITE_NOMEM (a MemoryError) or an OSError
    "Storage failure: MemoryError()" with ``outcome_unknown`` True - though the batch was rolled
    back. Now: typed, ``outcome_unknown`` False, nothing of it in the store."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("INSERT INTO events", fault)
        consumer = new_uuid()
        with pytest.raises(StorageError) as caught:
            await _claim(store, rp, consumer)
        failed = _typed(caught.value)
        assert failed.details["outcome_unknown"] is False, failed.details
        assert writer.hits, "the fault was not injected"
        assert not (await store.allocations(consumer)).allocations
        assert (await store.usage(rp))["VCPU"] == 0
        await _goes_on(store, rp, head)
        retried = await _claim(store, rp, consumer)  # (its key was not kept: it runs now)
        assert not retried.replayed


async def test_a_rollback_that_fails_leaves_the_writer_usable(tmp_path: Path) -> None:
    """Regression: when the ROLLBACK of a failed batch failed too, its error replaced the one the
    caller needed, and the transaction stayed open on the writer's connection: the next command
    failed with "cannot start a transaction within a transaction". Now the caller hears the first
    error, the failed ROLLBACK is logged, and the writer's next work rolls the transaction back."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("INSERT INTO events", "malformed")
        writer.fail("^ROLLBACK", "disk_io")
        with capture_logs() as logs, pytest.raises(StorageError) as caught:
            await _claim(store, rp)
        failed = _typed(caught.value)
        assert "malformed" in failed.message, failed.message
        assert failed.details["outcome_unknown"] is False
        assert len(writer.hits) == 2
        assert any(line["event"] == "sqlite.rollback_failed" for line in logs), logs
        await _goes_on(store, rp, head)


async def test_work_on_the_writer_after_a_failed_rollback_rolls_it_back_first(tmp_path: Path) -> None:
    """The same for the writer's other work - a rebuild, a snapshot - after a failed ROLLBACK: it
    runs, and nothing of the rolled-back batch is committed with it."""
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=1) as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("INSERT INTO events", "disk_io")
        writer.fail("^ROLLBACK", "disk_io")
        with pytest.raises(StorageError):
            await _claim(store, rp)
        await store.take_snapshots()
        await store.rebuild()
        assert await store.head() == head
        await _goes_on(store, rp, head)


async def test_a_read_whose_commit_fails_leaves_no_stale_snapshot(tmp_path: Path) -> None:
    """Regression: a read of several statements runs in a read transaction; when its COMMIT failed,
    the transaction stayed open on the reader's connection, and every later read saw the store as
    it was then (a command acknowledged since, missing from ``usage``). Now it is rolled back."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        _, reader = await _wrap(store)
        reader.fail("^COMMIT", "disk_io")
        with pytest.raises(StorageError) as caught:
            await store.audit()
        _typed(caught.value)
        assert reader.hits
        await _claim(store, rp)
        assert (await store.usage(rp))["VCPU"] == 1
        assert (await store.audit()).clean


READS: dict[str, Callable[[AllocationStore, str], Any]] = {
    "head": lambda store, rp: store.head(),
    "usage": lambda store, rp: store.usage(rp),
    "providers": lambda store, rp: store.providers(),
    "read": lambda store, rp: store.read(after=0),
    "history": lambda store, rp: _all(store.history(rp)),
    "state_at": lambda store, rp: store.state_at(position=2),
    "replay": lambda store, rp: store.replay(to_position=2),
    "diff": lambda store, rp: store.diff(0, 2),
    "audit": lambda store, rp: store.audit(),
    "stats": lambda store, rp: store.stats(),
    "export": lambda store, rp: _all(store.export()),
    "rebuild": lambda store, rp: store.rebuild(),
    "take_snapshots": lambda store, rp: store.take_snapshots(),
}


async def _all(items: Any) -> list[Any]:
    return [item async for item in items]


@pytest.mark.parametrize("fault", OTHER_FAULTS)
async def test_reads_and_maintenance_give_typed_errors(tmp_path: Path, fault: str) -> None:
    """Regression: sqlite3's InterfaceError, a MemoryError (SQLite's SQLITE_NOMEM) or an OSError
    met by a read - and by the audit, time travel, export, rebuild, snapshots - reached the caller
    bare. Now a typed StorageError, and the next call answers."""
    async with open_store(f"sqlite:///{tmp_path}/s.db", snapshot_every=1) as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, reader = await _wrap(store)
        for name, call in READS.items():
            for conn in (writer, reader):
                conn.rules.clear()
                conn.fail("^SELECT|^PRAGMA", fault)
            with pytest.raises(EvstoreError) as caught:
                await call(store, rp)
            failed = _typed(caught.value)
            if fault == "no_memory":
                assert failed.details["reason"] == "out_of_memory", (name, failed.details)
            for conn in (writer, reader):
                conn.rules.clear()
            await call(store, rp)  # (the fault passed: it answers)
        await _goes_on(store, rp, head)


async def test_a_subscriber_whose_poll_fails_hears_a_typed_error(tmp_path: Path) -> None:
    """Regression: the poller's read of the head, failing with SQLite's SQLITE_NOMEM (a
    MemoryError), ended the subscription with "Storage failure: MemoryError()"."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url, poll_interval=0.01) as store:
        rp = await make_provider(store, VCPU=100)
        _, reader = await _wrap(store)
        seen: list[int] = []

        async def follow() -> None:
            async for event in store.subscribe(after=await store.head()):
                seen.append(event.position)

        following = asyncio.ensure_future(follow())
        await asyncio.sleep(0.05)
        reader.fail(r"max\(position\)", "no_memory")
        async with open_store(url) as other:  # (another process's append: found by the poller)
            await _claim(other, rp)
        with pytest.raises(StorageError) as caught:
            await asyncio.wait_for(following, 10)
        assert _typed(caught.value).details["reason"] == "out_of_memory"


@pytest.mark.parametrize("pragma", ["busy_timeout", "journal_mode", "synchronous"])
@pytest.mark.parametrize("fault", ["no_memory", "os_error"])
async def test_an_open_whose_pragma_fails_gives_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pragma: str, fault: str
) -> None:
    """Regression: a MemoryError (SQLite's SQLITE_NOMEM) or an OSError at a connection's pragmas
    escaped ``open_store`` bare (SQLite's own errors there said "Cannot open ...")."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url) as store:
        await make_provider(store, VCPU=100)
    connect = sqlite3.connect
    made: list[Faulty] = []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        conn = Faulty(connect(*args, **kwargs))
        conn.fail(f"PRAGMA {pragma}", fault)
        made.append(conn)
        return conn

    monkeypatch.setattr(sqlite3, "connect", faulty)
    with pytest.raises(StorageError) as caught:
        async with open_store(url):
            pass
    failed = _typed(caught.value)
    assert failed.message.startswith(f"Cannot open {url}: "), failed.message
    assert any(conn.hits for conn in made)
    monkeypatch.undo()
    async with open_store(url) as store:
        assert await store.head() == 2
        assert (await store.audit()).clean


@pytest.mark.parametrize("fault", ["disk_io", "no_memory"])
async def test_a_close_that_fails_closes_every_connection(tmp_path: Path, fault: str) -> None:
    """Regression: a connection's close that failed raised bare out of ``store.close()`` and left
    the other connection - and its thread - open. Now each is closed, the failure logged (what
    was committed stays so: the next open finds it)."""
    url = f"sqlite:///{tmp_path}/s.db"
    store = await open_store(url)
    rp = await make_provider(store, VCPU=100)
    await _claim(store, rp)
    backend = store.backend
    assert isinstance(backend, SqliteBackend)
    writer, _ = await _wrap(store)
    reader_thread = backend._reader._thread  # type: ignore[union-attr]
    assert isinstance(reader_thread, threading.Thread)

    def failing_close() -> None:
        raise FAULTS[fault]()

    writer.close = failing_close  # type: ignore[method-assign]
    with capture_logs() as logs:
        await store.close()
    assert any(line["event"] == "store.close_failed" for line in logs), logs
    assert backend._reader is None and backend._writer is None
    reader_thread.join(10)
    assert not reader_thread.is_alive()
    async with open_store(url) as again:
        assert await again.head() == 3
        assert (await again.audit()).clean


@pytest.mark.parametrize("fault", ["no_memory", "disk_io", "interface"])
async def test_an_import_that_fails_gives_a_typed_error_and_leaves_the_store_empty(
    tmp_path: Path, fault: str
) -> None:
    async with open_store(f"sqlite:///{tmp_path}/a.db") as source:
        rp = await make_provider(source, VCPU=100)
        await _claim(source, rp)
        lines = [line async for line in source.export()]
    async with open_store(f"sqlite:///{tmp_path}/b.db") as store:
        writer, _ = await _wrap(store)
        writer.fail("INSERT INTO events", fault)
        with pytest.raises(StorageError) as caught:
            await store.import_events(lambda: lines)
        _typed(caught.value)
        assert await store.head() == 0
        await store.import_events(lambda: lines)
        assert await store.head() == 3
        assert (await store.audit(history=True)).clean


@pytest.mark.parametrize(
    "error",
    [
        OSError(5, "Input/output error (the caller's file)"),
        ValueError("I/O operation on closed file (the caller's file)"),
    ],
    ids=["os_error", "closed_file"],
)
async def test_an_import_whose_own_file_fails_raises_that_error_as_it_was(
    tmp_path: Path, error: Exception
) -> None:
    """An error of the caller's file, read on the writer's thread by the import pass, is the
    caller's - raised as it was: an OSError not taken for the store's files (a guard of the fix
    above), and - a regression - a ValueError saying "closed" (a file the caller closed) no
    longer taken for the store closed (``StoreClosed`` "The store is closed", before)."""
    async with open_store(f"sqlite:///{tmp_path}/a.db") as source:
        rp = await make_provider(source, VCPU=100)
        await _claim(source, rp)
        lines = [line async for line in source.export()]
    passes = []

    def open_lines() -> Iterator[str]:
        passes.append(1)
        for n, line in enumerate(lines):
            if len(passes) == 2 and n == 2:
                raise error
            yield line

    async with open_store(f"sqlite:///{tmp_path}/b.db") as store:
        with pytest.raises(type(error), match="the caller's file"):
            await store.import_events(open_lines)
        assert await store.head() == 0
        await store.import_events(lambda: lines)  # (the store was not closed: it imports)
        assert await store.head() == 3


@pytest.mark.parametrize("option", ["create", "upgrade"])
@pytest.mark.parametrize("fault", ["no_memory", "os_error"])
async def test_an_opens_look_at_the_file_that_fails_gives_a_typed_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, option: str, fault: str
) -> None:
    """Regression: the read-only looks at the file an open with ``create=False`` or
    ``upgrade=False`` makes first let a MemoryError (SQLite's SQLITE_NOMEM) or an OSError out bare."""
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url) as store:
        await make_provider(store, VCPU=100)
    connect = sqlite3.connect

    def faulty(*args: Any, **kwargs: Any) -> Any:
        conn = Faulty(connect(*args, **kwargs))
        conn.fail("PRAGMA query_only", fault)
        return conn

    monkeypatch.setattr(sqlite3, "connect", faulty)
    with pytest.raises(StorageError) as caught:
        async with open_store(url, **{option: False}):  # type: ignore[arg-type]
            pass
    assert _typed(caught.value).message.startswith(f"Cannot open {url}: ")
    monkeypatch.undo()
    async with open_store(url, **{option: False}) as store:  # type: ignore[arg-type]
        assert await store.head() == 2


@pytest.mark.parametrize("committed", [False, True], ids=["not-committed", "committed"])
async def test_an_import_whose_commit_fails_says_it_may_have_been_committed(
    tmp_path: Path, committed: bool
) -> None:
    """Regression: an import whose COMMIT failed with "disk I/O error" said only that, as one
    that failed before its COMMIT does (README: a failed import leaves the store empty), though it
    may have been committed - whole. Now ``outcome_unknown`` True and what to look at."""
    async with open_store(f"sqlite:///{tmp_path}/a.db") as source:
        rp = await make_provider(source, VCPU=100)
        await _claim(source, rp)
        lines = [line async for line in source.export()]
    async with open_store(f"sqlite:///{tmp_path}/b.db") as store:
        writer, _ = await _wrap(store)
        writer.fail("^COMMIT", "disk_io", after=committed)
        with pytest.raises(StorageError) as caught:
            await store.import_events(lambda: lines)
        failed = _typed(caught.value)
        assert failed.details["outcome_unknown"] is True, failed.details
        assert "may have been committed" in failed.message and "evstore stats" in failed.message
        if committed:
            assert await store.head() == 3
        else:
            assert await store.head() == 0
            await store.import_events(lambda: lines)
        assert (await store.audit(history=True)).clean


async def test_a_batch_whose_transaction_sqlite_rolled_back_writes_nothing_outside_it(tmp_path: Path) -> None:
    """Regression: SQLite rolls a transaction back itself on some errors (SQLITE_NOMEM among them,
    which sqlite3 raises as MemoryError). One met while a job of a group commit loaded its slice
    failed that job alone ("Cannot run ...: MemoryError()"), and the batch went on without a
    transaction: each later statement - the other jobs' idempotency rows, the events, the
    projection - committed on its own, and the COMMIT then failed, "cannot commit - no transaction
    is active": half a batch in the store, its callers told it failed. Now the batch stops there,
    rolled back whole, every caller told nothing was written."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        consumers = [new_uuid() for _ in range(5)]
        async with _held(store, writer):  # (five commands queue meanwhile: they are then one batch)
            claims = [asyncio.ensure_future(_claim(store, rp, consumer)) for consumer in consumers]
            await _queued(store, 5)
            writer.fail("FROM p_usages", "no_memory", rolls_back=True)
        results = await asyncio.gather(*claims, return_exceptions=True)
        assert writer.hits, "the fault was not injected"
        assert not writer.outside, writer.outside
        for result in results:
            failed = _typed(result)
            assert failed.details["outcome_unknown"] is False, failed.details
        assert await store.head() == head
        for consumer in consumers:
            assert not (await store.allocations(consumer)).allocations
            retried = await _claim(store, rp, consumer)  # (no idempotency row was left behind)
            assert not retried.replayed
        assert (await store.audit(history=True)).clean


async def test_a_rebuild_whose_transaction_sqlite_rolled_back_says_why_and_writes_nothing(
    tmp_path: Path,
) -> None:
    """Regression: a rebuild that met a read error of the projection took it for an unreadable row
    and rewrote the tables whole - also when the error was one on which SQLite rolls the
    transaction back itself (a disk I/O error): the rewrite then ran outside any transaction, each
    statement committing on its own, and the caller heard "cannot commit - no transaction is
    active" instead of the disk I/O error. Now that error, and nothing written."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        await _claim(store, rp)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail(r"FROM p_consumers ORDER BY", "disk_io", rolls_back=True)
        with pytest.raises(StorageError) as caught:
            await store.rebuild()
        failed = _typed(caught.value)
        assert writer.hits, "the fault was not injected"
        assert "disk I/O error" in failed.message, failed.message
        assert not writer.outside, writer.outside
        await store.rebuild()
        await _goes_on(store, rp, head)


async def test_a_failed_commit_of_a_batch_of_keyed_and_unkeyed_commands_tells_each_what_to_do(
    tmp_path: Path,
) -> None:
    """One error answers every caller of a group commit whose COMMIT failed: with keyed and unkeyed
    commands in it, it says what each kind does (the keyed were told to look at the log)."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            claims = [asyncio.ensure_future(_claim(store, rp, keyed=keyed)) for keyed in (True, False)]
            await _queued(store, 2)
            writer.fail("^COMMIT", "disk_io")
        for result in await asyncio.gather(*claims, return_exceptions=True):
            failed = _typed(result)
            assert failed.details["outcome_unknown"] is True
            assert "same idempotency_key" in failed.message and "look at the log" in failed.message


#: a process that fills its store past a file size limit (RLIMIT_FSIZE: a write past it fails with
#: EFBIG, SQLite's "disk I/O error" when it meets the -wal's append at COMMIT), then lifts the limit
#: and retries the command that failed, with its key; prints what it saw as one JSON line
_FILE_SIZE_LIMIT_SCRIPT = """
import asyncio, json, os, resource, signal, sys, uuid
from evstore import StorageError, open_store

async def main(path):
    async with open_store(f"sqlite:///{path}") as store:
        rp = str(uuid.uuid4())
        await store.create_provider(rp, "rp")
        await store.set_inventories(rp, {"VCPU": {"total": 10**6}}, generation=0)
        body = dict(project_id="p", user_id="u", consumer_type="INSTANCE", generation=None)
        limit = max(os.path.getsize(path), os.path.getsize(path + "-wal")) + 64 * 1024
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        for _ in range(10000):
            consumer = str(uuid.uuid4())
            try:
                await store.set_allocations(consumer, {rp: {"VCPU": 1}}, idempotency_key=consumer, **body)
            except StorageError as exc:
                failed = exc
                break
        head = await store.head()
        resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        retried = await store.set_allocations(consumer, {rp: {"VCPU": 1}}, idempotency_key=consumer, **body)
        print(json.dumps({"details": failed.details, "message": failed.message, "head": head,
                          "replayed": retried.replayed, "position": retried.position,
                          "clean": (await store.audit(history=True)).clean}))

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
asyncio.run(main(sys.argv[1]))
"""


async def test_a_real_write_error_at_commit_says_the_outcome_is_unknown(tmp_path: Path) -> None:
    """The first test's fault, not injected: a file size limit makes the -wal's append at COMMIT
    fail, "disk I/O error" (a failing disk says the same). The caller hears ``outcome_unknown``
    True (it said nothing of it before); the retry with the same key goes through - this write
    failed before its commit frame, so it runs now - and the store is whole."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    done = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _FILE_SIZE_LIMIT_SCRIPT, str(tmp_path / "s.db")],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    if seen["details"].get("reason") == "disk_full":  # (a file system may say so instead: nothing committed)
        assert seen["details"]["outcome_unknown"] is False
    else:
        assert seen["details"]["outcome_unknown"] is True, seen
        assert "disk I/O error" in seen["message"] and "same idempotency_key" in seen["message"]
    assert seen["replayed"] is False and seen["position"] == seen["head"] + 1
    assert seen["clean"]


class _Recording(Faulty):
    """A proxy that records the statements run on it (none fails)."""

    def __init__(self, real: sqlite3.Connection) -> None:
        super().__init__(real)
        self.statements: list[str] = []

    def _check(self, sql: str, after: bool) -> None:
        if not after and sql not in self.statements:
            self.statements.append(sql)


@pytest.mark.parametrize(
    ("fault", "rolls_back"),
    [("disk_io", False), ("no_memory", False), ("interface", False), ("no_memory", True)],
)
async def test_every_statement_of_a_command_fails_cleanly(
    tmp_path: Path, fault: str, rolls_back: bool
) -> None:
    """The sweep behind the tests above: each statement a keyed command runs on the writer (recorded
    from a real one), failing in turn. The caller hears a typed StorageError that says
    ``outcome_unknown`` - True for the COMMIT, False before it -, nothing of the command is in the
    store, the audit is clean, and the next command goes through. ``rolls_back``: the failure
    rolls the transaction back too, as SQLite does on some errors."""
    async with open_store(f"sqlite:///{tmp_path}/r.db") as store:
        rp = await make_provider(store, VCPU=100)
        await _claim(store, rp)
        backend = store.backend
        assert isinstance(backend, SqliteBackend) and backend._writer is not None
        await backend.settle()
        recording = _Recording(backend._writer._connection)  # type: ignore[arg-type]
        backend._writer._connection = recording  # type: ignore[assignment]
        await _claim(store, rp)
        await backend.settle()
        statements = list(recording.statements)  # (not the close's)
    assert "COMMIT" in statements and len(statements) >= 8, statements
    for n, sql in enumerate(statements):  # (each in a store as the recorded one was)
        async with open_store(f"sqlite:///{tmp_path}/s{n}.db") as store:
            rp = await make_provider(store, VCPU=100)
            await _claim(store, rp)
            head = await store.head()
            writer, _ = await _wrap(store)
            writer.fail(f"^{re.escape(sql)}$", fault, rolls_back=rolls_back)
            with pytest.raises(StorageError) as caught:
                await _claim(store, rp)
            failed = _typed(caught.value)
            assert writer.hits == [sql]
            assert failed.details["outcome_unknown"] is (sql == "COMMIT"), (sql, failed.details)
            assert not writer.outside, (sql, writer.outside)
            assert await store.head() == head, sql
            await _goes_on(store, rp, head)


async def test_a_command_refused_for_a_damaged_projection_says_nothing_was_written(tmp_path: Path) -> None:
    """Regression: a batch that fails whole on an error of evstore's own before its COMMIT - here
    a projection holding a row the store did not expect (``evstore.projection.corrupt``) - said
    nothing of ``outcome_unknown``, unlike SQLite's errors at the same place. Now False: the batch
    was rolled back."""
    from evstore import ProjectionCorrupt

    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        consumer = new_uuid()
        await backend.tamper("INSERT INTO p_allocations VALUES (?,?,?)", (consumer, rp, '{"VCPU": 1}'))
        with pytest.raises(ProjectionCorrupt) as caught:
            await _claim(store, rp, consumer)
        assert caught.value.details["outcome_unknown"] is False, caught.value.details
        assert await store.head() == head
        await backend.tamper("DELETE FROM p_allocations WHERE consumer = ?", (consumer,))
        await _goes_on(store, rp, head)
