"""The audit of a store whose leak cites a row damaged since (stop 42, helper D)."""

from __future__ import annotations

from pathlib import Path

import pytest

from evstore import open_store
from tests.test_audit_findings import _deleted_mid_migration


@pytest.mark.parametrize("cited", ["allocated", "deleted"])
async def test_a_leak_citing_a_row_with_metadata_nested_too_deep_is_still_reported(
    tmp_path: Path, store_url: str, cited: str
) -> None:
    """Regression: the audit names who asked for a leak's allocation and its tombstone from those
    rows' metadata; a row whose metadata was altered since into JSON nested deeper than the
    recursion limit made the audit fail with a bare RecursionError (``evstore audit``:
    ``evstore.internal``), where it reports the damaged row - and the leak, without that citation."""
    lines, revert, _, instance, tombstone = await _deleted_mid_migration(tmp_path, same_host=False)
    damaged = revert.position if cited == "allocated" else tombstone
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        deep = '{"actor": "x", "k": ' + "[" * 5000 + "]" * 5000 + "}"
        await store.backend.tamper("UPDATE events SET metadata = ? WHERE position = ?", (deep, damaged))
        report = await store.audit()
    [leak] = report.leaks
    assert leak.details["consumer"] == instance
    assert cited not in leak.details.get("requests", {})
    assert any(f.kind == "integrity" and f.positions == (damaged,) for f in report.findings)
