"""Storage probes of stop 41 (helper D): damaged projection rows read by every query alike, a
read-only store file's commands refused with what to do, PostgreSQL's refused connects saying
what to check."""

from __future__ import annotations

import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from evstore import AllocationStore, CorruptEvent, ProjectionCorrupt, StorageError, open_store
from tests.conftest import allocate, make_provider, new_uuid

ROOT = Path(__file__).resolve().parent.parent


async def _damage_allocation(store: AllocationStore, consumer: str, provider: str, amount: object) -> None:
    """The projection row of ``consumer``'s allocation of VCPU on ``provider`` set to ``amount``."""
    if store.url.startswith("sqlite"):
        await store.backend.tamper(
            "UPDATE p_allocations SET resources = json_object('VCPU', json(?)) "
            "WHERE consumer = ? AND provider = ?",
            (_json(amount), consumer, provider),
        )
    else:
        await store.backend.tamper(
            "UPDATE p_allocations SET used = ? WHERE consumer = ? AND provider = ?",
            (amount, consumer, provider),
        )


def _json(value: object) -> str:
    import json

    return json.dumps(value)


@pytest.mark.parametrize("amount", [-5, 0, "5"])
async def test_provider_allocations_refuses_a_damaged_amount_as_allocations_does(
    store: AllocationStore, amount: object
) -> None:
    """Finding (stop 41, helper D): an allocation row damaged by hand to an amount evstore never
    writes (-5, 0, the text "5") was refused by ``allocations(consumer)`` and by every command on
    the consumer (``evstore.projection.corrupt``, "rebuild"), but ``provider_allocations(provider)``
    - Placement's GET /resource_providers/{uuid}/allocations, what a scheduler sums - answered it
    as the consumer's holding: ``{'VCPU': -5}``. Now it refuses it the same way."""
    if amount == "5" and not store.url.startswith("sqlite"):
        pytest.skip("PostgreSQL's column is a bigint: it cannot hold text")
    rp = await make_provider(store, VCPU=8)
    damaged, other = new_uuid(), new_uuid()
    await allocate(store, damaged, {rp: {"VCPU": 1}})
    await allocate(store, other, {rp: {"VCPU": 2}})
    await _damage_allocation(store, damaged, rp, amount)
    with pytest.raises(ProjectionCorrupt) as by_consumer:
        await store.allocations(damaged)
    with pytest.raises(ProjectionCorrupt) as by_provider:
        await store.provider_allocations(rp)
    assert by_provider.value.code == "evstore.projection.corrupt"
    assert by_provider.value.details["consumer"] == damaged == by_consumer.value.details["consumer"]
    assert by_provider.value.details["provider"] == rp
    assert "rebuild" in by_provider.value.message and repr(amount) in by_provider.value.message
    await store.rebuild()
    assert await store.provider_allocations(rp) == {damaged: {"VCPU": 1}, other: {"VCPU": 2}}
    assert (await store.audit()).clean


def _without_write_permission() -> list[str] | None:
    """A prefix that runs a command as root without the capabilities that let root write any
    file (as tests/test_cli_hostile.py does); None where that cannot be done."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        return None
    caps = "-dac_override,-dac_read_search,-fowner"
    probe = subprocess.run(["setpriv", "--bounding-set", caps, "--inh-caps", caps, "true"], check=False)
    return ["setpriv", "--bounding-set", caps, "--inh-caps", caps] if probe.returncode == 0 else None


READ_ONLY_PROBE = """
import asyncio, json, sys
import structlog, logging
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
from evstore import EvstoreError, open_store

async def main():
    out = {}
    async with open_store(sys.argv[1]) as store:
        out["head"] = await store.head()
        try:
            await store.create_provider(sys.argv[2], "another")
        except EvstoreError as exc:
            out["error"] = exc.to_dict()
        out["head_after"] = await store.head()
        out["clean"] = (await store.audit()).clean
    print(json.dumps(out))

asyncio.run(main())
"""


async def test_a_command_on_a_read_only_store_file_says_what_to_do(tmp_path: Path) -> None:
    """Finding (stop 41, helper D): a store file the process may read but not write (mode 0444, in
    a directory it may write: its -wal and -shm files can be made) opens, and its reads answer; but
    each command failed with SQLite's bare "SQLite error: attempt to write a readonly database"
    and only ``sqlite_error: OperationalError`` - no word of the file's permissions, where a
    read-only directory's open says what to do. Now the command's error says that the file (or its
    -wal or -shm) may not be written, to check its permissions or the file system's, that nothing
    was written, and ``details["reason"]`` is ``"read_only"`` (``outcome_unknown`` False)."""
    prefix = _without_write_permission()
    if prefix is None:
        pytest.skip("cannot drop root's right to write any file here (no setpriv)")
    path = tmp_path / "s.db"
    async with open_store(f"sqlite:///{path}") as store:
        await make_provider(store, VCPU=8)
    path.chmod(0o444)
    try:
        run = subprocess.run(
            [*prefix, sys.executable, "-c", READ_ONLY_PROBE, f"sqlite:///{path}", new_uuid()],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            check=False,
        )
    finally:
        path.chmod(0o644)
    assert run.returncode == 0, run.stderr
    import json

    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["head"] == out["head_after"] == 2 and out["clean"]
    error = out["error"]
    assert error["code"] == StorageError.code
    assert error["details"]["reason"] == "read_only"
    assert error["details"]["outcome_unknown"] is False
    assert "permission" in error["message"] and "nothing of it was written" in error["message"]
    with sqlite3.connect(path) as conn:  # (and nothing was)
        assert conn.execute("SELECT count(*) FROM events").fetchone()[0] == 2


def _server_url() -> str:
    from tests.pg import server_url

    return server_url()


async def test_a_postgresql_login_refused_says_what_to_check() -> None:
    """Finding (stop 41, helper D): a login the server refuses (a role that does not exist, a
    wrong password, no pg_hba.conf entry: SQLSTATE class 28) was "Cannot connect to PostgreSQL at
    URL: role "nosuchuser" does not exist" with only the URL in its details, where a missing
    database says what to do. Now it says to check the URL's user and password and the server's
    pg_hba.conf, and its details carry the ``sqlstate``."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(_server_url())
    netloc = f"nosuchuser_s41:secret@{parts.hostname}:{parts.port}"
    url = urlunsplit(parts._replace(netloc=netloc))
    with pytest.raises(StorageError) as caught:
        async with open_store(url):
            pass
    assert caught.value.details["sqlstate"].startswith("28")
    assert "nosuchuser_s41" in caught.value.message and "secret" not in caught.value.message
    assert "user name and password" in caught.value.message and "pg_hba.conf" in caught.value.message


async def test_a_postgresql_port_nothing_listens_on_says_what_to_check() -> None:
    """Finding (stop 41, helper D): a URL whose host has nothing listening on its port said only
    "[Errno 111] Connect call failed ('127.0.0.1', N)". Now it says to check the host, the port
    and that the server is up."""
    import socket

    with socket.socket() as sock:  # (a port just free: nothing listens on it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageError) as caught:
        async with open_store(f"postgresql://evstore:pw@127.0.0.1:{port}/evstore", connect_timeout=5):
            pass
    assert "Connect call failed" in caught.value.message and "pw" not in caught.value.message
    assert "check the host and the port" in caught.value.message


async def test_a_postgresql_socket_directory_without_a_server_says_what_to_check(tmp_path: Path) -> None:
    """Finding (stop 41, helper D): a URL naming a Unix socket directory where no server listens
    said only "[Errno 2] No such file or directory". Now it says which part of the URL to check."""
    with pytest.raises(StorageError) as caught:
        async with open_store(f"postgresql:///evstore?host={tmp_path}", connect_timeout=5):
            pass
    assert "No such file or directory" in caught.value.message
    assert "no server socket there" in caught.value.message


@pytest.mark.parametrize("receipt", ["{bad", "[]", "null", '{"positions": "x"}', '{"positions": [1, "a"]}'])
async def test_a_damaged_idempotency_receipt_is_a_typed_error_that_says_what_it_means(
    store: AllocationStore, receipt: str
) -> None:
    """Finding (stop 41, helper D): a retry whose key's stored receipt was damaged (its row edited
    by hand, a bad restore) failed as "Storage failure: JSONDecodeError('Expecting property name
    ...')" or "Storage failure: KeyError('consumer_generations')" - the repr of an exception from
    inside the decoding, no word of which key or what to do. Now it is ``evstore.storage`` with
    ``details["reason"] == "damaged"`` and the ``idempotency_key``, saying that the command was
    committed under the key before and nothing was written now; the store goes on."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()

    async def claim() -> object:
        return await store.set_allocations(
            c,
            {rp: {"VCPU": 1}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
            idempotency_key="key-1",
        )

    await claim()
    head = await store.head()
    await store.backend.tamper("UPDATE idempotency SET receipt = ? WHERE key = ?", (receipt, "key-1"))
    with pytest.raises(StorageError) as caught:
        await claim()
    assert caught.value.details["reason"] == "damaged"
    assert caught.value.details["idempotency_key"] == "key-1"
    assert caught.value.details["outcome_unknown"] is False
    assert "key-1" in caught.value.message and "committed" in caught.value.message
    assert "Storage failure" not in caught.value.message
    assert await store.head() == head
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # (the store goes on)
    assert (await store.audit()).clean


async def test_a_subscriber_resumed_on_another_event_loop_raises_wrong_event_loop(sqlite_url: str) -> None:
    """Finding (stop 41, helper D): a subscriber begun on the store's loop and then iterated from
    another loop (a thread's ``asyncio.run``) did not raise ``WrongEventLoop`` as every other call
    does: it waited on that loop for appends no one would announce there - for ever (its poller,
    started on that loop, could not read). Now its next iteration raises ``WrongEventLoop``; the
    store goes on serving its own loop's subscribers."""
    import asyncio
    import threading

    from evstore import WrongEventLoop

    async with open_store(sqlite_url, poll_interval=0.05) as store:
        await make_provider(store, VCPU=1)
        events = store.subscribe()
        while (await events.__anext__()).position < await store.head():
            pass
        caught: list[BaseException] = []

        def elsewhere() -> None:
            async def resume() -> None:
                try:
                    await asyncio.wait_for(events.__anext__(), 10)
                except BaseException as exc:
                    caught.append(exc)

            asyncio.run(resume())

        thread = threading.Thread(target=elsewhere)
        thread.start()
        while thread.is_alive():  # (the store's loop runs meanwhile)
            await asyncio.sleep(0.02)
        assert len(caught) == 1 and isinstance(caught[0], WrongEventLoop), caught
        head = await store.head()
        follower = store.subscribe(after=head)
        async with open_store(sqlite_url) as other:  # (another connection's append: the poller's)
            await make_provider(other, VCPU=1)
        assert (await asyncio.wait_for(follower.__anext__(), 10)).position == head + 1
        await follower.aclose()


@pytest.mark.parametrize("create", [True, False])
async def test_a_symlink_loop_is_refused_as_no_database_file(tmp_path: Path, create: bool) -> None:
    """Finding (stop 41, helper D): a store path that is a symbolic link loop (``loop.db`` ->
    ``loop.db``) raised a bare ``RuntimeError: Symlink loop from ...`` with ``create=False`` (as
    the read-only CLI commands open), and with ``create=True`` "unable to open database file
    (evstore needs to write the file and its directory ...: work on a writable copy)", which is
    not the trouble. Now both are ``evstore.invalid_input`` saying it is a symbolic link loop, as a
    directory or a FIFO at the path is refused."""
    from evstore import InvalidInput

    link = tmp_path / "loop.db"
    link.symlink_to("loop.db")
    with pytest.raises(InvalidInput) as caught:
        async with open_store(f"sqlite:///{link}", create=create):
            pass
    assert "symbolic link loop" in caught.value.message and str(link) in caught.value.message


async def test_a_symlink_into_a_missing_directory_is_not_found_as_a_missing_directory_is(
    tmp_path: Path,
) -> None:
    """Finding (stop 41, helper D): a store path that is a symbolic link to a file in a directory
    that does not exist (a volume not mounted, a moved data directory) was refused as
    ``evstore.storage`` "unable to open database file (evstore needs to write the file and its
    directory ... work on a writable copy)", where the same path written out is
    ``evstore.not_found`` "directory ... does not exist". Now the link is refused that way, naming
    the missing directory and the link's target; a link to a file yet to be made in a directory
    that exists still makes the store there."""
    from evstore import NotFound

    link = tmp_path / "s.db"
    link.symlink_to(tmp_path / "unmounted" / "s.db")
    with pytest.raises(NotFound) as caught:
        async with open_store(f"sqlite:///{link}"):
            pass
    assert f"directory {tmp_path / 'unmounted'} does not exist" in caught.value.message
    assert str(tmp_path / "unmounted" / "s.db") in caught.value.message
    (tmp_path / "unmounted").mkdir()
    async with open_store(f"sqlite:///{link}") as store:
        await make_provider(store, VCPU=1)
    assert (tmp_path / "unmounted" / "s.db").is_file()


async def test_a_postgresql_session_that_may_not_write_says_so_with_the_reason_sqlite_gives(
    pg_url: str,
) -> None:
    """Finding (stop 41, helper D): a command on a PostgreSQL session that may not write (a hot
    standby, ``default_transaction_read_only`` set for the role, the database or in the URL) was
    "cannot execute INSERT in a read-only transaction; it was rolled back" with only the sqlstate
    25006 - no word of where such a session comes from or what to do, nor the ``reason`` a
    read-only SQLite file now gives. Now ``details["reason"] == "read_only"``, and the message
    says to run commands on the primary or with a session that may write; reads still answer."""
    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=1)
    async with open_store(f"{pg_url}&default_transaction_read_only=on") as store:
        head = await store.head()
        with pytest.raises(StorageError) as caught:
            await make_provider(store, VCPU=1)
        assert caught.value.details["reason"] == "read_only"
        assert caught.value.details["outcome_unknown"] is False
        assert "primary" in caught.value.message
        assert await store.head() == head and (await store.audit()).clean


@pytest.mark.parametrize("damaged", ["yesterday", "5"])
async def test_a_damaged_time_on_the_last_event_does_not_spread_to_new_events(
    store: AllocationStore, damaged: str, request: pytest.FixtureRequest
) -> None:
    """Finding (stop 41, helper D): the writer records each new event at the later of its clock
    and the last event's time (times never go backwards), comparing them as text: a last row whose
    ``recorded_at`` was damaged ("yesterday", "5": text that sorts after any "2026-...") was copied
    into every event appended after it - commands accepted, their events unreadable
    (``evstore.log.corrupt`` "Cannot decode the envelope at position N") for ``read``,
    ``history``, ``subscribe`` and export: the damage of one row spread to all that came after.
    Now a time that is no time is not taken over: the new events are recorded at the clock, and
    only the damaged row stays for the audit to name. (PostgreSQL's sequencer does the same in its
    SQL function, which only a schema upgrade can replace: left as a strict xfail there.)"""
    if not store.url.startswith("sqlite"):
        request.applymarker(
            pytest.mark.xfail(
                strict=True,
                raises=CorruptEvent,
                reason="PostgreSQL's sequencer (the SQL function evstore_sequence, replaced only by a "
                "schema upgrade) still copies a damaged last time into the events it positions",
            )
        )
    rp = await make_provider(store, VCPU=8)
    head = await store.head()
    await store.backend.tamper("UPDATE events SET recorded_at = ? WHERE position = ?", (damaged, head))
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    [event] = await store.read(after=head)
    assert event.position == head + 1 and event.recorded_at.year >= 2020
    report = await store.audit()
    assert {f.positions[0] for f in report.integrity if "envelope" in f.message} == {head}


async def test_postgresql_usages_refuses_a_damaged_amount_as_allocations_does(pg_url: str) -> None:
    """Finding (stop 41, helper D): on PostgreSQL ``usages(project)`` sums the allocation rows, and
    summed one damaged to -5 (which ``allocations(consumer)`` and every command on the consumer
    refuse, ``evstore.projection.corrupt``) into the project's total: ``{'VCPU': -3}`` for a
    project holding 4 - what a quota check reads. Now it refuses it the same way, naming the
    consumer and the provider. (SQLite's ``usages`` reads its own counters, not these rows.)"""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=16)
        damaged = new_uuid()
        for consumer in (damaged, new_uuid()):
            await allocate(store, consumer, {rp: {"VCPU": 2}}, project_id="p")
        await store.backend.tamper("UPDATE p_allocations SET used = -5 WHERE consumer = ?", (damaged,))
        for consumer_type in (None, "all", "INSTANCE"):
            with pytest.raises(ProjectionCorrupt) as caught:
                await store.usages("p", consumer_type=consumer_type)
            assert caught.value.details == {"consumer": damaged, "provider": rp}
            assert "rebuild" in caught.value.message
        await store.rebuild()
        assert (await store.usages("p")).usages == {"VCPU": 4}
