"""An import names the row that first repeats an event id, whatever else repeats it, and on
PostgreSQL whatever language the server writes its messages in."""

from __future__ import annotations

import json
from pathlib import Path

import asyncpg
import pytest

from evstore import CorruptEvent, open_store
from evstore.log import GENESIS_HASH
from projections.exchange import parse_row, row_line
from tests.test_import_memory import _fresh_url, synthetic_export


def _with_ids(lines: list[str], ids: dict[int, int]) -> list[str]:
    """``lines`` (an export) with the event id of each position ``p`` in ``ids`` replaced by that
    of position ``ids[p]``, the chain and head hash computed again."""
    of = {row.position: row.event_id for row in (parse_row(t, n) for n, t in enumerate(lines) if n and t)}
    out, prev = [lines[0]], GENESIS_HASH
    for n, text in enumerate(lines[1:], 2):
        row = parse_row(text, n)
        row = row._replace(event_id=of[ids.get(row.position, row.position)], hash="")
        row = row._replace(hash=row.chained_hash(prev))
        prev = row.hash
        out.append(row_line(row))
    header = json.loads(lines[0])
    return [json.dumps({**header, "head_hash": prev}), *out[1:]]


async def _refusal(url: str, lines: list[str], batch_size: int) -> CorruptEvent:
    async with open_store(url) as store:
        with pytest.raises(CorruptEvent) as info:
            await store.import_events(lambda: iter(lines), batch_size=batch_size)
        assert await store.head() == 0
        assert await store.providers() == []
    return info.value


async def test_an_id_in_an_earlier_batch_and_twice_in_a_later_one_is_named_at_its_second_row(
    backend_name: str, tmp_path: Path
) -> None:
    """Review 29 (helper-96): PostgreSQL named the row from the batch the unique violation
    stopped, taking the second row of that batch holding the id when it held two - but the id of
    position 3 repeated at positions 10 and 11 (batches of 7: both in the second batch) first
    repeats at 10, not 11 (line 12 was named, position 11)."""
    lines = _with_ids(synthetic_export(30), {10: 3, 11: 3})
    event_id = parse_row(lines[3], 4).event_id
    refused = await _refusal(await _fresh_url(backend_name, tmp_path, "target"), lines, 7)
    assert refused.message == f"line 11: event id {event_id} appears twice"
    assert refused.details == {"line": 11, "position": 10, "reason": "duplicate_id"}


@pytest.mark.parametrize(
    "detail",
    [
        "Key (event_id)=({}) already exists.",
        "Schlüssel »(event_id)=({})« existiert bereits.",
        "La clé « (event_id)=({}) » existe déjà.",
    ],
    ids=["en", "de", "fr"],
)
def test_the_repeated_id_is_read_from_a_unique_violation_in_any_language(detail: str) -> None:
    """Review 29 (helper-96): the id was read from the English text of the violation's DETAIL
    only; a server whose lc_messages is German or French failed the import with
    evstore.storage ('doppelter Schlüsselwert verletzt Unique-Constraint »events_event_id_key«')
    instead of naming the repeated id."""
    from evstore.log.postgres import _repeated_id

    lines = synthetic_export(5)
    batch = [parse_row(text, n) for n, text in enumerate(lines) if n]
    event_id = batch[2].event_id
    exc = asyncpg.exceptions.UniqueViolationError.new(
        {"C": "23505", "M": "duplicate", "D": detail.format(event_id), "n": "events_event_id_key"}
    )
    assert _repeated_id(batch, exc) == (event_id, batch[2].position)


async def test_a_server_writing_german_messages_names_the_repeated_id(pg_url: str, tmp_path: Path) -> None:
    """Review 29 (helper-96): as above, end to end, on a server that allows lc_messages=de_DE
    (needs a superuser and the locale; skipped otherwise)."""
    url = f"{pg_url}&lc_messages=de_DE.utf8"
    try:
        conn = await asyncpg.connect(pg_url.split("?")[0], server_settings={"lc_messages": "de_DE.utf8"})
    except (asyncpg.PostgresError, OSError) as exc:
        pytest.skip(f"the server takes no lc_messages=de_DE.utf8 from this role: {exc}")
    await conn.close()
    lines = _with_ids(synthetic_export(30), {20: 3})
    event_id = parse_row(lines[3], 4).event_id
    refused = await _refusal(url, lines, 7)
    assert refused.message == f"line 21: event id {event_id} appears twice"
    assert refused.details == {"line": 21, "position": 20, "reason": "duplicate_id"}
