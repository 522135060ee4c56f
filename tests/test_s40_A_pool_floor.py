"""asyncpg's pool warns "Failed to restore the pool connection floor; retrying", with the
connect's traceback, at each failed try to reopen the ``min_pool_size`` connections it keeps
(after one was lost, while the server is down or refuses it: tries after 1 s, 2 s, ... 60 s).
Where the logging is not configured, Python printed each on stderr, some 40 lines a try for as
long as an outage lasted. evstore logs those of its pools through structlog instead, a line each;
a configured logging still gets asyncpg's record, and an error that is no connection's keeps its
traceback (stop 40, helper A)."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from evstore import open_store
from evstore.log.postgres import PostgresBackend

ROOT = Path(__file__).resolve().parent.parent

#: a program that embeds evstore without configuring logging: its pool's floor connection lost
#: and the reconnect refused (a server down), then failing as a bug would
PROGRAM = """
import asyncio, sys
from evstore import open_store

async def main():
    async with open_store(sys.argv[1]) as store:
        pool = store.backend._pool
        connect = pool._connect
        for error in (ConnectionRefusedError(111, "Connect call failed"), ZeroDivisionError("a bug")):
            tried = asyncio.Event()

            async def failing(*args, **kwargs):
                tried.set()
                raise error

            pool._connect = failing
            conn = await pool.acquire()
            conn.terminate()  # (the floor's one connection lost: the pool tries to reopen it)
            await pool.release(conn)
            await asyncio.wait_for(tried.wait(), 10)  # (its warning is logged in the same step)
            print("tried", file=sys.stderr, flush=True)
            pool._connect = connect
            while pool.get_size() < 1:  # (reopened at the pool's next try, 1 s later)
                await asyncio.sleep(0.01)
        await store.head()

asyncio.run(main())
"""


def test_the_floor_warning_of_a_pool_is_a_line_of_structlog_where_logging_is_not_configured(
    pg_url: str,
) -> None:
    """Regression: the warning came with a traceback on stderr, at every try; now it is
    ``postgres.pool_floor_retry``, one line with the error. A bug's error keeps asyncpg's
    warning and its traceback."""
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, pg_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    refused, bug = done.stderr.split("tried\n")[:2]
    assert "Failed to restore the pool connection floor" not in refused and "Traceback" not in refused, (
        refused
    )
    lines = [line for line in done.stdout.splitlines() if "postgres.pool_floor_retry" in line]
    assert len(lines) == 1 and "Connect call failed" in lines[0] and "min_pool_size (1)" in lines[0], (
        done.stdout
    )
    assert "Failed to restore the pool connection floor" in bug and "ZeroDivisionError: a bug" in bug, bug


async def test_a_configured_logging_still_gets_asyncpgs_warning(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the logging is configured (here pytest's handlers), its handlers get asyncpg's
    record as before, and evstore logs nothing of its own for it."""
    async with open_store(pg_url) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend) and backend._pool is not None
        pool = backend._pool

        tried = asyncio.Event()

        async def refused(*args: object, **kwargs: object) -> None:
            tried.set()
            raise ConnectionRefusedError(111, "Connect call failed")

        connect = pool._connect
        pool._connect = refused
        try:
            with caplog.at_level(logging.WARNING, "asyncpg.pool"), structlog.testing.capture_logs() as logs:
                conn = await pool.acquire()
                conn.terminate()  # (the floor's one connection lost: the pool tries to reopen it)
                await pool.release(conn)
                async with asyncio.timeout(10):
                    await tried.wait()  # (its warning is logged in the same step)
        finally:
            pool._connect = connect
        floor = [r for r in caplog.records if r.name == "asyncpg.pool" and "floor" in r.getMessage()]
        assert floor and floor[0].exc_info is not None, caplog.records
        assert not [e for e in logs if e["event"] == "postgres.pool_floor_retry"], logs
        assert await store.head() == 0
