"""The CLI as an acceptance reviewer drives it: an interrupted demo, `--json` on every command.

From review 32 (helper B): each test failed on 65bdca0. They drive the CLI in a subprocess, as an
operator would (tests/test_cli_support.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_cli_support import REPO, evstore

# --- an interrupted or failed demo -------------------------------------------------------------------


def _demo_that(failure: str, db: Path) -> subprocess.CompletedProcess[str]:
    """``evstore demo --db DB`` whose simulation raises ``failure`` once the store is open (its
    tables written, no event yet: where Ctrl-C lands in the demo's first moments)."""
    script = textwrap.dedent(
        f"""
        import sys
        import evstore.demo
        from evstore import errors
        async def fails(store, **kwargs):
            raise {failure}
        evstore.demo.run_demo = fails
        from evstore.cli import main
        main(sys.argv[1:])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    return subprocess.run(
        [sys.executable, "-c", script, "demo", "--db", str(db)],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("failure", "exit_code"),
    [("KeyboardInterrupt", 130), ("errors.StorageError('disk I/O error')", 1)],
)
def test_a_demo_ended_before_its_first_event_leaves_no_file_the_next_demo_refuses(
    tmp_path: Path, failure: str, exit_code: int
) -> None:
    """Regression: Ctrl-C in the demo's first moments left an empty store at ./evstore-demo.db,
    which every later `evstore demo` refused ("exists and is not a database the demo wrote ...
    remove it yourself"): the demo now removes the database it created when it ends, interrupted
    or failed, with no event in it, as a refused or interrupted import does."""
    db = tmp_path / "evstore-demo.db"
    done = _demo_that(failure, db)
    assert done.returncode == exit_code, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not any(tmp_path.iterdir()), sorted(p.name for p in tmp_path.iterdir())
    again = evstore("demo", "--db", str(db), "--instances", "10")
    assert again.returncode == 0, again.stderr


def test_a_failed_demo_leaves_a_previous_demos_events_or_an_other_file_alone(tmp_path: Path) -> None:
    """The clean-up removes only a file the failing demo created: an empty store someone else
    made is still refused, untouched."""
    import sqlite3

    db = tmp_path / "theirs.db"
    assert evstore("demo", "--db", str(db), "--instances", "5").returncode == 0
    sqlite3.connect(db).execute("DELETE FROM events").connection.commit()  # (anyone's empty store)
    done = _demo_that("KeyboardInterrupt", db)
    assert done.returncode == 1 and "not a database the demo wrote" in done.stderr, done.stderr
    assert db.exists()


# --- --json on every command (issue 3: "`--json` on every command for machines") ----------------------


def test_export_takes_json_as_every_command_does(tmp_path: Path) -> None:
    """Regression: `evstore export --json` was a usage error (exit 2, "No such option: --json"),
    the one command without it. To stdout it writes the JSON lines it always writes; with -o, what
    it wrote, as JSON on stdout, where the note on stderr says it for people."""
    import json

    from tests.test_cli_support import demo_db

    db = demo_db(tmp_path / "s.db", instances=10)
    plain, as_json = evstore("export", "--db", str(db)), evstore("export", "--db", str(db), "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert as_json.stdout == plain.stdout and as_json.stdout.startswith('{"format":"evstore-export"')
    head = json.loads(plain.stdout.splitlines()[0])["head"]

    out = tmp_path / "e.jsonl"
    done = evstore("export", "--db", str(db), "-o", str(out), "--json")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert json.loads(done.stdout) == {"url": f"sqlite:///{db}", "output": str(out), "exported": head}
    assert out.read_text() == plain.stdout
    people = evstore("export", "--db", str(db), "-o", str(out))
    assert people.stdout == "" and people.stderr == f"exported {head} events to {out}\n"


# --- an output encoding that cannot show every name -------------------------------------------------

P1 = "11111111-1111-4111-8111-111111111111"
C1 = "22222222-2222-4222-8222-222222222222"


async def test_tables_print_names_their_output_encoding_cannot_show(tmp_path: Path) -> None:
    """Regression: with standard output in an encoding that cannot show a stored name (a Latin-1
    or ASCII locale, PYTHONIOENCODING, a Windows code page when redirected), every table of it
    ended in `error: evstore.internal: UnicodeEncodeError` after printing nothing. Such a
    character is now shown as its escape (``\\u0153``), as a control character is shown ``\\xNN``;
    --json (ASCII JSON) and the export (written as UTF-8) were never affected."""
    from evstore import Inventory, open_store

    db = tmp_path / "s.db"
    async with open_store(f"sqlite:///{db}") as store:
        await store.create_provider(P1, "nœud-节点", metadata={"request_id": "req-é", "actor": "opérateur"})
        await store.set_inventories(P1, {"VCPU": Inventory(total=8)}, generation=0)
        await store.set_allocations(
            C1, {P1: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
        )
    for encoding in ("ascii", "latin-1"):
        for command in (
            ["history", P1],
            ["history", C1],
            ["state"],
            ["state", "--provider", P1],
            ["state", "--consumer", C1],
            ["diff", "0", "3"],
            ["tail", "--after", "0", "--no-follow"],
        ):
            env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
            env.update(COLUMNS="250", PYTHONIOENCODING=encoding)
            done = subprocess.run(
                [sys.executable, "-m", "evstore.cli", *command, "--db", str(db)],
                capture_output=True, encoding=encoding, timeout=120, env=env, cwd=REPO, check=False,
            )  # fmt: skip
            assert done.returncode == 0, (encoding, command, done.stderr)
            assert "n\\u0153ud-\\u8282\\u70b9" in done.stdout, (encoding, command, done.stdout)


# --- COLUMNS ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("columns", ["0", "-5", "abc", " "])
def test_a_columns_variable_that_is_no_width_does_not_empty_or_fold_the_output(
    tmp_path: Path, columns: str
) -> None:
    """Regression: with COLUMNS=0 (what some containers and CI runners export) every table and
    line of human output was empty - `evstore audit` printed nothing and exited 0 - since rich
    renders nothing at width 0; and a COLUMNS that is not a number (``abc``) folded piped tables
    at 80 columns, cutting uuids, where an unset one gives them 200. Both are now as if unset."""
    from tests.test_cli_support import demo_db

    db = demo_db(tmp_path / "s.db", instances=10)
    unset = {
        command: evstore(*command, "--db", str(db), env={"COLUMNS": ""}).stdout
        for command in (("audit",), ("stats",), ("state",), ("tail", "--after", "0", "--no-follow"))
    }
    for command, expected in unset.items():
        assert expected.strip(), command
        done = evstore(*command, "--db", str(db), env={"COLUMNS": columns})
        assert done.returncode == 0, done.stderr
        assert done.stdout == expected, (command, done.stdout)
