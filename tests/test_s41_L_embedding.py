"""Stop 41, helper L: evstore embedded in an async service, as README's embedded API describes it:
deadlines and cancellation around commands (the caller gets ``TimeoutError``; the same
idempotency key tells the true outcome; nothing half-written), a ``TaskGroup`` whose failing
command cancels its siblings mid-command, a store closed while other tasks call it, subscribers
and histories left early, request ids carried by ``command_metadata`` and structlog's contextvars
into child tasks, the lines and the events - under asyncio, and under uvloop where it is installed."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import random
import warnings
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

import pytest
import structlog

from evstore import (
    AllocationStore,
    CapacityExceeded,
    Receipt,
    StoreClosed,
    command_metadata,
    open_store,
)
from tests.conftest import make_provider, new_uuid


def _put(store: AllocationStore, consumer: str, rp: str, amount: int = 1, **kwargs: Any) -> Any:
    return store.set_allocations(
        consumer,
        {rp: {"VCPU": amount}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        **kwargs,
    )


async def _deadlines_then_retries(url: str, seed: int) -> None:
    """Commands under ``asyncio.timeout`` / ``wait_for`` cut at random points: each caller that
    timed out repeats its command with the same key and learns it is held once."""
    rnd = random.Random(seed)
    async with open_store(url) as store:
        rp = await make_provider(store, VCPU=10_000)
        timed_out = 0
        for turn in range(60):
            consumer, key = new_uuid(), f"key-{turn}"
            call = _put(store, consumer, rp, idempotency_key=key)
            try:
                if turn % 2:
                    async with asyncio.timeout(rnd.random() * 0.004):
                        await call
                else:
                    await asyncio.wait_for(call, rnd.random() * 0.004)
            except TimeoutError:
                timed_out += 1
                again = await _put(store, consumer, rp, idempotency_key=key)
                assert isinstance(again, Receipt)
            held = await store.allocations(consumer)
            assert held == {rp: {"VCPU": 1}} and held.generation == 1, (turn, held)
        assert (await store.usage(rp))["VCPU"] == 60
        assert (await store.audit()).clean
        # reads cut short leave nothing behind: the store answers the next one
        for _ in range(30):
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0):
                    await store.usage(rp)
        assert (await store.usage(rp))["VCPU"] == 60


async def _task_group_with_a_failure(url: str) -> None:
    """One command of a ``TaskGroup`` refused: its siblings are cancelled wherever they were;
    repeated with their keys, each is held exactly once."""
    async with open_store(url) as store:
        big = await make_provider(store, VCPU=1000)
        small = await make_provider(store, VCPU=1)
        consumers = [new_uuid() for _ in range(40)]
        with pytest.raises(ExceptionGroup) as caught:
            async with asyncio.TaskGroup() as group:
                for i, consumer in enumerate(consumers):
                    rp = small if i == 20 else big
                    group.create_task(_put(store, consumer, rp, 2, idempotency_key=f"tg-{consumer}"))
        assert [type(e) for e in caught.value.exceptions] == [CapacityExceeded]
        for i, consumer in enumerate(consumers):
            if i != 20:
                await _put(store, consumer, big, 2, idempotency_key=f"tg-{consumer}")
        assert (await store.usage(big))["VCPU"] == 78
        assert (await store.usage(small))["VCPU"] == 0
        assert (await store.audit()).clean


async def _closed_while_used(url: str) -> None:
    """A store opened by one task, used by many, closed by another: every call ends (a receipt,
    or ``StoreClosed``), none hangs, and what was answered is what the store holds."""
    opened: dict[str, AllocationStore] = {}

    async def startup() -> None:
        opened["store"] = await open_store(url)

    await asyncio.create_task(startup())
    store = opened["store"]
    rp = await make_provider(store, VCPU=100_000)

    async def worker() -> list[str]:
        answers = []
        for _ in range(30):
            try:
                await _put(store, new_uuid(), rp)
                await store.usage(rp)
            except StoreClosed as exc:
                assert exc.code == "evstore.store.closed"
                answers.append("closed")
                break
            answers.append("ok")
        return answers

    workers = [asyncio.create_task(worker()) for _ in range(10)]
    await asyncio.sleep(0.02)
    async with asyncio.timeout(10):
        await store.close()
        ends = await asyncio.gather(*workers)
    assert {e[-1] for e in ends} <= {"ok", "closed"}
    with pytest.raises(StoreClosed):
        await store.usage(rp)


async def _left_early(url: str) -> None:
    """``async for`` over ``subscribe``, ``history`` and ``export`` broken out of early; an
    ``async with open_store`` left by an exception with a command still queued."""
    pending: asyncio.Task[Any] | None = None
    with pytest.raises(KeyError):
        async with open_store(url) as store:
            rp = await make_provider(store, VCPU=100)
            for _ in range(5):
                await _put(store, new_uuid(), rp)
            for _ in range(20):
                async for _event in store.subscribe():
                    break
                async for _event in store.history(rp):
                    break
                async for _line in store.export():
                    break
            waiting = store.subscribe(after=await store.head())
            follower = asyncio.create_task(anext(waiting))
            pending = asyncio.create_task(_put(store, new_uuid(), rp))
            await asyncio.sleep(0)
            raise KeyError("the request handler failed")
    assert pending is not None
    async with asyncio.timeout(10):
        assert isinstance(await pending, Receipt)  # (answered by close: it had been queued)
        with pytest.raises(StoreClosed):
            await follower
    await waiting.aclose()


SCENARIOS: dict[str, Callable[[str], Coroutine[Any, Any, None]]] = {
    "deadlines": lambda url: _deadlines_then_retries(url, 41),
    "task_group": _task_group_with_a_failure,
    "closed_while_used": _closed_while_used,
    "left_early": _left_early,
}


@pytest.fixture
def no_resource_warnings() -> Iterator[None]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        yield
        gc.collect()
    leaked = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert not leaked, leaked


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_embedded_under_asyncio(store_url: str, scenario: str, no_resource_warnings: None) -> None:
    await SCENARIOS[scenario](store_url)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_embedded_under_uvloop(store_url: str, scenario: str, no_resource_warnings: None) -> None:
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(SCENARIOS[scenario](store_url))


async def test_request_ids_follow_child_tasks_into_lines_and_events(sqlite_url: str) -> None:
    """A service's JSON logs: the request id bound with ``command_metadata`` (and a key bound with
    structlog's contextvars) reaches the events and the log lines of commands issued by tasks
    the request created, also of one whose caller timed out."""
    out = io.StringIO()
    saved = structlog.get_config()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.JSONRenderer(),
        ],
        logger_factory=structlog.PrintLoggerFactory(out),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    try:
        async with open_store(sqlite_url) as store:
            rp = await make_provider(store, VCPU=1000)

            async def request(n: int) -> None:
                structlog.contextvars.bind_contextvars(http_path=f"/req/{n}")
                with command_metadata(request_id=f"req-{n}", actor="svc"):

                    async def child() -> None:
                        await _put(store, new_uuid(), rp)

                    async with asyncio.TaskGroup() as group:
                        group.create_task(child())
                        group.create_task(child())
                    with pytest.raises(CapacityExceeded):
                        await _put(store, new_uuid(), rp, 10_000)

            async with asyncio.TaskGroup() as group:
                for n in range(5):
                    group.create_task(request(n))
            events = await store.read(after=2)
    finally:
        structlog.configure(**saved)
        structlog.contextvars.clear_contextvars()
    assert len(events) == 10
    by_request: dict[str, int] = {}
    for event in events:
        assert event.metadata.actor == "svc"
        by_request[str(event.metadata.request_id)] = by_request.get(str(event.metadata.request_id), 0) + 1
    assert by_request == {f"req-{n}": 2 for n in range(5)}
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    writes = [line for line in lines if line.get("command") == "WriteAllocations"]
    assert sorted(line["event"] for line in writes) == ["command.accepted"] * 10 + ["command.rejected"] * 5
    for line in writes:
        assert line["http_path"] == "/req/" + line["request_id"].removeprefix("req-"), line
