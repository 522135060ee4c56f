"""Stop 44, helper C: the command line's items left at stop 43 - ``tail --limit N --no-follow``'s
"up to", a libpq keyword string given as --url, ``import``'s progress total, SIGINT after an
in-process ``evstore.__main__.main()`` - and what probing the CLI with README in hand found."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import NamedTuple

import pytest

from evstore import cli
from evstore.store import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import REPO

pytestmark = pytest.mark.usefixtures("logging_as_it_was")


class _Done(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> _Done:
    """``evstore ARGS`` run by ``cli.main`` in this process (a subprocess each costs a second)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return _Done(int(done.value.code or 0), out.out, out.err)


def _small_store(path: Path, allocations: int = 1) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=64)
            for _ in range(allocations):
                await allocate(store, new_uuid(), {provider: {"VCPU": 1}})

    asyncio.run(build())


# --- (d) SIGINT after evstore.__main__.main() in-process ------------------------------------------


def test_main_called_in_process_puts_sigints_handler_back(tmp_path: Path) -> None:
    """``evstore.__main__.main()`` ignored SIGINT once the command's status was decided - right for
    the program, which ends then, but a test or an embedder that called it went on with Ctrl-C
    ignored for good. It now puts the handler back as it was when it returns (SystemExit)."""
    from evstore.__main__ import main

    db = tmp_path / "s.db"
    _small_store(db)

    def mine(signum: int, frame: object) -> None:  # pragma: no cover (never sent)
        pass

    before = signal.signal(signal.SIGINT, mine)
    try:
        for args in (["stats", "--db", str(db), "--json"], ["no-such-command"], ["--version"]):
            with pytest.raises(SystemExit):
                main(args)
            assert signal.getsignal(signal.SIGINT) is mine, args
    finally:
        signal.signal(signal.SIGINT, before)


def test_the_program_still_ignores_ctrl_c_once_decided() -> None:
    """The program itself - the script pip writes, ``python -m evstore`` - still leaves SIGINT
    ignored as it ends (stop 42's fix, which ``test_s43_C_cli`` proves end to end)."""
    probe = textwrap.dedent(
        """
        import signal, sys
        from evstore.__main__ import main
        try:
            main(["--version"])
        except SystemExit:
            pass
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert done.stdout.strip().splitlines()[-1] == "True", done.stdout + done.stderr


# --- (a) tail --limit N --no-follow says where it stops ---------------------------------------------


def test_tail_limit_no_follow_says_where_it_stops(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``tail --limit 2 --no-follow`` printed "after position 1 up to <head>" on stderr, though it
    stops after 2 events: it now says the position it stops at, and the head apart."""
    db = tmp_path / "s.db"
    _small_store(db, allocations=5)  # (head 7: the provider, its inventory, 5 allocations)
    args = ("--after", "1", "--limit", "2", "--no-follow", "--json")
    done = _in_process(capsys, "tail", "--db", str(db), *args)
    assert done.returncode == 0, done.stderr
    assert [line.split('"position": ')[1].split(",")[0] for line in done.stdout.splitlines()] == ["2", "3"]
    assert "after position 1 up to 3 (--limit 2; the head is 7)" in done.stderr, done.stderr
    # (a limit past the head: up to the head, as without one)
    done = _in_process(capsys, "tail", "--db", str(db), "--after", "5", "--limit", "9", "--no-follow")
    assert done.returncode == 0, done.stderr
    assert "after position 5 up to 7\n" in done.stderr, done.stderr
    assert len(done.stdout.splitlines()) == 2, done.stdout


# --- (b) a libpq keyword/value string given as --url ------------------------------------------------


@pytest.mark.parametrize(
    ("given", "as_url"),
    [
        (
            "host=127.0.0.1 port=5432 user=evstore dbname=evstore_test",
            "postgresql://evstore@127.0.0.1:5432/evstore_test",
        ),
        (
            "host = db.example dbname = 'my db' sslmode=require",
            "postgresql://db.example/my%20db?sslmode=require",
        ),
        ("host=/var/run/postgresql user=bob dbname=x", "postgresql://bob@/x?host=/var/run/postgresql"),
        ("host=::1 user=a@b password='s3cr\\'t pw' dbname=d", "postgresql://a%40b:***@[::1]/d"),
    ],
)
def test_a_libpq_keyword_string_as_url_is_answered_with_the_url_form(
    given: str, as_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--url "host=localhost dbname=x"`` (libpq's keyword/value form, as psql takes it) got
    "Unsupported store URL ...: use sqlite:///path.db or postgresql://...". It now says evstore
    takes a URL and writes this one as a URL - its password as ***, never repeated."""
    done = _in_process(capsys, "stats", "--url", given)
    assert done.returncode == 1, done
    assert done.stderr.startswith("error: evstore.invalid_input: "), done.stderr
    assert "libpq keyword/value connection string" in done.stderr, done.stderr
    assert "): evstore takes a URL, postgresql://" in done.stderr, done.stderr
    assert f"this one as a URL: {as_url}" in done.stderr, done.stderr
    assert "s3cr" not in done.stderr and done.stdout == "", done


def test_a_libpq_string_that_cannot_be_a_url_still_says_what_evstore_takes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keyword libpq does not know, or a quote left open: no URL is built, the rest is said; the
    same from EVSTORE_URL."""
    for given in ("dbname=x frobnicate=1", "host=h password='open secret"):
        done = _in_process(capsys, "audit", "--url", given)
        assert done.returncode == 1, done
        assert "): evstore takes a URL, postgresql://" in done.stderr, done.stderr
        assert "cannot be written as one" in done.stderr and "secret" not in done.stderr, done.stderr
    monkeypatch.setenv("EVSTORE_URL", "host=h dbname=x")
    done = _in_process(capsys, "audit")
    assert done.returncode == 1 and "this one as a URL: postgresql://h/x" in done.stderr, done.stderr
    assert done.stderr.startswith("error: evstore.invalid_input: Unsupported store URL (from EVSTORE_URL) ")


# --- (c) import's progress bar has a total ----------------------------------------------------------


def _export_of(tmp_path: Path, allocations: int) -> Path:
    db = tmp_path / "from.db"
    _small_store(db, allocations=allocations)
    dump = tmp_path / "log.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "evstore", "export", "--db", str(db), "-o", str(dump)],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dump


def test_import_progress_has_the_headers_total(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``evstore import``'s bar counted against "?" (rich's unknown total): each phase's task now
    has the events the export's header promises as its total (the import checks that promise)."""
    dump = _export_of(tmp_path, allocations=5)
    totals: list[tuple[str, float | None]] = []
    real = cli.progress_bar

    def recording() -> object:
        bar = real()
        add_task = bar.add_task

        def add(description: str, total: float | None = None, **kwargs: object) -> object:
            totals.append((description, total))
            return add_task(description, total=total, **kwargs)  # type: ignore[arg-type]

        bar.add_task = add  # type: ignore[method-assign,assignment]
        return bar

    monkeypatch.setattr(cli, "progress_bar", recording)
    done = _in_process(capsys, "import", str(dump), "--db", str(tmp_path / "to.db"))
    assert done.returncode == 0, done.stderr
    assert totals == [("validating", 7), ("importing", 7)], totals
    # (a file that is no export: no total, and the import's own refusal)
    totals.clear()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "something else"}\n')
    done = _in_process(capsys, "import", str(bad), "--db", str(tmp_path / "to2.db"))
    assert done.returncode == 1 and "not an evstore export" in done.stderr, done.stderr
    assert all(total is None for _, total in totals), totals


def test_import_from_a_pipe_shows_the_total_on_a_terminal(tmp_path: Path) -> None:
    """Piped input (copied to a temporary file first) gets its total from the copy: the pipe is
    read once. On a terminal the bar shows ``7/7``, where it showed ``7/?``."""
    import os
    import pty
    import select

    dump = _export_of(tmp_path, allocations=5)
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("EVSTORE_URL", "NO_COLOR", "TERM")}
    env.update(COLUMNS="120", TERM="xterm-256color")
    with dump.open("rb") as piped_from:
        cat = subprocess.Popen(["cat"], stdin=piped_from, stdout=subprocess.PIPE)
        assert cat.stdout is not None
        proc = subprocess.Popen(
            [sys.executable, "-m", "evstore", "import", "-", "--db", str(tmp_path / "to.db")],
            stdin=cat.stdout, stdout=slave, stderr=slave, cwd=REPO, env=env,
        )  # fmt: skip
        cat.stdout.close()
    os.close(slave)
    shown = b""
    try:
        while select.select([master], [], [], 60)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # (the terminal's other end closed: the command ended)
                break
            if not chunk:
                break
            shown += chunk
        assert proc.wait(timeout=60) == 0, shown
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
        cat.wait(timeout=10)
    text = shown.decode("utf-8", "replace")
    assert "7/7" in text and "/?" not in text, text[-2000:]
    assert "imported 7 events" in text, text[-2000:]


# --- what probing found -----------------------------------------------------------------------------


def test_rebuild_says_it_dropped_the_snapshots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``rebuild`` drops the time-travel snapshots (its --help says so), and said only "rebuilt the
    projection from N events": the snapshots an operator took ahead of the questions with
    ``evstore snapshot`` were gone without a word. It now says how many it dropped (``--json``:
    ``snapshots_dropped``), and how to take them again."""
    db = tmp_path / "s.db"
    _small_store(db, allocations=5)
    done = _in_process(capsys, "snapshot", "--db", str(db), "--every", "3", "--json")
    assert done.returncode == 0 and '"snapshot_positions": [\n    3,\n    6\n  ]' in done.stdout, done
    done = _in_process(capsys, "rebuild", "--db", str(db))
    assert done.returncode == 0, done.stderr
    said = "rebuilt the projection from 7 events (head 7); dropped its 2 time-travel snapshots"
    assert said in done.stdout and "`evstore snapshot` takes them again" in done.stdout, done.stdout
    done = _in_process(capsys, "rebuild", "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "url": f"sqlite:///{db}",
        "events": 7,
        "head": 7,
        "snapshots_dropped": 0,
    }


def test_a_libpq_password_with_an_escaped_quote_is_hidden_whole() -> None:
    """README: "Passwords never appear in error messages". ``open_store`` given a libpq keyword
    string whose quoted password holds ``\\'`` (libpq's escape for a quote in it) answered
    "Unsupported store URL \\"host=h password=***cdSECRET ef' ...\\"": the part after the quote shown.
    (The command line no longer quotes such a string: its message writes the URL form itself.)"""
    from evstore import errors as err

    for given in ("host=h password='ab\\'cdSECRET ef' dbname=x", "host=h password=ab\\ cdSECRET dbname=x"):
        shown = err.redact_url(given)  # (libpq: \' in a quoted value, \<space> in a bare one)
        assert "SECRET" not in shown, shown
