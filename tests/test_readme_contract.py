"""The README read as a contract, from the outside (review 29, helper-92): what a person or a
script relying only on the README's words would check.

README, "Debugging a leak": "errors are one line ``error: <code>: <message>``"; tables and lines
show text "with control characters as ``\\xNN``, so a stored string cannot ... split a line".
"""

from __future__ import annotations

from pathlib import Path

from tests.test_cli_support import evstore


def test_an_error_naming_a_path_with_a_newline_names_all_of_it_on_one_line(tmp_path: Path) -> None:
    """Regression: the error line was the message's first line, so a path (or URL) holding a
    newline was cut at it: ``--db $'a\\nb.db'`` said ``no database file at a`` - another file than
    the one given - and lost the hint after it. The whole message is shown, its control
    characters as ``\\xNN``, which keeps it one line."""
    odd = tmp_path / "a\nb.db"
    for store in (["--db", str(odd)], ["--url", f"sqlite:///{odd}"]):
        done = evstore("audit", *store)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith("error: evstore.not_found: "), done.stderr
        assert "a\\x0ab.db" in lines[0], done.stderr
    done = evstore("audit", "--db", str(odd))
    assert "(check the path, or create one with `evstore demo`)" in done.stderr, done.stderr
