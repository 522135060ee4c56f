"""The README's command line as a newcomer and an acceptance tester use it (stop 41, helper B):
what it documents of each command's output, checked against what the command prints."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore
from tests.test_s38_a_leak_tools import _left_holding


def _run(*args: str, code: int = 0) -> str:
    done = evstore(*args)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return done.stdout


def _json(*args: str, code: int = 0) -> Any:
    return json.loads(_run(*args, "--json", code=code))


async def _migration_of_a_deleted_instance(db: Path) -> dict[str, str]:
    """An instance moved to a migration, then deleted (its delete releases what the migration
    held): the uuids, and the delete's position."""
    async with open_store(f"sqlite:///{db}") as store:
        src = await make_provider(store, "src", VCPU=8)
        instance, migration = new_uuid(), new_uuid()
        await allocate(store, instance, {src: {"VCPU": 2}})
        await store.start_migration(instance, migration)
        deleted = (await store.delete_consumer(instance)).position
    return {"instance": instance, "migration": migration, "deleted": str(deleted)}


def test_diff_names_a_migrations_instance_in_its_table_as_in_its_json(tmp_path: Path) -> None:
    """README: ``evstore diff`` lists each consumer "with their positions, its type and, for a
    migration, its instance (``on_behalf_of``, in ``evstore diff --json`` too ...)". The JSON
    named it; the table had no place for it (consumer, change, type, before, after, events)."""
    db = tmp_path / "c.db"
    ids = asyncio.run(_migration_of_a_deleted_instance(db))
    before = str(int(ids["deleted"]) - 1)
    doc = _json("diff", before, ids["deleted"], "--db", str(db))
    by_consumer = {c["consumer"]: c for c in doc["consumers"]}
    assert by_consumer[ids["migration"]]["on_behalf_of"] == ids["instance"]
    assert by_consumer[ids["instance"]]["on_behalf_of"] is None
    table = _run("diff", before, ids["deleted"], "--db", str(db))
    [row] = [line for line in table.splitlines() if ids["migration"] in line]
    assert ids["instance"] in row, table
    header = next(line for line in table.splitlines() if "consumer" in line and "change" in line)
    assert "instance" in header, table
    [row] = [line for line in table.splitlines() if line.startswith(f"│ {ids['instance']}")]
    assert "released" not in row and "deleted" in row, table


def test_a_providers_uuid_given_for_a_consumer_is_said_to_be_a_providers(tmp_path: Path) -> None:
    """The usage tables list providers' uuids; pasted into ``release``, ``confirm-migration`` or
    ``state --consumer`` one was refused "no event in this log touches consumer X" - of a uuid
    the log names on every line of its history - and a consumer's given to ``state --provider``
    "No resource provider ... found". Each still refuses (the same code and exit status), and says
    what the uuid is instead."""
    db = tmp_path / "c.db"
    ids = asyncio.run(_migration_of_a_deleted_instance(db))
    src = next(iter(_json("state", "--db", str(db))["providers"]))["provider"]
    for args in (["release", src], ["confirm-migration", src], ["state", "--consumer", src]):
        done = evstore(*args, "--db", str(db))
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert done.stderr.startswith(
            f"error: evstore.not_found: no event in this log touches consumer {src}"
        )
        assert "is a resource provider's uuid" in done.stderr, (args, done.stderr)
    for at in ([], ["--at", "2"]):
        done = evstore("state", "--provider", ids["instance"], *at, "--db", str(db))
        assert done.returncode == 1, (at, done.stdout, done.stderr)
        assert done.stderr.startswith("error: placement.resource_provider.not_found: No resource provider"), (
            at
        )
        assert "is a consumer's uuid" in done.stderr, (at, done.stderr)
    stranger = new_uuid()
    for args in (["release", stranger], ["state", "--consumer", stranger], ["state", "--provider", stranger]):
        done = evstore(*args, "--db", str(db))
        assert done.returncode == 1 and "uuid" not in done.stderr.split(stranger, 1)[1], (args, done.stderr)


async def _instance_mid_migration(db: Path) -> dict[str, str]:
    """An instance moved to a migration (on src) and given its new allocations (on dst): the
    migration in flight, as a compute host would confirm it."""
    async with open_store(f"sqlite:///{db}") as store:
        src, dst = await make_provider(store, "src", VCPU=8), await make_provider(store, "dst", VCPU=8)
        instance, migration = new_uuid(), new_uuid()
        await allocate(store, instance, {src: {"VCPU": 2}})
        await store.start_migration(instance, migration)
        await allocate(store, instance, {dst: {"VCPU": 2}})
    return {"instance": instance, "migration": migration}


def test_confirm_migration_given_the_instance_names_its_migration_in_flight(tmp_path: Path) -> None:
    """``confirm-migration INSTANCE`` (the instance's uuid where the migration's belongs) is
    refused as the API refuses it, ``evstore.not_found`` - "holds no allocations for a migration
    in progress" of an instance whose migration is in progress - and now says which uuid to give.
    Nothing is written; the migration's own uuid then confirms it."""
    db = tmp_path / "c.db"
    ids = asyncio.run(_instance_mid_migration(db))
    head = _json("state", "--db", str(db))["head"]
    done = evstore("confirm-migration", ids["instance"], "--db", str(db))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: evstore.not_found: "), done.stderr
    assert f"`evstore confirm-migration {ids['migration']}`" in done.stderr, done.stderr
    assert _json("state", "--db", str(db))["head"] == head
    confirmed = _json("confirm-migration", ids["migration"], "--db", str(db))
    assert (confirmed["instance"], confirmed["position"]) == (ids["instance"], head + 1)
    done = evstore("confirm-migration", ids["instance"], "--db", str(db))  # (none in flight now)
    assert done.returncode == 1 and "evstore confirm-migration" not in done.stderr, done.stderr


def test_confirm_migration_given_a_deleted_instance_names_its_migration_holding_a_leak(
    tmp_path: Path,
) -> None:
    """An older writer's delete of an instance left its migration holding (a leak, which
    ``confirm-migration MIGRATION`` clears): ``confirm-migration INSTANCE`` is refused as the API
    refuses it, ``evstore.consumer.deleted``, and names the command that clears it."""
    db = tmp_path / "old.db"
    ids = asyncio.run(_left_holding(tmp_path, f"sqlite:///{db}"))
    done = evstore("confirm-migration", ids["instance"], "--db", str(db))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: evstore.consumer.deleted: "), done.stderr
    assert f"`evstore confirm-migration {ids['migration']}`" in done.stderr, done.stderr


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_export_that_cannot_be_written_names_the_file(tmp_path: Path) -> None:
    """``export -o FILE`` that fails writing said only "[Errno 28] No space left on device"
    (or "[Errno 22] Invalid argument"), not what it failed to write: it names the file."""
    db = tmp_path / "c.db"
    asyncio.run(_migration_of_a_deleted_instance(db))
    done = evstore("export", "--db", str(db), "-o", "/dev/full")
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr == "error: evstore.io: cannot write the export to /dev/full: No space left on device\n"


def test_tail_says_why_a_read_failed_without_cutting_a_word_in_two() -> None:
    """``tail`` noted a failed read (then tried again) with the error's first 200 characters,
    cut mid-word with nothing to say so: "... while this store had it open: SQLite would go on
    writing to the file it opened, which the pat); trying again". It ends at a word, with an
    ellipsis, and a first line that fits is kept whole."""
    message = (
        "The database file /tmp/pytest-of-root/pytest-451/test_tail_says_why_a_read_fail0/c.db was "
        "deleted or moved while this store had it open: SQLite would go on writing to the file it "
        "opened, which the path no longer names, so nothing was committed.\nsecond line"
    )
    why = cli.first_line(message, 200)
    assert len(why) <= 200 and why.endswith("which the…"), why
    assert message.startswith(why.removesuffix("…"))
    assert cli.first_line("short\nsecond", 200) == "short"
    assert cli.first_line("x" * 300, 200) == "x" * 199 + "…"  # (no space to cut at)


def test_a_demo_refused_for_a_postgresql_schema_with_events_says_what_to_do(pg_url: str) -> None:
    """On PostgreSQL the demo needs a schema without events (on SQLite it replaces its own file):
    a second demo - or one whose first run was interrupted - was refused saying only that the
    store "already has events". Still refused, nothing written, it says what to give instead."""
    _run("demo", "--instances", "2", "--nodes", "2", "--url", pg_url)
    head = _json("stats", "--url", pg_url)["head"]
    done = evstore("demo", "--instances", "2", "--nodes", "2", "--url", pg_url)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert done.stderr.startswith("error: evstore.invalid_input: the demo needs an empty store"), done.stderr
    assert done.stderr.rstrip().endswith(
        "give it a schema without events (another ?search_path=, or database)"
    )
    assert _json("stats", "--url", pg_url)["head"] == head
