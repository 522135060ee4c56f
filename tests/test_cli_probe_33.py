"""The CLI as an acceptance reviewer drives it (session 33, helper B): each test failed before its fix.

They drive the CLI in a subprocess, as an operator would (tests/test_cli_support.py).
"""

from __future__ import annotations

import pytest

from tests.test_cli_support import demo_db, evstore


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
