"""Stop 41, helper C: findings outside the files this helper owned (fixed by the lead and helper D)."""

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
    with pytest.raises(InvalidInput) as refused:
        await asked()
    # (it says what failed, not "no time zone" or a bare ValueError from the zone)
    assert "failed to give its offset from UTC (ValueError: no offset here)" in str(refused.value)
    assert "no time zone" not in str(refused.value)


async def test_provider_allocations_refuses_a_damaged_amount_as_allocations_does(
    store: AllocationStore, backend_name: str
) -> None:
    from evstore import ProjectionCorrupt
    from tests.conftest import allocate, make_provider, new_uuid

    rp, consumer = await make_provider(store, VCPU=8), new_uuid()
    await allocate(store, consumer, {rp: {"VCPU": 2}})
    damage = {
        "sqlite": "UPDATE p_allocations SET resources = '{\"VCPU\":-3}' WHERE consumer = ?",
        "postgres": "UPDATE p_allocations SET used = -3 WHERE consumer = ?",
    }[backend_name]
    await store.backend.tamper(damage, (consumer,))  # type: ignore[attr-defined]
    with pytest.raises(ProjectionCorrupt):
        await store.allocations(consumer)
    with pytest.raises(ProjectionCorrupt):
        await store.provider_allocations(rp)
