"""Stop 45, helper I: a host's structlog configuration that fails - a ``PrintLogger`` on a closed
file (seen: a later command failed with "Storage failure: ValueError('I/O operation on closed
file.')"), a processor that raises - changes no call's outcome and stops no thread of evstore's,
on either backend: every module logs through ``evstore.logs`` (guarded lines, the failure
reported on stderr), not only ``evstore.store``."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from evstore import AllocationStore, CapacityExceeded, InvalidInput, StorageError, open_store
from evstore.demo import run_demo
from evstore.log.sqlite import SqliteBackend
from evstore.logs import BoundOnce, Guarded, get_logger
from projections.replay import replay
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_s44_B_sqlite_faults import FAULTS, _claim, _goes_on, _wrap

pytestmark = pytest.mark.usefixtures("logging_as_it_was")


class _Boom(RuntimeError):
    pass


def _closed_file() -> None:
    closed = io.StringIO()
    closed.close()
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.dev.ConsoleRenderer(colors=False)],
        logger_factory=structlog.PrintLoggerFactory(file=closed),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )


def _raising_processor() -> None:
    def boom(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        raise _Boom("the host's processor failed")

    structlog.configure(
        processors=[boom],
        logger_factory=structlog.ReturnLoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )


BROKEN = {"closed_file": _closed_file, "raising_processor": _raising_processor}
#: what each broken configuration's report on stderr names
REPORTED = {"closed_file": "I/O operation on closed file", "raising_processor": "the host's processor failed"}


@pytest.fixture(params=sorted(BROKEN))
def broken(request: pytest.FixtureRequest) -> Iterator[str]:
    """structlog configured to fail every line (put back by ``logging_as_it_was``)."""
    BROKEN[request.param]()
    yield request.param


def _reported(capsys: pytest.CaptureFixture[str], broken: str, event: str) -> None:
    err = capsys.readouterr().err
    assert f"log line {event!r} not emitted" in err and REPORTED[broken] in err, err


def test_every_level_of_a_guarded_logger_survives_a_broken_configuration(
    broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    logger = get_logger("evstore.test")
    assert isinstance(logger, Guarded)
    for level in ("debug", "info", "warning", "error", "exception"):
        getattr(logger, level)(f"test.{level}", n=1)
        _reported(capsys, broken, f"test.{level}")
    bound = BoundOnce("evstore.test").get()
    bound.info("test.bound")
    _reported(capsys, broken, "test.bound")


async def test_a_failed_rollback_answers_its_error_with_broken_logging(
    tmp_path: Path, broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``sqlite.rollback_failed``, logged on the writer's thread, raised the logging's
    exception in place of the batch's own error ("malformed", outcome_unknown False)."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("INSERT INTO events", "malformed")
        writer.fail("^ROLLBACK", "disk_io")
        with pytest.raises(StorageError) as caught:
            await _claim(store, rp)
        assert "malformed" in caught.value.message, caught.value.message
        assert caught.value.details["outcome_unknown"] is False
        assert len(writer.hits) == 2
        await _goes_on(store, rp, head)
    _reported(capsys, broken, "sqlite.rollback_failed")


async def test_a_failed_close_closes_every_connection_with_broken_logging(
    tmp_path: Path, broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``store.close_failed`` raised the logging's exception out of ``close()``, the
    reader's connection and thread left open."""
    url = f"sqlite:///{tmp_path}/s.db"
    store = await open_store(url)
    rp = await make_provider(store, VCPU=100)
    await _claim(store, rp)
    backend = store.backend
    assert isinstance(backend, SqliteBackend)
    writer, _ = await _wrap(store)
    reader_thread = backend._reader._thread  # type: ignore[union-attr]

    def failing_close() -> None:
        raise FAULTS["disk_io"]()

    writer.close = failing_close  # type: ignore[method-assign]
    await store.close()
    assert backend._reader is None and backend._writer is None
    reader_thread.join(10)  # type: ignore[union-attr]
    assert not reader_thread.is_alive()  # type: ignore[union-attr]
    _reported(capsys, broken, "store.close_failed")
    async with open_store(url) as again:
        assert await again.head() == 3
        assert (await again.audit()).clean


async def test_an_unreadable_snapshot_is_folded_past_with_broken_logging(
    store: AllocationStore, broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``snapshot.unreadable`` raised the logging's exception out of ``state_at``
    (both backends) instead of folding the answer from the log."""
    store.snapshot_every = 4
    rp = await make_provider(store, VCPU=100)
    for _ in range(8):
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.delete_consumer(consumer)
    head = await store.head()
    await store.take_snapshots()
    backend: Any = store.backend
    await backend.tamper("DELETE FROM snapshots WHERE position = -8")
    assert (await store.state_at(head)).state == await replay(store.backend.read, head)
    _reported(capsys, broken, "snapshot.unreadable")


async def test_the_demo_reports_with_broken_logging(
    store: AllocationStore, broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the demo's last line (``demo.done``) raised the logging's exception instead of
    returning the report of the cloud it played."""
    report = await run_demo(store, seed=7, nodes=2, instances=4)
    assert report.head == await store.head() > 0
    assert (await store.audit()).clean
    _reported(capsys, broken, "demo.done")


def _set(store: AllocationStore, consumer: str, rp: str, amount: int) -> Any:
    return store.set_allocations(
        consumer,
        {rp: {"VCPU": amount}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
    )


async def _life(url: str, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A store's life, its outcomes as comparable values: commands accepted and refused (also
    before being queued), a batch that failed (SQLite: a fault injected), a subscriber whose read
    failed transiently (retried), snapshots, a rebuild, an audit and a close."""
    seen: list[Any] = []
    rp = "a5b2c0de-0000-4000-8000-000000000001"
    consumers = [f"c0c0c0c0-0000-4000-8000-{n:012d}" for n in range(6)]
    async with open_store(url, snapshot_every=2, poll_interval=0.05) as store:
        await store.create_provider(rp, "node")
        await store.set_inventories(rp, {"VCPU": {"total": 8}}, generation=0)
        for consumer in consumers[:3]:
            receipt = await _set(store, consumer, rp, 2)
            seen.append((type(receipt).__name__, receipt.position))
        for refused in (
            lambda: _set(store, consumers[3], rp, 100),
            lambda: _set(store, "x", rp, 1),
        ):
            with pytest.raises((CapacityExceeded, InvalidInput, ValueError)) as caught:
                await refused()
            seen.append(type(caught.value).__name__)
        if isinstance(store.backend, SqliteBackend):
            writer, _ = await _wrap(store)
            writer.fail("INSERT INTO events", "disk_io")
            with pytest.raises(StorageError) as failed:
                await _set(store, consumers[4], rp, 1)
            seen.append((failed.value.code, failed.value.details.get("outcome_unknown")))
        await store.delete_consumer(consumers[0])
        # a subscriber whose first read fails transiently: retried, it gets every event once
        read, reads = store.backend.read, []

        async def flaky(after: int, limit: int) -> Any:
            reads.append(after)
            if len(reads) == 1:
                raise StorageError("the server went away", transient=True)
            return await read(after, limit)

        monkeypatch.setattr(store.backend, "read", flaky)
        head = await store.head()
        got = []
        async with asyncio.timeout(10):
            async for event in store.subscribe(0):
                got.append(event.position)
                if event.position == head:
                    break
        monkeypatch.undo()
        seen.append((got == list(range(1, head + 1)), len(reads) > 1))
        seen.append(await store.take_snapshots())
        seen.append((await store.state_at(head)).state == await replay(store.backend.read, head))
        rebuilt = await store.rebuild()
        seen.append((rebuilt.events, rebuilt.head) if hasattr(rebuilt, "events") else type(rebuilt).__name__)
        seen.append((await store.audit(history=True)).clean)
        seen.append(dict(await store.usage(rp)))
    async with open_store(url) as again:
        seen.append(await again.head())
    return seen


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_a_store_lives_the_same_with_broken_logging(
    backend: str,
    tmp_path: Path,
    broken: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    """Commands accepted and refused, a failed batch, a subscriber's retry, snapshots, a rebuild
    and close: the same outcomes as with working logging, each failed line reported on stderr."""
    if backend == "sqlite":
        urls = [f"sqlite:///{tmp_path}/{n}.db" for n in ("broken", "working")]
    else:
        urls = [request.getfixturevalue("pg_url")]
        from tests.pg import fresh_database_url

        urls.append(fresh_database_url())
    with_broken = await _life(urls[0], monkeypatch)
    structlog.reset_defaults()
    with structlog.testing.capture_logs() as logs:
        with_working = await _life(urls[1], monkeypatch)
    assert with_broken == with_working
    events = {line["event"] for line in logs}
    assert {"command.accepted", "command.rejected", "subscribe.read_retry"} <= events, events
    err = capsys.readouterr().err
    for event in events & {"command.accepted", "command.rejected", "subscribe.read_retry"}:
        assert f"log line {event!r} not emitted" in err, (event, err[-2000:])
    assert REPORTED[broken] in err


async def test_an_open_that_refolds_a_lost_projection_table_with_broken_logging(
    store_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: the open's repair of a projection table dropped by hand logs its refold (a
    warning; on PostgreSQL in the open's transaction): the logging's exception failed the open."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 3}})
        await store.backend.tamper("DROP TABLE p_allocations")  # type: ignore[attr-defined]
    _raising_processor()
    async with open_store(store_url) as store:
        repaired = store.backend.repaired  # type: ignore[attr-defined]
        assert repaired is not None and "p_allocations" in repaired.made_again and repaired.refolded
        assert (await store.usage(rp))["VCPU"] == 3
        assert (await store.allocations(consumer)).allocations
        assert (await store.audit()).clean
    assert "not emitted" in capsys.readouterr().err
