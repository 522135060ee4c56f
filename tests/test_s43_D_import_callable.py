"""Stop 43, helper D: ``import_events(open_lines)`` given the natural mistakes of an async service
- an ``async def`` (or an object with ``async def __call__``) answering the lines, an async
generator, a function answering the whole text as one string - was refused as "open_lines() must
return the lines, got a coroutine" ("got a async_generator", "got a str"), which says what was
wrong but not what to give. The refusal now says it: lines are read synchronously, twice, so a
plain function answering a file or a list; a text is split into lines first. Nothing is written."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from evstore import InvalidInput, open_store
from tests.conftest import new_uuid


async def _lines() -> list[str]:
    async with open_store("sqlite://") as source:
        await source.create_provider(new_uuid(), "rp")
        return [line async for line in source.export()]


async def test_an_async_callable_is_refused_saying_what_to_give(sqlite_url: str) -> None:
    lines = await _lines()

    async def coroutine_fn() -> list[str]:
        return lines

    async def agen() -> AsyncIterator[str]:
        for line in lines:
            yield line

    class Handler:
        async def __call__(self) -> list[str]:
            return lines

    cases: list[tuple[Callable[[], Any], str]] = [
        (coroutine_fn, "not an async"),
        (agen, "not an async"),
        (Handler(), "not an async"),
        (lambda: "\n".join(lines), "splitlines"),
    ]
    async with open_store(sqlite_url) as store:
        for open_lines, hint in cases:
            with pytest.raises(InvalidInput) as caught:
                await store.import_events(open_lines)
            assert caught.value.details["field"] == "open_lines" and hint in caught.value.message
        assert await store.head() == 0
        assert await store.import_events(lambda: lines) == 1  # (the plain form still imports)
