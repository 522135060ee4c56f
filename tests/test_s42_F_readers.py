"""Readers of the log across processes (README: "Order"; ``subscribe``: "other processes' commits
are seen within about ``poll_interval``"): an import written by another process into an empty
store reaches a subscriber already waiting on it, every event once and in order; ``position_of``
names the same position for an event's time in any timezone."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import sys
import uuid
from pathlib import Path
from zoneinfo import ZoneInfo

from evstore import open_store

ROOT = Path(__file__).resolve().parent.parent

IMPORTER = """
import asyncio, json, sys
from evstore import open_store
lines = json.load(open(sys.argv[2]))
async def main():
    async with open_store(sys.argv[1]) as store:
        await store.import_events(lambda: lines)
asyncio.run(main())
"""


async def _import_in_another_process_while_subscribed(
    source_url: str, target_url: str, tmp_path: Path
) -> None:
    async with open_store(source_url) as source:
        for _ in range(25):
            await source.create_provider(str(uuid.uuid4()), f"rp-{uuid.uuid4().hex}")
        lines = [line async for line in source.export()]
        expected = [(e.position, e.event_id) for e in await source.read(0, 100)]
    exported = tmp_path / "lines.json"
    exported.write_text(json.dumps(lines))
    async with open_store(target_url, poll_interval=0.05) as target:
        seen: list[tuple[int, str]] = []

        async def follow() -> None:
            async for event in target.subscribe(0, batch_size=7):
                seen.append((event.position, event.event_id))
                if len(seen) == len(expected):
                    return

        task = asyncio.create_task(follow())
        await asyncio.sleep(0.2)  # (waiting on the empty store)
        assert not task.done() and seen == []
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            IMPORTER,
            target_url,
            str(exported),
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=asyncio.subprocess.DEVNULL,
        )
        async with asyncio.timeout(30):  # (against a hang only)
            assert await proc.wait() == 0
            await task
        assert seen == expected, "the imported log, once each, in order"


async def test_an_import_by_another_process_reaches_a_waiting_sqlite_subscriber(tmp_path: Path) -> None:
    await _import_in_another_process_while_subscribed(
        f"sqlite:///{tmp_path}/source.db", f"sqlite:///{tmp_path}/target.db", tmp_path
    )


async def test_an_import_by_another_process_reaches_a_waiting_postgresql_subscriber(tmp_path: Path) -> None:
    from tests.pg import fresh_database_url

    await _import_in_another_process_while_subscribed(fresh_database_url(), fresh_database_url(), tmp_path)


async def test_position_of_an_events_time_is_its_position_in_any_timezone(store_url: str) -> None:
    async with open_store(store_url) as store:
        for _ in range(4):
            await store.create_provider(str(uuid.uuid4()), f"rp-{uuid.uuid4().hex}")
            await asyncio.sleep(0.002)  # (distinct times, so each names its own event)
        zones = [
            dt.timezone(dt.timedelta(hours=5, minutes=30)),
            dt.timezone(dt.timedelta(hours=-11, seconds=17)),
            ZoneInfo("America/New_York"),
        ]
        for event in await store.read():
            at = event.recorded_at
            assert [await store.position_of(at.astimezone(z)) for z in zones] == [event.position] * 3
            assert await store.position_of(at - dt.timedelta(microseconds=1)) == event.position - 1
