"""The debugging tools around a leak agree with one another and say how to clear it (stop 38, A).

Two logs an older, Placement-style writer could leave, each imported on every backend: a revert
that gave a deleted instance its allocations back (the deleted consumer holds them), and a delete
of an instance that did not release its migration's (the migration holds them for a deleted
instance). The API's ``ConsumerView.leaked``, ``evstore state``, ``history``, ``diff`` and the
audit say the same of each, and what they say clears it does clear it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from evstore import AllocationStore, open_store
from projections.invariants import clear_leak
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_audit_findings import _deleted_mid_migration, _deleted_twice, _migration_left_holding
from tests.test_cli_support import evstore


def _run(*args: str, code: int = 0) -> str:
    done = evstore(*args)
    assert done.returncode == code, (args, done.stdout, done.stderr)
    return done.stdout


def _json(*args: str) -> Any:
    return json.loads(_run(*args, "--json"))


async def _imported(url: str, lines: list[str]) -> None:
    async with open_store(url) as store:
        await store.import_events(lambda: iter(lines))


async def _revert_to_deleted(tmp_path: Path, url: str) -> dict[str, Any]:
    """The first log, imported at ``url``: the instance deleted at ``tombstone``, given back its
    allocations on ``src`` at ``revert``."""
    lines, revert, src, instance, tombstone = await _deleted_mid_migration(tmp_path, same_host=False)
    await _imported(url, lines)
    return {"src": src, "instance": instance, "tombstone": tombstone, "revert": revert.position}


async def _left_holding(tmp_path: Path, url: str) -> dict[str, Any]:
    """The second log, imported at ``url``: the instance deleted at ``delete``, its migration
    (started at ``started``) left holding 2 VCPU of ``src``."""
    lines, delete, ids = await _migration_left_holding(tmp_path)
    await _imported(url, lines)
    return {**ids, "started": int(ids["started"]), "delete": delete.position}


# --- the API: ConsumerView.leaked, live and in time travel -----------------------------------------


async def test_consumer_view_says_leaked_for_a_deleted_consumer_holding_allocations(
    tmp_path: Path, store_url: str
) -> None:
    """Regression: ``store.allocations()`` (and ``state_at``'s) had no ``leaked``, where ``evstore
    state --consumer --json`` says it: a service had to fold the state and call the audit's
    predicate itself to tell a leak from a consumer holding allocations."""
    s = await _revert_to_deleted(tmp_path, store_url)
    instance = s["instance"]
    async with open_store(store_url) as store:
        live = await store.allocations(instance)
        assert live.deleted and live.leaked and live.allocations == {s["src"]: {"VCPU": 2}}
        assert live.to_dict()["leaked"] is True
        for position, leaked in ((s["revert"], True), (s["revert"] - 1, False), (s["tombstone"] - 1, False)):
            whole = await (await store.state_at(position=position)).allocations(instance)
            one = await store.state_at(position=position, consumer=instance)
            sliced = await one.allocations(instance)
            assert (whole.leaked, sliced.leaked) == (leaked, leaked), position
            assert whole == sliced, position
        await store.release(instance)  # (what the audit says clears it)
        assert not (await store.allocations(instance)).leaked
        assert (await store.audit()).clean


async def test_consumer_view_says_leaked_for_a_migration_left_holding_for_a_deleted_instance(
    tmp_path: Path, store_url: str
) -> None:
    """The migration's own view says it too - live, and in a one-consumer slice of time travel,
    which folds the migration's own events only: the older writer's delete of its instance does
    not name it, and the slice said ``leaked`` False where the whole state says True."""
    s = await _left_holding(tmp_path, store_url)
    migration, instance = s["migration"], s["instance"]
    async with open_store(store_url) as store:
        live = await store.allocations(migration)
        assert (live.leaked, live.deleted, live.on_behalf_of) == (True, False, instance)
        for position, leaked in ((s["delete"], True), (s["delete"] - 1, False), (s["started"], False)):
            whole = await (await store.state_at(position=position)).allocations(migration)
            one = await store.state_at(position=position, consumer=migration)
            sliced = await one.allocations(migration)
            assert (whole.leaked, sliced.leaked) == (leaked, leaked), position
            assert whole == sliced, position
        assert not (await store.allocations(instance)).leaked  # (deleted, holding nothing)
        await store.confirm_migration(migration)  # (what the audit says clears it)
        assert not (await store.allocations(migration)).leaked
        assert (await store.audit()).clean


async def test_a_migration_in_flight_is_no_leak(store: AllocationStore) -> None:
    """A migration holding for a live instance is not ``leaked``; once this evstore deletes the
    instance it holds nothing (released with it), and is not either."""
    rp = await make_provider(store, VCPU=8)
    instance, migration = new_uuid(), new_uuid()
    await allocate(store, instance, {rp: {"VCPU": 2}})
    await store.start_migration(instance, migration)
    assert not (await store.allocations(migration)).leaked
    await store.delete_consumer(instance)
    view = await store.allocations(migration)
    assert (view.leaked, view.allocations, view.on_behalf_of) == (False, {}, instance)
    head = await store.head()
    assert not (await (await store.state_at(position=head, consumer=migration)).allocations(migration)).leaked


# --- the command line ---------------------------------------------------------------------------


def _target(url: str) -> tuple[str, str]:
    return ("--db", url.removeprefix("sqlite:///")) if url.startswith("sqlite:") else ("--url", url)


def test_state_and_the_api_agree_on_leaked(tmp_path: Path, store_url: str) -> None:
    """``state --consumer --json``'s ``leaked`` is the view's, at the head and in the past."""
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where = _target(store_url)

    async def api(position: int) -> bool:
        async with open_store(store_url) as store:
            view = await store.state_at(position=position)
            return (await view.allocations(s["migration"])).leaked

    for position in (s["delete"], s["delete"] - 1):
        doc = _json("state", "--at", str(position), "--consumer", s["migration"], *where)
        assert doc["leaked"] is asyncio.run(api(position)), position
    assert _json("state", "--consumer", s["migration"], *where)["leaked"] is True


def test_state_counts_a_leaked_migration_as_a_leak_not_in_flight(tmp_path: Path, store_url: str) -> None:
    """Regression: the summary of ``evstore state`` counted a migration left holding for a deleted
    instance as a migration "in flight" (no revert or confirm of it can come: its instance is
    gone); it is counted as a leak, in the text and in --json (``leaks``)."""
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where = _target(store_url)
    before = _json("state", "--at", str(s["delete"] - 1), *where)
    assert (before["migrations_in_flight"], before["leaks"]) == (1, 0)
    after = _json("state", *where)
    assert (after["migrations_in_flight"], after["leaks"]) == (0, 1)
    assert after["consumers_holding_allocations"] == 1
    text = _run("state", *where)
    assert "1 consumers hold allocations, 0 of them migrations in flight, 1 of them leaks" in text
    assert "evstore audit lists them" in text
    clean = _run("state", "--at", str(s["delete"] - 1), *where)
    assert "1 of them migrations in flight, 0 of them leaks" in clean and "audit lists" not in clean


def test_the_leak_messages_say_how_to_clear_it_and_that_clears_it(tmp_path: Path, store_url: str) -> None:
    """Regression: the audit, ``state``, ``history`` and ``diff`` said where a leak is but not how
    to clear it. Each ends with the command that does and the API call it makes (stop 38: the
    command line had none that writes, and the clause named the call alone), while the leak is
    there; done, by that command, the audit is clean and the clause is gone."""
    s = asyncio.run(_revert_to_deleted(tmp_path, store_url))
    where, instance = _target(store_url), s["instance"]
    clear = f"clear it with `evstore release {instance}` (store.release('{instance}'))"
    assert clear == clear_leak(instance, deleted=True)

    findings = json.loads(_run("audit", *where, "--json", code=3))["findings"]
    [leak] = [f for f in findings if f["kind"] == "leak"]
    assert leak["message"].endswith(f"; {clear}")
    assert f"store.release('{instance}')" in _run("audit", *where, code=3)  # (the table wraps the rest)
    state = _run("state", "--consumer", instance, *where)
    assert "still a leak now" in state and clear in state
    events = _json("history", instance, *where)["events"]
    [given] = [e for e in events if e["position"] == s["revert"]]
    said = f"given to a consumer deleted at position {s['tombstone']}: a leak"
    assert given["summary"].endswith(f"{said}; {clear}")
    assert not any(clear in e["summary"] for e in events if e["position"] != s["revert"])
    [row] = [line for line in _run("history", instance, *where).splitlines() if f" {s['revert']} " in line]
    assert "given to a consumer deleted at position" in row
    diff = _run("diff", str(s["revert"] - 1), str(s["revert"]), *where)
    assert f"consumer {instance} still holds a leak: {clear}" in diff

    assert _run("release", instance, *where).endswith("; the leak is cleared\n")  # (what it says)
    assert _json("audit", *where)["findings"] == []
    assert "still a leak now" not in _run("state", "--at", str(s["revert"]), "--consumer", instance, *where)
    events = _json("history", instance, *where)["events"]
    [given] = [e for e in events if e["position"] == s["revert"]]
    assert given["summary"].endswith(": a leak")  # (what it did then; nothing left to clear)
    assert "still holds a leak" not in _run("diff", str(s["revert"] - 1), str(s["revert"]), *where)


def test_the_instances_delete_says_it_left_its_migration_holding(tmp_path: Path, store_url: str) -> None:
    """Regression: in the history of an instance whose delete (an older writer's) left its
    migration holding allocations, the delete's line did not say so - the migration's history did
    (stop 37) - so a person reading the instance's story saw a clean delete. It says so, in the
    table and in --json, with how to clear it while the migration still holds them."""
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where, instance, migration = _target(store_url), s["instance"], s["migration"]
    said = f"left its migration {migration} holding what it held: a leak"
    clear = f"clear it with `evstore confirm-migration {migration}` (store.confirm_migration('{migration}'))"
    assert clear == clear_leak(migration, deleted=False)
    events = _json("history", instance, *where)["events"]
    [deleted] = [e for e in events if e["position"] == s["delete"]]
    assert deleted["summary"].endswith(f"; {said}; {clear}")
    assert not any("left its migration" in e["summary"] for e in events if e is not deleted)
    [row] = [line for line in _run("history", instance, *where).splitlines() if "ConsumerDeleted" in line]
    assert f"left its migration {migration[:8]} holding" in row
    # the migration's history says the same of the same event
    [mine] = [e for e in _json("history", migration, *where)["events"] if e["position"] == s["delete"]]
    assert mine["summary"].endswith(f"; {said}; {clear}")

    assert _run("confirm-migration", migration, *where).endswith("; the leak is cleared\n")
    events = _json("history", instance, *where)["events"]
    [deleted] = [e for e in events if e["position"] == s["delete"]]
    assert deleted["summary"].endswith(f"; {said}")  # (what it did; cleared since)


def test_an_instance_deleted_by_this_evstore_leaves_no_such_note(tmp_path: Path) -> None:
    """This evstore's delete releases the migration with the instance: its line in the
    instance's history says so in its own words, and no leak is noted anywhere."""

    async def build(url: str) -> tuple[str, str]:
        async with open_store(url) as store:
            rp = await make_provider(store, VCPU=8)
            instance, migration = new_uuid(), new_uuid()
            await allocate(store, instance, {rp: {"VCPU": 2}})
            await store.start_migration(instance, migration)
            await store.delete_consumer(instance)
            return instance, migration

    db = tmp_path / "own.db"
    instance, migration = asyncio.run(build(f"sqlite:///{db}"))
    for key in (instance, migration):
        summaries = [e["summary"] for e in _json("history", key, "--db", str(db))["events"]]
        assert not any("a leak" in text for text in summaries), summaries
    assert f"its migration {migration} released" in summaries[-1]


def test_history_says_an_event_gave_a_deleted_consumer_allocations(tmp_path: Path, store_url: str) -> None:
    """Regression: the history of an instance an older writer's revert gave allocations back to
    after its delete - the event the audit cites as the leak's - said only "migration M gave ...
    back to instance I": nothing said that instance was deleted, nor that this made a leak. Its
    line says so now, with the tombstone, in the instance's history and in the provider's."""
    s = asyncio.run(_revert_to_deleted(tmp_path, store_url))
    where, instance = _target(store_url), s["instance"]
    said = f"given to a consumer deleted at position {s['tombstone']}: a leak"
    for key in (instance, s["src"]):
        events = _json("history", key, *where)["events"]
        [given] = [e for e in events if e["position"] == s["revert"]]
        assert said in given["summary"], key
        assert not any(said in e["summary"] for e in events if e is not given)
    table = _run("history", instance, *where)
    [row] = [line for line in table.splitlines() if f" {s['revert']} " in line]
    assert "given to a consumer deleted at position" in row


def test_state_of_a_deleted_instance_says_its_migrations_still_holding_are_leaks(
    tmp_path: Path, store_url: str
) -> None:
    """Regression: ``state --consumer`` of an instance whose delete left its migration holding
    said "deleted (tombstone)" and listed the migration under "migrations holding for it", as for
    a live instance mid-migration: nothing on the page said that migration is the audit's leak."""
    s = asyncio.run(_left_holding(tmp_path, store_url))
    where, instance, migration = _target(store_url), s["instance"], s["migration"]
    [row] = [line for line in _run("state", "--consumer", instance, *where).splitlines() if migration in line]
    assert "migrations holding for it (leaks: it is deleted)" in row
    before = _run("state", "--at", str(s["delete"] - 1), "--consumer", instance, *where)
    [row] = [line for line in before.splitlines() if migration in line]
    assert "migrations holding for it" in row and "leaks" not in row  # (live, mid-migration)


def test_a_second_tombstone_is_not_said_to_have_left_the_migration_holding(
    tmp_path: Path, store_url: str
) -> None:
    """Regression (review): in a log where an older writer deleted the instance twice, the fold, the
    audit and diff say the first tombstone made the leak; ``history`` listed the second too in the
    migration's history and said of both, there and in the instance's, that it "left its migration
    holding what it held". Only the first says so, and the migration's history lists only it."""
    lines, delete, _, ids = asyncio.run(_deleted_twice(tmp_path))
    asyncio.run(_imported(store_url, lines))
    where, instance, migration = _target(store_url), ids["instance"], ids["migration"]
    noted = [
        e["position"]
        for e in _json("history", instance, *where)["events"]
        if "left its migration" in e["summary"]
    ]
    assert noted == [delete.position]
    listed = [e for e in _json("history", migration, *where)["events"] if e["type"] == "ConsumerDeleted"]
    assert [e["position"] for e in listed] == [delete.position]
    assert "left its migration" in listed[0]["summary"]

    async def api_history() -> list[int]:
        async with open_store(store_url) as store:
            return [e.position async for e in store.history(migration) if e.type == "ConsumerDeleted"]

    assert asyncio.run(api_history()) == [delete.position]
