"""Stop 46, helper A: a TLS problem met by a read's (or a command's) reconnect - the pool's next
connection, after the server ended the one it held - is told as an open's first connect is (the
TLS file named with the URL's option, the server offering no TLS, a handshake that fails, a
certificate not trusted: what to check, not transient), not "this process may not use the
server's socket or address, or does not trust its certificate".

Real failures, on a real reconnect: the store is opened through a TLS-terminating proxy in this
process (TLS with the client, plain to the durable server, whose ssl is off), the server ends the
store's sessions (pg_terminate_backend), and the proxy then answers the next connect otherwise; or
the client certificate the URL names is removed after the open (asyncpg reads it again at each
connect, under the default sslmode too)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import InvalidInput, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def _certificate(where: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (PEM), made by openssl."""
    crt, key = where / f"{name}.crt", where / f"{name}.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(crt)),
        ],
        check=True,
        capture_output=True,
    )
    return crt, key


class _TlsProxy:
    """Speaks PostgreSQL's TLS opening (SSLRequest, 'S', a handshake with ``context``) with the
    client and forwards what follows, plain, to the server at ``upstream``. ``mode`` says how it
    answers the next connects: ``tls`` as above, ``no_tls`` 'N' (a server whose ssl is off),
    ``http`` 'S' then an HTTP answer (what is not PostgreSQL: the handshake fails), ``other``
    a handshake with ``other`` (a certificate the client does not trust)."""

    def __init__(self, upstream: tuple[str, int], context: ssl.SSLContext, other: ssl.SSLContext) -> None:
        self.upstream, self.context, self.other = upstream, context, other
        self.mode = "tls"
        self.tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            await reader.readexactly(8)  # (the SSLRequest)
            if self.mode == "no_tls":
                writer.write(b"N")
                await writer.drain()
                await reader.read(1)  # (the client closes)
                return
            writer.write(b"S")
            await writer.drain()
            if self.mode == "http":
                await reader.read(4096)  # (the ClientHello)
                writer.write(b"HTTP/1.1 400 Bad Request\r\n\r\n" * 4)
                await writer.drain()
                return
            await writer.start_tls(self.other if self.mode == "other" else self.context)
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
            try:
                await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
            finally:
                up_writer.close()
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()
            self.tasks.discard(task)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ssl.SSLError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


def _via(url: str, port: int, query: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.netloc.rsplit('@', 1)[0]}@127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=netloc, query=f"{parts.query}&{query}"))


@pytest.fixture
async def proxy(pg_url: str, tmp_path: Path) -> AsyncIterator[tuple[_TlsProxy, int, Path]]:
    """A TLS proxy to the durable server (its port) and the CA file the client is to trust."""
    crt, key = _certificate(tmp_path, "server")
    other_crt, other_key = _certificate(tmp_path, "other")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(crt, key)
    other = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    other.load_cert_chain(other_crt, other_key)
    parts = urlsplit(pg_url)
    assert parts.hostname is not None and parts.port is not None
    server = _TlsProxy((parts.hostname, parts.port), context, other)
    port = await server.start()
    try:
        yield server, port, crt
    finally:
        await server.close()


async def _end_sessions(pg_url: str) -> None:
    """The server ends every session of this test's store but the admin's own (a restart would)."""
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE pid <> pg_backend_pid() AND application_name = 's46a_tls'"
        )
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("mode", "sslmode", "says"),
    [
        ("no_tls", "require", "the server offers no TLS"),
        ("http", "require", "the TLS handshake failed"),
        ("other", "verify-ca", "does not trust the server's certificate"),
    ],
)
async def test_a_reads_reconnect_that_meets_a_tls_problem_says_what_to_check(
    pg_url: str, proxy: tuple[_TlsProxy, int, Path], mode: str, sslmode: str, says: str
) -> None:
    """Regression: only the open's first connect named the TLS problem; a read whose pooled
    connection the server had ended, reconnecting into the same problem (the proxy, or the server
    behind that address, changed), was told "Cannot connect to PostgreSQL while connecting to
    ...: this process may not use the server's socket or address, or does not trust its
    certificate ... check the socket's permissions, the firewall" - for a server that offers no
    TLS, a handshake that fails, a certificate it does not trust alike. It is told what the open
    says: what is wrong and what to check, not transient; a command likewise, not run."""
    server, port, ca = proxy
    query = f"sslmode={sslmode}&sslrootcert={quote(str(ca))}&application_name=s46a_tls"
    async with open_store(_via(pg_url, port, query), pool_size=2, connect_timeout=5) as store:
        rp = await make_provider(store, VCPU=4)
        head = await store.head()
        server.mode = mode
        await _end_sessions(pg_url)
        with pytest.raises(StorageError) as read:
            await store.head()
        with pytest.raises(StorageError) as command:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        server.mode = "tls"  # (put right: the store reads again)
        assert await store.head() == head
    for failed in (read.value, command.value):
        assert "transient" not in failed.details, failed.details
        assert says in failed.message, failed.message
        assert "that does not pass by itself" in failed.message
        assert "the socket's permissions" not in failed.message, failed.message
    assert command.value.details["outcome_unknown"] is False
    assert "the command was not run" in command.value.message


async def test_a_reads_reconnect_that_cannot_use_the_urls_tls_file_names_it(
    pg_url: str, tmp_path: Path
) -> None:
    """Regression: a client certificate the URL names (``sslcert``, ``sslkey``: read at each
    connect, under the default sslmode too) removed after the open: a read reconnecting was told
    "Cannot connect to PostgreSQL while connecting to ...: [Errno 2] No such file or directory
    (this process may not use the server's socket or address ...)". As at the open now:
    ``InvalidInput`` naming the file and the URL's option (``field``), not transient."""
    crt, key = _certificate(tmp_path, "client")
    url = f"{pg_url}&sslcert={quote(str(crt))}&sslkey={quote(str(key))}&application_name=s46a_tls"
    async with open_store(url, pool_size=2, connect_timeout=5) as store:
        rp = await make_provider(store, VCPU=4)
        head = await store.head()
        crt.rename(tmp_path / "elsewhere.crt")
        await _end_sessions(pg_url)
        with pytest.raises(InvalidInput) as read:
            await store.head()
        with pytest.raises(InvalidInput) as command:
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        (tmp_path / "elsewhere.crt").rename(crt)  # (put back: the store reads again)
        assert await store.head() == head
    for failed in (read.value, command.value):
        assert failed.details.get("field") == "sslcert", failed.details
        assert "transient" not in failed.details, failed.details
        assert f"sslcert: {crt}" in failed.message, failed.message
        assert "socket" not in failed.message, failed.message
    assert "the command was not run" in command.value.message


async def test_an_open_that_does_not_trust_the_servers_certificate_says_what_to_check(
    pg_url: str, proxy: tuple[_TlsProxy, int, Path]
) -> None:
    """Regression: the open's first connect named a server offering no TLS and a failed handshake,
    but a certificate the client does not trust (``sslmode=verify-ca``, another CA's) was told
    ``InvalidInput`` "Malformed PostgreSQL URL ...: [SSL: CERTIFICATE_VERIFY_FAILED] ..." (its
    ``SSLCertVerificationError`` is a ``ValueError`` too, as asyncpg's refusals of a URL are): the
    URL is sound. ``evstore.storage`` now, saying what to check, not transient."""
    server, port, ca = proxy
    server.mode = "other"
    with pytest.raises(StorageError) as failed:
        async with open_store(_via(pg_url, port, f"sslmode=verify-ca&sslrootcert={quote(str(ca))}")):
            pass
    assert failed.value.code == "evstore.storage"
    assert "Malformed" not in failed.value.message
    assert "transient" not in failed.value.details, failed.value.details
    assert "does not trust the server's certificate" in failed.value.message, failed.value.message
    assert "sslrootcert" in failed.value.message
