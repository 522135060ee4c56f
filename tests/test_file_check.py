"""The SQLite writer's check that its path still names the file it opened (``file_replaced``):
no false alarm for a path SQLite resolves differently from a lexical ``abspath``, and every
write on the writer connection checked, not only commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from evstore import Inventory, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid


@pytest.mark.parametrize("relative", [True, False])
async def test_a_path_through_a_symlink_and_dot_dot_takes_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, relative: bool
) -> None:
    """Regression: ``link/../s.db``, ``link`` a symlink to ``real/sub``, names ``real/s.db`` (the
    kernel and SQLite resolve ``..`` after the link), but the file check compared it with
    ``os.path.abspath``'s lexical ``./s.db``, which does not exist: every command of the store
    failed as ``file_replaced`` ("deleted or moved") from the first one."""
    (tmp_path / "real" / "sub").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    monkeypatch.chdir(tmp_path)
    given = "link/../s.db" if relative else f"{tmp_path}/link/../s.db"
    async with open_store(f"sqlite:///{given}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.head() == 3
    assert (tmp_path / "real" / "s.db").exists() and not (tmp_path / "s.db").exists()


async def test_an_import_into_a_store_whose_file_was_deleted_fails(tmp_path: Path) -> None:
    """Regression: the README says that with the file deleted, moved or replaced "nothing is
    committed until it is put back or the store reopened", but only commands were checked: an
    import (and a rebuild, a snapshot) was acknowledged - "imported 1 events" - into the deleted
    file, and the store reopened at that path was empty."""
    async with open_store(f"sqlite:///{tmp_path / 'a.db'}") as source:
        await make_provider(source, VCPU=Inventory(total=10))
        lines = [line async for line in source.export()]
    path = tmp_path / "b.db"
    async with open_store(f"sqlite:///{path}") as store:
        for suffix in ("", "-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)
        with pytest.raises(StorageError) as caught:
            await store.import_events(lambda: lines)
        assert caught.value.details["sqlite_error"] == "file_replaced"
        with pytest.raises(StorageError) as caught:
            await store.rebuild()
        assert caught.value.details["sqlite_error"] == "file_replaced"
