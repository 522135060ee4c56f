"""A store its program never closed: dropped inside a running loop, or left open at exit.

As asyncio's and sqlite3's resources do, it warns (``ResourceWarning: unclosed store
AllocationStore('<url, password hidden>')``, with where it was opened under ``python -X dev``),
lets go of its connections and writer task, and the process exits quietly; what was committed is
in the store when it is opened again.

Regression (helper B, stop 31): on ef9c98d nothing said a store was left open. On
SQLite the aiosqlite thread kept the last call it ran, the writer's drain holding the store, so a
dropped store lived on, connections and threads included, never warned of; on PostgreSQL the
store and its writer task were collected together: asyncio printed "Task was destroyed but it is
pending!" (always, not only in dev mode), and under -X dev asyncpg warned of its own connection and
transport, not of the store.
"""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from evstore import open_store
from evstore.errors import redact_url

PROVIDER = "6b143df3-2c73-42b9-b8cc-a015a322dab3"

SCRIPT = (
    "import asyncio, sys\n"
    "from evstore import open_store\n"
    "async def main():\n"
    "    store = await open_store(sys.argv[1])\n"
    f"    await store.create_provider({PROVIDER!r}, 'unclosed')\n"
    "asyncio.run(main())\n"
    "print('ended', flush=True)\n"
)

#: what no store left open may print: a thread's traceback, asyncio's lost task, the libraries'
#: own warnings about the store's connections (the store's warning names the store instead)
NOISE = (
    "Exception in thread",
    "Task was destroyed",
    "unclosed connection",
    "unclosed transport",
    "Traceback",
)


def _run(url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, *flags, "-c", SCRIPT, url], capture_output=True, text=True, timeout=120, env=env
    )


async def _committed(url: str) -> None:
    async with open_store(url) as store:
        assert await store.head() == 1
        assert await store.providers() == [(PROVIDER, "unclosed")]
        assert (await store.audit()).clean


async def test_a_store_left_open_at_exit_warns_and_the_process_exits_quietly(store_url: str) -> None:
    shown = redact_url(store_url)
    done = _run(store_url, "-X", "dev")
    assert done.returncode == 0 and "ended" in done.stdout, done.stderr[-3000:]
    assert f"ResourceWarning: unclosed store AllocationStore({shown!r})" in done.stderr, done.stderr[-3000:]
    assert "opened at (most recent call last)" in done.stderr and "in main" in done.stderr, done.stderr
    for noise in NOISE:
        assert noise not in done.stderr, done.stderr[-3000:]
    password = urlsplit(store_url).password
    assert not password or password not in done.stderr
    await _committed(store_url)


def test_a_store_left_open_at_exit_raises_its_warning_where_warnings_are_errors(tmp_path: Path) -> None:
    """``-W error::ResourceWarning``: the warning is raised in ``__del__``, which Python reports as
    "Exception ignored in", as for any resource; no thread dies of it, the process ends normally,
    and the commit is there."""
    url = f"sqlite:///{tmp_path / 'unclosed.db'}"
    done = _run(url, "-W", "error::ResourceWarning")
    assert done.returncode == 0 and "ended" in done.stdout, done.stderr[-3000:]
    assert "Exception ignored in: <function AllocationStore.__del__" in done.stderr, done.stderr
    assert "ResourceWarning: unclosed store" in done.stderr and "Exception in thread" not in done.stderr
    asyncio.run(_committed(url))


async def test_a_store_dropped_in_a_running_loop_warns_and_lets_go_of_its_connections(store_url: str) -> None:
    store = await open_store(store_url)
    await store.create_provider(PROVIDER, "unclosed")
    backend, writer, dropped = store.backend, store._writer, weakref.ref(store)
    threads = [
        getattr(conn, "_thread", conn)
        for conn in {getattr(backend, n, None) for n in ("_writer", "_reader")}
        if conn
    ]
    with pytest.warns(ResourceWarning, match=r"^unclosed store AllocationStore\(") as caught:
        del store
        for _ in range(100):  # (its writer may still be on its way back from the command's batch)
            gc.collect()
            if caught:
                break
            await asyncio.sleep(0.01)
    # (collected: only the warning's ``source`` - the store, as asyncio's warnings give theirs -
    # holds it now, recorded by pytest)
    assert caught[0].source is dropped() is not None, "the store outlived its program's last reference to it"
    assert repr(redact_url(store_url)) in str(caught[0].message)
    await asyncio.sleep(0.05)
    assert writer is not None and writer.done()
    assert getattr(backend, "_pool", None) is None and getattr(backend, "_writer", None) is None
    for thread in threads:  # (SQLite: each connection's thread closed it and ended)
        await asyncio.to_thread(thread.join, 10)
        assert not thread.is_alive()
    await _committed(store_url)


async def test_a_closed_store_dropped_says_nothing(store_url: str, recwarn: pytest.WarningsRecorder) -> None:
    async with open_store(store_url) as store:
        await store.create_provider(PROVIDER, "unclosed")
    del store
    gc.collect()
    assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
