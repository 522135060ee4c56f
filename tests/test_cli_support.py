"""Helpers for driving the ``evstore`` command line as a user would: in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def evstore(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m evstore.cli ARGS`` and capture its output (never raises on exit status)."""
    full_env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    full_env["COLUMNS"] = "250"
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "evstore.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=REPO,
        check=False,
    )


def demo_db(path: Path, seed: int = 7, instances: int = 60, nodes: int = 4) -> Path:
    """A demo database at ``path`` built by the CLI (asserts that the demo succeeded)."""
    done = evstore(
        "demo", "--db", str(path), "--seed", str(seed), "--instances", str(instances), "--nodes", str(nodes)
    )
    assert done.returncode == 0, done.stderr + done.stdout
    return path
