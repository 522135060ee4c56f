"""Acceptance, outside in: evstore inside a running service - logs routed by the host, a real
Ctrl-C, a flood of concurrent requests and a slow consumer of the event stream.

Written from the README before reading the implementation.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from evstore import AllocationStore, ConcurrentUpdate, open_store
from tests.test_acceptance_embedding import GUARD, claim, new_uuid, provider

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def host_logs() -> Iterator[structlog.testing.LogCapture]:
    """A host's structlog set-up: request context merged, info and above, captured."""
    config = structlog.get_config()
    capture = structlog.testing.LogCapture()
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, capture],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    try:
        yield capture
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.configure(**config)


# ---------------------------------------------------------------------------------------------
# observability


async def test_a_request_handlers_lines_carry_its_context_and_nothing_reaches_stdout(
    store_url: str, host_logs: structlog.testing.LogCapture, capfd: pytest.CaptureFixture[str]
) -> None:
    async with open_store(store_url) as store:
        rp = await provider(store)
        c = new_uuid()

        async def handler() -> None:
            structlog.contextvars.bind_contextvars(request_id="req-http-1", route="/allocations")
            await claim(store, c, rp)
            with pytest.raises(ConcurrentUpdate):
                await store.set_allocations(
                    c, {rp: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=7
                )
            await claim(store, new_uuid(), rp, metadata={"request_id": "req-from-metadata"})

        await asyncio.create_task(handler())
        head = await store.head()
    lines = [e for e in host_logs.entries if e["event"].startswith("command.")]
    accepted, rejected, own = (x for x in (lines[-3], lines[-2], lines[-1]))
    assert accepted["event"] == "command.accepted"
    assert (accepted["request_id"], accepted["route"]) == ("req-http-1", "/allocations")
    assert accepted["consumer"] == [c] and rp in accepted["provider"]
    assert accepted["position"] == head - 1
    assert rejected["event"] == "command.rejected" and rejected["code"] == "placement.concurrent_update"
    assert rejected["request_id"] == "req-http-1" and rejected["consumer"] == [c]
    # the metadata's request id wins over the bound one, as the README says; the rest of the
    # bound context stays
    assert (own["request_id"], own["route"], own["position"]) == ("req-from-metadata", "/allocations", head)
    out, err = capfd.readouterr()
    assert out == "" and err == "", (out, err)


async def test_a_command_line_names_every_consumer_the_command_changed(
    store_url: str, host_logs: structlog.testing.LogCapture
) -> None:
    """The race evstore exists for, read from the logs by an instance's uuid: the revert that
    gave an instance its allocations back named only the migration, and the delete that released
    a migration's allocations with its instance named only the instance. The accepted line names
    every consumer the receipt names."""
    async with open_store(store_url) as store:
        source, dest = await provider(store), await provider(store)
        instance, migration = new_uuid(), new_uuid()
        await claim(store, instance, source)
        await store.start_migration(instance, migration)
        await claim(store, instance, dest)
        await store.revert_migration(migration, metadata={"request_id": "req-revert"})
        await store.start_migration(instance, second := new_uuid())
        await store.delete_consumer(instance, metadata={"request_id": "req-delete"})
    by_request = {e.get("request_id"): e for e in host_logs.entries if e["event"] == "command.accepted"}
    assert by_request["req-revert"]["consumer"] == sorted([instance, migration])
    assert by_request["req-delete"]["consumer"] == sorted([instance, second])
    assert by_request["req-delete"]["provider"] == [source]


async def test_a_log_level_raised_at_run_time_brings_the_command_lines(store_url: str) -> None:
    """A host routing structlog through the standard library (``structlog.stdlib``) sets levels
    on its loggers, and changes them while it runs (an operator turning on info for evstore to
    see what a scheduler's commands did). evstore asked the logger once per structlog
    configuration whether it logs info and, told no at start, dropped every command line for
    good: the level raised later brought nothing."""
    config = structlog.get_config()
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect()
    evstore_logger = logging.getLogger("evstore")
    level, propagate = evstore_logger.level, evstore_logger.propagate
    evstore_logger.addHandler(handler)
    evstore_logger.propagate = False
    evstore_logger.setLevel(logging.WARNING)
    structlog.configure(
        processors=[structlog.processors.KeyValueRenderer(key_order=["event"])],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
    )
    try:
        async with open_store(store_url) as store:
            rp = await provider(store)
            await claim(store, new_uuid(), rp)
            assert lines == []
            evstore_logger.setLevel(logging.INFO)
            await claim(store, new_uuid(), rp)
            assert [line for line in lines if "command.accepted" in line], lines
            evstore_logger.setLevel(logging.WARNING)
            lines.clear()
            await claim(store, new_uuid(), rp)
            assert lines == []
    finally:
        structlog.configure(**config)
        evstore_logger.removeHandler(handler)
        evstore_logger.setLevel(level)
        evstore_logger.propagate = propagate


# ---------------------------------------------------------------------------------------------
# a real Ctrl-C

SERVICE = textwrap.dedent(
    """
    import asyncio, logging, sys, uuid
    import structlog
    from evstore import open_store

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def main(url, rp):
        async with open_store(url) as store:
            async def request(i):
                c = str(uuid.uuid4())
                await store.set_allocations(c, {rp: {"VCPU": 1}}, project_id="p", user_id="u",
                                            consumer_type="INSTANCE", generation=None,
                                            idempotency_key=f"k-{c}")
            n = 0
            while True:
                await asyncio.gather(*(request(i) for i in range(50)))
                n += 1
                if n == 3:
                    print("ready", flush=True)

    asyncio.run(main(sys.argv[1], sys.argv[2]))
    """
)


def test_ctrl_c_mid_traffic_exits_and_leaves_a_consistent_store(store_url: str, tmp_path: Path) -> None:
    async def seed() -> str:
        async with open_store(store_url) as store:
            return await provider(store, vcpu=1_000_000)

    rp = asyncio.run(seed())
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script), store_url, rp],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # (a shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited:
        # a suite run in the background - `bash .ci/run &` - gave the service no KeyboardInterrupt
        # to raise, and it ran on until the guard's timeout)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=GUARD)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in stderr, stderr[-2000:]

    async def check() -> tuple[int, int, bool]:
        async with open_store(store_url) as store:
            usage = (await store.usage(rp))["VCPU"]
            claims = len([e for e in await store.read(0, 100_000) if e.type == "AllocationsReplaced"])
            return usage, claims, (await store.audit()).clean

    usage, claims, clean = asyncio.run(check())
    assert clean
    assert usage == claims >= 150


# ---------------------------------------------------------------------------------------------
# back-pressure


async def test_a_flood_of_concurrent_requests_all_answered_and_reads_not_starved(store_url: str) -> None:
    async with open_store(store_url) as store:
        rp = await provider(store, vcpu=1_000_000)
        start = await store.head()
        n = 1500
        commands = [asyncio.create_task(claim(store, new_uuid(), rp)) for _ in range(n)]
        await asyncio.sleep(0)
        # a read issued behind the flood is answered while commands are still queued: reads do
        # not wait for the writer's queue
        async with asyncio.timeout(GUARD):
            await store.usage(rp)
        pending_after_read = sum(not t.done() for t in commands)
        async with asyncio.timeout(GUARD * 4):
            receipts = await asyncio.gather(*commands)
        assert pending_after_read > 0
        positions = sorted(p for r in receipts for p in r.positions)
        assert positions == list(range(start + 1, start + n + 1))
        assert (await store.usage(rp))["VCPU"] == n
        assert (await store.audit()).clean


async def _flood(store: AllocationStore, rp: str, n: int) -> None:
    for _ in range(0, n, 250):
        await asyncio.gather(*(claim(store, new_uuid(), rp) for _i in range(250)))


async def test_a_stalled_subscriber_holds_memory_bounded_while_the_log_grows(store_url: str) -> None:
    """A subscriber whose consumer stops pulling (a slow webhook) must not buffer the events it
    has not been asked for: the writer goes on, memory does not grow with the log."""
    async with open_store(store_url) as store:
        rp = await provider(store, vcpu=1_000_000)
        await _flood(store, rp, 250)  # (warm: caches, statements)

        async def grow() -> int:
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            await _flood(store, rp, 1500)
            await asyncio.sleep(0.5)  # (a subscriber polling ahead would have fetched by now)
            gc.collect()
            grown = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            return grown

        plain = await grow()
        stalled = store.subscribe(after=await store.head(), batch_size=100)
        first = asyncio.create_task(anext(stalled))
        await asyncio.sleep(0)
        with_stalled = await grow()
        await first
        await stalled.aclose()
        # 1,500 decoded events are ~4 MB; a batch of 100 (or nothing) is what a stalled
        # subscriber may hold
        assert with_stalled - plain < 1_500_000, (plain, with_stalled)


async def test_a_subscriber_that_stops_pulling_does_not_hold_commands_back_and_misses_nothing(
    store_url: str,
) -> None:
    async with open_store(store_url) as store:
        rp = await provider(store, vcpu=1_000_000)
        start = await store.head()
        n = 600
        seen: list[int] = []
        writes_done = asyncio.Event()

        async def stuck_then_reading() -> None:
            async for event in store.subscribe(after=start):
                seen.append(event.position)
                if len(seen) == 1:
                    await writes_done.wait()  # (its consumer is stuck while the writers go on)
                if len(seen) == n:
                    return

        sub = asyncio.create_task(stuck_then_reading())
        async with asyncio.timeout(GUARD):
            await _flood(store, rp, n)
        # (the flood ended inside GUARD while the subscriber was stuck: the writers did not wait)
        assert await store.head() >= start + n and len(seen) <= 1
        writes_done.set()
        async with asyncio.timeout(GUARD):
            await sub
        assert seen == list(range(start + 1, start + n + 1))


async def test_many_subscribers_and_commands_on_one_store_all_progress(store_url: str) -> None:
    async with open_store(store_url) as store:
        rp = await provider(store, vcpu=1_000_000)
        start = await store.head()
        n = 300
        counts = [0] * 20

        async def follow(i: int) -> None:
            async for _ in store.subscribe(after=start):
                counts[i] += 1
                if counts[i] == n:
                    return

        subs = [asyncio.create_task(follow(i)) for i in range(len(counts))]
        async with asyncio.timeout(GUARD * 2):
            await _flood(store, rp, n)
            await asyncio.gather(*subs)
        assert counts == [n] * len(counts)
