"""Stop 43, helper D: metadata a command refuses says where in it the problem is.

A value JSON cannot hold (a set, a ``Decimal``, a ``uuid.UUID``, bytes, NaN, an int of 5,000
digits, a mapping that is not a dict) was refused as "metadata values must be JSON-serialisable"
without naming it or where it was. The message now names the place (the keys down to it) and the
type found, on ``metadata=`` and ``command_metadata`` alike, nothing written.

``details["path"]`` (README: for a problem inside an argument) names the place for these too, and
for a key that is no string at the top (the lead, after helper D's strict xfails)."""

from __future__ import annotations

import decimal
import types
import uuid
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput, command_metadata
from tests.conftest import new_uuid


@pytest.mark.parametrize(
    ("metadata", "path", "named"),
    [
        ({"tags": {1, 2}}, ["metadata", "tags"], "set"),
        ({"cost": decimal.Decimal("1.5")}, ["metadata", "cost"], "Decimal"),
        ({"x": {"y": [1, uuid.UUID(int=1)]}}, ["metadata", "x", "y", "1"], "UUID"),
        ({"raw": b"x"}, ["metadata", "raw"], "bytes"),
        ({"ratio": float("nan")}, ["metadata", "ratio"], "nan"),
        ({"n": [0, 10**5000]}, ["metadata", "n", "1"], "int"),
        ({"m": types.MappingProxyType({"a": 1})}, ["metadata", "m"], "mappingproxy"),
    ],
    ids=["set", "decimal", "uuid", "bytes", "nan", "huge-int", "mappingproxy"],
)
async def test_a_value_json_cannot_hold_is_named_with_where_it_is(
    store: AllocationStore, metadata: dict[str, Any], path: list[str], named: str
) -> None:
    head = await store.head()
    with pytest.raises(InvalidInput, match="JSON") as caught:
        await store.delete_consumer(new_uuid(), metadata=metadata)
    assert caught.value.code == "evstore.invalid_input" and caught.value.details["field"] == "metadata"
    assert ".".join(path[1:]) in caught.value.message and named in caught.value.message
    with pytest.raises(InvalidInput, match="JSON") as caught:
        command_metadata(**metadata)
    assert ".".join(path[1:]) in caught.value.message and named in caught.value.message
    assert await store.head() == head


async def test_a_value_json_cannot_hold_has_its_path_in_details(store: AllocationStore) -> None:
    with pytest.raises(InvalidInput) as caught:
        await store.delete_consumer(new_uuid(), metadata={"x": {"y": [1, uuid.UUID(int=1)]}})
    assert caught.value.details.get("path") == ["metadata", "x", "y", "1"]


async def test_a_top_level_key_that_is_no_string_has_its_path(store: AllocationStore) -> None:
    head = await store.head()
    with pytest.raises(InvalidInput, match="metadata keys must be strings") as caught:
        await store.delete_consumer(new_uuid(), metadata={1: "x"})  # type: ignore[dict-item]
    assert caught.value.details["field"] == "metadata" and caught.value.details["path"] == ["metadata", "1"]
    assert await store.head() == head
