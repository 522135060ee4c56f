"""``open_store(...)``'s misuses (stop 45, helper D): an opener entered again while its ``async
with`` runs, or used in a plain ``with``, is an ``InvalidInput`` whose details name what is
refused (``field``: the call, ``open_store``, as ``command_metadata(...)``'s misuses name theirs),
as every other ``InvalidInput`` does."""

from __future__ import annotations

import pytest

from evstore import InvalidInput, open_store


async def test_an_opener_entered_twice_names_what_is_refused(sqlite_url: str) -> None:
    opener = open_store(sqlite_url)
    async with opener as store:
        with pytest.raises(InvalidInput) as caught:
            async with opener:
                pass  # pragma: no cover (refused)
        assert caught.value.details == {"field": "open_store"}, caught.value.details
        assert "in use" in caught.value.message
        assert await store.head() == 0  # (the first block's store is still open)


def test_an_opener_used_in_a_plain_with_names_what_is_refused(sqlite_url: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        with open_store(sqlite_url):  # type: ignore[attr-defined]
            pass  # pragma: no cover (refused)
    assert caught.value.details == {"field": "open_store"}, caught.value.details
    assert "async with" in caught.value.message


async def test_open_store_refuses_snapshot_every_none_as_every_option_does(sqlite_url: str) -> None:
    """``open_store(snapshot_every=None)`` opened with the default (10,000), where ``max_batch=None``
    and ``poll_interval=None`` are refused, and ``store.snapshot_every = None`` too: the option is an
    ``int`` (``StoreOptions``). Now refused alike, naming the option; leaving it out keeps the default."""
    with pytest.raises(InvalidInput) as caught:
        async with open_store(sqlite_url, snapshot_every=None):  # type: ignore[arg-type]
            pass  # pragma: no cover (refused)
    assert caught.value.details == {"field": "snapshot_every"}, caught.value.details
    async with open_store(sqlite_url) as store:
        assert store.snapshot_every == 10_000
