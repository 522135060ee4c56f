"""Stop 41, helper E (review of the stop's changes): cases the stop's fixes left out."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from evstore import AllocationStore, ProjectionCorrupt, StorageError, open_store
from projections.exchange import row_line
from tests.conftest import allocate, make_provider, new_uuid


async def test_a_host_whose_every_address_refuses_says_nothing_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review (stop 41, helper E): the hint for a port nothing listens on (helper D's fix) was
    given only for a ``ConnectionRefusedError``; a host name with more than one address - the
    usual ``localhost`` with ``::1`` and ``127.0.0.1`` - is refused at each, and asyncio then
    raises a plain ``OSError("Multiple exceptions: [Errno 111] ..., [Errno 111] ...")``: the
    driver's text alone, no hint. Now it gets the same hint."""
    real = socket.getaddrinfo

    def two_addresses(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "two-addresses.invalid":
            return [
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    with socket.socket() as sock:  # (a port just free: nothing listens on it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageError) as caught:
        async with open_store(
            f"postgresql://evstore:pw@two-addresses.invalid:{port}/evstore", connect_timeout=5
        ):
            pass
    assert "Multiple exceptions" in caught.value.message
    assert "check the host and the port" in caught.value.message


@pytest.mark.parametrize(
    "damaged",
    [
        "2099-01-01T05:00:00.000000+05:00",  # (an offset other than UTC's: sorts by its local time)
        "2099-01-01 00:00:00.000000+00:00",  # (a space for the T)
        "2099-01-01T00:00:00+00:00",  # (no microseconds)
        "0001-01-01T00:00:00.000000+05:00",  # (before year 1 in UTC: no OverflowError from the check)
    ],
)
async def test_a_last_time_not_in_evstores_form_does_not_spread_to_new_events(
    sqlite_url: str, damaged: str
) -> None:
    """Review (stop 41, helper E): helper D's fix keeps the writer from taking over a last
    ``recorded_at`` that is no time, but took over one that is a time in a form evstore never
    writes (an offset other than +00:00, a space for the T, no microseconds: a row edited by
    hand). Every event appended after it copied that text - recorded in the year 2099, and not
    importable (an import refuses a time not in evstore's form, the hash covering the text). Now
    only a time in evstore's own form is taken over."""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        head = await store.head()
        await store.backend.tamper("UPDATE events SET recorded_at = ? WHERE position = ?", (damaged, head))
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        [event] = await store.read(after=head)
        assert event.position == head + 1 and event.recorded_at.year < 2099
        # (the new event's row as export writes it: recorded at the clock; export itself now
        # refuses this log, whose hash chain the hand edit broke)
        [raw] = await store.backend.read_raw(head, 1)
    assert raw.position == head + 1 and damaged not in row_line(raw)


@pytest.mark.parametrize(
    "receipt",
    [
        '{"positions": [999999], "consumer_generations": {}, "provider_generations": {}}',
        '{"positions": [0], "consumer_generations": {}, "provider_generations": {}}',
        '{"positions": [-5], "consumer_generations": {}, "provider_generations": {}}',
        '{"positions": [9223372036854775808], "consumer_generations": {}, "provider_generations": {}}',
        # (the stored receipt with one generation more, below 0: its positions as they are)
        '"consumer_generations":{"c":-1,',
        '"provider_generations":{"p":-1,',
    ],
)
async def test_a_receipt_naming_no_event_is_damaged_too(store: AllocationStore, receipt: str) -> None:
    """Review (stop 41, helper E): helper D's check of a stored idempotency receipt took any
    integer as a position or a generation. A receipt damaged to name a position past the head, 0,
    or below (a hand edit, a restore of the idempotency table from another store) was answered on
    SQLite as the key's receipt (``positions=(999999,)``, ``replayed=True``); on PostgreSQL, which
    stores the events' seqs there, as "The command was committed, but reading its positions
    failed ...; retry with the same idempotency key" with ``outcome_unknown=True`` - and each such
    retry failed the same way. Now both say the receipt is damaged, as for one that is no JSON."""
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
    if receipt.startswith("{"):
        await store.backend.tamper("UPDATE idempotency SET receipt = ? WHERE key = ?", (receipt, "key-1"))
    else:
        was = receipt.split("{")[0] + "{"
        await store.backend.tamper(
            "UPDATE idempotency SET receipt = replace(receipt, ?, ?) WHERE key = ?", (was, receipt, "key-1")
        )
    with pytest.raises(StorageError) as caught:
        await claim()
    assert caught.value.details["reason"] == "damaged", caught.value.message
    assert caught.value.details["idempotency_key"] == "key-1"
    assert caught.value.details["outcome_unknown"] is False
    assert await store.head() == head
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # (the store goes on)


async def test_sqlite_project_usage_counters_below_zero_are_refused(sqlite_url: str) -> None:
    """Review (stop 41, helper E): helper D made PostgreSQL's ``usages(project)`` refuse an
    allocation row damaged below zero instead of summing it; SQLite's reads its per-user counters,
    and answered a counter damaged to ``-3`` (or a consumer count of ``-1``) as the project's usage.
    Now they are ``evstore.projection.corrupt`` naming the project and user, as counters that are
    no mapping of amounts are."""
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=4)
        await allocate(store, new_uuid(), {rp: {"VCPU": 4}}, project_id="p")
        for counters in ('[["INSTANCE", 1, {"VCPU": -3}]]', '[["INSTANCE", -1, {"VCPU": 4}]]'):
            await store.backend.tamper(
                "UPDATE p_usages SET counters = ? WHERE project_id = ?", (counters, "p")
            )
            with pytest.raises(ProjectionCorrupt) as caught:
                await store.usages("p")
            assert caught.value.details["project_id"] == "p"
            # (the audit still compares such a counter with the fold, as it did: what it holds, what
            # the replay gives - not "cannot be read")
            [finding] = (await store.audit()).findings
            assert finding.details.get("consumer_type") == "INSTANCE", finding.message
            assert "replay gives 1 holding {'VCPU': 4}" in finding.message


def test_a_host_refused_at_one_address_and_unreachable_at_another_says_nothing_listens() -> None:
    """Review (stop 41, helper E): ``localhost`` where IPv6 is off fails at ``::1`` with "Cannot
    assign requested address" and is refused at ``127.0.0.1``: asyncio's "Multiple exceptions"
    error then holds two different errnos, and the hint is as due as when both refuse."""
    from evstore.log.postgres import _connect_hint

    mixed = OSError(
        "Multiple exceptions: [Errno 99] Cannot assign requested address, "
        "[Errno 111] Connect call failed ('127.0.0.1', 5432)"
    )
    assert "check the host and the port" in _connect_hint(mixed)
    assert (
        _connect_hint(OSError("Multiple exceptions: [Errno 101] Network is unreachable, [Errno 113] x")) == ""
    )
