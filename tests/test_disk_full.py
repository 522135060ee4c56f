"""A disk that fills up (here: a file size limit, RLIMIT_FSIZE, on the process) while evstore writes
a store: the caller hears that the disk is full, as a typed error, and nothing is left half done."""

from __future__ import annotations

import asyncio
import resource
import sqlite3
import subprocess
import sys
from pathlib import Path

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid

ROOT = Path(__file__).resolve().parent.parent


def _evstore_limited(limit: int, *args: str) -> subprocess.CompletedProcess[str]:
    """``evstore ARGS`` in a process that may not write any file past ``limit`` bytes (a write
    there fails with EFBIG, which SQLite reports as a full disk; Python ignores SIGXFSZ)."""

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run(
        [sys.executable, "-m", "evstore.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=limit_files,
        check=False,
    )


async def _store_with_consumers(path: Path, consumers: int) -> str:
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, "rp", VCPU=100_000)
        await asyncio.gather(*(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(consumers)))
        return rp


async def test_an_import_that_fills_the_disk_says_so_and_leaves_nothing(tmp_path: Path) -> None:
    """Regression (helper-75): SQLite rolls a transaction back itself when the disk is full, and
    the import's own ROLLBACK then failed, so the caller read 'cannot rollback - no transaction
    is active' instead of why the import failed."""
    await _store_with_consumers(tmp_path / "source.db", 1500)
    export = tmp_path / "export.jsonl"
    async with open_store(f"sqlite:///{tmp_path / 'source.db'}") as source:
        export.write_text("".join([line + "\n" async for line in source.export()]))
    target = tmp_path / "target.db"
    done = _evstore_limited(256 * 1024, "import", str(export), "--db", str(target))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.storage: "), done.stderr
    assert "disk is full" in done.stderr or "disk I/O error" in done.stderr, done.stderr
    assert not target.exists()  # (a file the import created is removed when it fails)


async def test_an_upgrade_that_fills_the_disk_says_so_and_leaves_the_store_as_it_was(tmp_path: Path) -> None:
    """The same when opening a store of schema version 2 refolds its projection (the upgrade):
    SQLite's error, not the failed ROLLBACK's; the store stays at version 2, and upgrades
    once there is room."""
    path = tmp_path / "v2.db"
    rp = await _store_with_consumers(path, 3000)
    conn = sqlite3.connect(path)
    with conn:  # what version 2 wrote
        conn.execute("ALTER TABLE p_consumers DROP COLUMN instance_type")
        conn.execute("UPDATE meta SET value = '2' WHERE key = 'schema_version'")
    conn.execute("VACUUM")
    conn.close()
    done = _evstore_limited(64 * 1024, "upgrade", "--db", str(path))  # (stats refuses an older store)
    assert done.returncode == 1, done.stdout + done.stderr
    error = done.stderr.splitlines()[-1]  # (after the upgrade's warning that it refolds)
    assert error.startswith("error: evstore.storage: "), done.stderr
    # (a write past the limit fails with EFBIG, which SQLite reports as an I/O error here)
    assert "disk is full" in error or "disk I/O error" in error, done.stderr
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone() == ("2",)
    conn.close()
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.usage(rp))["VCPU"] == 3000
        assert (await store.audit()).clean
