"""Stop 41, helper L: ``evstore.command_metadata(...)`` as a service uses it. Built with
``contextlib.contextmanager`` it was also a decorator, and decorating a request handler - an
``async def`` - silently dropped the metadata: the decorator's context ended when the handler's
coroutine was made, before it ran, so its commands' events carried none of it. Now the context
spans each call (each await of the handler); ``async with`` is taken too."""

from __future__ import annotations

import asyncio

import pytest

from evstore import AllocationStore, InvalidInput, command_metadata, open_store
from tests.conftest import make_provider, new_uuid


async def _alloc(store: AllocationStore, rp: str) -> int:
    receipt = await store.set_allocations(
        new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )
    return receipt.position


async def test_a_decorated_async_handler_records_its_metadata(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)

        @command_metadata(actor="scheduler", tenant="t1")
        async def handler(n: int) -> int:
            with command_metadata(request_id=f"req-{n}"):  # (nested: adds to the decorator's)
                return await _alloc(store, rp)

        positions = await asyncio.gather(*(handler(n) for n in range(4)))
        events = {e.position: e for e in await store.read()}
        for n, position in enumerate(positions):
            meta = events[position].metadata
            assert (meta.actor, meta.request_id) == ("scheduler", f"req-{n}")
            assert meta.model_dump()["tenant"] == "t1"
        # and outside any call of it, nothing is set
        position = await _alloc(store, rp)
        bare = (await store.read(after=position - 1))[0].metadata
        assert (bare.actor, bare.request_id) == (None, None)


async def test_async_with_and_a_decorated_plain_function(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)
        async with command_metadata(request_id="req-async-with"):
            position = await _alloc(store, rp)
        assert (await store.read(after=position - 1))[0].metadata.request_id == "req-async-with"

        @command_metadata(actor="sync-caller")
        def start() -> asyncio.Task[int]:  # (a task made inside the context inherits it)
            return asyncio.create_task(_alloc(store, rp))

        position = await start()
        assert (await store.read(after=position - 1))[0].metadata.actor == "sync-caller"


def test_refused_metadata_is_refused_where_it_is_given() -> None:
    with pytest.raises(InvalidInput, match="request_id"):

        @command_metadata(request_id=5)  # type: ignore[arg-type]
        async def handler() -> None:
            pass
