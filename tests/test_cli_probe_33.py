"""The CLI as an acceptance reviewer drives it (session 33, helper B): each test failed before its fix.

They drive the CLI in a subprocess, as an operator would (tests/test_cli_support.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_cli_support import REPO, demo_db, evstore


@pytest.fixture(scope="module")
def db(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(demo_db(tmp_path_factory.mktemp("probe") / "d.db", instances=10, nodes=2))


# --- diff A B with A after B --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("9", "5"),  # two positions: wrong on the command line itself, refused before the store opens
        ("2026-12-05T10:00:00Z", "2026-01-01T00:00:00Z"),  # two times, likewise
        ("9", "2000-01-01T00:00:00Z"),  # a position after a time the log puts before it
    ],
)
def test_diff_with_a_after_b_is_a_usage_error(db: str, a: str, b: str) -> None:
    """Regression: ``evstore diff 9 5`` exited 1 with ``evstore.invalid_input: diff needs a <= b``,
    where the README's rule makes arguments that conflict a usage error (2), as ``--db`` with
    ``--url`` or ``--provider`` with ``--consumer`` are."""
    done = evstore("diff", a, b, "--db", db)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: evstore.usage: ") and "earlier point first" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_diff_of_a_point_with_itself_or_in_order_still_answers(db: str) -> None:
    for a, b in (("5", "5"), ("3", "9"), ("2000-01-01T00:00:00Z", "5")):
        done = evstore("diff", a, b, "--db", db, "--json")
        assert done.returncode == 0, (a, b, done.stderr)


def test_diff_past_the_head_is_still_the_stores_error(db: str) -> None:
    done = evstore("diff", "1", "100000", "--db", db)
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.invalid_input: "), done.stderr


# --- the C locale, not coerced to UTF-8 -----------------------------------------------------------------

P1 = "11111111-1111-4111-8111-111111111111"
C1 = "22222222-2222-4222-8222-222222222222"


async def test_tables_print_names_in_the_c_locale_not_coerced_to_utf8(tmp_path: Path) -> None:
    """Regression: in the C (or POSIX) locale with its coercion to UTF-8 off (PYTHONCOERCECLOCALE=0,
    PYTHONUTF8=0: an old container, a cron job, ``env -i``), Python writes standard output as ASCII
    with ``surrogateescape``, which stop 32's fix (for ``strict``, what PYTHONIOENCODING gives)
    left alone: every table holding a non-ASCII name ended in ``evstore.internal:
    UnicodeEncodeError`` after printing nothing. The character is now shown as its escape."""
    from evstore import Inventory, open_store

    db = tmp_path / "s.db"
    async with open_store(f"sqlite:///{db}") as store:
        await store.create_provider(P1, "nœud-节点", metadata={"request_id": "req-é", "actor": "opérateur"})
        await store.set_inventories(P1, {"VCPU": Inventory(total=8)}, generation=0)
        await store.set_allocations(
            C1, {P1: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
        )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LC_", "LANG", "PYTHON", "EVSTORE_URL"))}
    env.update(LC_ALL="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0", COLUMNS="250")
    for command in (
        ["history", P1],
        ["history", C1],
        ["state"],
        ["state", "--provider", P1],
        ["state", "--consumer", C1],
        ["diff", "0", "3"],
        ["tail", "--after", "0", "--no-follow"],
    ):
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", *command, "--db", str(db)],
            capture_output=True, timeout=120, env=env, cwd=REPO, check=False,
        )  # fmt: skip
        assert done.returncode == 0, (command, done.stderr)
        assert b"n\\u0153ud-\\u8282\\u70b9" in done.stdout, (command, done.stdout)


# --- start-up -------------------------------------------------------------------------------------------


def test_the_command_line_loads_the_models_only_once_a_command_runs() -> None:
    """``evstore --help``, ``--version`` and a usage error need neither pydantic nor the projections
    (about half of the CLI's start-up: ``evstore --help`` took 0.95-1.53 s before, 0.44-0.87 s
    after, alternating runs on a busy machine); the options' bound is the log's."""
    from evstore import cli
    from evstore.log import MAX_POSITION

    assert cli.MAX_POSITION == MAX_POSITION
    script = (
        "import sys, evstore.cli\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('pydantic', 'projections', 'msgspec')]\n"
        "assert not heavy, heavy\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr


# --- the help and the version, written where they cannot be -----------------------------------------


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full")
@pytest.mark.parametrize("args", [["--help"], ["--version"], ["audit", "--help"]], ids=" ".join)
def test_help_or_version_on_a_full_disk_is_one_error_line(args: list[str]) -> None:
    """Regression: the help and the version are printed outside the code that turns a failed
    write into ``evstore.io`` (exit 1, one line): written to a full disk (``> /dev/full``), they
    ended with a traceback of the OSError."""
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", *args],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=env, cwd=REPO, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.io: ") and done.stderr.count("\n") == 1, done.stderr
