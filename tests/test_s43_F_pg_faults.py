"""PostgreSQL under what a DBA or a deployment does to a running store (stop 43, helper F): the
role's settings changed under it (``ALTER ROLE ... SET``: search_path, statement_timeout,
lock_timeout, idle_in_transaction_session_timeout, default_transaction_read_only), its sessions
ended or cancelled by an admin (``pg_terminate_backend``, ``pg_cancel_backend``) while commands
run and a subscriber follows, a table locked by another session. Each command succeeds, or fails
as ``evstore.storage`` saying whether it may have committed; afterwards the log holds exactly the
accepted ones (plus those of unknown outcome, either way), the audit is clean and the same store
goes on without being reopened."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import ProviderNotFound, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid

#: seconds of each campaign (EVSTORE_SLOW=1: longer)
SLOW = os.environ.get("EVSTORE_SLOW") == "1"
CAMPAIGN = 20.0 if SLOW else 1.5


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


def _as(url: str, role: str, *, search_path: bool = True) -> str:
    """``url`` logging in as ``role``; without its ``search_path`` (the role's default then)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if search_path or k != "search_path"]
    netloc = f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))


@pytest.fixture
async def role(pg_url: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A login role of its own, that may use and create in the test's schema (its name; an admin
    connection to change its settings)."""
    name = f"evt_s43f_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{_schema(pg_url)}" TO {name}')
        yield name, admin
    finally:
        await admin.execute(f"ALTER ROLE {name} RESET ALL")
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()


async def _end_sessions(admin: asyncpg.Connection, role: str) -> None:
    await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)


async def test_a_store_keeps_its_schema_when_the_roles_search_path_changes(
    pg_url: str, role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression: a store opened by a URL without ``search_path`` is the store of the role's
    search_path at the open; when the DBA changed the role's (``ALTER ROLE ... SET search_path``),
    each connection the pool opened after it (a reconnect after a restart, a terminated session)
    landed in the other schema: the same open store read another store's providers and log, wrote
    its commands there - under the locks of the first store's schema, not those the other's
    writers take - or failed for a table it could not find. It keeps the search_path it opened
    with."""
    name, admin = role
    from tests.pg import fresh_database_url

    other_url = fresh_database_url()  # (another store, in a schema of its own)
    await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{_schema(other_url)}" TO {name}')
    async with open_store(_as(other_url, name)) as other:
        theirs = await make_provider(other, "theirs", VCPU=10)
        their_head = await other.head()
    await admin.execute(f"ALTER ROLE {name} SET search_path = '{_schema(pg_url)}'")
    async with open_store(_as(pg_url, name, search_path=False), pool_size=3) as store:
        ours = await make_provider(store, "ours", VCPU=10)
        await allocate(store, new_uuid(), {ours: {"VCPU": 1}})
        head = await store.head()
        await admin.execute(f"ALTER ROLE {name} SET search_path = '{_schema(other_url)}'")
        await _end_sessions(admin, name)
        for _ in range(3):  # (the first may meet a connection the server ended)
            try:
                await allocate(store, new_uuid(), {ours: {"VCPU": 1}})
                break
            except StorageError as exc:
                assert exc.details.get("transient") is True, exc.details
        assert await store.head() == head + 1
        assert (await store.usage(ours))["VCPU"] == 2
        with pytest.raises(ProviderNotFound):
            await allocate(store, new_uuid(), {theirs: {"VCPU": 1}})
        assert (await store.audit()).clean
    async with open_store(_as(other_url, name)) as other:
        assert await other.head() == their_head
