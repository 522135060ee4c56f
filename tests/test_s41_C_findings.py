"""Stop 41, helper C: findings outside the files this helper owns, kept as strict xfails."""

from __future__ import annotations

from datetime import datetime, timedelta, tzinfo

import pytest

from evstore import AllocationStore, InvalidInput


class _BrokenZone(tzinfo):
    """A time zone whose offset cannot be had (a caller's bug: Python's own datetime raises
    ValueError when asked for it)."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        raise ValueError("no offset here")

    def dst(self, dt: datetime | None) -> timedelta | None:
        return None


@pytest.mark.xfail(
    strict=True,
    reason="evstore/store.py (_aware_time, _point, _given) calls value.utcoffset() unguarded: a "
    "datetime whose tzinfo fails escapes as a bare ValueError from the zone, not InvalidInput "
    "naming the argument (state_at, replay, diff, position_of and, in the message, read/export/"
    "history/subscribe/import's number arguments)",
)
@pytest.mark.parametrize("call", ["state_at", "position_of", "read"])
async def test_a_datetime_whose_zone_fails_is_refused_as_invalid_input(
    store: AllocationStore, call: str
) -> None:
    broken = datetime(2026, 1, 2, tzinfo=_BrokenZone())
    asked = {
        "state_at": lambda: store.state_at(at=broken),
        "position_of": lambda: store.position_of(broken),
        "read": lambda: store.read(after=broken),  # type: ignore[arg-type]
    }[call]
    with pytest.raises(InvalidInput):
        await asked()
