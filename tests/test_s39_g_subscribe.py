"""Reading the log live (stop 39, helper G): ``subscribe`` ending with its store, on PostgreSQL
never skipping an event whose transaction commits late, and the arguments of the log's readers.

Closing a store ends the subscribers' reads in flight before ``close()`` returns. Before, on
PostgreSQL, the pool closed once a read's query had returned its rows, and ``close()`` returned
while the read decoded them: the read's task, and the subscriber waiting for it, were still
pending, and a loop closed after ``close()`` (``loop.run_until_complete(store.close());
loop.close()``) said "Task was destroyed but it is pending!". A read held in flight (a gate
before it reads) makes that deterministic on both backends.

An integer of more than 4,300 digits given as a position or a count (``read(after=)``, ``limit``,
``batch_size``, ``position_of``...) raised Python's ValueError ("Exceeds the limit (4300 digits)
for integer string conversion"), from writing it into the message refusing it, not
``InvalidInput``: it is said to be "an integer past 64 bits", as a generation or an amount is.
"""

from __future__ import annotations

import asyncio
import uuid
from urllib.parse import parse_qsl, urlsplit

import asyncpg
import pytest

from evstore import AllocationStore, InvalidInput, StoreClosed, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.pg import server_url
from tests.test_idle_subscribers import GUARD, ended, idle_subscribers, until
from tests.test_live_subscribers import HeldReads, reads_in_flight


async def test_close_ends_the_subscribers_reads_in_flight_before_it_returns(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(store_url, poll_interval=3600) as store:
        rp = await make_provider(store, VCPU=100)
        start = await store.head()
        tasks, seen = await idle_subscribers(store, 3, start)
        reads = HeldReads(store, monkeypatch, after_reading=True)
        reads.gate.clear()  # (never opened: the read is in flight until close() ends it)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        await until(lambda: reads.held == 1)
        async with asyncio.timeout(GUARD):
            await store.close()
        assert not reads_in_flight()  # (before: the read held at the gate, pending)
        assert all(task.done() for task in tasks)
        errors = await ended(tasks)
    assert all(isinstance(e, StoreClosed) for e in errors), {repr(e) for e in errors}
    assert seen == [[], [], []]  # (nothing read before the close is delivered after it)


async def test_close_ends_the_subscribers_reads_also_when_the_backend_fails_to_close(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (stop 39, found by review): the reads were ended after the backend's close, in
    the same ``finally``: a close that raised left them pending."""
    store = await open_store(store_url, poll_interval=3600)
    rp = await make_provider(store, VCPU=100)
    start = await store.head()
    tasks, _ = await idle_subscribers(store, 2, start)
    reads = HeldReads(store, monkeypatch, after_reading=True)
    reads.gate.clear()
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
    await until(lambda: reads.held == 1)
    real_close = store.backend.close

    async def failing_close() -> None:
        await real_close()
        raise OSError("the disk went away while closing")

    monkeypatch.setattr(store.backend, "close", failing_close)
    with pytest.raises(OSError, match="went away"):
        async with asyncio.timeout(GUARD):
            await store.close()
    assert not reads_in_flight()
    errors = await ended(tasks)
    assert all(isinstance(e, StoreClosed) for e in errors), {repr(e) for e in errors}


async def test_a_subscriber_beginning_a_read_as_the_store_closes_ends_without_one(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A subscriber past its check of the store and about to read (the head of its ``after=``
    checked) as ``close()`` ends the reads in flight begins none after them."""
    async with open_store(store_url, poll_interval=3600) as store:
        await make_provider(store, VCPU=100)
        head = store.backend.head
        checking = asyncio.Event()
        gate = asyncio.Event()

        async def slow_head() -> int:
            checking.set()
            await gate.wait()
            return await head()

        monkeypatch.setattr(store.backend, "head", slow_head)
        got: list[int] = []

        async def follow() -> None:
            async for e in store.subscribe(after=1):
                got.append(e.position)

        task = asyncio.create_task(follow())
        async with asyncio.timeout(GUARD):
            await checking.wait()
        gate.set()  # (its head read answers on the next turn, after close() has begun)
        async with asyncio.timeout(GUARD):
            await store.close()
        assert not reads_in_flight()
        [error] = await ended([task])
    assert isinstance(error, StoreClosed), repr(error)
    assert got == []


# --- PostgreSQL: a transaction that commits late ---------------------------------------------


def _schema(url: str) -> str:
    return dict(parse_qsl(urlsplit(url).query))["search_path"]


async def test_subscribers_and_pollers_never_skip_an_event_whose_transaction_commits_late(
    store_url: str, backend_name: str
) -> None:
    """Writers whose transactions insert their events first (the lower ``seq`` and transaction
    id) and commit a second later, while other writers commit many events: every subscriber and
    ``read`` poller sees every event once, in order, the late ones included (positions are given
    after commit: README, Guarantees; postgres.py's module docstring)."""
    if backend_name != "postgres":
        pytest.skip("SQLite's writers hold the write lock from their first insert to their commit")
    schema = _schema(store_url)
    async with open_store(store_url) as store:
        conn = await asyncpg.connect(server_url())
        try:
            # (a trigger makes the transactions of providers named SLOW-... sleep after their insert)
            await conn.execute(f"""
                CREATE FUNCTION {schema}.s39g_slow() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN IF NEW.data LIKE '%SLOW-%' THEN PERFORM pg_sleep(1); END IF; RETURN NEW; END $$;
                CREATE TRIGGER s39g_slow AFTER INSERT ON {schema}.events
                    FOR EACH ROW EXECUTE FUNCTION {schema}.s39g_slow();
            """)
        finally:
            await conn.close()
        stop = new_uuid()
        seen: dict[str, list[int]] = {}

        def last(e: object) -> bool:
            return (
                getattr(e, "type", None) == "ProviderCreated" and getattr(e, "data", {})["provider"] == stop
            )

        async def follow(name: str, batch_size: int) -> None:
            got = seen[name] = []
            async for e in store.subscribe(batch_size=batch_size):
                got.append(e.position)
                if last(e):
                    return

        async def poll(name: str) -> None:
            got = seen[name] = []
            while True:
                for e in await store.read(got[-1] if got else 0, 3):
                    got.append(e.position)
                    if last(e):
                        return
                await asyncio.sleep(0.001)

        followers = [
            asyncio.create_task(follow("one at a time", 1)),
            asyncio.create_task(follow("in batches", 100)),
            asyncio.create_task(poll("read")),
        ]
        async with open_store(store_url) as other:  # (another store: its own pool, as another process)

            async def slow(i: int) -> None:
                await other.create_provider(new_uuid(), f"SLOW-{i}-{uuid.uuid4()}")

            async def fast(i: int) -> None:
                for k in range(15):
                    await store.create_provider(new_uuid(), f"fast-{i}-{k}-{uuid.uuid4()}")

            await asyncio.gather(*(slow(i) for i in range(4)), *(fast(i) for i in range(3)))
            await other.create_provider(stop, f"stop-{stop}")
        async with asyncio.timeout(GUARD):
            await asyncio.gather(*followers)
        head = await store.head()
        slow_positions = [e.position for e in await store.read(0, head) if "SLOW-" in e.data["name"]]
    assert head == 4 + 45 + 1
    assert len(slow_positions) == 4
    for name, got in seen.items():
        assert got == list(range(1, head + 1)), name


# --- arguments -------------------------------------------------------------------------------


async def test_a_position_or_count_too_long_to_write_out_is_refused_as_invalid_input(
    store: AllocationStore,
) -> None:
    await make_provider(store, VCPU=1)
    huge = 10**5000  # (str() of it raises ValueError: more than 4,300 digits)
    consumer = new_uuid()
    calls = {
        "read after": (lambda: store.read(huge), "after"),
        "read limit": (lambda: store.read(0, huge), "limit"),
        "read negative limit": (lambda: store.read(0, -huge), "limit"),
        "subscribe after": (lambda: store.subscribe(after=huge).__anext__(), "after"),
        "subscribe batch_size": (lambda: store.subscribe(batch_size=huge).__anext__(), "batch_size"),
        "history batch_size": (lambda: store.history(consumer, batch_size=huge).__anext__(), "batch_size"),
        "export batch_size": (lambda: store.export(batch_size=huge).__anext__(), "batch_size"),
        "position_of": (lambda: store.position_of(huge), "point"),
        "replay": (lambda: store.replay(huge), "to_position"),
    }
    for name, (call, field) in calls.items():
        with pytest.raises(InvalidInput) as refused:
            await call()
        assert refused.value.details["field"] == field, name
        assert refused.value.message.endswith("got an integer past 64 bits"), (name, refused.value.message)
    assert len(await store.read(0, 2**63 - 1)) == 2  # (the largest count is read as ever)


async def test_a_count_refused_names_what_was_given_as_a_position_refused_does(
    store: AllocationStore,
) -> None:
    """``limit=True`` said "got True", where ``after=True`` said "got bool True"."""
    for value, shown in [(True, "bool True"), ("5", "str '5'"), (1.0, "float 1.0"), (0, "0")]:
        with pytest.raises(
            InvalidInput, match=r"limit must be an integer from 1 to 2\*\*63-1, got "
        ) as refused:
            await store.read(0, value)
        assert refused.value.message.endswith(f"got {shown}"), refused.value.message
