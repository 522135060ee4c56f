"""The SQLite writer's check that its path still names the file it opened (``file_replaced``):
no false alarm for a path SQLite resolves differently from a lexical ``abspath``, and every
write on the writer connection checked, not only commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from evstore import Inventory, open_store
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
