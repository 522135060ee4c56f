"""``diff(a, b)`` against an oracle written from README alone (stop 42, helper D).

README: each consumer events touched in between is listed as ``created``, ``changed``,
``released``, ``deleted``, ``transient`` (holding nothing at either end) or ``leaked`` (holding
at the end what the audit calls a leak); one left as it was is not listed. The oracle reads the
two ends from ``state_at(a)`` and ``state_at(b)`` (their ``ConsumerView``s: allocations, project,
user, type, instance, ``deleted``, ``leaked``) and which consumers the events in between name;
the diff must say the same of every consumer, on a mixed workload and on a log an older,
Placement-style writer left leaking.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from evstore import ConsumerView, open_store
from tests.test_acceptance_debugging import _entity_uuids, _events, _mixed_workload
from tests.test_audit_findings import _deleted_mid_migration, _migration_left_holding


def _expected(before: ConsumerView, after: ConsumerView) -> str | None:
    had, has = dict(before.allocations), dict(after.allocations)

    def labels(v: ConsumerView) -> tuple[Any, ...]:
        return (v.project_id, v.user_id, v.consumer_type, v.on_behalf_of, v.deleted)

    if after.leaked:
        same = before.leaked and had == has and labels(before) == labels(after)
        return None if same else "leaked"
    if after.deleted and not before.deleted:
        return "deleted"
    if has and not had:
        return "created"
    if had and not has:
        return "released"
    if had and has:
        return None if had == has and labels(before) == labels(after) else "changed"
    return "transient"


async def _check_spans(url: str, spans: list[tuple[int, int]]) -> int:
    """Check each span; the number of consumer answers compared."""
    compared = 0
    async with open_store(url) as store:
        events = await _events(store)
        _, consumers = await _entity_uuids(store, events)
        for a, b in spans:
            diff = await store.diff(a, b)
            listed = {c.consumer: c for c in diff.consumers}
            va, vb = await store.state_at(position=a), await store.state_at(position=b)
            named = {c for c in consumers for e in events[a:b] if c in json.dumps(e.data)}
            for c in consumers:
                want = _expected(await va.allocations(c), await vb.allocations(c))
                got = listed.get(c)
                where: Any = (a, b, c, want, got)
                if c not in named and not (want == "leaked" and got is not None):
                    assert got is None, where  # (untouched; a migration left holding is cited)
                elif want is None:
                    assert got is None, where
                elif want == "transient":  # (an event that names it only in passing need not list it)
                    assert got is None or got.change == "transient", where
                else:
                    assert got is not None and got.change == want, where
                compared += 1
    return compared


async def test_every_consumers_change_is_what_its_two_ends_say(store_url: str) -> None:
    async with open_store(store_url) as store:
        await _mixed_workload(store, seed=42, commands=90)
        rewritten = await store.head()
        for c in (await _entity_uuids(store, await _events(store)))[1]:  # (rewritten the same)
            view = await store.allocations(c)
            if view.allocations and not view.deleted and view.consumer_type == "INSTANCE":
                await store.set_allocations(
                    c,
                    {p: dict(r) for p, r in view.allocations.items()},
                    project_id=view.project_id or "",
                    user_id=view.user_id or "",
                    consumer_type="INSTANCE",
                    generation=view.generation,
                )
        head = await store.head()
    rng = random.Random(42)
    assert head > rewritten
    spans = [(0, head), (head, head), (rewritten, head), (rewritten - 5, head)] + [
        tuple(sorted(rng.sample(range(head + 1), 2))) for _ in range(8)
    ]
    assert await _check_spans(store_url, spans) > 0  # type: ignore[arg-type]


async def test_a_leaking_logs_changes_are_what_its_two_ends_say(tmp_path: Path, store_url: str) -> None:
    """A migration an older writer's delete left holding (cleared by its confirm): every span."""
    lines, delete, ids = await _migration_left_holding(tmp_path)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        assert await store.head() == delete.position
        await store.confirm_migration(ids["migration"])  # (the leak cleared)
        end = await store.head()
    spans = [(a, b) for a in range(end + 1) for b in range(a, end + 1)]
    assert await _check_spans(store_url, spans) > 0


async def test_a_reverted_leaks_changes_are_what_its_two_ends_say(tmp_path: Path, sqlite_url: str) -> None:
    """An instance an older writer's revert gave allocations back after its delete (cleared by its
    release), on the host it held before: every span."""
    lines, revert, _, instance, _ = await _deleted_mid_migration(tmp_path, same_host=True)
    async with open_store(sqlite_url) as store:
        await store.import_events(lambda: iter(lines))
        assert await store.head() == revert.position
        await store.release(instance)
        end = await store.head()
    spans = [(a, b) for a in range(end + 1) for b in range(a, end + 1)]
    assert await _check_spans(sqlite_url, spans) > 0
