"""SQLite: what each caller of a group commit hears (stop 45, helper D).

A batch whose COMMIT failed: its accepted jobs may have been committed (``outcome_unknown`` True),
but a job refused by an invariant wrote nothing, whatever became of the COMMIT: it hears its own
refusal. A job refused for a damaged projection row, found before it wrote anything, says
``outcome_unknown`` False, as every other error before a COMMIT does."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from evstore import ConcurrentUpdate, ProjectionCorrupt, StorageError, open_store
from evstore.log.sqlite import SqliteBackend
from tests.conftest import make_provider, new_uuid
from tests.test_s44_B_sqlite_faults import _claim, _held, _queued, _typed, _wrap


async def _stale(store, rp: str):  # type: ignore[no-untyped-def]
    """A write refused by an invariant (a consumer generation that is not its): nothing written."""
    return await store.set_allocations(
        new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=7
    )


@pytest.mark.parametrize("committed", [False, True], ids=["not-committed", "committed"])
async def test_a_refused_job_of_a_batch_whose_commit_failed_hears_its_refusal(
    tmp_path: Path, committed: bool
) -> None:
    """Regression: when a group commit's COMMIT failed, every caller of the batch heard "may have
    been committed" (``outcome_unknown`` True), the refused ones too, though nothing of a refused
    job is ever written. Now a refused job hears its own refusal; the accepted one, outcome unknown."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            refused = asyncio.ensure_future(_stale(store, rp))
            accepted = asyncio.ensure_future(_claim(store, rp))
            refused_too = asyncio.ensure_future(_stale(store, rp))
            await _queued(store, 3)
            writer.fail("^COMMIT", "disk_io", after=committed)
        results = await asyncio.gather(refused, accepted, refused_too, return_exceptions=True)
        for result in (results[0], results[2]):
            wanted = ConcurrentUpdate if result is results[0] else StorageError
            assert isinstance(result, wanted), repr(result)
            assert "outcome_unknown" not in result.details or result.details["outcome_unknown"] is False
            assert "may have been committed" not in result.message
        # (the third was refused after the accepted one, against what it wrote, which may not be in
        # the log: told to retry, nothing of it written - stop 45, helper E)
        assert results[2].details["refused"] == "placement.concurrent_update"
        failed = _typed(results[1])
        assert failed.details["outcome_unknown"] is True, failed.details
        assert "same idempotency_key" in failed.message and "look at the log" not in failed.message
        assert await store.head() == head + committed


async def test_a_batch_of_refused_jobs_whose_commit_failed_hears_only_refusals(tmp_path: Path) -> None:
    """A batch whose jobs were all refused wrote nothing: a failed COMMIT changes none of their answers."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            refused = [asyncio.ensure_future(_stale(store, rp)) for _ in range(2)]
            await _queued(store, 2)
            writer.fail("^COMMIT", "disk_io")
        for result in await asyncio.gather(*refused, return_exceptions=True):
            assert isinstance(result, ConcurrentUpdate), repr(result)
        assert await store.head() == head
        await _claim(store, rp)
        assert await store.head() == head + 1


async def test_a_job_refused_for_a_damaged_projection_row_says_nothing_was_written(tmp_path: Path) -> None:
    """Regression: a damaged projection row met while one job loads its state (its own
    ``ProjectionCorrupt``, the batch's other jobs going on) carried no ``outcome_unknown``, where
    every other error before a COMMIT says False. Now False."""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        other = await make_provider(store, VCPU=100)
        head = await store.head()
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        await backend.tamper("UPDATE p_providers SET usages = 'not json' WHERE uuid = ?", (rp,))
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            damaged = asyncio.ensure_future(_claim(store, rp))
            fine = asyncio.ensure_future(_claim(store, other))
            await _queued(store, 2)
        results = await asyncio.gather(damaged, fine, return_exceptions=True)
        assert isinstance(results[0], ProjectionCorrupt), repr(results[0])
        assert results[0].details.get("outcome_unknown") is False, results[0].details
        assert not isinstance(results[1], BaseException), repr(results[1])
        assert await store.head() == head + 1
        with pytest.raises(StorageError):  # (still damaged: a lone command too)
            await _claim(store, rp)


async def test_a_command_refused_for_a_damaged_projection_row_says_so_on_postgres_too(pg_url: str) -> None:
    """The same on PostgreSQL: a ``ProjectionCorrupt`` is met reading the projection, inside the
    command's transaction and before its COMMIT (rolled back: nothing of it written), and said no
    ``outcome_unknown`` at all. The store now says False for every command's ``ProjectionCorrupt``."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        await store.backend.tamper("UPDATE p_providers SET usages = '[1]' WHERE uuid = ?", (rp,))  # type: ignore[attr-defined]
        with pytest.raises(ProjectionCorrupt) as caught:
            await _claim(store, rp)
        assert caught.value.details.get("outcome_unknown") is False, caught.value.details
        assert await store.head() == head


async def test_a_batch_through_run_jobs_whose_commit_failed_answers_each_job(tmp_path: Path) -> None:
    """The backend's other path, a whole batch per ``run_jobs`` (the store's generic writer):
    the refused job keeps its refusal, the accepted one hears outcome unknown."""
    from evstore.commands import ConsumerWrite, WriteAllocations, needs
    from evstore.log import Job

    def job(rp: str, generation: int | None) -> Job:
        write = ConsumerWrite(new_uuid(), {rp: {"VCPU": 1}}, "p", "u", "INSTANCE", generation)
        command = WriteAllocations((write,))
        return Job(command, {}, "{}", needs(command))

    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=100)
        head = await store.head()
        writer, _ = await _wrap(store)
        writer.fail("^COMMIT", "disk_io")
        backend = store.backend
        assert isinstance(backend, SqliteBackend)
        refused, accepted = await backend.run_jobs([job(rp, 3), job(rp, None)])
        assert isinstance(refused, ConcurrentUpdate), repr(refused)
        assert isinstance(accepted, StorageError), repr(accepted)
        assert accepted.details["outcome_unknown"] is True, accepted.details
        assert "look at the log" in accepted.message  # (it had no key: the advice is the accepted job's)
        assert await store.head() == head
