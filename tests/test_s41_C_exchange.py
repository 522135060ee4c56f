"""Stop 41, helper C: export/import round trips and the refusal of files an evstore did not write."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from evstore import CorruptEvent, InvalidInput, Inventory, open_store
from evstore import events as ev
from evstore.events import GENESIS_HASH, event_hash
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_s41_C_time_travel import export_of

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


# --- the seed bug, as a log an older, Placement-style writer left ---------------------------------

SRC, DST, INSTANCE, MIGRATION = (str(uuid.UUID(int=n, version=4)) for n in (1, 2, 3, 4))
FLAVOR = {"VCPU": 4, "MEMORY_MB": 8192}


def seed_bug_log(revert: str) -> list[ev.EventBase]:
    """Bug 1848343 as an older writer recorded it: the instance resized from SRC to DST (the
    migration holds SRC), the instance deleted - its DST allocation released, the migration left
    holding SRC - and then the revert gives SRC back to the deleted instance: as evstore's own
    MigrationReverted, or as Placement's move_allocations, two AllocationsReplaced."""
    inventory = {rc: Inventory(total=64 * 1024) for rc in FLAVOR}
    events: list[ev.EventBase] = [
        ev.ProviderCreated(provider=SRC, name="compute-src", root=SRC),
        ev.ProviderCreated(provider=DST, name="compute-dst", root=DST),
        ev.InventoriesReplaced(provider=SRC, inventories=inventory, generation=1),
        ev.InventoriesReplaced(provider=DST, inventories=inventory, generation=1),
        ev.AllocationsReplaced(
            consumer=INSTANCE,
            allocations={SRC: FLAVOR},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=1,
            provider_generations={SRC: 2},
        ),
        ev.MigrationStarted(
            instance=INSTANCE,
            migration=MIGRATION,
            allocations={SRC: FLAVOR},
            project_id="p",
            user_id="u",
            instance_consumer_type="INSTANCE",
            instance_generation=1,
            provider_generations={SRC: 3},
        ),
        ev.AllocationsReplaced(
            consumer=INSTANCE,
            allocations={DST: FLAVOR},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=1,
            provider_generations={DST: 2},
        ),
        # (the older writer's delete: the migration's SRC allocation is not released)
        ev.ConsumerDeleted(consumer=INSTANCE, released={DST: FLAVOR}),
    ]
    if revert == "MigrationReverted":
        events.append(
            ev.MigrationReverted(
                migration=MIGRATION,
                instance=INSTANCE,
                allocations={SRC: FLAVOR},
                project_id="p",
                user_id="u",
                instance_consumer_type="INSTANCE",
                instance_generation=2,
                provider_generations={SRC: 4},
            )
        )
    else:
        events += [
            ev.AllocationsReplaced(
                consumer=MIGRATION,
                allocations={},
                previous={SRC: FLAVOR},
                project_id="p",
                user_id="u",
                consumer_type="MIGRATION",
                generation=None,
                provider_generations={SRC: 4},
            ),
            ev.AllocationsReplaced(
                consumer=INSTANCE,
                allocations={SRC: FLAVOR},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=1,
                provider_generations={SRC: 4},
            ),
        ]
    return events


@pytest.mark.parametrize("revert", ["MigrationReverted", "move_allocations"])
async def test_the_seed_bug_in_an_imported_log_is_found_told_and_cleared(store_url: str, revert: str) -> None:
    events = seed_bug_log(revert)
    lines = export_of(events, datetime(2025, 3, 1, tzinfo=UTC))
    deleted_at, head = 8, len(events)
    async with open_store(store_url, snapshot_every=3) as store:
        await store.import_events(lambda: lines)
        # between the delete and the revert: the migration holds SRC for a deleted instance
        migration = await (await store.state_at(deleted_at, consumer=MIGRATION)).allocations(MIGRATION)
        assert migration.leaked and migration.on_behalf_of == INSTANCE
        assert migration == (await store.state_at(deleted_at)).state.consumers[MIGRATION].allocations
        delete = await store.diff(deleted_at - 1, deleted_at)
        leaked = delete.consumer(MIGRATION)
        assert leaked is not None and leaked.change == "leaked" and leaked.positions == (deleted_at,)
        assert [p.position async for p in store.history(MIGRATION)] == [
            6,
            deleted_at,
            9,
        ]  # (its revert's first)
        # at the head: the revert gave SRC back to the deleted instance, the audit's leak
        report = await store.audit()
        assert [(f.kind, f.details["consumer"]) for f in report.findings] == [("leak", INSTANCE)]
        leak = report.findings[0]
        assert leak.positions == (deleted_at, head) and leak.details["allocations"] == {SRC: FLAVOR}
        assert "req-8" in leak.message and f"store.release('{INSTANCE}')" in leak.message
        instance = await (await store.state_at(head, consumer=INSTANCE)).allocations(INSTANCE)
        assert instance.leaked and instance.deleted and instance.deleted_at == deleted_at
        assert (await store.allocations(INSTANCE)).leaked
        revert_diff = await store.diff(deleted_at, head)
        assert revert_diff.consumer(INSTANCE).change == "leaked"  # type: ignore[union-attr]
        assert [
            (u.provider, u.delta) for u in revert_diff.usage
        ] == []  # (SRC: the migration's, now the instance's)
        assert head in [e.position async for e in store.history(INSTANCE)]
        # cleared as the message says: usage back to what it was before the instance existed
        receipt = await store.release(INSTANCE)
        assert receipt.positions == (head + 1,)
        assert (await store.audit()).clean
        assert await store.usage(SRC) == {"VCPU": 0, "MEMORY_MB": 0}
        assert (await store.state_at(4)).state.providers[SRC].usages == {}
        assert [line async for line in store.export()][1 : len(lines)] == lines[1:]  # (rows kept as imported)


def _with_nul(where: str) -> list[ev.EventBase]:
    """A small log with a NUL character in one of the texts the projection stores."""
    name, project, user = ("a\x00b" if where == "name" else "n"), "p", "u"
    if where == "project_id":
        project = "p\x00"
    if where == "user_id":
        user = "\x00"
    events: list[ev.EventBase] = [
        ev.ProviderCreated(provider=SRC, name=name, root=SRC),
        ev.InventoriesReplaced(provider=SRC, inventories={"VCPU": Inventory(total=8)}, generation=1),
        ev.AllocationsReplaced(
            consumer=INSTANCE,
            allocations={SRC: {"VCPU": 1}},
            project_id=project,
            user_id=user,
            consumer_type="INSTANCE",
            generation=1,
            provider_generations={SRC: 2},
        ),
    ]
    if where == "rename":
        events.append(ev.ProviderUpdated(provider=SRC, name="b\x00"))
    return events


@pytest.mark.parametrize(
    ("where", "position"), [("name", 1), ("project_id", 3), ("user_id", 3), ("rename", 4)]
)
async def test_a_nul_character_in_an_imported_payload_is_refused_alike_on_both_backends(
    store_url: str, where: str, position: int
) -> None:
    """No command writes a NUL character in a name or an owner (PostgreSQL cannot store one: both
    backends refuse it alike). An imported log holding one was imported by SQLite, and refused by
    PostgreSQL only as it wrote the rows, ``evstore.storage`` "invalid byte sequence for encoding
    UTF8: 0x00", naming neither the line nor the event: the file imports into one backend and not
    the other. Both refuse it now while validating, naming its line and position."""
    lines = export_of(_with_nul(where), datetime(2025, 3, 1, tzinfo=UTC))
    async with open_store(store_url) as store:
        with pytest.raises(CorruptEvent) as refused:
            await store.import_events(lambda: lines)
        assert refused.value.details == {
            "line": position + 1,
            "position": position,
            "reason": "invalid_value",
        }
        assert "NUL" in refused.value.message
        assert await store.head() == 0


async def test_a_nul_character_in_an_imported_events_metadata_is_kept(store_url: str) -> None:
    """(Metadata is stored as the JSON text the hash covers, its NUL escaped: both backends keep it.)"""
    events = _with_nul("none")
    lines = export_of(events, datetime(2025, 3, 1, tzinfo=UTC))
    row = json.loads(lines[1])
    row["metadata"] = json.dumps({"request_id": "req\x00"})
    lines = chained([row, *(json.loads(line) for line in lines[2:])])
    async with open_store(store_url) as store:
        assert await store.import_events(lambda: lines) == len(events)
        assert (await store.read(0, 1))[0].metadata.request_id == "req\x00"


async def test_a_file_that_is_not_utf8_text_is_refused_as_invalid_input(
    tmp_path: Path, store_url: str
) -> None:
    """``import_events(lambda: open(path))`` - the form the API's own message suggests - of a file
    with bytes that are not UTF-8 ended in the file's bare UnicodeDecodeError, raised by the text
    file as the import read it (``evstore import`` said "not UTF-8 text", evstore.invalid_input)."""
    rows = await exported_rows(tmp_path)
    path = tmp_path / "damaged.jsonl"
    lines = chained(rows)
    path.write_bytes(
        ("\n".join(lines[:2]) + "\n").encode() + b"\xff\xfe garbage\n" + lines[2].encode() + b"\n"
    )
    opened: list[Any] = []

    def open_lines() -> Any:
        opened.append(path.open(encoding="utf-8"))
        return opened[-1]

    async with open_store(store_url) as target:
        with pytest.raises(InvalidInput) as refused:
            await target.import_events(open_lines)
        assert "not UTF-8 text" in refused.value.message and refused.value.details == {"field": "open_lines"}
        assert await target.head() == 0
    assert opened and all(f.closed for f in opened)


async def test_a_name_spelling_out_a_nul_escape_is_not_a_nul(store_url: str) -> None:
    """(A backslash and "u0000" in a name are six characters, not NUL: imported as they are.)"""
    events = [ev.ProviderCreated(provider=SRC, name="a\\u0000b", root=SRC)]
    lines = export_of(events, datetime(2025, 3, 1, tzinfo=UTC))
    async with open_store(store_url) as store:
        assert await store.import_events(lambda: lines) == 1
        assert await store.providers() == [(SRC, "a\\u0000b")]
