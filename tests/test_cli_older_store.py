"""The commands that only read leave a store an older evstore wrote as it is; ``evstore upgrade``
upgrades it.

Regression (session 33, helper B; known since earlier reviews): ``evstore audit`` / ``history`` /
``state`` / ``diff`` / ``tail`` / ``stats`` / ``export`` on a SQLite store of an older schema
version opened it as every open does, which upgrades it: the file was rewritten and closed to the
older evstore processes still using it, by a debugging command. They now refuse it, with
``evstore.schema.version`` and what to run, and write nothing: they open with ``upgrade=False``,
an option of ``open_store`` (PostgreSQL's side: test_postgres).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from evstore import InvalidInput, SchemaVersionError, open_store
from evstore.log.sqlite import SCHEMA_VERSION
from tests.test_cli_support import demo_db, evstore

READ_ONLY = [
    ["audit"],
    ["audit", "--history"],
    ["stats"],
    ["export"],
    ["state"],
    ["state", "--at", "3"],
    ["diff", "1", "3"],
    ["history", "6c3e1a2e-3c2b-4c55-9d47-000000000001"],
    ["tail", "--no-follow"],
]


def _version(db: Path) -> str:
    conn = sqlite3.connect(db)
    try:
        return str(conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()[0])
    finally:
        conn.close()


@pytest.fixture(scope="module")
def older_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo store whose meta says schema version 4: what every open upgrades (to 5)."""
    db = demo_db(tmp_path_factory.mktemp("older") / "older.db", instances=10, nodes=2)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    return db


@pytest.mark.parametrize("command", READ_ONLY, ids=" ".join)
def test_a_command_that_only_reads_refuses_an_older_store_and_leaves_it_as_it_is(
    older_store: Path, command: list[str]
) -> None:
    done = evstore(*command, "--db", str(older_store))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.schema.version: "), done.stderr
    assert "schema version 4" in done.stderr and "evstore upgrade --db" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert _version(older_store) == "4"


def test_evstore_upgrade_upgrades_it_and_says_from_what(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "older.db", instances=10, nodes=2)
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    conn.close()
    done = evstore("upgrade", "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["upgraded_from"] == 4
    assert _version(db) == "5"
    again = evstore("upgrade", "--db", str(db))
    assert again.returncode == 0 and "already" in again.stdout, again.stdout + again.stderr
    assert evstore("audit", "--db", str(db)).returncode == 0


def test_upgrade_of_a_missing_file_is_not_found(tmp_path: Path) -> None:
    done = evstore("upgrade", "--db", str(tmp_path / "none.db"))
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.not_found: "), done.stderr
    assert not (tmp_path / "none.db").exists()


async def test_open_store_with_upgrade_false_refuses_an_older_store_and_writes_nothing(
    older_store: Path, tmp_path: Path
) -> None:
    db = tmp_path / "copy.db"
    shutil.copy(older_store, db)
    for url, options in ((f"sqlite:///{db}", {"upgrade": False}), (f"sqlite:///{db}?upgrade=false", {})):
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(url, **options):  # type: ignore[arg-type]
                pass
        assert raised.value.code == "evstore.schema.version"
        assert raised.value.details["found"] == 4 and raised.value.details["supported"] == SCHEMA_VERSION
        assert "upgrade=False" in raised.value.message and "nothing was written" in raised.value.message
        assert _version(db) == "4"
    async with open_store(f"sqlite:///{db}") as store:  # (the default upgrades it, and says so)
        assert store.backend.upgraded_from == 4
        assert (await store.audit()).clean
    assert _version(db) == str(SCHEMA_VERSION)
    async with open_store(f"sqlite:///{db}", upgrade=False) as store:  # (a current store opens)
        assert store.backend.upgraded_from is None


@pytest.mark.parametrize(("url", "options"), [("sqlite://", {"upgrade": "no"}), ("sqlite://?upgrade=no", {})])
async def test_upgrade_must_be_true_or_false(url: str, options: dict[str, object]) -> None:
    with pytest.raises(InvalidInput) as raised:
        async with open_store(url, **options):  # type: ignore[arg-type]
            pass
    assert raised.value.details["field"] == "upgrade"
