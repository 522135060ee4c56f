"""Stop 45, helper E: the fold keeps a provider's usage at 0 or above (an imported log releasing
allocations a provider never counted - held since before it was created, or created again). Until
then such a log's usage went below zero and the audit reported it (``usage_not_held``: counted -3,
held 0); with the count kept at 0 the end state is consistent, and the audit was clean - of a log
whose release took away what the provider never counted, and commands had meanwhile decided
capacity against a count short of what was held. The audit now names each such release."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from evstore import open_store
from tests.conftest import make_provider, new_uuid
from tests.test_audit_findings import BUGGY_TAILS, _tail, append_row, chained

TAILS = {
    "allocated before it was created, then released": lambda rp, c, ghost: (
        BUGGY_TAILS["allocated before it was created, then released"](rp, c, ghost),
        ghost,
        {"VCPU": 3},
    ),
    "deleted while allocated, created again, then released": lambda rp, c, ghost: (
        [
            *BUGGY_TAILS["deleted while allocated, then created again"](rp, c, ghost),
            ("AllocationsReleased", {"consumer": c, "released": {rp: {"VCPU": 2}}}),
        ],
        rp,
        {"VCPU": 2},
    ),
}


def _not_held(report: Any) -> list[Any]:
    return [f for f in report.integrity if f.details.get("reason") == "usage_not_held"]


@pytest.mark.parametrize("tail", sorted(TAILS))
async def test_the_audit_reports_a_release_of_what_a_provider_never_counted(
    tmp_path: Path, store_url: str, tail: str
) -> None:
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=8)
        lines = [line async for line in source.export()]
        last = await _tail(source)
    rows, provider, released = TAILS[tail](rp, new_uuid(), new_uuid())
    for etype, data in rows:
        last = chained(last, etype, data)
        append_row(lines, last)
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        report = await store.audit()
        assert not report.drift, [f.message for f in report.drift]
        assert len(_not_held(report)) == 1, [f.message for f in report.findings]
        [found] = _not_held(report)
        assert found.positions == (last.position,)  # (the release)
        assert found.details["provider"] == provider
        assert found.details["uncounted"] == released
        assert provider in found.message and "never counted" in found.message
        assert (await store.usage(provider)).usages.get("VCPU", 0) == 0  # (kept at 0: what is held)
        await store.rebuild()
        assert _not_held(await store.audit()) == _not_held(report)


async def test_a_command_releasing_what_a_provider_never_counted_is_reported_at_its_position(
    tmp_path: Path, store_url: str
) -> None:
    """(The release made by a command of this evstore, on a store an imported log left so.)"""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=4)
        c = new_uuid()
        from tests.conftest import allocate

        await allocate(source, c, {rp: {"VCPU": 1}})
        lines = [line async for line in source.export()]
        append_row(lines, chained(await _tail(source), "ProviderDeleted", {"provider": rp}))
    async with open_store(store_url) as store:
        await store.import_events(lambda: iter(lines))
        await store.create_provider(rp, "rp-again")
        released = await store.release(c)
        [found] = _not_held(await store.audit())
        assert found.positions == tuple(released.positions)
        assert found.details["uncounted"] == {"VCPU": 1}
