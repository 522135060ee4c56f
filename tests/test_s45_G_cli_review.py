"""Stop 45, helper G: review of helper B's command-line fixes (closed stdin/stdout, misplaced
options, a provider's name where its uuid belongs)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from evstore import Inventory, open_store


def _small_store(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = uuid.uuid4()
            await store.create_provider(provider, "node-1")
            await store.set_inventory(provider, "VCPU", Inventory(total=8), 0)

    asyncio.run(build())


@pytest.mark.parametrize("given", ["/dev/stdout", "/dev/fd/1"])
def test_an_export_to_dev_stdout_with_stdout_closed_is_refused(tmp_path: Path, given: str) -> None:
    db = tmp_path / "s.db"
    _small_store(db)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore", "export", "--db", str(db), "-o", given],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60, env=env,
        check=False, preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    # (it said "exported 2 events to /dev/stdout", exit 0: the export written to /dev/null)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.io: standard output is closed"), done.stderr


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@127.0.0.1:1/db?password=p@SECRETpw&sslmode=disable",
        "foo=bar host=::1 password=p@SECRETpw",
    ],
)
def test_a_connection_error_does_not_show_a_query_password_holding_an_at_sign(url: str) -> None:
    """(at 4cb21c1: "Cannot connect to PostgreSQL at postgresql://u@127.0.0.1:1/db?password=***&...";
    since: "... at postgresql://u@127.0.0.1:***@SECRETpw&sslmode=disable")"""
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    done = subprocess.run(
        [sys.executable, "-m", "evstore", "stats", "--json", "--url", url],
        capture_output=True, text=True, timeout=60, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == "", done
    assert "SECRET" not in done.stderr, done.stderr
