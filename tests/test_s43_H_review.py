"""Stop 43, helper H: review of the session's product changes (76a8a3c..40a5aa3), the defects
found, each a strict xfail until fixed (helper H owns no product file)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any
from unittest.mock import AsyncMock

import pytest

from evstore import InvalidInput, ProviderNotFound, command_metadata, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_s43_C_cli import _in_process, _wide_store
from tests.test_s43_F_pg_faults import role  # noqa: F401 (a fixture)


@pytest.mark.parametrize("amount", [True, False])
async def test_a_bool_amount_is_not_told_to_give_int_of_it(amount: bool) -> None:
    """An amount of True is refused because a flag is no amount, not because of its type: the
    hint added for numpy.int64 ("not int: give int(value)") is wrong for it - bool is an int
    subclass, and int(True) == 1 turns the caller's mistake into an allocation of one."""
    async with open_store("sqlite://") as store:
        rp = await make_provider(store, VCPU=8)
        with pytest.raises(InvalidInput) as refused:
            await store.set_allocations(
                new_uuid(),
                {rp: {"VCPU": amount}},
                project_id="p",
                user_id="u",
                consumer_type="I",
                generation=None,
            )
    message = str(refused.value)
    assert "must be an integer" in message, message
    assert "int(value)" not in message and "builtins.bool" not in message, message


async def test_a_decorated_async_mock_is_still_an_async_callable() -> None:
    """What ``inspect.iscoroutinefunction`` took for an ``async def`` before it was decorated
    (``unittest.mock.AsyncMock``, a function marked as one) stays one decorated: frameworks
    choose how to call a handler by that test. 76a8a3c kept it (the test was on ``func``);
    7cfe5a4 asks only what ``type(func).__call__`` is, a plain method for AsyncMock."""
    handler = AsyncMock(return_value="done")
    assert inspect.iscoroutinefunction(handler)
    decorated = command_metadata(actor="svc")(handler)
    assert await decorated() == "done"  # (it runs either way: the coroutine it answers is wrapped)
    assert inspect.iscoroutinefunction(decorated)


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("columns", ["40", "80"])
def test_a_narrow_state_table_never_splits_a_number(
    columns: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Folding replaced the ellipsis ("103/2…") with a break inside a number: the first line of
    MEMORY_MB's cell reads '14950', which looks whole and is neither the used (149504) nor the
    total (583680). A number (and its used/total pair, at its '/') must stay whole on a line."""
    db = tmp_path / "s.db"
    _wide_store(db)
    monkeypatch.setenv("COLUMNS", columns)
    done = _in_process(capsys, "state", "--db", str(db))
    assert done.returncode == 0, done.stdout + done.stderr
    for number in ("149504", "583680", "1460", "3900", "103", "256"):
        assert number in done.stdout, (number, done.stdout)


async def test_an_open_store_keeps_its_schema_when_a_schema_named_after_its_role_appears(
    pg_url: str,
    role: tuple[str, Any],  # noqa: F811 (the fixture imported above)
) -> None:
    """README (c624874, e2ab279): without ``?search_path`` a store is in "the schema the role's
    default search_path finds at open, kept while the store is open". With the role's search_path
    ``"$user", <schema>`` (PostgreSQL's own default is ``"$user", public``) and no schema named
    after the role, the store is in <schema>; once a schema named after the role appears holding
    another store (an operator's ``evstore demo`` as the same role, after ``CREATE SCHEMA ...
    AUTHORIZATION``), every connection of the open store - not only later ones - reads and writes
    that other store: the pin kept the text "$user", which PostgreSQL resolves at each statement."""
    from tests.pg import with_search_path
    from tests.test_s43_F_pg_faults import _as, _schema

    name, admin = role
    await admin.execute(f'ALTER ROLE {name} SET search_path = "$user", "{_schema(pg_url)}"')
    async with open_store(_as(pg_url, name, search_path=False), pool_size=2) as store:
        ours = await make_provider(store, "ours", VCPU=10)
        await allocate(store, new_uuid(), {ours: {"VCPU": 1}})
        head = await store.head()
        await admin.execute(f"CREATE SCHEMA {name} AUTHORIZATION {name}")
        async with open_store(_as(with_search_path(pg_url, name), name)) as other:
            theirs = await make_provider(other, "theirs", VCPU=10)
        assert await store.head() == head
        assert (await store.usage(ours))["VCPU"] == 1
        with pytest.raises(ProviderNotFound):
            await store.usage(theirs)


async def test_open_lines_answering_bytes_is_told_to_decode_them() -> None:
    """``import_events(lambda: data)`` with ``data`` the export's bytes (read with ``open(path,
    'rb').read()``, or off the network) is told to answer ``text.splitlines()``; doing so answers
    bytes lines, which the import refuses next ("line 1 of the export is bytes, not text"). One
    refusal should say both: decode, then split (``data.decode().splitlines()``)."""
    async with open_store("sqlite://") as store:
        with pytest.raises(InvalidInput) as refused:
            await store.import_events(lambda: b'{"format": "evstore-export"}\n')
    assert refused.value.details.get("field") == "open_lines"
    assert "decode" in str(refused.value), str(refused.value)
