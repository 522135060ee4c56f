"""Stop 46, the lead: an import into a store that has events is refused with a reason a program
can match on (``details["reason"] == "not_empty"``), not only words (the CLI matched the message's
first words to name the store in its own refusal)."""

from __future__ import annotations

import pytest

from evstore import InvalidInput, open_store
from tests.conftest import allocate, make_provider, new_uuid


async def test_an_import_into_a_store_with_events_says_not_empty(store_url: str, tmp_path: object) -> None:
    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=4)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        lines = [line async for line in store.export()]
        head = await store.head()
        with pytest.raises(InvalidInput) as refused:
            await store.import_events(lambda: iter(lines))
        assert refused.value.details["reason"] == "not_empty"
        assert refused.value.message.startswith("import needs an empty store")
        assert await store.head() == head  # (nothing written)
