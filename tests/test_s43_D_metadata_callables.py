"""Stop 43, helper D: ``command_metadata(...)`` as a decorator of callables that are not an
``async def`` themselves but run one. A handler class with ``async def __call__`` (how many web
frameworks take a handler), a ``functools.partial`` of one, and a plain function answering a
coroutine were wrapped as plain functions: the metadata was set while the coroutine was made and
gone when it ran, so their commands' events silently carried none of it (as stop 41 found for
``async def``). Now each sets it for the run; a generator behind a ``__call__`` is refused as a
generator function is, and a thing that cannot be called is a typed error where it is decorated."""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput, command_metadata, open_store
from tests.conftest import make_provider, new_uuid


async def _alloc(store: AllocationStore, rp: str) -> int:
    receipt = await store.set_allocations(
        new_uuid(), {rp: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )
    return receipt.position


async def _request_id_at(store: AllocationStore, position: int) -> str | None:
    return (await store.read(after=position - 1, limit=1))[0].metadata.request_id


class Handler:
    def __init__(self, store: AllocationStore, rp: str) -> None:
        self.store, self.rp = store, rp

    async def __call__(self) -> int:
        return await _alloc(self.store, self.rp)


async def test_an_object_with_an_async_call_records_the_metadata(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)
        handler = command_metadata(request_id="req-call")(Handler(store, rp))
        # (it stays an async callable, as frameworks that look before they call see it)
        assert inspect.iscoroutinefunction(handler)
        assert await _request_id_at(store, await handler()) == "req-call"


async def test_a_partial_of_an_async_callable_records_the_metadata(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)
        of_function = command_metadata(request_id="req-partial")(functools.partial(_alloc, store, rp))
        assert await _request_id_at(store, await of_function()) == "req-partial"
        of_object = command_metadata(request_id="req-partial-call")(functools.partial(Handler(store, rp)))
        assert await _request_id_at(store, await of_object()) == "req-partial-call"


async def test_a_plain_function_answering_a_coroutine_records_the_metadata(sqlite_url: str) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=100)

        @command_metadata(request_id="req-plain")
        def start() -> Coroutine[Any, Any, int]:
            return _alloc(store, rp)

        assert await _request_id_at(store, await start()) == "req-plain"
        # and none outside it
        assert await _request_id_at(store, await _alloc(store, rp)) is None


def test_a_generator_behind_call_is_refused_as_a_generator_is() -> None:
    class Gen:
        def __call__(self) -> Iterator[int]:
            yield 1

    class AsyncGen:
        async def __call__(self) -> AsyncIterator[int]:
            yield 1

    for thing in (Gen(), AsyncGen(), functools.partial(AsyncGen())):
        with pytest.raises(InvalidInput, match="cannot decorate a generator") as caught:
            command_metadata(request_id="r")(thing)
        assert caught.value.code == "evstore.invalid_input"


def test_decorating_what_cannot_be_called_is_a_typed_error() -> None:
    with pytest.raises(InvalidInput, match="decorates a function") as caught:
        command_metadata(request_id="r")(5)  # type: ignore[arg-type]
    assert caught.value.details["field"] == "command_metadata"
