"""Stop 45, helper B: the command line probed as a demanding user (what bad input gets)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from evstore import cli


@dataclass
class _Done:
    returncode: int
    stdout: str
    stderr: str


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> _Done:
    """``evstore ARGS`` run by ``cli.main`` in this process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return _Done(int(done.value.code or 0), out.out, out.err)


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        # README: "`evstore.internal` for a bug in evstore, whose traceback `-vv` shows" - typed
        # after the command, as one adds a flag to the line that failed, it was "No such option: -v"
        (
            ["audit", "--db", "x.db", "-vv"],
            "-v is an option of evstore itself: give it before the command, evstore -vv audit ...",
        ),
        (
            ["state", "--verbose"],
            "--verbose is an option of evstore itself: give it before the command, "
            "evstore --verbose state ...",
        ),
        # README: "Every command is `evstore <command> --db PATH`": given before the command, "No
        # such option: --db" (and for --json "Possible options: --version", which it is not)
        (
            ["--db", "x.db", "audit"],
            "--db is an option of the commands: give it after the command, evstore audit --db ...",
        ),
        (
            ["--json", "stats", "--db", "x.db"],
            "--json is an option of the commands: give it after the command, evstore stats --json ...",
        ),
        (
            ["--url", "sqlite:///x.db"],
            "--url is an option of the commands: give it after the command, evstore COMMAND --url ...",
        ),
    ],
)
def test_an_option_given_on_the_wrong_side_of_the_command_says_where_it_goes(
    capsys: pytest.CaptureFixture[str], args: list[str], hint: str
) -> None:
    done = _in_process(capsys, *args)
    assert done.returncode == 2, done
    assert done.stderr.startswith("error: evstore.usage: No such option: "), done.stderr
    assert f"({hint})" in done.stderr, done.stderr
    assert "Possible options" not in done.stderr and done.stdout == "", done
    assert done.stderr.count("\n") == 1, done.stderr


def test_an_option_nobody_takes_gets_no_such_hint(capsys: pytest.CaptureFixture[str]) -> None:
    done = _in_process(capsys, "audit", "--jso")
    assert done.stderr == "error: evstore.usage: No such option: --jso (Possible options: --json)\n", done
    done = _in_process(capsys, "--frob", "audit")
    assert done.returncode == 2 and "give it" not in done.stderr, done
