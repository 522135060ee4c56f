"""The command line as an operator meets it (stop 39, helper A): ``history``'s leak notes on an
older writer's move of a deleted instance's allocations, ``confirm-migration --json``'s instance
when there is nothing to confirm, ``state --provider`` and ``tail`` marking leaks, ``release``'s
``leak_cleared`` under a race, and the failures an operator's bad input meets."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, cli, open_store
from evstore.errors import NotFound
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import _migration_left_holding, _tail, append_row, chained
from tests.test_cli_support import evstore
from tests.test_s38_a_leak_tools import _imported, _revert_to_deleted, _target


def _run(*args: str, code: int = 0) -> str:
    done = evstore(*args)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return done.stdout


def _json(*args: str, code: int = 0) -> Any:
    return json.loads(_run(*args, "--json", code=code))


async def _moved_after_delete(tmp_path: Path) -> tuple[list[str], int, dict[str, str]]:
    """An export of a store where an instance (2 VCPU on src) was deleted (this evstore: released),
    and the move of its allocations to a migration an older, Placement-style writer then recorded
    (a MigrationStarted, as a ``write_allocations`` move is recorded): (lines, the move's position,
    the uuids and the tombstone's position)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        src = await make_provider(source, "src", VCPU=8)
        instance, migration = new_uuid(), new_uuid()
        await allocate(source, instance, {src: {"VCPU": 2}})
        tombstone = (await source.delete_consumer(instance)).position
        lines = [line async for line in source.export()]
        last = await _tail(source)
    move = chained(
        last,
        "MigrationStarted",
        {"instance": instance, "migration": migration, "allocations": {src: {"VCPU": 2}},
         "project_id": "project", "user_id": "user", "instance_consumer_type": "INSTANCE",
         "instance_generation": 1, "provider_generations": {}},
    )  # fmt: skip
    append_row(lines, move)
    ids = {"src": src, "instance": instance, "migration": migration, "tombstone": str(tombstone)}
    return lines, move.position, ids


# --- 1. history notes the move of a deleted instance's allocations to a migration ---------------


def test_history_says_a_move_of_a_deleted_instances_allocations_made_a_leak(
    tmp_path: Path, store_url: str
) -> None:
    """Regression (stop 38's leftover): an older writer's MigrationStarted moving a deleted
    instance's allocations onto a migration makes the migration the audit's leak, but its line in
    the histories of the instance and of the migration said only "instance I moved ... to
    migration M", although history marks the event that made each leak. Both say so now, with how
    to clear it while it is one (and, cleared, what it did)."""
    lines, moved, ids = asyncio.run(_moved_after_delete(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, instance, migration = _target(store_url), ids["instance"], ids["migration"]
    [leak] = [f for f in _json("audit", *where, code=3)["findings"] if f["kind"] == "leak"]
    assert leak["details"]["consumer"] == migration and moved in leak["positions"]
    said = f"held for an instance deleted at position {ids['tombstone']}: a leak"
    clear = f"clear it with `evstore confirm-migration {migration}` (store.confirm_migration('{migration}'))"
    for key in (instance, migration):
        events = _json("history", key, *where)["events"]
        [move] = [e for e in events if e["position"] == moved]
        assert move["summary"].endswith(f"; {said}; {clear}"), (key, move["summary"])
        assert not any("a leak" in e["summary"] for e in events if e is not move), key
        [row] = [line for line in _run("history", key, *where).splitlines() if "MigrationStarted" in line]
        assert "held for an instance deleted at position" in row, row
    assert _run("confirm-migration", migration, *where).endswith("; the leak is cleared\n")
    for key in (instance, migration):
        [move] = [e for e in _json("history", key, *where)["events"] if e["position"] == moved]
        assert move["summary"].endswith(f"; {said}"), key  # (what it did; cleared since)


async def _written_after_delete(tmp_path: Path) -> tuple[list[str], int, dict[str, str]]:
    """An export where an instance's delete released its migration (this evstore: the link kept),
    and the write of allocations to that migration an older writer then recorded (an
    AllocationsReplaced that does not name the instance): (lines, its position, the ids)."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        src = await make_provider(source, "src", VCPU=8)
        instance, migration = new_uuid(), new_uuid()
        await allocate(source, instance, {src: {"VCPU": 2}})
        await source.start_migration(instance, migration)
        tombstone = (await source.delete_consumer(instance)).position
        lines = [line async for line in source.export()]
        last = await _tail(source)
    write = chained(
        last,
        "AllocationsReplaced",
        {"consumer": migration, "allocations": {src: {"VCPU": 2}}, "project_id": "project",
         "user_id": "user", "consumer_type": "MIGRATION", "generation": 1, "provider_generations": {}},
    )  # fmt: skip
    append_row(lines, write)
    ids = {"src": src, "instance": instance, "migration": migration, "tombstone": str(tombstone)}
    return lines, write.position, ids


def test_history_says_a_write_to_a_deleted_instances_migration_made_a_leak(
    tmp_path: Path, store_url: str
) -> None:
    """Regression (as above): an older writer's write of allocations to a migration its
    instance's delete had emptied (the link to the instance kept) is the audit's leak; the
    migration's history said only "consumer M now holds ...". It says whose deleted instance it
    holds them for, and how to clear it."""
    lines, written, ids = asyncio.run(_written_after_delete(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, migration = _target(store_url), ids["migration"]
    [leak] = [f for f in _json("audit", *where, code=3)["findings"] if f["kind"] == "leak"]
    assert leak["details"]["consumer"] == migration
    events = _json("history", migration, *where)["events"]
    [write] = [e for e in events if e["position"] == written]
    said = f"held for an instance deleted at position {ids['tombstone']}: a leak"
    assert write["summary"].endswith(f"; {said}; clear it with `evstore confirm-migration {migration}` "
                                     f"(store.confirm_migration('{migration}'))")  # fmt: skip
    assert not any("a leak" in e["summary"] for e in events if e is not write)


# --- 2. confirm-migration --json names the instance when there is nothing to confirm -------------


def test_confirm_migration_with_nothing_to_confirm_names_its_instance(tmp_path: Path, store_url: str) -> None:
    """Regression (stop 38's leftover): ``confirm-migration --json`` of a migration that holds
    nothing answered ``"instance": null``, where the log names its instance (and a confirm that
    releases something names it): a migration confirmed already, and one its instance's delete
    released, both name the instance the log last moved to them."""

    async def build() -> dict[str, str]:
        async with open_store(store_url) as store:
            rp = await make_provider(store, "rp", VCPU=8)
            ids = {name: new_uuid() for name in ("confirmed", "its_instance", "released", "deleted")}
            await allocate(store, ids["its_instance"], {rp: {"VCPU": 1}})
            await store.start_migration(ids["its_instance"], ids["confirmed"])
            await store.confirm_migration(ids["confirmed"])
            await allocate(store, ids["deleted"], {rp: {"VCPU": 1}})
            await store.start_migration(ids["deleted"], ids["released"])
            await store.delete_consumer(ids["deleted"])
            return ids

    ids = asyncio.run(build())
    where = _target(store_url)
    for migration, instance in ((ids["confirmed"], ids["its_instance"]), (ids["released"], ids["deleted"])):
        doc = _json("confirm-migration", migration, *where)
        assert (doc["migration"], doc["instance"], doc["position"]) == (migration, instance, None), doc
        assert doc["released"] == {} and doc["leak_cleared"] is False


# --- 4. release under a race with another writer ---------------------------------------------------


def _fresh_like(url: str, tmp_path: Path) -> str:
    """Another empty store on ``url``'s backend."""
    if url.startswith("sqlite:"):
        return f"sqlite:///{tmp_path}/fresh.db"
    from tests.pg import fresh_database_url

    return fresh_database_url()


def _where_args(url: str) -> tuple[str | None, str | None]:
    """(--db, --url) as ``_clear`` takes them."""
    return (url.removeprefix("sqlite:///"), None) if url.startswith("sqlite:") else (None, url)


async def test_release_refused_while_another_writer_allocates_says_nothing_to_release(
    store_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``release`` read the consumer again after the API refused it (it held nothing)
    and, finding allocations another writer had written in between, failed with the refusal's
    ``evstore.not_found`` (exit 1) - the release was decided on a consumer holding nothing, which
    is "nothing to release", exit 0, nothing written. Interleaved deliberately: the other writer
    allocates right after the refusal."""
    async with open_store(store_url) as other:
        rp = await make_provider(other, "rp", VCPU=8)
        consumer = new_uuid()
        await allocate(other, consumer, {rp: {"VCPU": 1}})
        await other.release(consumer)
        real = AllocationStore.release

        async def release(self: AllocationStore, given: str, **options: Any) -> Any:
            try:
                return await real(self, given, **options)
            except NotFound:
                await allocate(other, consumer, {rp: {"VCPU": 2}})  # (the other writer, between)
                raise

        monkeypatch.setattr(AllocationStore, "release", release)
        head = await other.head()
        assert await cli._clear(consumer, *_where_args(store_url), True, migration=False) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["position"], doc["released"], doc["leak_cleared"]) == (None, {}, False)
        assert await other.head() == head + 1  # (the other writer's, and nothing of the release's)


async def test_release_says_whether_it_cleared_a_leak_from_what_it_released(
    tmp_path: Path, store_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``leak_cleared`` is the log's: whether the consumer held a leak just before the release's
    own event - not a read made before the command, which another writer may have made stale. Here
    another writer releases the leak first (interleaved deliberately, just before the command):
    this release has nothing to release and cleared nothing; run alone, it clears the leak."""
    s = await _revert_to_deleted(tmp_path, store_url)
    instance = s["instance"]
    real = AllocationStore.release
    async with open_store(store_url) as other:

        async def release(self: AllocationStore, given: str, **options: Any) -> Any:
            await real(other, given)  # (the other writer, first)
            return await real(self, given, **options)

        monkeypatch.setattr(AllocationStore, "release", release)
        assert await cli._clear(instance, *_where_args(store_url), True, migration=False) == 0
        doc = json.loads(capsys.readouterr().out)
        assert (doc["position"], doc["leak_cleared"]) == (None, False)
    monkeypatch.setattr(AllocationStore, "release", real)
    (tmp_path / "again").mkdir()
    s = await _revert_to_deleted(tmp_path / "again", fresh := _fresh_like(store_url, tmp_path))
    assert await cli._clear(s["instance"], *_where_args(fresh), True, migration=False) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["leak_cleared"] is True and doc["position"] is not None


# --- 3. state --provider and tail mark leaks --------------------------------------------------------


def test_state_of_a_provider_marks_the_leaks_on_it(tmp_path: Path, store_url: str) -> None:
    """Regression (stop 38's leftover): ``state --provider`` listed the allocations on it with no
    word of which are leaks, where ``state`` counts them and ``state --consumer`` says so: a
    deleted consumer's, and a deleted instance's migration's. ``--json`` has ``leaks`` (the
    consumers holding one there), the table a "leak" column with how to clear each while it is
    one; at the head and in time travel (the provider's slice) alike."""
    lines, moved, ids = asyncio.run(_moved_after_delete(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, src, migration = _target(store_url), ids["src"], ids["migration"]
    for at in ((), ("--at", str(moved))):
        doc = _json("state", "--provider", src, *at, *where)
        assert doc["leaks"] == [migration] and list(doc["allocations"]) == [migration], at
        [row] = [
            line for line in _run("state", "--provider", src, *at, *where).splitlines() if migration in line
        ]
        assert f"a leak: clear it with `evstore confirm-migration {migration}`" in row, (at, row)
    assert _json("state", "--provider", src, "--at", str(moved - 1), *where)["leaks"] == []
    _run("confirm-migration", migration, *where)
    assert _json("state", "--provider", src, *where)["leaks"] == []
    [row] = [line for line in _run("state", "--provider", src, "--at", str(moved), *where).splitlines()
             if migration in line]  # fmt: skip
    assert "a leak (cleared since)" in row

    fresh = _fresh_like(store_url, tmp_path)
    (tmp_path / "second").mkdir()
    s = asyncio.run(_revert_to_deleted(tmp_path / "second", fresh))
    where, instance = _target(fresh), s["instance"]
    for at in ((), ("--at", str(s["revert"]))):
        assert _json("state", "--provider", s["src"], *at, *where)["leaks"] == [instance], at


def test_tail_notes_the_events_that_made_a_leak(tmp_path: Path, store_url: str) -> None:
    """Regression (stop 38's leftover): ``tail`` printed an older writer's event that made a leak
    in its own words only (history marks it): its line and its ``--json`` summary say so now, with
    how to clear it while it is one - a move of a deleted instance's allocations onto a migration,
    and a revert that gave a deleted instance allocations back."""
    lines, moved, ids = asyncio.run(_moved_after_delete(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, migration = _target(store_url), ids["migration"]
    said = f"held for an instance deleted at position {ids['tombstone']}: a leak"
    clear = f"clear it with `evstore confirm-migration {migration}`"
    tail = ("tail", "--after", "0", "--no-follow", *where)
    docs = [json.loads(line) for line in _run(*tail, "--json").splitlines()]
    assert [d["position"] for d in docs if "a leak" in d["summary"]] == [moved]
    [move] = [d for d in docs if d["position"] == moved]
    assert move["summary"].endswith(f"; {said}; {clear} (store.confirm_migration('{migration}'))")
    [row] = [line for line in _run(*tail).splitlines() if line.split()[0] == str(moved)]
    assert said in row and clear in row
    _run("confirm-migration", migration, *where)
    [move] = [json.loads(x) for x in _run(*tail, "--json").splitlines() if json.loads(x)["position"] == moved]
    assert move["summary"].endswith(f"; {said}")  # (what it did; cleared since)

    fresh = _fresh_like(store_url, tmp_path)
    (tmp_path / "second").mkdir()
    s = asyncio.run(_revert_to_deleted(tmp_path / "second", fresh))
    docs = [
        json.loads(x)
        for x in _run("tail", "--after", "0", "--no-follow", *_target(fresh), "--json").splitlines()
    ]
    [given] = [d for d in docs if "a leak" in d["summary"]]
    assert given["position"] == s["revert"]
    assert (
        f"given to a consumer deleted at position {s['tombstone']}: a leak; clear it with" in given["summary"]
    )


def test_tail_notes_a_delete_that_left_its_migration_holding(tmp_path: Path, store_url: str) -> None:
    """``tail`` says it too of an older writer's delete that left the instance's migration holding
    (its own words name only the instance), as history does - from a start before the migration
    and after it alike; this evstore's delete (which releases the migration) gets no such note."""
    lines, delete, ids = asyncio.run(_migration_left_holding(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, migration, started = _target(store_url), ids["migration"], int(ids["started"])
    said = f"left its migration {migration} holding what it held: a leak"
    clear = f"clear it with `evstore confirm-migration {migration}` (store.confirm_migration('{migration}'))"
    for after in (0, started):
        tail = ("tail", "--after", str(after), "--no-follow", *where, "--json")
        docs = [json.loads(line) for line in _run(*tail).splitlines()]
        assert [d["position"] for d in docs if "a leak" in d["summary"]] == [delete.position], after
        [deleted] = [d for d in docs if d["position"] == delete.position]
        assert deleted["summary"].endswith(f"; {said}; {clear}"), after

    async def own() -> None:  # (this evstore's delete of an instance mid-migration)
        async with open_store(store_url) as store:
            rp = await make_provider(store, "own", VCPU=8)
            instance = new_uuid()
            await allocate(store, instance, {rp: {"VCPU": 1}})
            await store.start_migration(instance, new_uuid())
            await store.delete_consumer(instance)

    asyncio.run(own())
    docs = [json.loads(x) for x in _run("tail", "--after", "0", "--no-follow", *where, "--json").splitlines()]
    assert [d["position"] for d in docs if "a leak" in d["summary"]] == [delete.position]


# --- part 2: the failures an operator's bad input meets ---------------------------------------------


def test_a_negative_position_given_to_diff_says_it_is_no_position(tmp_path: Path) -> None:
    """Regression (black-box): ``diff -1 3`` (and ``diff 3 -5``) answered only "No such option:
    -1" - the command line took the negative position for an option, and the operator was told
    nothing about positions, where ``state --at -1`` says a position is from 0 to 2**63-1. Still a
    usage error (exit 2), one line; an unknown option that is no number is as it was."""
    db = str(tmp_path / "none.db")  # (refused before any store is opened)
    for args in (("-1", "3"), ("3", "-5")):
        done = evstore("diff", *args, "--db", db)
        assert done.returncode == 2 and not done.stdout, done
        [line] = done.stderr.splitlines()
        assert line.startswith("error: evstore.usage: No such option: -")
        assert line.endswith("(a negative number is no position: a position is from 0 to 2**63-1)")
    done = evstore("history", "-x", "--db", db)
    assert done.returncode == 2 and done.stderr.strip() == "error: evstore.usage: No such option: -x"


def test_history_and_tail_say_a_move_onto_a_deleted_consumer_made_a_leak(
    tmp_path: Path, store_url: str
) -> None:
    """An older writer's move of a live instance's allocations onto a consumer deleted before
    (its tombstone not in the instance's history) gave a deleted consumer allocations: the
    audit's leak, to be released. The move's line says so in the instance's history, the
    consumer's, and tail's."""

    async def build() -> tuple[list[str], int, dict[str, str]]:
        async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
            src = await make_provider(source, "src", VCPU=8)
            instance, gone = new_uuid(), new_uuid()
            await allocate(source, gone, {src: {"VCPU": 1}})
            tombstone = (await source.delete_consumer(gone)).position
            await allocate(source, instance, {src: {"VCPU": 2}})
            lines = [line async for line in source.export()]
            last = await _tail(source)
        move = chained(
            last,
            "MigrationStarted",
            {"instance": instance, "migration": gone, "allocations": {src: {"VCPU": 2}},
             "project_id": "project", "user_id": "user", "instance_consumer_type": "INSTANCE",
             "instance_generation": 1, "provider_generations": {}},
        )  # fmt: skip
        append_row(lines, move)
        return lines, move.position, {"instance": instance, "gone": gone, "tombstone": str(tombstone)}

    lines, moved, ids = asyncio.run(build())
    asyncio.run(_imported(store_url, lines))
    where, gone = _target(store_url), ids["gone"]
    [leak] = [f for f in _json("audit", *where, code=3)["findings"] if f["kind"] == "leak"]
    assert leak["details"]["consumer"] == gone
    said = f"given to a consumer deleted at position {ids['tombstone']}: a leak"
    clear = f"clear it with `evstore release {gone}` (store.release('{gone}'))"
    for key in (ids["instance"], gone):
        events = _json("history", key, *where)["events"]
        assert [e["position"] for e in events if "a leak" in e["summary"]] == [moved], key
        assert events[-1]["summary"].endswith(f"; {said}; {clear}"), key
    docs = [json.loads(x) for x in _run("tail", "--after", "0", "--no-follow", *where, "--json").splitlines()]
    assert [d["summary"].endswith(f"; {said}; {clear}") for d in docs] == [
        d["position"] == moved for d in docs
    ]


async def _left_holding_then_snapshot_then_released(tmp_path: Path, url: str) -> tuple[dict[str, str], int]:
    """An older writer's log where an instance's delete left its migration holding, imported;
    snapshots every 10 events taken past it; then the migration released (the leak cleared)."""
    lines, delete, ids = await _migration_left_holding(tmp_path)
    async with open_store(url, snapshot_every=10) as store:
        await store.import_events(lambda: iter(lines))
        while await store.head() < delete.position + 12:
            await make_provider(store, VCPU=1)
        at = await store.head() - 1
        assert at - at % 10 > delete.position  # (a snapshot between the leak and the position asked)
        assert await store.take_snapshots()
        await store.release(ids["migration"])
    return ids, at


def test_state_of_a_provider_in_time_travel_marks_a_leak_cleared_since_past_a_snapshot(
    tmp_path: Path, store_url: str
) -> None:
    """Regression (stop 39, found by review): with a provider snapshot between the leak and the
    position asked, ``state --provider P --at X`` left out a migration's leak that a release had
    cleared since: the provider's slice keeps no consumer's link to its instance, and the released
    migration has none now, so it was not checked - while without the snapshot it was."""
    ids, at = asyncio.run(_left_holding_then_snapshot_then_released(tmp_path, store_url))
    where, migration = _target(store_url), ids["migration"]
    assert _json("state", "--at", str(at), "--consumer", migration, *where)["leaked"] is True
    doc = _json("state", "--provider", ids["src"], "--at", str(at), *where)
    assert migration in doc["allocations"] and doc["leaks"] == [migration]
    [row] = [
        line
        for line in _run("state", "--provider", ids["src"], "--at", str(at), *where).splitlines()
        if migration[:8] in line or migration in line
    ]
    assert "a leak (cleared since)" in row
