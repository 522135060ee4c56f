"""``evstore export -o FILE`` and ``evstore demo`` stopped by SIGTERM (kill, systemd, a container
stopping) end as when stopped by Ctrl-C: what they had begun is undone - the export's
half-written ``FILE.partial`` removed, the store the demo created removed when it holds no event
yet - and the exit status is 143 (128 + SIGTERM) where Ctrl-C's is 130.

Regression (session 36, helper C, reviewing the CLI as a user): SIGTERM took its default action
there. An export killed so left ``FILE.partial`` behind (as large as the part of the log it had
written: the export removes it on every other failure, so as not to fill a disk); a demo killed
before its first event left an empty store, which the next ``evstore demo`` refused as not its
own ("exists and is not a database the demo wrote"). The signal is sent by the child itself at a
chosen point (a timed kill would depend on the machine's speed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.test_cli_support import REPO, demo_db, evstore

#: the ``evstore`` entry point, sending itself ``sys.argv[1]`` once the export wrote its header
#: and first rows, or as the demo starts its cloud
CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys
    from evstore import demo, store

    SIGNAL = signal.Signals[sys.argv[1]]
    original_export, original_demo = store.AllocationStore._export, demo.run_demo

    async def export(self, batch_size):
        async for n, line in aenumerate(original_export(self, 1)):  # (a read per row)
            if n == 10:
                os.kill(os.getpid(), SIGNAL)
            yield line

    async def aenumerate(lines):
        n = 0
        async for line in lines:
            yield n, line
            n += 1

    async def run_demo(*args, **kwargs):
        os.kill(os.getpid(), SIGNAL)
        await asyncio.sleep(60)  # (cancelled by the signal)
        return await original_demo(*args, **kwargs)

    store.AllocationStore._export, demo.run_demo = export, run_demo
    from evstore.__main__ import main

    sys.argv = ["evstore", *sys.argv[2:]]
    main()
    """
)

SIGNALS = [("SIGTERM", 143), ("SIGINT", 130)]


def _stopped_by(sig: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", CHILD, sig, *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
        # (a shell's background job inherits SIGINT ignored: give it the terminal's default)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_an_export_stopped_by_a_signal_leaves_no_partial_file(tmp_path: Path, sig: str, code: int) -> None:
    db = demo_db(tmp_path / "s.db", instances=10, nodes=2)
    out = tmp_path / "out" / "log.jsonl"
    out.parent.mkdir()
    done = _stopped_by(sig, "export", "--db", str(db), "-o", str(out))
    assert (done.returncode, done.stderr) == (code, ""), done.stdout
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_a_demo_stopped_by_a_signal_before_its_first_event_leaves_no_store(
    tmp_path: Path, sig: str, code: int
) -> None:
    db = tmp_path / "demo.db"
    done = _stopped_by(sig, "demo", "--db", str(db))
    assert (done.returncode, done.stderr) == (code, ""), done.stdout
    assert list(tmp_path.iterdir()) == []
    again = evstore("demo", "--db", str(db), "--instances", "5", "--nodes", "2")
    assert again.returncode == 0, again.stderr


# --- an export blocked on a full pipe -----------------------------------------------------------
#
# Regression (session 36, helper R, reviewing the SIGTERM changes): the loop's SIGTERM handler
# cancels at the loop's next turn, and an export writing to a pipe nobody reads (`evstore export
# | less`, the pager stopped) is blocked in a write that never gives it one: SIGTERM, sent any
# number of times, left it running (before the loop took SIGTERM, the default action ended it;
# Ctrl-C's second press ends it). A second SIGTERM now does what the handler before it did.


def _blocked_in_a_pipe_write(pid: int) -> bool:
    """Whether ``pid`` waits in a write to a full pipe, no SIGTERM pending (two sent while one
    is pending are taken as one)."""
    with open(f"/proc/{pid}/status") as status:
        pending = [int(line.split()[1], 16) for line in status if line.startswith(("SigPnd:", "ShdPnd:"))]
    with open(f"/proc/{pid}/wchan") as wchan:
        blocked = "pipe_write" in wchan.read()
    return blocked and not any(mask & (1 << (signal.SIGTERM - 1)) for mask in pending)


def _until_blocked_in_a_pipe_write(child: subprocess.Popen[bytes]) -> None:
    while not _blocked_in_a_pipe_write(child.pid):
        assert child.poll() is None, child.stderr.read() if child.stderr else ""
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/wchan").exists(), reason="needs Linux's /proc/PID/wchan")
def test_an_export_blocked_on_a_full_pipe_ends_on_a_second_sigterm(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "s.db")  # (its export is larger than a pipe holds)
    read_end, write_end = os.pipe()
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "evstore", "export", "--db", str(db)],
            stdout=write_end, stderr=subprocess.PIPE, cwd=REPO,
        )  # fmt: skip
        os.close(write_end)
        try:
            _until_blocked_in_a_pipe_write(child)  # (the pipe full, nobody reading it)
            child.send_signal(signal.SIGTERM)  # (taken by the loop: a cancellation, waiting)
            _until_blocked_in_a_pipe_write(child)
            child.send_signal(signal.SIGTERM)
            assert child.wait(timeout=60) == 143
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    finally:
        os.close(read_end)
