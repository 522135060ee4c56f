"""Stop 40: a row's schema_version below 1 is damage, not a newer evstore's (helper 165's probe)."""

from __future__ import annotations

import pytest

from evstore import CorruptEvent
from evstore.events import EVENT_TYPES, decode_event


@pytest.mark.parametrize("version", [0, -1])
def test_a_schema_version_below_1_is_not_put_down_to_a_newer_evstore(version: int) -> None:
    """Regression: version 0 (or below) was explained as "written by a newer evstore? read the
    store with that version", which no version of evstore can do; it is a row changed by hand."""
    with pytest.raises(CorruptEvent) as caught:
        decode_event("ProviderCreated", version, '{"provider":"x","name":"n","root":"x"}', position=7)
    message = str(caught.value)
    assert "newer evstore" not in message, message
    assert f"has schema_version {version}; evstore's versions start at 1" in message, message
    assert "`evstore audit` lists every such row" in message, message
    assert caught.value.details["reason"] == "unknown_schema_version"
    assert caught.value.details["position"] == 7


def test_a_schema_version_above_this_evstores_still_says_a_newer_one_may_have_written_it() -> None:
    newest = EVENT_TYPES["ProviderCreated"].SCHEMA_VERSION
    with pytest.raises(CorruptEvent, match=r"reads up to \d+ \(written by a newer evstore\?"):
        decode_event("ProviderCreated", newest + 1, '{"provider":"x"}', position=3)
