"""Stop 41, helper A: the command side through the public API.

A malformed argument is ``InvalidInput``, "refused before the command is queued" (README). Four
refusals that need no state - an instance that is its own migration, a provider that is its own
parent, a custom class name that is no custom class, one consumer named twice in a
``write_allocations`` - were made by the writer's ``decide``: the command was queued behind
whatever the writer was doing, so with another process holding SQLite's write lock the caller
got ``StorageError`` (busy: "retry") after ``busy_timeout`` - 30 s by default - and a closed store
answered ``StoreClosed``, for an argument that no retry can make valid.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable

import pytest

from evstore import AllocationStore, ConsumerAllocations, InvalidInput, Inventory, open_store
from tests.conftest import new_uuid

OWNER = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
SAME = new_uuid()

#: each call, its InvalidInput's ``field``, and a piece of its message
MALFORMED: dict[str, tuple[Callable[[AllocationStore], Awaitable[object]], str, str]] = {
    "an instance that is its own migration": (
        lambda s: s.start_migration(SAME, SAME.upper()),
        "migration",
        "instance and migration must be different consumers",
    ),
    "a provider that is its own parent": (
        lambda s: s.create_provider(SAME, "self", parent=SAME.upper()),
        "parent",
        "cannot be same as UUID",
    ),
    "a standard class given as a custom one": (
        lambda s: s.create_resource_class("VCPU"),
        "name",
        "Custom resource classes must be CUSTOM_ followed by",
    ),
    "the prefix alone as a custom class": (
        lambda s: s.create_resource_class("CUSTOM_"),
        "name",
        "Custom resource classes must be CUSTOM_ followed by",
    ),
    "one consumer twice, in two spellings": (
        lambda s: s.write_allocations(
            {SAME: {"allocations": {}, **OWNER}, SAME.upper(): {"allocations": {}, **OWNER}}
        ),
        "allocations",
        "appears twice in one command",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_malformed_argument_is_refused_while_another_process_holds_the_write_lock(
    sqlite_url: str, case: str
) -> None:
    call, field, said = MALFORMED[case]
    async with open_store(sqlite_url, busy_timeout=0) as store:
        await store.create_provider(new_uuid(), "a provider")  # (the file exists, WAL on)
        holder = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # another process's write in progress
            with pytest.raises(InvalidInput, match=said) as refused:
                await call(store)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        assert refused.value.code == "evstore.invalid_input"
        assert refused.value.details["field"] == field
        assert await store.head() == 1  # nothing written


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_malformed_argument_is_refused_as_such_by_a_closed_store(store_url: str, case: str) -> None:
    call, field, said = MALFORMED[case]
    store = await open_store(store_url)
    await store.close()
    with pytest.raises(InvalidInput, match=said) as refused:
        await call(store)
    assert refused.value.details["field"] == field


# --- the value types' pydantic constructors (helper A's finding in schema.py, fixed by the lead) ----


INVENTORY_CODE, INPUT_CODE = "evstore.inventory.invalid", "evstore.invalid_input"


@pytest.mark.parametrize(
    ("build", "code", "field"),
    [
        (lambda: Inventory.model_validate({"total": 0}), INVENTORY_CODE, "total"),
        (lambda: Inventory.model_validate_json('{"total": "eight"}'), INVENTORY_CODE, "total"),
        (lambda: Inventory.model_validate_strings({"total": "8"}), INVENTORY_CODE, "total"),  # (strict)
        (
            lambda: ConsumerAllocations.model_validate({"allocations": {}, "project_id": "p"}),
            INPUT_CODE,
            "user_id",
        ),
        (
            lambda: ConsumerAllocations.model_validate_json('{"allocations": {"x": {}}}'),
            INPUT_CODE,
            "allocations",
        ),
    ],
    ids=[
        "Inventory.model_validate",
        "Inventory.model_validate_json",
        "Inventory.model_validate_strings",
        "ConsumerAllocations.model_validate",
        "ConsumerAllocations.model_validate_json",
    ],
)
def test_the_value_types_classmethods_refuse_as_invalid_input(
    build: Callable[[], object], code: str, field: str
) -> None:
    with pytest.raises(InvalidInput) as refused:
        build()
    assert (
        refused.value.code == code
    )  # (the code a call of the type gives: Inventory(total=0)'s is the first)
    assert refused.value.details["field"] == field
    assert "Value error, Invalid" not in str(
        refused.value
    )  # (not pydantic's wrapping of the type's own refusal)


def test_the_value_types_classmethods_still_build_what_the_call_builds() -> None:
    assert Inventory.model_validate({"total": 8, "reserved": 1}) == Inventory(total=8, reserved=1)
    assert Inventory.model_validate_json('{"total": 8}') == Inventory(total=8)
    owner = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}
    assert ConsumerAllocations.model_validate({"allocations": {}, **owner}) == ConsumerAllocations(
        allocations={}, **owner
    )
