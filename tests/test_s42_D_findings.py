"""Stop 42 helper D's finding in evstore/cli.py (a strict xfail until the lead fixed it in 7ef4223)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from evstore import open_store
from tests.conftest import make_provider
from tests.test_cli_support import evstore


def test_tail_after_a_position_over_a_row_nested_too_deeply_is_no_internal_error(tmp_path: Path) -> None:
    """``evstore tail --after N`` learns the providers' names from the events after N; a provider
    event's payload altered into JSON nested deeper than the recursion limit made it fail as
    ``evstore.internal`` ("a bug in evstore") before listing anything, where a payload that is no
    JSON at all is listed up to the damaged row and reported there (``evstore.log.corrupt``)."""
    db = tmp_path / "s.db"

    async def fill() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            for name in ("a", "b", "c", "d"):
                await make_provider(store, name)

    asyncio.run(fill())
    with sqlite3.connect(db) as conn:
        conn.execute(
            "UPDATE events SET data = ? WHERE position = 4", ('{"provider":' + "[" * 5000 + "]" * 5000 + "}",)
        )
    done = evstore("tail", "--after", "1", "--no-follow", "--limit", "2", "--db", str(db))
    assert "evstore.internal" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
