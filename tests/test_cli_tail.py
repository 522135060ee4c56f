"""`evstore tail` follows appends made by another process, live, until interrupted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from evstore import Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import REPO, demo_db, evstore


def _start_tail(*args: str) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    proc = subprocess.Popen(
        # -X faulthandler: a SIGABRT makes a hung tail print every thread's stack (see below)
        [sys.executable, "-X", "faulthandler", "-m", "evstore.cli", "tail", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        # A shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited:
        # the tail would (rightly) not react to it. Give it the default disposition, as a
        # terminal would.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stderr is not None
    ready = proc.stderr.readline()  # the tail says when it is following: no sleeping
    assert ready.startswith("following "), ready
    return proc


async def _write_three_events(url: str) -> int:
    async with open_store(url) as store:
        rp = await make_provider(store, "late-node", VCPU=4)  # 2 events
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # 1 event
        return await store.head()


def test_tail_follows_another_process_appends(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "c.db", instances=10, nodes=2)
    head = json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"]
    proc = _start_tail("--db", str(db), "--json", "--limit", "3")
    try:
        new_head = asyncio.run(_write_three_events(f"sqlite:///{db}"))
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    events = [json.loads(line) for line in out.splitlines()]
    assert [e["position"] for e in events] == list(range(head + 1, new_head + 1))
    assert [e["type"] for e in events] == ["ProviderCreated", "InventoriesReplaced", "AllocationsReplaced"]
    assert "late-node" in events[2]["summary"]


def test_tail_stops_cleanly_on_interrupt(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "c.db", instances=5, nodes=2)
    proc = _start_tail("--db", str(db))
    proc.send_signal(signal.SIGINT)
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # keep the evidence: every thread's stack
        proc.send_signal(signal.SIGABRT)
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"tail did not stop on SIGINT; its threads:\n{err}") from None
    assert proc.returncode == 0, err
    assert "Traceback" not in err


def test_tail_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    """Regression (stop 23, helper-51): SIGTERM (``kill``, systemd, a container stopping) killed a
    following tail by the default action (exit -15, no clean-up: the store not closed), where
    Ctrl-C stops it with 0. Both stop it the same way now."""
    db = demo_db(tmp_path / "c.db", instances=5, nodes=2)
    proc = _start_tail("--db", str(db))
    proc.send_signal(signal.SIGTERM)
    try:
        _out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _out, err = proc.communicate(timeout=30)
        raise AssertionError(f"tail did not stop on SIGTERM; its threads:\n{err}") from None
    assert proc.returncode == 0, (proc.returncode, err)
    assert "Traceback" not in err


def test_tail_from_the_start_without_following(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "c.db", instances=5, nodes=2)
    head = json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"]
    done = evstore("tail", "--db", str(db), "--after", "0", "--no-follow", "--json")
    assert done.returncode == 0, done.stderr
    assert [json.loads(line)["position"] for line in done.stdout.splitlines()] == list(range(1, head + 1))
    human = evstore("tail", "--db", str(db), "--after", str(head - 1), "--no-follow")
    assert human.returncode == 0 and str(head) in human.stdout
    # (regression, helper-31: a position past the head was taken, and followed it waited silently)
    for follow in ("--no-follow", "--follow"):
        beyond = evstore("tail", "--db", str(db), "--after", str(head + 1), follow)
        assert beyond.returncode == 1
        assert beyond.stderr.strip().endswith(f"position {head + 1} is beyond the head of the log ({head})")


def test_piped_tail_prints_one_line_per_event_whatever_the_width(tmp_path: Path) -> None:
    """Regression (helper-28): piped output was folded at the console width (200 columns, or
    $COLUMNS), so one event could take several lines and grep missed parts of it."""
    db = demo_db(tmp_path / "demo.db", instances=20, nodes=2)
    head = json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"]
    for columns in ("60", "250"):
        done = evstore("tail", "--after", "0", "--no-follow", "--db", str(db), env={"COLUMNS": columns})
        assert done.returncode == 0, done.stderr
        assert len(done.stdout.splitlines()) == head


def test_tail_names_a_renamed_provider_by_its_new_name(tmp_path: Path) -> None:
    """Regression (helper r25a): tail learnt names from ProviderCreated but not from
    ProviderUpdated, so after a rename every line about the provider still said its old name
    ("inventory of old-name" right after "renamed to new-name"), followed or not."""
    db = tmp_path / "r.db"

    async def write() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            rp = new_uuid()
            await store.create_provider(rp, "old-name")
            await store.rename_provider(rp, "new-name")
            await store.set_inventories(rp, {"VCPU": Inventory(total=8)}, generation=0)

    asyncio.run(write())
    for args in (("--json",), ()):
        done = evstore("tail", "--db", str(db), "--after", "0", "--no-follow", *args)
        assert done.returncode == 0, done.stderr
        last = done.stdout.splitlines()[-1]
        assert "inventory of new-name" in (json.loads(last)["summary"] if args else last), last


async def test_a_following_tail_outlives_a_storage_failure(capsys: pytest.CaptureFixture[str]) -> None:
    """Regression (helper-29): `tail --follow` ended (exit 1) at the first storage error, e.g. a
    read while the server restarted; it now says so on stderr and subscribes again after the last
    event it printed. Without --follow, and for a damaged row, the error still ends it."""
    from evstore.cli import _following
    from evstore.errors import CorruptEvent, StorageError

    class Flaky:
        def __init__(self, failure: Exception) -> None:
            self.failure = failure
            self.calls: list[int] = []

        async def subscribe(self, after: int) -> Any:
            self.calls.append(after)
            for position in range(after + 1, 6):
                if position == 3 and len(self.calls) == 1:
                    raise self.failure
                yield SimpleNamespace(position=position)

    lost = Flaky(StorageError("Lost the connection to PostgreSQL while reading the log"))
    assert [r.position async for r in _following(lost, 0, follow=True)] == [1, 2, 3, 4, 5]
    assert lost.calls == [0, 2]
    assert "trying again" in capsys.readouterr().err
    for failure, follow in ((StorageError("lost"), False), (CorruptEvent("damaged", position=3), True)):
        seen: list[int] = []
        with pytest.raises(type(failure)):
            async for r in _following(Flaky(failure), 0, follow=follow):
                seen.append(r.position)
        assert seen == [1, 2]


@pytest.mark.parametrize("verbose", [0, 2])
def test_a_library_warning_is_one_line_on_stderr_unless_debugging(verbose: int) -> None:
    """Regression (helper r25a): while the PostgreSQL server restarted under `evstore tail
    --follow --url ...`, asyncpg's pool logged "Failed to restore the pool connection floor;
    retrying" with exc_info, and with no handler configured Python printed each one with a
    30-line traceback on the tail's stderr, between tail's own one-line "trying again" notes.
    A library's warning is now one line naming the exception; -vv keeps the traceback."""
    script = textwrap.dedent(
        f"""
        import logging
        from evstore.cli import configure_logging
        configure_logging({verbose})
        try:
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")
        except OSError:
            logging.getLogger("asyncpg.pool").warning(
                "Failed to restore the pool connection floor; retrying", exc_info=True
            )
        logging.getLogger("asyncpg.pool").info("not shown by default")
        """
    )
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    said = "warning: asyncpg.pool: Failed to restore the pool connection floor; retrying"
    why = "ConnectionRefusedError: [Errno 111] Connect call failed ('127.0.0.1', 5432)"
    if verbose:
        assert lines[0] == said and lines[1] == "Traceback (most recent call last):", done.stderr
        assert why in lines and "info: asyncpg.pool: not shown by default" in lines
    else:
        assert lines == [f"{said} ({why})"], done.stderr


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_following_tail_ends_when_its_database_file_is_removed_or_replaced(
    tmp_path: Path, how: str
) -> None:
    """Regression (helper-61): `tail --follow` kept following a database file that was removed,
    or replaced (another store copied over it), printing nothing, for ever. It ends with
    `evstore.not_found`, saying what happened to the file. (`evstore demo` used to replace its
    file so; it now refuses while another process, this tail too, has the file open.)"""
    db = demo_db(tmp_path / "c.db", instances=4, nodes=2)
    other = demo_db(tmp_path / "other.db", instances=4, nodes=2) if how == "replaced" else None
    proc = _start_tail("--db", str(db))
    try:
        if other is None:
            for suffix in ("", "-wal", "-shm"):
                Path(f"{db}{suffix}").unlink(missing_ok=True)
        else:
            refused = evstore("demo", "--db", str(db), "--instances", "4", "--nodes", "2")
            assert refused.returncode == 1 and "is open in another process" in refused.stderr, refused
            os.replace(other, db)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().endswith(
        f"error: evstore.not_found: The database {db} was {how}"
        + ("" if how == "removed" else " by another file")
        + " while tail followed it: run tail again"
    ), err


def test_a_following_tail_ends_when_its_postgresql_schema_is_dropped(pg_url: str) -> None:
    """Regression (helper-61): with the store's schema dropped, `tail --follow --url ...` said
    "relation events does not exist; trying again" every second, for ever."""
    from tests.pg import run_sync

    asyncio.run(_write_three_events(pg_url))
    proc = _start_tail("--url", pg_url)
    try:
        schema = pg_url.split("search_path=")[1].split("&")[0]

        async def drop() -> None:
            async with open_store(pg_url) as store:
                await store.backend.tamper(f'DROP SCHEMA "{schema}" CASCADE')  # type: ignore[attr-defined]

        run_sync(drop())
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "error: evstore.not_found: The store's tables are gone" in err, err
    assert err.count("trying again") <= 1, err


def test_debug_verbosity_does_not_print_aiosqlites_per_call_lines(tmp_path: Path) -> None:
    """Regression (helper-70): once -vv set the root logger to DEBUG, aiosqlite's two debug lines
    per database call ("executing <function ...>", "operation ... completed") went to stderr:
    30 lines for one `evstore -vv stats`, ~10 a second for an idle `tail --follow -vv`."""
    db = demo_db(tmp_path / "c.db", instances=4, nodes=2)
    done = evstore("-vv", "stats", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert "aiosqlite" not in done.stderr, done.stderr
