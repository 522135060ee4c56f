"""The CLI in hostile environments: names and request ids holding rich markup or terminal
control characters, a read-only directory, a pipe as the import's input, closed stdout, Ctrl-C
during an import, an empty --url, a directory as the database.

From review 21 (helper-38): each test failed on b748275. They drive the CLI in a subprocess, as an
operator would (tests/test_cli_support.py), with stores built through the Python API.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from evstore import Inventory, open_store
from tests.test_cli_support import REPO, demo_db, evstore

P1 = "11111111-1111-4111-8111-111111111111"
C1 = "22222222-2222-4222-8222-222222222222"


def _store_with_provider(path: Path, name: str, request_id: str = "req-1") -> None:
    """A store with one provider called ``name`` (inventory VCPU=10) and one consumer on it."""

    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as s:
            await s.create_provider(P1, name)
            await s.set_inventories(P1, {"VCPU": Inventory(total=10)}, generation=0)
            await s.set_allocations(
                C1, {P1: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                generation=None, metadata={"request_id": request_id},
            )  # fmt: skip

    asyncio.run(build())


# --- rich markup in provider names ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["rack1[/red]", "[/]", "edge[/bold] a"])
def test_history_of_a_provider_whose_name_looks_like_a_closing_tag(tmp_path: Path, name: str) -> None:
    # cli.history: events_table(f"History of {names.get(key, key)}") - the title is not escaped,
    # so rich parses the name as markup: MarkupError -> "error: evstore.internal", exit 1
    db = tmp_path / "s.db"
    _store_with_provider(db, name)
    done = evstore("history", P1, "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert f"History of {name}" in done.stdout


def test_history_title_shows_a_markup_like_name_literally(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    _store_with_provider(db, "[red]rack-7[/red]")
    done = evstore("history", P1, "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert "History of [red]rack-7[/red]" in done.stdout  # today: "History of rack-7"


def test_state_provider_lists_allocations_of_a_provider_with_a_markup_name(tmp_path: Path) -> None:
    # cli.state (--provider): the "allocations on it" rows are fmt_allocs(...) without escape()
    db = tmp_path / "s.db"
    _store_with_provider(db, "rack1[/red]")
    for extra in ([], ["--at", "3"]):
        done = evstore("state", "--provider", P1, *extra, "--db", str(db))
        assert done.returncode == 0, done.stderr
        assert "rack1[/red]: VCPU=1" in done.stdout


# --- control characters from the log reach the terminal -------------------------------------------


def test_piped_table_output_carries_no_terminal_escape_sequences(tmp_path: Path) -> None:
    # provider names and request ids are stored as given (Placement accepts any string); the
    # CLI must not replay an ESC sequence from the log into the operator's terminal
    db = tmp_path / "s.db"
    _store_with_provider(db, "evil\x1b[2J\x1b]0;owned\x07name", request_id="req-\x1b]0;pwned\x07")
    for args in (
        ["state"],
        ["state", "--provider", P1],
        ["history", P1],
        ["history", C1],
        ["tail", "--after", "0", "--no-follow"],
        ["diff", "0", "3"],
    ):
        done = evstore(*args, "--db", str(db))
        assert done.returncode == 0, (args, done.stderr)
        assert "\x1b" not in done.stdout, (args, done.stdout)


def test_tail_prints_one_line_per_event_even_with_a_newline_in_a_name(tmp_path: Path) -> None:
    # cli.tail: "(never folded: one event, one line, for grep)"
    db = tmp_path / "s.db"
    _store_with_provider(db, "rack\nforged 999 line")
    done = evstore("tail", "--after", "0", "--no-follow", "--db", str(db))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3, lines
    assert all(line.split()[0].isdigit() for line in lines), lines


def test_unicode_line_separators_and_bidi_overrides_are_shown_escaped(tmp_path: Path) -> None:
    """Regression (helper-119): U+2028 in a provider name split the ``state`` table's row in two
    (and a ``tail`` line for ``str.splitlines``), and U+202E / U+2066 / U+200B reordered or hid
    what the line shows: the README says a stored string cannot split a line. Shown as ``\\uNNNN``
    now, as control characters are shown as ``\\xNN``; ordinary non-ASCII text is left alone."""
    db = tmp_path / "s.db"
    _store_with_provider(db, "caf\u00e9 rack\u2028forged\u2029row \u202eevil\u2066x\u200by")
    for args in (["state"], ["history", P1], ["tail", "--after", "0", "--no-follow"], ["diff", "0", "3"]):
        done = evstore(*args, "--db", str(db))
        assert done.returncode == 0, (args, done.stderr)
        for hidden in ("\u2028", "\u2029", "\u202e", "\u2066", "\u200b"):
            assert hidden not in done.stdout, (args, hidden, done.stdout)
        assert "\\u2028forged\\u2029row" in done.stdout and "caf\u00e9" in done.stdout, (args, done.stdout)
    done = evstore("tail", "--after", "0", "--no-follow", "--db", str(db))
    assert len(done.stdout.splitlines()) == 3, done.stdout


# --- read-only directory ---------------------------------------------------------------------------


def _without_write_permission() -> list[str] | None:
    """A command prefix under which file modes are enforced (root: drop CAP_DAC_*), or None."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search,-fowner"
    probe = subprocess.run(["setpriv", "--bounding-set", caps, "--inh-caps", caps, "true"], check=False)
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps] if probe.returncode == 0 else None


def _evstore_read_only(*args: str) -> subprocess.CompletedProcess[str]:
    prefix = _without_write_permission()
    if prefix is None:
        pytest.skip("cannot run without write permission here")
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    env["COLUMNS"] = "250"
    return subprocess.run(
        [*prefix, sys.executable, "-m", "evstore.cli", *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip


@pytest.fixture
def read_only_demo(tmp_path: Path) -> Path:
    """A cleanly closed demo store (no -wal/-shm) in a directory nobody may write."""
    src = demo_db(tmp_path / "src.db", instances=20)
    ro = tmp_path / "ro"
    ro.mkdir()
    shutil.copy(src, ro / "store.db")  # (closed cleanly: the WAL was checkpointed away)
    (ro / "store.db").chmod(0o444)
    ro.chmod(0o555)
    yield ro / "store.db"
    ro.chmod(0o755)


def test_demo_in_a_read_only_directory_does_not_call_its_own_database_foreign(read_only_demo: Path) -> None:
    # cli._is_demo_database opens with ?mode=ro, which fails there (WAL, no -shm), and the demo
    # then claims "store.db exists and is not a database the demo wrote" - it is one.
    done = _evstore_read_only("demo", "--db", str(read_only_demo))
    assert done.returncode == 1
    assert "not a database the demo wrote" not in done.stderr, done.stderr


# --- import from a pipe ----------------------------------------------------------------------------


def test_import_reads_an_export_from_a_pipe(tmp_path: Path) -> None:
    # `evstore export ... | evstore import /dev/stdin --db copy.db`: import_events opens the file
    # twice (validate, then write); a pipe is empty the second time, and the error says
    # "the export file is empty". Expected: the import works (spool a non-regular file to a
    # temporary file first), or a message that says a pipe cannot be imported.
    src = demo_db(tmp_path / "src.db", instances=20)
    export = evstore("export", "--db", str(src))
    assert export.returncode == 0, export.stderr
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore.cli", "import", "/dev/stdin", "--db", str(tmp_path / "copy.db")],
        input=export.stdout, capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    assert "the export file is empty" not in done.stderr
    assert done.returncode == 0 or "pipe" in done.stderr, done.stderr


def test_dash_is_standard_input_for_import_and_standard_output_for_export(tmp_path: Path) -> None:
    """Regression (stop 23, helper-47): ``evstore import - --db b.db`` said "no file at -"
    (and ``export -o -`` wrote a file named ``-``): the usual convention, now both directions."""
    src = demo_db(tmp_path / "src.db", instances=20)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    export = subprocess.run(
        [sys.executable, "-m", "evstore.cli", "export", "--db", str(src), "-o", "-"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr
    assert not (tmp_path / "-").exists()
    assert json.loads(export.stdout.splitlines()[0])["format"] == "evstore-export"
    done = subprocess.run(
        [sys.executable, "-m", "evstore.cli", "import", "-", "--db", str(tmp_path / "copy.db"), "--json"],
        input=export.stdout, capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["imported"] == json.loads(export.stdout.splitlines()[0])["events"]


# --- closed stdout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [["audit"], ["rebuild"], ["state"]])
def test_a_closed_stdout_is_not_an_internal_error(tmp_path: Path, command: list[str]) -> None:
    # `evstore rebuild --db x >&-` (cron, a daemon without stdout): console() calls
    # sys.stdout.isatty() on None -> "error: evstore.internal: AttributeError ...", exit 1 -
    # for rebuild after the rebuild committed
    db = demo_db(tmp_path / "s.db", instances=20)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore.cli", *command, "--db", str(db)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120, env=env, cwd=REPO,
        check=False, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert "evstore.internal" not in done.stderr, done.stderr


# --- interrupted import ----------------------------------------------------------------------------


def test_an_interrupted_import_into_a_new_file_leaves_no_file(tmp_path: Path) -> None:
    # A refused import removes the SQLite file it created (exit 1); an interrupted one (Ctrl-C,
    # exit 130) leaves an empty store behind, which `evstore demo --db` then refuses as foreign.
    src = demo_db(tmp_path / "src.db", instances=20)
    export = tmp_path / "e.jsonl"
    assert evstore("export", "--db", str(src), "-o", str(export)).returncode == 0
    target = tmp_path / "new.db"
    script = textwrap.dedent(
        """
        import sys
        from evstore.store import AllocationStore
        async def interrupted(self, *args, **kwargs):
            raise KeyboardInterrupt
        AllocationStore.import_events = interrupted
        from evstore.cli import main
        main(sys.argv[1:])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-c", script, "import", str(export), "--db", str(target)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert not target.exists()
    assert done.stderr.strip(), "an interrupted import says so (and that nothing was imported)"


# --- store selection -------------------------------------------------------------------------------


def test_an_empty_url_option_is_not_silently_replaced_by_evstore_url(tmp_path: Path) -> None:
    # resolve_url: `url or os.environ.get("EVSTORE_URL")` - `--url ""` (an unset shell variable,
    # `--url "$STORE"`) silently audits whatever EVSTORE_URL names
    db = demo_db(tmp_path / "s.db", instances=20)
    done = evstore("audit", "--url", "", env={"EVSTORE_URL": f"sqlite:///{db}"})
    assert done.returncode == 2, done.stdout + done.stderr


def test_a_url_naming_a_directory_says_so(tmp_path: Path) -> None:
    # --db DIR: "Invalid value for '--db': file ... is a directory." (exit 2); --url sqlite:///DIR:
    # "No evstore store in DIR: the file cannot be read (disk I/O error)"
    (tmp_path / "adir.db").mkdir()
    done = evstore("audit", "--url", f"sqlite:///{tmp_path}/adir.db")
    assert done.returncode in (1, 2)
    assert "is a directory" in done.stderr, done.stderr  # (the tmp path itself says "directory")


def test_a_damaged_database_file_says_what_to_do(tmp_path: Path) -> None:
    """Regression (stop 37, operator sweep): a store file with damaged pages (a disk's fault, a
    copy cut short) ended every command with only SQLite's "database disk image is malformed",
    nothing of what to do about it."""
    db = demo_db(tmp_path / "s.db", instances=20, nodes=2)
    for suffix in ("-wal", "-shm"):  # (closed cleanly: checkpointed, nothing in them)
        Path(f"{db}{suffix}").unlink(missing_ok=True)
    data = bytearray(db.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    assert len(data) > 4 * page
    data[page:] = b"\xff" * (len(data) - page)  # every page but the first (the header, the schema's root)
    db.write_bytes(bytes(data))
    for command in ("audit", "stats", "export"):
        done = evstore(command, "--db", str(db))
        assert done.returncode == 1 and done.stderr.startswith("error: evstore.storage: "), done.stderr
        assert "malformed" in done.stderr and "damaged: restore it from a backup" in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1 and "Traceback" not in done.stderr


def test_a_sqlite_url_without_its_slashes_says_how_to_write_one() -> None:
    """Regression (stop 37, operator sweep): ``--url sqlite:`` and ``--url sqlite:x.db`` said only
    "Not a SQLite URL: 'sqlite:x.db'", where ``sqlite://x.db`` says what a SQLite URL looks like."""
    for url in ("sqlite:", "sqlite:x.db"):
        done = evstore("audit", "--url", url)
        assert done.returncode == 1 and done.stderr.startswith("error: evstore.invalid_input: "), done.stderr
        assert "sqlite:///relative.db" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def test_an_in_memory_url_says_what_it_is() -> None:
    # `audit --url sqlite://` said "No evstore store in :memory:: the file does not exist", and
    # `demo --url sqlite://` ended with a "Try: evstore history ... --url 'sqlite://'" that cannot
    # work (the store is gone with the demo's process)
    done = evstore("audit", "--url", "sqlite://")
    assert done.returncode == 1
    assert "in-memory store starts empty" in done.stderr and "file does not exist" not in done.stderr
    done = evstore("demo", "--url", "sqlite://")
    assert done.returncode == 0, done.stderr
    assert "clean" in done.stdout and "Try: evstore history" not in done.stdout


def test_an_import_interrupted_while_spooling_a_pipe_leaves_no_temporary_file(tmp_path: Path) -> None:
    """Regression (helper-41): Ctrl-C while a pipe was spooled to a temporary file (a slow
    `evstore export ... |`) left the partial copy in $TMPDIR, and said nothing."""
    src = demo_db(tmp_path / "src.db", instances=5)
    export = tmp_path / "e.jsonl"
    assert evstore("export", "--db", str(src), "-o", str(export)).returncode == 0
    spool_dir = tmp_path / "tmp"
    spool_dir.mkdir()
    script = textwrap.dedent(
        """
        import shutil, sys
        def interrupted(source, target, *args, **kwargs):
            target.write(source.read(100))  # (part of the pipe copied, then Ctrl-C)
            raise KeyboardInterrupt
        shutil.copyfileobj = interrupted
        from evstore.cli import main
        main(sys.argv[1:])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    env["TMPDIR"] = str(spool_dir)
    # (stdin must be a pipe, not the file: cat it in)
    done = subprocess.run(
        ["bash", "-c", f'cat "$1" | "{sys.executable}" -c "$2" import /dev/stdin --db "$3"', "_",
         str(export), script, str(tmp_path / "new.db")],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 130, done.stderr
    assert list(spool_dir.iterdir()) == [], "the spooled copy of the pipe is left behind"
    assert "interrupted" in done.stderr


def test_tail_shows_request_and_actor_as_history_does(tmp_path: Path) -> None:
    db = tmp_path / "s.db"

    async def build() -> None:
        async with open_store(f"sqlite:///{db}") as s:
            await s.create_provider(P1, "rp", metadata={"request_id": "req-7", "actor": "conductor"})

    asyncio.run(build())
    done = evstore("tail", "--after", "0", "--no-follow", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert "req-7 / conductor" in done.stdout
