"""rebuild's count of the time-travel snapshots it dropped (stop 45, helper D): what the rebuild's
own transaction deleted, not what was there before it began - a question answered meanwhile (by
this process or another) saves snapshots on its way, and the rebuild drops them too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from evstore import open_store
from evstore.log import sqlite as sqlite_backend
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_s44_C_cli import _in_process, _small_store


def _snapshots_taken_during_the_fold(monkeypatch: pytest.MonkeyPatch, url: str) -> list[list[int]]:
    """Another store on the same file takes snapshots (every 3 events) while a rebuild folds the
    log, before its write transaction: the positions it took, once per rebuild."""
    real = sqlite_backend.replay
    taken: list[list[int]] = []

    async def folding(*args: Any, **kwargs: Any) -> Any:
        state = await real(*args, **kwargs)
        async with open_store(url, snapshot_every=3) as other:
            taken.append(await other.take_snapshots())
        return state

    monkeypatch.setattr(sqlite_backend, "replay", folding)
    return taken


async def test_rebuild_counts_the_snapshots_it_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path}/s.db"
    async with open_store(url, snapshot_every=3) as store:
        rp = await make_provider(store, VCPU=64)
        for _ in range(5):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.take_snapshots() == [3, 6]
        rebuilt = await store.rebuild()
        assert rebuilt == await store.head() and rebuilt.snapshots_dropped == 2
        rebuilt = await store.rebuild()
        assert rebuilt == await store.head() and rebuilt.snapshots_dropped == 0
        taken = _snapshots_taken_during_the_fold(monkeypatch, url)
        rebuilt = await store.rebuild()
        assert taken == [[3, 6]]
        assert rebuilt.snapshots_dropped == 2, "the snapshots saved while it folded were dropped too"
        assert await store.snapshot_positions() == []


@pytest.mark.usefixtures("logging_as_it_was")  # (cli.main configures logging to this test's streams)
def test_the_rebuild_command_says_how_many_it_dropped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    db = tmp_path / "s.db"
    _small_store(db, allocations=5)
    taken = _snapshots_taken_during_the_fold(monkeypatch, f"sqlite:///{db}")
    done = _in_process(capsys, "rebuild", "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    assert taken == [[3, 6]]
    assert asyncio.run(_positions(db)) == []
    assert '"snapshots_dropped": 2' in done.stdout, done.stdout


async def _positions(db: Path) -> list[int]:
    async with open_store(f"sqlite:///{db}") as store:
        return await store.snapshot_positions()


def test_what_rebuild_answers_is_shown_as_the_int_it_was() -> None:
    """``rebuild`` answered an ``int``: a ``Rebuilt`` is shown, and written to JSON, as one."""
    import json

    from evstore.store import Rebuilt

    rebuilt = Rebuilt(7, 2)
    assert (str(rebuilt), repr(rebuilt), f"{rebuilt}", json.dumps(rebuilt)) == ("7", "7", "7", "7")
    assert rebuilt == 7 and rebuilt.snapshots_dropped == 2 and isinstance(rebuilt, int)
