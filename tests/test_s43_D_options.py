"""Stop 43, helper D: the duration options of ``open_store`` (``poll_interval``, and PostgreSQL's
``connect_timeout`` and ``command_timeout``) took any positive float, 1e-320 and 1e-9 included: a
subscriber's poller then read the head of the log in a busy loop, a pool connection or statement
timed out at once. Each is now refused at the call below a millisecond, as nan, inf, a negative,
zero, a bool and text were, with ``evstore.invalid_input`` naming the option and the range; the
values the README and the suite use (0.01 s up) still open."""

from __future__ import annotations

import math

import pytest

from evstore import InvalidInput, open_store
from tests.conftest import new_uuid

ABSURD = [
    1e-320,
    5e-324,
    1e-9,
    0.0009,
    0.0,
    -0.0,
    -1.0,
    math.nan,
    math.inf,
    -math.inf,
    True,
    False,
    "0.2",
    None,
]


def _is_refusal_of(caught: pytest.ExceptionInfo[InvalidInput], name: str) -> None:
    error = caught.value
    assert error.code == "evstore.invalid_input" and error.details["field"] == name
    assert name in error.message and "0.001" in error.message, error.message


@pytest.mark.parametrize("value", ABSURD, ids=repr)
async def test_poll_interval_refuses_absurd_values_at_the_call(value: object, sqlite_url: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        async with open_store(sqlite_url, poll_interval=value):  # type: ignore[arg-type]
            pass
    _is_refusal_of(caught, "poll_interval")


@pytest.mark.parametrize("value", [0.001, 0.01, 0.2, 1, 3600])
async def test_poll_interval_takes_sensible_values(value: float, sqlite_url: str) -> None:
    async with open_store(sqlite_url, poll_interval=value) as store:
        assert await store.head() == 0


@pytest.mark.parametrize("name", ["connect_timeout", "command_timeout"])
@pytest.mark.parametrize("value", [1e-320, 1e-9, 0.0009, math.nan, True, -1])
async def test_postgres_timeouts_refuse_absurd_values_before_connecting(name: str, value: object) -> None:
    # (port 1: nothing listens; the option is refused before any connection is tried)
    with pytest.raises(InvalidInput) as caught:
        async with open_store("postgresql://u@127.0.0.1:1/x", **{name: value}):  # type: ignore[misc]
            pass
    _is_refusal_of(caught, name)


@pytest.mark.parametrize("name", ["connect_timeout", "command_timeout"])
async def test_postgres_timeouts_in_the_url_are_checked_alike(name: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        async with open_store(f"postgresql://u@127.0.0.1:1/x?{name}=1e-320"):
            pass
    _is_refusal_of(caught, name)


@pytest.mark.parametrize("value", [0, -1, 1.5, True, None, "10", 2**63])
async def test_setting_snapshot_every_on_an_open_store_is_checked_as_the_option_is(
    value: object, sqlite_url: str
) -> None:
    """``store.snapshot_every`` is a plain attribute the suite and services set on an open store
    (time travel reads it): 1.5 failed a later ``state_at`` as a storage error ("datatype
    mismatch"), None and "10" as a bare TypeError, 0 and -1 as a message about an "interval". It is
    now refused where it is set, as ``open_store(snapshot_every=)`` refuses it, and left as it was."""
    async with open_store(sqlite_url, snapshot_every=7) as store:
        with pytest.raises(InvalidInput) as caught:
            store.snapshot_every = value  # type: ignore[assignment]
        assert caught.value.details["field"] == "snapshot_every" and "snapshot_every" in caught.value.message
        assert store.snapshot_every == 7
        store.snapshot_every = 3  # (a sound value is taken, and used)
        for _ in range(4):
            await store.delete_consumer(new_uuid())
        await store.state_at(position=4)
        assert await store.snapshot_positions() == [3]
