"""Stop 43, helper I: standard output that cannot be written is named in the error."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import REPO


def _small_store(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})

    asyncio.run(build())


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
@pytest.mark.parametrize("args", [["state"], ["state", "--json"], ["export"]], ids=" ".join)
def test_standard_output_that_cannot_be_written_is_named(tmp_path: Path, args: list[str]) -> None:
    """``evstore state > /dev/full`` said only "evstore.io: [Errno 28] No space left on device",
    naming nothing it could not write (export -o FILE names its file)."""
    db = tmp_path / "s.db"
    _small_store(db)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", *args, "--db", str(db)],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=env, cwd=REPO, check=False,
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == "error: evstore.io: cannot write standard output: No space left on device\n"


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_the_help_on_a_full_disk_names_standard_output() -> None:
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", "--version"],
            stdout=full, stderr=subprocess.PIPE, text=True, timeout=60, env=env, cwd=REPO, check=False,
        )  # fmt: skip
    assert (done.returncode, done.stderr) == (
        1, "error: evstore.io: cannot write standard output: No space left on device\n"
    )  # fmt: skip
