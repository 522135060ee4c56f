"""Stop 39: a row no evstore writes, met by a reader, is refused with what to do about it (the
audit lists such rows; restore from a backup; for a type or version it does not know, a newer
evstore may have written it), where the message said only what was wrong; the audit's finding
for the row says what is wrong, not the advice that sends a person to the audit."""

from __future__ import annotations

import pytest

from evstore import CorruptEvent, open_store
from tests.conftest import make_provider
from tests.test_audit_findings import _append, _sqlite, _tail, chained


@pytest.mark.parametrize(
    ("etype", "data", "version", "newer"),
    [
        ("ProviderUpdated", '{"provider": 5}', 1, False),
        ("ProviderRenamedInTheFuture", '{"provider": "x"}', 1, True),
        ("ProviderUpdated", '{"provider": "x", "name": "y"}', 99, True),
    ],
)
async def test_a_damaged_row_met_by_a_reader_says_what_to_do(
    sqlite_url: str, etype: str, data: str, version: int, newer: bool
) -> None:
    async with open_store(sqlite_url) as store:
        await make_provider(store, VCPU=8)
        await _append(await _sqlite(store), chained(await _tail(store), etype, data, version=version))
        with pytest.raises(CorruptEvent) as caught:
            await store.read(0, 10)
        message = caught.value.message
        assert "position 3" in message
        assert "`evstore audit` lists every such row" in message and "backup" in message, message
        assert ("newer evstore" in message) is newer, message
        report = await store.audit()
        found = [f for f in report.findings if f.positions == (3,)]
        assert found and all("evstore audit" not in f.message for f in found), found
