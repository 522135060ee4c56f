"""The README's embedded-API example, taken from the README itself and run as a newcomer runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_the_readmes_embedded_api_example_runs_and_prints_what_its_comments_say(tmp_path: Path) -> None:
    snippet = README.read_text().split("```python\n")[1].split("```")[0]
    assert "open_store(" in snippet and "revert_migration" in snippet
    done = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=tmp_path,
        # (this checkout's evstore, not whichever one is installed: cwd is the temporary directory)
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # structlog's default lines go to stdout too: the example's own prints are the lines without a level
    printed = [line for line in done.stdout.splitlines() if "[info" not in line and "[warning" not in line]
    assert printed[0].startswith("evstore.consumer.deleted Instance "), printed
    assert "was deleted at position 5" in printed[0]
    assert printed[1] == "{'MEMORY_MB': 0, 'VCPU': 0}"  # the revert was refused: nothing came back
    assert printed[2:] == ["3 AllocationsReplaced req-1", "4 MigrationStarted None", "5 ConsumerDeleted None"]
    assert (tmp_path / "cloud.db").exists()
