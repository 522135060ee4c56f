"""Opening a PostgreSQL store where nothing is there, or with a malformed URL: the same codes as
SQLite's (a missing place is ``evstore.not_found``, a wrong URL ``evstore.invalid_input``), not
``evstore.storage``, which tells a person to look at the server."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from evstore import InvalidInput, NotFound, StorageError, open_store
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
