"""Stop 44, the lead: what CI's run of stop 43's final commit found, and small things after it."""

from __future__ import annotations

import pytest

from evstore import AllocationStore, StorageError, open_store
from tests.conftest import make_provider, new_uuid


def _set_up_failing(monkeypatch: pytest.MonkeyPatch, times: int) -> dict[str, int]:
    """Makes the set-up of the next ``times`` new PostgreSQL connections (``failing["left"]``,
    which a test may raise again) fail as asyncpg does on a session the server ended under it."""
    import asyncpg

    import evstore.log.postgres as pg

    set_up = pg._init_connection
    failing = {"left": times}

    async def init(conn: object, search_path: str | None = None) -> str | None:
        if failing["left"]:
            failing["left"] -= 1
            raise asyncpg.InternalClientError(
                "cannot switch to state 15; another operation (2) is in progress"
            )
        return await set_up(conn, search_path)

    monkeypatch.setattr(pg, "_init_connection", init)
    return failing


async def test_a_new_connection_the_server_ends_during_its_set_up_fails_cleanly(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (CI's run of test_s43_F_pg_faults, idle_in_transaction_session_timeout with
    the role's sessions ended under a burst): the server ended a connection the pool had just
    opened, before its set-up statement (the session's search_path and isolation) ran, and
    asyncpg raised InternalClientError "cannot switch to state 15; another operation (2) is in
    progress" from the pool's acquire. Nothing caught it there: a keyed command was told
    "Storage failure: InternalClientError(...)", without outcome_unknown, and a read the same.
    Nothing of the command was sent: it says it was not run (outcome_unknown False), that the
    connection was lost (transient), and the next command and read go on."""

    import evstore.log.postgres as pg

    # (min_pool_size=0: the pool restores a floor of connections in a background task after a
    # lost one, whose set-up could take the failure armed for the read below - helper A saw it)
    async with open_store(pg_url, min_pool_size=0) as store:
        backend = store.backend
        assert isinstance(backend, pg.PostgresBackend) and backend._pool is not None
        rp = await make_provider(store, VCPU=8)
        failing = _set_up_failing(monkeypatch, 0)
        body = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}
        consumer = new_uuid()
        head = await store.head()
        failing["left"] = 1
        await backend._pool.expire_connections()  # (the next acquire opens a new one)
        with pytest.raises(StorageError) as failed:
            await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
        assert failed.value.details["outcome_unknown"] is False
        assert failed.value.details["transient"] is True
        assert "the command was not run" in failed.value.message
        assert "Lost the connection to PostgreSQL" in failed.value.message
        assert "Storage failure" not in failed.value.message
        assert failing["left"] == 0 and await store.head() == head

        failing["left"] = 2  # (a read tries a second new connection: stop 45 A)
        await backend._pool.expire_connections()
        with pytest.raises(StorageError) as read_failed:
            await store.usage(rp)
        assert read_failed.value.details["transient"] is True
        assert "Storage failure" not in read_failed.value.message

        await store.set_allocations(consumer, {rp: {"VCPU": 2}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_backend_bug_under_a_command_says_its_outcome_is_unknown(
    store: AllocationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error that is not evstore's, raised under a command (a backend bug), reaches its caller
    as ``StorageError("Storage failure: ...")``; the backend did not say whether the command
    committed, so the error says its outcome is unknown (``outcome_unknown`` True, as every other
    storage error of a command says one way or the other: a caller holding an idempotency key
    knows to retry with it). It said nothing before. The store goes on."""
    import evstore.log.postgres as pg
    import evstore.log.sqlite as lite

    rp = await make_provider(store, VCPU=8)
    bug = RuntimeError("a bug in a backend")

    def broken(*args: object, **kwargs: object) -> object:
        raise bug

    async def broken_async(*args: object, **kwargs: object) -> object:
        raise bug

    if isinstance(store.backend, pg.PostgresBackend):
        monkeypatch.setattr(store.backend, "_attempt", broken_async)
    else:
        monkeypatch.setattr(lite, "run_batch", broken)
    body = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", "generation": None}
    with pytest.raises(StorageError) as failed:
        await store.set_allocations(new_uuid(), {rp: {"VCPU": 1}}, idempotency_key="k-1", **body)  # type: ignore[arg-type]
    assert failed.value.message == "Storage failure: RuntimeError('a bug in a backend')"
    assert failed.value.details["outcome_unknown"] is True
    monkeypatch.undo()
    receipt = await store.set_allocations(new_uuid(), {rp: {"VCPU": 1}}, idempotency_key="k-2", **body)  # type: ignore[arg-type]
    assert receipt.positions
    assert (await store.usage(rp)).usages["VCPU"] == 1


async def test_an_open_whose_first_connection_the_server_ends_says_so(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The open's first connections meet what a burst's did (the test above): the server ends one
    before its set-up statement ran. The open fails as ``StorageError`` naming the store's URL and
    the lost session, not asyncpg's bare InternalClientError; the next open works."""

    _set_up_failing(monkeypatch, 1)
    with pytest.raises(StorageError) as failed:
        async with open_store(pg_url):
            pass
    assert failed.value.message.startswith("Cannot connect to PostgreSQL at ")
    assert "the session ended as it was set up" in failed.value.message
    assert "another operation (2) is in progress" in failed.value.message
    async with open_store(pg_url) as store:
        assert await store.head() >= 0
