"""Stop 48, helper Q: the SQLite writer's receipts and its cache across group commits.

The writer builds each job's receipt from the slice it folded and records the slice's entities in
its cache (``_WriterCache.settle``) from the slice's keys as loaded and as folded. These tests hold
what that must keep: a receipt names every consumer the command named (an absent one with
generation None) and every one it changed that it did not name (a revert's instance, a delete's
migrations), with the generations the store then answers; and entities a batch creates, changes or
deletes are what the next batches load (the projection written from the cache audits clean, and a
store opened afresh answers the same)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from evstore import open_store
from tests.conftest import make_provider, new_uuid


async def _claim(store, rp: str, consumer: str, vcpu: int = 1, generation: int | None = None):  # type: ignore[no-untyped-def]
    return await store.set_allocations(
        consumer,
        {rp: {"VCPU": vcpu}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=generation,
    )


async def test_receipts_of_one_group_commit_name_what_each_command_named_and_changed(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/s.db") as store:
        rp = await make_provider(store, VCPU=64)
        kept, gone, moving, migration = (new_uuid() for _ in range(4))
        await _claim(store, rp, kept)
        await _claim(store, rp, gone)
        await _claim(store, rp, moving, 2)
        absent = new_uuid()
        # (queued together: one batch, each decided against what the ones before it left)
        claim, delete, release, start, again = await asyncio.gather(
            _claim(store, rp, kept, 3, generation=1),
            store.delete_consumer(gone),
            store.release(absent),
            store.start_migration(moving, migration),
            _claim(store, rp, kept, 4, generation=2),
            return_exceptions=True,
        )
        assert claim.consumer_generations == {kept: 2}
        assert again.consumer_generations == {kept: 3}
        assert list(claim.provider_generations) == [rp]
        assert again.provider_generations[rp] > claim.provider_generations[rp]
        assert delete.consumer_generations == {gone: None}
        assert type(release).__name__ == "NotFound"
        assert start.consumer_generations[moving] is None
        assert start.consumer_generations[migration] == 1
        reverted = await store.revert_migration(migration)
        # (the instance it changed, though only the migration was named)
        assert reverted.consumer_generations == {migration: None, moving: 1}
        assert (await store.usage(rp))["VCPU"] == 4 + 2
        assert (await store.audit()).clean


async def test_what_a_batch_creates_changes_and_deletes_is_what_the_next_batches_load(tmp_path: Path) -> None:
    path = f"sqlite:///{tmp_path}/s.db"
    async with open_store(path) as store:
        rps = [await make_provider(store, VCPU=1000) for _ in range(3)]
        consumers = [new_uuid() for _ in range(24)]
        for round_ in range(4):
            # each round one batch: claims (new, then changed), releases and deletions mixed
            jobs = []
            for i, c in enumerate(consumers):
                kind = (i + round_) % 4
                if kind == 0:
                    jobs.append(_claim(store, rps[i % 3], c, 1 + round_))
                elif kind == 1:
                    jobs.append(store.release(c))
                elif kind == 2:
                    jobs.append(_claim(store, rps[(i + 1) % 3], c, 2))
                else:
                    jobs.append(store.delete_consumer(c) if round_ == 3 else store.release(c))
            await asyncio.gather(*jobs, return_exceptions=True)
        seen = {rp: dict(await store.usage(rp)) for rp in rps}
        assert (await store.audit()).clean
    async with open_store(path) as store:  # (read from the rows the writer's cache wrote)
        assert {rp: dict(await store.usage(rp)) for rp in rps} == seen
        assert (await store.audit()).clean


async def test_usage_counters_a_batch_empties_refills_and_starts_by_type(tmp_path: Path) -> None:
    """One batch takes a (project, user)'s only INSTANCE to nothing and gives it back, starts a
    type it never counted, and empties another user: the counters written once for the batch are
    what the store answers, after a reopen too (the audit compares them with the fold)."""
    path = f"sqlite:///{tmp_path}/s.db"

    async def claim(store, rp: str, c: str, vcpu: int, user: str, ctype: str = "INSTANCE"):  # type: ignore[no-untyped-def]
        return await store.set_allocations(
            c,
            {rp: {"VCPU": vcpu, "DISK_GB": 1}},
            project_id="p",
            user_id=user,
            consumer_type=ctype,
            generation=None,
        )

    async with open_store(path) as store:
        rp = await make_provider(store, VCPU=100, DISK_GB=100)
        a, b, c, d = (new_uuid() for _ in range(4))
        await claim(store, rp, a, 2, "alice")
        await claim(store, rp, b, 3, "bob")
        await asyncio.gather(
            store.delete_consumer(a),  # alice's INSTANCE count to 0 ...
            claim(store, rp, c, 5, "alice"),  # ... and back to 1
            claim(store, rp, d, 7, "alice", "MIGRATION"),  # a type alice had not counted
            store.release(b),  # bob: nothing left
        )
        answers = [
            (await store.usages("p", "alice")).by_consumer_type,
            (await store.usages("p", "bob")).by_consumer_type,
            (await store.usages("p")).usages,
        ]
        assert answers[0] == {
            "INSTANCE": {"VCPU": 5, "DISK_GB": 1, "consumer_count": 1},
            "MIGRATION": {"VCPU": 7, "DISK_GB": 1, "consumer_count": 1},
        }
        assert answers[1] == {}
        assert answers[2] == {"VCPU": 12, "DISK_GB": 2}
        assert (await store.audit()).clean
    async with open_store(path) as store:
        again = [
            (await store.usages("p", "alice")).by_consumer_type,
            (await store.usages("p", "bob")).by_consumer_type,
            (await store.usages("p")).usages,
        ]
        assert again == answers
        assert (await store.audit()).clean
