"""Fresh PostgreSQL stores for tests: one new schema per test, in the database named by
``EVSTORE_TEST_POSTGRES_URL``.

A schema costs one ``CREATE SCHEMA`` (milliseconds, unlike a database); the store URL selects it
with ``?search_path=<schema>`` (asyncpg passes unknown URL parameters as server settings). Schemas
made by this process are dropped at exit; those left by killed runs on this machine are dropped on
the next run (schema names carry a hash of the host name: a pid means nothing on another machine).
Without a configured server the PostgreSQL tests are skipped; under CI (``CI=true``) that is a
failure instead, so CI cannot silently stop testing PostgreSQL.
"""

from __future__ import annotations

import asyncio
import atexit
import hashlib
import itertools
import os
import re
import socket
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest

ENV = "EVSTORE_TEST_POSTGRES_URL"
PREFIX = "evt_"
T = TypeVar("T")

#: this machine (or container), in schema names: the sweep of schemas left by killed runs drops
#: only its own (another machine sharing the server has other pids, alive or not)
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_counter = itertools.count(1)
_created: list[str] = []
_swept = False


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def server_url() -> str:
    """The configured server URL; skips the test without one (fails it under CI)."""
    url = os.environ.get(ENV, "").strip()
    if not url:
        if in_ci():
            pytest.fail(f"{ENV} is not set but CI=true: PostgreSQL must be tested in CI (see .ci/postgres)")
        pytest.skip(f"no PostgreSQL server: set {ENV}=postgresql://user@host:port/db to run these tests")
    return url


def with_search_path(url: str, schema: str) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if k != "search_path"]
    query.append(("search_path", schema))
    return urlunsplit(parts._replace(query=urlencode(query)))


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from sync code, even if an event loop runs in this thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def _create_schema(url: str, schema: str, sweep: bool) -> None:
    conn = await asyncpg.connect(url)
    try:
        if sweep:
            for row in await conn.fetch(
                "SELECT nspname FROM pg_namespace WHERE nspname LIKE $1", PREFIX.replace("_", r"\_") + "%"
            ):
                # only this machine's (container's) schemas: a pid is meaningless on another one
                match = re.fullmatch(rf"{PREFIX}{HOST}_(\d+)_\d+", row["nspname"])
                if match and not _alive(int(match.group(1))):
                    await conn.execute(f'DROP SCHEMA IF EXISTS "{row["nspname"]}" CASCADE')
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


async def _drop_schemas(url: str, schemas: list[str]) -> None:
    conn = await asyncpg.connect(url)
    try:
        for schema in schemas:
            await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def _cleanup() -> None:
    url = os.environ.get(ENV, "").strip()
    if url and _created:
        try:
            run_sync(_drop_schemas(url, list(_created)))
        except (OSError, RuntimeError, asyncpg.PostgresError):
            pass  # a throwaway cluster may already be gone


def fresh_database_url() -> str:
    """A URL to a fresh, empty store (a new schema) on the configured PostgreSQL server."""
    global _swept
    base = server_url()
    schema = f"{PREFIX}{HOST}_{os.getpid()}_{next(_counter)}"
    run_sync(_create_schema(base, schema, sweep=not _swept))
    if not _swept:
        _swept = True
        atexit.register(_cleanup)
    _created.append(schema)
    return with_search_path(base, schema)
