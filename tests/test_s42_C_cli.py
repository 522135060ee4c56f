"""Stop 42, helper C: the command line probed against README - what an interrupted ``evstore demo``
leaves behind, and ``evstore upgrade`` run again on a store whose log was lost."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import REPO, evstore


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


def _events_in(path: Path) -> int:
    """How many events the SQLite store at ``path`` holds (beside a writer), -1 while it has no
    events table yet. (Not a read-only connection, which leaves -wal and -shm files behind.)"""
    if not path.exists():
        return -1
    try:
        conn = sqlite3.connect(path, timeout=5)
        conn.execute("PRAGMA query_only = ON")
    except sqlite3.Error:
        return -1
    try:
        return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])
    except sqlite3.Error:
        return -1
    finally:
        conn.close()


def _demo(db: Path, instances: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "evstore",
            "demo",
            "--db",
            str(db),
            "--nodes",
            "100",
            "--instances",
            str(instances),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        # (a shell's background job - CI started with `&` - inherits SIGINT ignored: give it the default)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _until(process: subprocess.Popen[str], ready: object, what: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        if callable(ready) and ready():
            return
        time.sleep(0.02)
    pytest.fail(f"the demo never {what}")


@pytest.mark.parametrize(
    ("signum", "code", "how"), [(signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")]
)
def test_a_demo_stopped_after_its_first_events_says_what_it_left(
    tmp_path: Path, signum: int, code: int, how: str
) -> None:
    """A demo stopped halfway (Ctrl-C, SIGTERM) ended with 130 or 143 and said nothing, leaving a
    store of part of the demo's events where the user expected the demo's tables. It now says how
    many events the file holds, that the demo did not finish, and that the next demo replaces the
    file (which it does: the file is one the demo wrote)."""
    db = tmp_path / "d.db"
    process = _demo(db, 20_000)  # (~20 s of work: stopped as soon as it has written something)
    try:
        _until(process, lambda: _events_in(db) > 0, "wrote an event")
        process.send_signal(signum)
        _out, err_text = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == code, err_text
    # (the file alone, as a finished demo leaves it: the looks at it after the stop - whether it
    # holds events - left a -wal and a -shm beside it, which a read-only connection makes and
    # cannot remove)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.db"]
    left = _events_in(db)
    assert left > 0
    assert err_text.startswith(f"{how} after the demo wrote {left} events"), err_text
    assert str(db) in err_text and "did not finish" in err_text, err_text
    assert f"evstore demo --db {db}" in err_text, err_text  # (how to start again)
    again = evstore("demo", "--db", str(db), "--instances", "5", "--json")
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["audit"]["clean"] is True


def test_a_postgresql_demo_interrupted_after_its_first_events_says_what_it_left(pg_url: str) -> None:
    """(on PostgreSQL the store is counted again after the stop, and the next demo refuses a
    schema with events: the line says so instead of offering to replace it)"""
    import asyncpg

    async def events() -> int:
        conn = await asyncpg.connect(pg_url)
        try:
            return int(await conn.fetchval("SELECT count(*) FROM events"))
        except asyncpg.UndefinedTableError:
            return -1
        finally:
            await conn.close()

    process = subprocess.Popen(
        [sys.executable, "-m", "evstore", "demo", "--url", pg_url, "--nodes", "100", "--instances", "20000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _until(process, lambda: asyncio.run(events()) > 0, "wrote an event")
        process.send_signal(signal.SIGINT)
        _out, err_text = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 130, err_text
    done = evstore("stats", "--url", pg_url, "--json")
    head = json.loads(done.stdout)["head"]
    assert err_text.startswith(f"interrupted after the demo wrote {head} events: "), err_text
    assert "did not finish" in err_text and "the next demo needs a store without events" in err_text


def _small_store(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})

    asyncio.run(build())


def _store_that_lost_its_log(path: Path) -> None:
    _small_store(path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("DROP TABLE events")
        conn.commit()


@pytest.mark.usefixtures("logging_as_it_was")
def test_upgrade_run_again_on_a_store_whose_log_was_lost_still_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first ``evstore upgrade`` of a store whose events table was dropped makes it again,
    empty, and says that the log is lost (exit 1, stop 41). Run again - a script retrying, a user
    checking the repair - it said "at schema version 5 already", exit 0: the store looked sound,
    while its projection still records what the lost events did (the audit's log_truncated, which
    a rebuild refuses). It now says so each time, ``evstore.log.corrupt``, exit 1, with what to do."""
    db = tmp_path / "s.db"
    _store_that_lost_its_log(db)
    first = _in_process(capsys, "upgrade", "--db", str(db))
    assert first.returncode == 1 and "the log is lost" in first.stderr, first.stdout + first.stderr

    for args in ((), ("--json",)):
        again = _in_process(capsys, "upgrade", "--db", str(db), *args)
        assert again.returncode == 1, (args, again.stdout, again.stderr)
        assert again.stderr.startswith("error: evstore.log.corrupt: "), again.stderr
        assert "lost its last events" in again.stderr and "position 3" in again.stderr, again.stderr
        assert "evstore rebuild --force" in again.stderr, again.stderr
        if args:
            assert json.loads(again.stdout)["repaired"] is None  # (nothing repaired this time)
        else:
            assert "already" not in again.stdout, again.stdout

    # once the loss is accepted (rebuild --force empties the projection), upgrade has nothing to say
    assert _in_process(capsys, "rebuild", "--db", str(db), "--force").returncode == 0
    done = _in_process(capsys, "upgrade", "--db", str(db))
    assert done.returncode == 0 and "already" in done.stdout, done.stdout + done.stderr


@pytest.mark.usefixtures("logging_as_it_was")
def test_a_demo_refusing_another_store_leaves_no_file_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``evstore demo --db FILE`` refuses a store it did not write (README: it replaces only its
    own), having looked at it read-only - a look that left FILE-wal and FILE-shm beside the other
    application's store (a read-only connection to a file in WAL mode makes them, and cannot
    remove them). The refusal now leaves the directory as it was."""
    db = tmp_path / "theirs.db"
    _small_store(db)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]
    done = _in_process(capsys, "demo", "--db", str(db))
    assert done.returncode == 1 and "is not a database the demo wrote" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("command", [("audit",), ("import", "EXPORT")])
def test_a_command_refusing_another_applications_file_leaves_no_file_beside_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: tuple[str, ...]
) -> None:
    """An SQLite file of another application, in WAL mode and closed cleanly (no -wal, no -shm):
    ``evstore audit`` refuses it (``evstore.not_found``), ``evstore import`` too (another
    application's tables), both after a read-only look that leaves FILE-wal and FILE-shm behind."""
    theirs = tmp_path / "data" / "theirs.db"
    theirs.parent.mkdir()
    with contextlib.closing(sqlite3.connect(theirs)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE x (a)")
        conn.commit()
    assert sorted(p.name for p in theirs.parent.iterdir()) == ["theirs.db"]
    export = tmp_path / "e.jsonl"
    _small_store(tmp_path / "s.db")
    assert _in_process(capsys, "export", "--db", str(tmp_path / "s.db"), "-o", str(export)).returncode == 0
    args = [str(export) if a == "EXPORT" else a for a in command]
    done = _in_process(capsys, *args, "--db", str(theirs))
    assert done.returncode == 1, done.stderr
    assert sorted(p.name for p in theirs.parent.iterdir()) == ["theirs.db"]
