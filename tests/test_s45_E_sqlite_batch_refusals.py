"""Stop 45, helper E: SQLite's group commit decides each job against the state the jobs before
it in the batch left. When the batch's COMMIT failed, its refused jobs keep their refusal (006858f)
- but a refusal decided against a batch-mate that was accepted, and whose COMMIT failed, was
decided against a state that may never have been written: a command refused "capacity exceeded",
or "consumer deleted at position N", by a claim or a delete that is not in the log. PostgreSQL
never answers so (each command commits alone, after those on its entities ended). Such a job now
hears that nothing of it was written and that it is to be retried (``outcome_unknown`` False);
a job refused before any batch-mate changed anything keeps its refusal."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from evstore import CapacityExceeded, ConsumerDeleted, StorageError, open_store
from tests.conftest import make_provider, new_uuid
from tests.test_s44_B_sqlite_faults import _held, _queued, _wrap


async def _claim(store, rp: str, consumer: str | None = None):  # type: ignore[no-untyped-def]
    return await store.set_allocations(
        consumer or new_uuid(),
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
    )


@pytest.mark.parametrize("committed", [False, True], ids=["not-committed", "committed"])
async def test_a_refusal_decided_against_a_batch_mate_whose_commit_failed_says_retry(
    tmp_path: Path, committed: bool
) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=1)
        head = await store.head()
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            full = asyncio.ensure_future(_claim(store, rp))  # (takes the one VCPU)
            over = asyncio.ensure_future(_claim(store, rp))  # (refused against the first)
            await _queued(store, 2)
            writer.fail("^COMMIT", "disk_io", after=committed)
        results = await asyncio.gather(full, over, return_exceptions=True)
        assert isinstance(results[0], StorageError) and results[0].details["outcome_unknown"] is True
        refused = results[1]
        assert not isinstance(refused, CapacityExceeded), repr(refused)  # (the VCPU may be free)
        assert isinstance(refused, StorageError), repr(refused)
        assert refused.details["outcome_unknown"] is False, refused.details
        assert "retry" in refused.message and "nothing of it was written" in refused.message, refused.message
        assert refused.details["refused"] == "evstore.allocation.capacity_exceeded"
        assert await store.head() == head + committed


async def test_a_write_to_a_consumer_a_batch_mate_deleted_is_not_told_it_was_deleted(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await _claim(store, rp, c)
        head = await store.head()
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            deleted = asyncio.ensure_future(store.delete_consumer(c))
            written = asyncio.ensure_future(_claim(store, rp, c))
            await _queued(store, 2)
            writer.fail("^COMMIT", "disk_io")
        results = await asyncio.gather(deleted, written, return_exceptions=True)
        assert isinstance(results[0], StorageError) and results[0].details["outcome_unknown"] is True
        assert not isinstance(results[1], ConsumerDeleted), repr(results[1])  # (it was not deleted)
        assert isinstance(results[1], StorageError) and results[1].details["outcome_unknown"] is False
        assert await store.head() == head
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 1}}


async def test_a_refusal_before_any_batch_mate_changed_anything_is_kept(tmp_path: Path) -> None:
    """(Decided against what the log held: the COMMIT's failure changes nothing of it.)"""
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=1)
        await _claim(store, rp)
        other = await make_provider(store, VCPU=1)
        writer, _ = await _wrap(store)
        async with _held(store, writer):
            over = asyncio.ensure_future(_claim(store, rp))
            fine = asyncio.ensure_future(_claim(store, other))
            await _queued(store, 2)
            writer.fail("^COMMIT", "disk_io")
        results = await asyncio.gather(over, fine, return_exceptions=True)
        assert isinstance(results[0], CapacityExceeded), repr(results[0])
        assert isinstance(results[1], StorageError) and results[1].details["outcome_unknown"] is True
