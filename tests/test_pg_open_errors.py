"""Opening a PostgreSQL store where nothing is there, or with a malformed URL: the same codes as
SQLite's (a missing place is ``evstore.not_found``, a wrong URL ``evstore.invalid_input``), not
``evstore.storage``, which tells a person to look at the server."""

from __future__ import annotations

import re
from urllib.parse import quote, urlsplit, urlunsplit

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


def _shaped_as(version: int) -> list[str]:
    """Statements that make a current store's objects those of schema ``version`` (9, 8 or 4)."""
    from tests.test_postgres import _downgrade_to_v4_sql

    if version == SCHEMA_VERSION:
        return []
    if version == 8:  # (9 set enable_bitmapscan off for the sequencer)
        return [
            "ALTER FUNCTION evstore_sequence(bigint, boolean, bigint[]) RESET enable_bitmapscan",
            "UPDATE evstore_meta SET value = '8' WHERE key = 'schema_version'",
        ]
    assert version == 4
    return _downgrade_to_v4_sql()


async def _what_is_there(conn: object) -> tuple[object, ...]:
    """The schema's tables, functions (with their settings) and evstore_meta's rows."""
    tables = await _tables(conn)
    functions = await conn.fetch(  # type: ignore[attr-defined]
        "SELECT proname, proconfig, prosrc FROM pg_proc WHERE pronamespace = current_schema()::regnamespace "
        "ORDER BY 1, 2, 3"
    )
    meta = []
    if "evstore_meta" in tables:
        meta = await conn.fetch("SELECT key, value FROM evstore_meta ORDER BY 1")  # type: ignore[attr-defined]
    return tables, [tuple(f) for f in functions], [tuple(m) for m in meta]


def _statement(message: str) -> str:
    """The SQL a message gives to run (between backticks)."""
    found = re.findall(r"`([^`]+)`", message)
    assert len(found) == 1, message
    return str(found[0])


async def _refused_then_repaired(pg_url: str, said: str, version: int) -> str:
    """Open the damaged store (create=True and create=False): refused alike, ``said`` in the
    message, nothing written; returns the statement the message gives, which names ``version``."""
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        before = await _what_is_there(conn)
        statements = set()
        for create in (True, False):
            with pytest.raises(SchemaVersionError) as caught:
                await open_store(pg_url, create=create)
            message = str(caught.value)
            assert caught.value.code == "evstore.schema.version"
            assert said in message, message
            assert "another application" not in message and "None" not in message, message
            assert "backup" in message and "Nothing was written" in message, message
            if version < SCHEMA_VERSION:
                assert f"schema version {version}: this evstore upgrades it to {SCHEMA_VERSION}" in message
            else:
                assert f"schema version {SCHEMA_VERSION}, this evstore's" in message, message
            statements.add(_statement(message))
            assert await _what_is_there(conn) == before  # (nothing written)
    finally:
        await conn.close()
    (statement,) = statements
    assert f"'{version}'" in statement, statement
    return statement


@pytest.mark.parametrize("version", [SCHEMA_VERSION, 8, 4])
@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("DELETE FROM evstore_meta WHERE key = 'schema_version'", "evstore_meta lost its schema_version row"),
        ("UPDATE evstore_meta SET value = 'nine' WHERE key = 'schema_version'", "is 'nine', not a number"),
        ("DROP TABLE evstore_meta", "has lost evstore_meta"),
    ],
    ids=["row deleted", "not a number", "table dropped"],
)
async def test_a_store_that_lost_its_schema_version_is_refused_with_the_statement_that_gives_it_back(
    pg_url: str, damage: str, said: str, version: int
) -> None:
    """Regression: a store whose evstore_meta lost its schema_version row was refused as "schema
    version is None: not one evstore writes (... another application's)", and one whose version
    was not a number as "not a number", neither saying what to do; a dropped evstore_meta was
    given back at this evstore's version whatever the store's objects were (an older store's
    upgrade then skipped). Now: the message says what is lost and gives the statement that puts
    back the version the store's tables and functions show (schema-qualified, for a psql whose
    search_path is not the store's); run as given, the store opens again (an older one upgraded),
    as it was."""
    import asyncpg

    from tests.conftest import allocate, make_provider, new_uuid

    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {rp: {"VCPU": 2}}, consumer_type="BAREMETAL")
        await store.start_migration(inst, mig)
        head = await store.head()
        for sql in _shaped_as(version):
            await store.backend.tamper(sql)  # type: ignore[attr-defined]
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute(damage)
    finally:
        await conn.close()
    statement = await _refused_then_repaired(pg_url, said, version)
    conn = await asyncpg.connect(server_url())  # (its search_path is not the store's)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()
    async with open_store(pg_url, create=False) as store:
        assert await store.head() == head
        report = await store.audit()
        assert report.clean, [f.message for f in report.findings]
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"
        assert (await store.usage(rp)).usages == {"VCPU": 2}
    conn = await asyncpg.connect(pg_url)
    try:
        value = await conn.fetchval("SELECT value FROM evstore_meta WHERE key = 'schema_version'")
        assert value == str(SCHEMA_VERSION)
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (f" {SCHEMA_VERSION}", "not a number"),
        (f"{SCHEMA_VERSION} ", "not a number"),
        (f"+{SCHEMA_VERSION}", "not a number"),
        (" 5", "not a number"),
        ("\u0669", "not a number"),  # (ARABIC-INDIC DIGIT NINE: int() reads 9)
        ("9_0", "not a number"),
        ("9" * 5000, "not a number"),  # (more digits than int() reads)
        ("0", "evstore numbers its versions from 1"),
        ("-9", "evstore numbers its versions from 1"),
    ],
    ids=[
        "space 9",
        "9 space",
        "plus",
        "space 5",
        "arabic-indic",
        "underscore",
        "5000 digits",
        "zero",
        "minus",
    ],
)
async def test_a_store_whose_version_is_not_as_evstore_writes_it_is_refused_strictly(
    pg_url: str, value: str, said: str
) -> None:
    """Regression: PostgreSQL read the schema version with int(), as SQLite did before 9a5443a:
    ' 9', '+9' and an Arabic-Indic nine opened a store of version 9 as 9, ' 5' as 5 (migrations
    5-8 run again over it, the projection refolded), '9_0' as 90 ("upgrade evstore"), and 5000
    digits were refused as "not a number" without a word of what to do. Versions are now read as
    SQLite reads them (parse_version: ASCII digits, bounded); a store holding another value is
    refused with the statement that sets it, which opens it again."""
    import asyncpg

    from tests.conftest import make_provider

    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("UPDATE evstore_meta SET value = $1 WHERE key = 'schema_version'", value)
    finally:
        await conn.close()
    statement = await _refused_then_repaired(pg_url, said, SCHEMA_VERSION)
    assert statement.startswith("UPDATE "), statement
    conn = await asyncpg.connect(server_url())
    try:
        await conn.execute(statement)
    finally:
        await conn.close()
    async with open_store(pg_url, create=False) as store:
        assert await store.head() == head and (await store.usage(rp)).usages == {"VCPU": 0}
        assert (await store.audit()).clean


async def test_an_evstore_meta_without_a_store_and_a_version_int_reads_is_refused(pg_url: str) -> None:
    """Regression: a schema holding an evstore_meta whose version is ' 9' (int() reads 9) and no
    evstore tables was taken for a store of version 9, and the open went on to make the
    projection's tables in it. It is now "not a number", with nothing written."""
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE evstore_meta (key text PRIMARY KEY, value text NOT NULL)")
        await conn.execute("INSERT INTO evstore_meta VALUES ('schema_version', $1)", f" {SCHEMA_VERSION}")
        for create in (True, False):
            with pytest.raises(SchemaVersionError, match="not a number"):
                await open_store(pg_url, create=create)
            assert await _tables(conn) == ["evstore_meta"]
    finally:
        await conn.close()


@pytest.mark.parametrize("value", [None, "nine", "0"])
async def test_an_evstore_meta_without_a_log_says_what_to_do(pg_url: str, value: str | None) -> None:
    """Regression (review of stop 30): an evstore_meta holding no schema version, or one evstore
    does not write, beside no evstore log was refused as "This database's schema version is
    'nine', not a number: it was not written by evstore, or was damaged" (or None: "not one
    evstore writes"), not saying what to do - where SQLite's open of the same says "Use another
    file for the store" and PostgreSQL's for another application's events table "Put the store in
    a schema of its own". It now names the schema and says so; nothing is written."""
    import asyncpg

    conn = await asyncpg.connect(pg_url)
    try:
        await conn.execute("CREATE TABLE evstore_meta (key text PRIMARY KEY, value text NOT NULL)")
        if value is not None:
            await conn.execute("INSERT INTO evstore_meta VALUES ('schema_version', $1)", value)
        for create in (True, False):
            with pytest.raises(SchemaVersionError) as caught:
                await open_store(pg_url, create=create)
            message = str(caught.value)
            assert "schema of its own (?search_path=...)" in message, message
            assert "no evstore log" in message and "nothing was written" in message, message
            assert caught.value.details["found"] == value
            assert await _tables(conn) == ["evstore_meta"]
    finally:
        await conn.close()


#: passwords that start with digits, with each character a URL reserves
_PASSWORDS = ["123abc", "5432", "123/abc", "12@34x", "123#abc", "123?a=b", "99:88@77/66x"]


# (the second: URL text anyone may read that holds a password's pieces - the test server's port
# and search_path are random and once held "123", which the check below took for a leak)
_PUBLIC = ["", "&application_name=app_123_5432_66x"]


@pytest.mark.parametrize("public", _PUBLIC)
@pytest.mark.parametrize("password", _PASSWORDS)
async def test_a_password_that_starts_with_digits_is_never_taken_for_a_port(
    pg_url: str, password: str, public: str
) -> None:
    """Regression (helper s36_P): a password starting with digits and holding an unencoded "/"
    or "#" (``u:123/abc@db``) ends the URL's host part there, and the URL was read as host ``u``,
    port 123 - "Name or service not known", a StorageError that sent a person to the network; one
    holding a second "@" (``u:12@34x@db``) was looked up as the host ``34x@db`` (a piece of the
    password sent to the resolver). Percent-encoded, every such password opens the store (the
    test server trusts the role; a server that checks it refuses the password, not the host);
    written as is, a second "@" is refused as a malformed URL, and a misread that fails says to
    percent-encode it. The password is in no message, no details and no log line."""
    import structlog

    parts = urlsplit(pg_url + public)
    user, host = parts.username, f"{parts.hostname}:{parts.port}"
    encoded = urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))
    raw = urlunsplit(parts._replace(netloc=f"{user}:{password}@{host}"))
    pieces = [p for p in re.split(r"[/?#@:=]", password) if len(p) >= 3]
    with structlog.testing.capture_logs() as logs:
        try:
            async with open_store(encoded, connect_timeout=5) as store:
                assert await store.head() == 0
        except StorageError as exc:  # (only a server that checks passwords)
            assert "password" in exc.message and "percent-encode" not in exc.message, exc.message
        if password.isalnum():
            return
        with pytest.raises((InvalidInput, StorageError)) as raised:
            async with open_store(raw, connect_timeout=5):
                pass
    said = f"{raised.value.message} {raised.value.details} {logs}"
    assert "percent-encode" in raised.value.message, raised.value.message
    if urlsplit(raw).netloc.count("@") > 1:  # (refused before any connection is tried)
        assert isinstance(raised.value, InvalidInput), raised.value.message
    # The URL's public text (host, port, database, settings) is shown as given: a piece of the
    # password found there is no leak, so it is taken out before the pieces are looked for.
    for shown in (host, parts.path, parts.query):
        said = said.replace(shown, "<public>")
    for secret in [password, quote(password, safe=""), *pieces]:
        assert secret not in said, (secret, said)


async def test_a_url_with_an_at_sign_in_its_query_is_not_taken_for_a_password(pg_url: str) -> None:
    """The note on a password misread (above) is said only with an error: a sound URL whose last
    '@' lies past its host part - in a setting's value - opens as before."""
    async with open_store(f"{pg_url}&application_name=me@example", connect_timeout=5) as store:
        assert await store.head() == 0


async def test_a_server_that_never_answers_says_connect_timeout() -> None:
    """Regression (stop 37, operator sweep): a server that accepts the connection and never answers
    (stopped, or not PostgreSQL) failed as "Cannot connect to PostgreSQL at URL: TimeoutError" - the
    timeout's class name, with nothing of which timeout, or what to check."""
    import socket

    with socket.socket() as silent:  # (the kernel accepts the connection; nobody ever answers)
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with pytest.raises(StorageError) as caught:
            async with open_store(f"postgresql://evstore@127.0.0.1:{port}/x?connect_timeout=0.5"):
                pass
    message = caught.value.message
    assert "no answer within connect_timeout (0.5 s)" in message and message.count("TimeoutError") == 0, (
        message
    )
