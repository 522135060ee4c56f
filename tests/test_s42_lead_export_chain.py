"""export refuses a log whose hash chain is broken (stop 42, the lead, helper D's finding)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from evstore import AllocationStore, CorruptEvent, open_store
from tests.conftest import make_provider
from tests.test_cli_support import evstore

ALTERATIONS = {
    "metadata": 'UPDATE events SET metadata = \'{"actor":"mallory"}\' WHERE position = 2',
    "payload": "UPDATE events SET data = 'garbage' WHERE position = 2",
    "hash": "UPDATE events SET hash = 'abc' WHERE position = 2",
    "time": "UPDATE events SET recorded_at = '2020-01-01T00:00:00.000000+00:00' WHERE position = 2",
}


@pytest.mark.parametrize("altered", sorted(ALTERATIONS))
async def test_an_export_of_an_altered_row_is_refused_as_a_hole_is(
    store: AllocationStore, altered: str
) -> None:
    """Regression: a row altered by hand (its hash chain broken: the audit's integrity finding) was
    exported without a word - a payload that is no JSON at all too - so a backup taken so hid the
    damage until an import refused it. README: a hole stops export "as a damaged row does"."""
    for name in ("a", "b", "c"):
        await make_provider(store, name)
    sound = [line async for line in store.export()]
    assert len(sound) == 4
    await store.backend.tamper(ALTERATIONS[altered])
    assert not (await store.audit()).clean
    with pytest.raises(CorruptEvent) as caught:
        _ = [line async for line in store.export()]
    assert caught.value.code == "evstore.log.corrupt"
    assert caught.value.details["position"] == 2 and caught.value.details["reason"] == "hash_chain"
    assert "evstore audit" in caught.value.message


async def test_a_row_after_an_altered_one_is_not_reached(store: AllocationStore) -> None:
    """The refusal comes at the first row whose hash does not follow on; what came before it was
    yielded (the CLI writes it to FILE.partial and removes that)."""
    for name in ("a", "b", "c", "d"):
        await make_provider(store, name)
    await store.backend.tamper("UPDATE events SET data = replace(data, '\"c\"', '\"x\"') WHERE position = 3")
    got: list[str] = []
    with pytest.raises(CorruptEvent) as caught:
        async for line in store.export():
            got.append(line)
    assert caught.value.details["position"] == 3
    assert [json.loads(line).get("position") for line in got[1:]] == [1, 2]


def test_the_command_line_export_of_an_altered_log_leaves_no_file(tmp_path: Path) -> None:
    db, out = tmp_path / "s.db", tmp_path / "backup.jsonl"

    async def fill() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            for name in ("a", "b", "c"):
                await make_provider(store, name)
            await store.backend.tamper(ALTERATIONS["metadata"])

    asyncio.run(fill())
    done = evstore("export", "-o", str(out), "--db", str(db))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "evstore.log.corrupt" in done.stderr and "position 2" in done.stderr
    assert not out.exists() and not Path(f"{out}.partial").exists()
