"""The bulk operations leave the event loop free: what they did on it, stalling every other task of
the service (measured on a 200k-event SQLite store), now runs on a thread or in short slices.

Timing is not asserted (it would be flaky): each test checks the mechanism - where a piece of work
runs, or how much of it runs between two turns of another task.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import projections.replay as replay_module
from evstore import AllocationStore, open_store
from projections.state import FOLDS, ConsumerState, State
from tests.conftest import allocate, make_provider, new_uuid


async def _store_of(store: AllocationStore, consumers: int) -> None:
    """Consumers holding allocations, some deleted (tombstones) and some migrated."""
    rp = await make_provider(store, VCPU=10**6)
    other = await make_provider(store, VCPU=10**6)
    held = [new_uuid() for _ in range(consumers)]
    await asyncio.gather(*(allocate(store, c, {rp: {"VCPU": 1}}) for c in held))
    await asyncio.gather(*(store.start_migration(c, new_uuid()) for c in held[: consumers // 4]))
    await asyncio.gather(*(store.delete_consumer(c) for c in held[consumers // 2 :]))
    await allocate(store, new_uuid(), {other: {"VCPU": 1}})


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _watched_sorts() -> tuple[list[int], Callable[..., list[Any]]]:
    """A stand-in for ``sorted`` (patched into a module) that records the size of each sort."""
    sizes: list[int] = []

    def watched(items: Any, **kwargs: Any) -> list[Any]:
        out = sorted(items, **kwargs)
        sizes.append(len(out))
        return out

    return sizes, watched


async def test_a_replay_recounts_usage_on_a_thread(
    store: AllocationStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 28: a replay from the first event recounted every provider's usage at its end (one
    pass over every consumer) on the event loop: 60-80 ms a stall on a 200k-event store, at the
    end of every replay, rebuild and whole-state time travel without a snapshot. It runs on a
    thread now, as the audit's recount does; a replay that fails still leaves its state
    recounted."""
    calls: list[bool] = []
    recount = State.recount_usages

    def watched(self: State) -> None:
        calls.append(_on_loop())
        recount(self)

    monkeypatch.setattr(State, "recount_usages", watched)
    await _store_of(store, 40)
    state = await store.replay()
    assert calls == [False]
    assert sum(p.usages.get("VCPU", 0) for p in state.providers.values()) == 1 + 20
    calls.clear()
    await store.rebuild()
    assert calls == [False]
    assert (await store.audit()).clean


@pytest.mark.parametrize("work", ["replay", "rebuild", "audit", "diff", "state_at", "take_snapshots"])
async def test_bulk_folds_give_the_loop_a_turn_when_their_time_slice_is_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    """Review 28: the bulk folds gave the loop a turn every 1,000 events, whatever they cost: the
    audit's checked events (~50 us each) and diff's decoded ones held it 40-120 ms per slice on a
    200k-event store. They also give it a turn once SLICE_SECONDS have passed: with no time at all,
    at most a replay's step of rows (the audit and diff: one event) between two turns of another
    task, counted by the folds themselves."""
    monkeypatch.setattr(replay_module, "SLICE_SECONDS", 0.0, raising=False)
    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF", snapshot_every=500) as store:
        await _store_of(store, 400)
        head = await store.head()
        folded = {"since_turn": 0, "most": 0, "all": 0}

        def counting(fold: Callable[..., None]) -> Callable[..., None]:
            def counted(*args: Any) -> None:
                folded["since_turn"] += 1
                folded["all"] += 1
                folded["most"] = max(folded["most"], folded["since_turn"])
                fold(*args)

            return counted

        for name, fold in list(FOLDS.items()):
            monkeypatch.setitem(FOLDS, name, counting(fold))
        stop = False

        async def turns() -> None:
            while not stop:
                folded["since_turn"] = 0
                await asyncio.sleep(0)

        other = asyncio.create_task(turns())
        await asyncio.sleep(0)
        if work == "replay":
            await store.replay()
        elif work == "rebuild":
            await store.rebuild()
        elif work == "audit":
            assert (await store.audit()).clean
        elif work == "diff":
            await store.diff(1, head)
        elif work == "state_at":
            await store.state_at(head)
        else:
            await store.take_snapshots()
        stop = True
        await other
        assert folded["all"] >= head - 1
        step = 64 if work in ("replay", "rebuild", "state_at", "take_snapshots") else 1
        assert folded["most"] <= step, folded


@pytest.mark.parametrize("work", ["audit", "diff", "rebuild", "take_snapshots"])
async def test_whole_states_a_bulk_operation_is_done_with_are_freed_on_a_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    """Review 28: the whole states the audit, diff, rebuild and take_snapshots fold (and the
    audit's persisted projection) were dropped where they were last referenced: freeing one is C
    code that holds the GIL from start to end (30-55 ms for 78,000 consumers), on the event loop
    at the operation's return, or on the SQLite reader's thread at its next job (it still
    referenced the projection it had loaded), stalling the loop either way. They are emptied a
    consumer at a time on a thread now (``dismantle``): no consumer a state keeps is freed on the
    loop's thread, nor outside ``dismantle``."""
    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF", snapshot_every=200) as store:
        await _store_of(store, 200)
        head = await store.head()
        # (the writer's cache of what the commands loaded - at most LIMIT entities - is dropped
        # by any other work on the writer: here, before counting)
        await store.backend.tamper("SELECT 1")  # type: ignore[attr-defined]
        loop_thread = threading.get_ident()
        freed = {"on_loop": 0, "elsewhere": 0, "dismantled": 0}

        def finalize(self: ConsumerState) -> None:
            if not self.worth_keeping():
                return  # (one a fold forgot, or made for a lookup: not part of a whole state)
            frame: Any = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "dismantle":
                frame = frame.f_back
            if frame is not None:
                freed["dismantled"] += 1
            elif threading.get_ident() == loop_thread:
                freed["on_loop"] += 1
            else:
                freed["elsewhere"] += 1

        monkeypatch.setattr(ConsumerState, "__del__", finalize, raising=False)
        if work == "audit":
            assert (await store.audit()).clean
        elif work == "diff":
            await store.diff(1, head)
        elif work == "rebuild":
            await store.rebuild()
        else:
            await store.take_snapshots()
        await store.head()  # (the reader's next job: it drops what it returned last)
        monkeypatch.undo()
        assert freed["dismantled"] >= 100, freed
        assert freed["on_loop"] == 0, freed
        assert freed["elsewhere"] == 0, freed


async def test_the_audit_sorts_only_the_consumers_that_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 28: the audit's comparison with the projection (on a thread) sorted every consumer
    key of both sides to walk them in order: one C call that holds the GIL, ~50 ms for 78,000
    consumers, which the event loop waited for. It finds the consumers that differ first (in
    Python, handing the GIL over) and sorts only those: a clean audit sorts no consumer key, and a
    drifted consumer is still reported, in order."""
    import projections.audit as audit_module

    sorted_sizes, watched = _watched_sorts()

    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF") as store:
        await _store_of(store, 200)
        monkeypatch.setattr(audit_module, "sorted", watched, raising=False)
        assert (await store.audit()).clean
        assert max(sorted_sizes) < 20, sorted_sizes
        persisted = await store.backend.load_state()  # type: ignore[attr-defined]
        drifted = sorted(uuid for uuid, c in persisted.consumers.items() if c.allocations)[:2]
        for consumer in drifted:
            await store.backend.tamper(  # type: ignore[attr-defined]
                "UPDATE p_consumers SET generation = generation + 7 WHERE uuid = ?", (consumer,)
            )
        report = await store.audit()
    assert list(dict.fromkeys(f.details.get("consumer") for f in report.drift)) == drifted


async def test_diff_sorts_the_consumers_it_touched_in_short_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review 28: diff's description of the change (on a thread) sorted every consumer the span
    touched in one C call that holds the GIL: 50-100 ms for the 150,000 of diff(1, head) on a
    200k-event store, which the event loop waited for. It sorts runs of SORT_RUN keys and merges them
    in Python (which hands the GIL over): with runs of 16, no sort of the module covers more, and
    the consumers come out in uuid order as before."""
    import projections.diff as diff_module

    sorted_sizes, watched = _watched_sorts()

    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF") as store:
        await _store_of(store, 200)
        monkeypatch.setattr(replay_module, "SORT_RUN", 16)
        monkeypatch.setattr(replay_module, "sorted", watched, raising=False)
        monkeypatch.setattr(diff_module, "sorted", watched, raising=False)
        diff = await store.diff(0, await store.head())
    uuids = [c.consumer for c in diff.consumers]
    assert len(uuids) > 200
    assert uuids == sorted(uuids)
    assert max(sorted_sizes) <= 16, sorted_sizes


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.text(max_size=6), unique=True, max_size=300),
    run=st.integers(2, 40),
    order=st.sampled_from(["as drawn", "ascending", "descending", "halves swapped"]),
)
def test_sorted_in_runs_sorts_in_bounded_sorts(keys: list[str], run: int, order: str) -> None:
    """sorted_in_runs merges its sorted runs a block at a time (bisection, then one sort of the
    block): the keys come out as one sort orders them, and no sort covers more than SORT_RUN keys,
    whatever the runs hold (interleaved, disjoint, more runs than SORT_RUN)."""
    if order == "ascending":
        keys = sorted(keys)
    elif order == "descending":
        keys = sorted(keys, reverse=True)
    elif order == "halves swapped":
        keys = sorted(keys)
        keys = keys[len(keys) // 2 :] + keys[: len(keys) // 2]
    sizes, watched = _watched_sorts()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "SORT_RUN", run)
        patch.setattr(replay_module, "sorted", watched, raising=False)
        out = replay_module.sorted_in_runs(iter(keys))
    assert out == sorted(keys)
    assert max(sizes, default=0) <= run, sizes


def test_sorted_in_runs_merges_runs_given_in_order_in_blocks_not_key_by_key() -> None:
    """Keys given in order (a state loaded from the database holds its consumers so) make runs
    that follow one another, of which a block took only SORT_RUN // runs keys - from the first
    run, nothing from the others - when every run was merged at once: a sort (and a Python step
    over every run) per key with as many runs as SORT_RUN, 12.6 s for 2,000,000 uuids where
    heapq.merge took 2.9. Merged MERGE_FAN_IN runs at a time, a block takes SORT_RUN //
    MERGE_FAN_IN keys at the least: here 8,448 sorts for 65,536 keys, where it made 65,792."""
    run = 256
    keys = [f"{i:06d}" for i in range(run * run)]  # (256 runs of 256 keys, each after the last)
    sizes, watched = _watched_sorts()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(replay_module, "SORT_RUN", run)
        patch.setattr(replay_module, "sorted", watched, raising=False)
        out = replay_module.sorted_in_runs(iter(keys))
    assert out == keys
    assert max(sizes) <= run
    assert len(sizes) <= len(keys) // 4, len(sizes)


def test_the_first_open_of_a_process_imports_its_backend_off_the_event_loop(tmp_path: Path) -> None:
    """Review 28: the first open_store of a process imported the backend's module (and the
    projections' it imports) on the event loop, ~26 ms of module code every task waited for. It is
    imported on a thread now; run in a fresh interpreter, where nothing is imported yet."""
    import subprocess

    script = f"""
import asyncio, sys, threading
seen = {{}}
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "evstore.log.sqlite":
            seen[name] = threading.current_thread() is threading.main_thread()
        return None
sys.meta_path.insert(0, Watch())
from evstore import open_store
async def main():
    async with open_store({f"sqlite:///{tmp_path / 'f.db'}"!r}) as store:
        assert await store.head() == 0
asyncio.run(main())
print(seen)
"""
    root = str(Path(__file__).resolve().parents[1])  # (this checkout's evstore, not the installed one)
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": root},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'evstore.log.sqlite': False}", done.stdout


async def test_a_postgresql_rebuild_frees_its_fold_on_a_thread(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """helper-85 (left for PostgreSQL): the rebuild's fold of the whole log was dropped on the event
    loop at its return - freeing a whole state is C code holding the GIL (30-55 ms for 78,000
    consumers). It is emptied a consumer at a time on a thread, as on SQLite."""
    async with open_store(pg_url) as store:
        await _store_of(store, 60)
        loop_thread = threading.get_ident()
        freed = {"on_loop": 0, "dismantled": 0}

        def finalize(self: ConsumerState) -> None:
            if not self.worth_keeping():
                return
            frame: Any = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "dismantle":
                frame = frame.f_back
            if frame is not None:
                freed["dismantled"] += 1
            elif threading.get_ident() == loop_thread:
                freed["on_loop"] += 1

        monkeypatch.setattr(ConsumerState, "__del__", finalize, raising=False)
        await store.rebuild()
        monkeypatch.undo()
        assert freed["dismantled"] >= 30, freed
        assert freed["on_loop"] == 0, freed
        assert (await store.audit()).clean


@pytest.mark.parametrize("full", [False, True])
async def test_a_sqlite_rebuild_sorts_the_consumers_in_short_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, full: bool
) -> None:
    """helper-85 (left): the SQLite rebuild sorted every consumer of its fold in one C call on the
    writer thread (~20 ms for 78,000 consumers, twice; a 45 ms loop stall once), holding the GIL
    the event loop needs. It sorts runs of SORT_RUN keys and merges them; the projection it writes
    is as before (the audit is clean)."""
    import evstore.log.sqlite as sqlite_module

    sorted_sizes, watched = _watched_sorts()

    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF") as store:
        await _store_of(store, 200)
        await store.backend.tamper("DELETE FROM p_consumers")  # type: ignore[attr-defined]
        monkeypatch.setattr(replay_module, "SORT_RUN", 16)
        monkeypatch.setattr(replay_module, "sorted", watched, raising=False)
        monkeypatch.setattr(sqlite_module, "sorted", watched, raising=False)
        await store.rebuild(full=full)
        monkeypatch.undo()
        assert max(sorted_sizes) <= 16, sorted_sizes
        assert (await store.audit()).clean
