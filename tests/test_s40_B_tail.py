"""Stop 40, helper B: ``tail --after N`` reads what came before N for the consumers its events
name a page of events at a time (a read of the log per page), not one read of the store per
consumer; what it says of each event is what ``tail --after 0`` says of it."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from evstore import cli
from evstore.log.sqlite import SqliteBackend
from tests.test_cli_support import demo_db
from tests.test_s38_a_leak_tools import _imported, _left_holding, _revert_to_deleted, _target
from tests.test_s39_a_cli import _fresh_like, _moved_after_delete

# (cli.main configures structlog and the root logger to print on a test's captured stderr, which
# pytest closes after it: every later test's warning then raised "I/O operation on closed file" -
# 23 tests failed after this file in a CI run. tests/conftest.py's logging_as_it_was puts them back)
pytestmark = pytest.mark.usefixtures("logging_as_it_was")


def _tail(capsys: pytest.CaptureFixture[str], after: int, *where: str) -> list[dict[str, Any]]:
    """``evstore tail --after N --no-follow --json``, run in this process (its exit status 0)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(["tail", "--after", str(after), "--no-follow", *where, "--json"])
    out = capsys.readouterr()
    assert done.value.code == 0, out.err
    return [json.loads(line) for line in out.out.splitlines()]


def _each_start_says_the_same(capsys: pytest.CaptureFixture[str], *where: str) -> int:
    """Every ``--after N`` lists what ``--after 0`` lists after N, word for word; the number of
    events marked as leaks by ``--after 0``."""
    whole = _tail(capsys, 0, *where)
    for after in range(1, len(whole)):
        assert _tail(capsys, after, *where) == whole[after:], after
    return sum("a leak" in doc["summary"] for doc in whole)


def test_every_start_notes_the_leaks_as_the_whole_listing_does(
    tmp_path: Path, store_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The logs of an older writer whose events made leaks (a move onto a deleted instance's
    migration, a revert onto a deleted instance, a delete that left its migration holding), each
    listed from every start, with a look ahead of 3 events: its pages end anywhere."""
    monkeypatch.setattr(cli.TailLeakNotes, "AHEAD", 3)
    lines, _, _ = asyncio.run(_moved_after_delete(tmp_path))
    asyncio.run(_imported(store_url, lines))
    assert _each_start_says_the_same(capsys, *_target(store_url)) == 1
    for name, build in (("revert", _revert_to_deleted), ("left", _left_holding)):
        (tmp_path / name).mkdir()
        url = _fresh_like(store_url, tmp_path / name)
        asyncio.run(build(tmp_path / name, url))
        assert _each_start_says_the_same(capsys, *_target(url)) == 1, name


def test_a_tail_after_a_position_reads_the_store_per_page_not_per_consumer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: one ``allocations`` read per consumer the events after N name (its tombstone before
    N), and one history read per instance with a migration - 1.4 s to 2.3 s for a tail of 2,000
    events. Now, for these ~570 events: the look ahead's reads of the log (two pages), and for
    each page one read of the tombstones and one of the migrations before N."""
    db = demo_db(tmp_path / "demo.db", instances=200, nodes=4)
    calls: Counter[str] = Counter()
    for name in ("query", "read_entities", "read"):
        real = getattr(SqliteBackend, name)

        def counted(self: SqliteBackend, *args: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            calls[f"{_name}:{args[0]}" if _name == "query" else _name] += 1
            return _real(self, *args, **kw)

        monkeypatch.setattr(SqliteBackend, name, counted)
    providers = 4 + 1  # (the names as they were at N: each provider's naming events, read once)
    docs = _tail(capsys, 1, "--db", str(db))
    assert len(docs) > 500
    assert calls["query:consumer"] == 0, calls  # (no consumer read alone: the demo's log holds no leak)
    assert calls["read_entities"] <= providers + 2 * 2, calls
