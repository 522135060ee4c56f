"""Stop 45, helper K: what this stop's README says of the command line, checked end to end as a
user runs it, on both backends - import's refusal of an event no command writes, the audit's
``usage_not_held``, rebuild's ``snapshots_dropped``, ``busy_timeout`` and ``search_path`` refused
through ``--url``, the ``(from EVSTORE_URL)`` marker - and an export to a standard stream the
command was started without (``-o /dev/stderr`` with stderr closed, ``-o //dev/stdout`` with
stdout closed), which was written to the /dev/null put in its place and said it succeeded."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from evstore import open_store
from tests.conftest import make_provider, new_uuid
from tests.test_audit_findings import BUGGY_TAILS, _tail, append_row, chained
from tests.test_s44_C_cli import _Done, _in_process, _small_store
from tests.test_s45_C_impossible_import import IMPOSSIBLE, _lines

pytestmark = pytest.mark.usefixtures("logging_as_it_was")


def _store_args(store_url: str) -> list[str]:
    return ["--url", store_url]


async def _head_and_tables(store_url: str) -> int | None:
    """The store's head, None when there is no store (a SQLite file not there)."""
    if store_url.startswith("sqlite:") and not Path(store_url.removeprefix("sqlite:///")).exists():
        return None
    async with open_store(store_url, create=False) as store:
        return await store.head()


# --- import refuses an event no command writes ----------------------------------------------------


@pytest.mark.parametrize("case", ["its own parent", "a self-migration", "reserved above total"])
@pytest.mark.parametrize("json_out", [False, True])
def test_the_import_command_refuses_an_impossible_event_and_writes_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store_url: str, case: str, json_out: bool
) -> None:
    events, position, etype, rule, words = IMPOSSIBLE[case]
    export = tmp_path / "x.jsonl"
    export.write_text("\n".join(_lines(events)) + "\n")
    done = _in_process(capsys, "import", str(export), *_store_args(store_url), *(["--json"] * json_out))
    assert done.returncode == 1 and done.stdout == "", done
    [line] = done.stderr.splitlines()
    assert line.startswith("error: evstore.log.corrupt: "), line
    assert f"position {position}" in line and etype in line and words in line and f"(rule {rule})" in line
    assert "nothing was imported" in line and "Traceback" not in line
    # nothing written: a SQLite file the import created is removed; a PostgreSQL schema holds no event
    head = asyncio.run(_head_and_tables(store_url))
    assert head is None if store_url.startswith("sqlite:") else head == 0


# --- the audit names a release of what a provider never counted ------------------------------------


def _buggy_export(tmp_path: Path) -> tuple[Path, str, int]:
    async def build() -> tuple[list[str], str, int]:
        async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
            rp = await make_provider(source, "rp", VCPU=8)
            lines = [line async for line in source.export()]
            last = await _tail(source)
        ghost = new_uuid()
        for etype, data in BUGGY_TAILS["allocated before it was created, then released"](
            rp, new_uuid(), ghost
        ):
            last = chained(last, etype, data)
            append_row(lines, last)
        return lines, ghost, last.position

    lines, provider, position = asyncio.run(build())
    export = tmp_path / "buggy.jsonl"
    export.write_text("\n".join(lines) + "\n")
    return export, provider, position


def test_the_audit_command_reports_usage_not_held_of_an_imported_log(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store_url: str
) -> None:
    export, provider, position = _buggy_export(tmp_path)
    done = _in_process(capsys, "import", str(export), *_store_args(store_url), "--json")
    assert done.returncode == 3, done  # (imported; the log holds a finding)
    done = _in_process(capsys, "audit", *_store_args(store_url), "--json")
    assert done.returncode == 3 and done.stderr == "", done
    report = json.loads(done.stdout)
    assert next(iter(report)) == "url" and report["clean"] is False
    assert report["counts"] == {"integrity": 1}, report
    [finding] = report["findings"]
    assert finding["kind"] == "integrity" and finding["positions"] == [position]
    assert finding["details"] == {"reason": "usage_not_held", "provider": provider, "uncounted": {"VCPU": 3}}


# --- rebuild says the snapshots it dropped -------------------------------------------------------


def test_the_rebuild_command_says_the_snapshots_it_dropped(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, store_url: str
) -> None:
    export, _, _ = _buggy_export(tmp_path)
    assert _in_process(capsys, "import", str(export), *_store_args(store_url)).returncode == 3
    done = _in_process(capsys, "snapshot", *_store_args(store_url), "--every", "2", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["snapshot_positions"] == [2, 4], done
    first = _in_process(capsys, "rebuild", *_store_args(store_url), "--json")
    again = _in_process(capsys, "rebuild", *_store_args(store_url), "--json")
    assert first.returncode == again.returncode == 0, (first, again)
    assert json.loads(first.stdout)["snapshots_dropped"] == 2
    assert json.loads(again.stdout)["snapshots_dropped"] == 0
    assert json.loads(first.stdout)["events"] == 5


# --- open_store options refused through --url and EVSTORE_URL --------------------------------------


@pytest.mark.parametrize("value", ["0.0005", "1e-320", "86401"])
def test_a_busy_timeout_sqlite_cannot_wait_is_refused_through_the_url(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    db = tmp_path / "s.db"
    _small_store(db)
    url = f"sqlite:///{db}?busy_timeout={value}"
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    done = _in_process(capsys, "audit", "--url", url)
    assert done.returncode == 1 and done.stdout == "", done
    assert done.stderr.startswith("error: evstore.invalid_input: busy_timeout must be"), done
    assert f"got '{value}'" in done.stderr and "EVSTORE_URL" not in done.stderr
    monkeypatch.setenv("EVSTORE_URL", url)
    done = _in_process(capsys, "audit")
    assert done.returncode == 1 and done.stderr.rstrip().endswith("(from EVSTORE_URL)"), done
    # (an import into a new file refused so creates none)
    new, export = tmp_path / "new.db", tmp_path / "x.jsonl"
    monkeypatch.delenv("EVSTORE_URL")
    assert _in_process(capsys, "export", "--db", str(db), "-o", str(export)).returncode == 0
    done = _in_process(capsys, "import", str(export), "--url", f"sqlite:///{new}?busy_timeout={value}")
    assert done.returncode == 1 and not new.exists(), done


def _schema_of(url: str) -> tuple[str, str]:
    from urllib.parse import parse_qsl, urlsplit

    return url.split("?")[0], dict(parse_qsl(urlsplit(url).query))["search_path"]


def test_search_path_refusals_through_the_command_line(
    capsys: pytest.CaptureFixture[str], pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncpg

    from tests.pg import fresh_database_url

    base, store_schema = _schema_of(pg_url)
    _, other = _schema_of(fresh_database_url())

    async def prepare() -> None:
        async with open_store(pg_url) as store:
            await make_provider(store, "rp", VCPU=1)
        conn = await asyncpg.connect(base)
        try:
            await conn.execute(f"CREATE TABLE {other}.events (x int)")
        finally:
            await conn.close()

    asyncio.run(prepare())
    monkeypatch.delenv("EVSTORE_URL", raising=False)
    for search_path, words in [
        (f"{other},{store_schema}", f"{other}.events"),
        ("pg_temp", "temporary schema"),
        ("information_schema", "pg_dump"),
    ]:
        url = f"{base}?search_path={search_path}"
        done = _in_process(capsys, "audit", "--url", url, "--json")
        assert done.returncode == 1 and done.stdout == "", done
        [line] = done.stderr.splitlines()
        assert line.startswith("error: evstore.invalid_input: The search_path of "), line
        assert words in line and "EVSTORE_URL" not in line, line
        monkeypatch.setenv("EVSTORE_URL", url)
        done = _in_process(capsys, "stats")
        monkeypatch.delenv("EVSTORE_URL")
        assert done.returncode == 1 and done.stderr.rstrip().endswith("(from EVSTORE_URL)"), done
    # (the store's schema first: it opens)
    done = _in_process(capsys, "stats", "--url", f"{base}?search_path={store_schema},{other}", "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["head"] == 2, done


# --- an export to a standard stream the command was started without --------------------------------


def _export_with_closed(tmp_path: Path, output: str, closed: int) -> subprocess.CompletedProcess[str]:
    db = tmp_path / "s.db"
    if not db.exists():
        _small_store(db)
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    return subprocess.run(
        [sys.executable, "-m", "evstore", "export", "--db", str(db), "-o", output],
        stdout=subprocess.PIPE if closed == 2 else subprocess.DEVNULL,
        stderr=subprocess.PIPE if closed == 1 else subprocess.DEVNULL,
        text=True, timeout=60, env=env, check=False, cwd=tmp_path,
        preexec_fn=lambda: os.close(closed),
    )  # fmt: skip


@pytest.mark.parametrize(
    "output",
    ["//dev/stdout", "/dev/../dev/stdout", "/proc/thread-self/fd/1", "/proc/self/../self/fd/1", "link"],
)
def test_an_export_to_stdout_spelled_otherwise_is_refused_when_stdout_is_closed(
    tmp_path: Path, output: str
) -> None:
    """(``-o /dev/stdout`` and ``/dev/fd/1`` were refused by name; spelled otherwise - or through a
    symbolic link to it - the export went to /dev/null: "exported 2 events to //dev/stdout", exit 0)"""
    (tmp_path / "link").symlink_to("/dev/stdout")
    done = _export_with_closed(tmp_path, output, closed=1)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.io: standard output is closed"), done.stderr


@pytest.mark.parametrize("output", ["/dev/stderr", "/dev/fd/2", "/proc/self/fd/2"])
def test_an_export_to_stderr_is_refused_when_stderr_is_closed(tmp_path: Path, output: str) -> None:
    """(exit 0, the export written to the /dev/null put in place of the closed stderr; the error
    itself goes nowhere then - the exit status says it, and nothing is written on stdout)"""
    done = _export_with_closed(tmp_path, output, closed=2)
    assert done.returncode == 1 and done.stdout == "", done


def test_an_export_to_stderr_or_stdout_left_open_is_written(tmp_path: Path) -> None:
    """(what the refusals above leave alone: the stream is there)"""
    done = _export_with_closed(tmp_path, "/dev/stderr", closed=1)
    assert done.returncode == 0 and done.stderr.startswith('{"format":"evstore-export"'), done
    done = _export_with_closed(tmp_path, "//dev/stdout", closed=2)
    assert done.returncode == 0 and done.stdout.count("\n") == 4, done  # the header, 3 events


_ = _Done  # (the type _in_process answers)
