"""An import's memory does not grow with the length of the log it imports (issue 5's bound on
rebuild and replay, asked of import too), and what it finds without keeping per-event data
(duplicate event ids) it still finds wherever they lie."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import pytest

from evstore import CorruptEvent, open_store
from evstore.log import GENESIS_HASH
from projections.exchange import EXPORT_FORMAT, EXPORT_VERSION, ExportRow, row_line
from tests.conftest import new_uuid

_RECORDED = "2026-01-02T03:04:05.000006+00:00"
_INVENTORY = {
    "total": 100,
    "reserved": 0,
    "min_unit": 1,
    "max_unit": 100,
    "step_size": 1,
    "allocation_ratio": 1.0,
}


def synthetic_export(events: int, repeat: tuple[int, int] | None = None, blank_every: int = 0) -> list[str]:
    """A sound export of ``events`` events whose fold stays one provider however long it is (a
    provider created, then its inventories replaced again and again): what grows with its length
    is only what the import keeps per event. ``repeat=(a, b)``: position ``b`` carries position
    ``a``'s event id (the chain computed over it); ``blank_every``: an empty line after every so
    many rows (an import skips them, and counts them in the line numbers it names)."""
    provider = new_uuid()
    ids = [new_uuid() for _ in range(events)]
    if repeat is not None:
        ids[repeat[1] - 1] = ids[repeat[0] - 1]
    lines, prev = [], GENESIS_HASH
    for position in range(1, events + 1):
        if position == 1:
            etype, command = "ProviderCreated", "CreateProvider"
            data: dict[str, object] = {"provider": provider, "name": "rp", "parent": None, "root": provider}
        else:
            etype, command = "InventoriesReplaced", "SetInventories"
            data = {"provider": provider, "inventories": {"VCPU": _INVENTORY}, "generation": position - 1}
        # (one metadata text for every event: pydantic's JSON parser caches strings, up to 16,384
        # of them, so unique ones would grow the import's memory here, as far as that bound)
        metadata = json.dumps({"command": command})
        row = ExportRow(
            position,
            ids[position - 1],
            etype,
            1,
            json.dumps(data, separators=(",", ":")),
            metadata,
            _RECORDED,
            "",
        )
        row = row._replace(hash=row.chained_hash(prev))
        prev = row.hash
        lines.append(row_line(row))
        if blank_every and position % blank_every == 0:
            lines.append("")
    header = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "events": events, "head": events}
    return [json.dumps({**header, "head_hash": prev}), *lines]


def synthetic_v1_moves(events: int) -> list[str]:
    """A sound export whose fold stays two providers and one consumer however long it is: the
    consumer's allocations moved from one provider to the other and back by version-1
    AllocationsReplaced events (an earlier evstore's: no ``previous``), each of which changes
    holdings on a provider its payload does not name (the history index must list it there)."""
    a, b, consumer = new_uuid(), new_uuid(), new_uuid()
    payloads: list[tuple[str, int, dict[str, object]]] = [
        ("ProviderCreated", 1, {"provider": a, "name": "a", "parent": None, "root": a}),
        ("ProviderCreated", 1, {"provider": b, "name": "b", "parent": None, "root": b}),
        ("InventoriesReplaced", 1, {"provider": a, "inventories": {"VCPU": _INVENTORY}, "generation": 1}),
        ("InventoriesReplaced", 1, {"provider": b, "inventories": {"VCPU": _INVENTORY}, "generation": 1}),
    ]
    for n in range(1, events - len(payloads) + 1):
        to = (a, b)[n % 2]
        data = {
            "consumer": consumer,
            "allocations": {to: {"VCPU": 1}},
            "project_id": "p",
            "user_id": "u",
            "generation": n,
            "provider_generations": {to: n + 1},
        }
        payloads.append(("AllocationsReplaced", 1, data))
    return _chained(payloads)


def _chained(payloads: list[tuple[str, int, dict[str, object]]]) -> list[str]:
    lines, prev = [], GENESIS_HASH
    metadata = json.dumps({"command": "Imported"})  # (one text: see synthetic_export)
    for position, (etype, version, data) in enumerate(payloads, start=1):
        text = json.dumps(data, separators=(",", ":"))
        row = ExportRow(position, new_uuid(), etype, version, text, metadata, _RECORDED, "")
        row = row._replace(hash=row.chained_hash(prev))
        prev = row.hash
        lines.append(row_line(row))
    header = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "events": len(payloads)}
    return [json.dumps({**header, "head": len(payloads), "head_hash": prev}), *lines]


async def _fresh_url(backend_name: str, tmp_path: Path, name: str) -> str:
    if backend_name == "sqlite":
        return f"sqlite:///{tmp_path}/{name}.db"
    from tests.pg import fresh_database_url

    return fresh_database_url()


async def _held(url: str, lines: list[str]) -> int:
    """The most memory (Python's allocations, traced) the import of ``lines`` held from one batch
    of its validation pass to the next: what it keeps of the rows it has read."""
    async with open_store(url) as store:
        held = []
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]

            def progress(phase: str, done: int) -> None:  # (called between batches)
                if phase == "validate":
                    held.append(tracemalloc.get_traced_memory()[0] - before)

            assert await store.import_events(lambda: iter(lines), progress=progress) == len(lines) - 1
        finally:
            tracemalloc.stop()
        return max(held)


async def test_an_import_holds_nothing_per_event(tmp_path: Path) -> None:
    """Regression (helper-93): the validation pass kept every event id it had read, to refuse a
    duplicate (~110 bytes an event: ~1.1 GB for 10M events, on top of the fold), so an import's
    memory grew with the log. Four times the events now hold no more: here 7,500 more events,
    which the id set made ~0.8 MB more. (The pass is the same on both backends.)"""
    small, large = synthetic_export(2_500), synthetic_export(10_000)
    first = await _held(f"sqlite:///{tmp_path}/small.db", small)
    second = await _held(f"sqlite:///{tmp_path}/large.db", large)
    assert second - first < 250_000, (first, second)


@pytest.mark.parametrize(
    ("repeat", "batch_size", "blank_every"),
    [((3, 40), 7, 0), ((12, 13), 7, 0), ((3, 40), 7, 5), ((1, 60), 1000, 0)],
    ids=["across-batches", "within-a-batch", "blank-lines", "one-batch"],
)
async def test_a_duplicate_event_id_is_refused_naming_its_line_wherever_it_lies(
    backend_name: str, tmp_path: Path, repeat: tuple[int, int], batch_size: int, blank_every: int
) -> None:
    """The duplicate found without a set of every id (by the store as the rows are written) is
    refused as before: ``evstore.log.corrupt``, ``reason="duplicate_id"``, the line and position of
    its second occurrence, and nothing imported; the store then takes a sound file."""
    lines = synthetic_export(60, repeat=repeat, blank_every=blank_every)
    line = next(
        n for n, text in enumerate(lines, 1) if text and json.loads(text).get("position") == repeat[1]
    )
    event_id = json.loads(lines[line - 1])["event_id"]
    async with open_store(await _fresh_url(backend_name, tmp_path, "target")) as store:
        with pytest.raises(CorruptEvent) as info:
            await store.import_events(lambda: iter(lines), batch_size=batch_size)
        assert info.value.message == f"line {line}: event id {event_id} appears twice"
        assert info.value.details == {"line": line, "position": repeat[1], "reason": "duplicate_id"}
        assert info.value.code == "evstore.log.corrupt"
        assert await store.head() == 0
        assert await store.providers() == []
        sound = synthetic_export(60)
        assert await store.import_events(lambda: iter(sound), batch_size=batch_size) == 60


async def test_an_import_of_moves_its_payloads_do_not_name_holds_nothing_per_event(tmp_path: Path) -> None:
    """Regression (helper-93): for every event whose fold changes holdings on a provider its
    payload does not name (each allocation change of a version-1 log, many of a Placement-style
    writer's), the validation pass kept that provider's history key until the write pass
    (``extra_entities``: ~360 bytes such an event, more than the id set was). The write pass
    now finds those keys from its own fold: 7,500 more such events held ~2.7 MB more before."""
    small, large = synthetic_v1_moves(2_500), synthetic_v1_moves(10_000)
    first = await _held(f"sqlite:///{tmp_path}/small.db", small)
    second = await _held(f"sqlite:///{tmp_path}/large.db", large)
    assert second - first < 250_000, (first, second)


async def test_an_imported_move_its_payload_does_not_name_is_in_the_history_it_left(
    backend_name: str, tmp_path: Path
) -> None:
    """Each move of the version-1 log is in the history of both providers: the one it names and
    the one it took the allocation from (the history index written from the write pass's fold);
    batches of 7 rows, so that moves straddle them."""
    lines = synthetic_v1_moves(40)
    rows = [json.loads(text) for text in lines[1:]]
    a, b = (json.loads(rows[i]["data"])["provider"] for i in (0, 1))
    async with open_store(await _fresh_url(backend_name, tmp_path, "target")) as store:
        assert await store.import_events(lambda: iter(lines), batch_size=7) == 40
        # (position 5 allocates on b, then 6, 7, ... move the allocation to a, b, a...: each
        # of those touches both providers, and names one)
        for provider, held in ((a, [1, 3, *range(6, 41)]), (b, [2, 4, *range(5, 41)])):
            assert [e.position async for e in store.history(provider)] == held, provider
        assert (await store.audit()).clean
