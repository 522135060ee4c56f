"""Several OS processes writing one store (one SQLite file, or one PostgreSQL schema) while
subscribers in other processes, and in this one, follow the log (README: "Order", "SQLite or
PostgreSQL?": readers and subscribers never skip or repeat an event).

Each writer process records what the store answered each command (its positions, or the code it
was refused with), every command carrying its own ``request_id``; each subscriber records every
event it was handed. Then: every subscriber saw positions after its ``after=`` up to the head,
once each, in order, the same event at each position as ``read`` gives; every accepted command's
events are seen by every subscriber at exactly the positions its receipt gave, and no rejected
command's ``request_id`` is ever seen. Subscribers of several kinds: from 0 (catch-up then live),
from the middle of the log, one that stops and subscribes again from the last position it
delivered (as README says to), one slow (batch_size 1, pausing), several in one process.

Also the module a worker runs: ``python -m tests.test_s42_F_xproc_subscribers writer|subscriber``.
``EVSTORE_SLOW=1`` runs longer campaigns.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SLOW = os.environ.get("EVSTORE_SLOW") == "1"
COMMANDS = 150 if SLOW else 20  # per writer process
WRITERS = 4 if SLOW else 3
DONE = "s42F-DONE"  # the request id of the parent's last command: subscribers stop at it
DEADLINE = 60.0  # seconds a subscriber process waits for DONE before giving up (a hang, not a timing)
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


# ---------------------------------------------------------------------------------------------
# worker processes


async def _writer(url: str, seed: int, n: int, out_path: str) -> None:
    _quiet()
    if seed % 2 == 0:
        # (SQLite: this writer writes the history index every few events, where the others keep
        # theirs for HISTORY_LAG; each process's index writes then meet the others' events)
        import evstore.log.sqlite

        evstore.log.sqlite.HISTORY_LAG = 3 + seed
    from evstore import (
        ConsumerAllocations,
        EvstoreError,
        Metadata,
        StorageError,
        open_store,
    )

    rng = random.Random(seed)
    with open(out_path, "w") as out:
        async with open_store(url) as store:
            providers = sorted(u for u, _ in await store.providers())
            live: dict[str, int] = {}  # consumer -> its generation as this writer last saw it
            deleted: list[str] = []
            migrations: list[str] = []

            async def one(i: int) -> None:
                rid = f"w{seed}-{i}"
                meta = Metadata(request_id=rid, actor=f"writer-{seed}")
                op = rng.random()
                try:
                    if op < 0.4 or not live:  # a build: refused for capacity once the providers fill
                        c = str(uuid.uuid4())
                        r = await store.set_allocations(
                            c,
                            {rng.choice(providers): {"VCPU": rng.randint(1, 4)}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                            metadata=meta,
                        )
                        live[c] = r.consumer_generations[c]
                    elif op < 0.5:  # a stale generation: refused, ConcurrentUpdate
                        c = rng.choice(list(live))
                        r = await store.set_allocations(
                            c,
                            {rng.choice(providers): {"VCPU": 1}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=live[c] + 7,
                            metadata=meta,
                        )
                    elif op < 0.6 and deleted:  # a write to a tombstone: refused, ConsumerDeleted
                        r = await store.set_allocations(
                            rng.choice(deleted),
                            {rng.choice(providers): {"VCPU": 1}},
                            project_id="p",
                            user_id="u",
                            consumer_type="INSTANCE",
                            generation=None,
                            metadata=meta,
                        )
                    elif op < 0.7:
                        c = rng.choice(list(live))
                        m = str(uuid.uuid4())
                        r = await store.start_migration(c, m, metadata=meta)
                        migrations.append(m)
                    elif op < 0.78 and migrations:  # a revert, maybe after its instance was deleted
                        r = await store.revert_migration(migrations.pop(), metadata=meta)
                    elif op < 0.92:
                        c = rng.choice(list(live))
                        live.pop(c, None)
                        deleted.append(c)
                        r = await store.delete_consumer(c, metadata=meta)
                    else:  # two consumers at once: refused whole if either does not fit
                        p = rng.choice(providers)
                        body = {
                            str(uuid.uuid4()): ConsumerAllocations(
                                allocations={p: {"VCPU": rng.randint(1, 3)}},
                                project_id="p",
                                user_id="u",
                                consumer_type="INSTANCE",
                                consumer_generation=None,
                            )
                            for _ in range(2)
                        }
                        r = await store.write_allocations(body, metadata=meta)
                        live.update({c: r.consumer_generations[c] for c in body})
                except StorageError:
                    raise  # (a storage error is no refusal: the parent fails on the exit code)
                except EvstoreError as exc:
                    out.write(json.dumps({"rid": rid, "rejected": exc.code}) + "\n")
                    out.flush()
                    return
                out.write(json.dumps({"rid": rid, "positions": list(r.positions)}) + "\n")
                out.flush()

            for start in range(0, n, 3):  # a few at once: group commits and the file lock mix
                await asyncio.gather(*(one(i) for i in range(start, min(n, start + 3))))


async def _subscriber(url: str, after: int, batch_size: int, mode: str, out_path: str) -> None:
    _quiet()
    from evstore import open_store

    rng = random.Random(os.getpid())
    deadline = time.monotonic() + DEADLINE
    with open(out_path, "w") as out:
        async with open_store(url, poll_interval=0.05) as store:
            out.write(json.dumps({"ready": True}) + "\n")
            out.flush()
            while True:
                stop_after = rng.randint(1, 25) if mode == "resubscribe" else None
                seen = 0
                done = False
                async with contextlib.aclosing(store.subscribe(after, batch_size=batch_size)) as events:
                    async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
                        async for event in events:
                            rid = event.metadata.request_id
                            out.write(
                                json.dumps({"p": event.position, "id": event.event_id, "rid": rid}) + "\n"
                            )
                            out.flush()
                            after = event.position
                            seen += 1
                            if rid == DONE:
                                done = True
                                break
                            if mode == "slow" and seen % 5 == 0:
                                await asyncio.sleep(0.02)
                            if stop_after is not None and seen >= stop_after:
                                break  # stop following; subscribe again from ``after``
                if done:
                    return


def _quiet() -> None:
    """Workers log warnings only (structlog's command lines would fill the test's output)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def _main(argv: list[str]) -> None:
    role = argv[0]
    if role == "writer":
        asyncio.run(_writer(argv[1], int(argv[2]), int(argv[3]), argv[4]))
    elif role == "subscriber":
        asyncio.run(_subscriber(argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]))
    else:
        raise SystemExit(f"unknown role {role!r}")


# ---------------------------------------------------------------------------------------------
# the tests


def _lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (a last line a killed process left half-written left out)."""
    text = path.read_text()
    complete = text[: text.rfind("\n") + 1] if not text.endswith("\n") else text
    return [json.loads(line) for line in complete.splitlines() if line.strip()]


async def _spawn(*args: str) -> asyncio.subprocess.Process:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.test_s42_F_xproc_subscribers", *args, env=env
    )


async def _wait_ready(path: Path, proc: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(30):
        while not (path.exists() and path.read_text().strip()):
            assert proc.returncode is None, f"subscriber exited {proc.returncode} before subscribing"
            await asyncio.sleep(0.02)


async def _in_process_subscriber(store: Any, after: int, batch_size: int, seen: list[dict[str, Any]]) -> None:
    async for event in store.subscribe(after, batch_size=batch_size):
        seen.append({"p": event.position, "id": event.event_id, "rid": event.metadata.request_id})
        if event.metadata.request_id == DONE:
            return


async def _campaign(url: str, tmp_path: Path, kill: bool = False) -> None:
    """``kill``: one more writer process is killed (SIGKILL) mid-run: what it was told was accepted
    is seen like the others'; what it committed unacknowledged is seen once, like any event."""
    from evstore import Inventory, Metadata, open_store

    async with open_store(url, poll_interval=0.05) as store:
        for i in range(2):
            rp = str(uuid.uuid4())
            await store.create_provider(rp, f"node-{i}", metadata=Metadata(request_id=f"setup-{i}-a"))
            await store.set_inventories(
                rp, {"VCPU": Inventory(total=40)}, generation=0, metadata=Metadata(request_id=f"setup-{i}-b")
            )
        setup_head = await store.head()

        # subscribers in other processes, started before the writers: from 0, from the middle of
        # the log, one that keeps stopping and subscribing again, and a slow one
        kinds = [("0", "500", "plain"), ("2", "7", "resubscribe"), ("0", "1", "slow")]
        sub_outs = [tmp_path / f"sub-{k}.jsonl" for k in range(len(kinds))]
        subs = [
            await _spawn("subscriber", url, after, batch, mode, str(out))
            for (after, batch, mode), out in zip(kinds, sub_outs, strict=True)
        ]
        for proc, out in zip(subs, sub_outs, strict=True):
            await _wait_ready(out, proc)

        # subscribers in this process too, on this process's store: at the same position (they
        # share reads), and with another batch size
        local: list[list[dict[str, Any]]] = [[] for _ in range(3)]
        local_tasks = [
            asyncio.create_task(_in_process_subscriber(store, 0, 500, local[0])),
            asyncio.create_task(_in_process_subscriber(store, 0, 500, local[1])),
            asyncio.create_task(_in_process_subscriber(store, 1, 3, local[2])),
        ]

        writer_outs = [tmp_path / f"writer-{k}.jsonl" for k in range(WRITERS)]
        writers = [
            await _spawn("writer", url, str(k), str(COMMANDS), str(out)) for k, out in enumerate(writer_outs)
        ]
        victim_out = tmp_path / "victim.jsonl"
        if kill:
            victim = await _spawn("writer", url, "99", "100000", str(victim_out))
            async with asyncio.timeout(60):
                while not (
                    victim_out.exists() and victim_out.read_text().count("\n") >= random.randint(3, 15)
                ):
                    assert victim.returncode is None
                    await asyncio.sleep(0.005)
            victim.kill()
            await victim.wait()
        # a subscriber process started while the writers run, from 0: catch-up, then live
        late_out = tmp_path / "sub-late.jsonl"
        late = await _spawn("subscriber", url, "0", "4", "plain", str(late_out))
        sub_outs.append(late_out)
        kinds.append(("0", "4", "plain"))
        subs.append(late)
        async with asyncio.timeout(120):
            codes = [await w.wait() for w in writers]
        assert codes == [0] * WRITERS, "a writer process failed (its stderr is above)"
        await _wait_ready(late_out, late)

        # an in-process subscriber from the middle of the log, begun after the writers
        mid = (setup_head + await store.head()) // 2
        local.append([])
        local_tasks.append(asyncio.create_task(_in_process_subscriber(store, mid, 2, local[-1])))

        # this process's last command marks the end for every subscriber
        await store.create_provider(str(uuid.uuid4()), "the-end", metadata=Metadata(request_id=DONE))
        head = await store.head()
        async with asyncio.timeout(DEADLINE + 10):
            sub_codes = [await s.wait() for s in subs]
            await asyncio.gather(*local_tasks)
        assert sub_codes == [0] * len(subs), "a subscriber process failed (its stderr is above)"

        log = await store.read(0, head + 10)

        # history (SQLite: through an index each writer process wrote part of, and past it) of
        # every entity: the events whose payload names it, from a store that wrote almost none
        entities = {u for e in log for u in _UUID.findall(json.dumps(e.data))}
        for u in sorted(entities):
            expected = [e.position for e in log if u in json.dumps(e.data)]
            assert [e.position async for e in store.history(u, batch_size=4)] == expected, u
        report = await store.audit(history=True)
        assert report.clean, report.findings

        # times never go backwards along positions, whichever process recorded them, so a time
        # names the last event recorded at or before it
        times = [e.recorded_at for e in log]
        assert times == sorted(times), "recorded_at goes backwards along positions"
        for e in log[:: max(1, len(log) // 40)]:
            last_at = max(x.position for x in log if x.recorded_at == e.recorded_at)
            assert await store.position_of(e.recorded_at) == last_at
    assert [e.position for e in log] == list(range(1, head + 1)), "the log's positions are gap-free"
    by_position = {e.position: (e.event_id, e.metadata.request_id) for e in log}

    accepted: dict[str, list[int]] = {}
    rejected: set[str] = set()
    for out in writer_outs + ([victim_out] if kill else []):
        lines = _lines(out)
        assert len(lines) == COMMANDS or out == victim_out, f"{out.name}: every command was answered"
        for line in lines:
            if "rejected" in line:
                rejected.add(line["rid"])
            else:
                accepted[line["rid"]] = line["positions"]
    assert rejected, "the campaign made no refused command: it proves nothing about them"
    assert len([p for ps in accepted.values() for p in ps]) > WRITERS * 3, "too few accepted commands"

    # every accepted command's events are in the log, at its receipt's positions, contiguous
    for rid, positions in accepted.items():
        assert positions == list(range(positions[0], positions[-1] + 1)) if positions else True, rid
        for p in positions:
            assert by_position[p][1] == rid, f"position {p} of {rid}'s receipt holds {by_position[p]}"
    unacknowledged = {rid for _, rid in by_position.values()} - {DONE} - {r for r in accepted if accepted[r]}
    assert {r for r in unacknowledged if not r.startswith("w99-")} == {
        f"setup-{i}-{x}" for i in range(2) for x in "ab"
    }, "the log holds no event of a command nobody was told was accepted (but the killed writer's)"
    # (the killed writer's commands committed unacknowledged: each whole, contiguous, once)
    for rid in {r for r in unacknowledged if r.startswith("w99-")}:
        at = [p for p, (_, r) in by_position.items() if r == rid]
        assert at == list(range(at[0], at[0] + len(at))) and rid not in rejected, rid

    def check(name: str, after: int, seen: list[dict[str, Any]]) -> None:
        positions = [s["p"] for s in seen]
        assert positions == list(range(after + 1, head + 1)), (
            f"{name}: saw positions {_summary(positions)}, expected {after + 1}..{head} once each, in order"
        )
        for s in seen:
            assert (s["id"], s["rid"]) == by_position[s["p"]], f"{name}: position {s['p']} is another event"
            assert s["rid"] not in rejected, f"{name}: saw an event of refused command {s['rid']}"
        assert {s["rid"] for s in seen} >= {r for r, ps in accepted.items() if ps and ps[0] > after}

    for (after, _, mode), out in zip(kinds, sub_outs, strict=True):
        check(f"subscriber process ({mode}, after={after})", int(after), [x for x in _lines(out) if "p" in x])
    for k, seen in enumerate(local):
        check(f"in-process subscriber {k}", [0, 0, 1, mid][k], seen)


def _summary(positions: list[int]) -> str:
    if len(positions) < 12:
        return str(positions)
    dups = sorted({p for p in positions if positions.count(p) > 1})
    return f"{positions[:5]}...{positions[-5:]} ({len(positions)}; repeated {dups[:10]})"


async def test_processes_writing_one_sqlite_file_while_others_subscribe_skip_and_repeat_nothing(
    tmp_path: Path,
) -> None:
    await _campaign(f"sqlite:///{tmp_path}/shared.db", tmp_path)


async def test_stores_writing_one_postgresql_schema_while_others_subscribe_skip_and_repeat_nothing(
    tmp_path: Path,
) -> None:
    from tests.pg import fresh_database_url

    await _campaign(fresh_database_url(), tmp_path)


async def test_a_writer_process_killed_mid_run_leaves_every_subscriber_whole_on_sqlite(
    tmp_path: Path,
) -> None:
    await _campaign(f"sqlite:///{tmp_path}/shared.db", tmp_path, kill=True)


async def test_a_writer_process_killed_mid_run_leaves_every_subscriber_whole_on_postgresql(
    tmp_path: Path,
) -> None:
    """(PostgreSQL: a writer killed between its COMMIT and the sequencer leaves its events
    unpositioned until another process's sequencer, or a subscriber's poll, positions them)"""
    from tests.pg import fresh_database_url

    await _campaign(fresh_database_url(), tmp_path, kill=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
