"""Stop 41, helper J: small command-line items - a uuid argument pasted with spaces around it,
``evstore upgrade`` of a store whose log table was dropped, ``export -o FIFO`` with no reader."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import REPO, evstore


def _small_store(path: Path) -> tuple[str, str]:
    """A SQLite store holding one provider and one consumer's allocation on it: (provider, consumer)."""

    async def build() -> tuple[str, str]:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            consumer = new_uuid()
            await allocate(store, consumer, {provider: {"VCPU": 2}})
            return provider, consumer

    return asyncio.run(build())


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


@pytest.mark.usefixtures("logging_as_it_was")
def test_a_uuid_argument_pasted_with_spaces_around_it_is_taken_as_the_uuid(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--at " 5"`` was trimmed, a uuid argument was not: ``history " <uuid> "`` (pasted from a
    table, a log line) was refused as malformed (exit 1). Every uuid argument now trims the
    whitespace around it, as --at does; what is inside is checked as before."""
    db = tmp_path / "s.db"
    provider, consumer = _small_store(db)
    where = ("--db", str(db), "--json")
    spaced_consumer, spaced_provider = f" {consumer.upper()}\t", f"\u00a0{provider} \n"

    done = _in_process(capsys, "history", spaced_consumer, *where)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["uuid"] == consumer
    done = _in_process(capsys, "history", spaced_provider, *where)
    assert done.returncode == 0, done.stderr
    for option, given, at in (
        ("--consumer", spaced_consumer, ()),
        ("--consumer", spaced_consumer, ("--at", " 3 ")),
        ("--provider", spaced_provider, ()),
        ("--provider", spaced_provider, ("--at", "3")),
    ):
        done = _in_process(capsys, "state", option, given, *at, *where)
        assert done.returncode == 0, (option, at, done.stderr)
        assert consumer in done.stdout and provider in done.stdout, (option, at, done.stdout)
    # (a uuid the log names and that is no migration: the command's own refusal, past the parse)
    done = _in_process(capsys, "confirm-migration", spaced_consumer, *where)
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.not_found: "), done.stderr
    done = _in_process(capsys, "release", spaced_consumer, *where)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["consumer"] == consumer
    # what is inside the spaces is checked as before; only spaces remain a usage error
    for bad in (f" {consumer[:-1]} ", f"{consumer[:8]} {consumer[9:]}"):
        done = _in_process(capsys, "history", bad, *where)
        assert done.returncode == 1 and done.stderr.startswith(
            "error: evstore.invalid_input: Malformed uuid"
        ), done.stderr
    done = _in_process(capsys, "history", "  ", *where)
    assert done.returncode == 2 and done.stderr.startswith("error: evstore.usage: "), done.stderr


def _drop_the_log(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("DROP TABLE events")
    conn.close()


def test_upgrade_of_a_store_whose_events_table_was_dropped_says_the_log_is_lost(tmp_path: Path) -> None:
    """``evstore upgrade`` made the dropped ``events`` table again, empty, and said only "repaired:
    made events again", exit 0 - as if all were well, where every event the store held was gone. It
    now says that the log is lost and what to do (a backup, an export), exit 1 with
    ``evstore.log.corrupt`` (the store stays damaged: an error a script sees), and the projection,
    which still records the lost events, is left for the audit to show."""
    db = tmp_path / "s.db"
    _, consumer = _small_store(db)
    _drop_the_log(db)

    done = evstore("upgrade", "--db", str(db))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "made events again" in done.stdout and "the events it held are lost" in done.stdout
    assert done.stderr.startswith("error: evstore.log.corrupt: "), done.stderr
    assert "the log is lost" in done.stderr and "backup" in done.stderr and "evstore import" in done.stderr
    assert "up to position 3" in done.stderr, done.stderr  # (the allocation, position 3)
    audit = evstore("audit", "--db", str(db))
    assert audit.returncode == 3 and consumer in audit.stdout, audit.stdout + audit.stderr

    # --json: the same keys as ever, the same refusal on stderr
    db2 = tmp_path / "s2.db"
    _small_store(db2)
    _drop_the_log(db2)
    done = evstore("upgrade", "--db", str(db2), "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    assert json.loads(done.stdout)["repaired"]["made_again"] == ["events"]
    assert done.stderr.startswith("error: evstore.log.corrupt: "), done.stderr


@pytest.mark.parametrize("lost", ["an index", "a projection table"])
def test_upgrade_repairing_anything_but_the_log_still_exits_0(tmp_path: Path, lost: str) -> None:
    """(the other repairs keep their one line and exit 0: the log is whole, the projection refolded)"""
    db = tmp_path / "s.db"
    _small_store(db)
    with sqlite3.connect(db) as conn:
        if lost == "an index":
            name = conn.execute(
                "SELECT name FROM sqlite_master WHERE type = 'index' AND sql IS NOT NULL"
            ).fetchone()[0]
            conn.execute(f"DROP INDEX {name}")
        else:
            conn.execute("DROP TABLE p_consumers")
    conn.close()
    done = evstore("upgrade", "--db", str(db))
    assert done.returncode == 0 and "error:" not in done.stderr, done.stdout + done.stderr
    assert "repaired: made " in done.stdout and "lost" not in done.stdout, done.stdout


def _waiting_at(process: subprocess.Popen[str], db: Path) -> None:
    """Until ``process`` has the store ``db`` open (its signal handlers are in place by then: the
    export then goes on to open its output)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()
        with contextlib.suppress(OSError):
            if any(os.readlink(fd) == str(db) for fd in Path(f"/proc/{process.pid}/fd").iterdir()):
                time.sleep(0.5)  # (on to the open of the FIFO: the signal lands there, or before)
                return
        time.sleep(0.05)
    pytest.fail("the export never opened its store")


@contextlib.contextmanager
def _as_a_background_job(yes: bool) -> Iterator[None]:
    """Inside ``with`` (around a Popen): this process ignores SIGINT, as a non-interactive shell
    starts a background job (``.ci/run &``), so that the child inherits SIGINT ignored unless it
    is given the default back (the ``preexec_fn`` below)."""
    if not yes:
        yield
        return
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="reads /proc/PID/fd")
@pytest.mark.parametrize(
    ("signum", "code", "background"),
    [
        (signal.SIGTERM, 143, False),
        (signal.SIGINT, 130, False),
        # Stop 42, helper C: the one CI run (of edaeb13) in which the first SIGINT did not end the
        # export - no output, SIGTERM's case passing - ran the suite as a shell's background job,
        # whose children inherit SIGINT ignored; the test then gave the child no default back, so
        # the export never saw the signal and waited for its reader. That is reproduced at will by
        # running edaeb13's test from `sh -c 'pytest ... & wait'`; with the ``preexec_fn`` (from
        # a491618) it passes there too. This case keeps that condition in every run.
        (signal.SIGINT, 130, True),
    ],
    ids=["SIGTERM", "SIGINT", "SIGINT-from-a-background-job"],
)
def test_export_to_a_named_pipe_no_one_reads_ends_on_the_first_signal(
    tmp_path: Path, signum: int, code: int, background: bool
) -> None:
    """``export -o FIFO`` with no reader waited in the kernel's open of the FIFO, where the signal's
    handler ran without ending it: the first Ctrl-C or SIGTERM did nothing, only a second one ended
    it. The first one now ends it, 130 or 143 as README says, the FIFO left as it was. (A reader
    that comes later still gets the whole export: test below.)"""
    db = tmp_path / "s.db"
    _small_store(db)
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with _as_a_background_job(background):
        process = subprocess.Popen(
            [sys.executable, "-m", "evstore.cli", "export", "--db", str(db), "-o", str(fifo)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            # (a shell's background job - CI started with `&` - inherits SIGINT ignored, and Python
            # then never raises KeyboardInterrupt: give it the terminal's default)
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        _waiting_at(process, db)
        process.send_signal(signum)
        try:
            _out, err_text = process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            pytest.fail("the first signal left the export waiting for a reader")
        assert process.returncode == code, err_text
        assert fifo.is_fifo() and not list(tmp_path.glob("pipe?*"))  # (no pipe.partial)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_export_to_a_named_pipe_waits_for_its_reader(tmp_path: Path) -> None:
    """(the wait for a reader, now at the loop's turns: one that opens the FIFO late reads it all)"""
    db = tmp_path / "s.db"
    _small_store(db)
    expected = evstore("export", "--db", str(db)).stdout
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    process = subprocess.Popen(
        [sys.executable, "-m", "evstore.cli", "export", "--db", str(db), "-o", str(fifo)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        # (a shell's background job - CI started with `&` - inherits SIGINT ignored, and Python
        # then never raises KeyboardInterrupt: give it the terminal's default)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        _waiting_at(process, db)
        received = fifo.read_text()
        _out, err_text = process.communicate(timeout=30)
        assert process.returncode == 0, err_text
        assert received == expected and len(expected.splitlines()) == 4  # (the header, 3 events)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_upgrade_of_a_postgresql_store_whose_events_table_was_dropped_says_the_log_is_lost(
    pg_url: str,
) -> None:
    """(as on SQLite, the CLI's error says the log is lost; PostgreSQL's open refuses the store,
    which it said 'relation "events" does not exist' for: fixed by the lead after helper J's
    strict xfail)"""
    import asyncpg

    async def build_then_drop() -> None:
        async with open_store(pg_url) as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})
        conn = await asyncpg.connect(pg_url)
        try:
            await conn.execute("DROP TABLE events CASCADE")  # (a view of the projection reads it)
        finally:
            await conn.close()

    asyncio.run(build_then_drop())
    done = evstore("upgrade", "--url", pg_url)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.log.corrupt: ") and "the log is lost" in done.stderr, (
        done.stderr
    )
