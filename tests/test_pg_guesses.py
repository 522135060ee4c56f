"""PostgreSQL: the neighbours a command guesses it will reach (``_near``, schema 8) under races
with other processes: a guess is only ever taken if free at once, in every attempt."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from evstore import Inventory, open_store
from tests.conftest import allocate, new_uuid
from tests.test_postgres import _another_client_holding, _spy_on_restarts, pg


async def test_a_stale_guess_taken_before_a_restart_is_not_waited_for_after_it(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper-E, review of 45795bd): a stale guess (the consumer's old provider, which
    another process moved it from) taken in a command's first attempt was kept in the lock set of
    its restart, so the restart waited for it in order: the delete below hung for as long as
    another session held a provider it does not touch. A guess is taken only if free, in every
    attempt; a restart waits only for what the loads found."""
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        backend = pg(first)
        c = new_uuid()
        old = new_uuid()
        while True:  # (the new provider sorts below the consumer: found out of order, try-locked)
            new = new_uuid()
            if backend._key(f"provider:{new}") < backend._key(f"consumer:{c}"):
                break
        for rp in (old, new):
            await first.create_provider(rp, f"rp-{rp}")
            await first.set_inventories(rp, {"VCPU": Inventory(total=8)}, generation=0)
        await allocate(first, c, {old: {"VCPU": 2}})  # first remembers c with old
        await allocate(second, c, {new: {"VCPU": 3}}, generation=1)  # another process moves it
        assert f"provider:{old}" in backend._near[f"consumer:{c}"]
        restarts = _spy_on_restarts(monkeypatch)
        attempts = 0
        real = backend._attempt
        async with (
            _another_client_holding(pg_url, first, f"provider:{new}") as (_, holding_new),
            _another_client_holding(pg_url, first, "!unused") as (holder_of_old, holding_old),
        ):

            async def attempt(*args: Any) -> Any:
                nonlocal attempts
                attempts += 1
                if attempts == 2:
                    # between the attempts: another session takes the stale provider, and the
                    # one holding the consumer's provider now lets go
                    await holder_of_old.execute(
                        "SELECT pg_advisory_xact_lock($1)", backend._key(f"provider:{old}")
                    )
                    await holding_new.rollback()
                return await real(*args)

            monkeypatch.setattr(backend, "_attempt", attempt)
            await asyncio.wait_for(first.delete_consumer(c), 10)
            assert len(restarts) == 1
            await holding_old.rollback()
        assert (await first.usage(old)).usages == {"VCPU": 0}
        assert (await first.usage(new)).usages == {"VCPU": 0}
        assert (await first.audit()).clean


async def test_a_command_naming_many_remembered_consumers_guesses_no_more_than_a_slice(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper-E): a command's guess was the union over every consumer it names, so a
    write_allocations naming 20 consumers, each remembered with its own provider, took 40 guessed
    locks (toward max_locks_per_transaction, past which the command fails) for entities it may not
    touch. Past NEAR_SLICE_MAX it guesses nothing and finds them as before."""
    import evstore.log.postgres as pg_module

    async with open_store(pg_url) as store:
        consumers = [new_uuid() for _ in range(20)]
        providers = []
        for c in consumers:
            rp = new_uuid()
            await store.create_provider(rp, f"rp-{rp}")
            await store.set_inventories(rp, {"VCPU": Inventory(total=8)}, generation=0)
            await allocate(store, c, {rp: {"VCPU": 1}})
            providers.append(rp)
        guessed: list[int] = []
        real = pg_module.lock_load

        async def spy(conn: Any, n: Any, fence: Any, keys: list[int], near: Any = ()) -> Any:
            guessed.append(len(near))
            return await real(conn, n, fence, keys, near)

        monkeypatch.setattr(pg_module, "lock_load", spy)
        target = providers[0]
        await store.write_allocations(
            {
                c: {
                    "allocations": {target: {"VCPU": 1}} if i == 0 else {},
                    "consumer_generation": 1,
                    "project_id": "p",
                    "user_id": "u",
                    "consumer_type": "INSTANCE",
                }
                for i, c in enumerate(consumers)
            }
        )
        assert guessed and max(guessed) <= pg_module.NEAR_SLICE_MAX, guessed
        assert (await store.usage(target)).usages == {"VCPU": 1}
        assert (await store.audit()).clean
