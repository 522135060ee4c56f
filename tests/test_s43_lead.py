"""Stop 43, the lead: small things the helpers' reports asked for."""

from __future__ import annotations

import pytest

from evstore import AllocationStore, IdempotencyConflict, open_store
from tests.conftest import make_provider, new_uuid


async def test_an_idempotency_conflict_says_what_to_do(store: AllocationStore) -> None:
    """A key reused for another command is refused, and the message says what a key is for (a
    retry repeats its command exactly) and what to do (a new key for a new command); nothing is
    written."""
    rp = await make_provider(store, VCPU=8)
    consumer = new_uuid()
    body = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}
    await store.set_allocations(consumer, {rp: {"VCPU": 1}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
    head = await store.head()
    with pytest.raises(IdempotencyConflict) as refused:
        await store.set_allocations(new_uuid(), {rp: {"VCPU": 2}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
    assert refused.value.code == "evstore.idempotency.conflict"
    assert "a retry repeats its command exactly; give a new command a new key" in str(refused.value)
    assert refused.value.details["idempotency_key"] == "k-1"
    assert await store.head() == head


async def test_a_release_racing_the_loss_of_its_connection_keeps_the_commands_outcome(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (the slow run of test_s43_F_pg_faults under pg_terminate_backend): asyncpg's
    release of a connection lost meanwhile - its holder already given back by the loss - raises
    InternalClientError "release() called on a free connection holder". Raised from the store's
    give-back, it replaced the outcome of the command that had used the connection: a committed
    command was told "Storage failure" (no outcome_unknown), as a read was. The release is done
    then: the command's receipt stands, and the store goes on."""
    import asyncpg

    from evstore.log.postgres import PostgresBackend

    async with open_store(pg_url) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend) and backend._pool is not None
        released = asyncpg.pool.Pool.release
        failing = {"left": 0}

        async def release(pool: asyncpg.Pool, conn: object, *, timeout: float | None = None) -> None:
            await released(pool, conn, timeout=timeout)  # type: ignore[arg-type]
            if failing["left"]:
                failing["left"] -= 1
                raise asyncpg.InternalClientError(
                    "PoolConnectionHolder.release() called on a free connection holder"
                )

        monkeypatch.setattr(asyncpg.pool.Pool, "release", release)
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        failing["left"] = 3
        receipt = await store.set_allocations(
            consumer, {rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="I", generation=None
        )
        assert receipt.positions and failing["left"] < 3
        failing["left"] = 3
        assert (await store.allocations(consumer)).allocations == {rp: {"VCPU": 2}}
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_malformed_class_name_is_in_details_as_given(store: AllocationStore) -> None:
    """details["resource_class"] of a malformed name is the name as given (helper A: it was its
    repr in quotes, "'vcpu'", where every other refusal has the plain name); one that is no text
    keeps its repr. InvalidInventoryValue, which set_inventories raises, is importable from evstore."""
    import evstore
    from evstore import InvalidInput, InvalidInventoryValue

    rp = await make_provider(store, VCPU=8)
    with pytest.raises(InvalidInput) as refused:
        await store.set_allocations(
            new_uuid(), {rp: {"vcpu": 1}}, project_id="p", user_id="u", consumer_type="I", generation=None
        )
    assert refused.value.details["resource_class"] == "vcpu"
    assert "InvalidInventoryValue" in evstore.__all__ and issubclass(InvalidInventoryValue, InvalidInput)
