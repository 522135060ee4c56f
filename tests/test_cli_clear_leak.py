"""``evstore release`` and ``evstore confirm-migration``: a leak cleared from the command line.

Regression (stop 38): the audit, ``state``, ``history`` and ``diff`` found a leak and said to
clear it with ``store.release(...)`` or ``store.confirm_migration(...)``, and no command of the
command line could: an operator had to write Python. Each command makes exactly that API call on
a store that must exist, answers one line (or ``--json``, with ``url``), and refuses as the API
does, one line with its code; a uuid no event names is ``evstore.not_found``, as for ``history``,
and a consumer that holds nothing has nothing to release (exit 0, nothing written).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from evstore import open_store
from tests.conftest import allocate, new_uuid
from tests.test_audit_findings import _migration_left_holding, append_row, chained
from tests.test_cli_support import demo_db, evstore
from tests.test_s38_a_leak_tools import _left_holding, _revert_to_deleted, _target

#: the keys of ``--json``, in order
RELEASE_KEYS = [
    "url",
    "consumer",
    "released",
    "position",
    "leak_cleared",
    "migrations_leaking",
    "provider_names",
]
CONFIRM_KEYS = ["url", "migration", "instance", "released", "position", "leak_cleared", "provider_names"]


def _ok(*args: str) -> str:
    """A command's one line of output (asserts exit 0 and nothing on stderr)."""
    done = evstore(*args)
    assert done.returncode == 0 and not done.stderr, (args, done.stdout, done.stderr)
    assert len(done.stdout.strip().splitlines()) == 1, done.stdout
    return done.stdout.strip()


def _json(*args: str) -> dict[str, Any]:
    done = evstore(*args, "--json")
    assert done.returncode == 0 and not done.stderr, (args, done.stdout, done.stderr)
    doc: dict[str, Any] = json.loads(done.stdout)
    return doc


def _refused(*args: str) -> tuple[int, str, str]:
    """(exit status, code, message) of a refused command: one line, no traceback, no output."""
    done = evstore(*args)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, done.stderr)
    assert not done.stdout, (args, done.stdout)
    _, code, message = lines[0].split(": ", 2)
    return done.returncode, code, message


def _head(url: str) -> int:
    async def head() -> int:
        async with open_store(url) as store:
            return await store.head()

    return asyncio.run(head())


def test_release_clears_a_deleted_consumers_leak_and_a_second_run_has_nothing_to_release(
    tmp_path: Path, store_url: str
) -> None:
    s = asyncio.run(_revert_to_deleted(tmp_path, store_url))
    where, instance = _target(store_url), s["instance"]
    assert evstore("audit", *where).returncode == 3
    head = _head(store_url)
    # (confirm-migration of it is refused, saying it holds a leak - not that a delete released all)
    code, name, message = _refused("confirm-migration", instance, *where)
    assert (code, name) == (1, "evstore.consumer.deleted") and "released then" not in message
    assert "(it still holds allocations: a leak)" in message and f"`evstore release {instance}`" in message
    said = _ok("release", instance, *where)
    assert said == (f"consumer {instance}: released src: VCPU=2 at position {head + 1}; the leak is cleared")
    assert evstore("audit", *where).returncode == 0  # (clean)
    # what it wrote: the API's release, by the command line (its actor, in the history)
    [event] = [e for e in _json("history", instance, *where)["events"] if e["position"] == head + 1]
    assert event["type"] == "AllocationsReleased" and event["metadata"]["actor"] == "evstore-cli"
    # again: nothing to release, exit 0, nothing written
    again = _ok("release", instance, *where)
    assert (
        again
        == f"consumer {instance} holds nothing: nothing to release (deleted at position {s['tombstone']})"
    )
    doc = _json("release", instance, *where)
    assert list(doc) == RELEASE_KEYS
    assert doc["consumer"] == instance and doc["released"] == {} and doc["position"] is None
    assert doc["leak_cleared"] is False and doc["provider_names"] == {}
    assert _head(store_url) == head + 1


def test_confirm_migration_clears_a_migration_left_holding_for_a_deleted_instance(
    tmp_path: Path, store_url: str
) -> None:
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where, migration, instance = _target(store_url), s["migration"], s["instance"]
    assert evstore("audit", *where).returncode == 3
    head = _head(store_url)
    doc = _json("confirm-migration", migration.upper(), *where)  # (any spelling of the uuid)
    assert list(doc) == CONFIRM_KEYS
    assert doc["url"] == json.loads(evstore("stats", *where, "--json").stdout)["url"]
    assert (doc["migration"], doc["instance"], doc["position"]) == (migration, instance, head + 1)
    assert doc["released"] == {s["src"]: {"VCPU": 2}} and doc["provider_names"] == {s["src"]: "src"}
    assert doc["leak_cleared"] is True
    assert evstore("audit", *where).returncode == 0
    assert _ok("confirm-migration", migration, *where) == (
        f"migration {migration} of instance {instance} holds nothing: nothing to release"
    )
    again = _json("confirm-migration", migration, *where)
    assert (again["released"], again["position"], again["leak_cleared"]) == ({}, None, False)
    assert _head(store_url) == head + 1


def test_each_refusal_is_the_apis_one_line_with_its_code(tmp_path: Path, store_url: str) -> None:
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where, migration, instance = _target(store_url), s["migration"], s["instance"]
    live = new_uuid()

    async def add_live() -> None:
        async with open_store(store_url) as store:
            await allocate(store, live, {s["dst"]: {"VCPU": 1}})

    asyncio.run(add_live())
    head = _head(store_url)
    for command in ("release", "confirm-migration"):
        assert _refused(command, "not-a-uuid", *where)[:2] == (1, "evstore.invalid_input")
        unknown = new_uuid()
        code = _refused(command, unknown, *where)
        assert code == (1, "evstore.not_found", f"no event in this log touches consumer {unknown}")
        assert _refused(command, " ", *where)[:2] == (2, "evstore.usage")
        assert _refused(command, instance, "--json")[:2] == (2, "evstore.usage")  # (no store given)
    # not a migration: a consumer holding allocations of its own, and a deleted instance
    code, name, message = _refused("confirm-migration", live, *where)
    assert (code, name) == (
        1,
        "evstore.not_found",
    ) and "no allocations for a migration in progress" in message
    code, name, message = _refused("confirm-migration", instance, *where)
    assert (code, name) == (1, "evstore.consumer.deleted") and "no migration of it to confirm" in message
    assert _head(store_url) == head  # (nothing written by any of them)
    # the migration's leak holds: release of the migration clears it too (the API releases any consumer)
    assert evstore("audit", *where).returncode == 3
    assert _ok("release", migration, *where).endswith(f"at position {head + 1}; the leak is cleared")
    assert evstore("audit", *where).returncode == 0


def test_a_migration_whose_instance_is_alive_is_confirmed_as_the_api_confirms_it(
    tmp_path: Path, store_url: str
) -> None:
    """The commands make the API call, whatever the consumer: a live instance's migration is
    confirmed (the resize's source released), a live consumer's allocations released - neither a
    leak, and their answer says none was cleared."""
    s = asyncio.run(_revert_to_deleted(tmp_path, store_url))
    where = _target(store_url)
    instance, migration = new_uuid(), new_uuid()

    async def migrating() -> None:
        async with open_store(store_url) as store:
            await allocate(store, instance, {s["src"]: {"VCPU": 1}})
            await store.start_migration(instance, migration)
            await allocate(store, instance, {s["src"]: {"VCPU": 1}})

    asyncio.run(migrating())
    head = _head(store_url)
    said = _ok("confirm-migration", migration, *where)
    confirmed = f"migration {migration} of instance {instance} confirmed"
    assert said == f"{confirmed}: released src: VCPU=1 at position {head + 1}"
    assert _ok("confirm-migration", migration, *where) == (
        f"migration {migration} of instance {instance} holds nothing: nothing to release"
    )
    doc = _json("release", instance, *where)
    assert (doc["released"], doc["position"], doc["leak_cleared"]) == (
        {s["src"]: {"VCPU": 1}},
        head + 2,
        False,
    )


def test_a_store_is_never_created_nor_an_older_one_upgraded(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    some = new_uuid()
    for command in ("release", "confirm-migration"):
        for how in (("--db", str(missing)), ("--url", f"sqlite:///{missing}")):
            assert _refused(command, some, *how)[:2] == (1, "evstore.not_found")
    assert not missing.exists()
    older = demo_db(tmp_path / "older.db", instances=4, nodes=2)
    with sqlite3.connect(older) as conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    for command in ("release", "confirm-migration"):
        code, name, message = _refused(command, some, "--db", str(older))
        assert (code, name) == (1, "evstore.schema.version") and "evstore upgrade --db" in message
    with sqlite3.connect(older) as conn:
        assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("4",)
    conn.close()


@pytest.mark.parametrize("command", ["release", "confirm-migration"])
def test_the_help_names_the_api_call(command: str) -> None:
    done = evstore(command, "--help")
    assert done.returncode == 0
    call = "store.release" if command == "release" else "store.confirm_migration"
    assert call in done.stdout


def test_the_release_of_a_deleted_instance_names_its_migrations_still_leaking(
    tmp_path: Path, store_url: str
) -> None:
    """Regression (review): the release of a deleted instance holding a leak said "the leak is
    cleared" (``leak_cleared`` true) while a migration still held a leak for it - the audit still
    failed. It says its own leak is cleared and names each migration still leaking, with how to
    clear it; confirming that migration leaves the audit clean."""
    lines, delete, ids = asyncio.run(_migration_left_holding(tmp_path))
    instance, migration, src = ids["instance"], ids["migration"], ids["src"]
    given = chained(
        delete,
        "AllocationsReplaced",
        {
            "consumer": instance,
            "allocations": {src: {"VCPU": 1}},
            "project_id": "p",
            "user_id": "u",
            "consumer_type": "INSTANCE",
            "generation": 5,
        },
    )
    append_row(lines, given)

    async def imported() -> None:
        async with open_store(store_url) as store:
            await store.import_events(lambda: iter(lines))
            assert (await store.allocations(instance)).leaked and (await store.allocations(migration)).leaked

    asyncio.run(imported())
    where = _target(store_url)
    doc = _json("release", instance, *where)
    assert list(doc) == RELEASE_KEYS
    assert doc["migrations_leaking"] == [migration] and doc["released"] == {src: {"VCPU": 1}}
    assert evstore("audit", *where).returncode == 3
    again = _ok("release", instance, *where)
    assert (
        f"migration {migration} still holds a leak for it: clear it with `evstore confirm-migration" in again
    )
    _ok("confirm-migration", migration, *where)
    assert _json("release", instance, *where)["migrations_leaking"] == []
    assert evstore("audit", *where).returncode == 0
