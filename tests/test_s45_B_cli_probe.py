"""Stop 45, helper B: the command line probed as a demanding user (what bad input gets)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_s44_C_cli import _in_process

# (cli.main, run in this process, configures logging to this test's captured streams, closed after it)
pytestmark = pytest.mark.usefixtures("logging_as_it_was")


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


def _small_store(path: Path) -> None:
    import asyncio
    import uuid

    from evstore import Inventory, open_store

    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = uuid.uuid4()
            await store.create_provider(provider, "node-1")
            await store.set_inventory(provider, "VCPU", Inventory(total=8), 0)

    asyncio.run(build())


@pytest.mark.parametrize(
    "command", [["export"], ["export", "-o", "-"], ["tail", "--no-follow", "--after", "0"]]
)
def test_a_command_whose_output_is_its_product_refuses_a_closed_stdout(
    tmp_path: Path, command: list[str]
) -> None:
    """Started with standard output closed (``>&-``), the CLI writes to /dev/null, so that a
    command whose output only reports (audit, rebuild: their exit status says it) is not failed
    for it. ``export`` to stdout wrote the whole log there and exited 0 - the export was lost,
    the command said it succeeded -; ``tail`` printed its events to nothing (following: forever).
    Their output is what they are run for: they now fail, ``evstore.io``, exit 1, writing nothing."""
    db = tmp_path / "s.db"
    _small_store(db)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore", *command, "--db", str(db)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60, env=env,
        check=False, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.io: standard output is closed"), done.stderr
    assert "Traceback" not in done.stderr


def test_an_export_to_a_file_with_stdout_closed_is_written(tmp_path: Path) -> None:
    db, out = tmp_path / "s.db", tmp_path / "e.jsonl"
    _small_store(db)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore", "export", "--db", str(db), "-o", str(out)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60, env=env,
        check=False, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 3  # the header, 2 events


@pytest.mark.parametrize("given", ["-", "/dev/stdin"])
def test_an_import_of_a_closed_stdin_says_so(tmp_path: Path, given: str) -> None:
    """``evstore import - --db x.db <&-``: standard input closed, its descriptor was the next file
    opened - the spool's own temporary file - and the import said "the export file is empty"
    (evstore.invalid_input), as of a file given empty. It now says standard input is closed,
    evstore.io, and creates nothing."""
    target = tmp_path / "new.db"
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore", "import", given, "--db", str(target)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, env=env,
        check=False, preexec_fn=lambda: os.close(0),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.io: standard input is closed"), done.stderr
    assert not target.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["state", "--provider", "node-1"],
        ["state", "--at", "1", "--provider", "node-1"],
        ["history", "node-1"],
    ],
)
def test_a_provider_named_where_its_uuid_belongs_is_answered_with_the_uuid(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str]
) -> None:
    """Tables show providers by name (``compute-02``): typed back as ``state --provider
    compute-02`` or ``history compute-02``, it was only "Malformed provider uuid: 'compute-02' is
    not a UUID". Still that error (evstore.invalid_input, exit 1), now naming the provider's uuid."""
    db = tmp_path / "s.db"
    _small_store(db)
    done = _in_process(capsys, *args, "--db", str(db))
    assert done.returncode == 1, done
    assert done.stderr.startswith("error: evstore.invalid_input: Malformed "), done.stderr
    assert "'node-1' is not a UUID" in done.stderr, done.stderr
    uuids = set(re.findall(r"[0-9a-f-]{36}", done.stderr))
    assert len(uuids) == 1, done.stderr
    [uuid] = uuids
    assert f"it is the name of provider {uuid}; give its uuid (evstore {' '.join(args[:-1])}" in done.stderr
    assert f" {uuid} ...)\n" in done.stderr, done.stderr


def test_a_malformed_uuid_that_names_no_provider_is_refused_as_before(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    _small_store(db)
    for args in (["state", "--provider", "node-2"], ["history", "node-2"]):
        done = _in_process(capsys, *args, "--db", str(db))
        assert done.returncode == 1 and "'node-2' is not a UUID\n" in done.stderr, done
    done = _in_process(capsys, "history", "node-1", "--db", str(tmp_path / "missing.db"))
    assert done.stderr.startswith("error: evstore.invalid_input: Malformed uuid: 'node-1'"), done
