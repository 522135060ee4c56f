"""Stop 46, helper A2: time-travel questions asked by a role that may only read the store (USAGE on
the schema, SELECT on its tables) do not try, at each question, a snapshot save the server refused
a moment ago: each such try cost a failed INSERT with the whole state sent for it."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest
import structlog

from evstore import StorageError, open_store
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


@pytest.fixture
async def reader(pg_url: str) -> AsyncIterator[tuple[str, str]]:
    """The test's store (4 providers with an inventory each, 4 allocations: 12 events) and the URL
    of a role of the test's own that may read it and nothing more: USAGE on the schema, SELECT on
    its tables (as helper A's tests/test_s46_A_pg_read_only_writes.py makes it)."""
    async with open_store(pg_url) as store:
        for i in range(4):
            rp = await make_provider(store, f"rp-{i}", VCPU=8)
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    role = f"evt_s46a2_{os.getpid()}_{random.randrange(10**6)}"
    schema = _schema(pg_url)
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
        yield _as(pg_url, role), role
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


@pytest.fixture
def debug_logs() -> Iterator[list[dict[str, Any]]]:
    """structlog's events at every level (the tests' configuration filters below WARNING)."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            yield logs
    finally:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _not_saved(logs: list[dict[str, Any]], level: str) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == "snapshot.not_saved" and e["log_level"] == level]


async def test_a_read_only_role_does_not_try_a_refused_save_at_each_question(
    reader: tuple[str, str], debug_logs: list[dict[str, Any]]
) -> None:
    """Regression: each question of a role that may only read tried to save a snapshot on the way
    (an INSERT the server refused, the state sent with it) and warned ``snapshot.not_saved``. The
    first question tries (and warns: read_only, what the role lacks); the next ones, within
    SNAPSHOT_REFUSAL_KEPT, do not try - a debug line says so - and answer as before."""
    url, _ = reader
    async with open_store(url, create=False, upgrade=False, snapshot_every=4) as store:
        assert isinstance(store.backend, PostgresBackend)
        answers = [await store.state_at(position=p) for p in (12, 11, 9, 12)]
        assert [a.position for a in answers] == [12, 11, 9, 12]
        assert repr(answers[0]) == repr(answers[3]) == "StateView(position=12, providers=4, consumers=4)"
        assert await store.snapshot_positions() == []
    warned = _not_saved(debug_logs, "warning")
    # (projections/snapshots.py's: once per store and reason, see the last test)
    assert 1 <= len(warned) <= 4, debug_logs
    assert "this role may not write the store" in warned[0]["error"], warned[0]
    assert {w["error"] for w in warned} == {warned[0]["error"]}, warned  # (as the server's refusal)
    skipped = [e for e in _not_saved(debug_logs, "debug") if "error" not in e]  # (the backend's)
    assert len(skipped) == 3 and {e["reason"] for e in skipped} == {"read_only"}, skipped


async def test_a_save_is_tried_again_once_the_refusal_is_old_and_then_saved(
    pg_url: str, reader: tuple[str, str], debug_logs: list[dict[str, Any]]
) -> None:
    """A refusal is kept SNAPSHOT_REFUSAL_KEPT seconds only: the role granted what a save needs
    meanwhile, the next question after that saves its snapshots. And the snapshot command (what
    the caller asked for) tries always, refused or not a moment ago."""
    url, role = reader
    async with open_store(url, create=False, upgrade=False, snapshot_every=4) as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        backend.SNAPSHOT_REFUSAL_KEPT = 1.0  # type: ignore[misc]
        await store.state_at(position=12)
        with pytest.raises(StorageError) as failed:
            await store.take_snapshots()
        assert failed.value.details.get("reason") == "read_only"
        assert "not tried again" not in failed.value.message
        admin = await asyncpg.connect(pg_url)
        try:
            await admin.execute(f"GRANT INSERT, UPDATE ON snapshots TO {role}")
        finally:
            await admin.close()
        await store.state_at(position=12)  # (within the time kept: not tried)
        assert await store.snapshot_positions() == []
        await asyncio.sleep(1.1)
        await store.state_at(position=12)
        assert await store.snapshot_positions() == [4, 8, 12]


async def test_a_read_only_role_asking_many_questions_warns_once(
    reader: tuple[str, str], debug_logs: list[dict[str, Any]]
) -> None:
    """Many questions of a read-only role, one warning (then at debug). Regression: a warning for
    each question, which flooded a reader's log."""
    url, _ = reader
    async with open_store(url, create=False, upgrade=False, snapshot_every=4) as store:
        for p in (12, 11, 9, 12):
            await store.state_at(position=p)
    assert len(_not_saved(debug_logs, "warning")) == 1, debug_logs
