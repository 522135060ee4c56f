"""PostgreSQL commands that run out of a timeout say what became of them: rolled back when they
ran out before their COMMIT (a lock_timeout always is), of unknown outcome when the COMMIT was
sent and its answer never came."""

from __future__ import annotations

import asyncpg
import pytest

from evstore import StorageError, open_store
from tests.conftest import make_provider, new_uuid
from tests.test_postgres import _Partition, pg
from tests.test_s38_c_disk_full import _claim


async def test_a_commit_whose_answer_never_came_is_unknown_and_its_keyed_retry_settles_it(
    pg_url: str,
) -> None:
    """command_timeout running out at COMMIT (a partition: the COMMIT sent, no answer) leaves the
    outcome unknown - here the relay delivers the COMMIT once the partition heals, after the
    client gave up - so the error says so (``outcome_unknown``), never "rolled back"; the retry
    with the command's idempotency key, which it asks for, applies the command exactly once."""
    partition = _Partition(pg_url)
    async with partition as relayed, open_store(relayed, command_timeout=1, connect_timeout=3) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()

        async def cut(conn: object) -> None:
            partition.cut()

        pg(store)._before_commit = cut
        with pytest.raises(StorageError) as caught:
            await _claim(store, consumer, rp)
        pg(store)._before_commit = None
        assert caught.value.details["outcome_unknown"] is True, caught.value.details
        message = caught.value.message
        assert "within command_timeout (1 s)" in message, message
        assert "may or may not have been committed" in message and "rolled back" not in message, message
        assert "same idempotency key" in message, message
        partition.heal()
        receipt = await _claim(store, consumer, rp)
        # (the COMMIT the client gave up on did commit: saying "rolled back" would have been false)
        assert receipt.replayed and len(receipt.positions) == 1
        assert (await store.usage(rp)).usages == {"VCPU": 1}
        assert [e.position for e in await store.read(0, 100)][-1] == receipt.positions[0]
        assert (await store.audit()).clean


async def test_a_command_that_runs_out_of_lock_timeout_was_rolled_back(pg_url: str) -> None:
    """README: for waits on locks alone, ``?lock_timeout=`` in the URL - a command waits for its
    locks before its COMMIT, so one that runs out of it was rolled back (here waiting for a table
    lock another session holds), not of unknown outcome; it goes through once the lock is gone."""
    url = pg_url + ("&" if "?" in pg_url else "?") + "lock_timeout=500ms"
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=8)
        before = await store.head()
        consumer = new_uuid()
        other = await asyncpg.connect(pg_url)
        try:
            tx = other.transaction()
            await tx.start()
            await other.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(StorageError) as caught:
                await _claim(store, consumer, rp)
            await tx.rollback()
        finally:
            await other.close()
        assert caught.value.details["sqlstate"] == "55P03", caught.value.details
        assert caught.value.details["outcome_unknown"] is False
        assert "it was rolled back" in caught.value.message, caught.value.message
        assert await store.head() == before
        assert (await store.allocations(consumer)).allocations == {}
        assert len((await _claim(store, consumer, rp)).positions) == 1
        assert (await store.audit()).clean
