"""Stop 46, helper A: a role that may not read the store (no SELECT on its tables) is told what a
read needs - not "this role may not write the store ... reads work with SELECT" (what its open
was told: the open's first read of the store is in its migration's transaction), nor the
server's "permission denied for table p_providers" alone (what its reads were told)."""

from __future__ import annotations

import os
import random
from collections.abc import AsyncIterator
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import StorageError, open_store
from evstore.log.postgres import _storage_error
from tests.conftest import make_provider


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


@pytest.fixture
async def role(pg_url: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A role of the test's own with USAGE on the store's schema (one provider in it), and the
    admin connection that grants it more."""
    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=2)
    name = f"evt_s46a_nr_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE ON SCHEMA "{_schema(pg_url)}" TO {name}')
        yield name, admin
    finally:
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()


def _says_it_may_not_read(failed: StorageError) -> None:
    assert failed.details["sqlstate"] == "42501", failed.details
    assert "reason" not in failed.details, failed.details  # (not read_only: it may not read)
    assert "this role may not read the store" in failed.message, failed.message
    assert "SELECT on its tables" in failed.message
    assert "may not write" not in failed.message


@pytest.mark.parametrize("create", [False, True])
async def test_opening_as_a_role_that_may_not_read_the_store_says_what_a_read_needs(
    pg_url: str, role: tuple[str, asyncpg.Connection], create: bool
) -> None:
    """Regression: the open's read of the schema version, in its migration's transaction, was
    told as a write: ``reason`` ``read_only``, "this role may not write the store: it lacks ...
    INSERT, UPDATE and DELETE ... reads, export, audit and time travel work with SELECT" - which
    is what the role lacks."""
    name, _ = role
    with pytest.raises(StorageError) as failed:
        async with open_store(_as(pg_url, name), create=create):
            pass
    _says_it_may_not_read(failed.value)


async def test_a_read_by_a_role_that_lost_select_on_a_table_says_what_a_read_needs(
    pg_url: str, role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression: a read of a table the role may not read ("permission denied for table
    p_providers") was told the server's words alone."""
    name, admin = role
    await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{_schema(pg_url)}" TO {name}')
    async with open_store(_as(pg_url, name), create=False) as store:
        assert len(await store.providers()) == 1
        await admin.execute(f"REVOKE SELECT ON p_providers FROM {name}")
        with pytest.raises(StorageError) as failed:
            await store.providers()
    _says_it_may_not_read(failed.value)


def test_the_sequencer_refused_for_want_of_a_privilege_is_a_write_refused() -> None:
    """(The sequencer's refusal with nothing to wait for - its UPDATE of events - is a write's:
    ``read_only``, what to grant; with the read's hint it would say the role may not read.)"""
    exc = asyncpg.exceptions.InsufficientPrivilegeError("permission denied for table events")
    assert "may not read" in _storage_error(exc, "reading the log", None).message
    failed = _storage_error(exc, "assigning positions", None, writes=True)
    assert failed.details == {"sqlstate": "42501", "reason": "read_only"}
    assert "may not write the store" in failed.message
