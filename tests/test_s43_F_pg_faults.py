"""PostgreSQL under what a DBA or a deployment does to a running store (stop 43, helper F): the
role's settings changed under it (``ALTER ROLE ... SET``: search_path, statement_timeout,
lock_timeout, idle_in_transaction_session_timeout, default_transaction_read_only), its sessions
ended or cancelled by an admin (``pg_terminate_backend``, ``pg_cancel_backend``) while commands
run and a subscriber follows, a table locked by another session. Each command succeeds, or fails
as ``evstore.storage`` saying whether it may have committed; afterwards the log holds exactly the
accepted ones (plus those of unknown outcome, either way), the audit is clean and the same store
goes on without being reopened."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import (
    AllocationStore,
    EvstoreError,
    Inventory,
    ProviderNotFound,
    Receipt,
    StorageError,
    open_store,
)
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_s39_d_storage import _Server, own_server  # noqa: F401 (a fixture)

#: seconds of each campaign (EVSTORE_SLOW=1: longer)
SLOW = os.environ.get("EVSTORE_SLOW") == "1"
CAMPAIGN = 20.0 if SLOW else 1.0


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


def _as(url: str, role: str, *, search_path: bool = True) -> str:
    """``url`` logging in as ``role``; without its ``search_path`` (the role's default then)."""
    parts = urlsplit(url)
    query = [(k, v) for k, v in parse_qsl(parts.query) if search_path or k != "search_path"]
    netloc = f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))


@pytest.fixture
async def role(pg_url: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A login role of its own, that may use and create in the test's schema (its name; an admin
    connection to change its settings)."""
    name = f"evt_s43f_{os.getpid()}_{random.randrange(10**6)}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"CREATE ROLE {name} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{_schema(pg_url)}" TO {name}')
        yield name, admin
    finally:
        await admin.execute(f"ALTER ROLE {name} RESET ALL")
        await admin.execute(f"DROP OWNED BY {name} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {name}")
        await admin.close()


async def _end_sessions(admin: asyncpg.Connection, role: str) -> None:
    await admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)


async def test_a_store_keeps_its_schema_when_the_roles_search_path_changes(
    pg_url: str, role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression: a store opened by a URL without ``search_path`` is the store of the role's
    search_path at the open; when the DBA changed the role's (``ALTER ROLE ... SET search_path``),
    each connection the pool opened after it (a reconnect after a restart, a terminated session)
    landed in the other schema: the same open store read another store's providers and log, wrote
    its commands there - under the locks of the first store's schema, not those the other's
    writers take - or failed for a table it could not find. It keeps the search_path it opened
    with."""
    name, admin = role
    from tests.pg import fresh_database_url

    other_url = fresh_database_url()  # (another store, in a schema of its own)
    await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{_schema(other_url)}" TO {name}')
    async with open_store(_as(other_url, name)) as other:
        theirs = await make_provider(other, "theirs", VCPU=10)
        their_head = await other.head()
    await admin.execute(f"ALTER ROLE {name} SET search_path = '{_schema(pg_url)}'")
    async with open_store(_as(pg_url, name, search_path=False), pool_size=3) as store:
        ours = await make_provider(store, "ours", VCPU=10)
        await allocate(store, new_uuid(), {ours: {"VCPU": 1}})
        head = await store.head()
        await admin.execute(f"ALTER ROLE {name} SET search_path = '{_schema(other_url)}'")
        await _end_sessions(admin, name)
        for _ in range(3):  # (the first may meet a connection the server ended)
            try:
                await allocate(store, new_uuid(), {ours: {"VCPU": 1}})
                break
            except StorageError as exc:
                assert exc.details.get("transient") is True, exc.details
        assert await store.head() == head + 1
        assert (await store.usage(ours))["VCPU"] == 2
        with pytest.raises(ProviderNotFound):
            await allocate(store, new_uuid(), {theirs: {"VCPU": 1}})
        assert (await store.audit()).clean
    async with open_store(_as(other_url, name)) as other:
        assert await other.head() == their_head


class _Burst:
    """16 tasks claiming with idempotency keys, and a subscriber that follows (subscribing again
    ``after=`` the last position it delivered when it ends with an error, as README says); then
    the checks every fault here ends with."""

    def __init__(self, store: AllocationStore, providers: list[str]) -> None:
        self.store, self.providers = store, providers
        self.asks: dict[str, tuple[str, str]] = {}
        self.ended: dict[str, tuple[str, list[int]]] = {}
        self.failures: Counter[tuple[str | None, str | None]] = Counter()
        self.seen: list[int] = []
        #: the errors the subscriber ended with (a connection lost is retried inside it: none)
        self.sub_errors: list[StorageError] = []
        self.stop = asyncio.Event()
        self._keys = iter(range(10**9))

    async def claim(self, key: str) -> Receipt:
        consumer, rp = self.asks[key]
        return await self.store.set_allocations(
            consumer,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            idempotency_key=key,
        )

    async def _client(self, n: int) -> None:
        while not self.stop.is_set():
            key = f"k{next(self._keys)}"
            self.asks[key] = (str(uuid.uuid4()), self.providers[n % len(self.providers)])
            try:
                self.ended[key] = ("ok", list((await self.claim(key)).positions))
            except StorageError as exc:
                unknown = exc.details.get("outcome_unknown")
                assert unknown in (True, False), (exc.details, exc.message)  # (keyed: always said)
                self.ended[key] = ("unknown" if unknown else "clean", [])
                self.failures[(exc.details.get("sqlstate"), exc.details.get("reason"))] += 1
                await asyncio.sleep(0.02)

    async def _follow(self) -> None:
        while True:
            try:
                async for event in self.store.subscribe(after=self.seen[-1] if self.seen else 0):
                    self.seen.append(event.position)
            except StorageError as exc:
                self.sub_errors.append(exc)
                await asyncio.sleep(0.05)

    async def run(self, fault: Any) -> None:
        """Run the burst while ``fault()`` (a coroutine function) does its worst."""
        follower = asyncio.create_task(self._follow())
        clients = [asyncio.create_task(self._client(n)) for n in range(16)]
        try:
            await fault()
        finally:
            self.stop.set()
            await asyncio.wait_for(asyncio.gather(*clients), 30)
        try:
            head = await self.store.head()
            async with asyncio.timeout(10):
                while not self.seen or self.seen[-1] < head:
                    await asyncio.sleep(0.02)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower

    async def check(self) -> None:
        """The log holds exactly the accepted commands (those of unknown outcome either way; a
        retry with the key answers which), the subscriber saw each event once, in order, the
        audit is clean, and the same store takes commands."""
        head = await self.store.head()
        events = await self.store.read(0, head + 10)
        assert [e.position for e in events] == list(range(1, head + 1))
        assert self.seen == list(range(1, head + 1))
        by_key: dict[str, list[int]] = {}
        for e in events:
            if e.metadata.idempotency_key is not None:
                by_key.setdefault(e.metadata.idempotency_key, []).append(e.position)
        for key, (outcome, positions) in self.ended.items():
            if outcome == "ok":
                assert by_key[key] == positions, key
            elif outcome == "clean":
                assert key not in by_key, f"{key} failed, rolled back, but is in the log"
            else:
                receipt = await self.claim(key)
                assert receipt.replayed == (key in by_key), (key, receipt)
        assert sum(1 for v in self.ended.values() if v[0] == "ok") > 0
        assert (await self.store.audit(history=True)).clean
        self.asks["after"] = (str(uuid.uuid4()), self.providers[0])
        assert not (await self.claim("after")).replayed


@pytest.mark.parametrize("end", ["pg_terminate_backend", "pg_cancel_backend"])
async def test_sessions_ended_or_cancelled_by_an_admin_under_a_burst_lose_nothing(
    pg_url: str, end: str
) -> None:
    """An admin's ``pg_terminate_backend`` / ``pg_cancel_backend`` of the store's busy sessions
    at random moments (a second connection finds them by the store's application_name) while
    16 tasks run commands and a subscriber follows."""
    app = f"evt_s43f_{uuid.uuid4().hex[:8]}"
    admin = await asyncpg.connect(pg_url)
    try:
        async with open_store(f"{pg_url}&application_name={app}", pool_size=8) as store:
            providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(4)]
            burst = _Burst(store, providers)

            async def fault() -> None:
                loop = asyncio.get_running_loop()
                until = loop.time() + CAMPAIGN
                while loop.time() < until:
                    await asyncio.sleep(random.uniform(0, 0.1))
                    pids = await admin.fetch(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND state <> 'idle'",
                        app,
                    )
                    if pids:
                        await admin.execute(f"SELECT {end}($1)", random.choice(pids)[0])

            await burst.run(fault)
            await burst.check()
            if end == "pg_terminate_backend":  # (a cancelled read is an answer of the server: it ends)
                assert not burst.sub_errors, burst.sub_errors
    finally:
        await admin.close()


@pytest.mark.parametrize(
    ("setting", "sqlstate", "reason"),
    [
        ("statement_timeout = '2ms'", "57014", None),
        ("lock_timeout = '1ms'", None, None),  # (one process's commands seldom wait for locks)
        ("idle_in_transaction_session_timeout = '1ms'", None, None),
        ("default_transaction_read_only = on", "25006", "read_only"),
    ],
)
async def test_a_dba_setting_on_the_role_under_a_burst_fails_commands_cleanly_and_passes(
    pg_url: str,
    role: tuple[str, asyncpg.Connection],
    setting: str,
    sqlstate: str | None,
    reason: str | None,
) -> None:
    """``ALTER ROLE ... SET`` while the store runs (its sessions ended, so the pool's new ones
    take the setting): the commands it stops fail as ``evstore.storage`` saying they were
    rolled back (``idle_in_transaction_session_timeout``: the server ends the session between a
    command's statements); once the DBA resets it, the same store goes on."""
    name, admin = role
    async with open_store(_as(pg_url, name), pool_size=8) as store:
        providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(4)]
        burst = _Burst(store, providers)

        async def fault() -> None:
            await admin.execute(f"ALTER ROLE {name} SET {setting}")
            await _end_sessions(admin, name)
            await asyncio.sleep(CAMPAIGN)
            await admin.execute(f"ALTER ROLE {name} RESET ALL")
            await _end_sessions(admin, name)
            await asyncio.sleep(0.3)

        await burst.run(fault)
        await burst.check()
        if sqlstate is not None:
            assert any(s == sqlstate and r == reason for s, r in burst.failures), burst.failures


@pytest.mark.parametrize(
    "table", ["events", "p_providers", "idempotency", "p_classes"] if SLOW else ["events", "p_providers"]
)
async def test_a_table_locked_by_another_session_holds_commands_back_then_they_go_on(
    pg_url: str, table: str
) -> None:
    """``LOCK TABLE ... IN ACCESS EXCLUSIVE MODE`` by another session for a second and a half
    under a burst: with ``command_timeout`` the commands it holds past it fail, rolled back; the
    others wait, and all go on once it is released."""
    async with open_store(pg_url, pool_size=8, command_timeout=0.5) as store:
        providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(4)]
        burst = _Burst(store, providers)
        admin = await asyncpg.connect(pg_url)
        try:

            async def fault() -> None:
                await asyncio.sleep(0.2)
                async with admin.transaction():
                    await admin.execute(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE")
                    await asyncio.sleep(1.5)
                await asyncio.sleep(0.3)

            await burst.run(fault)
        finally:
            await admin.close()
        await burst.check()
        assert set(burst.failures) <= {(None, None)}, burst.failures  # (timeouts of the client's)


@pytest.mark.skipif(not SLOW, reason="a server of its own, restarted: EVSTORE_SLOW=1")
async def test_a_server_restart_under_a_burst_with_a_subscriber_following(
    own_server: _Server,  # noqa: F811 (the fixture)
) -> None:
    """A crash and recovery of the server (``pg_ctl stop -m immediate``, then start) while 16
    tasks run commands and a subscriber follows: as above, and the subscriber, subscribing
    again after the last position it delivered, sees each event once (tests/test_s39_d_storage.py
    restarts without a subscriber)."""
    async with open_store(own_server.url, pool_size=8, connect_timeout=2) as store:
        providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(4)]
        burst = _Burst(store, providers)

        async def fault() -> None:
            await asyncio.sleep(0.3)
            await own_server.restart("immediate")
            await asyncio.sleep(CAMPAIGN)

        await burst.run(fault)
        await burst.check()
        assert not burst.sub_errors, burst.sub_errors  # (an outage that passes: followed through)


def test_a_connection_broken_under_asyncpgs_state_machine_says_what_ended_it() -> None:
    """Regression: a session the server ended while asyncpg had it between two of its states
    (seen under pg_terminate_backend, a restart, idle_in_transaction_session_timeout) came back
    as "Lost the connection to PostgreSQL while running a command: cannot switch to state 12;
    another operation (2) is in progress" - asyncpg's internals, with nothing of what happened
    nor what to do."""
    from evstore.log import postgres

    internal = asyncpg.InternalClientError("cannot switch to state 12; another operation (2) is in progress")
    for committing in (False, True, None):
        failed = postgres._storage_error(internal, "running a command", committing)
        assert failed.details["transient"] is True
        assert failed.message.startswith("Lost the connection to PostgreSQL while running a command: ")
        assert "ended" in failed.message and "pg_terminate_backend" in failed.message, failed.message
        assert "cannot switch to state 12" in failed.message  # (asyncpg's words kept, for a report)


async def test_two_stores_in_two_schemas_of_one_database_stay_apart(pg_url: str) -> None:
    """Two stores of one process in two schemas of the same database - one whose name needs
    quoting (``?search_path=%22...%22``) - with the same provider, consumer and idempotency key
    in each, their sessions ended by an admin midway: each reads and writes its own, and keeps
    to it after reconnecting."""
    from urllib.parse import quote

    quoted = f"S43F-Quoted {uuid.uuid4().hex[:6]}"
    admin = await asyncpg.connect(pg_url)
    await admin.execute(f'CREATE SCHEMA "{quoted}"')
    try:
        other_url = pg_url.replace(
            f"search_path={_schema(pg_url)}", f"search_path={quote(chr(34) + quoted + chr(34))}"
        )
        rp, consumer = new_uuid(), new_uuid()
        app = f"evt_s43f_{uuid.uuid4().hex[:8]}"  # (the admin ends these stores' sessions only)
        async with (
            open_store(f"{pg_url}&application_name={app}") as one,
            open_store(f"{other_url}&application_name={app}") as two,
        ):
            for n, store in ((1, one), (2, two)):
                await store.create_provider(rp, f"rp{n}")
                await store.set_inventories(rp, {"VCPU": Inventory(total=10 * n)}, generation=0)
            await admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = $1", app
            )
            for n, store in ((1, one), (2, two)):
                for _ in range(3):  # (the first may meet a session the admin ended)
                    try:
                        receipt = await store.set_allocations(
                            consumer,
                            {rp: {"VCPU": n}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                            idempotency_key="same key",
                        )
                        break
                    except StorageError as exc:
                        assert exc.details.get("transient") is True, exc.details
                assert not receipt.replayed
            for n, store in ((1, one), (2, two)):
                assert (await store.usage(rp))["VCPU"] == n
                assert (await store.inventories(rp))["VCPU"].total == 10 * n
                assert (await store.provider(rp)).name == f"rp{n}"
                assert await store.head() == 3
                assert (await store.audit(history=True)).clean
        assert await admin.fetchval(f'SELECT count(*) FROM "{quoted}".events') == 3
    finally:
        await admin.execute(f'DROP SCHEMA "{quoted}" CASCADE')
        await admin.close()


async def test_an_open_tried_again_after_the_dba_fixed_the_roles_search_path_finds_the_store(
    pg_url: str, role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression (of the search_path kept since the first connection): an open that failed -
    the role's search_path named a schema without the store, ``create=False`` - and was tried
    again on the same store object once the DBA fixed it kept the search_path the failed open
    had found, and failed again."""
    from evstore.store import make_backend

    name, admin = role
    async with open_store(_as(pg_url, name)) as store:
        await make_provider(store, "ours", VCPU=10)
    await admin.execute(f"ALTER ROLE {name} SET search_path = 'pg_catalog'")
    store = AllocationStore(make_backend(_as(pg_url, name, search_path=False), create=False))
    with pytest.raises(EvstoreError):
        await store.open()
    await admin.execute(f"ALTER ROLE {name} SET search_path = '{_schema(pg_url)}'")
    await store.open()
    try:
        assert await store.head() == 2
    finally:
        await store.close()
