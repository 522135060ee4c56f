"""Stop 41, helper L: a host's structlog configuration that fails (a processor that raises, a
closed sink) must not change what a command answers: a committed command is a receipt to its
caller, not the logging's exception (a caller told "failed" retries without its key and doubles
it), and the writer must answer every caller of a batch (a line that failed for one cancelled
caller left the batch's other callers waiting for ever)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import structlog

from evstore import AllocationStore, CapacityExceeded, Receipt, open_store
from tests.conftest import make_provider, new_uuid


class _Boom(RuntimeError):
    pass


@pytest.fixture
def failing_logs() -> Iterator[list[str]]:
    """structlog configured with a processor that raises for every line (and records its event)."""
    seen: list[str] = []

    def boom(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        seen.append(str(event.get("event")))
        raise _Boom("the host's processor failed")

    saved = structlog.get_config()
    structlog.configure(
        processors=[boom],
        logger_factory=structlog.ReturnLoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    try:
        yield seen
    finally:
        structlog.configure(**saved)


def _alloc(store: AllocationStore, rp: str, amount: int = 1, **kwargs: Any) -> Any:
    return store.set_allocations(
        new_uuid(),
        {rp: {"VCPU": amount}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        **kwargs,
    )


async def test_a_raising_processor_does_not_turn_a_commit_into_an_error(
    sqlite_url: str, failing_logs: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=4)
        receipt = await _alloc(store, rp, idempotency_key="k1")
        assert isinstance(receipt, Receipt) and receipt.positions
        assert (await store.usage(rp))["VCPU"] == 1
        # a refusal stays the refusal (not the logging's exception), also one refused before it is queued
        with pytest.raises(CapacityExceeded):
            await _alloc(store, rp, 100)
        with pytest.raises(ValueError):
            await _alloc(store, "not-a-uuid")
    assert {"command.accepted", "command.rejected"} <= set(failing_logs)
    # the failure is reported where a failed logging handler's is: stderr, naming the line
    err = capsys.readouterr().err
    assert "command.accepted" in err and "the host's processor failed" in err, err


async def test_a_line_failing_for_a_cancelled_caller_leaves_no_other_caller_waiting(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    def boom_when_cancelled(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        if event.get("caller_cancelled"):
            raise _Boom("the host's processor failed")
        return event

    saved = structlog.get_config()
    structlog.configure(
        processors=[boom_when_cancelled],
        logger_factory=structlog.ReturnLoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
    )
    try:
        async with open_store(sqlite_url) as store:
            rp = await make_provider(store, VCPU=10_000)
            for turn in range(40):
                tasks = [asyncio.create_task(_alloc(store, rp)) for _ in range(8)]
                await asyncio.sleep(0.0005 * (turn % 5))  # (cancelled queued, or once its batch began)
                tasks[0].cancel()
                async with asyncio.timeout(10):  # (before the fix: the batch's other callers hung)
                    answers = await asyncio.gather(*tasks[1:])
                assert all(isinstance(a, Receipt) for a in answers)
            assert (await store.audit()).clean
    finally:
        structlog.configure(**saved)
    assert "the host's processor failed" in capsys.readouterr().err
