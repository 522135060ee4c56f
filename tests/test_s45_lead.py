"""Stop 45, lead: rebuild's count of the snapshots it dropped, on both backends (helper D counted
it in SQLite's rebuild transaction; PostgreSQL counted those there when the rebuild began)."""

from __future__ import annotations

from typing import Any

import pytest

from evstore import open_store
from evstore.log import Rebuilt
from evstore.log import postgres as postgres_backend
from evstore.log import sqlite as sqlite_backend
from tests.conftest import allocate, make_provider, new_uuid


async def test_rebuild_counts_the_snapshots_its_transaction_dropped(store_url: str) -> None:
    async with open_store(store_url, snapshot_every=3) as store:
        rp = await make_provider(store, VCPU=64)
        for _ in range(5):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.take_snapshots() == [3, 6]
        rebuilt = await store.rebuild()
        assert isinstance(rebuilt, Rebuilt)
        assert rebuilt == await store.head() and rebuilt.snapshots_dropped == 2
        assert await store.snapshot_positions() == []
        again = await store.rebuild()
        assert again == rebuilt and again.snapshots_dropped == 0
        # a snapshot saved after the rebuild is counted by the next one, not the tombstone segments
        await store.state_at(4)
        saved = await store.snapshot_positions()
        assert saved, "a whole-store question saves a snapshot on its way"
        assert (await store.rebuild()).snapshots_dropped == len(saved)


async def test_snapshots_saved_while_it_folds_are_counted_too(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rebuild folds the log before its transaction; a question answered meanwhile (another
    store on the same log) saves snapshots, which the rebuild's transaction drops: counted. They
    were missed where the count was taken as the rebuild began (PostgreSQL until this stop)."""
    backend = sqlite_backend if store_url.startswith("sqlite") else postgres_backend
    real = backend.replay
    taken: list[list[int]] = []

    async def folding(*args: Any, **kwargs: Any) -> Any:
        state = await real(*args, **kwargs)
        async with open_store(store_url, snapshot_every=3) as other:
            taken.append(await other.take_snapshots())
        return state

    async with open_store(store_url, snapshot_every=3) as store:
        rp = await make_provider(store, VCPU=64)
        for _ in range(5):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        monkeypatch.setattr(backend, "replay", folding)
        rebuilt = await store.rebuild()
        assert taken == [[3, 6]]
        assert rebuilt.snapshots_dropped == 2
        assert await store.snapshot_positions() == []


def test_what_rebuild_answers_is_named_by_the_package() -> None:
    """``store.rebuild()`` answers a ``Rebuilt``: importable from ``evstore`` for annotations, as
    ``Receipt`` and the queries' answers are."""
    import evstore

    assert "Rebuilt" in evstore.__all__ and evstore.Rebuilt is Rebuilt
