"""``evstore import`` stopped by SIGTERM (kill, systemd, a container stopping) in the middle of
its write ends as one stopped by Ctrl-C: the import rolled back, a SQLite file it created
removed, a PostgreSQL store left empty, one line saying nothing was imported, and the same
import run again succeeds. Exit 143 (128 + SIGTERM), as a shell reports a process it ended;
Ctrl-C stays 130.

Regression (session 35, helper K2): SIGTERM took its default action, the process's death in the
middle of the import: exit -15, no word said, and a new SQLite file left behind as an empty
store (with its -wal and -shm), where Ctrl-C removed it. The signal is sent deterministically,
by the child itself, as the write begins (a timed kill would depend on the machine's speed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_cli_support import REPO, demo_db, evstore

#: run as ``python -c``: the ``evstore`` entry point, with the signal sent by the import itself
#: once its write began (SQLite: on the writer's thread, which then waits for the rollback the
#: signal asks for; PostgreSQL: on the loop, as the first batch is folded)
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    from evstore.log import postgres, sqlite

    SIGNAL = signal.Signals[sys.argv[1]]

    def sqlite_import_all(conn, rows, batch_size, progress, stop=None):
        os.kill(os.getpid(), SIGNAL)
        stop.wait(60)  # (set once the signal cancelled the import)
        return original_sqlite(conn, rows, batch_size, progress, stop)

    def pg_imported_keys(*args):
        os.kill(os.getpid(), SIGNAL)
        return original_pg(*args)

    original_sqlite, sqlite._import_all = sqlite._import_all, sqlite_import_all
    original_pg, postgres.imported_keys = postgres.imported_keys, pg_imported_keys
    from evstore.__main__ import main

    sys.argv = ["evstore", *sys.argv[2:]]
    main()
    """
)


def _import_stopped_by(sig: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, sig, "import", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
        # (a shell's background job - CI started with `&` - inherits SIGINT ignored, and Python
        # then leaves it ignored: give the child the terminal's default, as Ctrl-C meets it)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tmp_path_factory.mktemp("export")
    db = demo_db(where / "demo.db", instances=10, nodes=2)
    out = where / "demo.jsonl"
    done = evstore("export", "--db", str(db), "-o", str(out))
    assert done.returncode == 0, done.stderr
    return out


@pytest.mark.parametrize(
    ("sig", "code", "said"), [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")]
)
def test_an_import_into_a_new_sqlite_file_stopped_by_a_signal_leaves_no_file(
    export: Path, tmp_path: Path, sig: str, code: int, said: str
) -> None:
    db = tmp_path / "new.db"
    done = _import_stopped_by(sig, str(export), "--db", str(db))
    assert (done.returncode, done.stderr) == (code, f"{said}: nothing was imported\n"), done.stdout
    assert list(tmp_path.iterdir()) == []  # (no file, no -wal, no -shm)
    again = evstore("import", str(export), "--db", str(db))
    assert again.returncode == 0 and "audit: clean" in again.stdout, again.stdout + again.stderr


def test_an_import_into_postgresql_stopped_by_sigterm_leaves_the_store_empty(
    export: Path, pg_url: str
) -> None:
    url = pg_url
    done = _import_stopped_by("SIGTERM", str(export), "--url", url)
    assert (done.returncode, done.stderr) == (143, "terminated: nothing was imported\n"), done.stdout
    stats = evstore("stats", "--url", url, "--json")
    assert stats.returncode == 0 and '"head": 0' in stats.stdout, stats.stdout + stats.stderr
    again = evstore("import", str(export), "--url", url)
    assert again.returncode == 0 and "audit: clean" in again.stdout, again.stdout + again.stderr


# --- before the write: while `import -` spools its input, and before the event loop runs -------
#
# Regression (session 36, helper C): the SIGTERM handling above covered the import's coroutine
# only. Before it - `import -` copying piped input to its temporary file, which it reads twice -
# and around the event loop, SIGTERM took its default action: exit -15, no word said, and the
# spool's temporary file left behind in $TMPDIR.


def _import_from_a_pipe(
    tmp_path: Path, *args: str, child: list[str] | None = None
) -> subprocess.Popen[bytes]:
    """``evstore import - ARGS`` (or ``child``) reading a pipe, its spool in ``tmp_path/spool``."""
    (tmp_path / "spool").mkdir()
    return subprocess.Popen(
        child or [sys.executable, "-m", "evstore", "import", "-", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        env={**os.environ, "TMPDIR": str(tmp_path / "spool")},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _spool_files(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "spool").iterdir())


@pytest.mark.parametrize(
    ("sig", "code", "said"), [("SIGTERM", 143, "terminated"), ("SIGINT", 130, "interrupted")]
)
def test_a_signal_while_import_spools_piped_input_leaves_no_temporary_file(
    export: Path, tmp_path: Path, sig: str, code: int, said: str
) -> None:
    db = tmp_path / "new.db"
    child = _import_from_a_pipe(tmp_path, "--db", str(db))
    assert child.stdin is not None
    child.stdin.write(export.read_bytes()[:100_000])  # (part of it; the pipe stays open)
    child.stdin.flush()
    # the spool's file exists once the copy began; with the pipe open, the copy cannot end
    for _ in range(1200):
        if _spool_files(tmp_path) or child.poll() is not None:
            break
        time.sleep(0.05)
    assert _spool_files(tmp_path), child.communicate(timeout=60)
    child.send_signal(signal.Signals[sig])
    _, err = child.communicate(timeout=60)
    assert (child.returncode, err.decode()) == (code, f"{said}: nothing was imported\n")
    assert _spool_files(tmp_path) == []
    assert not db.exists()


#: the import, with SIGTERM sent by the child itself at ``sys.argv[1]``: "asyncio.run", just before
#: the event loop starts; "loop", once it runs, before the import's coroutine handles the signal
BEFORE_THE_LOOP = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from evstore import cli

    WHERE = sys.argv[1]
    original_run, original_enter = asyncio.run, cli.SigtermCancels.__enter__

    def run(*args, **kwargs):
        if WHERE == "asyncio.run":
            os.kill(os.getpid(), signal.SIGTERM)
        return original_run(*args, **kwargs)

    def enter(self):
        if WHERE == "loop":
            os.kill(os.getpid(), signal.SIGTERM)
        return original_enter(self)

    asyncio.run, cli.SigtermCancels.__enter__ = run, enter
    from evstore.__main__ import main

    sys.argv = ["evstore", *sys.argv[2:]]
    main()
    """
)


@pytest.mark.parametrize("where", ["asyncio.run", "loop"])
def test_sigterm_before_the_import_handles_it_ends_as_during_the_write(
    export: Path, tmp_path: Path, where: str
) -> None:
    db = tmp_path / "new.db"
    child = _import_from_a_pipe(
        tmp_path, child=[sys.executable, "-c", BEFORE_THE_LOOP, where, "import", "-", "--db", str(db)]
    )
    _, err = child.communicate(export.read_bytes(), timeout=120)
    assert (child.returncode, err.decode()) == (143, "terminated: nothing was imported\n")
    assert _spool_files(tmp_path) == []
    assert not db.exists() and not list(tmp_path.glob("new.db*"))
    again = evstore("import", str(export), "--db", str(db))
    assert again.returncode == 0 and "audit: clean" in again.stdout, again.stdout + again.stderr
