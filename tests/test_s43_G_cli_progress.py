"""Issue 3 point 6, read literally: "``rebuild`` (with a progress bar)", "``export`` / ``import``
(JSON lines, with progress)", using ``rich`` rather than hand-rolled progress output. Nothing ran
them on a terminal: here each runs on a pseudo-terminal, as an operator's shell runs it, and shows
a bar that reaches the whole log; piped, the same commands print no bar and no escape codes."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
from pathlib import Path

from tests.test_cli_support import REPO, demo_db, evstore


def _on_a_terminal(*args: str) -> tuple[int, str]:
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if k not in ("EVSTORE_URL", "NO_COLOR", "TERM")}
    env.update(COLUMNS="120", TERM="xterm-256color")
    proc = subprocess.Popen(
        [sys.executable, "-m", "evstore.cli", *args],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=REPO,
        env=env,
    )
    os.close(slave)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 60)
            if not ready:
                break
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal's other end closed: the command ended
                break
            if not chunk:
                break
            out += chunk
        return proc.wait(timeout=60), out.decode("utf-8", "replace")
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()


def test_rebuild_export_and_import_show_a_progress_bar_on_a_terminal_and_none_piped(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "demo.db", instances=30, nodes=3)
    head = int(evstore("stats", "--db", str(db), "--json").stdout.split('"head": ')[1].split(",")[0])
    dump = tmp_path / "log.jsonl"
    copy = tmp_path / "copy.db"
    for args in (
        ("rebuild", "--db", str(db)),
        ("export", "-o", str(dump), "--db", str(db)),
        ("import", str(dump), "--db", str(copy)),
    ):
        code, shown = _on_a_terminal(*args)
        assert code == 0, (args, shown[-2000:])
        assert "\u2501" in shown, (args, "no bar", shown[-2000:])  # rich's bar
        # (import counts against the events the export's header promises: stop 44)
        assert f"{head}/" in shown, (args, "the bar does not reach the head", shown[-2000:])
        assert "Traceback" not in shown
    piped = evstore("rebuild", "--db", str(db))
    assert piped.returncode == 0, piped.stderr
    assert "\x1b[" not in piped.stdout + piped.stderr and "\u2501" not in piped.stdout + piped.stderr
