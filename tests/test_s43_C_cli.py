"""Stop 43, helper C: the command line probed against README - the store as ``evstore upgrade``'s
"log is lost" error shows it, and more (see each test)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
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


#: a child running the ``evstore`` script as pip writes it, which sends itself SIGINT at WHERE:
#: "leaving" - as the command's SystemExit leaves the entry point's frame (its work done, its
#: output written), "handling" - at the first line the entry point runs while that SystemExit passes
#: through it, "shutdown" - as Python, ending, joins its threads (threading._shutdown)
_CTRL_C_AT_THE_END = textwrap.dedent(
    """
    import os, signal, sys, threading

    WHERE = sys.argv[1]

    def ctrl_c():
        os.kill(os.getpid(), signal.SIGINT)

    def tracer(frame, event, arg):
        if frame.f_code.co_name != "main" or not frame.f_code.co_filename.endswith("__main__.py"):
            return None
        state = {"exiting": False}

        def local(frame, event, arg):
            if event == "exception" and issubclass(arg[0], SystemExit):
                state["exiting"] = True
            elif state["exiting"] and event == ("return" if WHERE == "leaving" else "line"):
                state["exiting"] = False
                ctrl_c()
            return local

        return local

    if WHERE == "shutdown":
        original = threading._shutdown

        def shutdown():
            ctrl_c()
            original()

        threading._shutdown = shutdown
    else:
        sys.settrace(tracer)
    from evstore.__main__ import main

    sys.argv = ["evstore", *sys.argv[2:]]
    sys.exit(main())
    """
)


@pytest.mark.parametrize("where", ["leaving", "handling", "shutdown"])
def test_ctrl_c_once_a_command_has_finished_ends_it_without_a_traceback(tmp_path: Path, where: str) -> None:
    """A Ctrl-C that comes once the command has done its work and written its output - as its
    exit passes through the script's entry point, or while Python ends - printed a
    ``KeyboardInterrupt`` traceback and ended the process by SIGINT (-2; "Exception ignored in
    threading" and exit 0 while Python joined its threads), where README's Ctrl-C is exit 130 and
    never a traceback. The script now takes no Ctrl-C once the command's status is decided: it
    ends with that status (the command finished: an import that committed says 0, not "stopped"),
    or 130 where the Ctrl-C came first; never by the signal, never with a traceback."""
    db = tmp_path / "s.db"
    _small_store(db)
    done = subprocess.run(
        [sys.executable, "-c", _CTRL_C_AT_THE_END, where, "stats", "--db", str(db), "--json"],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False, stdin=subprocess.DEVNULL,
        # (a shell's background job inherits SIGINT ignored: give it the terminal's default)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr
    assert done.returncode in (0, 130), (done.returncode, done.stderr)
    assert json.loads(done.stdout)["head"] == 3, done.stdout  # (its output whole)


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("url", ["sqlite://?busy_timeout=5", "sqlite:///:memory:?busy_timeout=5"])
def test_a_demo_in_memory_suggests_no_command_on_a_store_that_is_gone(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A demo ends with "Try: evstore history INSTANCE --url ..." on the store it wrote - except in
    memory, gone once the demo ends (the command would say "No evstore store in sqlite://"). That
    was decided by the URL's text, ``sqlite://`` or ``sqlite:///:memory:`` exactly, so an in-memory
    URL with options (README: ``?k=v`` sets them) got the line, a command that cannot work."""
    done = _in_process(capsys, "demo", "--url", url, "--instances", "3", "--nodes", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Audit of " in done.stdout and "clean" in done.stdout, done.stdout  # (the demo ran whole)
    assert "Try: evstore" not in done.stdout, done.stdout
    # (the same demo in a file says it: the line is there to be left out)
    on_file = _in_process(capsys, "demo", "--db", str(tmp_path / "d.db"), "--instances", "3", "--nodes", "2")
    assert "Try: evstore history " in on_file.stdout, on_file.stdout


def _wide_store(path: Path) -> tuple[str, str]:
    """A store whose ``state`` table is wider than 80 columns (the demo's classes and amounts):
    (the provider's uuid, the consumer's)."""
    consumer = new_uuid()

    async def build() -> str:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(
                store, "compute-0001.example", VCPU=256, MEMORY_MB=583680, DISK_GB=3900
            )
            await allocate(store, consumer, {provider: {"VCPU": 103, "MEMORY_MB": 149504, "DISK_GB": 1460}})
            return provider

    return asyncio.run(build()), consumer


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("columns", ["1", "7", "40", "80"])
def test_tables_narrower_than_their_text_hide_none_of_it(
    columns: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In an 80-column terminal ``evstore state`` of the README's demo showed "comp…" for its
    providers and "103/2…" for 103/256 VCPU (rich cut each cell short with an ellipsis), ``diff``'s
    consumers "rel…" for released; at 40 columns the state table showed only the uuids, its other
    columns given no width at all; at 7 or fewer it ended with ``evstore.internal: AssertionError:
    Sum of ratios must be > 0``, exit 1. A cell's text is now folded onto more lines, and a table
    too narrow for its uuids and a few characters a column is laid out wider (the terminal wraps
    it): nothing cut short, nothing left out."""
    db = tmp_path / "s.db"
    provider, consumer = _wide_store(db)
    monkeypatch.setenv("COLUMNS", columns)
    for args in (("state",), ("state", "--provider", provider), ("diff", "0", "3"), ("history", consumer)):
        done = _in_process(capsys, *args, "--db", str(db))
        assert done.returncode == 0, (args, done.stdout + done.stderr)
        assert "…" not in done.stdout, (args, done.stdout)
        if args == ("state",):
            assert provider in done.stdout, done.stdout  # (a uuid whole)
            assert "VCPU" in done.stdout, done.stdout  # (a column there, not given no width)


@pytest.mark.parametrize(
    "env",
    [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "PYTHONCOERCECLOCALE": "0", "PYTHONUTF8": "0"}],
    ids=["ascii", "C-locale"],
)
def test_a_table_in_a_locale_without_its_names_characters_keeps_its_borders_in_line(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Where standard output cannot encode a stored name's characters (``LANG=C``,
    ``PYTHONIOENCODING=ascii``), each is printed as its escape (``\\u0153``) - by the stream, after
    rich had laid the table out for the one character, so the cell overflowed its column and the
    row's borders stood apart from the others'. The escape is now made before the layout."""
    db = tmp_path / "s.db"

    async def build() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            await make_provider(store, "nœud-東京-ü", VCPU=16)

    asyncio.run(build())
    done = evstore("state", "--db", str(db), env=env)
    assert done.returncode == 0, done.stderr
    assert "n\\u0153ud-\\u6771\\u4eac-" in done.stdout, done.stdout
    rows = [line for line in done.stdout.splitlines() if line[:1] in ("|", "+")]
    assert len(rows) >= 5 and len({len(row) for row in rows}) == 1, done.stdout
