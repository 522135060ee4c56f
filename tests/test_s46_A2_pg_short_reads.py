"""Stop 46, helper A2 (task 3, a finding left to the owners of projections/replay.py and
evstore/store.py): a paged read that comes back short - the server it reads from after a reconnect
holds fewer events than the head the caller read first (a multi-host URL's standby, behind the
primary, answering after a failover; the tail lost in a crash under synchronous_commit off) - ends
a time-travel fold or an export silently: the fold's state is labelled with the position asked for
though it lacks the last events, the export's header claims lines it does not write.

The server answering behind is simulated: the events past 10 are deleted, by hand, as the fold's
(or the export's) first page is read, after the head was read - what a reconnect to a server that
lacks them shows. Both failed before the fold (replay's ``if not batch: break``) and the export
refused to end short of the position they were asked for; on both backends (SQLite's log can lose
its tail only to a hand or a restore, but the read is the same code)."""

from __future__ import annotations

from typing import Any

import pytest

from evstore import StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def _twelve_events(url: str) -> None:
    async with open_store(url) as store:
        for i in range(4):
            rp = await make_provider(store, f"rp-{i}", VCPU=8)
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.head() == 12


def _behind_after_first_page(backend: Any, method: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend.<method>`` answering from a server that lacks the events past 10 from its first
    call on (deleted then, by hand)."""
    read = getattr(backend, method)
    done: list[bool] = []

    async def behind(after: int, limit: int) -> Any:
        if not done:
            done.append(True)
            await backend.tamper("DELETE FROM events WHERE position > 10")
        return await read(after, limit)

    monkeypatch.setattr(backend, method, behind)


def _says_ended_short(refused: StorageError, what: str) -> None:
    assert refused.code == "evstore.storage"
    assert refused.details["reason"] == "log_ended_early"
    assert refused.details["position"] == 10 and refused.details["wanted"] == 12
    assert f"this {what} was to reach" in refused.message and "evstore audit" in refused.message


async def test_a_fold_that_ends_short_of_the_position_asked_is_refused(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _twelve_events(store_url)
    async with open_store(store_url, snapshot_every=1000) as store:
        _behind_after_first_page(store.backend, "read_payloads", monkeypatch)
        with pytest.raises(StorageError) as refused:
            await store.state_at(position=12)  # (answered labelled 12, folded to 10)
        _says_ended_short(refused.value, "fold")


async def test_a_replay_that_ends_short_of_the_position_asked_is_refused(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _twelve_events(store_url)
    async with open_store(store_url) as store:
        _behind_after_first_page(store.backend, "read_payloads", monkeypatch)
        with pytest.raises(StorageError) as refused:
            await store.replay(12)
        _says_ended_short(refused.value, "fold")


async def test_an_export_that_ends_short_of_its_header_is_refused(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _twelve_events(store_url)
    async with open_store(store_url) as store:
        export = store.export(batch_size=5)
        header = await anext(export)  # (head 12, read before the reconnect)
        assert '"head":12' in header.replace(" ", ""), header
        _behind_after_first_page(store.backend, "read_raw", monkeypatch)
        lines = []
        with pytest.raises(StorageError) as refused:
            async for line in export:
                lines.append(line)
        assert len(lines) == 10  # (what the server held, then the refusal: no silent end)
        _says_ended_short(refused.value, "export")
