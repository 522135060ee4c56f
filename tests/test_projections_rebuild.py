"""rebuild() refolds the persisted projection from the log with the one fold; it equals the live one."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from evstore import AllocationStore, InvalidInput
from projections.replay import replay
from tests.test_projections_support import random_workload


async def test_rebuild_after_a_long_random_workload_equals_the_live_projection(
    store: AllocationStore,
) -> None:
    await random_workload(store, seed=20260101, commands=600, providers=6)
    live = await store.backend.load_state()
    assert live == await replay(store.backend.read)  # the inline projection is the fold of the log
    folded = await store.rebuild(batch_size=37)  # small batches: streaming across many boundaries
    assert folded == await store.head()
    assert await store.backend.load_state() == live
    assert (await store.audit()).clean


async def test_rebuild_repairs_a_tampered_projection(store: AllocationStore) -> None:
    await random_workload(store, seed=5, commands=80)
    live = await store.backend.load_state()
    tamper = getattr(store.backend, "tamper", None)
    if tamper is None:
        return  # only the SQLite backend exposes raw SQL
    await tamper("DELETE FROM p_allocations WHERE consumer IN (SELECT consumer FROM p_allocations LIMIT 2)")
    await tamper("UPDATE p_providers SET generation = generation + 7")
    assert not (await store.audit()).clean
    await store.rebuild()
    assert await store.backend.load_state() == live
    assert (await store.audit()).clean


async def test_rebuild_folds_what_was_appended_while_it_folded_outside_the_lock(store_url: str) -> None:
    # Both backends fold the log before holding writers back (SQLite's write lock, PostgreSQL's
    # fence); events appended in between (here by another store on the same database, the moment
    # the fold has found the end of the log) are folded before the projection is rewritten.
    from evstore import open_store
    from tests.conftest import allocate, make_provider, new_uuid

    async with open_store(store_url) as store:
        await random_workload(store, seed=3, commands=120)
        backend = store.backend
        read = backend.read_payloads
        late: list[str] = []

        async def read_then_append(after: int, limit: int) -> list[Any]:
            rows = await read(after, limit)
            if not rows and not late:  # the fold has seen the end of the log
                async with open_store(store_url) as other:
                    rp = await make_provider(other, "late-node", VCPU=8)
                    late.append(new_uuid())
                    await allocate(other, late[0], {rp: {"VCPU": 3}})
            return rows

        backend.read_payloads = read_then_append  # type: ignore[method-assign]
        try:
            folded = await store.rebuild(batch_size=50)
        finally:
            del backend.read_payloads
        assert late, "the append happened during the rebuild's fold"
        assert folded == await store.head()
        assert await store.backend.load_state() == await replay(store.backend.read)
        assert (await store.allocations(late[0])).allocations  # the late consumer is in the projection
        assert (await store.audit()).clean


async def test_rebuild_reports_progress_up_to_the_head(store: AllocationStore) -> None:
    await random_workload(store, seed=8, commands=150)
    head = await store.head()
    seen: list[tuple[int, int]] = []
    assert await store.rebuild(batch_size=40, progress=lambda done, total: seen.append((done, total))) == head
    assert len(seen) >= head // 40  # at least once per batch
    assert [d for d, _ in seen] == sorted(d for d, _ in seen), "progress never goes back"
    assert all(0 < done <= total for done, total in seen), "the total never falls behind"
    assert seen[-1] == (head, head)


async def test_rebuild_calls_progress_on_the_event_loops_thread(store: AllocationStore) -> None:
    """Regression (review 32, helper D): on SQLite the last ``progress(head, head)`` - the catch-up
    folded - was called on the writer's thread, where an asyncio caller's callback (one setting
    an ``asyncio.Event`` or feeding a queue) is unsafe; PostgreSQL called every one on the loop."""
    await random_workload(store, seed=9, commands=60)
    loop_thread = threading.get_ident()
    threads: list[int] = []
    await store.rebuild(batch_size=20, progress=lambda done, total: threads.append(threading.get_ident()))
    await store.rebuild(full=True, progress=lambda done, total: threads.append(threading.get_ident()))
    assert threads and set(threads) == {loop_thread}


async def test_a_progress_callback_that_raises_stops_the_rebuild(store: AllocationStore) -> None:
    """Its exception reaches the caller, and the projection is left as it was (on both backends
    alike: the last call comes inside the rebuild's transaction)."""
    await random_workload(store, seed=10, commands=60)
    await store.backend.tamper("UPDATE p_providers SET generation = generation + 7")  # type: ignore[attr-defined]
    head = await store.head()

    def stop(done: int, total: int) -> None:
        if done == head:
            raise KeyError("stop")

    with pytest.raises(KeyError, match="stop"):
        await store.rebuild(progress=stop)
    assert (await store.audit()).drift, "left as it was: not repaired"
    await store.rebuild()
    assert (await store.audit()).clean


@pytest.mark.parametrize(
    "raised",
    [ValueError("I/O operation on closed file."), TimeoutError("the dashboard did not answer")],
    ids=["ValueError-closed", "TimeoutError"],
)
async def test_a_progress_callbacks_exception_reaches_the_rebuilds_caller_as_it_was_raised(
    store: AllocationStore, raised: Exception
) -> None:
    """Regression (review 32, helper R): on SQLite the last call's exception (inside the
    rebuild's write transaction) came back through the writer's thread, where a ValueError saying
    "closed" became ``StoreClosed`` and a TimeoutError hung the writer for ever."""
    await random_workload(store, seed=11, commands=30)
    calls: list[int] = []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        if len(calls) > 1 and done == total:  # (the last call: from the write transaction)
            raise raised

    with pytest.raises(type(raised), match=str(raised)):
        async with asyncio.timeout(60):
            await store.rebuild(progress=progress)
    await store.rebuild()
    assert (await store.audit()).clean


# --- SQLite: a rebuild writes only the rows that differ from the fold -----------------------------

_TABLES = ("p_providers", "p_consumers", "p_allocations", "p_classes", "p_usages")


async def _count_writes(store: AllocationStore) -> None:
    """Triggers that record every row written to the projection tables into ``t_writes``."""
    tamper = store.backend.tamper  # type: ignore[attr-defined]
    await tamper("CREATE TABLE t_writes (tbl TEXT NOT NULL, op TEXT NOT NULL)")
    for table in _TABLES:
        for op in ("INSERT", "UPDATE", "DELETE"):
            await tamper(
                f"CREATE TRIGGER t_{table}_{op} AFTER {op} ON {table} "
                f"BEGIN INSERT INTO t_writes VALUES ('{table}', '{op}'); END"
            )


async def _writes(store: AllocationStore) -> list[tuple[str, str]]:
    def q(conn: Any) -> list[tuple[str, str]]:
        rows = conn.execute("SELECT tbl, op FROM t_writes ORDER BY rowid").fetchall()
        conn.execute("DELETE FROM t_writes")
        return [tuple(r) for r in rows]

    return await store.backend._on_writer(q)  # type: ignore[attr-defined,no-any-return]


async def test_rebuild_of_a_sound_projection_writes_no_row(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=11, commands=150)
        live = await store.backend.load_state()
        await _count_writes(store)
        assert await store.rebuild(batch_size=30) == await store.head()
        assert await _writes(store) == []
        assert await store.backend.load_state() == live


async def test_rebuild_repairs_small_damage_row_by_row(sqlite_url: str) -> None:
    from evstore import open_store
    from tests.conftest import new_uuid

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=12, commands=150)
        live = await store.backend.load_state()
        held = next(c for c in live.consumers.values() if c.allocations)
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper(
            """UPDATE p_allocations SET resources = '{"VCPU":99}' WHERE consumer = ?""", (held.uuid,)
        )
        await tamper("DELETE FROM p_consumers WHERE uuid = (SELECT min(uuid) FROM p_consumers)")
        # rows the log never made, sorting before, between and after the real ones
        for stray in ("0" * 8 + new_uuid()[8:], new_uuid(), "f" * 8 + new_uuid()[8:]):
            row = "(?, 'p', 'u', 'INSTANCE', 1, 0, NULL, NULL, 1, NULL)"
            await tamper(f"INSERT INTO p_consumers VALUES {row}", (stray,))
            await tamper("""INSERT INTO p_allocations VALUES (?, ?, '{"VCPU":1}')""", (stray, new_uuid()))
        await tamper(
            "UPDATE p_providers SET generation = generation + 3"
            " WHERE uuid = (SELECT min(uuid) FROM p_providers)"
        )
        await tamper("INSERT INTO p_classes VALUES ('CUSTOM_NEVER_CREATED')")
        assert not (await store.audit()).clean
        await _count_writes(store)
        await store.rebuild()
        writes = await _writes(store)
        assert await store.backend.load_state() == live
        assert (await store.audit()).clean
        # repaired in place: a handful of rows, not the whole projection rewritten
        assert 0 < len(writes) <= 20, writes
        assert ("p_classes", "DELETE") in writes


async def test_rebuild_rewrites_a_projection_far_from_the_log(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=13, commands=150)
        live = await store.backend.load_state()
        await store.backend.tamper("DELETE FROM p_consumers")  # type: ignore[attr-defined]
        await _count_writes(store)
        await store.rebuild()
        writes = await _writes(store)
        assert await store.backend.load_state() == live
        assert (await store.audit()).clean
        assert writes.count(("p_consumers", "INSERT")) == len(live.consumers)  # rewritten whole


async def test_rebuild_repairs_rows_whose_keys_are_not_text(sqlite_url: str) -> None:
    # A blob key (a TEXT column's affinity turns 42 or 7 into text, not a blob): SQLite orders
    # blobs after text and Python cannot compare bytes with str, so such a row must not derail
    # the row-by-row comparison (the projection is rewritten whole instead). The extra text rows
    # 42 and 7 ride along as ordinary strays.
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=14, commands=100)
        live = await store.backend.load_state()
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper("INSERT INTO p_consumers VALUES (42, 'p', 'u', 'INSTANCE', 1, 0, NULL, NULL, 1, NULL)")
        await tamper("""INSERT INTO p_allocations VALUES (X'00ff', 'rp', '{"VCPU":1}')""")
        await tamper("INSERT INTO p_providers VALUES (7, 'n', NULL, 7, 0, '{}', '{}')")
        report = await store.audit()  # reports such rows (it used to fail sorting them)
        messages = [f.message for f in report.findings]
        assert "Consumer 42 is extra in the projection" in messages
        assert "Provider 7 is extra in the projection" in messages
        assert "Consumer b'\\x00\\xff' is extra in the projection" in messages
        await store.rebuild()
        assert await store.backend.load_state() == live
        assert (await store.audit()).clean


async def test_rebuild_repairs_a_row_that_cannot_be_read_back(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=15, commands=100)
        live = await store.backend.load_state()
        await store.backend.tamper(  # type: ignore[attr-defined]
            "UPDATE p_consumers SET project_id = CAST(X'ff' AS TEXT)"
            " WHERE uuid = (SELECT min(uuid) FROM p_consumers)"
        )
        await store.rebuild()  # reading the row back fails: the projection is rewritten whole
        assert await store.backend.load_state() == live


async def test_rebuild_recreates_a_projection_index_defined_otherwise(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=16, commands=100)
        tamper = store.backend.tamper  # type: ignore[attr-defined]
        await tamper("DROP INDEX p_allocations_provider")
        await tamper("CREATE INDEX p_allocations_provider ON p_allocations (resources)")
        await tamper("DROP INDEX p_consumers_migrations")

        def indexes(conn: Any) -> dict[str, str]:
            rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'index' AND name LIKE 'p%'")
            return {name: " ".join(sql.split()) for name, sql in rows}

        await store.rebuild()
        found = await store.backend._on_writer(indexes)  # type: ignore[attr-defined]
        assert (
            found["p_allocations_provider"]
            == "CREATE INDEX p_allocations_provider ON p_allocations (provider)"
        )
        assert (
            found["p_consumers_migrations"]
            == "CREATE INDEX p_consumers_migrations ON p_consumers (on_behalf_of) "
            "WHERE on_behalf_of IS NOT NULL"
        )


async def test_full_rebuild_rewrites_every_row(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await random_workload(store, seed=17, commands=100)
        live = await store.backend.load_state()
        await _count_writes(store)
        await store.rebuild(full=True)
        writes = await _writes(store)
        assert writes.count(("p_consumers", "INSERT")) == len(live.consumers)
        assert await store.backend.load_state() == live
        with pytest.raises(InvalidInput):
            await store.rebuild(full="yes")  # type: ignore[arg-type]
