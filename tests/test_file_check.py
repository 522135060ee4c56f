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


async def test_a_file_uri_path_opens_and_takes_commands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: SQLite built with URI filenames on (Debian's, and this one) opens
    ``sqlite:///file:s.db`` as ``s.db``; the file check's ``os.stat('file:s.db')`` at open raised
    a bare FileNotFoundError, so the open failed (it opened before the check). The check follows
    the file SQLite names when the given path does not name it."""
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///file:s.db", create=True) as store:
        await make_provider(store, VCPU=Inventory(total=10))
        assert await store.head() == 2


async def test_a_symlink_swapped_to_another_file_is_noticed(tmp_path: Path) -> None:
    """The check follows the path as given when it names the opened file (not SQLite's name, the
    link's target): a symlink swapped to another database - a restore by link swap - leaves this
    store writing to the old file, so its commands fail as they do for a replaced file."""
    for name in ("a.db", "b.db"):
        async with open_store(f"sqlite:///{tmp_path / name}") as other:
            await make_provider(other, VCPU=Inventory(total=1))
    link = tmp_path / "s.db"
    link.symlink_to(tmp_path / "a.db")
    async with open_store(f"sqlite:///{link}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        (tmp_path / "next").symlink_to(tmp_path / "b.db")
        (tmp_path / "next").replace(link)
        with pytest.raises(StorageError) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert caught.value.details["sqlite_error"] == "file_replaced"


async def test_a_file_that_cannot_be_looked_up_is_not_said_to_be_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: any error of the check's ``os.stat`` was reported as the file "deleted or
    moved" - also one that says nothing of the kind (permission denied on a directory of the path,
    an I/O error): the command still fails, nothing committed, as it cannot be checked, and the
    message says why."""
    import os

    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        stat = os.stat

        def denied(name: object, *args: object, **kwargs: object) -> os.stat_result:
            if str(name) == str(path):
                raise PermissionError(13, "Permission denied", str(name))
            return stat(name, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "stat", denied)
        with pytest.raises(StorageError) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        monkeypatch.undo()
        assert "deleted or moved" not in caught.value.message
        assert "Permission denied" in caught.value.message and "nothing was committed" in caught.value.message
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.head() == 3


async def test_a_path_that_is_not_utf8_opens_and_is_checked(tmp_path: Path) -> None:
    """Regression: a directory named in Latin-1 (``caf\\xe9``: not UTF-8) could not hold a store -
    the file check read SQLite's name for the file as UTF-8 text, and every open failed with
    ``StorageError: Could not decode to UTF-8 column 'file'``. The file check still works there:
    the file deleted under the open store is noticed."""
    import os

    odd = os.path.join(os.fsencode(tmp_path), b"caf\xe9")
    os.mkdir(odd)
    path = os.fsdecode(os.path.join(odd, b"s.db"))
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        assert await store.head() == 2
        os.replace(path, path + ".moved")
        with pytest.raises(StorageError) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert caught.value.details.get("sqlite_error") == "file_replaced"
        os.replace(path + ".moved", path)
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 2 and (await store.audit()).clean


@pytest.mark.parametrize("deleted", [("-wal", "-shm"), ("-wal",), ("-shm",)])
async def test_a_write_ahead_log_deleted_under_the_store_is_noticed(
    tmp_path: Path, deleted: tuple[str, ...]
) -> None:
    """Regression (session 37): only the database file was checked, not the -wal and -shm files
    beside it, which hold the commits not yet copied into it and the lock every process writing
    the file takes. With them deleted (a clean-up of "temporary" files) a store went on
    acknowledging commands into a log no other process could see: a process opening the file then
    read the store as it was before the log (an empty store: head 0, audit clean) and could decide
    against it - a tombstone it did not see - with a log and lock of its own, racing this one's.
    Such a command now fails as ``file_replaced``, nothing committed; what the log held before
    is not lost: the store's close copies it into the database file."""
    import os

    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        for suffix in deleted:
            os.unlink(f"{path}{suffix}")
        with pytest.raises(StorageError) as caught:
            await store.delete_consumer(consumer)
        assert caught.value.details["sqlite_error"] == "file_replaced"
        assert f"{path}{deleted[0]}" in caught.value.message
        assert "nothing was committed" in caught.value.message
        with pytest.raises(StorageError) as caught:  # (every write on the writer connection)
            await store.rebuild()
        assert caught.value.details["sqlite_error"] == "file_replaced"
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == 3
        assert (await store.allocations(consumer)).allocations == {rp: {"VCPU": 1}}
        assert (await store.audit()).clean
        await store.delete_consumer(consumer)  # (a store opened again has files of its own)


async def test_a_write_ahead_log_beside_a_symlinks_target_is_checked(tmp_path: Path) -> None:
    """SQLite keeps the -wal and -shm files beside the file a symlink names, not beside the link:
    those are the files checked (none beside the link, which nothing would have noticed)."""
    import os

    (tmp_path / "real").mkdir()
    link = tmp_path / "s.db"
    link.symlink_to(tmp_path / "real" / "s.db")
    async with open_store(f"sqlite:///{link}") as store:
        rp = await make_provider(store, VCPU=Inventory(total=10))
        assert not os.path.exists(f"{link}-wal")
        os.unlink(tmp_path / "real" / "s.db-wal")
        with pytest.raises(StorageError) as caught:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert caught.value.details["sqlite_error"] == "file_replaced"
        assert str(tmp_path / "real" / "s.db-wal") in caught.value.message


async def test_a_store_file_this_process_may_not_read_is_no_missing_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (stop 37, operator sweep): ``evstore audit --db FILE`` on a store file the user
    may not read (mode 000, another user's) said ``evstore.not_found`` "No evstore store in FILE:
    the file cannot be read ... (check the path, or create a store)": the read-only look for a store
    took a file it could not open for a missing one. Now the open says why it cannot open it,
    ``evstore.storage``. (SQLite's refusal is simulated: these tests run as root too, whom file
    permissions do not stop.)"""
    import sqlite3

    from evstore import NotFound

    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=Inventory(total=10))
    connect = sqlite3.connect

    def unreadable(database: object, *args: object, **kwargs: object) -> sqlite3.Connection:
        if str(path) in str(database):
            raise sqlite3.OperationalError("unable to open database file")
        return connect(database, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(sqlite3, "connect", unreadable)
    for upgrade in (True, False):
        with pytest.raises(StorageError) as caught:
            async with open_store(f"sqlite:///{path}", create=False, upgrade=upgrade):
                pass
        assert not isinstance(caught.value, NotFound)
        assert "unable to open database file" in caught.value.message
    monkeypatch.undo()
    with pytest.raises(NotFound):  # (a missing file still is one)
        async with open_store(f"sqlite:///{tmp_path / 'missing.db'}", create=False):
            pass
    async with open_store(f"sqlite:///{path}", create=False) as store:
        assert await store.head() == 2
