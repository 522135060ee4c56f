"""Stop 43, helper I: an import into a store in memory is refused (it kept nothing)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``evstore ARGS`` run by ``cli.main`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


def _small_store(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})

    asyncio.run(build())


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite://?busy_timeout=5"])
def test_an_import_into_a_store_in_memory_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, url: str
) -> None:
    """``evstore import FILE --url sqlite://`` said "imported N events", exit 0, into a store gone
    as the command ended. Every other command that writes already refuses a store in memory
    (it holds no store to open); the demo, whose report is its work, keeps running there."""
    db = tmp_path / "s.db"
    _small_store(db)
    export = tmp_path / "e.jsonl"
    assert _in_process(capsys, "export", "--db", str(db), "-o", str(export))[0] == 0
    code, out, err = _in_process(capsys, "import", str(export), "--url", url)
    assert (code, out) == (1, "")
    assert err == (
        f"error: evstore.invalid_input: {url} is a store in memory, gone when the command ends: an import "
        "into it keeps nothing; import into a database file (--db PATH) or a PostgreSQL schema\n"
    )
    # (into a file, the same export imports)
    code, out, err = _in_process(capsys, "import", str(export), "--db", str(tmp_path / "copy.db"))
    assert code == 0 and out.startswith("imported "), err
