"""PostgreSQL-only behaviour: schema migration on open, parallel and serialised writers, retries,
readers that never skip or repeat under concurrent commits, many processes, and faults.

Everything that is not about PostgreSQL runs on it through the ``store`` fixture (see conftest).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest

import evstore.log.postgres as pg_module
from evstore import (
    AllocationStore,
    CapacityExceeded,
    ConsumerDeleted,
    EvstoreError,
    InvalidInput,
    Inventory,
    NotFound,
    ProjectionCorrupt,
    StorageError,
    open_store,
)
from evstore.errors import CorruptEvent, SchemaVersionError
from evstore.log.postgres import SCHEMA_VERSION, PostgresBackend, redact
from evstore.store import make_backend
from tests.conftest import allocate, make_provider, new_uuid
from tests.pg import HOST, PREFIX, _alive, server_url, with_search_path


def pg(store: AllocationStore) -> PostgresBackend:
    backend = store.backend
    assert isinstance(backend, PostgresBackend)
    return backend


async def admin_fetch(url: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(url)
    try:
        return list(await conn.fetch(sql, *args))
    finally:
        await conn.close()


async def database(url: str) -> str:
    rows = await admin_fetch(url, "SELECT current_database() AS name")
    return str(rows[0]["name"])


# --- opening ----------------------------------------------------------------------------------


async def test_concurrent_opens_migrate_once_and_reopen_is_idempotent(pg_url: str) -> None:
    async def open_and_write(i: int) -> None:
        async with open_store(pg_url, pool_size=2) as store:
            await store.create_provider(new_uuid(), f"node-{i}")

    await asyncio.gather(*(open_and_write(i) for i in range(6)))
    async with open_store(pg_url) as store:
        assert await store.head() == 6
        assert len(await store.providers()) == 6
    rows = await admin_fetch(pg_url, "SELECT key, value FROM evstore_meta")
    assert [tuple(r) for r in rows] == [("schema_version", str(SCHEMA_VERSION))]


async def test_an_older_schema_is_migrated_on_open(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        # what a version-1 store looked like: no snapshots table, no write-path functions
        await pg(store).tamper("DROP TABLE snapshots")
        for fn in (
            "evstore_lock_load",
            "evstore_lock_load_near",
            "evstore_write",
            "evstore_positions",
            "evstore_sequence",
        ):
            await pg(store).tamper(f"DROP FUNCTION {fn}")
        await pg(store).tamper("UPDATE evstore_meta SET value = '1' WHERE key = 'schema_version'")
    async with open_store(pg_url) as store:
        assert (await store.usage(rp)).usages == {"VCPU": 0}
        assert await pg(store).snapshot_positions() == []
        receipt = await store.set_allocations(
            "11111111-1111-4111-8111-111111111111",
            {rp: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        assert receipt.positions == (await store.head(),)
        assert (await store.usage(rp)).usages == {"VCPU": 2}
    rows = await admin_fetch(pg_url, "SELECT value FROM evstore_meta WHERE key = 'schema_version'")
    assert rows[0]["value"] == str(SCHEMA_VERSION)


async def test_a_schema_without_a_store_is_refused_when_it_must_exist(pg_url: str) -> None:
    from evstore import NotFound
    from tests.test_cli_support import evstore

    with pytest.raises(NotFound, match="No evstore store in schema"):
        async with open_store(pg_url, create=False):
            pass
    tables = "SELECT tablename FROM pg_tables WHERE schemaname = current_schema()"
    assert await admin_fetch(pg_url, tables) == []  # nothing was created
    # the read-only CLI commands open with create=False: a typo in the URL is an error, not a new store
    for command in ("audit", "stats", "tail"):
        extra = ["--no-follow"] if command == "tail" else []
        done = await asyncio.to_thread(evstore, command, "--url", pg_url, *extra)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "evstore.not_found" in done.stderr and "Traceback" not in done.stderr
    assert await admin_fetch(pg_url, tables) == []
    async with open_store(pg_url) as store:  # the default creates it
        await make_provider(store, VCPU=1)
    async with open_store(pg_url, create=False) as store:
        assert await store.head() == 2


async def test_open_does_not_hang_on_a_stuck_holder_of_the_migration_lock(pg_url: str) -> None:
    """Regression (helper-29): open() waited without limit for the store's migration lock, which
    a stuck session held; it now gives up after connect_timeout with a message saying why."""
    async with open_store(pg_url) as store:
        async with _another_client_holding(pg_url, store, "!migrate"):
            with pytest.raises(StorageError, match="migration lock") as info:
                async with asyncio.timeout(10):
                    async with open_store(pg_url, connect_timeout=1):
                        pass
            assert "evstore" in info.value.code
        async with open_store(pg_url, connect_timeout=1) as reopened:  # (released: opens at once)
            assert await reopened.head() == 0


async def test_a_multi_host_url_fails_over_to_the_host_that_answers(pg_url: str) -> None:
    """Regression (helper-29): libpq's multi-host form (host1:port1,host2:port2, what failover set-ups
    use) was refused as a malformed URL; asyncpg tries the hosts in turn."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    scheme, rest = pg_url.split("://", 1)
    user, hostpart = rest.split("@", 1)
    url = f"{scheme}://{user}@127.0.0.1:{dead},{hostpart}"
    async with open_store(url) as store:
        await make_provider(store, VCPU=1)
        assert await store.head() == 2
    with pytest.raises(InvalidInput, match="Malformed"):
        make_backend(f"{scheme}://{user}@127.0.0.1:{dead},127.0.0.1:nope/db")


async def test_a_newer_schema_is_refused(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        await pg(store).tamper("UPDATE evstore_meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(SchemaVersionError, match="schema version 99"):
        async with open_store(pg_url):
            pass


async def test_a_server_that_is_down_is_named_without_its_password() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"127.0.0.1:{port}/evstore"
    for url, secret, shown in (
        (f"postgresql://evstore:s3cret@{base}", "s3cret", f"postgresql://evstore:***@{base}"),
        # libpq's ?password= too (it was shown in full)
        (f"postgresql://evstore@{base}?password=Top3", "Top3", f"postgresql://evstore@{base}?password=***"),
    ):
        with pytest.raises(StorageError) as info:
            async with open_store(url, connect_timeout=5):
                pass
        assert shown in info.value.message
        assert secret not in str(info.value) and secret not in json.dumps(info.value.to_dict())
    assert redact("postgresql://u@h/db") == "postgresql://u@h/db"
    assert redact("postgresql://u@h/x?PASSWORD=a&sslpassword=b&x=1") == (
        "postgresql://u@h/x?PASSWORD=***&sslpassword=***&x=1"
    )


@pytest.mark.parametrize(
    "url",
    [
        "postgresql+asyncpg://app:TopSecret1@db.example:5432/evstore",  # not a scheme evstore takes
        " postgresql://app:TopSecret1@db.example/evstore",
        "host=db.example password=TopSecret1 dbname=evstore",  # a libpq keyword string
        "postgresql://app:ab/cdTopSecret1@db.example/evstore",  # an unencoded "/": no URL parser's
        "postgresql://app:Top@Secret1@db.example:x/evstore",
        # the "/" ends the parser's netloc: the password (or its part before the "/") is taken for
        # the port, which the port check's error quoted ("... integer value as 'TopSecret1'")
        "postgresql://app:TopSecret1/@db.example/evstore",
        "postgresql://app:TopSecret1/x@db.example:5432/evstore",
        # ... quoted as Python's repr does: in double quotes when it holds a "'", with a "\"
        # doubled - neither was taken for a quoted value (review of session 34's redaction)
        "postgresql://app:Secret1'x/y@db.example/evstore",
        "postgresql://app:Secret1\\x/y@db.example/evstore",
        # brackets in the password: the URL parser's own error ("'Secret1' does not appear to be
        # an IPv4 or IPv6 address") was not redacted at all
        "postgresql://app:x[Secret1]y@db.example/evstore",
    ],
)
def test_a_url_evstore_refuses_is_named_without_its_password(url: str) -> None:
    """Regression (helper-29): 'Unsupported store URL' and 'Malformed PostgreSQL URL' printed the
    URL as given, password and all (redaction relied on a URL parser that did not see one)."""
    with pytest.raises(InvalidInput) as info:
        make_backend(url)
    assert "Secret1" not in str(info.value) and "Secret1" not in json.dumps(info.value.to_dict())
    assert "***" in info.value.message


@pytest.mark.parametrize(
    "url",
    [
        # asyncpg cuts the userinfo at the first "@", evstore at the last: the piece of the
        # password after the first "@" is then a host and port, or a query, that asyncpg quotes
        # with the host after it ("invalid literal for int() with base 10: 'Secret1@db.example:5432'")
        "postgresql://app:x@y:Secret1@db.example:5432/evstore",
        "postgresql://app:x@y?Secret1@db.example/evstore",
    ],
)
async def test_a_password_piece_asyncpg_quotes_with_the_host_is_hidden(url: str) -> None:
    """Regression (review of session 34's redaction): a quoted value that holds a piece of the
    password and more of the URL was kept, being no part of the password."""
    with pytest.raises(InvalidInput, match="Malformed PostgreSQL URL") as info:
        async with open_store(url, connect_timeout=2):
            pass
    assert "Secret1" not in str(info.value) and "Secret1" not in json.dumps(info.value.to_dict())
    assert "***" in info.value.message


@pytest.mark.parametrize("min_pool_size", [1, 0])
@pytest.mark.parametrize("query", ["port=5432/x", "port=abc", "host=/tmp&port=1,x"])
async def test_a_malformed_port_in_the_urls_query_is_invalid_input(query: str, min_pool_size: int) -> None:
    """Regression (rev22): a port given in the query (libpq's ``?host=/socket/dir&port=N`` form,
    for a Unix socket) that is not a number escaped open_store as asyncpg's bare ValueError.
    With ``min_pool_size=0`` the pool connects (and asyncpg parses the URL) only at the first
    acquire, after create_pool: that path let the bare ValueError through (review of rev22)."""
    url = f"postgresql://app:TopSecret1@/evstore?{query}"
    with pytest.raises(InvalidInput, match="Malformed PostgreSQL URL") as info:
        async with open_store(url, connect_timeout=2, min_pool_size=min_pool_size):
            pass
    assert "Secret1" not in str(info.value) and info.value.code == "evstore.invalid_input"


async def _until_one_statement_waited(
    url: str, holder: int, seconds: float, unless: asyncio.Future[Any]
) -> None:
    """Return once a statement of another session has waited ``seconds`` for a lock the session
    ``holder`` (a server pid) holds, or once ``unless`` is done; fails after a minute (a hang)."""
    # (not on the holder's connection: a transaction keeps the pg_stat_activity it read first)
    watcher = await asyncpg.connect(url)
    try:
        async with asyncio.timeout(60):
            while not unless.done():
                waited = await watcher.fetchval(
                    "SELECT coalesce(extract(epoch FROM max(clock_timestamp() - query_start)), 0)::float8 "
                    "FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    holder,
                )
                if waited >= seconds:
                    return
                await asyncio.sleep(0.05)
    finally:
        await watcher.close()


@pytest.mark.parametrize(
    ("setting", "value", "pool_size"),
    [("lock_timeout", "50ms", 10), ("statement_timeout", "1s", 10), ("statement_timeout", "1s", 1)],
)
async def test_a_timeout_in_the_url_does_not_fail_a_committed_command(
    pg_url: str, setting: str, value: str, pool_size: int
) -> None:
    """Regression (helper-29, lock_timeout; helper-59, statement_timeout - the URL's, or a DBA's on
    the role or database): the sequencer, which positions a command's events after its COMMIT,
    waited for its lock under the setting, so while another process's run held the lock past it,
    a command that had committed was reported as failed ("committed, but reading its positions
    failed"; without an idempotency key, "do not retry"). The sequencer's wait is not bounded by
    either now; the commands' own statements and locks still are. (In a pool of one: the run
    tried first on the command's own connection gives it back before the retry needs one.)

    Only what the test is about runs under the setting: the store is made and checked through
    one without it, and statement_timeout is 1 s - at 100 ms, under load, the open's own
    statements ran out of it (migrating, repairing the projection: flaky). The lock is held
    until the claim has waited for it in one statement for 2 s, twice the longest timeout or
    more, however long the claim took to get there."""
    async with open_store(pg_url) as plain:
        rp = await make_provider(plain, VCPU=4)
        async with open_store(f"{pg_url}&{setting}={value}&pool_size={pool_size}") as store:
            async with _another_client_holding(pg_url, store, "!sequencer") as (other, tr):
                claim = asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 1}}))
                await _until_one_statement_waited(pg_url, other.get_server_pid(), 2, claim)
                assert not claim.done(), claim.exception()
                await tr.rollback()
            await asyncio.wait_for(claim, 10)  # (raised StorageError before the fix)
            # the setting still applies to everything else evstore's sessions run
            async with pg(store)._connection() as conn:
                assert await conn.fetchval(f"SHOW {setting}") == value
                if setting == "statement_timeout":
                    with pytest.raises(asyncpg.QueryCanceledError):
                        await conn.execute("SELECT pg_sleep(10)")
        assert (await plain.usage(rp))["VCPU"] == 1
        assert (await plain.audit()).clean


async def test_a_command_takes_one_pooled_connection_and_positions_its_events_on_it(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured (issue 5, PostgreSQL 8 clients vs 1): a command gave its connection back after
    COMMIT and took another from the pool for the sequencer (asyncpg's release runs a shielded
    task and the pool's reset): two acquisitions per command. The sequencer now runs first on the
    command's own connection."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=100)
        backend = pg(store)
        taken = 0
        real = backend._acquire

        async def counted(pool: Any) -> Any:
            nonlocal taken
            taken += 1
            return await real(pool)

        monkeypatch.setattr(backend, "_acquire", counted)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        await store.delete_consumer(c)
        assert taken == 2
        assert [r.position for r in await store.read(after=0)][-2:] == [
            await store.head() - 1,
            await store.head(),
        ]
        assert (await store.audit()).clean


@contextlib.asynccontextmanager
async def _a_database_of_its_own() -> AsyncIterator[str]:
    """A URL to a new, empty database on the test server (dropped after), for a test whose
    outcome depends on what other clients of its database do: a snapshot any of them holds
    keeps every row version that died since it was taken - a test's schema shares the xmin
    horizon of the whole database with every other test on the server, a database does not.
    Databases a killed run on this machine left behind are dropped first (as tests/pg.py's
    schemas)."""
    base = server_url()
    name = f"{PREFIX}{HOST}_{os.getpid()}_db{random.randrange(1 << 30)}"
    admin = await asyncpg.connect(base)
    try:
        for row in await admin.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", PREFIX.replace("_", r"\_") + "%"
        ):
            match = re.fullmatch(rf"{PREFIX}{HOST}_(\d+)_db\d+", row["datname"])
            if match and not _alive(int(match.group(1))):
                await admin.execute(f'DROP DATABASE IF EXISTS "{row["datname"]}" WITH (FORCE)')
        # (template0: nobody is connected to it, as CREATE DATABASE requires of its template)
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE template0')
    finally:
        await admin.close()
    parts = urlsplit(base)
    try:
        yield urlunsplit(parts._replace(path=f"/{name}"))
    finally:
        admin = await asyncpg.connect(base)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


async def test_the_sequencer_does_not_rescan_the_events_it_positioned_before() -> None:
    """Regression (issue 5, measured on the scaling stream): the sequencer found the events to
    position with a bitmap scan of events_unpositioned (its generic plan), which never marks the
    entries of the row versions its own UPDATEs left dead: every run read every entry and heap
    page of every event positioned since the table's last VACUUM (7.3M index entries read by
    3,017 runs of a 5,300-event store; 3.6 ms and 664 buffers per run at 1,200 commands, growing
    until autovacuum ran at 20% of the table). It scans the index in order now, which marks them,
    so the index keeps only the events not positioned yet (and a few just positioned).

    In a database of its own, with autovacuum off for the events: an entry can be marked only
    once no snapshot can see its row version, and under load another test's transaction (any
    client of the same database) held one long enough to leave hundreds unmarked (27 buffers,
    4 pages: flaky); and the scan, not a VACUUM, is what must keep the index small."""
    async with _a_database_of_its_own() as url, open_store(url) as store:
        async with pg(store)._connection() as conn:
            await conn.execute("ALTER TABLE events SET (autovacuum_enabled = false)")
        rp = await make_provider(store, VCPU=100_000)
        for _ in range(1000):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        async with pg(store)._connection() as conn:
            plan = json.loads(
                await conn.fetchval(
                    "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                    "SELECT EXISTS (SELECT 1 FROM events WHERE position IS NULL)"
                )
            )[0]["Plan"]
            pages = await conn.fetchval("SELECT pg_relation_size('events_unpositioned') / 8192")
        touched = plan["Shared Hit Blocks"] + plan["Shared Read Blocks"]
        assert touched <= 10, plan  # (85-99 buffers before the fix)
        assert pages <= 3  # (a meta page and a leaf or two: 5 or more before)


async def test_transactions_run_at_read_committed_whatever_the_default(pg_url: str) -> None:
    """Regression (helper-29): with default_transaction_isolation=serializable (a role's or a
    database's default, or the URL's), audits, rebuilds and head reads failed with serialization
    errors evstore does not retry; evstore's locking is built for READ COMMITTED."""
    url = pg_url + "&default_transaction_isolation=serializable"
    async with open_store(url) as store:
        backend = pg(store)
        async with backend._connection() as conn:
            assert await conn.fetchval("SHOW transaction_isolation") == "read committed"
        rp = await make_provider(store, VCPU=100)
        await asyncio.gather(
            *(allocate(store, new_uuid(), {rp: {"VCPU": 1}}) for _ in range(20)),
            *(store.audit() for _ in range(3)),
        )
        assert (await store.usage(rp))["VCPU"] == 20


@pytest.mark.parametrize("value", ["banana", "", "-2", "0"])
async def test_a_damaged_schema_version_is_a_typed_error(pg_url: str, value: str) -> None:
    """Regression (helper-29): a schema version that is not a number raised a bare ValueError."""
    async with open_store(pg_url) as store:
        await pg(store).tamper(f"UPDATE evstore_meta SET value = '{value}' WHERE key = 'schema_version'")
    with pytest.raises(SchemaVersionError, match="schema version"):
        async with open_store(pg_url):
            pass


async def test_a_missing_schema_is_a_clear_error(pg_url: str) -> None:
    missing = with_search_path(pg_url, "evstore_no_such_schema")
    # creating one: nowhere to create it in, NotFound as for a SQLite file in a directory that
    # does not exist (was StorageError, which sends a person to the server)
    with pytest.raises(NotFound, match="no schema of the search_path exists to create the store in"):
        async with open_store(missing):
            pass
    # opening an existing store only (the CLI's read-only commands): there is none, NotFound
    # as for a SQLite file without one (was StorageError)
    with pytest.raises(NotFound, match="no schema of its search_path exists"):
        async with open_store(missing, create=False):
            pass


@pytest.mark.parametrize(
    ("url", "options", "named"),
    [
        ("postgresql://u@127.0.0.1:1/x", {"command_timeout": 0}, "command_timeout"),  # raw ValueError
        ("postgresql://u@127.0.0.1:1/x", {"command_timeout": float("nan")}, "command_timeout"),
        ("postgresql://u@127.0.0.1:1/x", {"connect_timeout": -1}, "connect_timeout"),
        ("postgresql://u@127.0.0.1:1/x", {"statement_cache_size": -1}, "statement_cache_size"),
        ("postgresql://u@127.0.0.1:1/x", {"pool_size": 2.7}, "pool_size"),  # was truncated to 2
        ("postgresql://u@127.0.0.1:1/x", {"pool_size": True}, "pool_size"),
        ("postgresql://u@127.0.0.1:abc/x", {}, "Malformed PostgreSQL URL"),  # was evstore.internal
        ("postgresql://u@[::1/x", {}, "Malformed PostgreSQL URL"),
        ("postgresql://u@127.0.0.1:1/x?pool_size=x", {}, "pool_size in the URL must be an integer"),
        ("postgresql://u@127.0.0.1:1/x?pool_size=0", {}, "pool_size"),
        ("postgresql://u@127.0.0.1:1/x?connect_timeout=soon", {}, "connect_timeout"),
        ("postgresql://u@127.0.0.1:1/x?create=maybe", {}, "create must be true or false"),
        ("postgresql://u@127.0.0.1:1/x?pool_size=1&pool_size=2", {}, "sets pool_size more than once"),
    ],
)
async def test_bad_options_and_urls_are_invalid_input_before_connecting(
    url: str, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidInput, match=named):
        async with open_store(url, **options):
            pass


async def test_store_options_in_the_url_are_evstores_not_server_settings(pg_url: str) -> None:
    """Regression: the README says the backend's options may be given as ?k=v in the URL (the
    CLI's --url is the only way there), but they went to the server as settings, which refused
    the connection ('unrecognized configuration parameter "pool_size"'), libpq's connect_timeout
    included."""
    options = "pool_size=3&min_pool_size=1&connect_timeout=5&command_timeout=30&max_retries=3"
    options += "&statement_cache_size=0"
    async with open_store(f"{pg_url}&{options}") as store:
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        assert (backend.pool_size, backend.min_pool_size, backend.max_retries) == (3, 1, 3)
        assert (backend.connect_timeout, backend.command_timeout, backend.statement_cache_size) == (5, 30, 0)
        await make_provider(store, VCPU=4)
        assert await store.head() == 2
    async with open_store(f"{pg_url}&pool_size=3", pool_size=4) as store:  # (a keyword wins)
        assert isinstance(store.backend, PostgresBackend) and store.backend.pool_size == 4


async def test_unknown_options_are_refused(pg_url: str) -> None:
    with pytest.raises(EvstoreError, match="Unknown PostgreSQL store option"):
        async with open_store(pg_url, synchronous="FULL"):
            pass


async def test_a_misspelt_url_option_is_invalid_input_naming_evstores_options(pg_url: str) -> None:
    """Regression (helper-56): ``?pool_sise=3`` went to the server as a setting and came back as
    evstore.storage 'Cannot connect ...: unrecognized configuration parameter' - a storage
    failure, with nothing saying it came from the URL."""
    with pytest.raises(InvalidInput, match="unrecognized configuration parameter") as caught:
        async with open_store(f"{pg_url}&pool_sise=3"):
            pass
    assert "pool_size" in caught.value.message and "check its spelling" in caught.value.message
    assert caught.value.code == "evstore.invalid_input"


# --- parallel writers -------------------------------------------------------------------------


async def test_commands_on_disjoint_entities_are_in_flight_together(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        a, b = await make_provider(store, VCPU=4), await make_provider(store, VCPU=4)
        both_inside = asyncio.Barrier(2)

        async def hook(conn: Any) -> None:
            # Both transactions hold their locks and wait here: they cannot be serialised.
            await both_inside.wait()

        pg(store)._before_commit = hook
        async with asyncio.timeout(30):
            await asyncio.gather(
                allocate(store, new_uuid(), {a: {"VCPU": 1}}), allocate(store, new_uuid(), {b: {"VCPU": 1}})
            )
        assert (await store.usage(a)).usages["VCPU"] == 1 == (await store.usage(b)).usages["VCPU"]


@pytest.mark.parametrize("stores", [1, 2], ids=["one-process", "two-processes"])
async def test_commands_naming_one_custom_class_on_disjoint_entities_are_in_flight_together(
    pg_url: str, stores: int
) -> None:
    """Found by review (helper-48): every command naming a custom class took an exclusive lock on
    it (and queued behind the process's last one naming it), so allocations of CUSTOM_GPU on
    disjoint consumers and providers ran one at a time, across the whole cloud. A class is never
    deleted: only its creation needs the lock."""
    async with contextlib.AsyncExitStack() as stack:
        first = await stack.enter_async_context(open_store(pg_url))
        second = first if stores == 1 else await stack.enter_async_context(open_store(pg_url))
        await first.create_resource_class("CUSTOM_GPU")
        a, b = await make_provider(first, CUSTOM_GPU=4), await make_provider(first, CUSTOM_GPU=4)
        both_inside = asyncio.Barrier(2)

        async def hook(conn: Any) -> None:
            # Both transactions hold their locks and wait here: they cannot be serialised (one
            # gives up after a while, failing its command, so a serialised pair does not hang).
            async with asyncio.timeout(5):
                await both_inside.wait()

        pg(first)._before_commit = pg(second)._before_commit = hook
        await asyncio.gather(
            allocate(first, new_uuid(), {a: {"CUSTOM_GPU": 1}}),
            allocate(second, new_uuid(), {b: {"CUSTOM_GPU": 1}}),
        )
        pg(first)._before_commit = pg(second)._before_commit = None
        assert (await first.usage(a)).usages == {"CUSTOM_GPU": 1} == (await first.usage(b)).usages
        # creating a class is still serialised: created once, from two stores at once
        assert [
            r.positions
            for r in await asyncio.gather(
                first.create_resource_class("CUSTOM_FPGA"), second.create_resource_class("CUSTOM_FPGA")
            )
        ].count(()) == 1
        # a command queued after a creation of its class (in one process) still runs after it
        fresh = await make_provider(second)
        await asyncio.gather(
            second.create_resource_class("CUSTOM_NEW"),
            second.set_inventories(fresh, {"CUSTOM_NEW": Inventory(total=1)}, generation=0),
        )
        assert (await first.audit()).clean


async def test_commands_sharing_a_provider_are_serialised(pg_url: str) -> None:
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        rp = await make_provider(first, VCPU=1)
        inside, release = asyncio.Event(), asyncio.Event()

        async def hold(conn: Any) -> None:
            inside.set()
            await release.wait()

        pg(first)._before_commit = hold
        c1, c2 = new_uuid(), new_uuid()
        async with asyncio.timeout(30):
            t1 = asyncio.create_task(allocate(first, c1, {rp: {"VCPU": 1}}))
            await inside.wait()
            t2 = asyncio.create_task(allocate(second, c2, {rp: {"VCPU": 1}}))
            # the second command waits for the first one's advisory lock on the provider
            waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory' AND datname = $1"
            while not await admin_fetch(pg_url, waiting, await database(pg_url)):
                await asyncio.sleep(0.01)
            assert not t2.done()
            release.set()
            await t1
            with pytest.raises(EvstoreError) as info:
                await t2
        # it decided on the first command's result: the provider was full
        assert info.value.code == "evstore.allocation.capacity_exceeded"
        assert (await second.allocations(c1)).allocations == {rp: {"VCPU": 1}}
        assert (await second.audit()).clean


async def test_a_revert_waits_for_a_write_to_its_absent_instance(pg_url: str) -> None:
    """Regression: an instance emptied by start_migration has no row, so a revert (which names only
    the migration) loaded and locked nothing for it: the scheduler's destination write to the
    instance, open at that moment, was overwritten by a revert decided on 'the instance holds
    nothing' - the acknowledged allocation missing from the log, the projection drifting from it."""
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        src, dst = await make_provider(first, "src", VCPU=8), await make_provider(first, "dst", VCPU=8)
        instance, migration = new_uuid(), new_uuid()
        await allocate(first, instance, {src: {"VCPU": 4}})
        await first.start_migration(instance, migration)
        inside, release = asyncio.Event(), asyncio.Event()

        async def hold(conn: Any) -> None:
            inside.set()
            await release.wait()

        pg(first)._before_commit = hold
        async with asyncio.timeout(30):
            destination = asyncio.create_task(allocate(first, instance, {dst: {"VCPU": 4}}))
            await inside.wait()
            revert = asyncio.create_task(second.revert_migration(migration))
            waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory' AND datname = $1"
            try:
                while not await admin_fetch(pg_url, waiting, await database(pg_url)):
                    assert not revert.done(), "the revert did not wait for the write to its instance"
                    await asyncio.sleep(0.01)
            finally:
                release.set()
            await destination
            await revert
        pg(first)._before_commit = None
        # the revert replaced what the instance held by then: the destination allocation
        assert (await second.allocations(instance)).allocations == {src: {"VCPU": 4}}
        assert (await second.usage(dst)).usages["VCPU"] == 0
        assert (await second.audit()).clean


async def test_racing_deletes_and_reverts_from_two_processes_leak_nothing(pg_url: str) -> None:
    """The delete discovers the migration, the revert the instance: both lock both, in order."""
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        src = await make_provider(first, "src", VCPU=Inventory(total=1000))
        dst = await make_provider(first, "dst", VCPU=Inventory(total=1000))
        pairs = []
        for _ in range(20):
            instance, migration = new_uuid(), new_uuid()
            await allocate(first, instance, {src: {"VCPU": 2}})
            await first.start_migration(instance, migration)
            await allocate(first, instance, {dst: {"VCPU": 2}})
            pairs.append((instance, migration))

        async def race(instance: str, migration: str, delete_first: bool) -> None:
            delete = first.delete_consumer(instance)
            revert = second.revert_migration(migration)
            calls = (delete, revert) if delete_first else (revert, delete)
            await asyncio.gather(*calls, return_exceptions=True)

        await asyncio.gather(*(race(i, m, n % 2 == 0) for n, (i, m) in enumerate(pairs)))
        for instance, migration in pairs:
            assert (await first.allocations(instance)).deleted
            assert (await first.allocations(migration)).allocations == {}
        assert (await first.usage(src)).usages["VCPU"] == 0 == (await first.usage(dst)).usages["VCPU"]
        report = await second.audit()
        assert report.clean, report.findings


def _spy_on_restarts(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The lock sets of every restart (``_Relock``) from now on."""
    import evstore.log.postgres as pgmod

    restarts: list[set[int]] = []

    class Spy(pgmod._Relock):
        def __init__(self, keys: set[int]) -> None:
            restarts.append(keys)
            super().__init__(keys)

    monkeypatch.setattr(pgmod, "_Relock", Spy)
    return restarts


async def _consumer_on_a_provider_that_locks_first(store: AllocationStore) -> tuple[str, str]:
    """A consumer holding 1 VCPU on a provider whose lock key sorts before the consumer's:
    releasing the consumer discovers the provider while loading, out of order."""
    backend = pg(store)
    consumer = new_uuid()
    while True:
        rp = new_uuid()
        if backend._key(f"provider:{rp}") < backend._key(f"consumer:{consumer}"):
            break
    await store.create_provider(rp, "node")
    await store.set_inventories(rp, {"VCPU": Inventory(total=4)}, generation=0)
    await allocate(store, consumer, {rp: {"VCPU": 1}})
    return consumer, rp


async def test_an_entity_found_while_loading_that_sorts_first_is_taken_at_once_when_free(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Free, the provider's lock is taken without waiting (``pg_try_advisory_xact_lock``) in the
    same transaction: no restart."""
    restarts = _spy_on_restarts(monkeypatch)
    async with open_store(pg_url) as store:
        consumer, rp = await _consumer_on_a_provider_that_locks_first(store)
        restarts.clear()
        await store.release(consumer)
        assert restarts == []
        assert (await store.usage(rp)).usages["VCPU"] == 0
        assert (await store.audit()).clean


async def test_an_entity_found_while_loading_that_sorts_first_and_is_busy_restarts_with_all_locks(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same discovery while another session holds the provider's lock: the command must not
    wait for it out of order; it restarts with every lock taken in order, waits there, and
    completes once the other session lets go."""
    restarts = _spy_on_restarts(monkeypatch)
    async with open_store(pg_url) as store:
        consumer, rp = await _consumer_on_a_provider_that_locks_first(store)
        restarts.clear()
        other = await asyncpg.connect(pg_url)
        try:
            provider_key = pg(store)._key(f"provider:{rp}")
            await other.execute("SELECT pg_advisory_lock($1)", provider_key)
            release = asyncio.create_task(store.release(consumer))
            for _ in range(200):  # until the command has restarted and waits in order
                if restarts:
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not release.done()  # it waits for the provider, holding no lock out of order
            await other.execute("SELECT pg_advisory_unlock($1)", provider_key)
            await asyncio.wait_for(release, 10)
        finally:
            await other.close()
        assert len(restarts) == 1 and provider_key in restarts[0]
        assert (await store.usage(rp)).usages["VCPU"] == 0
        assert (await store.audit()).clean


def _count_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The commands' loads (``evstore_lock_load_near`` round trips) from now on, by command."""
    import evstore.log.postgres as pgmod

    loads: list[str] = []
    real = pgmod.lock_load

    async def counted(conn: Any, n: Any, *args: Any) -> Any:
        loads.append(",".join(sorted(n.consumers)))
        return await real(conn, n, *args)

    monkeypatch.setattr(pgmod, "lock_load", counted)
    return loads


async def test_a_command_naming_consumers_only_loads_once_when_its_neighbours_are_known(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured (issue 5, PostgreSQL 8 clients vs 1): a command naming consumers only (a migration's
    start, its revert or confirmation, a delete) found its providers and migrations by loading, so
    it loaded twice (and often ran a try-lock between): 1.54 loads and 0.40 try-locks per command
    on the scaling stream, ~15% of the client's and the server's CPU per command. The entities a
    consumer was loaded with by this process are now locked with its own keys, if free, in the
    first load."""
    loads = _count_loads(monkeypatch)
    async with open_store(pg_url) as store:
        src, dest = await make_provider(store, VCPU=8), await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}})
        loads.clear()
        await store.start_migration(inst, mig)
        await allocate(store, inst, {dest: {"VCPU": 2}})
        await store.revert_migration(mig)
        await store.delete_consumer(inst)
        assert len(loads) == 4, loads
        assert (await store.usage(src)).usages == {"VCPU": 0}
        assert (await store.usage(dest)).usages == {"VCPU": 0}
        assert (await store.audit()).clean


async def test_a_stale_guess_of_a_consumers_provider_is_neither_waited_for_nor_trusted(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guess is this process's memory: another process may have moved the consumer since. Its
    old provider, held by another session, is not waited for (a guess never waits); its new one,
    found by the load, is locked before anything is decided, as without a guess."""
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        old, new = await make_provider(first, VCPU=8), await make_provider(first, VCPU=8)
        c = new_uuid()
        await allocate(first, c, {old: {"VCPU": 2}})  # first remembers c with old
        await allocate(second, c, {new: {"VCPU": 3}}, generation=1)  # second moves it
        restarts = _spy_on_restarts(monkeypatch)
        async with _another_client_holding(pg_url, first, f"provider:{old}") as (other, tr):
            await asyncio.wait_for(first.delete_consumer(c), 10)
            # (the lock of the consumer's provider now was taken by the command, and let go)
            assert await other.fetchval(
                "SELECT pg_try_advisory_xact_lock($1)", pg(first)._key(f"provider:{new}")
            )
            await tr.rollback()
        assert restarts == []
        assert (await first.usage(old)).usages == {"VCPU": 0}
        assert (await first.usage(new)).usages == {"VCPU": 0}
        assert (await first.audit()).clean


async def test_a_guessed_neighbour_the_command_needs_is_waited_for_in_order(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guessed entity another session holds is not taken by the load; when the command needs it
    (the consumer is still there) it is found and locked as without a guess, waiting in order, and
    the command completes once the other session lets go."""
    async with open_store(pg_url) as store:
        consumer, rp = await _consumer_on_a_provider_that_locks_first(store)
        assert f"provider:{rp}" in pg(store)._near[f"consumer:{consumer}"]
        restarts = _spy_on_restarts(monkeypatch)
        async with _another_client_holding(pg_url, store, f"provider:{rp}") as (_, tr):
            release = asyncio.create_task(store.release(consumer))
            await asyncio.sleep(0.3)
            assert not release.done()
            await tr.rollback()
            await asyncio.wait_for(release, 10)
        assert len(restarts) == 1 and pg(store)._key(f"provider:{rp}") in restarts[0]
        assert (await store.usage(rp)).usages["VCPU"] == 0
        assert (await store.audit()).clean


async def test_one_name_created_from_two_processes_is_taken_once(pg_url: str) -> None:
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        outcomes = await asyncio.gather(
            *(s.create_provider(new_uuid(), f"node-{i // 2}") for i, s in enumerate([first, second] * 10)),
            return_exceptions=True,
        )
        failures = [o for o in outcomes if isinstance(o, BaseException)]
        assert len(failures) == 10
        assert all(getattr(f, "code", None) == "placement.duplicate_name" for f in failures)
        assert len(await first.providers()) == 10


@pytest.mark.parametrize(
    "error", [asyncpg.exceptions.DeadlockDetectedError, asyncpg.exceptions.SerializationError]
)
async def test_deadlock_and_serialization_failures_are_retried(pg_url: str, error: type[Exception]) -> None:
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        calls = 0

        async def fail_once(conn: Any) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                raise error("simulated by the test")

        pg(store)._before_commit = fail_once
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
        assert calls == 2
        assert await store.head() == 3
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_one_idempotency_key_from_two_processes_appends_once(pg_url: str) -> None:
    async with open_store(pg_url) as first, open_store(pg_url) as second:
        rp = await make_provider(first, VCPU=4)
        c = new_uuid()
        kwargs: dict[str, Any] = dict(
            project_id="p", user_id="u", consumer_type="INSTANCE", generation=None, idempotency_key="req-1"
        )
        r1, r2 = await asyncio.gather(
            first.set_allocations(c, {rp: {"VCPU": 1}}, **kwargs),
            second.set_allocations(c, {rp: {"VCPU": 1}}, **kwargs),
        )
        assert r1.positions == r2.positions == (3,)
        assert {r1.replayed, r2.replayed} == {False, True}
        assert await first.head() == 3


# --- readers never skip, never repeat ---------------------------------------------------------


async def test_readers_see_exactly_the_committed_events_under_concurrent_writers(pg_url: str) -> None:
    """8 writer connections commit with random delays (so positions would become visible out of
    order if they were assigned at insert time) while a subscriber and a paging reader follow."""
    rng = random.Random(4)
    async with contextlib.AsyncExitStack() as stack:
        reader = await stack.enter_async_context(open_store(pg_url, poll_interval=0.01))
        providers = [await make_provider(reader, f"node-{i}", VCPU=Inventory(total=10_000)) for i in range(6)]
        writers = [await stack.enter_async_context(open_store(pg_url, pool_size=1)) for _ in range(8)]

        async def delay(conn: Any) -> None:
            await asyncio.sleep(rng.random() * 0.01)

        for w in writers:
            pg(w)._before_commit = delay
        acknowledged: list[int] = []
        done = asyncio.Event()

        async def write(w: AllocationStore, n: int) -> None:
            for _ in range(n):
                # a few shared providers: some commands serialise, most run in parallel
                receipt = await w.set_allocations(
                    new_uuid(),
                    {rng.choice(providers): {"VCPU": 1}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
                acknowledged.extend(receipt.positions)

        subscribed: list[tuple[int, str]] = []
        paged: list[tuple[int, str]] = []

        final_head: list[int] = []
        caught_up = asyncio.Event()

        async def subscribe() -> None:
            async for e in reader.subscribe(after=0, batch_size=5):
                subscribed.append((e.position, e.event_id))
                if final_head and e.position >= final_head[0]:
                    caught_up.set()

        async def page() -> None:
            after = 0
            while True:
                batch = await reader.read(after, 7)
                paged.extend((e.position, e.event_id) for e in batch)
                if batch:
                    after = batch[-1].position
                elif done.is_set() and after == await reader.head():
                    return
                else:
                    await asyncio.sleep(0)

        async with asyncio.timeout(120):
            follower = asyncio.create_task(subscribe())
            pager = asyncio.create_task(page())
            await asyncio.gather(*(write(w, 25) for w in writers))
            done.set()
            await pager
            final_head.append(await reader.head())
            if not (subscribed and subscribed[-1][0] >= final_head[0]):
                await caught_up.wait()
            follower.cancel()

        head = await reader.head()
        log = [(e.position, e.event_id) for e in await reader.read(0, head + 1)]
        assert [p for p, _ in log] == list(range(1, head + 1)), "gap-free, in order"
        assert head == len(providers) * 2 + 8 * 25
        assert paged == log, "the paging reader saw every event once, in order"
        assert subscribed == log, "the subscriber saw every event once, in order"
        assert sorted(acknowledged) == list(range(len(providers) * 2 + 1, head + 1))
        assert (await reader.audit()).clean
        # the scenario did happen: events inserted earlier were committed later (a reader paging
        # by insertion order would have skipped them)
        rows = await admin_fetch(pg_url, "SELECT seq FROM events ORDER BY position")
        seqs = [r["seq"] for r in rows]
        assert seqs != sorted(seqs)


async def _die_after_commit(conn: Any) -> None:
    """An ``_after_commit`` hook: the process dies between its COMMIT and the sequencing."""
    raise RuntimeError("the process died between its commit and the sequencing")


async def test_events_of_a_writer_that_died_after_commit_are_still_delivered(pg_url: str) -> None:
    # a reader with a pool of one connection positions them on that connection
    async with (
        open_store(pg_url) as writer,
        open_store(pg_url, pool_size=1, statement_cache_size=0) as reader,
    ):
        rp = await make_provider(writer, VCPU=4)

        pg(writer)._after_commit = _die_after_commit
        c = new_uuid()
        with pytest.raises(StorageError):
            await allocate(writer, c, {rp: {"VCPU": 3}})
        # committed, not yet positioned: the reader positions it rather than waiting forever
        assert (await reader.stats())["backend"]["unpositioned"] == 1
        events = await reader.read(0, 10)
        assert [e.type for e in events][-1] == "AllocationsReplaced"
        assert await reader.head() == 3
        assert (await reader.allocations(c)).allocations == {rp: {"VCPU": 3}}
        assert (await reader.audit()).clean


async def test_a_read_only_session_reads_and_audits_while_events_wait_for_positions(pg_url: str) -> None:
    """Regression (rev25_g): a session that cannot write (``default_transaction_read_only`` on its
    role or database, a hot standby, a role with SELECT only) tried to position every committed
    event it found unpositioned - which, with writers running, is most of the time (between each
    commit and its sequencing) - and its head(), read(), subscribe and audit failed with "cannot
    execute UPDATE in a read-only transaction". It reads the positioned prefix; the audit waits
    for the writers to position what they committed, and says what to do if none does."""
    read_only = f"{pg_url}&default_transaction_read_only=on"
    async with open_store(pg_url) as writer, open_store(read_only, create=False) as reader:
        rp = await make_provider(writer, VCPU=4)
        pg(writer)._after_commit = _die_after_commit
        with pytest.raises(StorageError):
            await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
        # committed, not positioned: the reader cannot position it, and does not fail trying
        assert await reader.head() == 2
        assert [e.position for e in await reader.read(0, 10)] == [1, 2]
        assert [e.position async for e in reader.history(rp)] == [1, 2]
        audit = asyncio.ensure_future(reader.audit())
        await asyncio.sleep(0.3)
        assert not audit.done(), "the audit waits for the event to be positioned"
        assert await writer.head() == 3  # a session that can write positions it as it reads
        assert (await audit).clean
        assert [e.position for e in await reader.read(0, 10)] == [1, 2, 3]

        # nobody positions it: the audit gives up and says why
        with pytest.raises(StorageError):
            await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
        pg(reader).POSITIONS_WAIT = 0.3
        with pytest.raises(StorageError, match="cannot assign them") as raised:
            await reader.audit()
        assert "read-only" in raised.value.message
        pg(writer)._after_commit = None
        assert await writer.head() == 4
        assert (await reader.audit()).clean


@pytest.mark.parametrize("cannot_write", ["read-only", "select only"])
async def test_a_session_that_cannot_write_does_not_run_the_sequencer(
    pg_url: str, cannot_write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (review 32; test_a_read_only_session_reads_and_audits... failed under load, the
    writer's head 2 where 3): a session that cannot write ran the sequencer to fail at its UPDATE,
    holding the sequencer's try-lock meanwhile; a writer's catch-up that tried the lock then gave
    up ("another run positions them") and the head it read stayed behind (an audit on a read-only
    session polls it every 50 ms). Such a session does not run it now: the writers position."""
    parts = urlsplit(pg_url)
    schema = dict(parse_qsl(parts.query))["search_path"]
    role = f"evt_reader_{os.getpid()}"
    admin = await asyncpg.connect(pg_url)
    try:
        if cannot_write == "read-only":
            reader_url = f"{pg_url}&default_transaction_read_only=on"
        else:
            await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
            reader_url = urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))
        async with open_store(pg_url) as writer:
            rp = await make_provider(writer, VCPU=4)
            if cannot_write != "read-only":
                await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
                await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
            async with open_store(reader_url, create=False) as reader:
                pg(writer)._after_commit = _die_after_commit
                with pytest.raises(StorageError):
                    await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
                pg(writer)._after_commit = None
                ran: list[object] = []
                real = pg_module._sequence

                async def spy(conn: Any, *args: Any) -> Any:
                    ran.append(conn)
                    return await real(conn, *args)

                monkeypatch.setattr(pg_module, "_sequence", spy)
                assert await reader.head() == 2  # (the positioned prefix)
                assert [e.position for e in await reader.read(0, 10)] == [1, 2]
                assert ran == []  # (before: it ran, and failed at the UPDATE)
                # nor does its audit, waiting for the writers to position what they committed
                # (helper s36_P: it ran the sequencer at each of its tries, every 50 ms, holding
                # its lock until the UPDATE failed - a writer's head() then read 2, not 3, when
                # the whole suite ran under load)
                monkeypatch.setattr(pg(reader), "POSITIONS_WAIT", 0.3)
                with pytest.raises(StorageError, match="cannot assign them"):
                    await reader.audit()
                assert ran == []
                assert await writer.head() == 3
                assert len(ran) == 1
                assert await reader.head() == 3
    finally:
        if cannot_write != "read-only":
            await admin.execute(f"DROP OWNED BY {role} CASCADE")
            await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_history_shows_the_events_of_a_writer_that_died_after_commit(pg_url: str) -> None:
    """Regression (helper-27): history() read positioned rows only and never caught up, so an
    event that queries already showed (committed, its writer dead before the sequencing) was
    missing from its consumer's and provider's history until something else read the head."""
    async with open_store(pg_url) as writer, open_store(pg_url, pool_size=1) as reader:
        rp = await make_provider(writer, VCPU=4)

        pg(writer)._after_commit = _die_after_commit
        c = new_uuid()
        with pytest.raises(StorageError):
            await allocate(writer, c, {rp: {"VCPU": 3}})
        assert (await reader.allocations(c)).allocations == {rp: {"VCPU": 3}}
        assert [e.position async for e in reader.history(c)] == [3]
        assert [e.position async for e in reader.history(rp)] == [1, 2, 3]


async def test_a_writer_whose_events_another_process_positioned_does_not_wait_for_the_sequencer(
    pg_url: str,
) -> None:
    # The sequencer returns positions assigned by another process's run without taking its lock:
    # here the lock stays held by someone else, so waiting for it would hang the command.
    async with open_store(pg_url) as writer, open_store(pg_url, pool_size=1) as reader:
        rp = await make_provider(writer, VCPU=4)
        holder = await asyncpg.connect(pg_url)
        try:

            async def positioned_elsewhere(conn: Any) -> None:
                assert await reader.head() == 3  # the reader's catch-up positions the new event
                await holder.execute("SELECT pg_advisory_lock($1)", pg(writer)._key("!sequencer"))

            pg(writer)._after_commit = positioned_elsewhere
            receipt = await asyncio.wait_for(
                writer.set_allocations(
                    new_uuid(),
                    {rp: {"VCPU": 3}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                ),
                10,
            )
            assert receipt.positions == (3,)
        finally:
            await holder.close()
        events = await reader.read(0, 10)
        assert [e.position for e in events] == [1, 2, 3]
        assert (await reader.audit()).clean


async def test_a_shared_sequencer_run_positions_the_events_of_every_task_sharing_it(pg_url: str) -> None:
    # Tasks of one process that wait together share the next sequencer run. Its caller's own
    # events may already be positioned (e.g. an idempotent replay's): the run must still
    # position what the other tasks wait for, or they are told their events have no position.
    async with open_store(pg_url) as store:
        backend = pg(store)
        rp = await make_provider(store, VCPU=4)

        async def die(conn: Any) -> None:
            raise RuntimeError("the process died between its commit and the sequencing")

        backend._after_commit = die
        with pytest.raises(StorageError):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        backend._after_commit = None
        rows = await admin_fetch(pg_url, "SELECT seq FROM events WHERE position IS NULL")
        pending = rows[0]["seq"]

        await backend._seq_lock.acquire()  # a run in progress: both tasks wait for the next one
        replay = asyncio.ensure_future(backend._sequenced([1]))  # seq 1 is positioned already
        waiter = asyncio.ensure_future(backend._sequenced([pending]))
        await asyncio.sleep(0)
        backend._seq_lock.release()
        assert await replay == [1]
        assert await waiter is None  # shared the replay's run
        assert (await store.stats())["backend"]["unpositioned"] == 0
        assert await backend._positions_of([pending]) == (3,)


async def test_the_audit_sees_a_consistent_projection_while_writers_run(pg_url: str) -> None:
    async with open_store(pg_url) as auditor, open_store(pg_url) as writer:
        rp = await make_provider(writer, VCPU=Inventory(total=100_000))
        stop = asyncio.Event()

        async def keep_writing() -> int:
            n = 0
            while not stop.is_set():
                await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
                n += 1
            return n

        tasks = [asyncio.create_task(keep_writing()) for _ in range(4)]
        reports = [await auditor.audit() for _ in range(5)]
        stop.set()
        written = sum(await asyncio.gather(*tasks))
        assert written > 0
        assert all(r.clean for r in reports), [r.findings for r in reports]
        assert await auditor.rebuild() == await auditor.head()
        assert (await auditor.audit()).clean


@pytest.mark.parametrize("fenced", ["audit", "rebuild"])
async def test_commands_go_on_while_the_fence_waits_for_a_stuck_client(pg_url: str, fenced: str) -> None:
    """Regression: audit, rebuild and import take the fence (an exclusive advisory lock every
    command takes shared). Waiting for it behind a client stuck inside a command queued every new
    command behind the wait too: PostgreSQL grants lock requests in order. The fence is now
    waited for in short attempts, between which commands go through; it is taken once the stuck
    client goes away."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=Inventory(total=100_000))
        async with _another_client_holding(pg_url, store, "!fence", shared=True) as (_, tr):
            waiting = asyncio.create_task(getattr(store, fenced)())
            await asyncio.sleep(0.5)  # (the fence is being waited for)
            assert not waiting.done()
            for _ in range(5):  # before the fix: each of these hung until the stuck client left
                await asyncio.wait_for(allocate(store, new_uuid(), {rp: {"VCPU": 1}}), timeout=10)
            assert not waiting.done()
            await tr.rollback()
            await asyncio.wait_for(waiting, timeout=10)
        assert (await store.audit()).clean


async def _search_path(store: AllocationStore) -> str:
    async with pg(store)._connection() as conn:
        return str(await conn.fetchval("SHOW search_path"))


@contextlib.asynccontextmanager
async def _another_client_holding(
    pg_url: str, store: AllocationStore, name: str, shared: bool = False
) -> AsyncIterator[tuple[Any, Any]]:
    """Another client inside a transaction, holding the advisory lock evstore takes for ``name``
    (as a command of another process would): yields the connection and its transaction."""
    other = await asyncpg.connect(pg_url, server_settings={"search_path": await _search_path(store)})
    try:
        tr = other.transaction()
        await tr.start()
        lock = "pg_advisory_xact_lock_shared" if shared else "pg_advisory_xact_lock"
        await other.execute(f"SELECT {lock}($1)", pg(store)._key(name))
        yield other, tr
    finally:
        await other.close()


async def test_reads_go_on_while_commands_wait_for_another_processs_fence(pg_url: str) -> None:
    """Regression (helper-29): while another process held the fence (its rebuild or import),
    this process's commands waiting for it took every pooled connection, and reads - which take
    no lock - waited for a connection as long as the fence was held."""
    async with open_store(pg_url, pool_size=3) as store:
        rps = [await make_provider(store, VCPU=100) for _ in range(6)]
        async with _another_client_holding(pg_url, store, "!fence") as (_, tr):
            # (on six providers: commands naming one entity would wait for each other, not the pool)
            claims = [asyncio.ensure_future(allocate(store, new_uuid(), {rp: {"VCPU": 1}})) for rp in rps]
            await asyncio.sleep(0.3)
            assert not any(c.done() for c in claims)  # (they wait for the fence)
            async with asyncio.timeout(10):  # (before the fix: until the fence was let go, below)
                assert await store.head() == 12
                assert (await store.usage(rps[0])).usages == {"VCPU": 0}
                assert [e.position async for e in store.history(rps[0])] == [1, 2]
            await tr.rollback()
        await asyncio.wait_for(asyncio.gather(*claims), 10)
        assert [(await store.usage(rp))["VCPU"] for rp in rps] == [1] * 6


async def test_a_command_waiting_for_another_process_holds_back_only_its_own_entities(pg_url: str) -> None:
    """Regression: a process ran one group commit at a time and answered a group when all of it
    had ended, so one command waiting for a lock another process held (here a raw connection in an
    open transaction) held back every command of its group and every group queued after it, on
    any entity. Now each command starts when it is queued and is answered when it ends; only the
    commands naming the same entity wait for it, and they keep their order."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=Inventory(total=100_000))
        held, free = new_uuid(), new_uuid()
        await allocate(store, held, {rp: {"VCPU": 1}})
        async with _another_client_holding(pg_url, store, f"consumer:{held}") as (_, tr):
            blocked = asyncio.create_task(store.delete_consumer(held))
            after_it = asyncio.create_task(
                store.set_allocations(
                    held, {}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
                )
            )
            await asyncio.sleep(0.2)
            for _ in range(3):  # queued alongside and after it, on other consumers of the same provider
                await asyncio.wait_for(allocate(store, free, {rp: {"VCPU": 1}}), timeout=10)
                free = new_uuid()
            assert not blocked.done() and not after_it.done()
            await tr.rollback()
            await asyncio.wait_for(blocked, timeout=10)
            with pytest.raises(EvstoreError):  # (it ran after the delete, as queued: a tombstone)
                await asyncio.wait_for(after_it, timeout=10)
        assert (await store.audit()).clean


async def test_a_command_whose_caller_gives_up_before_it_begins_does_not_run(pg_url: str) -> None:
    """Found by review: commands start as soon as they are queued, so one waiting behind an earlier
    command on its consumer was no longer dropped when its caller stopped waiting (a timeout): it
    ran later, unannounced. It is now asked before its transaction begins."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=100)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        async with _another_client_holding(pg_url, store, f"consumer:{c}") as (_, tr):
            first = asyncio.create_task(allocate(store, c, {rp: {"VCPU": 2}}, generation=1))
            await asyncio.sleep(0.2)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(allocate(store, c, {rp: {"VCPU": 50}}, generation=2), timeout=0.3)
            await tr.rollback()
            await asyncio.wait_for(first, timeout=10)
        while pg(store)._last_of:  # (every job has ended)
            await asyncio.sleep(0.05)
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 2}}
        assert await store.head() == 4


async def test_a_cancelled_job_does_not_let_its_successor_overtake_its_predecessor(pg_url: str) -> None:
    """Found by review: a job task cancelled while it waited for its predecessor released its
    successor at once, which then ran while the predecessor's transaction was still open."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=100)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        async with _another_client_holding(pg_url, store, f"consumer:{c}") as (other, tr):
            jobs = []
            for amount in (2, 3, 4):
                jobs.append(
                    asyncio.ensure_future(
                        store.set_allocations(
                            c,
                            {rp: {"VCPU": amount}},
                            project_id="p",
                            user_id="u",
                            consumer_type="I",
                            generation=1 if amount == 2 else 2,
                        )
                    )
                )
            await asyncio.sleep(0.3)
            running = sorted(store._running, key=lambda t: int(t.get_name().rsplit("-", 1)[1]))
            assert len(running) == 3 and not any(t.done() for t in running)
            running[1].cancel()  # (the middle job's own task, waiting for the first: started second)
            await asyncio.sleep(0.3)
            # (this consumer's lock only: other tests on the same server wait for locks of their own)
            waiting = await other.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid::bigint = ($1::bigint >> 32) & 4294967295 "
                "AND objid::bigint = $1::bigint & 4294967295",
                pg(store)._key(f"consumer:{c}"),
            )
            assert waiting == 1  # (the first job only: the third has not begun)
            assert not jobs[
                2
            ].done()  # (before the fix: it ran, and failed on the first's lock or overtook it)
            await tr.rollback()
            outcomes = await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), timeout=10)
        assert not isinstance(outcomes[0], BaseException) and not isinstance(outcomes[2], BaseException)
        assert isinstance(outcomes[1], StorageError)
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 4}}


async def test_a_tombstone_reports_its_position(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        receipt = await store.delete_consumer(c)
        view = await store.allocations(c)
        assert view.deleted and view.deleted_at == receipt.position
        with pytest.raises(EvstoreError, match=f"deleted at position {receipt.position}"):
            await allocate(store, c, {rp: {"VCPU": 1}})


@contextlib.asynccontextmanager
async def _deleted_not_positioned_yet(writer: AllocationStore) -> AsyncIterator[tuple[str, str]]:
    """A consumer holding 1 VCPU, deleted by ``writer`` whose sequencer is held back after the
    delete's COMMIT: inside the block, the tombstone is committed at position 4 but has none yet.
    Yields (provider, consumer)."""
    rp = await make_provider(writer, VCPU=4)
    c = new_uuid()
    await allocate(writer, c, {rp: {"VCPU": 1}})
    committed, go_on = asyncio.Event(), asyncio.Event()

    async def slow_to_sequence(conn: Any) -> None:
        committed.set()
        await go_on.wait()

    pg(writer)._after_commit = slow_to_sequence
    deleting = asyncio.ensure_future(writer.delete_consumer(c))
    try:
        async with asyncio.timeout(30):
            await committed.wait()
            yield rp, c
    finally:
        go_on.set()
    assert (await deleting).position == 4


async def test_a_tombstone_not_positioned_yet_is_reported_at_its_position(pg_url: str) -> None:
    """Found by review (helper-48): between a delete's commit and the sequencer's run (or for
    good, its writer dead after committing) the projection holds the tombstone's -seq, and
    ``allocations(c).deleted_at`` and the ConsumerDeleted refusing a write to it reported that
    negative number as the position it was deleted at. (The reader has a pool of one connection:
    it positions the tombstone on it, outside the command's transaction.)"""
    async with open_store(pg_url) as writer, open_store(pg_url, pool_size=1) as reader:
        async with _deleted_not_positioned_yet(writer) as (rp, c):
            view = await reader.allocations(c)
            assert view.deleted and view.deleted_at == 4
            with pytest.raises(EvstoreError, match="deleted at position 4;") as info:
                await allocate(reader, c, {rp: {"VCPU": 1}})
            assert info.value.details["deleted_at"] == 4
            with pytest.raises(NotFound, match=r"\(deleted at position 4\)"):
                await reader.release(c)
        assert (await reader.audit()).clean


async def test_a_read_only_session_waits_for_a_tombstones_position(pg_url: str) -> None:
    """Regression (rev25_g): a session that cannot write, finding a tombstone committed but not
    positioned yet, ran the sequencer itself, and ``allocations(c)`` of a consumer deleted a
    moment before failed with "cannot execute UPDATE in a read-only transaction". It waits for
    the writer to position it."""
    read_only = f"{pg_url}&default_transaction_read_only=on"
    async with open_store(pg_url) as writer, open_store(read_only, create=False) as reader:
        async with _deleted_not_positioned_yet(writer) as (_, c):
            viewing = asyncio.ensure_future(reader.allocations(c))
            await asyncio.sleep(0.3)
            assert not viewing.done(), "it waits for the tombstone's position"
        view = await viewing
        assert view.deleted and view.deleted_at == 4


async def test_a_tombstone_not_positioned_yet_is_positioned_even_with_one_attempt(pg_url: str) -> None:
    """Found by review (helper-49): a command whose slice holds a tombstone not positioned yet
    rolls back, positions it and decides again - but that round counted as a failed attempt, so
    with ``max_retries=1`` (one attempt, no retry of deadlocks) a write to a consumer deleted a
    moment before by another process failed with evstore.storage ('did not get positions')
    instead of ConsumerDeleted. Nothing failed: the round is no retry of a fault."""
    async with open_store(pg_url) as writer, open_store(pg_url, max_retries=1) as other:
        async with _deleted_not_positioned_yet(writer) as (rp, c):
            with pytest.raises(ConsumerDeleted, match="deleted at position 4;"):
                await allocate(other, c, {rp: {"VCPU": 1}})


async def test_a_tombstone_naming_no_event_is_a_damaged_projection(pg_url: str) -> None:
    """Found by review (helper-49, stop 23): a tombstone row whose ``deleted_at`` is a ``-seq`` no
    event has (a damaged projection) made every read and command on the consumer fail with
    evstore.storage "Committed events [999999] did not get positions" after three sequencer runs:
    no event will ever get that position. It is ProjectionCorrupt, which says to rebuild, and a
    rebuild repairs it."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        deleted = (await store.delete_consumer(c)).position
        await store.backend.tamper(  # type: ignore[attr-defined]
            "UPDATE p_consumers SET deleted_at = -999999 WHERE uuid = ?", (c,)
        )
        with pytest.raises(ProjectionCorrupt, match="rebuild"):
            await store.allocations(c)
        head = await store.head()
        with pytest.raises(ProjectionCorrupt, match="rebuild"):
            await allocate(store, c, {rp: {"VCPU": 1}})
        assert await store.head() == head
        # (a -seq the events' sequence never handed out is damage, not a lost event: the audit
        # says drift, not log_truncated - once its own rule said so while rebuild's did not)
        report = await store.audit()
        reasons = [f.details.get("reason") for f in report.integrity]
        assert report.drift and "log_truncated" not in reasons, report.findings
        await store.rebuild()
        assert (await store.allocations(c)).deleted_at == deleted
        with pytest.raises(ConsumerDeleted):
            await allocate(store, c, {rp: {"VCPU": 1}})


# --- many processes, faults -------------------------------------------------------------------


async def test_four_processes_with_their_own_pools_share_providers(pg_url: str, tmp_path: Path) -> None:
    async with open_store(pg_url) as store:
        providers = [await make_provider(store, f"node-{i}", VCPU=Inventory(total=12)) for i in range(3)]
    n = 60
    outs = [tmp_path / f"out-{i}.jsonl" for i in range(4)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.mp_worker", pg_url, str(seed), str(n), str(out), env=env
        )
        for seed, out in enumerate(outs)
    ]
    assert await asyncio.gather(*(p.wait() for p in procs)) == [0, 0, 0, 0]
    acknowledged: list[int] = []
    for out in outs:
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(lines) == n
        for line in lines:
            acknowledged.extend(line.get("positions", []))
    async with open_store(pg_url) as store:
        head = await store.head()
        events = await store.read(0, head + 10)
        assert [e.position for e in events] == list(range(1, head + 1))
        assert len(acknowledged) == len(set(acknowledged)), "no position acknowledged twice"
        assert set(range(1, head + 1)) - set(acknowledged) == set(range(1, 2 * len(providers) + 1))
        report = await store.audit()
        assert report.clean, report.findings  # never over capacity at any position, no drift
        for p in providers:
            assert (await store.usage(p)).usages.get("VCPU", 0) <= 12


async def test_a_connection_killed_mid_command_fails_it_cleanly(pg_url: str) -> None:
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)

        async def kill(conn: Any) -> None:
            await admin_fetch(pg_url, "SELECT pg_terminate_backend($1)", conn.get_server_pid())

        pg(store)._before_commit = kill
        c = new_uuid()
        with pytest.raises(StorageError) as info:
            await allocate(store, c, {rp: {"VCPU": 2}})
        assert info.value.code == "evstore.storage"
        pg(store)._before_commit = None
        assert await store.head() == 2, "nothing of the command was written"
        assert (await store.allocations(c)).allocations == {}
        assert (await store.usage(rp)).usages["VCPU"] == 0
        await allocate(store, c, {rp: {"VCPU": 2}})  # the pool recovered
        assert (await store.usage(rp)).usages["VCPU"] == 2
        assert (await store.audit()).clean


async def test_a_committed_command_whose_positions_time_out_is_not_called_rolled_back(pg_url: str) -> None:
    """Positions are assigned after COMMIT, under the sequencer's lock (held for a whole audit,
    rebuild or import by any process). A command timing out there is committed: it was reported
    'rolled back' (outcome_unknown False), inviting a retry without its key - a double apply."""
    async with open_store(pg_url, command_timeout=0.5) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()

        def claim() -> Any:
            return store.set_allocations(
                consumer, {rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                generation=None, idempotency_key="claim-1",
            )  # fmt: skip

        async with _another_client_holding(pg_url, store, "!sequencer") as (_, tx):
            with pytest.raises(StorageError) as caught:
                await claim()
            await tx.rollback()
        assert caught.value.details["committed"] is True
        assert caught.value.details["outcome_unknown"] is True
        assert "rolled back" not in caught.value.message
        assert "same idempotency key" in caught.value.message
        assert (await store.allocations(consumer)).allocations == {rp: {"VCPU": 2}}
        receipt = await claim()  # the retry the message asks for: its receipt
        assert receipt.replayed and receipt.positions == (await store.head(),)
        assert (await store.usage(rp)).usages == {"VCPU": 2}
        assert (await store.audit()).clean


async def test_a_committed_command_without_a_key_is_not_told_to_retry_with_its_key(pg_url: str) -> None:
    """Regression: a command sent without an idempotency key, committed but left without its
    positions (the sequencer's lock held past command_timeout), failed with "retry with the same
    idempotency key to get its receipt": there is no key, and a retry without one runs the
    command again. The message now says it was committed and must not be retried."""
    async with open_store(pg_url, command_timeout=0.5) as store:
        await make_provider(store, VCPU=8)
        late = new_uuid()
        async with _another_client_holding(pg_url, store, "!sequencer") as (_, tx):
            with pytest.raises(StorageError) as caught:
                await store.create_provider(late, "late")
            await tx.rollback()
        message = caught.value.message
        assert caught.value.details["committed"] is True
        assert "same idempotency key" not in message, message
        assert "committed" in message and "do not retry" in message, message
        assert (late, "late") in await store.providers()  # committed, once
        assert await store.head() == 3 and (await store.audit()).clean


def test_a_commit_cut_short_without_a_key_is_not_told_to_retry_with_its_key() -> None:
    """The same for a connection lost during COMMIT: 'retry with the same idempotency key to be
    sure' was said to a command that had none."""
    from evstore.log import postgres as pgmod

    lost = asyncpg.exceptions.ConnectionDoesNotExistError("connection was closed in the middle of operation")
    keyless = pgmod._storage_error(lost, "running a command", committing=True, keyed=False)
    assert keyless.details["outcome_unknown"] is True
    assert "may or may not have been committed" in keyless.message
    assert "same idempotency key" not in keyless.message, keyless.message
    keyed = pgmod._storage_error(lost, "running a command", committing=True)
    assert "retry with the same idempotency key" in keyed.message


async def test_a_command_timing_out_says_command_timeout_not_a_lost_connection(pg_url: str) -> None:
    """Regression: asyncpg's command_timeout raises TimeoutError, an OSError on Python 3.11, so a
    command that waited longer than command_timeout (here for a table lock another session held)
    failed with "Lost the connection to PostgreSQL while running a command: TimeoutError": a
    network fault to look for, where the setting the caller chose had run out."""
    async with open_store(pg_url, command_timeout=0.5) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        other = await asyncpg.connect(pg_url)
        try:
            tx = other.transaction()
            await tx.start()
            await other.execute("LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            with pytest.raises(StorageError) as caught:
                await allocate(store, consumer, {rp: {"VCPU": 2}})
            await tx.rollback()
        finally:
            await other.close()
        message = caught.value.message
        assert "Lost the connection" not in message and "TimeoutError" not in message, message
        assert "command_timeout (0.5 s)" in message and "it was rolled back" in message, message
        assert caught.value.details["outcome_unknown"] is False
        assert await store.head() == 2 and (await store.allocations(consumer)).allocations == {}
        await allocate(store, consumer, {rp: {"VCPU": 2}})  # the lock gone: it goes through
        assert (await store.audit()).clean


async def test_a_command_failing_on_a_server_error_or_no_connection_says_it_was_not_committed(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper-59): a command refused by the server inside its transaction (a
    lock_timeout a DBA set on the role, a statement_timeout) or that could not get a connection
    at all (the server restarting) failed with a StorageError that said neither that it was
    rolled back nor that it was not run, and had no ``outcome_unknown``: only a lost connection
    said so, though these are as certain."""
    async with open_store(pg_url + "&lock_timeout=50ms") as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        async with _another_client_holding(pg_url, store, f"consumer:{consumer}") as (_, tr):
            with pytest.raises(StorageError) as caught:
                await allocate(store, consumer, {rp: {"VCPU": 2}})
            await tr.rollback()
        assert caught.value.details["sqlstate"] == "55P03"
        assert caught.value.details["outcome_unknown"] is False
        assert "lock timeout" in caught.value.message and "it was rolled back" in caught.value.message
        assert (await store.allocations(consumer)).allocations == {}

        async def refused(*args: Any, **kwargs: Any) -> Any:  # (a server down or restarting)
            raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5432)")

        with monkeypatch.context() as patched:
            patched.setattr(asyncpg.pool.Pool, "acquire", refused)
            with pytest.raises(StorageError) as caught:
                await allocate(store, consumer, {rp: {"VCPU": 2}})
        assert caught.value.details["outcome_unknown"] is False
        assert "Connect call failed" in caught.value.message and "not run" in caught.value.message
        await allocate(store, consumer, {rp: {"VCPU": 2}})  # the server back: it goes through
        assert await store.head() == 3 and (await store.audit()).clean


def test_a_connection_killed_under_asyncpg_counts_as_lost() -> None:
    """A pooled connection the server killed surfaces as asyncpg's InternalClientError ('cannot
    switch to state ...'), and its proxy refuses is_closed(): both were taken for bugs, so a
    committed command failed with 'Storage failure: InternalClientError' and no outcome_unknown
    (seen with pg_terminate_backend during a load)."""
    from evstore.log import postgres as pgmod

    killed = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    committing = pgmod._storage_error(killed, "running a command", committing=True)
    assert committing.details["outcome_unknown"] is True
    assert "may or may not have been committed" in committing.message
    assert pgmod._storage_error(killed, "running a command").details["outcome_unknown"] is False

    class Detached:
        def is_closed(self) -> bool:
            raise asyncpg.InterfaceError("cannot call Connection.is_closed(): connection has been released")

    assert pgmod._closed(Detached())


async def test_a_free_connection_slot_goes_to_the_oldest_waiting_command() -> None:
    """A command that waited for an earlier one on its entity does not queue again behind every
    command started since: slots go to the lowest start order; a cancelled waiter passes its turn."""
    from evstore.log.postgres import _OldestFirst

    slots = _OldestFirst(1)
    await slots.acquire(1)
    got: list[int] = []

    async def wait(order: int) -> None:
        await slots.acquire(order)
        got.append(order)

    tasks = {order: asyncio.create_task(wait(order)) for order in (9, 7, 8, 6, 5)}
    await asyncio.sleep(0)
    tasks[6].cancel()
    await asyncio.sleep(0)
    tasks[5].cancel()  # (cancelled; its entry is popped by a release before it resumes)
    slots.release()
    (ended,) = await asyncio.gather(tasks[5], return_exceptions=True)
    assert isinstance(ended, asyncio.CancelledError)  # (not a ValueError from its clean-up)
    assert got == [7]
    for expected in (8, 9):
        slots.release()
        await asyncio.sleep(0)
        assert got[-1] == expected
    slots.release()  # (no one waits: the slot is free again)
    await asyncio.wait_for(slots.acquire(10), timeout=1)
    assert got == [7, 8, 9]


async def test_damaged_projection_rows_fail_typed_and_a_providers_drift_names_its_last_event(
    pg_url: str,
) -> None:
    """Regression (helper-33, helper-34): an allocation row tampered to -5 let the consumer's next
    command decide against it; both PostgreSQL load paths (a command's lock-and-load, a query's
    load) now refuse it. A provider's drift came with no position; it names its last event."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        last = await store.head()
        await allocate(store, new_uuid(), {await make_provider(store, VCPU=8): {"VCPU": 1}})
        backend = pg(store)
        await backend.tamper("UPDATE p_allocations SET used = -5 WHERE consumer = $1", (c,))
        with pytest.raises(ProjectionCorrupt, match="an allocation of -5 VCPU"):
            await store.allocations(c)
        head = await store.head()
        with pytest.raises(ProjectionCorrupt, match="an allocation of -5 VCPU"):
            await store.set_allocations(
                c, {rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=1
            )
        assert await store.head() == head
        await store.rebuild()
        await backend.tamper("UPDATE p_providers SET generation = 9 WHERE uuid = $1", (rp,))
        [drift] = (await store.audit()).drift
        assert drift.details == {"provider": rp, "field": "generation"} and drift.positions == (last,)


@pytest.mark.parametrize(
    "damage",
    [
        "DROP TABLE p_allocations",
        "DROP TABLE p_consumers CASCADE",
        "DROP TABLE p_classes",
        "DROP TABLE snapshots",
    ],
)
async def test_a_lost_projection_table_is_refolded_from_the_log_on_open(pg_url: str, damage: str) -> None:
    """helper-36: with a projection table dropped, every later command, query, audit and even
    rebuild failed with "relation ... does not exist", and nothing in evstore could repair it
    (SQLite refolds it on open). Now the open re-creates what is lost and refolds the log into
    it, holding writers back."""
    async with open_store(pg_url) as store:
        await store.create_resource_class("CUSTOM_GPU")
        rp = await make_provider(store, VCPU=4, CUSTOM_GPU=1)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 3, "CUSTOM_GPU": 1}})
        await store.take_snapshots()
        await pg(store).tamper(damage)
    async with open_store(pg_url) as store:
        assert (await store.allocations(c)).allocations == {rp: {"VCPU": 3, "CUSTOM_GPU": 1}}
        with pytest.raises(CapacityExceeded):
            await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert (await store.usage(rp)).usages == {"VCPU": 4, "CUSTOM_GPU": 1}
        assert (await store.state_at(position=3)).state.consumers == {}
        assert (await store.audit()).clean


async def test_rebuild_repairs_lost_tables_and_indexes_of_an_open_store(pg_url: str) -> None:
    """helper-36: rebuild failed on a dropped table, and rebuild(full=True) did not restore a
    dropped index although it "rewrites every row and index"."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=4)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
        await pg(store).tamper("DROP INDEX p_allocations_provider")
        await pg(store).tamper("DROP TABLE p_classes")
        await store.rebuild(full=True)
        rows = await admin_fetch(
            pg_url,
            "SELECT to_regclass('p_allocations_provider') IS NOT NULL, to_regclass('p_classes') IS NOT NULL",
        )
        assert tuple(rows[0]) == (True, True)
        assert (await store.provider_allocations(rp)) == {c: {"VCPU": 2}}
        assert (await store.audit()).clean


async def test_a_version_4_store_learns_its_migrations_instance_types_on_open(pg_url: str) -> None:
    """Migration 5 adds p_consumers.instance_type (and the functions that write and load it); the
    open then refolds the projection, so a migration started before the upgrade still reverts to
    its instance's type."""
    from evstore.log.postgres import MIGRATIONS

    async with open_store(pg_url) as store:
        src = await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}}, consumer_type="BAREMETAL")
        await store.start_migration(inst, mig)
        # what version 4 had: the column, the view and the write-path functions of migrations 1-4
        await pg(store).tamper(
            "DROP VIEW p_consumers_resolved; ALTER TABLE p_consumers DROP COLUMN instance_type; "
            "DROP FUNCTION evstore_write; DROP FUNCTION evstore_lock_load; "
            "DROP FUNCTION evstore_lock_load_near"
        )
        first = MIGRATIONS[0]
        view = first[first.index("CREATE VIEW") : first.index("CREATE FUNCTION evstore_lock(")]
        await pg(store).tamper(view)
        await pg(store).tamper(MIGRATIONS[2])
        await pg(store).tamper(MIGRATIONS[3])
        await pg(store).tamper("UPDATE evstore_meta SET value = '4' WHERE key = 'schema_version'")
    async with open_store(pg_url) as store:
        assert (await store.audit()).clean
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"
        assert (await store.audit()).clean
    rows = await admin_fetch(pg_url, "SELECT value FROM evstore_meta WHERE key = 'schema_version'")
    assert rows[0]["value"] == str(SCHEMA_VERSION)


async def test_a_version_5_store_gets_the_sequencer_that_plans_its_lookups_once(pg_url: str) -> None:
    """Migration 6 replaces evstore_sequence (its position lookups in its own statements, not
    through evstore_positions, which was planned anew at each call) and keeps what migration 4
    gave it: waiting for its lock whatever the URL's lock_timeout."""
    from evstore.log.postgres import MIGRATIONS

    sequencer = "SELECT prosrc, proconfig FROM pg_proc WHERE proname = 'evstore_sequence'"
    sequencer += " AND pg_function_is_visible(oid)"
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
        # version 5's sequencer: as migrations 3 and 4 made it
        sql = MIGRATIONS[2]
        await pg(store).tamper(sql[sql.index("CREATE OR REPLACE FUNCTION evstore_sequence") :])
        await pg(store).tamper(MIGRATIONS[3])
        await pg(store).tamper("UPDATE evstore_meta SET value = '5' WHERE key = 'schema_version'")
    rows = await admin_fetch(pg_url, sequencer)
    assert len(rows) == 1 and "evstore_positions(want)" in rows[0]["prosrc"]
    async with open_store(pg_url) as store:
        receipt = await store.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 3}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        assert receipt.positions == (await store.head(),)
        assert (await store.usage(rp)).usages == {"VCPU": 5}
        assert (await store.audit()).clean
    rows = await admin_fetch(pg_url, sequencer)
    assert len(rows) == 1 and "evstore_positions" not in rows[0]["prosrc"]
    assert "lock_timeout=0" in rows[0]["proconfig"]
    rows = await admin_fetch(pg_url, "SELECT value FROM evstore_meta WHERE key = 'schema_version'")
    assert rows[0]["value"] == str(SCHEMA_VERSION) == "9"


async def test_a_full_rebuild_writes_the_history_index_again(pg_url: str) -> None:
    """Regression (helper-39): rebuild(full=True) on PostgreSQL only reindexed the projection: a
    history index that lost rows kept giving history() and the entity slices wrong answers
    (SQLite's full rebuild writes the index again from the log)."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 1}})
        at = await store.head()
        await allocate(store, c, {rp: {"VCPU": 3}}, generation=1)
        stray = "INSERT INTO event_entities SELECT 'consumer:' || $1, seq FROM events WHERE position = 1"
        await pg(store).tamper(stray, (c,))  # (a row naming the consumer for the provider's creation)
        lost = "DELETE FROM event_entities WHERE seq = (SELECT seq FROM events WHERE position = $1)"
        await pg(store).tamper(lost, (at + 1,))
        assert [r.position async for r in store.history(c)] == [1, at]  # (the damage, shown)
        await store.rebuild(full=True)
        assert [r.position async for r in store.history(c)] == [at, at + 1]
        assert await (await store.state_at(position=at + 1, consumer=c)).allocations(c) == {rp: {"VCPU": 3}}
        assert (await (await store.state_at(position=at + 1, provider=rp)).usage(rp)).usages == {"VCPU": 3}
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # the index goes on being written
        assert [r.position async for r in store.history(rp)][-1] == await store.head()


def _downgrade_to_v4_sql() -> list[str]:
    """What a version-4 PostgreSQL store has (as test_postgres's upgrade test builds it)."""
    from evstore.log.postgres import MIGRATIONS

    first = MIGRATIONS[0]
    view = first[first.index("CREATE VIEW") : first.index("CREATE FUNCTION evstore_lock(")]
    return [
        "DROP VIEW p_consumers_resolved; ALTER TABLE p_consumers DROP COLUMN instance_type; "
        "DROP FUNCTION evstore_write; DROP FUNCTION evstore_lock_load; DROP FUNCTION evstore_lock_load_near",
        view,
        MIGRATIONS[2],
        MIGRATIONS[3],
        "UPDATE evstore_meta SET value = '4' WHERE key = 'schema_version'",
    ]


async def test_pg_upgrade_refold_is_not_lost_when_the_first_open_fails_after_migrating(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (helper-41): migration 5 committed schema_version = 5, and the refold that fills
    p_consumers.instance_type ran later, keyed on an in-memory flag: an open that failed between
    the two (statement_timeout on a large store's refold, a kill) left a v5 store never refolded,
    and a revert of a migration started before the upgrade restored its instance as INSTANCE.
    The pending refold is now a row of evstore_meta, written with the migration."""
    import asyncpg

    from evstore.log import postgres

    async with open_store(pg_url) as store:
        src = await make_provider(store, VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {src: {"VCPU": 2}}, consumer_type="BAREMETAL")
        await store.start_migration(inst, mig)
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]

    async def interrupted(*args: object, **kwargs: object) -> int:
        raise asyncpg.QueryCanceledError("canceling statement due to statement timeout")

    with monkeypatch.context() as m:
        m.setattr(postgres, "_rebuild", interrupted)
        with pytest.raises(Exception):  # noqa: B017 (the first open fails: fine)
            async with open_store(pg_url):
                pass
    async with open_store(pg_url) as store:
        report = await store.audit()
        assert report.clean, [f.message for f in report.findings]
        await store.revert_migration(mig)
        assert (await store.allocations(inst)).consumer_type == "BAREMETAL"


async def test_a_read_only_session_opening_an_older_store_is_told_it_needs_the_upgrade(pg_url: str) -> None:
    """A read-only session (a hot standby, a read-only role or database) can read a store, but not
    one an older evstore wrote: opening it upgrades it first. That was refused as "PostgreSQL
    error while migrating: cannot execute ALTER FUNCTION in a read-only transaction" ("must be
    owner of function evstore_sequence" for a role with SELECT only), which says neither that the
    store is older nor what to do. It is now a SchemaVersionError that says both; nothing changes."""
    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=8)
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]
    with pytest.raises(SchemaVersionError) as raised:
        async with open_store(f"{pg_url}&default_transaction_read_only=on", create=False):
            pass
    assert raised.value.details["found"] == 4
    assert "schema version 4, written by an older evstore" in raised.value.message
    assert "open it once with the role that owns the store, on the primary" in raised.value.message
    async with open_store(pg_url) as store:  # (the owner upgrades it, and all is there)
        assert await store.head() == 2 and (await store.audit()).clean


async def test_upgrade_false_refuses_an_older_store_and_the_cli_commands_that_only_read_open_so(
    pg_url: str,
) -> None:
    """Regression: the CLI's read-only commands (audit, history, state, ...) refused a SQLite store
    an older evstore wrote rather than upgrade it under the older processes still using it, but
    opened a PostgreSQL one as every open does, which upgrades it. ``upgrade=False`` (both
    backends, and the CLI's read-only commands) refuses it with ``evstore.schema.version`` and
    writes nothing; ``evstore upgrade --url`` upgrades it and says from what."""
    from tests.test_cli_support import evstore as run_cli

    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=8)
        for sql in _downgrade_to_v4_sql():
            await store.backend.tamper(sql)  # type: ignore[attr-defined]

    async def version() -> str:
        conn = await asyncpg.connect(pg_url)
        try:
            return str(await conn.fetchval("SELECT value FROM evstore_meta WHERE key = 'schema_version'"))
        finally:
            await conn.close()

    for options in ({"upgrade": False}, {"upgrade": False, "create": False}):
        with pytest.raises(SchemaVersionError) as raised:
            async with open_store(pg_url, **options):  # type: ignore[arg-type]
                pass
        assert raised.value.details["found"] == 4 and raised.value.details["supported"] == SCHEMA_VERSION
        assert "upgrade=False" in raised.value.message and "nothing was written" in raised.value.message
    with pytest.raises(SchemaVersionError):
        async with open_store(f"{pg_url}&upgrade=false"):
            pass
    audit = await asyncio.to_thread(run_cli, "audit", "--url", pg_url)
    assert audit.returncode == 1, audit.stdout + audit.stderr
    assert audit.stderr.startswith("error: evstore.schema.version: "), audit.stderr
    assert "schema version 4" in audit.stderr and "evstore upgrade --url" in audit.stderr, audit.stderr
    assert await version() == "4"  # (nothing written by any of them)

    upgraded = await asyncio.to_thread(run_cli, "upgrade", "--url", pg_url, "--json")
    assert upgraded.returncode == 0, upgraded.stderr
    assert json.loads(upgraded.stdout)["upgraded_from"] == 4
    assert await version() == str(SCHEMA_VERSION)
    again = await asyncio.to_thread(run_cli, "upgrade", "--url", pg_url, "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["upgraded_from"] is None, again.stderr
    async with open_store(pg_url, upgrade=False) as store:  # (a current store opens as ever)
        assert store.backend.upgraded_from is None
        assert await store.head() == 2 and (await store.audit()).clean


async def test_reads_on_pooled_connections_the_server_closed_are_tried_again(pg_url: str) -> None:
    """Regression (helper-59): a read handed a pooled connection that the server had closed while
    it sat idle (a restart, pg_terminate_backend, a firewall), before asyncpg noticed, failed
    with evstore.storage - once per such connection; commands already retried. A read is safe to
    repeat: it now runs again on a fresh connection."""
    app = f"evt_idle_{new_uuid()[:8]}"
    async with open_store(f"{pg_url}&application_name={app}", pool_size=2, min_pool_size=2) as store:
        rp = await make_provider(store, VCPU=4)
        await asyncio.gather(store.head(), store.usage(rp))  # (both connections made, now idle)

        async def terminate() -> int:
            conn = await asyncpg.connect(pg_url)
            try:
                return int(
                    await conn.fetchval(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE application_name = $1 AND pid <> pg_backend_pid()",
                        app,
                    )
                )
            finally:
                await conn.close()

        async def head() -> Any:
            return await store.head()

        async def usage() -> Any:
            return dict(await store.usage(rp))

        async def positions() -> Any:
            return [e.position for e in await store.read(0, 10)]

        for read, expected in ((head, 2), (usage, {"VCPU": 0}), (positions, [1, 2])):
            # Killed from another thread while this loop is blocked: asyncpg cannot notice first.
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                assert pool.submit(asyncio.run, terminate()).result() >= 1
            time.sleep(0.3)  # (the backends exit; the loop still does not run)
            assert await read() == expected


async def test_a_pool_larger_than_the_server_allows_waits_for_its_own_connections(pg_url: str) -> None:
    """Regression (rev25_g): with ``pool_size`` above what the server lets the role have
    (``max_connections``, the role's ``CONNECTION LIMIT``), every command or read that needed one
    more connection failed at once with "too many connections" - 32 of 40 concurrent commands,
    5 of them committed but reported as failed (their sequencing needed a connection). They
    wait for one of the pool's connections instead, as for a full pool."""
    parts = urlsplit(pg_url)
    schema = dict(parse_qsl(parts.query))["search_path"]
    role = f"evt_limited_{os.getpid()}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER CONNECTION LIMIT 2")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {role}')
        limited = urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))
        async with open_store(limited, pool_size=6) as store:
            providers = [await make_provider(store, VCPU=100) for _ in range(6)]
            receipts = await asyncio.gather(
                *(allocate(store, new_uuid(), {providers[i % 6]: {"VCPU": 1}}) for i in range(24)),
                *(store.head() for _ in range(6)),
            )
            assert len(receipts) == 30
            assert await store.head() == 12 + 24
            assert (await store.audit()).clean
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_a_store_found_further_along_the_search_path_shares_its_locks(pg_url: str) -> None:
    """Regression (rev25_g): lock keys were made from current_schema(), the first schema of the
    search_path that exists, though the tables were found further along it (a role's
    ``search_path = "$user", public`` once a schema named after the role exists, empty). Two
    processes using one store through different search_paths then took different locks - the
    fence, the sequencer's, every entity's - and rebuild copied into the empty schema and failed."""
    parts = urlsplit(pg_url)
    query = dict(parse_qsl(parts.query))
    store_schema, empty = query["search_path"], f"{query['search_path']}_first"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f'CREATE SCHEMA "{empty}"')
        along = with_search_path(pg_url, f'"{empty}", "{store_schema}"')
        async with open_store(pg_url) as direct:
            rp = await make_provider(direct, VCPU=4)
            async with open_store(along, create=False) as further:
                assert pg(further)._key("!fence") == pg(direct)._key("!fence")
                await allocate(further, new_uuid(), {rp: {"VCPU": 1}})
                assert await further.rebuild() == 3
                assert (await direct.usage(rp)) == {"VCPU": 1}
                assert (await further.audit()).clean
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{empty}" CASCADE')
        await admin.close()


class _Partition:
    """A TCP relay in front of the server that can stop relaying: a network partition (the
    server alive, its answers - and new connections - held back until it heals)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.hostname is None or parts.port is None:
            pytest.skip("the server's URL names no TCP host and port to relay")
        self._upstream = (parts.hostname, parts.port)
        self._parts = parts
        self._healed = asyncio.Event()
        self._healed.set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        netloc = self._parts.netloc.rsplit("@", 1)
        netloc[-1] = f"127.0.0.1:{port}"
        return urlunsplit(self._parts._replace(netloc="@".join(netloc)))

    async def __aexit__(self, *exc: object) -> None:
        self.heal()
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def cut(self) -> None:
        self._healed.clear()

    def heal(self) -> None:
        self._healed.set()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await self._healed.wait()
            up_reader, up_writer = await asyncio.open_connection(*self._upstream)
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._healed.wait()
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()


async def test_a_command_in_a_partition_fails_after_command_timeout_not_once_per_pooled_connection(
    pg_url: str,
) -> None:
    """Regression (helper-74): a BEGIN that ran out of command_timeout was taken for a dead pooled
    connection and the command tried again on the next one, up to max_retries: with
    command_timeout=1 and a pool of 10, a command in a network partition failed after 18-21 s
    (or, had the partition healed meanwhile, went through after them), where the README promises
    that with command_timeout it fails as evstore.storage."""
    partition = _Partition(pg_url)
    async with partition as relayed, open_store(relayed, command_timeout=1, connect_timeout=3) as store:
        rp = await make_provider(store, VCPU=100)
        await asyncio.gather(*(make_provider(store, VCPU=1) for _ in range(24)))  # (pooled connections)
        head = await store.head()
        consumer = new_uuid()
        loop = asyncio.get_running_loop()
        partition.cut()
        started = loop.time()
        with pytest.raises(StorageError) as caught:
            await allocate(store, consumer, {rp: {"VCPU": 2}})
        took = loop.time() - started
        partition.heal()
        # (18-21 s before; the message says what the command ran into)
        assert took < 10, f"failed after {took:.1f} s with command_timeout=1: {caught.value.message}"
        assert caught.value.details["outcome_unknown"] is False
        assert "within command_timeout (1 s)" in caught.value.message, caught.value.message
        assert "rolled back" in caught.value.message, caught.value.message
        assert await store.head() == head, "the command that failed wrote nothing"
        assert (await store.allocations(consumer)).allocations == {}
        await allocate(store, consumer, {rp: {"VCPU": 2}})  # healed: the store works again
        assert (await store.audit()).clean


async def test_a_timed_out_statement_fails_after_command_timeout_not_twice_that(pg_url: str) -> None:
    """Regression (helper-74): asyncpg cancels a statement that ran out of command_timeout, and
    releasing its connection to the pool waited for that cancellation - up to command_timeout
    again. Where the server does not answer (a partition) every command and read failed after
    twice the timeout the caller set. The connection is closed instead. (command_timeout 1.5 s and
    a bound of 1.9 times it: the slack a loaded 2-core CI machine needs - 1.6 s with 1 s left it
    0.6 s - while twice the timeout still fails it.)"""
    partition = _Partition(pg_url)
    async with partition as relayed, open_store(relayed, command_timeout=1.5, connect_timeout=3) as store:
        rp = await make_provider(store, VCPU=100)
        await asyncio.gather(*(make_provider(store, VCPU=1) for _ in range(8)), store.head(), store.usage(rp))
        head = await store.head()
        consumer = new_uuid()
        loop = asyncio.get_running_loop()
        partition.cut()
        took = {}
        for name, call in (
            ("command", lambda: allocate(store, consumer, {rp: {"VCPU": 2}})),
            ("usage", lambda: store.usage(rp)),
            ("head", store.head),
        ):
            started = loop.time()
            with pytest.raises(StorageError) as caught:
                await call()
            took[name] = loop.time() - started
            assert "within command_timeout (1.5 s)" in caught.value.message, caught.value.message
        partition.heal()
        assert max(took.values()) < 1.9 * 1.5, f"failed after {took} with command_timeout=1.5"
        assert await store.head() == head and (await store.allocations(consumer)).allocations == {}
        await allocate(store, consumer, {rp: {"VCPU": 2}})  # healed: the store works again
        assert (await store.audit()).clean


def test_a_connection_killed_mid_transaction_is_named_by_the_servers_reason() -> None:
    """Regression (helper-74): when the server ended a connection (pg_terminate_backend, an
    idle_in_transaction_session_timeout, a restart) during an import, a rebuild or an audit of
    the history index, what the caller read was asyncpg's complaint about the cleanup that
    followed - the rollback of the transaction block, a DROP of the staged table - not the
    reason: "Lost the connection to PostgreSQL while checking the history index: cannot call
    Connection.execute(): connection has been released back to the pool" (which reads like a
    bug of evstore's). The server's reason is named."""
    from evstore.log import postgres as pgmod

    reason = "terminating connection due to administrator command"

    def cleanup_after_kill(complaint: str) -> BaseException:
        try:
            try:
                raise asyncpg.exceptions.ConnectionDoesNotExistError(
                    f"connection was closed in the middle of operation: {reason}"
                )
            finally:
                raise asyncpg.InterfaceError(complaint)
        except asyncpg.InterfaceError as exc:
            return exc

    for complaint, doing, committing in (
        ("cannot call Connection.execute(): connection has been released back to the pool", "checking", None),
        ("cannot call Transaction.__aexit__(): the underlying connection is closed", "importing", False),
    ):
        failed = pgmod._storage_error(cleanup_after_kill(complaint), doing, committing)
        assert reason in failed.message, failed.message
        assert "released back to the pool" not in failed.message and "__aexit__" not in failed.message
        assert failed.message.startswith(f"Lost the connection to PostgreSQL while {doing}: ")
    # a complaint of asyncpg's with nothing behind it is still named as it is
    alone = asyncpg.InterfaceError("cannot perform operation: another operation is in progress")
    assert "another operation is in progress" in pgmod._storage_error(alone, "reading").message


def test_a_statement_timeout_says_where_to_raise_it() -> None:
    """Regression (helper-74): a role's or database's low statement_timeout ended a long audit or
    rebuild with "PostgreSQL error while reading the log: canceling statement due to statement
    timeout", which does not say that the setting can be raised for evstore's sessions alone."""
    from evstore.log import postgres as pgmod

    timed_out = pgmod._storage_error(
        asyncpg.exceptions.QueryCanceledError("canceling statement due to statement timeout"),
        "reading the log",
        None,
    )
    assert timed_out.code == "evstore.storage"
    assert "?statement_timeout=0" in timed_out.message, timed_out.message
    # a cancellation for another reason (pg_cancel_backend) is not blamed on the setting
    cancelled = pgmod._storage_error(
        asyncpg.exceptions.QueryCanceledError("canceling statement due to user request"),
        "reading the log",
        None,
    )
    assert "statement_timeout" not in cancelled.message


async def test_a_version_6_store_is_closed_to_an_evstore_that_refuses_the_new_payload_fields(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (stop 26): as on SQLite, an evstore of schema 6 refuses the optional payload
    fields events gained (``on_behalf_of``, a ProviderDeleted's ``parent``) and called such events
    corrupt in a store it could open. Opening a version-6 store marks it 7, which it refuses."""
    from evstore.log import postgres as pgmod

    async with open_store(pg_url) as store:
        await pg(store).tamper("UPDATE evstore_meta SET value = '6' WHERE key = 'schema_version'")
    async with open_store(pg_url) as store:
        root = await make_provider(store, "root")
        await store.delete_provider(await make_provider(store, "child", parent=root))
    rows = await admin_fetch(pg_url, "SELECT value FROM evstore_meta WHERE key = 'schema_version'")
    assert rows[0]["value"] == str(SCHEMA_VERSION) == "9"
    monkeypatch.setattr(pgmod, "SCHEMA_VERSION", 6)  # (that evstore's own check)
    with pytest.raises(SchemaVersionError, match="schema version 9; this evstore understands up to 6"):
        async with open_store(pg_url):
            pass


async def test_a_read_only_session_time_travels_past_where_no_snapshot_is(pg_url: str) -> None:
    """Found by review (helper-78): the README says a read-only role or database, or a hot
    standby, can time-travel; but ``state_at`` (and ``diff``, and ``evstore state --at``) saves a
    snapshot on the way at every multiple of ``snapshot_every`` that has none, and from such a
    session that failed the question with evstore.storage "cannot execute INSERT in a read-only
    transaction". A snapshot is a cache: the answer comes without it. Asked for explicitly
    (``take_snapshots``), the failure is still reported."""
    read_only = f"{pg_url}&default_transaction_read_only=on"
    async with open_store(pg_url) as writer:
        rp = await make_provider(writer, VCPU=100)  # positions 1, 2
        consumers = [new_uuid() for _ in range(8)]
        for c in consumers:  # 3-10
            await allocate(writer, c, {rp: {"VCPU": 1}})
    async with open_store(read_only, create=False, snapshot_every=4) as reader:
        view = await reader.state_at(10)
        assert await view.usage(rp) == {"VCPU": 8}
        assert await (await reader.state_at(6)).usage(rp) == {"VCPU": 4}
        changed = await reader.diff(5, 10)
        assert [(u.before, u.after) for u in changed.usage] == [(3, 8)]
        assert await reader.snapshot_positions() == []
        with pytest.raises(StorageError, match="read-only"):
            await reader.take_snapshots()


async def test_a_command_whose_run_was_cancelled_says_its_outcome_is_unknown(pg_url: str) -> None:
    """Helper-82: the StorageError of a command whose run on PostgreSQL was cancelled (the task
    running it, not its caller) said "its outcome is unknown" in words only, where every other
    such error sets ``details["outcome_unknown"]``, which a service reads to retry with the same
    idempotency key rather than fail."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        write = asyncio.create_task(allocate(store, new_uuid(), {rp: {"VCPU": 1}}))
        for _ in range(1000):  # (until the writer has started the command's run)
            await asyncio.sleep(0)
            if store._running:
                break
        assert store._running, "the command's run did not start"
        for task in list(store._running):
            task.cancel()
        with pytest.raises(StorageError, match="outcome is unknown") as info:
            await write
        assert info.value.details["outcome_unknown"] is True
        assert "it had no idempotency_key: look at the log" in info.value.message  # (no key: no safe retry)
        assert (await store.audit()).clean


async def test_a_lost_table_is_not_refolded_over_a_lost_log_tail(pg_url: str) -> None:
    """Helper-83: the repair on open of a projection table dropped by hand refolded the log even
    when the log had lost its last events (a tombstone among them) - what a rebuild refuses
    without force - so the tombstone was forgotten without a word and the audit came back clean.
    Now the open leaves the projection as it is and the audit still says the log lost its tail."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
        deleted_at = (await store.delete_consumer(c)).position
        await pg(store).tamper("DELETE FROM events WHERE position = $1", (deleted_at,))
        await pg(store).tamper("DROP TABLE p_allocations")
    async with open_store(pg_url) as store:
        reasons = [f.details.get("reason") for f in (await store.audit()).integrity]
        assert reasons == ["log_truncated"]
        with pytest.raises(CorruptEvent, match="lost its last events"):
            await store.rebuild()


@pytest.mark.parametrize(
    ("reading", "statement"),
    [
        ("the log", "FROM events WHERE position > $1 ORDER BY position LIMIT"),  # (no transaction)
        # (in a REPEATABLE READ transaction, which asyncpg knows of and rolls back at release:
        # this one passed before too)
        ("a provider", "FROM p_providers WHERE uuid = $1"),
    ],
)
async def test_a_read_cancelled_right_after_its_prepare_leaves_its_connection_clean(
    pg_url: str, reading: str, statement: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop 31 (stop 30's xfail of test_timeouts_around_reads_leave_the_store_usable): asyncpg
    prepares a statement (Parse, Describe, no Sync) and then sends Bind, Execute and Sync; a task
    cancelled once the prepare had answered but before it resumed sent neither, asked for no
    cancellation, and left the server in the implicit transaction the Parse began while asyncpg
    thought the connection idle. The next holder's ``BEGIN ISOLATION LEVEL REPEATABLE READ`` failed
    "SET TRANSACTION ISOLATION LEVEL must be called before any query" (a plain BEGIN joined it).
    Under load ~1 run in 6 of that test hit the window; here the cancellation lands in it."""
    from asyncpg.connection import Connection

    fired: list[str] = []
    prepare = Connection._get_statement

    async def cancelled_once_prepared(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        prepared = await prepare(self, query, *args, **kwargs)
        if statement in query and not fired:
            fired.append(query)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # (as a caller's asyncio.timeout does, at the worst moment)
            await asyncio.sleep(0)
        return prepared

    monkeypatch.setattr(Connection, "_get_statement", cancelled_once_prepared)
    async with open_store(pg_url, pool_size=1) as store:  # (one connection: the next call gets it)
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        call = store.read(0, 100) if reading == "the log" else store.usage(rp)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.ensure_future(call)
        assert fired, "the cancellation did not land: asyncpg no longer prepares in _get_statement"
        pool = pg(store)._pool
        assert pool is not None
        async with pool.acquire() as conn:
            pid = conn.get_server_pid()
        monitor = await asyncpg.connect(pg_url)
        try:
            state = await monitor.fetchval("SELECT state FROM pg_stat_activity WHERE pid = $1", pid)
        finally:
            await monitor.close()
        assert state == "idle", f"the pooled connection went back {state!r}"
        assert (await store.usage(rp))["VCPU"] == 1  # (a REPEATABLE READ read on that connection)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
    async with open_store(pg_url) as again:  # (the command committed, not held in a leftover transaction)
        assert (await again.usage(rp))["VCPU"] == 3
        assert (await again.allocations(c)).allocations == {rp: {"VCPU": 2}}
        assert (await again.audit()).clean


async def test_a_statement_whose_arguments_asyncpg_cannot_encode_leaves_its_connection_clean(
    pg_url: str,
) -> None:
    """Stop 31's window without a cancellation: asyncpg prepares (Parse, Describe, no Sync) and
    then encodes the arguments; one it cannot encode (a DataError, raised on the client) sent no
    Bind, Execute or Sync either, and the server sat in the Parse's implicit transaction while
    asyncpg thought the connection idle: the next holder's REPEATABLE READ read failed "SET
    TRANSACTION ISOLATION LEVEL must be called before any query". (Public input is validated
    before it reaches a statement; this is evstore passing a wrong type, through tamper.)"""
    async with open_store(pg_url, pool_size=1) as store:  # (one connection: the next call gets it)
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        with pytest.raises(StorageError, match=r"invalid input for query argument \$1"):
            await pg(store).tamper("SELECT count(*) FROM p_providers WHERE uuid = $1", [12])
        pool = pg(store)._pool
        assert pool is not None
        async with pool.acquire() as conn:
            pid = conn.get_server_pid()
        state = (await admin_fetch(pg_url, "SELECT state FROM pg_stat_activity WHERE pid = $1", pid))[0][
            "state"
        ]
        assert state == "idle", f"the pooled connection went back {state!r}"
        assert (await store.usage(rp))["VCPU"] == 1  # (a REPEATABLE READ read on that connection)
        await allocate(store, new_uuid(), {rp: {"VCPU": 2}})
    async with open_store(pg_url) as again:  # (the command committed, not held in a leftover transaction)
        assert (await again.usage(rp))["VCPU"] == 3


async def test_a_shutdown_cancelling_every_task_during_a_release_leaves_no_connection_checked_out(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncpg's Pool.release runs the connection's reset in a task of its own (asyncio.shield, so
    that its caller's cancellation does not stop it); a shutdown cancels every task at once
    (asyncio.run's way), and cancelled that one too before its first step when it had just been
    made: the release never ran, the connection stayed checked out for ever, and the pool's close
    waited for it until evstore gave up (10 s) and terminated the pool. Here the cancellation
    comes right as a read's release begins; the store's close must close the pool, not terminate
    it."""
    from asyncpg.pool import Pool

    releasing = asyncio.Event()
    release, terminate = Pool.release, Pool.terminate
    terminated: list[Pool] = []

    async def signalled(self: Any, connection: Any, *, timeout: float | None = None) -> Any:
        releasing.set()  # (the test's task runs before the release's own task takes its first step)
        return await release(self, connection, timeout=timeout)

    def recorded(self: Pool) -> None:
        terminated.append(self)
        terminate(self)

    monkeypatch.setattr(Pool, "terminate", recorded)
    async with open_store(pg_url, pool_size=2) as store:
        rp = await make_provider(store, VCPU=8)
        monkeypatch.setattr(Pool, "release", signalled)
        spared = asyncio.all_tasks()
        read = asyncio.ensure_future(store.usage(rp))
        await releasing.wait()
        for task in asyncio.all_tasks() - spared:  # (the read, and the release's task: not begun)
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await read
        monkeypatch.setattr(Pool, "release", release)
        assert (await store.usage(rp))["VCPU"] == 0  # (the pool's other connection)
    assert not terminated, "the pool's close waited for a connection no one would release"


async def test_a_command_job_cancelled_during_its_begin_is_rolled_back_without_an_error_log(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop 31 (helper-110's campaign): a command's transaction was started and ended by hand;
    a cancellation of its job (a shutdown's way) while BEGIN waited for its answer left asyncpg's
    failed transaction on the connection, evstore's rollback of it was refused ("in error
    state"), and the pool's reset logged "Resetting connection with an active transaction" at
    ERROR through the loop's exception handler before its ROLLBACK. Now the transaction is
    asyncpg's context manager: the reset rolls back without a word."""
    from asyncpg.connection import Connection

    execute = Connection.execute
    fired: list[str] = []

    async def cancelled_at_begin(self: Any, query: str, *args: Any, **kwargs: Any) -> Any:
        task = asyncio.current_task()
        if query.startswith("BEGIN") and armed and not fired and task is not None:
            fired.append(query)
            asyncio.get_running_loop().call_soon(task.cancel)  # (while BEGIN waits for its answer)
        return await execute(self, query, *args, **kwargs)

    armed = False
    monkeypatch.setattr(Connection, "execute", cancelled_at_begin)
    reported: list[str] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: reported.append(str(context.get("message"))))
    try:
        async with open_store(pg_url, pool_size=1) as store:
            rp = await make_provider(store, VCPU=8)
            c = new_uuid()
            armed = True
            with pytest.raises(StorageError) as info:
                await allocate(store, c, {rp: {"VCPU": 1}})
            armed = False
            assert fired, "no BEGIN went through Connection.execute: asyncpg changed"
            assert info.value.details.get("outcome_unknown") is not False
            while store._running:
                await asyncio.wait(list(store._running))
            pool = pg(store)._pool
            assert pool is not None
            while pool.get_idle_size() < pool.get_size():
                await asyncio.sleep(0.01)
            assert (await store.allocations(c)).allocations == {}  # (rolled back: nothing of it)
            await allocate(store, c, {rp: {"VCPU": 2}})
            assert (await store.usage(rp))["VCPU"] == 2
            assert (await store.audit()).clean
    finally:
        loop.set_exception_handler(None)
    assert not [m for m in reported if "active transaction" in m], reported


async def test_a_lost_event_never_positioned_is_a_lost_tail_said_with_what_to_restore(pg_url: str) -> None:
    """Regression (helper s36_P): an event lost before the sequencer gave it a position (a writer's
    commit, its row deleted - or an older copy restored - before any session positioned it) is
    named by the projection only by its -seq: the audit's log_truncated finding and the rebuild's
    refusal said "by an event the log no longer holds", with no position, nothing on which
    events to restore, and neither said which event (the finding not even which consumer). They
    now say it came after the head (the log's positions run 1..head), that it may never have had
    a position, which events to restore, and give the consumer and its seq in the details."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
        head = await store.head()

        async def lose_it(_: object) -> None:  # (committed, not positioned yet: deleted)
            await pg(store).tamper("DELETE FROM events WHERE position IS NULL")

        pg(store)._after_commit = lose_it
        with pytest.raises(StorageError):  # (its positions never come)
            await store.delete_consumer(c)
        pg(store)._after_commit = None
        assert await store.head() == head
        [lost] = (await store.audit()).integrity
        assert lost.details["reason"] == "log_truncated" and lost.details["consumer"] == c
        assert lost.details["head"] == head and lost.details["lost_seq"] > 0, lost.details
        assert "position" not in lost.details and lost.positions == ()
        for said in (lost.message, str((await _refused_rebuild(store)).value)):
            assert f"after position {head}" in said and "may never have been given one" in said, said
            assert f"events after position {head}" in said, said
        await store.rebuild(force=True)
        assert (await store.audit()).clean


async def _refused_rebuild(store: Any) -> pytest.ExceptionInfo[CorruptEvent]:
    with pytest.raises(CorruptEvent, match="lost its last events") as refused:
        await store.rebuild()
    assert refused.value.details["lost_seq"] > 0 and "position" not in refused.value.details
    return refused
