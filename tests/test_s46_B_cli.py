"""Stop 46, helper B: the command line's known defects - ``cli.crash`` logged through an unguarded
logger, a SQLite URL's options checked after its file was looked for, ``import``'s refusal of a
store with events naming no store, ``<str>`` metavars in the help, ``export -o /dev/fd/N`` with N
no open descriptor - and what probing every command with wrong input found."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from evstore import cli
from tests.test_cli_support import REPO, evstore
from tests.test_s44_C_cli import _in_process, _small_store

# (cli.main, run in this process, configures logging to this test's captured streams, closed after it)
pytestmark = pytest.mark.usefixtures("logging_as_it_was")


# --- 1. cli.crash through the guarded logger ------------------------------------------------------


class _Bug(RuntimeError):
    pass


def _a_bug_in_audit(monkeypatch: pytest.MonkeyPatch) -> None:
    def print_audit(*args: Any, **kwargs: Any) -> None:
        raise _Bug("a bug in evstore")

    monkeypatch.setattr(cli, "print_audit", print_audit)


def _raising_processor(verbosity: int) -> None:
    def boom(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        raise ValueError("the logging configuration failed")

    structlog.configure(
        processors=[boom],
        logger_factory=structlog.ReturnLoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )


def test_a_crash_whose_log_line_fails_still_ends_in_its_one_error_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A bug (evstore.internal) logs ``cli.crash`` with its traceback (shown at -vv). Logged with
    a bare ``structlog.get_logger``, a logging configuration that failed raised from the handler:
    the ValueError replaced the bug's one line and exit 1 with a traceback of its own."""
    db = tmp_path / "s.db"
    _small_store(db)
    _a_bug_in_audit(monkeypatch)
    monkeypatch.setattr(cli, "configure_logging", _raising_processor)
    done = _in_process(capsys, "-vv", "audit", "--db", str(db))
    assert done.returncode == 1, done
    assert "error: evstore.internal: _Bug: a bug in evstore\n" in done.stderr, done.stderr
    assert done.stderr.endswith("error: evstore.internal: _Bug: a bug in evstore\n"), done.stderr
    # (the guard's report of the line it could not emit)
    assert "log line 'cli.crash' not emitted" in done.stderr, done.stderr


def test_a_crash_with_standard_error_unwritable_keeps_its_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Standard error that cannot be written (a closed file): neither the crash's log line (-vv),
    nor a library's log line (asyncio's "Using selector", at -vv: its handler's handleError let
    the closed file's ValueError through, and the event loop was never made), nor the error line
    may raise in the command's place - its status stays 1, evstore.internal's, and a usage
    error's 2."""
    db = tmp_path / "s.db"
    _small_store(db)
    reached: list[bool] = []

    def print_audit(*args: Any, **kwargs: Any) -> None:
        reached.append(True)
        raise _Bug("a bug in evstore")

    monkeypatch.setattr(cli, "print_audit", print_audit)
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    for verbosity in ([], ["-vv"]):
        reached.clear()
        done = _in_process(capsys, *verbosity, "audit", "--db", str(db))
        assert (done.returncode, reached) == (1, [True]), (verbosity, done)
        done = _in_process(capsys, *verbosity, "audit")  # (no store given: a usage error)
        assert done.returncode == 2, (verbosity, done)


@pytest.mark.parametrize("verbosity", [[], ["-vv"]])
def test_exit_statuses_stand_with_standard_error_on_a_full_disk(tmp_path: Path, verbosity: list[str]) -> None:
    """``2>/dev/full``: an error line that cannot be written changed a usage error's exit 2, and a
    bug's evstore.internal, into a traceback's 1 (written nowhere); a clean audit stays 0."""
    db = tmp_path / "s.db"
    _small_store(db)
    script = (
        "import sys\n"
        "from evstore import cli\n"
        "if sys.argv[1] == 'bug':\n"
        "    def print_audit(*a, **k):\n"
        "        raise RuntimeError('a bug')\n"
        "    cli.print_audit = print_audit\n"
        "cli.main(sys.argv[2:])\n"
    )
    cases = [
        ("none", ["audit"], 2),
        ("bug", ["audit", "--db", str(db)], 1),
        ("none", ["audit", "--db", str(db)], 0),
    ]
    for mode, args, status in cases:
        with open("/dev/full", "w") as full:
            done = subprocess.run(
                [sys.executable, "-c", script, mode, *verbosity, *args],
                stdout=subprocess.PIPE,
                stderr=full,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
                timeout=60,
            )
        assert done.returncode == status, (mode, args, done)


# --- 2. a SQLite URL's options before its file ----------------------------------------------------


@pytest.mark.parametrize("through", ["--url", "EVSTORE_URL"])
@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("frob=1", "Unknown SQLite store option(s) frob"),
        ("busy_timeout=abc", "busy_timeout must be a number of seconds"),
        ("synchronous=WRONG", "synchronous must be OFF, NORMAL, FULL or EXTRA, got 'WRONG'"),
        ("create=maybe", "create must be true or false, got 'maybe'"),
    ],
)
def test_a_sqlite_urls_options_are_checked_before_its_file_is_looked_for(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    through: str,
    query: str,
    said: str,
) -> None:
    """``sqlite:///missing.db?frob=1`` said ``evstore.not_found`` (the file looked for first), and the
    file made, the next run was refused for ``frob``: the options are checked first, as the open
    checks them, also for the commands that make a store (import, demo) and a path through a file."""
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    export = tmp_path / "e.jsonl"
    export.write_text("")
    blocker = tmp_path / "notes.txt"
    blocker.write_text("")
    for path, command in [
        (tmp_path / "missing.db", ["audit"]),
        (tmp_path / "missing.db", ["history", "a7a2d8c9-45b3-4f0c-9b71-0d2cb1a8b5a1"]),
        (blocker / "x.db", ["import", str(export)]),
        (blocker / "x.db", ["demo"]),
    ]:
        url = f"sqlite:///{path}?{query}"
        if through == "--url":
            done = _in_process(capsys, *command, "--url", url)
        else:
            monkeypatch.setenv("EVSTORE_URL", url)
            done = _in_process(capsys, *command)
        assert done.returncode == 1, (command, done)
        assert done.stderr.startswith(f"error: evstore.invalid_input: {said}"), (command, done.stderr)
        assert done.stderr.count("\n") == 1, done.stderr
        assert ("(from EVSTORE_URL)" in done.stderr) == (through == "EVSTORE_URL"), done.stderr
        assert not (tmp_path / "missing.db").exists()


# --- 3. import into a store with events names the store -------------------------------------------


def _with_password(url: str, password: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    user = parts.username or "evstore"
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))


def test_import_into_a_store_with_events_names_the_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """ "import needs an empty store: this one already has events" - which one, a script importing
    into several stores, or one EVSTORE_URL chose, could not tell: the refusal names it (as error
    messages show a store) and its head, and says where an import goes."""
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    db = tmp_path / "full.db"
    _small_store(db)
    export = tmp_path / "e.jsonl"
    assert _in_process(capsys, "export", "--db", str(db), "-o", str(export)).returncode == 0
    done = _in_process(capsys, "import", str(export), "--db", str(db))
    assert done.returncode == 1, done
    assert done.stderr == (
        f"error: evstore.invalid_input: import needs an empty store: sqlite:///{db} already has events "
        "(head 3); import into a new file (--db NEW.db)\n"
    ), done.stderr
    monkeypatch.setenv("EVSTORE_URL", f"sqlite:///{db}")
    done = _in_process(capsys, "import", str(export), "--json")
    assert done.returncode == 1 and done.stdout == "", done
    assert f": sqlite:///{db} already has events (head 3); " in done.stderr, done.stderr
    assert done.stderr.endswith(" (from EVSTORE_URL)\n"), done.stderr


def test_import_into_a_postgresql_store_with_events_names_it_password_hidden(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pg_url: str
) -> None:
    import asyncio

    from evstore import Inventory, open_store
    from tests.conftest import new_uuid

    monkeypatch.delenv("EVSTORE_URL", raising=False)

    async def build() -> None:
        async with open_store(pg_url) as store:
            provider = new_uuid()
            await store.create_provider(provider, "node-1")
            await store.set_inventory(provider, "VCPU", Inventory(total=8), 0)

    asyncio.run(build())
    db = tmp_path / "s.db"
    _small_store(db)
    export = tmp_path / "e.jsonl"
    assert _in_process(capsys, "export", "--db", str(db), "-o", str(export)).returncode == 0
    url = _with_password(pg_url, "sekrit")
    done = _in_process(capsys, "import", str(export), "--url", url)
    assert done.returncode == 1, done
    assert "sekrit" not in done.stderr, done.stderr
    assert done.stderr.startswith(
        "error: evstore.invalid_input: import needs an empty store: postgresql://"
    ), done
    assert ":***@" in done.stderr and "already has events (head 2); import into another schema" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


# --- 4. metavars ----------------------------------------------------------------------------------

COMMANDS = [
    "demo",
    "audit",
    "history",
    "state",
    "diff",
    "tail",
    "release",
    "confirm-migration",
    "rebuild",
    "snapshot",
    "stats",
    "upgrade",
    "export",
    "import",
]


def test_every_command_and_option_is_listed_here(capsys: pytest.CaptureFixture[str]) -> None:
    done = _in_process(capsys, "--help")
    assert done.returncode == 0, done
    listed = [line.split()[0] for line in done.stdout.split("Commands:\n", 1)[1].splitlines() if line.strip()]
    assert listed == COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_no_help_shows_a_python_type_where_it_says_what_to_give(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """``state --at <str>``, ``--url <str>``, ``--provider <str>``, ``--nodes <int range>``, and every
    argument ``uuid <str>``: Python's types, where the other options say what to give (``--db
    <file>``, ``tail --after <position>``)."""
    monkeypatch.setenv("COLUMNS", "150")
    done = _in_process(capsys, command, "--help")
    assert done.returncode == 0, done
    for leftover in ("<str>", "<int", "<float", "range>", "<bool>", "<text>"):
        assert leftover not in done.stdout, (command, done.stdout)
    if command != "demo":
        assert "--url <url>" in done.stdout


def test_the_metavars_say_what_to_give(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "150")
    said = {
        "state": ["--at <position|time>", "--provider <uuid>", "--consumer <uuid>"],
        "demo": ["--seed <seed>", "--nodes <count>", "--instances <count>", "--url <url>"],
        "tail": ["--after <position>", "--limit <count>"],
        "rebuild": ["--batch-size <events>"],
        "snapshot": ["--every <events>"],
        "history": ["evstore history [OPTIONS] {UUID}", "\n  UUID  Consumer or provider uuid."],
        "diff": ["evstore diff [OPTIONS] {A} {B}", "\n  A  From: position", "\n  B  To: position"],
        "release": ["{CONSUMER}", "\n  CONSUMER  Consumer uuid."],
        "confirm-migration": ["{MIGRATION}", "\n  MIGRATION  Migration consumer uuid."],
        "import": ["{FILE}", "\n  FILE  An export (JSON lines)"],
    }
    for command, texts in said.items():
        done = _in_process(capsys, command, "--help")
        for text in texts:
            assert text in done.stdout, (command, text, done.stdout)
    # (a missing argument is named as the help names it, and as README writes it: `diff A B`)
    done = _in_process(capsys, "diff", "1", "--db", "x.db")
    assert (done.returncode, done.stderr) == (2, "error: evstore.usage: Missing argument 'B'.\n"), done


# --- 5. export -o /dev/fd/N, N not open -----------------------------------------------------------


def test_export_to_a_descriptor_the_command_was_not_given_is_refused_as_not_open(tmp_path: Path) -> None:
    """``-o /dev/fd/N`` with N no descriptor the command was started with: once the store was open,
    N was the store's own - "is the database being exported" (its file), "No such device or
    address" (its event loop's socket), a /dev/null the export "succeeded" into - or nothing. It is
    refused before the store is opened, evstore.io, naming the path and saying N is not open."""
    db = tmp_path / "s.db"
    _small_store(db)
    for path, n in [("/dev/fd/3", 3), ("/dev/fd/6", 6), ("/dev/fd/9", 9), ("/proc/self/fd/7", 7)]:
        done = evstore("export", "--db", str(db), "-o", path)
        assert (done.returncode, done.stdout) == (1, ""), (path, done)
        assert done.stderr == (
            f"error: evstore.io: cannot write the export to {path}: descriptor {n} is not open (a shell "
            f"opens it for the command: evstore export ... -o {path} {n}> FILE; or give -o FILE)\n"
        ), done.stderr
    link = tmp_path / "out"
    link.symlink_to("/dev/fd/8")
    done = evstore("export", "--db", str(db), "-o", str(link))
    assert done.returncode == 1 and "descriptor 8 is not open" in done.stderr, done


def test_export_to_a_descriptor_the_command_was_given_writes_there(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    _small_store(db)
    target = tmp_path / "e.jsonl"
    with target.open("w") as sink:
        fd = sink.fileno()
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", "export", "--db", str(db), "-o", f"/dev/fd/{fd}"],
            capture_output=True,
            text=True,
            cwd=REPO,
            pass_fds=(fd,),
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "EVSTORE_URL"},
        )
    assert done.returncode == 0, done
    assert len(target.read_text().splitlines()) == 4  # (the header and 3 events)


# --- 6. what probing found ------------------------------------------------------------------------


def test_white_space_around_a_store_url_or_file_name_is_said(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A URL pasted with a space before it was "a path, not a URL; use --db ' sqlite:///x.db' or
    sqlite:/// sqlite:///x.db" (and a PostgreSQL one had "//user" hidden as a password:
    "postgresql:***@host"); a file name with a space after it, "no database file at x.db " - the
    space it looked for invisible."""
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    monkeypatch.chdir(tmp_path)
    _small_store(tmp_path / "s.db")
    for url in (" sqlite:///s.db", "\tsqlite:///s.db"):
        done = _in_process(capsys, "audit", "--url", url)
        assert (done.returncode, done.stderr) == (
            1,
            "error: evstore.invalid_input: Unsupported store URL 'sqlite:///s.db': it has white space "
            "before it; remove it\n",
        ), done
    done = _in_process(capsys, "stats", "--url", " postgresql://evstore:sekrit@db.invalid:5432/x")
    assert done.stderr == (
        "error: evstore.invalid_input: Unsupported store URL 'postgresql://evstore:***@db.invalid:5432/x': "
        "it has white space before it; remove it\n"
    ), done
    monkeypatch.setenv("EVSTORE_URL", " sqlite:///s.db")
    done = _in_process(capsys, "audit")
    assert done.stderr == (
        "error: evstore.invalid_input: Unsupported store URL 'sqlite:///s.db' (from EVSTORE_URL): it has "
        "white space before it; remove it\n"
    ), done
    monkeypatch.delenv("EVSTORE_URL")
    for args in (["--url", "sqlite:///s.db "], ["--db", "s.db "]):
        done = _in_process(capsys, "audit", *args)
        assert (done.returncode, done.stderr) == (
            1,
            "error: evstore.not_found: no database file at 's.db ': its name has white space around it "
            "(check the path, or create one with `evstore demo`)\n",
        ), done


def test_a_time_still_to_come_is_said_to_be_shown_as_of_the_head(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """``state --at 2999-...`` showed "State at position 3 of 3" and exit 0, as if that time's
    state were known: what is appended before it will change it. A note on stderr says so (the
    JSON on stdout is as it was); a time past says nothing."""
    import json

    db = tmp_path / "s.db"
    _small_store(db)
    future = "2999-01-01T00:00:00Z"
    done = _in_process(capsys, "state", "--at", future, "--db", str(db), "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["position"] == 3, done
    assert done.stderr == (
        "note: --at 2999-01-01T00:00:00+00:00 is in the future: shown as of position 3, the head now; "
        "events appended before that time will change what it shows\n"
    ), done.stderr
    done = _in_process(capsys, "diff", "1", future, "--db", str(db))
    assert done.returncode == 0 and "note: B 2999-01-01T00:00:00+00:00 is in the future" in done.stderr, done
    for args in (["state", "--at", "2001-01-01T00:00:00Z"], ["diff", "2001-01-01T00:00:00Z", "2"]):
        done = _in_process(capsys, *args, "--db", str(db))
        assert done.returncode == 0 and done.stderr == "", done


@pytest.mark.parametrize("command", [["demo", "--instances", "2"], ["import", "EXPORT"]])
def test_a_url_forbidding_creation_given_to_a_command_that_creates_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: list[str]
) -> None:
    """``evstore demo --url 'sqlite:///new.db?create=false'`` answered "No evstore store in new.db ...
    create a store, e.g. with `evstore demo --db ...`" - to evstore demo: the URL's create=false is
    what refused, and the message says so."""
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    db = tmp_path / "s.db"
    _small_store(db)
    export = tmp_path / "e.jsonl"
    assert _in_process(capsys, "export", "--db", str(db), "-o", str(export)).returncode == 0
    args = [str(export) if arg == "EXPORT" else arg for arg in command]
    new = tmp_path / "new.db"
    done = _in_process(capsys, *args, "--url", f"sqlite:///{new}?create=false")
    assert done.returncode == 1 and done.stderr.startswith(
        "error: evstore.not_found: No evstore store in "
    ), done
    assert done.stderr.endswith(
        "; this command makes one, but the URL sets create=false, which forbids that: remove it\n"
    ), done.stderr
    assert not new.exists()
    # (a command that only reads says what it said)
    done = _in_process(capsys, "audit", "--url", f"sqlite:///{new}?create=false")
    assert "create=false" not in done.stderr and done.returncode == 1, done
