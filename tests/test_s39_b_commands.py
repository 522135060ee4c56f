"""The command side under a demanding caller's input (stop 39, helper B): what the embedded API
takes, refuses and records, on every backend."""

from __future__ import annotations

import json
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput, command_metadata
from tests.conftest import new_uuid

#: ``{"note":"..."}``: the JSON text of ``{"note": "x" * n}`` takes n + 11 bytes
_NOTE_OVERHEAD = len(json.dumps({"note": ""}, separators=(",", ":")))


async def test_metadata_bound_is_the_callers_64_kib_on_every_path(store: AllocationStore) -> None:
    """At most 64 KiB of the caller's JSON per command, as the README says, whether given as
    ``metadata=`` or by ``command_metadata``, and the refusal counts the caller's bytes.

    Regression: ``metadata=`` was measured with evstore's own keys (the command's name and id, an
    idempotency key) and a room of 4,096 bytes for them, so up to ~69.5 KiB of the caller's JSON
    was accepted there while ``command_metadata`` refused anything past 65,536 bytes - the same
    metadata accepted or refused by where it was given - and the refusal's size counted evstore's
    keys as the caller's."""
    head = await store.head()
    at_most = {"note": "x" * (65_536 - _NOTE_OVERHEAD)}
    over = {"note": "x" * (65_537 - _NOTE_OVERHEAD)}
    # (the caller's bytes, as stored: compact JSON)
    assert len(json.dumps(at_most, separators=(",", ":"))) == 65_536
    with pytest.raises(InvalidInput) as caught:
        await store.delete_consumer(new_uuid(), metadata=over)
    assert caught.value.details["field"] == "metadata"
    assert "65,537 bytes of JSON, at most 65,536" in str(caught.value)
    with pytest.raises(InvalidInput, match="65,537 bytes of JSON, at most 65,536"), command_metadata(**over):
        pass
    with pytest.raises(InvalidInput, match="65,537 bytes"):
        await store.delete_consumer(new_uuid(), metadata=over, idempotency_key="k" * 255)
    assert await store.head() == head  # nothing written
    # the largest accepted on both paths, with the longest idempotency key too
    receipt = await store.delete_consumer(new_uuid(), metadata=at_most, idempotency_key="\U0001f600" * 255)
    with command_metadata(**at_most):
        receipt2 = await store.delete_consumer(new_uuid(), idempotency_key="k" * 255)
    for r in (receipt, receipt2):
        [event] = await store.read(after=r.position - 1, limit=1)
        assert event.to_dict()["metadata"]["note"] == at_most["note"]


@pytest.mark.parametrize(
    ("metadata", "path"),
    [
        ({"tags": {1: "a"}}, ["metadata", "tags", "1"]),
        ({"tags": {1: "a", "1": "b"}}, ["metadata", "tags", "1"]),  # (JSON: the key "1" twice)
        ({"tags": {1: "a", "b": "c"}}, ["metadata", "tags", "1"]),  # (sorting them failed)
        ({"tags": [{"ok": {None: 1}}]}, ["metadata", "tags", "0", "ok", "None"]),
        ({"request_id": "r", "x": {"y": {2.5: True}}}, ["metadata", "x", "y", "2.5"]),
    ],
)
async def test_metadata_keys_are_strings_at_every_depth(
    store: AllocationStore, metadata: dict[str, Any], path: list[str]
) -> None:
    """A mapping key that is not a string is refused inside the metadata as it is at its top, with
    the path to it, on ``metadata=`` and ``command_metadata`` alike.

    Regression: only the top level's keys were checked; below it JSON wrote ``1`` as ``"1"`` and
    ``None`` as ``"null"``, so the log held other keys than the caller's (``{1: "a", "1": "b"}``
    stored a JSON object with the key ``"1"`` twice), and a mapping mixing strings and numbers as
    keys was refused as "values must be JSON-serialisable", naming nothing."""
    head = await store.head()
    with pytest.raises(InvalidInput, match="metadata keys must be strings") as caught:
        await store.delete_consumer(new_uuid(), metadata=metadata)
    assert caught.value.code == "evstore.invalid_input"
    assert caught.value.details["field"] == "metadata"
    assert caught.value.details["path"] == path
    with pytest.raises(InvalidInput, match="metadata keys must be strings") as caught:
        with command_metadata(**metadata):
            pass
    assert caught.value.details["path"] == path
    assert await store.head() == head
