"""Stop 43, helper D: a store's lifecycle used from several tasks.

One ``open_store(...)`` entered by two tasks at once (``async with opener`` in each, as a service
that shares its opener might): the second was let in while the first was still opening, since the
opener noted its store only once the open ended. Both opened a store; the opener kept the last,
so the first block to end closed the *other* task's store under it (its next call: StoreClosed)
and its own was never closed (a ResourceWarning). The second is now refused while the first
opens, as it is once the first is open (``InvalidInput``, "in use")."""

from __future__ import annotations

import asyncio
import gc
import warnings

import pytest

from evstore import InvalidInput, open_store
from tests.conftest import new_uuid


async def test_two_tasks_entering_one_opener_at_once_get_one_store_and_a_refusal(sqlite_url: str) -> None:
    opener = open_store(sqlite_url)
    entered: list[str] = []

    async def use(name: str, hold: float) -> str:
        try:
            async with opener as store:
                entered.append(name)
                await asyncio.sleep(hold)
                await store.create_provider(new_uuid(), f"rp-{name}")
                return "ok"
        except InvalidInput as exc:
            assert "in use" in exc.message
            return "refused"

    gc.collect()  # (earlier tests' garbage - a socket left to the collector - is not this test's)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        outcomes = await asyncio.wait_for(asyncio.gather(use("first", 0.2), use("second", 0.0)), 10)
        gc.collect()
    assert sorted(outcomes) == ["ok", "refused"] and len(entered) == 1
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
    # the opener serves a block again once that one ended, and that block's write is there
    async with opener as store:
        assert len(await store.providers()) == 1


async def test_a_failed_open_leaves_the_opener_usable(tmp_path: pytest.TempPathFactory) -> None:
    opener = open_store(f"sqlite:///{tmp_path}/missing/dir/x.db")
    for _ in range(2):  # (the same refusal each time, not "in use")
        with pytest.raises(Exception) as caught:
            async with opener:
                pass
        assert getattr(caught.value, "code", None) == "evstore.not_found"
