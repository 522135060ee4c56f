"""Stop 46, helper A2: the error of a connect made after the open - a read's, a command's, the
pool's reopening of its min_pool_size connections - is redacted of the URL's passwords as the
open's first connect's is (:func:`evstore.errors.redact_text`), in the error's message and in the
log line of the pool's floor."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest
import structlog

from evstore import StorageError, open_store
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


def _as(url: str, role: str, password: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}:{password}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def test_a_login_refused_at_a_reconnect_is_redacted_as_at_the_open(pg_url: str) -> None:
    """Regression: a role whose password is its own name (a development setup's ``evstore:evstore``),
    made NOLOGIN since the open: the open's refusal says ``role '***' is not permitted to log in``
    (redact_text hides the password's text wherever the server's message shows it), but a read's
    and a command's reconnect said ``role "<the password>" ...`` as the server wrote it. Both say
    it as the open does now.
    (A real server path, no patching: the password is in the server's text because it is the
    role's name.)"""
    schema = _schema(pg_url)
    name = f"evt_s46a2_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    url = _as(pg_url, name, name)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER PASSWORD '{name}'")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {name}')
        async with open_store(url, pool_size=2) as store:
            backend = store.backend
            assert isinstance(backend, PostgresBackend) and backend._pool is not None
            rp = await make_provider(store, VCPU=2)
            await admin.execute(f"ALTER ROLE {name} NOLOGIN")
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", name
            )
            with pytest.raises(StorageError) as read:
                await store.head()
            with pytest.raises(StorageError) as command:
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        with pytest.raises(StorageError) as opened:
            async with open_store(url):
                pass
    finally:
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()
    refused = "role '***' is not permitted to log in"
    assert refused in opened.value.message, opened.value.message
    for failed in (read.value, command.value):
        assert refused in failed.message, failed.message
        assert f'role "{name}"' not in failed.message, failed.message
        assert failed.details["sqlstate"] == "28000", failed.details
        assert "the server refused the login" in failed.message
    assert "the command was not run" in command.value.message


@pytest.mark.parametrize("configured", [True, False], ids=["logging_configured", "not_configured"])
async def test_the_pools_floor_warning_is_redacted(
    pg_url: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, configured: bool
) -> None:
    """Regression: the pool's floor (min_pool_size 1) reopened while the server refuses the login of
    a role whose password is its name: asyncpg's warning reached the configured logging's handlers
    (the CLI's prints the error's first line) with the server's text as it was, the password in
    it, and where the logging is not configured evstore's ``postgres.pool_floor_retry`` line
    did too; now the record names the error redacted, without its traceback, and the line says
    it as the open would."""
    pool_logger = logging.getLogger("asyncpg.pool")
    if not configured:  # (no handler reaches asyncpg's logger: the line is evstore's, structlog's)
        monkeypatch.setattr(pool_logger, "propagate", False)
        assert not pool_logger.hasHandlers()
    schema = _schema(pg_url)
    name = f"evt_s46a2_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER PASSWORD '{name}'")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {name}')
        async with open_store(_as(pg_url, name, name)) as store:
            backend = store.backend
            assert isinstance(backend, PostgresBackend) and backend._pool is not None
            pool = backend._pool
            await admin.execute(f"ALTER ROLE {name} NOLOGIN")
            tried = asyncio.Event()
            connect = pool._connect

            async def noted(*args: object, **kwargs: object) -> object:
                tried.set()
                return await connect(*args, **kwargs)

            pool._connect = noted
            try:
                with (
                    caplog.at_level(logging.WARNING, "asyncpg.pool"),
                    structlog.testing.capture_logs() as logs,
                ):
                    conn = await pool.acquire()
                    conn.terminate()  # (the floor's one connection lost: the pool reopens it, refused)
                    await pool.release(conn)
                    async with asyncio.timeout(10):
                        await tried.wait()
                    for _ in range(100):  # (logged once the refused connect has failed)
                        if any("floor" in r.getMessage() for r in caplog.records) or any(
                            e["event"] == "postgres.pool_floor_retry" for e in logs
                        ):
                            break
                        await asyncio.sleep(0.02)
            finally:
                pool._connect = connect
                await admin.execute(f"ALTER ROLE {name} LOGIN")
    finally:
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()
    lines = [e for e in logs if e["event"] == "postgres.pool_floor_retry"]
    floor = [r for r in caplog.records if r.name == "asyncpg.pool" and "floor" in r.getMessage()]
    if not configured:
        assert lines and not floor, (logs, caplog.records)
        for line in lines:
            assert "role '***' is not permitted to log in" in line["error"], line
            assert f"'{name}'" not in line["error"] and f'"{name}"' not in line["error"], line
        return
    assert floor and not lines, (logs, caplog.records)
    for record in floor:
        assert "role '***' is not permitted to log in" in record.getMessage(), record.getMessage()
        assert name not in record.getMessage()
        assert record.exc_info is None
