"""Read cursors under concurrency (stop 38, helper G): ``read(after=N)`` refuses an ``N`` beyond
the head, so a cursor a reader legitimately holds must never be beyond the head as any later read
sees it - on either backend, in any process.

Writer processes append to one store (a SQLite file, a PostgreSQL schema) while pollers - in
other processes, and as other tasks in the writers' own processes - call ``read(after=cursor)``
in a tight loop with cursors taken from (a) the last event they read, (b) receipts just
acknowledged in their own process, or passed from another through a ``multiprocessing`` queue,
(c) ``position_of`` of such a receipt, (d) ``head()`` itself (the cursor exactly at the head while
writers append: read reads from N-1), and subscribers start from such cursors or from their own
checkpoint. One more writer (``tests/crash_worker.py``) is killed with SIGKILL mid-stream.
Checked: no poller is ever refused; each read starts at cursor + 1 and is contiguous; a receipt's
position is readable at once wherever it is known; every poller's log (read from its cursor on,
one event after another) and every checkpointed subscriber's equal ``read`` from 0 at the end, so
every acknowledged position was seen exactly once, in order; every acknowledged receipt names its
event. A second test puts the pollers' cursor on a hole and on a damaged event while writers
append (reusing tests/test_s38_b_read_edges.py's tampering): they read on.

EVSTORE_SLOW=1 writes for 30 s instead of 3.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, EvstoreError, InvalidInput, Inventory, open_store
from tests.conftest import campaign_seed, make_provider

SECONDS = float(
    os.environ.get("EVSTORE_S38G_SECONDS", "30" if os.environ.get("EVSTORE_SLOW") == "1" else "3")
)
WRITERS = 2  # processes writing (each with pollers of its own)
POLLERS = 2  # processes only polling
TASKS = 3  # writing tasks per writer process


# --- in the child processes ------------------------------------------------------------------


class _Poller:
    """What one poller saw: its log (position, event id) from ``start`` on, what its probes read,
    and every failure (a refusal above all)."""

    def __init__(self, name: str, start: int, whole: bool = True) -> None:
        self.name, self.start, self.whole = name, start, whole
        self.log: list[tuple[int, str]] = []
        self.probes = 0
        self.probes_nonempty = 0
        self.probes_empty = 0
        self.errors: list[str] = []

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "start": self.start,
            "whole": self.whole,
            "log": self.log,
            "probes": self.probes,
            "probes_nonempty": self.probes_nonempty,
            "probes_empty": self.probes_empty,
            "errors": self.errors[:20],
        }


class _Child:
    def __init__(self, spec: dict[str, Any], queues: list[Any], stop: Any, final: Any) -> None:
        self.spec, self.queues, self.stop, self.final = spec, queues, stop, final
        self.me: int = spec["index"]
        self.rng = random.Random(spec["seed"])
        self.own: list[int] = []  # positions of receipts acknowledged in this process
        self.xproc: list[int] = []  # ... in other processes, through the queue
        self.acks: list[tuple[list[int], str]] = []
        self.observed: dict[int, str] = {}
        self.conflicts: list[str] = []
        self.pollers: list[_Poller] = []

    def latest(self, source: str) -> int | None:
        if source == "own":
            return self.own[-1] if self.own else None
        while True:
            try:
                self.xproc.append(self.queues[self.me].get_nowait())
            except Exception:  # (queue.Empty)
                break
        return self.xproc[-1] if self.xproc else None

    def done(self, cursor: int) -> bool:
        return bool(self.stop.is_set()) and cursor >= self.final.value

    def see(self, poller: _Poller, cursor: int, batch: list[Any], what: str) -> None:
        got = [e.position for e in batch]
        if got != list(range(cursor + 1, cursor + 1 + len(got))):
            poller.errors.append(f"{what}: read(after={cursor}) gave {got[:5]}...")
        for e in batch:
            if self.observed.setdefault(e.position, e.event_id) != e.event_id:
                self.conflicts.append(f"{what}: {e.position} read as two events")

    async def read(
        self, store: AllocationStore, poller: _Poller, cursor: int, what: str, limit: int
    ) -> list[Any]:
        try:
            batch = await store.read(after=cursor, limit=limit)
        except InvalidInput as exc:
            poller.errors.append(f"{what}: read(after={cursor}) refused: {exc.message} {exc.details}")
            return []
        self.see(poller, cursor, batch, what)
        return batch

    async def poll(self, store: AllocationStore, kind: str, start: int) -> None:
        """A poller whose log goes on from its last event, probing with cursors of ``kind``."""
        p = _Poller(f"{self.spec['role']}{self.me}-{kind}-{len(self.pollers)}", start)
        self.pollers.append(p)
        cursor = start
        while not self.done(cursor):
            batch = await self.read(store, p, cursor, "last", self.rng.choice((1, 3, 50, 1000)))
            p.log += [(e.position, e.event_id) for e in batch]
            cursor = p.log[-1][0] if p.log else cursor
            if kind == "last":  # (its own cursor is its probe)
                p.probes += 1
                p.probes_nonempty += bool(batch)
                p.probes_empty += not batch
            probe: int | None = None
            try:
                if kind == "head":
                    probe = await store.head()
                elif kind == "fixed":
                    probe = start
                elif kind in ("own", "xproc", "position_of"):
                    r = self.latest(
                        "own" if kind == "own" or (kind == "position_of" and self.own) else "xproc"
                    )
                    if r is not None:
                        # the receipt's own event is there, wherever the receipt is known
                        at = await store.read(after=r - 1, limit=1)
                        if [e.position for e in at] != [r]:
                            p.errors.append(f"{kind}: receipt {r} not readable: {[e.position for e in at]}")
                        self.see(p, r - 1, at, kind)
                        probe = r
                        if kind == "position_of" and (probe := await store.position_of(r)) != r:
                            p.errors.append(f"position_of({r}) = {probe}")
            except InvalidInput as exc:
                p.errors.append(f"{kind}: refused: {exc.message} {exc.details}")
            if probe is not None:
                got = await self.read(store, p, probe, kind, self.rng.choice((1, 1000)))
                p.probes += 1
                p.probes_nonempty += bool(got)
                p.probes_empty += not got
            await asyncio.sleep(0)

    async def follow(self, store: AllocationStore, source: str) -> None:
        """Subscribers: from the checkpoint of the one before (``checkpoint``: a log from 0), or
        from the latest receipt (``own``/``xproc``) or its ``position_of``, each for a few events."""
        p = _Poller(
            f"{self.spec['role']}{self.me}-subscribe-{source}-{len(self.pollers)}", 0, source == "checkpoint"
        )
        self.pollers.append(p)
        cursor = 0
        while not self.done(cursor):
            start = cursor
            if source != "checkpoint":
                r = self.latest("own" if self.own else "xproc")
                if r is None:
                    await asyncio.sleep(0.01)
                    continue
                start = await store.position_of(r) if self.rng.random() < 0.5 else r
            p.probes += 1
            at, n = start, self.rng.choice((1, 5, 40))
            try:
                gen = store.subscribe(after=start, batch_size=self.rng.choice((1, 500)))
                async with asyncio.timeout(0.5), aclosing(gen):
                    async for e in gen:
                        self.see(p, at, [e], f"subscribe-{source}")
                        at = e.position
                        if source == "checkpoint":
                            p.log.append((e.position, e.event_id))
                        n -= 1
                        if n == 0 or self.done(at):
                            break
            except TimeoutError:
                pass
            except InvalidInput as exc:
                p.errors.append(f"subscribe(after={start}) refused: {exc.message} {exc.details}")
            if source == "checkpoint":
                cursor = at
            elif self.stop.is_set():
                cursor = self.final.value
            p.probes_nonempty += at > start

    async def write(self, store: AllocationStore, providers: list[str]) -> None:
        held: list[str] = []
        deadline = time.monotonic() + self.spec["seconds"]
        while time.monotonic() < deadline:
            c = str(uuid.uuid4())
            try:
                if held and self.rng.random() < 0.3:
                    c = held.pop(self.rng.randrange(len(held)))
                    receipt = await store.delete_consumer(c)
                else:
                    receipt = await store.set_allocations(
                        c,
                        {self.rng.choice(providers): {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="INSTANCE",
                        generation=None,
                    )
                    held.append(c)
            except EvstoreError as exc:
                self.conflicts.append(f"writer refused: {exc.code} {exc.message}")
                continue
            self.acks.append((list(receipt.positions), c))
            r = receipt.positions[-1]
            self.own.append(r)
            for i, q in enumerate(self.queues):
                if i != self.me:
                    q.put(r)

    async def main(self, ready: Any, go: Any, written: Any) -> None:
        import structlog

        for q in self.queues:  # (what is still in a queue at the end is not waited for)
            q.cancel_join_thread()

        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        spec = self.spec
        async with open_store(spec["url"], poll_interval=0.02) as store:
            providers = [u for u, _ in await store.providers()]
            with ready.get_lock():
                ready.value += 1
            while not go.is_set():
                await asyncio.sleep(0.01)
            jobs = [self.poll(store, kind, spec["start"]) for kind in spec["kinds"]]
            jobs += [self.follow(store, s) for s in spec["follow"]]
            writers = [self.write(store, providers) for _ in range(spec["tasks"])]

            async def write_all() -> None:
                await asyncio.gather(*writers)
                with written.get_lock():
                    written.value += 1

            await asyncio.gather(write_all(), *jobs)
        Path(spec["out"]).write_text(
            json.dumps(
                {
                    "pollers": [p.to_dict() for p in self.pollers],
                    "acks": self.acks,
                    "observed": sorted(self.observed.items()),
                    "conflicts": self.conflicts[:20],
                    "xproc_receipts": len(self.xproc),
                }
            )
        )


def _child(
    spec: dict[str, Any], queues: list[Any], stop: Any, final: Any, ready: Any, go: Any, written: Any
) -> None:
    try:
        asyncio.run(_Child(spec, queues, stop, final).main(ready, go, written))
    except BaseException:  # (told to the test: a failed child is more than its exit code)
        Path(spec["out"] + ".failed").write_text(traceback.format_exc())
        raise


# --- in the test process ---------------------------------------------------------------------


def _failures(specs: list[dict[str, Any]]) -> str:
    failed = [Path(s["out"] + ".failed") for s in specs]
    return "\n".join(f.read_text() for f in failed if f.exists())


async def _campaign(
    url: str, tmp_path: Path, specs: list[dict[str, Any]], crash: bool, start: int = 0
) -> dict[str, Any]:
    """Run the children of ``specs`` (and, with ``crash``, a writer killed mid-stream) against
    ``url``; return what they saw and what the store holds from ``start`` at the end."""
    ctx = multiprocessing.get_context("spawn")
    queues = [ctx.Queue() for _ in specs]
    stop, go = ctx.Event(), ctx.Event()
    final, ready, written = ctx.Value("q", 0), ctx.Value("i", 0), ctx.Value("i", 0)
    seed = campaign_seed("read-cursor-races")
    for i, spec in enumerate(specs):
        spec.update(index=i, seed=seed + i, url=url, out=str(tmp_path / f"child{i}.json"), start=start)
    procs = [
        ctx.Process(target=_child, args=(s, queues, stop, final, ready, go, written), daemon=True)
        for s in specs
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + 60
    while ready.value < len(procs):
        assert time.monotonic() < deadline, "children not ready"
        assert all(p.is_alive() or p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        await asyncio.sleep(0.05)
    go.set()
    began = time.monotonic()
    acks_crash: list[list[int]] = []
    if crash:
        ack = tmp_path / "crash.jsonl"
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        worker = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.crash_worker",
            url,
            str(ack),
            str(seed),
            env=env,
            stdout=asyncio.subprocess.PIPE,
        )
        assert worker.stdout is not None
        assert (await asyncio.wait_for(worker.stdout.readline(), 30)).strip() == b"ready"
        # (killed mid-stream: once it has been told of a few commands, halfway through at the soonest)
        while not ack.exists() or ack.read_text().count("\n") < 3:
            assert time.monotonic() - began < 60, "the writer to kill acknowledged nothing in 60 s"
            await asyncio.sleep(0.02)
        await asyncio.sleep(max(0.0, SECONDS / 2 - (time.monotonic() - began)) + random.uniform(0, 0.2))
        worker.send_signal(signal.SIGKILL)
        await asyncio.wait_for(worker.communicate(), 60)
        assert worker.returncode == -signal.SIGKILL
        text = ack.read_text() if ack.exists() else ""
        acks_crash = [json.loads(x)["positions"] for x in text.splitlines() if x.endswith("}")]
    while written.value < len(procs):
        assert time.monotonic() - began < SECONDS + 60, "writers did not finish"
        assert all(p.is_alive() for p in procs), f"seed {seed}: {_failures(specs)}"
        await asyncio.sleep(0.1)
    async with open_store(url) as store:
        # (every receipt is in; on PostgreSQL the head also positions what the killed writer
        # committed and left unpositioned)
        final.value = head = await store.head()
        stop.set()
        for proc in procs:
            await asyncio.to_thread(proc.join, 90)
            assert proc.exitcode == 0, f"seed {seed}: child exit {proc.exitcode}: {_failures(specs)}"
        full: list[tuple[int, str]] = []
        while batch := await store.read(after=full[-1][0] if full else start):
            full += [(e.position, e.event_id) for e in batch]
        names = {e.position: getattr(e.payload, "consumer", None) for e in await store.read(start, 10**6)}
    outs = [json.loads(Path(s["out"]).read_text()) for s in specs]
    return {"seed": seed, "head": head, "full": full, "names": names, "outs": outs, "crash": acks_crash}


def _check(run: dict[str, Any], start: int = 0) -> dict[str, int]:
    seed, full = run["seed"], [tuple(x) for x in run["full"]]
    assert [p for p, _ in full] == list(range(start + 1, run["head"] + 1)), f"seed {seed}"
    by_pos = dict(full)
    stats: dict[str, int] = {"events": len(full), "acks": 0, "probes": 0, "pollers": 0}
    for out in run["outs"]:
        assert out["conflicts"] == [], f"seed {seed}: {out['conflicts']}"
        for pos, event_id in out["observed"]:
            assert by_pos.get(pos) == event_id, f"seed {seed}: {pos} read as another event"
        for positions, consumer in out["acks"]:
            for pos in positions:
                assert run["names"][pos] == consumer, f"seed {seed}: receipt {pos} names another event"
        stats["acks"] += len(out["acks"])
        stats["xproc_receipts"] = stats.get("xproc_receipts", 0) + out["xproc_receipts"]
        for p in out["pollers"]:
            assert p["errors"] == [], f"seed {seed}: {p['name']}: {p['errors']}"
            if p["whole"]:
                # a log, read one event after another from its cursor: every position once, in order
                assert [tuple(x) for x in p["log"]] == [x for x in full if x[0] > p["start"]], (
                    f"seed {seed}: {p['name']}"
                )
            kind = p["name"].split("-", 1)[1].rsplit("-", 1)[0]
            assert p["probes"] > 0, f"{p['name']} never probed"
            stats[f"{kind}.probes"] = stats.get(f"{kind}.probes", 0) + p["probes"]
            stats[f"{kind}.nonempty"] = stats.get(f"{kind}.nonempty", 0) + p["probes_nonempty"]
            stats["probes"] += p["probes"]
            stats["pollers"] += 1
    for positions in run["crash"]:
        assert all(start < pos <= run["head"] for pos in positions), f"seed {seed}: killed writer's receipt"
    stats["crash_acks"] = len(run["crash"])
    print(json.dumps(stats, sort_keys=True))
    return stats


async def _providers(url: str) -> int:
    async with open_store(url) as store:
        for i in range(3):
            await make_provider(store, f"cn-{i}", VCPU=Inventory(total=10**6))
        return await store.head()


async def test_legitimate_cursors_are_never_refused_nor_skip_under_concurrent_writers(
    store_url: str, tmp_path: Path
) -> None:
    await _providers(store_url)
    kinds = ["last", "own", "xproc", "head", "position_of"]
    writer = {"role": "w", "tasks": TASKS, "seconds": SECONDS, "kinds": kinds}
    poller = {"role": "p", "tasks": 0, "seconds": 0, "kinds": ["last", "xproc", "head", "position_of"]}
    specs = [{**writer, "follow": ["checkpoint", "own"]} for _ in range(WRITERS)] + [
        {**poller, "follow": ["checkpoint", "xproc"]} for _ in range(POLLERS)
    ]
    stats = _check(await _campaign(store_url, tmp_path, specs, crash=True))
    assert stats["acks"] > 0 and stats["crash_acks"] > 0 and stats["xproc_receipts"] > 0
    # the edge the change made: a cursor at the head read while writers append, and answered
    assert stats["head.nonempty"] > 0, stats


@pytest.mark.parametrize("tamper", ["hole", "damaged"])
async def test_a_cursor_on_a_hole_or_a_damaged_event_reads_on_while_writers_append(
    store_url: str, tmp_path: Path, tamper: str
) -> None:
    """The cursor on an event deleted by hand (a later one there) or damaged (the head itself):
    ``read(after=cursor)`` reads what comes after it as writers append, in every process."""
    head = await _providers(store_url)
    q = "?" if store_url.startswith("sqlite") else "$1"
    async with open_store(store_url) as store:
        for _ in range(3):
            await store.set_allocations(
                str(uuid.uuid4()),
                {(await store.providers())[0][0]: {"VCPU": 1}},
                project_id="p",
                user_id="u",
                consumer_type="INSTANCE",
                generation=None,
            )
        head = await store.head()
        at = head - 1 if tamper == "hole" else head
        sql = "DELETE FROM events" if tamper == "hole" else "UPDATE events SET data = '{not json'"
        await store.backend.tamper(f"{sql} WHERE position = {q}", (at,))  # type: ignore[attr-defined]
    kinds = ["last", "fixed", "head"]
    specs = [{"role": "w", "tasks": 2, "seconds": SECONDS / 2, "kinds": kinds, "follow": []}]
    specs.append({"role": "p", "tasks": 0, "seconds": 0, "kinds": kinds, "follow": []})
    run = await _campaign(store_url, tmp_path, specs, crash=False, start=at)
    stats = _check(run, start=at)
    assert stats["fixed.nonempty"] > 0, stats
