"""Stop 45, helper F: a review of this stop's PostgreSQL changes (helper A's open, TLS, URL
settings, search_path and 42501 refusals), probed against the durable server as a user would:
what they refuse must be what is wrong, and their messages must say what to do."""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import InvalidInput, NotFound, StorageError, open_store
from tests.conftest import make_provider, new_uuid


def _schema(pg_url: str) -> str:
    return dict(parse_qsl(urlsplit(pg_url).query))["search_path"]


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def _new_role(admin: asyncpg.Connection, suffix: str) -> str:
    role = f"evt_s45f_{suffix}_{os.getpid()}"
    await admin.execute(f"DROP ROLE IF EXISTS {role}")
    await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
    return role


async def _drop_role(admin: asyncpg.Connection, role: str) -> None:
    await admin.execute(f"DROP OWNED BY {role}")
    await admin.execute(f"DROP ROLE {role}")


async def test_a_schema_before_the_stores_with_a_function_evstore_never_calls_is_not_refused(
    pg_url: str,
) -> None:
    """Regression (fb6bd79 refused every ``evstore_*`` function): a schema before the store's
    holding a function of its own whose name only starts like evstore's (``evstore_report``, a
    report an operator wrote) shadows nothing evstore calls - the open was refused all the same,
    "holds what evstore's names would resolve to ... evstore_report". It opens; one holding a
    function evstore does call (``evstore_sequence``) is still refused (test_s45_A_pg_url)."""
    schema = _schema(pg_url)
    app = f"{schema}_f_app"
    admin = await asyncpg.connect(pg_url)
    try:
        async with open_store(pg_url) as store:
            rp = await make_provider(store, VCPU=1)
        await admin.execute(f'CREATE SCHEMA "{app}"')
        await admin.execute(
            f"CREATE FUNCTION \"{app}\".evstore_report() RETURNS int LANGUAGE sql AS 'SELECT 1'"
        )
        await admin.execute(f'CREATE TABLE "{app}".orders (id int)')  # (no name of evstore's)
        url = f"{pg_url.split('?')[0]}?search_path={quote(f'{app},{schema}')}"
        async with open_store(url, create=False) as store:
            assert (await store.usage(rp)).usages == {"VCPU": 0}
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{app}" CASCADE')
        await admin.close()


async def test_a_full_rebuild_by_a_role_that_writes_but_does_not_own_is_not_read_only(pg_url: str) -> None:
    """Regression (a293d24): a role granted what README's 42501 hint asks for - INSERT, UPDATE and
    DELETE on the tables, the sequence, EXECUTE - runs commands and a plain rebuild; its full
    rebuild reindexes, which PostgreSQL allows the tables' owner alone ("must be owner of table
    p_allocations", 42501). It was told ``reason`` ``read_only`` and "this role may not write the
    store: ... grant them" - what it has. Not read_only now, and the message says that the owner
    is needed."""
    schema = _schema(pg_url)
    admin = await asyncpg.connect(pg_url)
    role = await _new_role(admin, "writer")
    try:
        async with open_store(pg_url) as store:
            rp = await make_provider(store, VCPU=4)
        await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {role}')
        await admin.execute(
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}" TO {role}'
        )
        await admin.execute(f'GRANT USAGE, SELECT, UPDATE ON ALL SEQUENCES IN SCHEMA "{schema}" TO {role}')
        await admin.execute(f'GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA "{schema}" TO {role}')
        async with open_store(_as(pg_url, role), create=False, upgrade=False) as writer:
            await writer.set_allocations(
                new_uuid(),
                {rp: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
            assert await writer.rebuild() == await writer.head()
            with pytest.raises(StorageError) as refused:
                await writer.rebuild(full=True)
        assert refused.value.details["sqlstate"] == "42501"
        assert refused.value.details.get("reason") != "read_only", refused.value.details
        assert "may not write" not in refused.value.message
        assert "owner" in refused.value.message
        assert refused.value.details["outcome_unknown"] is False
    finally:
        await _drop_role(admin, role)
        await admin.close()


@pytest.mark.parametrize("setting", ["log_statement=all", "options=-c%20log_statement%3Dall"])
async def test_a_url_setting_the_role_may_not_set_is_invalid_input_naming_it(
    pg_url: str, setting: str
) -> None:
    """A ?k=v of the URL the server refuses for the role's want of a privilege ("permission denied
    to set parameter "log_statement"", 42501 - a superuser's setting): as one whose value it
    refuses (b82cbcb), the URL's to change - ``InvalidInput`` naming the key, saying the role may
    not set it -, where it was ``evstore.storage`` "Cannot connect"."""
    admin = await asyncpg.connect(pg_url)
    role = await _new_role(admin, "noset")
    try:
        with pytest.raises(InvalidInput) as refused:
            async with open_store(f"{_as(pg_url, role)}&{setting}", create=False):
                pass
        assert refused.value.details["field"] == setting.split("=")[0]
        assert "may not set it" in refused.value.message
        assert "transient" not in refused.value.details
    finally:
        await _drop_role(admin, role)
        await admin.close()


@pytest.mark.parametrize("source", ["environment", "home", "url_crl"])
async def test_a_tls_file_that_cannot_be_used_is_named_with_where_it_came_from(
    pg_url: str, source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (4d2362e): asyncpg also reads TLS files the URL does not name - PGSSLROOTCERT
    and the like, and ~/.postgresql/postgresql.crt even under the default sslmode (prefer) -; one
    that is missing or holds no certificate was told "Cannot use the TLS files the PostgreSQL URL
    ... names: [Errno 2] No such file or directory (check its sslrootcert, sslcert and sslkey ...)",
    of a URL naming none, without saying which file (nor sslcrl, which the URL may name). The
    refusal names the option and the file, and where such files come from; ``field`` is the
    URL's option when the URL names the file."""
    url, field = pg_url, None
    if source == "environment":
        monkeypatch.setenv("PGSSLROOTCERT", str(tmp_path / "s45f-missing-root.crt"))
        url = f"{pg_url}&sslmode=verify-ca"
        named = f"sslrootcert: {tmp_path / 's45f-missing-root.crt'}"
    elif source == "home":
        (tmp_path / ".postgresql").mkdir()
        (tmp_path / ".postgresql" / "postgresql.crt").write_text("not a certificate\n")
        monkeypatch.setenv("HOME", str(tmp_path))
        named = f"sslcert: {tmp_path / '.postgresql' / 'postgresql.crt'}"
    else:
        url, field = f"{pg_url}&sslmode=require&sslcrl=/nonexistent/s45f.crl", "sslcrl"
        named = "sslcrl: /nonexistent/s45f.crl"
    with pytest.raises(InvalidInput) as refused:
        async with open_store(url, create=False, connect_timeout=5):
            pass
    message = refused.value.message
    assert not message.startswith("Cannot use the TLS files the PostgreSQL URL"), message
    assert named in message, message
    assert "PGSSLROOTCERT" in message and "~/.postgresql" in message
    assert refused.value.details.get("field") == field, refused.value.details
    assert "transient" not in refused.value.details


class _Bouncer(asyncio.Protocol):
    """What pgbouncer answers a login to a database it has no entry for: no TLS, then a FATAL
    ErrorResponse "no such database: ..." with SQLSTATE 08P01 (protocol_violation, pgbouncer's
    code for every refusal of its own), and the connection closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport, self.buffer = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while len(self.buffer) >= 8 and len(self.buffer) >= struct.unpack("!I", self.buffer[:4])[0]:
            size = struct.unpack("!I", self.buffer[:4])[0]
            packet, self.buffer = self.buffer[:size], self.buffer[size:]
            if struct.unpack("!I", packet[4:8])[0] == 80877103:  # (SSLRequest: none here)
                self.transport.write(b"N")
                continue
            body = b"SFATAL\0VFATAL\0C08P01\0Mno such database: s45f_nodb\0\0"
            self.transport.write(b"E" + struct.pack("!I", len(body) + 4) + body)
            self.transport.close()


async def test_pgbouncers_no_such_database_is_not_found_not_transient() -> None:
    """Regression (d9e7bfa made an open's connection errors transient, class 08 among them):
    pgbouncer refuses a database it has no entry for with 08P01 "no such database: x" - the open
    said "(a restart, a failover or the network: try again)", ``transient`` True, for a name that
    stays wrong. It is ``evstore.not_found``, as the server's own 3D000, not transient."""
    server = await asyncio.get_running_loop().create_server(_Bouncer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(NotFound) as refused:
            async with open_store(f"postgresql://u@127.0.0.1:{port}/s45f_nodb", connect_timeout=5):
                pass
    finally:
        server.close()
        await server.wait_closed()
    assert "no such database: s45f_nodb" in refused.value.message
    assert "try again" not in refused.value.message
    assert "transient" not in refused.value.details
    assert "pgbouncer" in refused.value.message


async def test_the_search_path_a_shadowed_store_is_told_to_use_quotes_a_name_that_needs_it(
    pg_url: str,
) -> None:
    """fb6bd79's refusal of a schema before the store's holding ``events`` says to put the store's
    schema first, ``?search_path=<schema>, ...``: for a schema whose name needs quoting
    (capitals, a hyphen - README's ``%22Evstore-Prod%22``) it showed the bare name, which
    PostgreSQL folds to lower case or refuses. It shows the name quoted as a URL needs it."""
    base = pg_url.split("?")[0]
    store_schema, app = f"S45F-Store-{os.getpid()}", f"s45f_app_{os.getpid()}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f'CREATE SCHEMA "{store_schema}"')
        async with open_store(f"{base}?search_path={quote(chr(34) + store_schema + chr(34))}") as store:
            await make_provider(store, VCPU=1)
        await admin.execute(f"CREATE SCHEMA {app}")
        await admin.execute(f"CREATE TABLE {app}.events (id int)")
        with pytest.raises(InvalidInput) as refused:
            async with open_store(f"{base}?search_path={quote(f'{app},{chr(34)}{store_schema}{chr(34)}')}"):
                pass
        assert f"?search_path=%22{store_schema}%22" in refused.value.message, refused.value.message
    finally:
        await admin.execute(f"DROP SCHEMA IF EXISTS {app} CASCADE")
        await admin.execute(f'DROP SCHEMA IF EXISTS "{store_schema}" CASCADE')
        await admin.close()
