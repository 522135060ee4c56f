"""Stop 44, helper C: the command line's items left at stop 43 - ``tail --limit N --no-follow``'s
"up to", a libpq keyword string given as --url, ``import``'s progress total, SIGINT after an
in-process ``evstore.__main__.main()`` - and what probing the CLI with README in hand found."""

from __future__ import annotations

import asyncio
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
