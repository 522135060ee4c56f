"""Stop 41, helper C: export/import round trips and the refusal of files an evstore did not write."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from evstore import CorruptEvent, open_store
from evstore.events import GENESIS_HASH, event_hash
from tests.conftest import allocate, make_provider, new_uuid

_HASHED = ("position", "event_id", "type", "schema_version", "data", "metadata", "recorded_at")


def chained(rows: list[dict[str, Any]]) -> list[str]:
    """An export of ``rows`` as a writer would make it: every hash and the header made again, so
    that the chain holds and only the rows' own content is in question."""
    prev, lines = GENESIS_HASH, []
    for row in rows:
        row = {**row, "hash": event_hash(prev, *(row[f] for f in _HASHED))}
        prev = row["hash"]
        lines.append(json.dumps(row))
    head = rows[-1]["position"] if rows else 0
    header = {"format": "evstore-export", "version": 2, "events": len(rows), "head": head, "head_hash": prev}
    return [json.dumps(header), *lines]


async def exported_rows(tmp_path: Path) -> list[dict[str, Any]]:
    """The rows of a small log's export (made on SQLite: the file is the same from either backend)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, VCPU=8)
        await allocate(source, new_uuid(), {rp: {"VCPU": 2}})
        return [json.loads(line) for line in [line async for line in source.export()][1:]]


@pytest.mark.parametrize(
    "recorded_at",
    # (each a valid ISO time whose offset takes it before year 1 or past year 9999 in UTC)
    ["0001-01-01T00:00:00.000000+05:00", "9999-12-31T23:59:59.999999-05:00"],
)
async def test_a_time_utc_cannot_say_is_refused_as_corrupt(
    tmp_path: Path, store_url: str, recorded_at: str
) -> None:
    """The import refused such a row with a bare OverflowError (from ``astimezone``), where a time
    in any other form than evstore's gets the typed refusal, ``evstore.log.corrupt``."""
    rows = await exported_rows(tmp_path)
    rows[0]["recorded_at"] = recorded_at
    lines = chained(rows)
    async with open_store(store_url) as target:
        with pytest.raises(CorruptEvent) as refused:
            await target.import_events(lambda: lines)
        assert refused.value.details == {"line": 2, "position": 1, "reason": "envelope"}
        assert "evstore's form" in refused.value.message
        assert await target.head() == 0
