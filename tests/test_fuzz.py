"""Fuzz every public method: only EvstoreError escapes, and a rejected command leaves no trace.

Also: rows corrupted in the database fail reads with an error naming the position, and the
audit reports them; nothing is silently skipped.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from evstore import AllocationStore, CorruptEvent, EvstoreError, Inventory, open_store
from tests.conftest import allocate, make_provider, new_uuid

SLOW = os.environ.get("EVSTORE_SLOW") == "1"
FUZZ = settings(
    max_examples=1500 if SLOW else 120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=300),
    st.binary(max_size=20),
    st.sampled_from(["VCPU", "CUSTOM_X", "vcpu", "", " ", "00000000-0000-0000-0000-000000000000", "x" * 300]),
    st.uuids(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)
hashable_junk = junk.filter(lambda x: not isinstance(x, list | dict))
amounts = st.one_of(
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.none(),
)
classes = st.one_of(st.sampled_from(["VCPU", "MEMORY_MB", "CUSTOM_NOPE", "DISK_GB"]), st.text(max_size=12))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One store and event loop for all examples (a fresh one per example would dominate the time)."""
    loop = asyncio.new_event_loop()
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.db"
    cm = open_store(f"sqlite:///{path}")
    store = loop.run_until_complete(cm.__aenter__())

    async def setup() -> tuple[str, str]:
        rp = await make_provider(store, "fuzz-node", VCPU=64, MEMORY_MB=4096)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        return rp, c

    rp, consumer = loop.run_until_complete(setup())
    yield loop, store, rp, consumer
    loop.run_until_complete(cm.__aexit__(None, None, None))
    loop.close()


def call(world: Any, make: Any) -> None:
    loop, store, rp, consumer = world

    async def run() -> None:
        head = await store.head()
        before = (await store.usage(rp)).usages
        try:
            await make(store, rp, consumer)
        except EvstoreError as exc:
            assert exc.code and exc.message, "errors carry a code and a message"
            assert await store.head() == head, "a rejected command leaves no trace"
            assert (await store.usage(rp)).usages == before

    loop.run_until_complete(run())


METHODS = [
    "create_provider",
    "delete_provider",
    "release",
    "start_migration",
    "revert_migration",
    "confirm_migration",
    "delete_consumer",
    "usage",
    "allocations",
    "provider_allocations",
    "usages",
    "create_resource_class",
    "rename_provider",
    "read",
    "replay",
    "position_of",
    "diff",
    "state_at",
    "set_inventory",
    "delete_inventory",
    "head",
]


def positional_arity(method: str) -> tuple[int, int]:
    params = [
        p
        for p in inspect.signature(getattr(AllocationStore, method)).parameters.values()
        if p.name != "self" and p.kind is p.POSITIONAL_OR_KEYWORD
    ]
    required = sum(p.default is p.empty for p in params)
    return required, len(params)


@FUZZ
@given(data=st.data(), method=st.sampled_from(METHODS))
def test_any_values_to_any_method(world: Any, data: st.DataObject, method: str) -> None:
    low, high = positional_arity(method)
    args = data.draw(st.lists(junk, min_size=low, max_size=high))
    call(world, lambda s, rp, c: getattr(s, method)(*args))


@FUZZ
@given(
    consumer=st.one_of(st.uuids().map(str), junk),
    allocs=st.dictionaries(
        st.one_of(st.just("RP"), st.uuids().map(str), hashable_junk),
        st.one_of(st.dictionaries(classes, amounts, max_size=3), junk),
        max_size=3,
    ),
    project=st.one_of(st.just("p"), junk),
    ctype=st.one_of(st.just("INSTANCE"), junk),
    generation=st.one_of(st.none(), st.integers(-3, 3), junk),
)
def test_set_allocations_with_garbage(
    world: Any, consumer: Any, allocs: dict[Any, Any], project: Any, ctype: Any, generation: Any
) -> None:
    def make(s: AllocationStore, rp: str, c: str) -> Any:
        real = {(rp if k == "RP" else k): v for k, v in allocs.items()}
        return s.set_allocations(
            consumer, real, project_id=project, user_id="u", consumer_type=ctype, generation=generation
        )

    call(world, make)


@FUZZ
@given(
    inventories=st.dictionaries(
        st.one_of(classes, hashable_junk),
        st.one_of(
            st.fixed_dictionaries(
                {"total": amounts},
                optional={
                    "reserved": amounts,
                    "min_unit": amounts,
                    "max_unit": amounts,
                    "step_size": amounts,
                    "allocation_ratio": st.one_of(st.floats(allow_nan=True, allow_infinity=True), amounts),
                },
            ),
            junk,
        ),
        max_size=3,
    ),
    generation=st.one_of(st.integers(-2, 5), junk),
)
def test_set_inventories_with_garbage(world: Any, inventories: dict[Any, Any], generation: Any) -> None:
    call(world, lambda s, rp, c: s.set_inventories(rp, inventories, generation))


@FUZZ
@given(
    body=st.dictionaries(
        st.one_of(st.uuids().map(str), hashable_junk),
        st.one_of(
            junk,
            st.dictionaries(
                st.sampled_from(
                    ["allocations", "project_id", "user_id", "consumer_type", "consumer_generation", "extra"]
                ),
                junk,
                max_size=6,
            ),
        ),
        max_size=3,
    )
)
def test_write_allocations_with_garbage(world: Any, body: dict[Any, Any]) -> None:
    call(world, lambda s, rp, c: s.write_allocations(body))


async def test_thousands_of_providers_in_one_command(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    allocs = {str(uuid.uuid4()): {"VCPU": 1} for _ in range(3000)}
    allocs[rp] = {"VCPU": 1}
    head = await store.head()
    with pytest.raises(EvstoreError) as info:
        await allocate(store, new_uuid(), allocs)
    assert info.value.code == "placement.resource_provider.not_found"
    assert await store.head() == head


def test_nan_ratio_is_refused_by_the_model() -> None:
    with pytest.raises(ValueError):
        Inventory(total=1, allocation_ratio=math.nan)


@pytest.mark.parametrize(
    ("sql", "reason"),
    [
        ("UPDATE events SET data = '{not json' WHERE position = 3", "undecodable"),
        ("UPDATE events SET type = 'Teleported' WHERE position = 3", "unknown_type"),
        ("UPDATE events SET schema_version = 99 WHERE position = 3", "unknown_schema_version"),
        ("UPDATE events SET data = '{\"consumer\": 7}' WHERE position = 3", "undecodable"),
    ],
)
async def test_corrupt_rows_fail_reads_by_position_and_are_audited(
    tmp_path: Path, sql: str, reason: str
) -> None:
    url = f"sqlite:///{tmp_path}/corrupt.db"
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    conn = sqlite3.connect(tmp_path / "corrupt.db")
    conn.execute(sql)
    conn.commit()
    conn.close()
    async with open_store(url) as store:
        with pytest.raises(CorruptEvent, match="position 3") as info:
            await store.read(0, 10)
        assert info.value.details["position"] == 3
        assert info.value.details["reason"] == reason
        with pytest.raises(CorruptEvent):
            [e async for e in store.history(c)]
        report = await store.audit()
        assert not report.clean
        integrity = [f for f in report.findings if f.kind == "integrity"]
        assert any(3 in f.positions and f.details.get("reason") == reason for f in integrity)
        assert any(f.details.get("reason") == "hash_chain" and f.positions == (3,) for f in integrity)


@pytest.mark.parametrize(
    "make",
    [
        lambda s: s.read(2**63),  # found by the fuzzer: OverflowError from deep inside sqlite3
        lambda s: s.read(0, 2**64),
        lambda s: s.replay(2**63),
        lambda s: s.replay(-1),
        lambda s: s.state_at(2**70),
        lambda s: s.position_of(2**63),
        lambda s: s.diff(0, 2**63),
        lambda s: s.rebuild(batch_size=0),
        lambda s: s.read(after="3"),
    ],
)
async def test_positions_beyond_what_a_backend_stores_are_bad_input(
    store: AllocationStore, make: Any
) -> None:
    with pytest.raises(EvstoreError) as caught:
        await make(store)
    assert caught.value.code == "evstore.invalid_input"
    assert "2**63-1" in caught.value.message
