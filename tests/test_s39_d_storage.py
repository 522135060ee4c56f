"""Storage under failure (stop 39, helper D): PostgreSQL's insufficient-resources errors (SQLSTATE
class 53) each with its own ``details["reason"]`` and what to do; a SQLite file that is not a
database or is damaged, said so; one of several writer processes killed mid-append (both
backends): nothing acknowledged lost or doubled, nothing refused left behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import asyncpg
import pytest

from evstore import AllocationStore, EvstoreError, Receipt, StorageError, open_store
from evstore.log import postgres
from evstore.log.postgres import PostgresBackend
from tests.conftest import allocate, make_provider, new_uuid

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
#: rounds of the kill tests (EVSTORE_SLOW=1: more)
ROUNDS = 40 if os.environ.get("EVSTORE_SLOW") == "1" else 5

#: class 53's conditions other than disk_full: (SQLSTATE, asyncpg's class, reason, a word of the advice)
SHORTAGES = [
    ("53000", asyncpg.exceptions.InsufficientResourcesError, "insufficient_resources", "lower the load"),
    ("53200", asyncpg.exceptions.OutOfMemoryError, "out_of_memory", "memory"),
    ("53300", asyncpg.exceptions.TooManyConnectionsError, "too_many_connections", "pool_size"),
    (
        "53400",
        asyncpg.exceptions.ConfigurationLimitExceededError,
        "configuration_limit_exceeded",
        "raise that",
    ),
]


@pytest.mark.parametrize(("sqlstate", "cls", "reason", "advice"), SHORTAGES)
def test_a_resource_shortage_of_the_server_has_its_reason_and_says_what_to_do(
    sqlstate: str, cls: type[asyncpg.PostgresError], reason: str, advice: str
) -> None:
    """Regression: SQLSTATEs 53000, 53200, 53300 and 53400 came back as a bare "PostgreSQL error"
    with no ``details["reason"]``, unlike 53100 (disk_full): a caller could not tell the server
    out of memory or connections from any other error, nor read what to do."""
    for committing in (None, False):
        failed = postgres._storage_error(cls("no room for it"), "running a command", committing)
        assert failed.code == "evstore.storage"
        assert failed.details["sqlstate"] == sqlstate
        assert failed.details["reason"] == reason, failed.details
        assert advice in failed.message and "retry" in failed.message, failed.message
        if committing is False:
            assert failed.details["outcome_unknown"] is False
            assert failed.message.endswith("it was rolled back")
        else:
            assert "rolled back" not in failed.message
    # (an unknown condition of the class is the class's)
    unknown = asyncpg.PostgresError("something short")
    unknown.sqlstate = "53999"  # type: ignore[attr-defined]
    assert postgres._storage_error(unknown, "reading", None).details["reason"] == "insufficient_resources"


_RAISE = (
    "CREATE OR REPLACE FUNCTION s39_short() RETURNS trigger LANGUAGE plpgsql AS $f$ BEGIN "
    "RAISE EXCEPTION 'short of it' USING ERRCODE = '{code}'; END $f$"
)


@pytest.mark.parametrize(("sqlstate", "reason"), [(s, r) for s, _, r, _ in SHORTAGES])
async def test_a_command_meeting_a_resource_shortage_says_so_and_the_store_goes_on(
    pg_url: str, sqlstate: str, reason: str
) -> None:
    """The same from a command whose write the server refused (a trigger raises the SQLSTATE where
    the server would): rolled back, its reason said, and the same command goes through after."""
    async with open_store(pg_url) as store:
        rp = await make_provider(store, VCPU=10)
        before = await store.head()
        await store.backend.tamper(_RAISE.format(code=sqlstate))  # type: ignore[attr-defined]
        await store.backend.tamper(  # type: ignore[attr-defined]
            "CREATE TRIGGER s39_short BEFORE INSERT ON events FOR EACH ROW EXECUTE FUNCTION s39_short()"
        )
        consumer = new_uuid()
        with pytest.raises(StorageError) as caught:
            await allocate(store, consumer, {rp: {"VCPU": 1}})
        assert caught.value.details["reason"] == reason
        assert caught.value.details["sqlstate"] == sqlstate
        assert caught.value.details["outcome_unknown"] is False
        assert await store.head() == before
        await store.backend.tamper("DROP TRIGGER s39_short ON events")  # type: ignore[attr-defined]
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        assert await store.head() == before + 1
        assert (await store.audit()).clean


@pytest.fixture
async def limited_role(pg_url: str) -> AsyncIterator[tuple[str, asyncpg.Connection]]:
    """A role of its own on the test schema (its name; an admin connection to change its limit)."""
    schema = dict(p.split("=", 1) for p in urlsplit(pg_url).query.split("&"))["search_path"]
    role = f"evt_s39d_{os.getpid()}"
    admin = await asyncpg.connect(pg_url)
    try:
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.execute(f"CREATE ROLE {role} LOGIN NOSUPERUSER")
        await admin.execute(f'GRANT USAGE, CREATE ON SCHEMA "{schema}" TO {role}')
        yield role, admin
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


def _as(url: str, role: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=f"{role}@{parts.netloc.rsplit('@', 1)[-1]}"))


async def test_too_many_connections_at_open_and_while_running_says_so(
    pg_url: str, limited_role: tuple[str, asyncpg.Connection]
) -> None:
    """Regression: an open the server refused a connection (too many connections for the role)
    raised a StorageError with no ``sqlstate`` and no ``reason``, saying nothing of what to do; one
    refused a further connection while running said "too_many_connections" only in the server's
    words. Both have ``details["reason"] == "too_many_connections"`` and name the limits; the
    store recovers once a slot is free, without reopening."""
    role, admin = limited_role
    url = _as(pg_url, role)
    await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 0")
    with pytest.raises(StorageError) as caught:
        async with open_store(url):
            pass
    assert caught.value.details["sqlstate"] == "53300"
    assert caught.value.details["reason"] == "too_many_connections"
    assert "CONNECTION LIMIT" in caught.value.message and "pool_size" in caught.value.message
    await admin.execute(f"ALTER ROLE {role} CONNECTION LIMIT 1")
    async with open_store(url, pool_size=3, min_pool_size=1, connect_timeout=0.3) as store:
        rp = await make_provider(store, VCPU=10)
        backend = store.backend
        assert isinstance(backend, PostgresBackend)
        async with backend._connection():  # (the role's one slot, held: a read needs another)
            with pytest.raises(StorageError) as caught:
                await store.head()
            with pytest.raises(StorageError) as refused:
                await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        for failed in (caught.value, refused.value):
            assert failed.details.get("reason") == "too_many_connections", (failed.details, failed.message)
            assert failed.details["sqlstate"] == "53300"
            assert "CONNECTION LIMIT" in failed.message and "pool_size" in failed.message
        assert refused.value.details["outcome_unknown"] is False
        assert await store.head() == 2
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert (await store.audit()).clean


async def _small_store(path: Path) -> tuple[str, str]:
    """A store at ``path`` with a provider and a consumer holding some of it (their uuids)."""
    async with open_store(f"sqlite:///{path}") as store:
        rp = await make_provider(store, VCPU=10**6)
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        for _ in range(200):
            await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    return rp, consumer


async def test_a_file_that_is_not_a_database_or_is_cut_short_is_refused_with_its_reason(
    tmp_path: Path,
) -> None:
    """Regression: a file that is not SQLite's said only "file is not a database", with
    ``details["sqlite_error"] == "DatabaseError"`` (the class of every SQLite error) and nothing
    of what to do; a damaged file had advice but no stable word for it either. They have
    ``details["reason"]`` ``"not_a_database"`` and ``"damaged"``, and say what to do."""
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not a database, but a text someone named .db\n" * 100)
    with pytest.raises(StorageError) as caught:
        async with open_store(f"sqlite:///{junk}"):
            pass
    assert caught.value.details["reason"] == "not_a_database", caught.value.details
    assert "check that the path" in caught.value.message and "backup" in caught.value.message
    cut = tmp_path / "cut.db"
    await _small_store(cut)
    with cut.open("r+b") as file:
        file.truncate(cut.stat().st_size // 2)
    with pytest.raises(StorageError) as caught:
        async with open_store(f"sqlite:///{cut}"):
            pass
    assert caught.value.details["reason"] == "damaged", caught.value.details
    assert "restore it from a backup" in caught.value.message


async def test_a_page_damaged_under_a_read_is_a_storage_error_with_its_reason(tmp_path: Path) -> None:
    """A damaged page met by a read (here the root page of the history index, overwritten) fails
    that read with ``details["reason"] == "damaged"`` and what to do; the rest of the store still
    answers."""
    path = tmp_path / "s.db"
    rp, consumer = await _small_store(path)
    with sqlite3.connect(path) as db:
        [(root,)] = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'event_entities'")
        [(page_size,)] = db.execute("PRAGMA page_size")
    db.close()
    with path.open("r+b") as file:
        file.seek((root - 1) * page_size)
        file.write(b"\xff" * 64)
    async with open_store(f"sqlite:///{path}") as store:
        assert (await store.usage(rp)).usages == {"VCPU": 201}
        with pytest.raises(StorageError) as caught:
            [e async for e in store.history(consumer)]
        assert caught.value.details["reason"] == "damaged", caught.value.details
        assert "restore it from a backup" in caught.value.message


#: a writer process for the kill tests: ``python -c WORKER URL LOG SEED``. Three tasks run keyed
#: commands - claims, releases, and claims bound to be refused (more than the tiny provider
#: holds) - and log each one as it starts ("start", with what it asks) and as it ends ("ok" with
#: its receipt's positions, "refused" with the error's code), a flushed line each.
WORKER = r"""
import asyncio, json, logging, os, random, sys, uuid
import structlog
from evstore import EvstoreError, StorageError, open_store

async def main(url, log_path, seed):
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    rng = random.Random(seed)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    say = lambda **line: os.write(fd, (json.dumps(line) + "\n").encode())
    async with open_store(url) as store:
        providers = {name: u for u, name in await store.providers()}
        big = [u for name, u in providers.items() if name.startswith("big")]
        print("ready", flush=True)
        held = []
        counter = iter(range(10**9))

        async def one():
            i = next(counter)
            key = f"{seed}-{i}"
            roll = rng.random()
            if roll < 0.15 and held:
                consumer = held.pop(rng.randrange(len(held)))
                ask = {"op": "release", "consumer": consumer}
            elif roll < 0.3:
                ask = {"op": "claim", "consumer": str(uuid.uuid4()), "rp": providers["tiny"], "n": 2}
            else:
                ask = {"op": "claim", "consumer": str(uuid.uuid4()), "rp": rng.choice(big), "n": 1}
            say(ev="start", key=key, **ask)
            try:
                if ask["op"] == "release":
                    receipt = await store.delete_consumer(ask["consumer"], idempotency_key=key)
                else:
                    receipt = await store.set_allocations(
                        ask["consumer"], {ask["rp"]: {"VCPU": ask["n"]}}, project_id="p", user_id="u",
                        consumer_type="INSTANCE", generation=None, idempotency_key=key)
            except StorageError as exc:
                say(ev="storage", key=key, code=exc.code, details=exc.details)
                return
            except EvstoreError as exc:
                say(ev="refused", key=key, code=exc.code)
                return
            say(ev="ok", key=key, positions=list(receipt.positions))
            if ask["op"] == "claim":
                held.append(ask["consumer"])

        async def task():
            while True:
                await one()

        await asyncio.gather(*(task() for _ in range(3)))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


async def _start_worker(url: str, log: Path, seed: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", WORKER, url, str(log), str(seed), stdout=asyncio.subprocess.PIPE, env=ENV
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.strip() == b"ready", line
    return proc


def _lines(log: Path) -> list[dict[str, Any]]:
    """The log's complete lines (a kill may cut the last one: it claims nothing)."""
    return [json.loads(x) for x in log.read_text().splitlines() if x.endswith("}")] if log.exists() else []


async def _retry(store: AllocationStore, ask: dict[str, Any]) -> Receipt:
    if ask["op"] == "release":
        return await store.delete_consumer(ask["consumer"], idempotency_key=ask["key"])
    return await store.set_allocations(
        ask["consumer"],
        {ask["rp"]: {"VCPU": ask["n"]}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        idempotency_key=ask["key"],
    )


async def _kill_one_of_several(url: str, tmp_path: Path, rounds: int, window: float) -> None:
    """Three processes append to one store; one of them is killed (SIGKILL) at a random moment
    while the others go on, then they are stopped too. Each round, then: every command a process
    was told succeeded is in the log exactly once, at the positions its receipt gave; each
    command refused left nothing; the positions are 1..head, each once; the audit is clean; and
    a command cut off by the kill, retried with its key, answers what happened (done once)."""
    async with open_store(url) as store:
        for i in range(3):
            await make_provider(store, f"big-{i}", VCPU=10**9)
        await make_provider(store, "tiny", VCPU=1)
    rng = random.Random(3939)
    seed = 0
    done_keys: dict[str, list[int]] = {}
    seen = {"ok": 0, "refused": 0, "storage": 0, "replayed": 0, "retried": 0}
    for _ in range(rounds):
        procs = []
        for _ in range(3):
            seed += 1
            procs.append((seed, await _start_worker(url, tmp_path / f"w{seed}.jsonl", seed)))
        await asyncio.sleep(rng.uniform(0.05, window))
        victim = rng.randrange(3)
        procs[victim][1].send_signal(signal.SIGKILL)
        await asyncio.sleep(rng.uniform(0.0, window))  # (the others go on without it)
        for _, proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            await asyncio.wait_for(proc.communicate(), 60)
        async with open_store(url) as store:
            head = await store.head()
            events = await store.read(0, head + 10)
            assert [e.position for e in events] == list(range(1, head + 1)), "positions not 1..head"
            by_key: dict[str, list[int]] = {}
            for e in events:
                key = e.metadata.idempotency_key
                if key is not None:
                    by_key.setdefault(key, []).append(e.position)
            for s, _ in procs:
                lines = _lines(tmp_path / f"w{s}.jsonl")
                asks = {x["key"]: x for x in lines if x["ev"] == "start"}
                ended = {x["key"]: x for x in lines if x["ev"] != "start"}
                for key, end in ended.items():
                    seen[end["ev"]] += 1
                    if end["ev"] == "ok":
                        assert by_key.get(key, []) == end["positions"], (key, end, by_key.get(key))
                    elif end["ev"] == "refused":
                        assert key not in by_key, f"refused {key} ({end['code']}) left events"
                    else:
                        assert end["ev"] == "storage", end
                # cut off by the kill (or failed on storage): retried with the key, done once
                for key in (k for k in asks if ended.get(k, {}).get("ev") in (None, "storage")):
                    try:
                        receipt = await _retry(store, asks[key])
                    except EvstoreError as exc:
                        assert not isinstance(exc, StorageError), exc
                        assert key not in by_key, f"{key} refused on retry but in the log"
                        continue
                    seen["retried"] += 1
                    if key in by_key:
                        seen["replayed"] += 1
                        assert receipt.replayed and list(receipt.positions) == by_key[key], (key, receipt)
                    else:
                        assert not receipt.replayed
                        by_key[key] = list(receipt.positions)
            for key, positions in by_key.items():
                assert done_keys.setdefault(key, positions) == positions, f"{key} in the log twice"
            report = await store.audit(history=True)
            assert report.clean, report.findings
        with contextlib.suppress(FileNotFoundError):
            for s, _ in procs:
                (tmp_path / f"w{s}.jsonl").unlink()
    assert seen["ok"] and seen["refused"] and seen["retried"], seen


async def test_one_of_several_sqlite_writers_killed_mid_append_loses_and_doubles_nothing(
    tmp_path: Path,
) -> None:
    await _kill_one_of_several(f"sqlite:///{tmp_path}/shared.db", tmp_path, ROUNDS, 0.4)


async def test_one_of_several_postgresql_clients_killed_mid_command_loses_and_doubles_nothing(
    tmp_path: Path, pg_url: str
) -> None:
    await _kill_one_of_several(pg_url, tmp_path, max(3, ROUNDS // 3), 1.0)


def _pg_bin() -> Path | None:
    """The directory of PostgreSQL's server programs (initdb, pg_ctl), as .ci/postgres finds it."""
    found = shutil.which("pg_ctl")
    if found and shutil.which("initdb"):
        return Path(found).resolve().parent
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (candidate / "pg_ctl").exists() and (candidate / "initdb").exists():
            return candidate
    return None


class _Server:
    """A throwaway PostgreSQL cluster of this test's own, to restart (the shared one is not
    restarted); as .ci/postgres starts one, run as ``postgres`` when the test runs as root."""

    def __init__(self, bin_dir: Path, root: Path) -> None:
        self.bin, self.root = bin_dir, root
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"postgresql://evstore@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        subprocess.run([*self.as_user, *args], check=True, capture_output=True, timeout=120)

    def start(self) -> None:
        options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
        data, log = str(self.root / "data"), str(self.root / "server.log")
        self._run(str(self.bin / "pg_ctl"), "-D", data, "-l", log, "-w", "-t", "60", "-o", options, "start")

    def init(self) -> None:
        self.root.chmod(0o777)
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.root / "data"),
            "-U",
            "evstore",
            "--auth=trust",
            "--no-sync",
        )
        self.start()

    async def restart(self, mode: str) -> None:
        stop = [
            *self.as_user,
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.root / "data"),
            "-m",
            mode,
            "-w",
            "stop",
        ]
        proc = await asyncio.create_subprocess_exec(*stop, stdout=asyncio.subprocess.DEVNULL)
        assert await proc.wait() == 0
        await asyncio.to_thread(self.start)

    def stop(self) -> None:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            self._run(
                str(self.bin / "pg_ctl"), "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop"
            )


@pytest.fixture
def own_server() -> Iterator[_Server]:
    bin_dir = _pg_bin()
    if bin_dir is None or (os.geteuid() == 0 and shutil.which("runuser") is None):
        pytest.skip("no PostgreSQL server programs (initdb, pg_ctl) to run a server of the test's own")
    root = Path(tempfile.mkdtemp(prefix="evstore-s39d-pg."))
    server = _Server(bin_dir, root)
    try:
        try:
            server.init()
        except (subprocess.SubprocessError, OSError) as exc:
            pytest.skip(f"cannot start a PostgreSQL server of the test's own: {exc}")
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("mode", ["immediate", "fast"])
async def test_commands_through_a_postgresql_restart_each_say_what_became_of_them(
    own_server: _Server, mode: str
) -> None:
    """Commands run while the server restarts (``pg_ctl restart -m immediate``: a crash and
    recovery; ``-m fast``: a clean shutdown): each succeeded, failed with ``outcome_unknown``
    True - and a retry with its key answers what happened -, or failed cleanly, leaving nothing;
    the store recovers without being reopened, and the log is whole."""
    async with open_store(own_server.url, pool_size=6, connect_timeout=2) as store:
        providers = [await make_provider(store, f"n{i}", VCPU=10**9) for i in range(3)]
        asks: dict[str, tuple[str, str]] = {}
        ended: dict[str, tuple[str, list[int]]] = {}
        stop = asyncio.Event()
        keys = iter(range(10**9))

        async def claim(key: str) -> Receipt:
            consumer, rp = asks[key]
            return await store.set_allocations(
                consumer,
                {rp: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
                idempotency_key=key,
            )

        async def client(n: int) -> None:
            while not stop.is_set():
                key = f"k{next(keys)}"
                asks[key] = (new_uuid(), providers[n % 3])
                try:
                    ended[key] = ("ok", list((await claim(key)).positions))
                except StorageError as exc:
                    unknown = exc.details.get("outcome_unknown")
                    assert unknown in (True, False), exc.details  # (a keyed command: always said)
                    ended[key] = ("unknown" if unknown else "clean", [])
                    await asyncio.sleep(0.05)

        clients = [asyncio.create_task(client(n)) for n in range(8)]
        while sum(1 for v in ended.values() if v[0] == "ok") < 50:
            await asyncio.sleep(0.05)
        await own_server.restart(mode)
        done_before = len(ended)
        while sum(1 for v in list(ended.values())[done_before:] if v[0] == "ok") < 50:
            await asyncio.sleep(0.05)  # (the same store, not reopened, goes on)
        stop.set()
        await asyncio.gather(*clients)
        assert {v[0] for v in ended.values()} - {"ok"}, "nothing met the restart"
        head = await store.head()
        events = await store.read(0, head + 10)
        assert [e.position for e in events] == list(range(1, head + 1))
        by_key: dict[str, list[int]] = {}
        for e in events:
            if e.metadata.idempotency_key is not None:
                by_key.setdefault(e.metadata.idempotency_key, []).append(e.position)
        for key, (outcome, positions) in ended.items():
            if outcome == "ok":
                assert by_key[key] == positions, key
            elif outcome == "clean":
                assert key not in by_key, f"{key} failed cleanly but is in the log"
            receipt = await claim(key)  # (retried with its key: the truth)
            assert receipt.replayed == (key in by_key), (key, outcome, receipt)
            if receipt.replayed:
                assert list(receipt.positions) == by_key[key]
        assert (await store.audit(history=True)).clean


async def test_a_resource_shortage_while_opening_keeps_its_reason(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: an error of the server while an open prepared the store ("Cannot prepare the
    store at ...") kept its words but lost its ``sqlstate`` and ``reason``: a caller could not tell
    a server out of memory from any other failure to open."""
    async with open_store(pg_url):
        pass

    async def short_of_memory(self: PostgresBackend, conn: Any) -> None:
        raise asyncpg.exceptions.OutOfMemoryError("out of shared memory")

    monkeypatch.setattr(PostgresBackend, "_take_migration_lock", short_of_memory)
    with pytest.raises(StorageError) as caught:
        async with open_store(pg_url):
            pass
    assert caught.value.message.startswith("Cannot prepare the store at")
    assert caught.value.details["reason"] == "out_of_memory", caught.value.details
    assert caught.value.details["sqlstate"] == "53200"
    assert "max_locks_per_transaction" in caught.value.message
