"""The JSON texts evstore stores - each command's metadata, the projection's counters and holdings -
are ``json.dumps(value, separators=(",", ":"), sort_keys=True)``'s, whichever encoder wrote them
(msgspec for the common values, json for the rest): a rebuild compares rows by their text, and
an event's hash covers its metadata's."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from evstore import Inventory, open_store
from evstore.events import sorted_json
from evstore.store import _metadata_json
from projections import persisted
from tests.conftest import make_provider, new_uuid


def _json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


_ASCII = st.text(st.characters(max_codepoint=0x7E))  # (DEL, 0x7f, json escapes and msgspec does not)
_ANY_TEXT = st.text()
_INTS = st.integers(min_value=-(2**70), max_value=2**70)


def _values(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
    return st.recursive(
        st.none() | st.booleans() | _INTS | text,
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
        max_leaves=20,
    )


@settings(max_examples=1500, deadline=None)
@given(_values(_ANY_TEXT))
def test_sorted_json_writes_jsons_text_or_says_it_cannot(value: Any) -> None:
    text = sorted_json(value)
    assert text is None or text == _json(value)


@settings(max_examples=500, deadline=None)
@given(_values(_ASCII))
def test_sorted_json_takes_every_ascii_value(value: Any) -> None:
    assert sorted_json(value) == _json(value)


def test_sorted_json_leaves_del_non_ascii_and_odd_types_to_json() -> None:
    class Name(str):
        pass

    for value in ({"a": "\x7f"}, {"é": 1}, ["\u2603"], {"x": "\ud800"}, {"a": Name("b")}):
        assert sorted_json(value) is None, value
    assert sorted_json({Name("a"): 1}) == '{"a":1}'  # (a key's subclass is written as json writes it)


def test_metadata_text_is_jsons_for_strings_and_for_anything_else() -> None:
    for meta in (
        {"command": "Release", "command_id": "0" * 32},
        {"command": "Release", "request_id": "req-\u00e9t\u00e9", "actor": "nova\x7f"},
        {"command": "Release", "x": 1.5, "y": [1, {"b": None, "a": True}], "z": 10**30},
    ):
        assert _metadata_json(meta, check=True) == json.dumps(
            meta, separators=(",", ":"), sort_keys=True, allow_nan=False
        )


def test_row_texts_are_jsons() -> None:
    holdings = {"VCPU": 2, "MEMORY_MB": 2048, "CUSTOM_X_1": 1}
    counters: persisted.UserCounters = {"MIGRATION": (1, {"VCPU": 2}), "": (3, holdings), "INSTANCE": (0, {})}
    assert persisted.resources_json(holdings) == _json(holdings)
    assert persisted.usages_json(holdings) == _json(holdings)
    rows = [[t, n, a] for t, (n, a) in sorted(counters.items())]
    assert persisted.user_counters_json(counters) == _json(rows)


async def test_a_stores_metadata_and_projection_rows_hold_jsons_texts(tmp_path: Path) -> None:
    path = tmp_path / "evstore.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=16, MEMORY_MB=Inventory(total=4096, step_size=256))
        await store.create_resource_class("CUSTOM_GPU")
        await store.set_inventory(rp, "CUSTOM_GPU", Inventory(total=4), 1)
        for i, meta in enumerate(({"request_id": "req-1"}, {"request_id": "r\u00e9q", "n": 1.5}, None)):
            await store.set_allocations(
                new_uuid(),
                {rp: {"VCPU": 1 + i, "MEMORY_MB": 256, "CUSTOM_GPU": 1}},
                project_id=f"proj-{i % 2}",
                user_id="\u00fcser" if i else "user",
                consumer_type="INSTANCE",
                generation=None,
                metadata=meta,
            )
    with sqlite3.connect(path) as conn:
        texts = [r[0] for r in conn.execute("SELECT metadata FROM events")]
        texts += [r[0] for r in conn.execute("SELECT resources FROM p_allocations")]
        texts += [r[0] for r in conn.execute("SELECT counters FROM p_usages")]
        texts += [r[0] for r in conn.execute("SELECT usages FROM p_providers")]
    assert len(texts) == 7 + 3 + 3 + 1
    for text in texts:
        assert text == _json(json.loads(text))
    assert any("\\u00e9" in text for text in texts)  # (json's escape: the one non-ASCII request id)
