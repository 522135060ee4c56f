"""Issue 3 points 6-7 and issue 4 points 2 and 8, read together and literally: the operator's
replay-debugging session - which event released this allocation? - driven as a user drives it
(subprocesses, ``EVSTORE_URL`` or ``--url``, real stores) on PostgreSQL, and every command the
issue lists answering ``--json``, its exit code, and a one-line coded error instead of a traceback;
``export`` from PostgreSQL imported into SQLite tells the same story.

tests/test_cli_debugging.py runs the session on a SQLite file only (``--db``), and
tests/test_cli_tail.py follows a SQLite file: these are their PostgreSQL halves.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest

from evstore import open_store
from tests.test_cli_support import REPO, evstore


def _json(url: str, *args: str) -> Any:
    done = evstore(*args, "--json", env={"EVSTORE_URL": url})
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    return json.loads(done.stdout)


def test_the_replay_debugging_session_on_postgresql(pg_url: str) -> None:
    url = pg_url
    demo = _json(url, "demo", "--seed", "21", "--instances", "40", "--nodes", "4")
    assert demo["rejected_reverts"], "the seed must produce a revert that lost its race"
    instance, migration = demo["rejected_reverts"][0]

    # which event released the migration's allocation?
    story = _json(url, "history", migration)["events"]
    assert story[0]["type"] == "MigrationStarted"
    released_by = story[-1]
    assert released_by["type"] == "ConsumerDeleted" and released_by["data"]["consumer"] == instance
    for key in ("position", "recorded_at", "type", "data", "metadata"):
        assert key in released_by, key
    p = released_by["position"]
    before = _json(url, "state", "--at", str(p - 1), "--consumer", migration)
    after = _json(url, "state", "--at", str(p), "--consumer", migration)
    assert before["allocations"] and after["allocations"] == {}
    change = {c["consumer"]: c for c in _json(url, "diff", str(p - 1), str(p))["consumers"]}
    assert change[migration]["change"] == "released" and change[migration]["positions"] == [p]
    assert change[instance]["change"] == "deleted"

    assert _json(url, "audit")["clean"] is True


@pytest.mark.skipif(not os.environ.get("EVSTORE_SLOW"), reason="a dozen CLI runs: EVSTORE_SLOW=1 runs it")
def test_every_listed_command_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    url = pg_url
    demo = _json(url, "demo", "--seed", "21", "--instances", "40", "--nodes", "4")
    instance, migration = demo["rejected_reverts"][0]
    story = _json(url, "history", migration)["events"]
    by_time = _json(url, "state", "--at", story[-1]["recorded_at"], "--consumer", instance)
    assert by_time["deleted"] is True and by_time["position"] >= story[-1]["position"]
    stats = _json(url, "stats")
    head = stats["head"]
    for key in ("head", "events_by_type", "db_bytes", "snapshot_positions"):
        assert key in stats, (key, stats)
    assert sum(stats["events_by_type"].values()) == head
    rebuilt = evstore("rebuild", "--json", env={"EVSTORE_URL": url})
    assert rebuilt.returncode == 0, rebuilt.stderr
    tailed = evstore("tail", "--after", str(head - 2), "--no-follow", "--json", env={"EVSTORE_URL": url})
    assert tailed.returncode == 0, tailed.stderr
    assert [json.loads(line)["position"] for line in tailed.stdout.splitlines()] == [head - 1, head]

    # export, then import into a store of the other backend's kind (a new SQLite file)
    dump = tmp_path / "log.jsonl"
    exported = evstore("export", "-o", str(dump), "--url", url)
    assert exported.returncode == 0, exported.stderr
    copy = f"sqlite:///{tmp_path}/copy.db"
    imported = evstore("import", str(dump), "--url", copy)
    assert imported.returncode == 0, imported.stderr
    assert _json(copy, "history", migration)["events"] == story

    # human output is a table, not JSON; errors are one line with their code, no traceback
    human = evstore("history", instance, env={"EVSTORE_URL": url})
    assert human.returncode == 0 and "ConsumerDeleted" in human.stdout and not human.stdout.startswith("{")
    for args in (
        ("history", "not-a-uuid"),
        ("state", "--at", "yesterday-ish"),
        ("diff", "5", str(head + 10)),
    ):
        bad = evstore(*args, env={"EVSTORE_URL": url})
        assert bad.returncode not in (0, 3), (args, bad.returncode)
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and "evstore." in lines[0] and "Traceback" not in bad.stderr, (
            args,
            bad.stderr,
        )


async def _create_provider(url: str) -> None:
    async with open_store(url) as store:
        await store.create_provider(str(uuid.uuid4()), "late-node")


def test_tail_follows_new_events_until_interrupted_on_postgresql(pg_url: str) -> None:
    store_url = pg_url
    _json(store_url, "demo", "--seed", "3", "--instances", "10", "--nodes", "2")
    head = _json(store_url, "stats")["head"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "evstore.cli", "tail", "--after", str(head - 1), "--json", "--url", store_url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())
        assert first["position"] == head
        # a new event, appended meanwhile by another process (this one, through the API)
        asyncio.run(_create_provider(store_url))
        assert json.loads(proc.stdout.readline())["position"] == head + 1
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, (proc.returncode, err)  # its normal end, as on SQLite
        assert "Traceback" not in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
