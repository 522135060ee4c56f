"""Opening a SQLite store read-only (``create=False``) while another process creates it (helper-98).

The read-only open looks at the file several times before it opens it: whether it holds a store,
and if not, why not. A store created by another process between those looks - its tables and
schema version committed together - was reported as a damaged store ("has evstore's tables but no
schema version", evstore.schema.version): 13 of 100 rounds of a process creating a store while
another opened it with ``create=False`` in a loop. The test puts the other process's creation
between the looks deterministically.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from evstore import NotFound, open_store
from evstore.log import sqlite as sqlite_log
from tests.conftest import make_provider


async def test_a_store_created_between_the_read_only_opens_looks_is_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s.db"
    real = sqlite_log._holds_no_store
    looks: list[bool] = []

    def first_look_before_the_creation(p: str, deadline: float, stop: threading.Event) -> bool:
        looks.append(real(p, deadline, stop))
        # (the first look saw no file: the other process created the store just after it)
        return True if len(looks) == 1 else looks[-1]

    async with open_store(f"sqlite:///{path}") as creator:  # (the other process, done creating)
        rp = await make_provider(creator, VCPU=4)
    monkeypatch.setattr(sqlite_log, "_holds_no_store", first_look_before_the_creation)
    async with open_store(f"sqlite:///{path}", create=False) as store:
        assert (await store.provider(rp)).uuid == rp
    assert len(looks) >= 2


async def test_a_missing_file_is_still_not_found_read_only(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="the file does not exist"):
        async with open_store(f"sqlite:///{tmp_path / 'none.db'}", create=False):
            pass
    assert not (tmp_path / "none.db").exists()


async def test_a_read_only_open_that_could_not_look_at_a_locked_file_creates_no_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """create=False on an empty database that another connection held locked (BEGIN EXCLUSIVE,
    a rollback journal) for over 5 s: the read-only look (_holds_no_store) failed 'database is
    locked', which it takes for "not a database: the open reports it", and the open went on and
    created evstore's eleven tables in the file (`evstore stats --db F` writing a store). The
    look's outcome is put in place here; the open must still refuse the file, nothing created."""
    path = tmp_path / "empty.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA user_version = 7")  # (an empty database: a header, no tables)
    conn.close()
    monkeypatch.setattr(
        sqlite_log, "_holds_no_store", lambda p, deadline, stop: False
    )  # (as the locked look said)
    with pytest.raises(NotFound, match="holds no evstore tables"):
        async with open_store(f"sqlite:///{path}", create=False):
            pass
    conn = sqlite3.connect(path)
    try:
        assert conn.execute("SELECT name FROM sqlite_master").fetchall() == []
    finally:
        conn.close()
