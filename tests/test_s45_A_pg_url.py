"""Stop 45, helper A: the PostgreSQL store URL's server settings and the roles it opens with,
probed as a user would: a setting the server refuses the value of is the URL's fault
(``InvalidInput`` naming it, as SQLite's ``?busy_timeout=abc`` is), ``sslmode=require`` against a
server without TLS does not pass by itself, a ``client_encoding`` of the URL does not make
commands with names outside it fail, and a role that may not use or create in the schema is
told so."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import InvalidInput, NotFound, StorageError, open_store
from tests.conftest import make_provider, new_uuid


@pytest.mark.parametrize(
    ("setting", "field"),
    [
        ("statement_timeout=abc", "statement_timeout"),
        ("work_mem=1", "work_mem"),
        ("default_transaction_read_only=maybe", "default_transaction_read_only"),
        ("TimeZone=Mars%2FOlympus", "TimeZone"),
        ("options=--bad", "options"),
    ],
)
async def test_a_server_setting_in_the_url_with_a_value_the_server_refuses_is_invalid_input(
    pg_url: str, setting: str, field: str
) -> None:
    """Regression: a ?k=v of the URL that is not evstore's goes to the server as a setting; one
    whose value the server refused at the connect (SQLSTATE 22023 invalid_parameter_value, 55P02
    a setting only a restart changes, 42601 a malformed ``options``) failed the open as
    ``evstore.storage`` "Cannot connect to PostgreSQL" - a server's failure, with nothing saying it
    came from the URL - where a misspelt name is ``InvalidInput`` and SQLite's
    ``?busy_timeout=abc`` too. Now ``InvalidInput`` naming the key."""
    with pytest.raises(InvalidInput) as refused:
        async with open_store(f"{pg_url}&{setting}"):
            pass
    assert refused.value.code == "evstore.invalid_input"
    assert refused.value.details["field"] == field
    assert "sent to the server as a setting" in refused.value.message
    assert "check its value" in refused.value.message


async def test_an_unquoted_schema_name_with_a_space_is_invalid_input_saying_to_quote_it(pg_url: str) -> None:
    """``?search_path=my schema`` (unquoted): the server refuses the value ("invalid value for
    parameter"); README says a schema whose name needs quoting is named quoted in the URL - the
    refusal says so."""
    with pytest.raises(InvalidInput) as refused:
        async with open_store(f"{pg_url.split('?')[0]}?search_path={quote('s45a my schema')}"):
            pass
    assert refused.value.details["field"] == "search_path"
    assert "%22" in refused.value.message  # (how to quote it in a URL)


async def _fake_server_without_tls() -> tuple[asyncio.AbstractServer, int]:
    """A server that answers PostgreSQL's SSLRequest with 'N' (no TLS here), as a server with
    ``ssl = off`` does."""

    class NoTls(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport

        def data_received(self, data: bytes) -> None:
            assert isinstance(self.transport, asyncio.Transport)
            self.transport.write(b"N")

    server = await asyncio.get_running_loop().create_server(NoTls, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_sslmode_require_against_a_server_without_tls_does_not_pass_by_itself() -> None:
    """``sslmode=require`` where the server offers no TLS: asyncpg's ``ConnectionError`` "rejected
    SSL upgrade" - an OSError, which the open (since it says ``transient`` for a lost connection)
    would have called transient, "try again". It does not pass by itself: not transient, and the
    message says to check sslmode and the server's ssl setting."""
    server, port = await _fake_server_without_tls()
    try:
        with pytest.raises(StorageError) as failed:
            async with open_store(f"postgresql://u@127.0.0.1:{port}/db?sslmode=require", connect_timeout=5):
                pass
    finally:
        server.close()
        await server.wait_closed()
    assert "rejected SSL upgrade" in failed.value.message
    assert "transient" not in failed.value.details, failed.value.details
    assert "try again" not in failed.value.message
    assert "sslmode" in failed.value.message


@pytest.mark.parametrize(
    "how", ["client_encoding=LATIN1", "client_encoding=SQL_ASCII", "options=-c%20client_encoding%3DLATIN1"]
)
async def test_a_client_encoding_in_the_url_does_not_refuse_names_outside_it(pg_url: str, how: str) -> None:
    """Regression: ``?client_encoding=LATIN1`` in the URL (a server setting like any other) made
    asyncpg encode every text argument in Latin-1: a command naming a provider ``"rack ☃"`` - a
    valid name, taken by SQLite - failed ``evstore.storage`` "invalid input for query argument ...
    'latin-1' codec can't encode character". evstore's sessions speak UTF-8 whatever the URL says:
    the name is stored and read back as given, the events too."""
    async with open_store(f"{pg_url}&{how}") as store:
        rp = await make_provider(store, "rack ☃ é 日本", VCPU=4)
        consumer = new_uuid()
        await store.set_allocations(
            consumer,
            {rp: {"VCPU": 1}},
            project_id="projé☃",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        assert (await store.provider(rp)).name == "rack ☃ é 日本"
        assert (await store.allocations(consumer)).project_id == "projé☃"
        assert (await store.audit()).clean
    async with open_store(pg_url) as store:  # (as another process with the default sees it)
        assert (await store.provider(rp)).name == "rack ☃ é 日本"
        assert (await store.audit()).clean


async def _role(admin: asyncpg.Connection, pg_url: str, suffix: str) -> tuple[str, str]:
    """A new login role, and ``pg_url`` with it as the user."""
    role = f"evt_s45a_{suffix}_{os.getpid()}"
    await admin.execute(f"DROP ROLE IF EXISTS {role}")
    await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
    parts = urlsplit(pg_url)
    return role, urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def _drop_role(admin: asyncpg.Connection, role: str) -> None:
    await admin.execute(f"DROP OWNED BY {role}")
    await admin.execute(f"DROP ROLE {role}")


async def test_a_role_without_usage_on_the_urls_schema_is_told_so(pg_url: str) -> None:
    """A role that may not use the URL's schema (no USAGE) cannot see it: the open said the schema
    does not exist - "create it first: CREATE SCHEMA" -, which a person then finds is there. It
    says now that the role may also lack USAGE on it."""
    admin = await asyncpg.connect(pg_url)
    role, url = await _role(admin, pg_url, "nousage")
    try:
        async with open_store(pg_url) as store:
            await make_provider(store, VCPU=1)
        for create in (True, False):
            with pytest.raises(NotFound) as refused:
                async with open_store(url, create=create):
                    pass
            assert "USAGE" in refused.value.message, refused.value.message
    finally:
        await _drop_role(admin, role)
        await admin.close()


async def test_a_role_without_create_on_the_schema_is_told_what_it_lacks(pg_url: str) -> None:
    """A role with USAGE but not CREATE on an empty schema: the open that would create the store
    failed "PostgreSQL error while migrating: permission denied for schema ...; it was rolled back"
    (README: the first open needs CREATE on the schema). It says now that creating the store
    needs CREATE on the schema, and how to get on (nothing was written)."""
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    admin = await asyncpg.connect(pg_url)
    role, url = await _role(admin, pg_url, "nocreate")
    try:
        await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        with pytest.raises(StorageError) as refused:
            async with open_store(url):
                pass
        assert refused.value.details["sqlstate"] == "42501"
        assert "CREATE on the schema" in refused.value.message, refused.value.message
        assert await admin.fetchval("SELECT to_regclass($1)", f'"{schema}".evstore_meta') is None
    finally:
        await _drop_role(admin, role)
        await admin.close()


@pytest.mark.parametrize("search_path", ["pg_temp", "pg_temp,{schema}"])
@pytest.mark.parametrize("create", [True, False])
@pytest.mark.parametrize("made", [True, False], ids=["temp_schema_made", "not_made_yet"])
async def test_a_search_path_that_puts_the_store_in_a_temporary_schema_is_refused(
    pg_url: str, search_path: str, create: bool, made: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``?search_path=pg_temp`` (first): the store's schema is the session's temporary one, which
    each connection has its own of and which goes with the session - a store there would be a
    different, vanishing one on each pooled connection. The open failed "PostgreSQL error while
    migrating: function evstore_sequence(...) does not exist" (functions are never looked up in
    pg_temp), or with create=False "No evstore store in schema 'pg_temp_4'". Refused now as the
    URL's fault, naming search_path; nothing is left behind. (Whether the server process that
    serves the session made its temporary schema before decides whether the search_path the
    session finds names it: ``not_made_yet`` answers as one that did not.)"""
    import evstore.log.postgres as pg

    if not made:
        monkeypatch.setattr(pg, "STORE_SCHEMA", "SELECT NULL::name")
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    url = f"{pg_url.split('?')[0]}?search_path={quote(search_path.format(schema=schema))}"
    with pytest.raises(InvalidInput) as refused:
        async with open_store(url, create=create):
            pass
    assert refused.value.details["field"] == "search_path"
    assert "temporary schema" in refused.value.message
    admin = await asyncpg.connect(pg_url)
    try:
        assert await admin.fetchval(f"SELECT to_regclass('\"{schema}\".evstore_meta')") is None
    finally:
        await admin.close()


async def test_a_search_path_naming_information_schema_is_refused(pg_url: str) -> None:
    """A superuser's ``?search_path=information_schema`` made the store among PostgreSQL's own
    views there - a schema pg_dump leaves out of every backup: the store would be missing from
    each. Refused now, naming search_path (a role that is not a superuser was refused by the
    server already: permission denied)."""
    url = f"{pg_url.split('?')[0]}?search_path=information_schema"
    with pytest.raises(InvalidInput) as refused:
        async with open_store(url):
            pass
    assert refused.value.details["field"] == "search_path"
    assert "pg_dump" in refused.value.message
    admin = await asyncpg.connect(pg_url)
    try:
        assert await admin.fetchval("SELECT to_regclass('information_schema.evstore_meta')") is None
    finally:
        await admin.close()


@pytest.mark.parametrize("case", ["login", "misspelt_option", "setting_value", "nothing_listens"])
async def test_an_open_with_no_pool_floor_fails_its_first_connect_as_one_with_a_floor(
    pg_url: str, case: str
) -> None:
    """Regression: with ``min_pool_size=0`` the pool opens no connection as it is made, and the
    open's first connect happened at its first acquire, whose errors are those of a read: a login
    refused said "PostgreSQL error while connecting ..." without what to check, a misspelt option
    (``?pool_sise=3``) or a setting's bad value was ``evstore.storage`` instead of
    ``InvalidInput``, a port where nothing listens "Lost the connection". The open fails now as
    the same open with the default floor does: same type, same message, same details."""
    base, query = pg_url.split("?", 1)
    host = base.split("@", 1)[1]
    url = {
        "login": f"postgresql://evt_s45a_no_such_role@{host}?{query}",
        "misspelt_option": f"{pg_url}&pool_sise=3",
        "setting_value": f"{pg_url}&work_mem=1",
        "nothing_listens": "postgresql://u@127.0.0.1:1/db",
    }[case]
    failures = []
    for floor in ({}, {"min_pool_size": 0}):
        with pytest.raises(Exception) as failed:
            async with open_store(url, connect_timeout=5, **floor):  # type: ignore[arg-type]
                pass
        failures.append(failed.value)
    with_floor, without = failures
    assert type(without) is type(with_floor)
    assert getattr(without, "message", None) == getattr(with_floor, "message", None)
    assert getattr(without, "details", None) == getattr(with_floor, "details", None)


async def test_target_session_attrs_no_host_matches_says_so(pg_url: str) -> None:
    """Regression: ``?target_session_attrs=standby`` where every host of the URL is a primary:
    asyncpg's ``TargetServerAttributeNotMatched`` (an InternalClientError) was told as a session
    the server ended as it was set up ("a restart, pg_terminate_backend ... try again"), which
    nothing had done. It says now that no host is what target_session_attrs asks for (transient:
    a failover may make one so)."""
    with pytest.raises(StorageError) as failed:
        async with open_store(f"{pg_url}&target_session_attrs=standby", connect_timeout=5):
            pass
    assert "the session ended as it was set up" not in failed.value.message
    assert "target_session_attrs" in failed.value.message
    assert failed.value.details.get("transient") is True


def test_a_read_that_finds_no_host_matching_target_session_attrs_says_so() -> None:
    """The read's (or command's) sibling: a pool connecting anew during a failover with
    ``target_session_attrs=primary`` finds none - told "Lost the connection ...: the session
    ended under it - the server ended it (a restart, pg_terminate_backend ...)". It says what
    it is, still transient (the failover promotes one), a command not run."""
    import evstore.log.postgres as pg

    exc = asyncpg.exceptions.TargetServerAttributeNotMatched(
        "None of the hosts match the target attribute requirement <SessionAttribute.primary>"
    )
    for committing in (None, False):
        failed = pg._storage_error(exc, "reading the log", committing)
        assert "the session ended under it" not in failed.message
        assert "target_session_attrs" in failed.message
        assert failed.details["transient"] is True


async def test_a_command_by_a_role_that_may_only_read_is_read_only(pg_url: str) -> None:
    """Regression: a role with SELECT on the store's tables but no INSERT or UPDATE - the
    PostgreSQL counterpart of a SQLite store file this process may read but not write, whose
    command errors say ``details["reason"] == "read_only"`` - failed its commands "permission
    denied for table events; it was rolled back" with the SQLSTATE alone. It says now
    ``read_only`` (nothing written, ``outcome_unknown`` False) and what the role lacks; reads
    and the audit answer."""
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    admin = await asyncpg.connect(pg_url)
    role, url = await _role(admin, pg_url, "reader")
    try:
        async with open_store(pg_url) as store:
            rp = await make_provider(store, VCPU=4)
        await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO {role}')
        await admin.execute(f'GRANT SELECT ON ALL SEQUENCES IN SCHEMA "{schema}" TO {role}')
        async with open_store(url, create=False, upgrade=False) as reader:
            head = await reader.head()
            with pytest.raises(StorageError) as refused:
                await reader.set_allocations(
                    new_uuid(),
                    {rp: {"VCPU": 1}},
                    project_id="p",
                    user_id="u",
                    consumer_type="INSTANCE",
                    generation=None,
                )
            assert refused.value.details["reason"] == "read_only", refused.value.details
            assert refused.value.details["outcome_unknown"] is False
            assert refused.value.details["sqlstate"] == "42501"
            assert "privilege" in refused.value.message
            assert await reader.head() == head
            assert (await reader.usage(rp)).usages == {"VCPU": 0}
            assert (await reader.audit()).clean
    finally:
        await _drop_role(admin, role)
        await admin.close()


@pytest.mark.parametrize("shadow", ["events", "p_providers", "function"])
async def test_a_schema_before_the_stores_that_holds_a_table_of_its_names_is_refused(
    pg_url: str, shadow: str
) -> None:
    """Regression: ``?search_path=app,store`` where the store lives in ``store`` and the schema
    ``app`` before it holds another application's table named as one of evstore's (``events``,
    ``p_providers``) or a function named as evstore's: the open found the store (the first schema
    holding its ``evstore_meta``) and opened it, but every unqualified name resolved to ``app``'s
    - every read failed "column "position" does not exist", and a table of a like shape would have
    been read, and written, as the store's. Refused now at open, naming the schema and what it
    holds in the way; nothing of either is touched."""
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    app = f"{schema}_app"
    admin = await asyncpg.connect(pg_url)
    try:
        async with open_store(pg_url) as store:
            await make_provider(store, VCPU=1)
            head = await store.head()
        await admin.execute(f'CREATE SCHEMA "{app}"')
        if shadow == "function":
            await admin.execute(
                f'CREATE FUNCTION "{app}".evstore_sequence(bigint, boolean, bigint[]) RETURNS int '
                "LANGUAGE sql AS 'SELECT 1'"
            )
        else:
            await admin.execute(f'CREATE TABLE "{app}".{shadow} (id int, note text)')
        url = f"{pg_url.split('?')[0]}?search_path={quote(f'{app},{schema}')}"
        with pytest.raises(InvalidInput) as refused:
            async with open_store(url):
                pass
        assert refused.value.details["field"] == "search_path"
        assert app in refused.value.message
        assert (shadow if shadow != "function" else "evstore_sequence") in refused.value.message
        async with open_store(pg_url) as store:  # (the store, by its own search_path, is whole)
            assert await store.head() == head
            assert (await store.audit()).clean
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{app}" CASCADE')
        await admin.close()


@pytest.mark.parametrize(
    "tls",
    [
        "sslmode=verify-ca&sslrootcert=/nonexistent/s45a-root.crt",
        "sslmode=require&sslcert=/nonexistent/s45a.crt&sslkey=/nonexistent/s45a.key",
        "sslmode=verify-ca&sslrootcert={not_a_certificate}",
    ],
    ids=["no_root_cert", "no_client_cert", "not_a_certificate"],
)
async def test_tls_files_the_url_names_that_cannot_be_used_are_the_urls_fault(
    pg_url: str, tls: str, tmp_path: Path
) -> None:
    """Regression: a URL naming a TLS file that does not exist (``sslrootcert=``, ``sslcert=``)
    failed "[Errno 2] No such file or directory (no server socket there: check the URL's host -
    the directory of the server's Unix socket ...)", and one that holds no certificate "[X509:
    NO_CERTIFICATE_OR_CRL_FOUND] ... (a restart, a failover or the network: try again)", both
    ``transient``: asyncpg reads them as it parses the URL, before any connect. They are the
    URL's fault and do not pass by themselves - ``InvalidInput`` (as asyncpg's own refusal of a
    missing default root certificate is), naming the TLS parameters to check."""
    bogus = tmp_path / "not-a-certificate.crt"
    bogus.write_text("not a certificate\n")
    with pytest.raises(InvalidInput) as refused:
        async with open_store(f"{pg_url}&{tls.format(not_a_certificate=bogus)}", connect_timeout=5):
            pass
    assert "transient" not in refused.value.details
    assert "sslrootcert" in refused.value.message and "Unix socket" not in refused.value.message
    assert "try again" not in refused.value.message


async def test_a_tls_handshake_that_fails_does_not_pass_by_itself() -> None:
    """Regression of 737e234 (an open's OSError is transient, "try again"): a server that agrees to
    TLS and then answers with something else (a proxy that speaks HTTP, a protocol the two cannot
    agree on) fails the handshake with ``ssl.SSLError`` ("WRONG_VERSION_NUMBER"), an OSError - told
    "(a restart, a failover or the network: try again)", transient. It does not pass by itself:
    not transient, and the message says what to check."""

    class AgreesThenHttp(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            self.transport, self.answered = transport, False

        def data_received(self, data: bytes) -> None:
            # (the SSLRequest: "S", go ahead; then, for the ClientHello, an HTTP answer)
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4 if self.answered else b"S")
            self.answered = True

    server = await asyncio.get_running_loop().create_server(AgreesThenHttp, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(StorageError) as failed:
            async with open_store(f"postgresql://u@127.0.0.1:{port}/db?sslmode=require", connect_timeout=5):
                pass
    finally:
        server.close()
        await server.wait_closed()
    assert "transient" not in failed.value.details, failed.value.details
    assert "try again" not in failed.value.message
    assert "TLS" in failed.value.message
