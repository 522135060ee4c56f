"""Storage under failure (stop 39, helper D): PostgreSQL's insufficient-resources errors (SQLSTATE
class 53) each with its own ``details["reason"]`` and what to do."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import StorageError, open_store
from evstore.log import postgres
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid

#: class 53's conditions other than disk_full: (SQLSTATE, asyncpg's class, reason, a word of the advice)
SHORTAGES = [
    ("53000", asyncpg.exceptions.InsufficientResourcesError, "insufficient_resources", "lower the load"),
    ("53200", asyncpg.exceptions.OutOfMemoryError, "out_of_memory", "memory"),
    ("53300", asyncpg.exceptions.TooManyConnectionsError, "too_many_connections", "pool_size"),
    (
        "53400",
        asyncpg.exceptions.ConfigurationLimitExceededError,
        "configuration_limit_exceeded",
        "raise that",
    ),
]


@pytest.mark.parametrize(("sqlstate", "cls", "reason", "advice"), SHORTAGES)
def test_a_resource_shortage_of_the_server_has_its_reason_and_says_what_to_do(
    sqlstate: str, cls: type[asyncpg.PostgresError], reason: str, advice: str
) -> None:
    """Regression: SQLSTATEs 53000, 53200, 53300 and 53400 came back as a bare "PostgreSQL error"
    with no ``details["reason"]``, unlike 53100 (disk_full): a caller could not tell the server
    out of memory or connections from any other error, nor read what to do."""
    for committing in (None, False):
        failed = postgres._storage_error(cls("no room for it"), "running a command", committing)
        assert failed.code == "evstore.storage"
        assert failed.details["sqlstate"] == sqlstate
        assert failed.details["reason"] == reason, failed.details
        assert advice in failed.message and "retry" in failed.message, failed.message
        if committing is False:
            assert failed.details["outcome_unknown"] is False
            assert failed.message.endswith("it was rolled back")
        else:
            assert "rolled back" not in failed.message
    # (an unknown condition of the class is the class's)
    unknown = asyncpg.PostgresError("something short")
    unknown.sqlstate = "53999"  # type: ignore[attr-defined]
    assert postgres._storage_error(unknown, "reading", None).details["reason"] == "insufficient_resources"


_RAISE = (
    "CREATE OR REPLACE FUNCTION s39_short() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN "
    "RAISE EXCEPTION 'short of it' USING ERRCODE = '{code}'; END $f$"
)


@pytest.mark.parametrize(("sqlstate", "reason"), [(s, r) for s, _, r, _ in SHORTAGES])
async def test_a_command_meeting_a_resource_shortage_says_so_and_the_store_goes_on(
    pg_url: str, sqlstate: str, reason: str
) -> None:
    """The same from a command whose write the server refused (a trigger raises the SQLSTATE where
    the server would): rolled back, its reason said, and the same command goes through after."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=10)
        before = await store.head()
        await store.backend.tamper(_RAISE.format(code=sqlstate))  # type: ignore[attr-defined]
        await store.backend.tamper(  # type: ignore[attr-defined]
            "CREATE TRIGGER s39_short BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION s39_short()"
        )
        consumer = new_uuid()
        with pytest.raises(StorageError) as caught:
            await allocate(store, consumer, {rp: {"VCPU": 1}})
        assert caught.value.details["reason"] == reason
        assert caught.value.details["sqlstate"] == sqlstate
        assert caught.value.details["outcome_unknown"] is False
        assert await store.head() == before
        await store.backend.tamper("DROP TRIGGER s39_short ON events")  # type: ignore[attr-defined]
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        assert await store.head() == before + 1
        assert (await store.audit()).clean


@pytest.fixture
async def limited_role(pg_url: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A role of its own on the test schema (its name; an admin connection to change its limit)."""
    schema = dict(p.split("=", 1) for p in urlsplit(pg_url).query.split("&"))["search_path"]
    role = f"evt_s39d_{os.getpid()}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {role}')
        yield role, admin
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def test_too_many_connections_at_open_and_while_running_says_so(
    pg_url: str, limited_role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression: an open the server refused a connection (too many connections for the role)
    raised a StorageError with no ``sqlstate`` and no ``reason``, saying nothing of what to do; one
    refused a further connection while running said "too_many_connections" only in the server's
    words. Both have ``details["reason"] == "too_many_connections"`` and name the limits; the
    store recovers once a slot is free, without reopening."""
    role, admin = limited_role
    url = _as(pg_url, role)
    await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
    with pytest.raises(StorageError) as caught:
        async with open_store(url):
            pass
    assert caught.value.details["sqlstate"] == "53300"
    assert caught.value.details["reason"] == "too_many_connections"
    assert "CONNECTION LIMIT" in caught.value.message and "pool_size" in caught.value.message
    await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 1")
    async with open_store(url, pool_size=3, min_pool_size=1, connect_timeout=0.3) as store:
        rp = await make_provider(store, VCPU=10)
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        async with backend._connection():  # (the role's one slot, held: a read needs another)
            with pytest.raises(StorageError) as caught:
                await store.head()
            with pytest.raises(StorageError) as refused:
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        for failed in (caught.value, refused.value):
            assert failed.details.get("reason") == "too_many_connections", (failed.details, failed.message)
            assert failed.details["sqlstate"] == "53300"
            assert "CONNECTION LIMIT" in failed.message and "pool_size" in failed.message
        assert refused.value.details["outcome_unknown"] is False
        assert await store.head() == 2
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert (await store.audit()).clean
