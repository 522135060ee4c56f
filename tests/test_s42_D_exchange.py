"""import_events' refusals of lines that are no export rows say what they are and what to do
(stop 42, helper D)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evstore import CorruptEvent, InvalidInput, open_store
from tests.conftest import make_provider


async def _export(tmp_path: Path) -> list[str]:
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        await make_provider(source, "a", VCPU=8)
        return [line async for line in source.export()]


async def test_a_row_without_a_field_is_named_by_that_field(tmp_path: Path) -> None:
    """Regression: a line without one of a row's fields - a second header, a row cut by hand - was
    "not an event row ('position')", the bare repr of the KeyError; it names the field missing."""
    lines = await _export(tmp_path)
    row = json.loads(lines[2])
    del row["hash"]
    for bad, field in (([*lines[:1], *lines], "position"), ([*lines[:2], json.dumps(row)], "hash")):
        async with open_store(f"sqlite:///{tmp_path}/{field}.db") as store:
            with pytest.raises(CorruptEvent) as info:
                await store.import_events(lambda bad=bad: bad)  # type: ignore[misc]
            assert f"not an event row (it has no '{field}' field)" in info.value.message
            assert info.value.details["reason"] == "undecodable"
            assert await store.head() == 0


async def test_a_file_opened_in_binary_mode_is_refused_saying_to_open_it_as_text(tmp_path: Path) -> None:
    """Regression: lines of bytes (a file opened ``"rb"``) were refused as "line 1 of the export is a
    bytes, not text", without the argument's name or how to give text."""
    lines = await _export(tmp_path)
    path = tmp_path / "export.jsonl"
    path.write_text("\n".join(lines) + "\n")
    async with open_store(f"sqlite:///{tmp_path}/b.db") as store:
        with pytest.raises(InvalidInput) as info:
            await store.import_events(lambda: path.open("rb"))
        assert info.value.details["field"] == "open_lines"
        assert "line 1 of the export is bytes, not text" in info.value.message
        assert "open the file in text mode" in info.value.message
        assert await store.head() == 0
        assert await store.import_events(lambda: path.open()) == 2  # (as text: imported)


@pytest.mark.parametrize("where", ["header", "row"])
@pytest.mark.parametrize("nested", ["[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000])
async def test_a_line_nested_too_deeply_is_a_corrupt_line_not_a_recursion_error(
    tmp_path: Path, where: str, nested: str
) -> None:
    """Regression: a line of JSON nested deeper than Python's recursion limit - a damaged or
    hostile file - escaped the import as a bare ``RecursionError`` (``evstore import``:
    ``evstore.internal``, "a bug in evstore"); it is the file's fault, named by its line."""
    lines = await _export(tmp_path)
    bad = [nested, *lines[1:]] if where == "header" else [*lines, nested]
    async with open_store(f"sqlite:///{tmp_path}/deep.db") as store:
        with pytest.raises(CorruptEvent) as info:
            await store.import_events(lambda: bad)
        line = 1 if where == "header" else len(bad)
        assert info.value.details["line"] == line
        assert info.value.details["reason"] == ("header" if where == "header" else "undecodable")
        assert "nested too deeply" in info.value.message
        assert await store.head() == 0


def test_evstore_import_of_a_line_nested_too_deeply_says_which_line(tmp_path: Path) -> None:
    import asyncio

    from tests.test_cli_support import evstore

    lines = asyncio.run(_export(tmp_path))
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([*lines, "[" * 100_000 + "]" * 100_000]) + "\n")
    done = evstore("import", str(path), "--db", str(tmp_path / "target.db"))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: evstore.log.corrupt: line 4: not an event row"), done.stderr
    assert "nested too deeply" in done.stderr
    assert not (tmp_path / "target.db").exists()
