"""``evstore import`` of an empty input said "the export file is empty" - for ``import - </dev/null``
too, where no file was named, and without naming the file it meant. It now names what was empty:
the file given, or standard input (with how to pipe an export in); the library's refusal carries
``details["reason"] == "empty"`` for callers to tell it apart. Nothing is created either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evstore import InvalidInput, open_store


def _import(
    tmp_path: Path, *args: str, stdin: int | None = subprocess.DEVNULL
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "evstore", "import", *args],
        stdin=stdin, capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip


def test_an_empty_standard_input_is_said_to_be_standard_input(tmp_path: Path) -> None:
    target = tmp_path / "new.db"
    done = _import(tmp_path, "-", "--db", str(target))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.invalid_input: standard input was empty"), done.stderr
    assert "evstore export --db a.db | evstore import - --db b.db" in done.stderr, done.stderr
    assert not target.exists()


def test_an_empty_file_is_named(tmp_path: Path) -> None:
    empty = tmp_path / "nothing.jsonl"
    empty.write_text("")
    target = tmp_path / "new.db"
    done = _import(tmp_path, str(empty), "--db", str(target))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: evstore.invalid_input: {empty} is empty"), done.stderr
    assert not target.exists()


@pytest.mark.parametrize("lines", [[], [""]], ids=["no lines", "one blank line"])
async def test_the_librarys_refusal_says_empty(tmp_path: Path, lines: list[str]) -> None:
    async with open_store(f"sqlite:///{tmp_path / 'c.db'}") as target:
        with pytest.raises(InvalidInput) as refused:
            await target.import_events(lambda: iter(lines))
        assert await target.head() == 0
    if not lines:
        assert refused.value.details.get("reason") == "empty", refused.value.details
        assert refused.value.details.get("field") == "open_lines", refused.value.details
