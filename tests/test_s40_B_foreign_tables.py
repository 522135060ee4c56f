"""Stop 40, helper B: the import's look for another application's tables (``foreign_tables``)
waits for a lock as the store's open does, up to its busy_timeout, and says a file it cannot read
as the open says it - never "no other tables"."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from evstore.errors import StorageError
from evstore.log.sqlite import foreign_tables
from tests.test_cli_support import demo_db, evstore


def _app_file(path: Path) -> Path:
    conn = sqlite3.connect(path)
    with conn:
        conn.execute("CREATE TABLE users (id INTEGER, name TEXT)")
    conn.close()
    return path


@contextmanager
def _locked(path: Path) -> Iterator[sqlite3.Connection]:
    """``path`` (in rollback-journal mode) held under an exclusive lock by another connection:
    no reader gets in until it is let go of."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("BEGIN EXCLUSIVE")
    try:
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def test_a_file_locked_past_busy_timeout_is_a_busy_error_not_no_tables(tmp_path: Path) -> None:
    """Before: the look waited sqlite3's default 5 s, whatever busy_timeout said, then answered
    [] ("no foreign tables") for a file that holds one."""
    path = _app_file(tmp_path / "app.db")
    with _locked(path), pytest.raises(StorageError) as info:
        foreign_tables(f"sqlite:///{path}?busy_timeout=0.3")
    assert info.value.code == "evstore.storage"
    assert info.value.details["sqlite_error"] == "busy"
    assert "database is locked" in info.value.message
    assert "longer than busy_timeout (0.3 s)" in info.value.message
    assert "retry, or open the store with a longer busy_timeout" in info.value.message
    assert foreign_tables(f"sqlite:///{path}?busy_timeout=0.3") == ["users"]  # (let go of: read)


def test_a_lock_let_go_of_within_busy_timeout_is_waited_for(tmp_path: Path) -> None:
    path = _app_file(tmp_path / "app.db")
    with _locked(path) as holder:
        letting_go = threading.Timer(0.5, lambda: holder.execute("ROLLBACK"))
        letting_go.start()
        assert foreign_tables(f"sqlite:///{path}?busy_timeout=10") == ["users"]
        letting_go.join()


def test_a_file_that_is_not_a_database_is_said_as_the_open_says_it(tmp_path: Path) -> None:
    """Before: [] - no other tables - for a file the look could not read."""
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are notes, not a database" * 100)
    with pytest.raises(StorageError) as info:
        foreign_tables(f"sqlite:///{path}")
    assert info.value.details["reason"] == "not_a_database"
    assert info.value.message.startswith(f"Cannot open sqlite:///{path}: file is not a database (")


def test_missing_empty_and_evstore_files_hold_no_other_tables(tmp_path: Path) -> None:
    assert foreign_tables(f"sqlite:///{tmp_path / 'absent.db'}") == []
    (tmp_path / "empty.db").touch()
    assert foreign_tables(f"sqlite:///{tmp_path / 'empty.db'}") == []
    store = demo_db(tmp_path / "store.db", instances=2, nodes=2)
    assert foreign_tables(f"sqlite:///{store}") == []
    assert foreign_tables("sqlite://") == []


_HOLD = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("ROLLBACK")
"""


def test_the_import_names_the_other_tables_after_a_lock_held_over_5_s(tmp_path: Path) -> None:
    """Before: with another application's file locked for 6 s (busy_timeout 30 s, the default),
    the look answered "no other tables" after 5 s, and the import went on to the store's open,
    which refused the file with another code and message (evstore.storage "Not an evstore
    database"). Now it waits as the open does and refuses it as an import says it."""
    source = demo_db(tmp_path / "source.db", instances=2, nodes=2)
    dump = tmp_path / "d.jsonl"
    assert evstore("export", "--db", str(source), "-o", str(dump)).returncode == 0
    path = _app_file(tmp_path / "app.db")
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), "6"], stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        done = evstore("import", str(dump), "--db", str(path), timeout=60)
        holder.wait(timeout=30)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.invalid_input: "), done.stderr
    assert "another application's tables (users)" in done.stderr, done.stderr


def test_the_import_says_a_file_locked_past_busy_timeout_is_locked(tmp_path: Path) -> None:
    source = demo_db(tmp_path / "source.db", instances=2, nodes=2)
    dump = tmp_path / "d.jsonl"
    assert evstore("export", "--db", str(source), "-o", str(dump)).returncode == 0
    path = _app_file(tmp_path / "app.db")
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), "8"], stdout=subprocess.PIPE, text=True
    ) as holder:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        done = evstore("import", str(dump), "--url", f"sqlite:///{path}?busy_timeout=0.5", timeout=60)
        holder.kill()
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.storage: Cannot open sqlite:///"), done.stderr
    assert "database is locked" in done.stderr and "busy_timeout (0.5 s)" in done.stderr, done.stderr
    assert not done.stdout
