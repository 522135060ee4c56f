"""Stop 46, helper A: a login the server refuses at a read's reconnect (the role made NOLOGIN, its
password changed, a pg_hba.conf entry removed since the open) says what to check, as the open's
first connect does."""

from __future__ import annotations

import os
import random
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def test_a_login_refused_at_a_reconnect_says_what_to_check(pg_url: str) -> None:
    """Regression: a read whose pooled connection the server ended, reconnecting as a role made
    NOLOGIN since the open, was told "PostgreSQL error while connecting to ...: role ... is not
    permitted to log in" alone, where the open says to check the user, the password and
    pg_hba.conf. It says that now, not transient; a command likewise, not run."""
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    name = f"evt_s46a_lg_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {name}')
        parts = urlsplit(pg_url)
        url = urlunsplit(parts._replace(netloc=f"{name}@{parts.netloc.rsplit('@', 1)[-1]}"))
        async with open_store(url, pool_size=2) as store:
            rp = await make_provider(store, VCPU=2)
            await admin.execute(f"ALTER ROLE {name} NOLOGIN")
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
            )
            with pytest.raises(StorageError) as read:
                await store.head()
            with pytest.raises(StorageError) as command:
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
            await admin.execute(f"ALTER ROLE {name} LOGIN")
            assert await store.head() == 2
    finally:
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()
    for failed in (read.value, command.value):
        assert failed.details["sqlstate"].startswith("28"), failed.details
        assert "transient" not in failed.details
        assert "the server refused the login" in failed.message, failed.message
        assert "pg_hba.conf" in failed.message
    assert "the command was not run" in command.value.message
