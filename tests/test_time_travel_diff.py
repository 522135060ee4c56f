"""diff(a, b): usage deltas, consumers created/changed/released/deleted, and the events responsible."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any, get_args
from uuid import UUID

import pytest

from evstore import AllocationStore, InvalidInput
from projections.diff import ChangeKind
from tests.conftest import allocate, make_provider, new_uuid


async def test_a_diffs_consumer_is_found_by_its_uuid_in_any_form(store: AllocationStore) -> None:
    """Regression (review 32, helper D): ``Diff.consumer`` compared strings, so a ``uuid.UUID``
    (or the uuid in capitals) - what every query of the store takes for the same consumer -
    found nothing, as if the consumer had not changed; a malformed one said the same."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    start = await store.head()
    await allocate(store, c, {rp: {"VCPU": 1}})
    diff = await store.diff(start, await store.head())
    found = diff.consumer(c)
    assert found is not None and found.change == "created"
    assert diff.consumer(UUID(c)) == found
    assert diff.consumer(c.upper()) == found
    assert diff.consumer(new_uuid()) is None
    with pytest.raises(InvalidInput, match="Malformed consumer uuid"):
        diff.consumer("not-a-uuid")


async def test_a_kind_no_change_or_finding_has_is_refused_not_answered_empty(store: AllocationStore) -> None:
    """Regression (review 32, helper D): ``Diff.of_change("deletes")`` and ``AuditReport.of_kind(
    "leaks")`` - a typo - answered ``[]``, which reads as "none": for a debugging tool, "no leaks"."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    start = await store.head()
    await allocate(store, c, {rp: {"VCPU": 1}})
    await store.delete_consumer(c)
    diff = await store.diff(start, await store.head())
    assert [x.consumer for x in diff.of_change("deleted")] == [c]
    with pytest.raises(InvalidInput, match="unknown kind of change 'deletes'") as info:
        diff.of_change("deletes")  # type: ignore[arg-type]
    assert info.value.code == "evstore.invalid_input" and "deleted" in info.value.message
    report = await store.audit()
    assert report.of_kind("leak") == [] and report.clean
    with pytest.raises(InvalidInput, match="unknown kind of finding 'leaks'") as info:
        report.of_kind("leaks")  # type: ignore[arg-type]
    assert "over_capacity" in info.value.message


async def test_diff_names_each_change_and_its_events(store: AllocationStore) -> None:
    a = await make_provider(store, "a", VCPU=8)
    b = await make_provider(store, "b", VCPU=8)
    start = await store.head()
    c1, c2, c3, mig = new_uuid(), new_uuid(), new_uuid(), new_uuid()
    p1 = (await store.set_allocations(c1, {a: {"VCPU": 2}}, project_id="p", user_id="u",
                                      consumer_type="INSTANCE", generation=None)).position  # fmt: skip
    await allocate(store, c2, {a: {"VCPU": 1}})
    p2 = await store.head()
    p3 = (await store.start_migration(c1, mig)).position
    await allocate(store, c1, {b: {"VCPU": 2}})
    p4 = await store.head()
    p5 = (await store.delete_consumer(c1)).position
    p6 = (await store.release(c2)).position
    await allocate(store, c3, {b: {"VCPU": 4}})
    p7 = await store.head()
    await allocate(store, c3, {b: {"VCPU": 3}}, generation=1)
    p8 = await store.head()

    whole = await store.diff(start, p8)
    assert (whole.from_position, whole.to_position) == (start, p8)
    changes = {c.consumer: (c.change, c.positions) for c in whole.consumers}
    assert changes == {
        c1: ("deleted", (p1, p3, p4, p5)),
        mig: ("transient", (p3, p5)),
        c2: ("transient", (p2, p6)),
        c3: ("created", (p7, p8)),
    }
    assert whole.consumer(c3) is not None and whole.consumer(c3).after == {b: {"VCPU": 3}}  # type: ignore[union-attr]
    [usage] = whole.usage  # a is back to zero: only b moved
    assert (usage.provider, usage.resource_class, usage.before, usage.after, usage.delta) == (
        b,
        "VCPU",
        0,
        3,
        3,
    )
    assert set(usage.positions) >= {p4, p5, p7, p8}
    assert whole.events_by_type == {
        "AllocationsReplaced": 5,
        "MigrationStarted": 1,
        "ConsumerDeleted": 1,
        "AllocationsReleased": 1,
    }

    middle = await store.diff(p2, p5)
    assert middle.consumer(c1) is not None
    assert middle.consumer(c1).change == "deleted"  # type: ignore[union-attr]
    assert middle.consumer(c1).before == {a: {"VCPU": 2}}  # type: ignore[union-attr]
    assert middle.consumer(c2) is None  # untouched in (p2, p5]
    [a_usage] = middle.usage
    assert (a_usage.provider, a_usage.before, a_usage.after) == (a, 3, 1)
    assert a_usage.positions == (p3, p5)

    released = await store.diff(p5, p6)
    assert [(c.consumer, c.change, c.before, c.after) for c in released.consumers] == [
        (c2, "released", {a: {"VCPU": 1}}, {})
    ]

    changed = await store.diff(p7, p8)
    assert [(c.consumer, c.change) for c in changed.consumers] == [(c3, "changed")]
    assert changed.to_dict()["usage"][0]["delta"] == -1


async def test_diff_by_time_and_bad_bounds(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    before = datetime.now(UTC)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    by_time = await store.diff(before, datetime.now(UTC))
    assert [x.consumer for x in by_time.of_change("created")] == [c]
    head = await store.head()
    same = await store.diff(head, head)  # (a == b: nothing changed)
    assert (same.from_position, same.to_position, same.consumers, same.usage) == (head, head, [], [])
    with pytest.raises(InvalidInput):
        await store.diff(head, 1)
    with pytest.raises(InvalidInput):
        await store.diff(0, head + 1)
    with pytest.raises(InvalidInput):
        await store.diff(datetime.now(), head)  # naive time: ambiguous


async def test_a_bound_of_the_wrong_kind_is_refused_saying_what_a_bound_may_be(
    store: AllocationStore,
) -> None:
    """Regression: ``diff(date(...), n)`` - a date, not a datetime - answered "position must be an
    integer position", as if a time were not allowed there, and its repr was cut inside the
    tzinfo for an aware datetime given as ``state_at``'s position. Each entry taking a position
    or a time now says which it takes, what it got (a date or time in ISO form) and what to do."""
    rp = await make_provider(store, VCPU=8)
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    head = await store.head()
    dated = r".* got date 2026-01-02 \(a date has no time of day: datetime\(2026, 1, 2, tzinfo=UTC\)"
    either = r"must be a position \(an integer from 0 to 2\*\*63-1\) or a timezone-aware datetime"
    for call, field in (
        (lambda: store.diff(date(2026, 1, 2), head), "a"),  # type: ignore[arg-type]
        (lambda: store.diff(0, date(2026, 1, 2)), "b"),  # type: ignore[arg-type]
        (lambda: store.position_of(date(2026, 1, 2)), "point"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidInput, match=either + dated) as caught:
            await call()
        assert caught.value.details["field"] == field
    for bad, got in ((1.5, "float 1.5"), (None, "NoneType None"), (True, "bool True"), (-1, "-1")):
        with pytest.raises(InvalidInput, match=r"diff's b \(to\) " + either + f".* got {re.escape(got)}$"):
            await store.diff(0, bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"got str '3' \(a string: int\(text\) for a position"):
        await store.diff("3", head)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match=r"got a naive datetime 2026-01-02T03:04:05 \(no time zone"):
        await store.diff(0, datetime(2026, 1, 2, 3, 4, 5))
    # where the position and the time are separate arguments, the position's says where a time goes
    aware = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    position_only = (
        r"must be an integer position .*, got (datetime 2026-01-02T03:04:05\+00:00|date 2026-01-02) "
        r"\(a time goes in at=\)$"
    )
    for call, field in (
        (lambda: store.state_at(position=aware), "position"),  # type: ignore[arg-type]
        (lambda: store.state_at(position=date(2026, 1, 2)), "position"),  # type: ignore[arg-type]
        (lambda: store.replay(aware), "to_position"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidInput, match=position_only) as caught:
            await call()
        assert caught.value.details["field"] == field
    for call in (lambda: store.state_at(at=date(2026, 1, 2)), lambda: store.replay(at=date(2026, 1, 2))):  # type: ignore[arg-type]
        with pytest.raises(
            InvalidInput, match=r"at must be a timezone-aware datetime.* got date 2026-01-02 \(a date"
        ):
            await call()
    assert (await store.diff(0, aware + timedelta(days=36500))).to_position == head  # (the right kinds pass)


async def test_a_consumer_rewritten_for_another_project_is_a_change(store: AllocationStore) -> None:
    """Regression: released and written again with the same allocations and generation, for
    another project and user, the consumer was left out of the diff (only allocations and
    generation were compared), though project usage moved from one project to the other."""
    p, c = await make_provider(store, "n", VCPU=8), new_uuid()
    await store.set_allocations(
        c,
        {p: {"VCPU": 2}},
        project_id="project-A",
        user_id="alice",
        consumer_type="INSTANCE",
        generation=None,
    )
    a = await store.head()
    await store.release(c)
    await store.set_allocations(
        c, {p: {"VCPU": 2}}, project_id="project-B", user_id="bob", consumer_type="INSTANCE", generation=None
    )
    b = await store.head()
    change = (await store.diff(a, b)).consumer(c)
    assert change is not None and change.change == "changed"
    assert change.positions == (a + 1, b)
    assert (await store.diff(a, a + 1)).consumer(c) is not None  # (released: as before)
    for rewrite in ({"user_id": "carol"}, {"consumer_type": "MIGRATION"}):
        start = await store.head()
        await store.release(c)
        fields: dict[str, Any] = {"project_id": "project-B", "user_id": "bob", "consumer_type": "INSTANCE"}
        await store.set_allocations(c, {p: {"VCPU": 2}}, **{**fields, **rewrite}, generation=None)
        other = (await store.diff(start, await store.head())).consumer(c)
        assert other is not None and other.change == "changed", rewrite


async def test_a_usage_delta_names_only_the_events_that_moved_that_class(store: AllocationStore) -> None:
    """Regression (helper-39): a usage delta listed every event that named its provider (another
    class's allocation, a rename, an inventory change, a child's creation) as responsible."""
    from evstore import Inventory

    a = new_uuid()
    await store.create_provider(a, "a")
    await store.set_inventories(
        a, {"VCPU": Inventory(total=8), "MEMORY_MB": Inventory(total=8)}, generation=0
    )
    start = await store.head()
    vcpu_holder = new_uuid()
    await allocate(store, vcpu_holder, {a: {"VCPU": 1}})
    vcpu_at = await store.head()
    await allocate(store, new_uuid(), {a: {"MEMORY_MB": 2}})
    memory_at = await store.head()
    await store.rename_provider(a, "a-renamed")
    await store.set_inventories(
        a, {"VCPU": Inventory(total=9), "MEMORY_MB": Inventory(total=8)}, generation=3
    )
    await store.create_provider(new_uuid(), "child", parent=a)
    await allocate(store, vcpu_holder, {a: {"VCPU": 1, "MEMORY_MB": 1}}, generation=1)  # VCPU unchanged
    both_at = await store.head()
    await store.release(vcpu_holder)  # (names only the consumer)
    released_at = await store.head()
    d = await store.diff(start, await store.head())
    by_class = {u.resource_class: u.positions for u in d.usage}
    assert by_class == {"MEMORY_MB": (memory_at, both_at, released_at)}  # VCPU is back to 0
    d = await store.diff(start, both_at)
    by_class = {u.resource_class: u.positions for u in d.usage}
    assert by_class == {"VCPU": (vcpu_at,), "MEMORY_MB": (memory_at, both_at)}


async def test_a_provider_deleted_and_created_again_in_between_is_in_both_lists(
    store: AllocationStore,
) -> None:
    a, b = new_uuid(), new_uuid()
    await store.create_provider(a, "a")
    await store.create_provider(b, "b")
    start = await store.head()
    await store.delete_provider(b)
    await store.create_provider(b, "b-again", parent=a)
    d = await store.diff(start, await store.head())
    assert d.events_by_type == {"ProviderDeleted": 1, "ProviderCreated": 1}
    assert (d.providers_deleted, d.providers_created) == ([b], [b])
    d = await store.diff(start, start + 1)  # deleted only
    assert (d.providers_deleted, d.providers_created) == ([b], [])


async def test_each_label_alone_makes_a_change_a_new_generation_alone_none(store: AllocationStore) -> None:
    """Each of project, user and consumer type rewritten alone (the same allocations, released
    and written again) is a change; the change shows the consumer as it is now. A write of the
    same allocations (only a new generation) leaves it as it was: not listed (stop 42, helper D;
    it was called ``changed`` - tests/test_s42_D_diff.py)."""
    p, c = await make_provider(store, "n", VCPU=8), new_uuid()
    fields: dict[str, Any] = {"project_id": "project-A", "user_id": "alice", "consumer_type": "INSTANCE"}
    await store.set_allocations(c, {p: {"VCPU": 2}}, **fields, generation=None)
    for rewrite in ({"project_id": "project-B"}, {"user_id": "bob"}, {"consumer_type": "MIGRATION"}):
        start = await store.head()
        await store.release(c)
        fields = {**fields, **rewrite}
        await store.set_allocations(c, {p: {"VCPU": 2}}, **fields, generation=None)
        change = (await store.diff(start, await store.head())).consumer(c)
        assert change is not None and change.change == "changed", rewrite
        assert change.consumer_type == fields["consumer_type"], rewrite
    start = await store.head()
    generation = (await store.allocations(c)).generation
    await store.set_allocations(c, {p: {"VCPU": 2}}, **fields, generation=generation)
    assert (await store.diff(start, await store.head())).consumer(c) is None


async def test_a_migration_change_names_its_instance(store: AllocationStore) -> None:
    rp, instance, migration = await make_provider(store, VCPU=8), new_uuid(), new_uuid()
    await allocate(store, instance, {rp: {"VCPU": 2}})
    start = await store.head()
    await store.start_migration(instance, migration)
    change = (await store.diff(start, await store.head())).consumer(migration)
    assert change is not None and change.change == "created"
    assert (change.on_behalf_of, change.consumer_type) == (instance, "MIGRATION")


async def test_a_consumer_absent_at_both_ends_shows_the_type_and_instance_it_had_in_between(
    store: AllocationStore,
) -> None:
    """Regression (stop 35's note): a consumer created and gone again within the span (absent,
    so forgotten, at both ends) showed ``consumer_type: null`` - and a migration started and
    reverted within it ``on_behalf_of: null`` - though every event that named it said what it
    was. A consumer that ends the span absent shows the type (and instance) it had last in it."""
    rp = await make_provider(store, VCPU=8)
    instance, migration, plain, retyped, gone, held = (new_uuid() for _ in range(6))
    await allocate(store, instance, {rp: {"VCPU": 2}})
    await allocate(store, retyped, {rp: {"VCPU": 1}}, consumer_type="INSTANCE")
    await allocate(store, held, {rp: {"VCPU": 1}}, consumer_type="VOLUME")
    start = await store.head()
    await store.release(held)
    await store.delete_consumer(held)  # (held at the start, absent before its tombstone)
    await allocate(store, plain, {rp: {"VCPU": 1}}, consumer_type="BAREMETAL")
    await store.release(plain)
    await store.start_migration(instance, migration)
    await store.revert_migration(migration)
    await store.release(retyped)
    await allocate(store, retyped, {rp: {"VCPU": 1}}, consumer_type="VOLUME")
    await store.release(retyped)
    await allocate(store, gone, {rp: {"VCPU": 1}}, consumer_type="BAREMETAL")
    await store.release(gone)
    await store.delete_consumer(gone)  # (a tombstone of a consumer absent, forgotten, before it)
    d = await store.diff(start, await store.head())
    shown = {c.consumer: (c.change, c.consumer_type, c.on_behalf_of) for c in d.consumers}
    assert shown == {
        plain: ("transient", "BAREMETAL", None),
        migration: ("transient", "MIGRATION", instance),
        retyped: ("released", "VOLUME", None),  # (the type it had last, as "deleted" shows it)
        gone: ("deleted", "BAREMETAL", None),
        held: ("deleted", "VOLUME", None),
    }  # (the instance, given back what it held, is as it was: not listed)
    assert (
        d.to_dict()["consumers"][[c.consumer for c in d.consumers].index(plain)]["consumer_type"]
        == "BAREMETAL"
    )


async def test_a_diff_lists_things_in_one_order_and_only_what_moved(store: AllocationStore) -> None:
    """Usage deltas by provider name then class (not by uuid), only for classes whose usage moved;
    providers and consumers by uuid; event counts by type."""
    lo, hi = sorted([await make_provider(store, VCPU=8, MEMORY_MB=8) for _ in range(2)])
    await store.rename_provider(lo, "zulu")
    await store.rename_provider(hi, "alpha")
    await allocate(store, new_uuid(), {lo: {"VCPU": 1}})
    start = await store.head()
    created = [new_uuid() for _ in range(6)]
    for uuid in created:
        await store.create_provider(uuid, f"rp-{uuid}")
    consumers = [new_uuid() for _ in range(6)]
    await allocate(store, consumers[0], {lo: {"MEMORY_MB": 1}, hi: {"VCPU": 1}})
    for consumer in consumers[1:]:
        await allocate(store, consumer, {hi: {"MEMORY_MB": 1}})
    d = await store.diff(start, await store.head())
    assert [(u.name, u.provider, u.resource_class, u.delta) for u in d.usage] == [
        ("alpha", hi, "MEMORY_MB", 5),
        ("alpha", hi, "VCPU", 1),
        ("zulu", lo, "MEMORY_MB", 1),  # (zulu's VCPU, held all along, did not move)
    ]
    assert d.providers_created == sorted(created)
    assert [c.consumer for c in d.consumers] == sorted(consumers)
    assert list(d.to_dict()["events_by_type"]) == ["AllocationsReplaced", "ProviderCreated"]


async def test_a_diffs_allocations_are_in_key_order_as_state_shows_them(store: AllocationStore) -> None:
    """Regression: ``Diff.to_dict()`` (``evstore diff --json``) gave a consumer's ``before`` and
    ``after`` in the order the command listed them (``{"VCPU": 1, "MEMORY_MB": 2}``), where
    ``state --consumer --json`` gives the same allocations in key order, both levels (the same
    bytes however the state was read): one consumer's allocations now read alike in both."""
    lo, hi = sorted([await make_provider(store, VCPU=8, MEMORY_MB=8) for _ in range(2)])
    c = new_uuid()
    start = await store.head()
    await allocate(store, c, {hi: {"VCPU": 1, "MEMORY_MB": 2}, lo: {"VCPU": 1, "MEMORY_MB": 2}})
    end = await store.head()
    await store.release(c)
    for a, b, side in ((start, end, "after"), (end, end + 1, "before")):
        [change] = (await store.diff(a, b)).to_dict()["consumers"]
        held = change[side]
        assert list(held) == [lo, hi] and all(list(r) == ["MEMORY_MB", "VCPU"] for r in held.values()), side


def test_every_change_kind_is_described_where_the_readme_describes_diff() -> None:
    """Regression: ``transient`` was described only in projections/diff.py's docstring, so a
    reader of ``evstore diff --json`` met a change kind the README never named."""
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    start = readme.index("`diff(a, b)` (")
    described = readme[start : readme.index("), `audit`", start)]
    for kind in get_args(ChangeKind):
        assert f"`{kind}`" in described, kind
