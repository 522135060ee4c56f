"""Stop 43, helper D: one ``command_metadata(...)`` object entered by several tasks.

A service may make its scope once - ``SERVICE = command_metadata(actor="scheduler")`` at module
level - and enter it in each request handler (``async with SERVICE:``). The scope kept the tokens
of its entries in one list on the object, shared by every task: when two handlers' blocks
overlapped, the first to end popped the *other* task's token, and resetting it raised a bare
``ValueError: <Token ...> was created in a different Context`` out of the ``async with``, the
handler's command done but its block failed, and its metadata left set for the rest of that task.
Each task's entries are now its own."""

from __future__ import annotations

import asyncio

from evstore import command_metadata, open_store
from evstore.store import _command_metadata
from tests.conftest import new_uuid

SERVICE = command_metadata(actor="scheduler")


async def test_one_scope_object_entered_by_overlapping_tasks(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:

        async def handler(before: float, inside: float) -> tuple[int, object]:
            await asyncio.sleep(before)
            async with SERVICE:
                with command_metadata(request_id=f"req-{before}"):
                    await asyncio.sleep(inside)
                    receipt = await store.delete_consumer(new_uuid())
            return receipt.position, _command_metadata.get()

        # (the first enters first and ends first, while the second is inside its block)
        outcomes = await asyncio.wait_for(asyncio.gather(handler(0, 0.05), handler(0.01, 0.2)), 10)
        for (position, left), before in zip(outcomes, (0, 0.01), strict=True):
            assert left is None  # (nothing left set once each block ended)
            meta = (await store.read(after=position - 1, limit=1))[0].metadata
            assert (meta.actor, meta.request_id) == ("scheduler", f"req-{before}")


def test_the_same_scope_nested_in_one_task_unwinds_in_order() -> None:
    with SERVICE:
        with SERVICE:
            assert (_command_metadata.get() or {}).get("actor") == "scheduler"
        assert (_command_metadata.get() or {}).get("actor") == "scheduler"
    assert _command_metadata.get() is None
