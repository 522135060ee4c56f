"""Stop 48, probe P's findings on messages and value types (each test failed before its fix):

- F1: ``write_allocations`` and ``ConsumerAllocations`` refusals carried pydantic's wording ("Value
  error, ...", "String should have at least 1 character") where ``set_allocations`` gives evstore's
  own sentence for the same mistake;
- F2: an integer in metadata past Python's int-to-text limit was refused as "an integer of more
  than 40 digits", while integers of 41 to 4,300 digits are accepted;
- F6: assigning to a field of an ``Inventory``, a ``ConsumerAllocations`` or a ``Metadata`` raised pydantic's
  ``ValidationError``; the frozen dataclasses evstore answers raise ``FrozenInstanceError``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from evstore import ConsumerAllocations, InvalidInput, Inventory, Metadata, open_store
from tests.conftest import make_provider, new_uuid

PYDANTIC_WORDS = ("Value error", "String should", "should match pattern", "Input should")


def _entry(**fields: Any) -> dict[str, Any]:
    return {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE", **fields}


@pytest.mark.parametrize(
    ("fields", "said", "field"),
    [
        (
            {"allocations": {"RP": {"VCPU": 0}}},
            "allocations: Amount of VCPU must be between 1 and 2**63-1, got 0",
            "allocations",
        ),
        (
            {"allocations": {"nope": {"VCPU": 1}}},
            "allocations: Malformed provider uuid: 'nope' is not a UUID",
            "allocations",
        ),
        (
            {"allocations": {}, "project_id": ""},
            "project_id must be a string of 1..255 characters, got ''",
            "project_id",
        ),
        (
            {"allocations": {}, "user_id": 5},
            "user_id must be a string of 1..255 characters, got 5",
            "user_id",
        ),
        (
            {"allocations": {}, "consumer_type": "vm"},
            "consumer_type must match ^[A-Z0-9_]+$ (at most 255 characters), got 'vm'",
            "consumer_type",
        ),
    ],
)
async def test_write_allocations_refuses_in_evstores_words(
    store_url: str, fields: dict[str, Any], said: str, field: str
) -> None:
    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=8)
        fields = {
            **fields,
            "allocations": {rp if k == "RP" else k: v for k, v in fields["allocations"].items()},
        }
        c = new_uuid()
        with pytest.raises(InvalidInput) as info:
            await store.write_allocations({c: _entry(**fields)})
        message = info.value.message
        assert message == f"Invalid allocations for consumer {c}: {said}"
        assert not any(words in message for words in PYDANTIC_WORDS), message
        assert info.value.details["field"] == "allocations"
        assert info.value.details["path"][:3] == ["allocations", c, field]
        with pytest.raises(InvalidInput) as direct:
            ConsumerAllocations(**_entry(**fields))
        assert direct.value.message == f"Invalid consumer allocations: {said}"
        assert await store.head() == 2


async def test_set_allocations_and_write_allocations_say_the_same_of_an_empty_project(store_url: str) -> None:
    async with open_store(store_url) as store:
        rp = await make_provider(store, "rp", VCPU=8)
        with pytest.raises(InvalidInput) as by_set:
            await store.set_allocations(
                new_uuid(), {rp: {"VCPU": 1}}, project_id="", user_id="u", consumer_type="I", generation=None
            )
        with pytest.raises(InvalidInput) as by_write:
            await store.write_allocations({new_uuid(): _entry(allocations={rp: {"VCPU": 1}}, project_id="")})
        assert by_write.value.message.endswith(by_set.value.message)


async def test_a_metadata_integer_past_pythons_digit_limit_is_named_by_that_limit(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.create_provider(new_uuid(), "a", metadata={"x": 10**100})  # (101 digits: accepted)
        with pytest.raises(InvalidInput) as info:
            await store.create_provider(new_uuid(), "b", metadata={"x": 10**4300})
        assert "x is an integer of more than 4300 digits (int)" in info.value.message
        assert "40 digits" not in info.value.message
        assert await store.head() == 1


@pytest.mark.parametrize(
    ("value", "field"),
    [
        (Inventory(total=4), "total"),
        (ConsumerAllocations(allocations={}, project_id="p", user_id="u", consumer_type="I"), "project_id"),
        (Metadata(request_id="r", mine="x"), "request_id"),
        (Metadata(request_id="r", mine="x"), "mine"),
    ],
)
def test_assigning_to_a_value_type_raises_pythons_frozen_error(value: Any, field: str) -> None:
    before = getattr(value, field)
    with pytest.raises(dataclasses.FrozenInstanceError, match=f"cannot assign to field '{field}'"):
        setattr(value, field, before)
    with pytest.raises(AttributeError):
        delattr(value, field)
    assert getattr(value, field) == before
    # (copies and pickles still work: they do not assign)
    import copy
    import pickle

    assert copy.deepcopy(value) == value == pickle.loads(pickle.dumps(value))
    assert value.model_copy(update={field: before}) == value
