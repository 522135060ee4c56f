"""Opening a PostgreSQL store where nothing is there, or with a malformed URL: the same codes as
SQLite's (a missing place is ``evstore.not_found``, a wrong URL ``evstore.invalid_input``), not
``evstore.storage``, which tells a person to look at the server."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from evstore import InvalidInput, NotFound, SchemaVersionError, StorageError, open_store
from evstore.log.postgres import SCHEMA_VERSION
from tests.pg import server_url, with_search_path


def _database(url: str, name: str) -> str:
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@pytest.mark.parametrize("min_pool_size", [1, 0])
async def test_a_database_that_does_not_exist_is_not_found(min_pool_size: int) -> None:
    url = _database(server_url(), "evstore_no_such_database")
    with pytest.raises(NotFound, match=r'database "evstore_no_such_database" does not exist.*create it'):
        async with open_store(url, min_pool_size=min_pool_size) as store:
            await store.head()


@pytest.mark.parametrize("min_pool_size", [1, 0])
async def test_a_bad_sslmode_is_a_malformed_url(min_pool_size: int) -> None:
    with pytest.raises(InvalidInput, match=r"Malformed PostgreSQL URL.*sslmode"):
        async with open_store(f"{server_url()}?sslmode=bogus", min_pool_size=min_pool_size) as store:
            await store.head()


async def test_creating_a_store_in_a_schema_that_does_not_exist_is_not_found() -> None:
    url = with_search_path(server_url(), "evstore_no_such_schema")
    with pytest.raises(NotFound, match="no schema of the search_path exists to create the store in"):
        await open_store(url)
    with pytest.raises(NotFound, match="no schema of its search_path exists"):
        await open_store(url, create=False)


async def test_a_schema_with_another_applications_events_table_is_refused_clearly(pg_url: str) -> None:
    """Regression: open_store on a schema holding another application's ``events`` table failed
    with PostgreSQL's own 'relation "events" already exists' as evstore.storage "Cannot prepare
    the store", which reads as evstore's fault; now it says what is there and what to do."""
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE events (id int, what text)")
        said = r'relation "events" already exists.*schema of its own'
        with pytest.raises(StorageError, match=said) as caught:
            await open_store(pg_url)
        assert "another application" in str(caught.value)
        # (nothing was written: the schema holds the other application's table only)
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1"
        )
        assert [t["tablename"] for t in tables] == ["events"]
    finally:
        await conn.close()


async def _tables(conn: object) -> list[str]:
    rows = await conn.fetch(  # type: ignore[attr-defined]
        "SELECT tablename FROM pg_tables WHERE schemaname = current_schema() ORDER BY 1"
    )
    return [r["tablename"] for r in rows]


async def test_a_store_whose_evstore_meta_was_dropped_says_so_not_another_application(pg_url: str) -> None:
    """Regression (stop 29's note): a store whose evstore_meta (the table of its schema version)
    was dropped by hand was refused as 'relation "events" already exists ... another
    application's? Put the store in a schema of its own' - its own tables taken for another
    application's - and, opened with create=False (every read-only CLI command), as "No evstore
    store in schema". Both now say what is missing and how to put it back; nothing is written."""
    import asyncpg

    async with open_store(pg_url) as store:
        rp = await store.create_provider("11111111-1111-4111-8111-111111111111", "rp")
        assert rp.positions == (1,)
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DROP TABLE evstore_meta")
        before = await _tables(conn)
        for create in (True, False):
            with pytest.raises(SchemaVersionError) as caught:
                await open_store(pg_url, create=create)
            message = str(caught.value)
            assert "evstore_meta" in message and "dropped" in message, message
            assert "another application" not in message and "already exists" not in message, message
            assert "backup" in message and f"'schema_version', '{SCHEMA_VERSION}'" in message, message
            assert caught.value.code == "evstore.schema.version"
            assert await _tables(conn) == before  # (nothing written: evstore_meta not made again)
        # the repair the message gives opens the store as it was
        await conn.execute("CREATE TABLE evstore_meta (key text PRIMARY KEY, value text NOT NULL)")
        await conn.execute("INSERT INTO evstore_meta VALUES ('schema_version', $1)", str(SCHEMA_VERSION))
    finally:
        await conn.close()
    async with open_store(pg_url, create=False) as store:
        assert await store.head() == 1


async def test_a_table_an_upgrade_would_create_clashing_says_what_to_do(pg_url: str) -> None:
    """Regression (stop 29's note): upgrading a store of schema version 1, whose schema holds
    another application's ``snapshots`` (a table evstore's version 2 adds), failed with
    PostgreSQL's bare 'relation "snapshots" already exists' under "Cannot prepare the store".
    It now names the upgrade, the table, and what to do; the upgrade is rolled back."""
    import asyncpg

    async with open_store(pg_url) as store:
        await store.create_provider("11111111-1111-4111-8111-111111111111", "rp")
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("DROP TABLE snapshots")  # (what a version-1 store looked like)
        await conn.execute("UPDATE evstore_meta SET value = '1' WHERE key = 'schema_version'")
        await conn.execute("CREATE TABLE snapshots (id int, what text)")  # another application's
        with pytest.raises(StorageError) as caught:
            await open_store(pg_url)
        message = str(caught.value)
        assert caught.value.code == "evstore.storage"
        assert f"from schema version 1 to {SCHEMA_VERSION}" in message, message
        assert 'relation "snapshots" already exists' in message, message
        assert "not evstore's" in message and "rename" in message, message
        assert "another application" in message, message
        version = await conn.fetchval("SELECT value FROM evstore_meta WHERE key = 'schema_version'")
        assert version == "1"  # (rolled back)
        columns = await conn.fetch("SELECT attname FROM pg_attribute WHERE attrelid = 'snapshots'::regclass "
                                   "AND attnum > 0 ORDER BY attnum")  # fmt: skip
        assert [c["attname"] for c in columns] == ["id", "what"]
        await conn.execute("ALTER TABLE snapshots RENAME TO their_snapshots")  # (as the message says)
    finally:
        await conn.close()
    async with open_store(pg_url) as store:
        assert await store.head() == 1
