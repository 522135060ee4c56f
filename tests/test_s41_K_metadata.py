"""Stop 41, helper K: ``evstore.Metadata(...)`` refuses when built what a command would refuse."""

from __future__ import annotations

import math
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput, Metadata, command_metadata, open_store
from tests.conftest import make_provider, new_uuid

_DEEP: list[Any] = []
for _ in range(300):
    _DEEP = [_DEEP]

REFUSED_BY_A_COMMAND = {
    "a_nested_key_not_a_string": {"tenant": {"zone": {1: "a"}}},
    "a_key_not_a_string_in_a_list": {"hosts": [{None: "a"}]},
    "nan": {"score": math.nan},
    "infinity": {"score": [1, math.inf]},
    "not_json": {"when": object()},
    "70_kib": {"doc": "x" * 70 * 1024},
    # (11,000 characters, each written by JSON as 6: \u0001)
    "control_characters_over_64_kib_as_json": {"doc": "\x01" * 11_000},
    "a_long_key": {"k" * 66_000: "v"},
    "a_lone_surrogate": {"note": "a\ud800"},
    "a_lone_surrogate_key": {"tenant": {"\udc80": 1}},
    "too_deep": {"deep": _DEEP},
}


async def _refusal(store: AllocationStore, rp: str, metadata: Any) -> InvalidInput:
    with pytest.raises(InvalidInput) as caught:
        await store.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            metadata=metadata,
        )
    return caught.value


@pytest.mark.parametrize("given", list(REFUSED_BY_A_COMMAND.values()), ids=list(REFUSED_BY_A_COMMAND))
async def test_metadata_refuses_when_built_what_a_command_refuses(sqlite_url: str, given: Any) -> None:
    """Finding (stop 41, helper K): ``evstore.Metadata`` (public: exported, what a command's
    ``metadata=`` takes besides a mapping, and what it says in its refusal) built without a word
    from values every command then refuses - a key that is not a string inside a mapping, NaN or
    Infinity, a value that is not JSON, 70 KiB of JSON, a lone surrogate, 300 levels of lists -
    so the mistake surfaced at the first command, far from where it was made, where
    ``command_metadata(...)`` refuses the same values at once. Now building it refuses them, with
    the command's code, message and details; nothing is written by the command either."""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
        by_command = await _refusal(store, rp, {"request_id": "req-1", **given})
        assert await store.head() == head
    with pytest.raises(InvalidInput) as built:
        Metadata(request_id="req-1", **given)
    with pytest.raises(InvalidInput) as in_context:
        with command_metadata(request_id="req-1", **given):
            pass
    for refused in (built.value, in_context.value):
        assert (refused.code, refused.message, refused.details) == (
            by_command.code,
            by_command.message,
            by_command.details,
        )


def test_metadata_still_builds_what_a_command_takes() -> None:
    """What a command takes still builds as before: a caller's keys of any JSON value, a value
    of evstore's own keys (a command replaces them: not checked), ``None`` for a key; and
    ``Metadata(request_id=5)`` is refused as before, naming the field."""
    built = Metadata(
        request_id="req-1",
        actor=None,
        tenant={"zone": 3, "tags": ["a", None, 1.5, True]},
        doc="x" * 60 * 1024,
        command_id="c" * 70_000,  # (a command replaces it)
    )
    assert built.model_dump(exclude_none=True)["tenant"] == {"zone": 3, "tags": ["a", None, 1.5, True]}
    assert built.command_id == "c" * 70_000 and built.actor is None
    assert Metadata().model_dump(exclude_none=True) == {}
    assert Metadata(note="\x01" * 10_000).model_dump()["note"] == "\x01" * 10_000  # (60,000 bytes as JSON)
    with pytest.raises(InvalidInput) as caught:
        Metadata(request_id=5)
    assert caught.value.details["field"] == "request_id"
