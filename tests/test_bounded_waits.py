"""What bounds each wait the README names (command_timeout, a caller's own deadline)."""

from __future__ import annotations

import asyncio
import time

import pytest

from evstore import Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_postgres import _another_client_holding


@pytest.mark.parametrize("fenced", ["audit", "rebuild"])
async def test_a_fenced_call_given_up_on_behind_a_stuck_client_holds_nothing(
    pg_url: str, fenced: str
) -> None:
    """README: audit and rebuild wait for a client stuck inside a command until it is gone;
    cancelled (asyncio.timeout), they stop waiting and hold nothing: commands go on, and the next
    audit runs as soon as the stuck client is gone."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=Inventory(total=100))
        async with _another_client_holding(pg_url, store, "!fence", shared=True) as (_, tr):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(1):
                    await getattr(store, fenced)()
            assert time.monotonic() - started < 3
            await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), timeout=5)
            await tr.rollback()
        report = await asyncio.wait_for(store.audit(), timeout=5)
        assert report.clean and report.head == 3
