"""Stop 43, helper C: the command line probed against README - the store as ``evstore upgrade``'s
"log is lost" error shows it, and more (see each test)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid


@pytest.fixture
def logging_as_it_was() -> Iterator[None]:
    """(``cli.main`` run in this process configures structlog and the root logger to print on this
    test's captured stderr, closed after it: put back as they were - see tests/test_s40_B_tail.py)"""
    config, root, aiosqlite = structlog.get_config(), logging.getLogger(), logging.getLogger("aiosqlite")
    handlers, level, aiosqlite_level = root.handlers[:], root.level, aiosqlite.level
    try:
        yield
    finally:
        structlog.configure(**config)
        root.handlers[:] = handlers
        root.setLevel(level)
        aiosqlite.setLevel(aiosqlite_level)


class _Done:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> _Done:
    """``evstore ARGS`` run by ``cli.main`` in this process (a subprocess each costs a second)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return _Done(int(done.value.code or 0), out.out, out.err)


def _store_that_lost_its_log(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})

    asyncio.run(build())
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TABLE events")
        conn.commit()


@pytest.mark.usefixtures("logging_as_it_was")
def test_upgrades_log_is_lost_error_names_the_store_as_every_error_line_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error line is plain text on stderr (``fail``: control characters shown as ``\\xNN``), not
    rich markup: the "log is lost" error showed the store through ``safe`` - rich's escaping too -
    so a path holding ``[red]`` read ``\\[red]`` there, another path than the one given, and than
    ``upgrade``'s own output line and its ``log_truncated`` error (``shown`` alone) name."""
    where = tmp_path / "[red]"
    where.mkdir()
    db = where / "s.db"
    _store_that_lost_its_log(db)
    done = _in_process(capsys, "upgrade", "--db", str(db))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.log.corrupt: "), done.stderr
    assert "the log is lost" in done.stderr, done.stderr
    assert f"the events table of sqlite:///{db} was missing" in done.stderr, done.stderr
    assert "\\[" not in done.stderr, done.stderr
