"""Stop 46, helper D: black-box acceptance probes of the public API (README, SPEC, Placement 16).

Each test asserts what README/SPEC promise; the strict xfails are defects found by the probes,
with the likely cause and fix in their reason.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest

from evstore import CorruptEvent, open_store
from evstore.events import EventBase, ProviderCreated, ProviderUpdated, event_hash
from tests.test_typing import _mypy

#: Nova's move written the way README describes write_allocations' body - "{consumer:
#: ConsumerAllocations(...)}, or mappings of those fields" - with one consumer of each form, inline
#: and in a variable annotated with the exported alias; and a provider map whose keys are a
#: uuid.UUID and a str ("every uuid argument is taken ... as a uuid.UUID" - the aliases name
#: Mapping[str | UUID, ...] for exactly that).
MIXED_BODIES = """
from __future__ import annotations

import uuid

from evstore import AllocationsByConsumer, AllocationStore, ConsumerAllocations, Receipt


async def move(store: AllocationStore, instance: str, migration: str, node: str, gen: int) -> Receipt:
    return await store.write_allocations({
        instance: ConsumerAllocations(
            allocations={}, project_id="p", user_id="u", consumer_type="INSTANCE", consumer_generation=gen
        ),
        migration: {"allocations": {node: {"VCPU": 1}}, "project_id": "p", "user_id": "u",
                    "consumer_type": "MIGRATION", "consumer_generation": None},
    })


async def move_annotated(store: AllocationStore, instance: str, migration: str, node: str) -> Receipt:
    body: AllocationsByConsumer = {
        instance: ConsumerAllocations(
            allocations={}, project_id="p", user_id="u", consumer_type="INSTANCE", consumer_generation=1
        ),
        migration: {"allocations": {node: {"VCPU": 1}}, "project_id": "p", "user_id": "u",
                    "consumer_type": "MIGRATION", "consumer_generation": None},
    }
    return await store.write_allocations(body)


async def two_nodes(store: AllocationStore, server: str, a: uuid.UUID, b: str) -> Receipt:
    return await store.set_allocations(
        server, {a: {"VCPU": 1}, b: {"VCPU": 1}}, project_id="p", user_id="u",
        consumer_type="INSTANCE", generation=None,
    )
"""


def test_mixed_allocation_bodies_type_check(tmp_path: Path) -> None:
    """Regression (helper D): the exported aliases were unions of three Mappings, against which
    mypy cannot infer a literal: these bodies were refused (arg-type / assignment)."""
    result = _mypy(tmp_path, MIXED_BODIES)
    assert result.returncode == 0, result.stdout + result.stderr


#: what the one-Mapping aliases must still refuse: a wrong amount, a wrong consumer body
WRONG_BODIES = """
from __future__ import annotations

from evstore import AllocationStore, Receipt


async def amount(store: AllocationStore, server: str, node: str) -> Receipt:
    return await store.set_allocations(
        server, {node: {"VCPU": "1"}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )


async def body(store: AllocationStore, server: str) -> Receipt:
    return await store.write_allocations({server: 3})
"""


def test_wrong_allocation_bodies_are_still_refused_by_the_checker(tmp_path: Path) -> None:
    result = _mypy(tmp_path, WRONG_BODIES)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2, result.stdout


async def _with_events(source_url: str, build: Callable[[str], list[EventBase]]) -> tuple[list[str], str]:
    """The export of a new store at ``source_url`` holding one provider "A", with ``build(A)``'s
    events appended, chained as README's legacy example chains its revert; and A's uuid."""
    a = str(uuid.uuid4())
    async with open_store(source_url) as s:
        await s.create_provider(a, "A")
        lines = [line.rstrip("\n") async for line in s.export()]
    header, last = json.loads(lines[0]), json.loads(lines[-1])
    for event in build(a):
        row = {
            "position": last["position"] + 1,
            "event_id": str(uuid.uuid4()),
            "type": event.event_type,
            "schema_version": event.schema_version,
            "data": event.payload_json(),
            "metadata": json.dumps({"request_id": "req-legacy"}),
            "recorded_at": datetime.now(UTC).isoformat(timespec="microseconds"),
        }
        row["hash"] = event_hash(last["hash"], *row.values())
        header.update(events=header["events"] + 1, head=row["position"], head_hash=row["hash"])
        lines.append(json.dumps(row))
        last = row
    return [json.dumps(header) + "\n", *(line + "\n" for line in lines[1:])], a


@pytest.mark.parametrize("how", ["created", "renamed"])
async def test_an_imported_duplicate_provider_name_is_refused_or_audited(
    store_url: str, tmp_path: Path, how: str
) -> None:
    b = str(uuid.uuid4())

    def build(a: str) -> list[EventBase]:
        if how == "created":
            return [ProviderCreated(provider=b, name="A", root=b)]
        return [ProviderCreated(provider=b, name="B", root=b), ProviderUpdated(provider=b, name="A")]

    lines, _ = await _with_events(f"sqlite:///{tmp_path}/source.db", build)
    async with open_store(store_url) as store:
        try:
            await store.import_events(lambda: lines)
        except CorruptEvent as exc:
            assert exc.code == "evstore.log.corrupt"
            assert await store.head() == 0
            return
        names = [name for _, name in await store.providers()]
        assert names.count("A") == 2  # (what the import left: the audit must say so)
        report = await store.audit()
        assert not report.clean, "two live providers named 'A', and the audit is clean"
