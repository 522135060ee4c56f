"""The read side at its edges (stop 38, helper B): a position the log has not reached is refused
by every entry point that takes one - ``read``, ``subscribe``, ``position_of``, ``state_at``,
``replay``, ``diff`` - in one wording, ``InvalidInput`` with the head in ``details["head"]``, on
both backends; and a span given backwards is refused whether or not events lie between its ends."""

from __future__ import annotations

import shutil
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta, timezone, tzinfo
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, CorruptEvent, InvalidInput, StoreClosed, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def _refused_beyond(call: Callable[[], Awaitable[Any]], position: int, head: int, field: str) -> None:
    with pytest.raises(
        InvalidInput, match=rf"^position {position} is beyond the head of the log \({head}\)"
    ) as caught:
        await call()
    assert caught.value.code == "evstore.invalid_input"
    assert caught.value.details["field"] == field
    assert caught.value.details["head"] == head


async def test_position_of_refuses_a_position_the_log_has_not_reached(store: AllocationStore) -> None:
    """Regression: ``position_of(n)`` answered any n up to 2**63-1 as a position of the store -
    ``position_of(10**6)`` on an empty store was 10**6 - where ``state_at``, ``replay`` and
    ``diff`` refuse a position beyond the head, and the CLI's ``state --at`` checked it itself."""
    await _refused_beyond(lambda: store.position_of(1), 1, 0, "point")  # (an empty store: head 0)
    assert await store.position_of(0) == 0
    rp = await make_provider(store, VCPU=8)
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    head = await store.head()
    assert [await store.position_of(p) for p in (0, 1, head)] == [0, 1, head]
    for beyond in (head + 1, 10**6, 2**63 - 1):
        await _refused_beyond(lambda beyond=beyond: store.position_of(beyond), beyond, head, "point")  # type: ignore[misc]


async def test_read_refuses_an_after_beyond_the_head_as_subscribe_does(store: AllocationStore) -> None:
    """Regression: ``read(after=n)`` past the head answered ``[]`` - "nothing new" - where
    ``subscribe(after=n)`` refuses it. A poller paging with a cursor from another store, from
    before a restore, or lost with a PostgreSQL server's crash under ``synchronous_commit=off``,
    waited in silence until the log reached it and then skipped what was appended meanwhile. A
    cursor at the head is the ordinary poll: nothing new, as before."""
    await _refused_beyond(lambda: store.read(1), 1, 0, "after")  # (an empty store)
    assert await store.read(0) == []
    rp = await make_provider(store, VCPU=8)
    head = await store.head()
    assert await store.read(head) == []  # (a poller at the head: nothing new, not an error)
    await _refused_beyond(lambda: store.read(head + 2, 10), head + 2, head, "after")
    following = store.subscribe(after=head + 2)
    with pytest.raises(InvalidInput, match=rf"^position {head + 2} is beyond the head") as caught:
        await anext(following)
    assert caught.value.details == {"field": "after", "head": head}
    c1, c2 = new_uuid(), new_uuid()
    await allocate(store, c1, {rp: {"VCPU": 1}})
    await allocate(store, c2, {rp: {"VCPU": 1}})
    assert [e.position for e in await store.read(head + 1)] == [head + 2]  # (reached now: read)


async def test_a_cursor_kept_across_a_restore_from_an_older_backup_is_refused(tmp_path: Path) -> None:
    """A poller's cursor from before the store was restored from an older backup is past the
    restored log's head: ``read`` refuses it (it answered "nothing new" until the log grew past
    it, and the poller then skipped what was appended meanwhile), while another process's reader
    of the same file, whose cursor never passes the head, reads on."""
    path = tmp_path / "store.db"
    url = f"sqlite:///{path}"
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=8)
        backed_up = await store.head()
    shutil.copy(path, tmp_path / "backup.db")  # (closed: the log is all in the file)
    async with open_store(url) as writer, open_store(url) as reader:
        await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
        cursor = await writer.head()
        assert [e.position for e in await reader.read(backed_up)] == list(range(backed_up + 1, cursor + 1))
        assert await reader.read(cursor) == []
    shutil.copy(tmp_path / "backup.db", path)
    async with open_store(url) as restored:
        await _refused_beyond(lambda: restored.read(cursor), cursor, backed_up, "after")
        assert await restored.read(backed_up) == []
        await allocate(restored, new_uuid(), {rp: {"VCPU": 1}})  # (the log grows again, past nothing)
        assert [e.position for e in await restored.read(backed_up)] == [backed_up + 1]


async def test_position_of_a_closed_store_is_refused_as_every_read_is(tmp_path: Path) -> None:
    """Regression: ``position_of(0)`` of a closed store answered 0 (an integer was answered
    without asking the store), where every other read, ``position_of(a time)`` included, raises
    ``StoreClosed``."""
    store = await open_store(f"sqlite:///{tmp_path / 'closed.db'}")
    await store.close()
    for call in (lambda: store.position_of(0), lambda: store.read(0), lambda: store.diff(0, 0)):
        with pytest.raises(StoreClosed):
            await call()


async def test_every_entry_point_refuses_a_position_beyond_the_head_alike(store: AllocationStore) -> None:
    """One refusal, one wording and the head in its details, wherever a position is taken."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    head = await store.head()
    beyond = head + 1
    calls: list[tuple[Callable[[], Awaitable[Any]], str]] = [
        (lambda: store.read(beyond), "after"),
        (lambda: anext(store.subscribe(beyond)), "after"),
        (lambda: store.position_of(beyond), "point"),
        (lambda: store.state_at(beyond), "position"),
        (lambda: store.state_at(beyond, provider=rp), "position"),
        (lambda: store.state_at(beyond, consumer=c), "position"),
        (lambda: store.replay(beyond), "to_position"),
        (lambda: store.diff(0, beyond), "b"),
        (lambda: store.diff(beyond, beyond), "a"),
    ]
    for call, field in calls:
        await _refused_beyond(call, beyond, head, field)


async def test_a_diff_given_backwards_in_time_is_refused_even_with_no_event_between(
    store: AllocationStore,
) -> None:
    """Regression: ``diff(later, earlier)`` was refused ("diff needs a <= b") only when events lay
    between the two times; two times between the same events (or both before the first) gave an
    empty diff, as if the span were fine: the same mistake answered two ways, depending on the log.
    (``evstore diff`` refuses it either way, before opening the store.)"""
    rp = await make_provider(store, VCPU=8)
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    [*_, last] = await store.read(0)
    later, earlier = last.recorded_at + timedelta(days=2), last.recorded_at + timedelta(days=1)
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got times ") as caught:
        await store.diff(later, earlier)
    assert caught.value.details["field"] == "b"
    [first, *_] = await store.read(0)
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b"):
        await store.diff(first.recorded_at - timedelta(seconds=1), first.recorded_at - timedelta(seconds=2))
    same = await store.diff(later, later)  # (equal: an empty span, fine)
    head = await store.head()
    assert (same.from_position, same.to_position, same.consumers) == (head, head, [])
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got positions 2 and 1"):
        await store.diff(2, 1)


class _FoldingZone(tzinfo):
    """A zone at UTC+2 whose clocks went back an hour (as Europe/Berlin's do on a night in
    October, without needing the tz database): a wall-clock time lived the second time
    (``fold=1``) is at UTC+1, an hour later than the first."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        return timedelta(hours=1 if dt is not None and dt.fold else 2)

    def dst(self, dt: datetime | None) -> timedelta:
        return timedelta(0)


async def test_a_diff_orders_two_times_by_the_instants_they_name(store: AllocationStore) -> None:
    """Regression (review): diff compared two times with Python's ``>``, which for two times of one
    ``tzinfo`` compares their wall clocks: in a zone's repeated hour, 02:45 of its first pass
    (00:45 UTC) was taken for later than 02:15 of its second (01:15 UTC), so diff(earlier, later)
    was refused as backwards and diff(later, earlier) accepted."""
    await make_provider(store, VCPU=8)
    zone = _FoldingZone()
    earlier = datetime(2026, 10, 25, 2, 45, fold=0, tzinfo=zone)
    later = datetime(2026, 10, 25, 2, 15, fold=1, tzinfo=zone)
    assert earlier.astimezone(UTC) < later.astimezone(UTC)
    assert (await store.diff(earlier, later)).consumers == []
    with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got times "):
        await store.diff(later, earlier)
    # (and at the ends of the calendar, where UTC cannot say the time: review of the fix)
    for first, then in (
        (
            datetime(9999, 12, 31, 22, tzinfo=timezone(-timedelta(hours=5))),
            datetime(9999, 12, 31, 23, tzinfo=timezone(-timedelta(hours=5))),
        ),
        (
            datetime(1, 1, 1, 2, tzinfo=timezone(timedelta(hours=5))),
            datetime(1, 1, 1, 3, tzinfo=timezone(timedelta(hours=5))),
        ),
    ):
        await store.diff(first, then)
        with pytest.raises(InvalidInput, match=r"^diff needs a <= b, got times "):
            await store.diff(then, first)


async def test_a_huge_malformed_argument_is_quoted_cut_in_the_message(store: AllocationStore) -> None:
    """Regression: a malformed uuid (and a resource class, an amount that is not an integer) was
    quoted whole in the error's message, which ``command.rejected`` logs: a 1 MB string given as
    a consumer made a 1 MB message and log line. It is cut at 80 characters, as every other
    argument's quotation is (its ``details["value"]`` at 100, as before)."""
    rp = await make_provider(store, VCPU=8)
    huge = "x" * 1_000_000
    calls: list[tuple[Callable[[], Awaitable[Any]], str]] = [
        (lambda: store.allocations(huge), "consumer"),
        (lambda: anext(store.history(huge)), "uuid"),
        (lambda: store.state_at(0, consumer=huge), "consumer"),
        (lambda: store.usage(huge), "provider"),
        (lambda: store.release(huge), "consumer"),
        (lambda: store.set_inventory(rp, huge, {"total": 1}, generation=1), "resource_class"),
        (
            lambda: store.set_allocations(
                new_uuid(),
                {rp: {"VCPU": huge}},  # type: ignore[dict-item]
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            ),
            "allocations",
        ),
    ]
    for call, field in calls:
        with pytest.raises(InvalidInput, match="'xxxx") as caught:
            await call()
        assert caught.value.details["field"] == field
        assert len(caught.value.message) < 300, caught.value.message[:300]


async def test_a_reader_past_a_damaged_event_or_a_hole_reads_on(store_url: str) -> None:
    """``read(after=n)`` reads the event at ``n`` too (to tell a cursor beyond the head without a
    second query): a reader already past that event, damaged or deleted by hand, reads what follows
    it as before, and one before it still stops there with ``CorruptEvent``."""
    q = "?" if store_url.startswith("sqlite") else "$1"
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        for _ in range(4):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        head = await store.head()
        damaged, hole = head - 3, head - 1
        await store.backend.tamper(f"UPDATE events SET data = '{{not json' WHERE position = {q}", (damaged,))  # type: ignore[attr-defined]
        await store.backend.tamper(f"DELETE FROM events WHERE position = {q}", (hole,))  # type: ignore[attr-defined]
        assert [e.position for e in await store.read(damaged, 1)] == [damaged + 1]
        assert [e.position for e in await store.read(hole)] == [head]
        assert await store.read(head) == []
        with pytest.raises(CorruptEvent) as caught:
            await store.read(damaged - 1)
        assert caught.value.details["position"] == damaged
        with pytest.raises(CorruptEvent, match=f"Position {hole} is missing"):
            await store.read(damaged)
        await _refused_beyond(lambda: store.read(head + 1), head + 1, head, "after")
