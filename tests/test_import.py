"""import_events is all or nothing, and nothing is decided against a half-imported store."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TextIO

import pytest

from evstore import (
    AllocationStore,
    ConsumerDeleted,
    CorruptEvent,
    DuplicateName,
    InvalidInput,
    StorageError,
    open_store,
)
from evstore.log import GENESIS_HASH
from projections.exchange import parse_row, row_line
from tests.conftest import allocate, make_provider, new_uuid

ROOT = Path(__file__).resolve().parent.parent


async def _source(tmp_path: Path, consumers: int = 1500) -> tuple[list[str], str, str]:
    """An export of a store with one provider, ``consumers`` allocations and one tombstone."""
    async with open_store(f"sqlite:///{tmp_path}/source.db") as source:
        rp = await make_provider(source, "rp", VCPU=100_000)
        held = [new_uuid() for _ in range(consumers)]
        await asyncio.gather(*(allocate(source, c, {rp: {"VCPU": 1}}) for c in held))
        await source.delete_consumer(held[0])
        return [line async for line in source.export()], rp, held[0]


async def test_commands_during_an_import_are_decided_against_all_of_it(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression: the import appended batch after batch and refolded the projection at the end;
    meanwhile commands were decided against an empty projection: a provider of the log created
    again, a tombstoned consumer given allocations (a leak), and the import then failed halfway
    (its positions taken), leaving a store no import could fill again."""
    lines, rp, deleted = await _source(tmp_path)
    importing = asyncio.Event()

    def progress(phase: str, done: int) -> None:
        if phase == "import":
            importing.set()

    task = asyncio.create_task(store.import_events(lambda: iter(lines), batch_size=100, progress=progress))
    await asyncio.wait_for(importing.wait(), 30)
    outcomes = await asyncio.gather(
        store.create_provider(rp, "again"),
        allocate(store, deleted, {rp: {"VCPU": 1}}),
        return_exceptions=True,
    )
    assert await task == len(lines) - 1
    assert isinstance(outcomes[0], DuplicateName), outcomes[0]
    assert isinstance(outcomes[1], ConsumerDeleted), outcomes[1]
    assert await store.head() == len(lines) - 1
    assert (await store.usage(rp))["VCPU"] == 1499
    assert (await store.audit()).clean


async def test_an_import_that_fails_halfway_leaves_the_store_empty(
    store: AllocationStore, tmp_path: Path
) -> None:
    """The file changed between the validation and the import pass: refused, nothing kept, and
    the same store takes the sound file afterwards."""
    lines, rp, _ = await _source(tmp_path, consumers=300)
    last = parse_row(lines[-1], len(lines))
    altered = [*lines[:-1], lines[-1].replace(last.hash, "0" * 64)]
    calls = 0

    def open_lines() -> list[str]:
        nonlocal calls
        calls += 1
        return lines if calls == 1 else altered

    with pytest.raises(CorruptEvent, match="hash chain"):
        await store.import_events(open_lines, batch_size=50)
    assert await store.head() == 0
    assert await store.providers() == []
    assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
    assert (await store.usage(rp))["VCPU"] == 299
    assert (await store.audit()).clean


async def test_an_import_whose_caller_is_cancelled_while_it_writes_leaves_the_store_empty(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression (helper-28): Ctrl-C during the write pass ended the command, but the writer
    thread went on and committed the whole import (SQLite); the README promises an interrupted
    import leaves the store empty. Cancelled in the middle of the write pass, and at its end (the
    rows written, the projection not yet), it rolls back; the store then takes the file."""
    lines, rp, _ = await _source(tmp_path, consumers=1500)
    loop = asyncio.get_running_loop()
    rows = len(lines) - 1  # (the header is not a row)
    # mid-pass; and once every row is written, at the last read of the file (the whole file in
    # one batch: the check before the projection is written, or the one before COMMIT, stops it)
    for cancel_at, batch_size in ((500, 100), (len(lines), rows)):
        reached, gate = asyncio.Event(), threading.Event()
        calls = 0

        def gated(at: int, reached: asyncio.Event = reached, gate: threading.Event = gate) -> Iterator[str]:
            # the write pass reads the file on the writer's thread: hold it there at line ``at``
            for n, line in enumerate([*lines, None]):
                if n == at:
                    loop.call_soon_threadsafe(reached.set)
                    gate.wait(30)
                if line is not None:
                    yield line

        def open_lines(at: int = cancel_at) -> Iterator[str]:
            nonlocal calls
            calls += 1
            return iter(lines) if calls == 1 else gated(at)

        task = asyncio.create_task(store.import_events(open_lines, batch_size=batch_size))
        await asyncio.wait_for(reached.wait(), 60)
        task.cancel()
        await asyncio.sleep(0.1)  # (the import's caller hears of it and tells the thread to stop)
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await store.head() == 0, cancel_at
        assert await store.providers() == []
    assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
    assert (await store.usage(rp))["VCPU"] == 1499
    assert (await store.audit()).clean


async def test_a_progress_callback_that_raises_ends_the_import_with_nothing_kept(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression (review 32, helper D): on SQLite the import pass handed ``progress`` to the
    event loop without waiting for it, so an exception it raised went to asyncio's exception
    handler ("Exception in callback") and the import committed regardless; on PostgreSQL it
    reached the caller and the import was rolled back. Now both: raised, nothing kept, on the
    event loop's thread."""
    lines, rp, _ = await _source(tmp_path, consumers=300)
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def progress(phase: str, done: int) -> None:
        threads.add(threading.get_ident())
        if phase == "import":
            raise KeyError("stop")

    with pytest.raises(KeyError, match="stop"):
        await store.import_events(lambda: iter(lines), batch_size=50, progress=progress)
    assert threads == {loop_thread}
    assert await store.head() == 0
    assert await store.providers() == []
    assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
    assert (await store.usage(rp))["VCPU"] == 299
    assert (await store.audit()).clean


@pytest.mark.parametrize(
    "raised",
    [ValueError("I/O operation on closed file."), TimeoutError("the dashboard did not answer")],
    ids=["ValueError-closed", "TimeoutError"],
)
async def test_a_progress_callbacks_exception_reaches_the_caller_as_it_was_raised(
    store: AllocationStore, tmp_path: Path, raised: Exception
) -> None:
    """Regression (review 32, helper R): on SQLite the exception came back through the writer's
    thread, where a ValueError saying "closed" (a progress writing to a closed file) became
    ``StoreClosed("The store is closed")`` - the store was open - and a TimeoutError was taken
    for the writer's own wait for the callback, which it then waited for again, for ever (the
    writer, holding the write lock, hung, and the import's caller with it)."""
    lines, rp, _ = await _source(tmp_path, consumers=30)

    def progress(phase: str, done: int) -> None:
        if phase == "import":
            raise raised

    with pytest.raises(type(raised), match=str(raised)):
        async with asyncio.timeout(60):
            await store.import_events(lambda: iter(lines), batch_size=10, progress=progress)
    assert await store.head() == 0
    assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
    assert (await store.usage(rp))["VCPU"] == 29


async def test_a_cancelled_import_whose_file_then_fails_still_ends_cancelled(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression (helper-30): an error from the writer thread after the cancellation (here the
    file failing to read) replaced the CancelledError: Ctrl-C printed an I/O error, exit 1."""
    lines, _, _ = await _source(tmp_path, consumers=300)
    loop = asyncio.get_running_loop()
    reached, gate = asyncio.Event(), threading.Event()
    calls = 0

    def open_lines() -> Iterator[str]:
        nonlocal calls
        calls += 1
        if calls == 1:
            return iter(lines)

        def failing() -> Iterator[str]:
            yield from lines[:100]
            loop.call_soon_threadsafe(reached.set)
            gate.wait(30)
            raise OSError(5, "Input/output error")

        return failing()

    task = asyncio.create_task(store.import_events(open_lines, batch_size=10))
    await asyncio.wait_for(reached.wait(), 60)
    task.cancel()
    await asyncio.sleep(0.1)
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.head() == 0


async def test_a_file_replaced_by_another_sound_export_between_the_passes_is_refused(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression: the second pass checked each row and the header but not that they were the
    rows the first pass validated; another sound export of the same length (here one whose second
    row repeats the first row's event id, re-chained) was imported, duplicate id and all (stores
    of schema version 2 have no unique index on event ids)."""
    lines, _, _ = await _source(tmp_path, consumers=20)
    rows = [parse_row(line, n) for n, line in enumerate(lines[1:], start=2)]
    forged, prev = [], GENESIS_HASH
    for i, row in enumerate(rows):
        row = row._replace(event_id=rows[0].event_id) if i == 1 else row
        row = row._replace(hash=row.chained_hash(prev))
        forged.append(row_line(row))
        prev = row.hash
    header = json.loads(lines[0])
    header["head_hash"] = prev
    forged_lines = [json.dumps(header), *forged]
    calls = 0

    def open_lines() -> list[str]:
        nonlocal calls
        calls += 1
        return lines if calls == 1 else forged_lines

    if store.url.startswith("postgres"):  # (its unique index on event ids may refuse the row first)
        with pytest.raises((CorruptEvent, StorageError), match=r"changed while it was imported|event_id"):
            await store.import_events(open_lines, batch_size=5)
    else:
        with pytest.raises(CorruptEvent, match="changed while it was imported") as info:
            await store.import_events(open_lines, batch_size=5)
        assert info.value.details["reason"] == "changed"
    assert await store.head() == 0
    with pytest.raises(CorruptEvent, match="appears twice"):  # (the forged file alone: refused too)
        await store.import_events(lambda: forged_lines)


async def test_an_import_killed_midway_leaves_the_store_empty(tmp_path: Path) -> None:
    """kill -9 of `evstore import` at random moments: the store holds all of the log or none of
    it, never a part without its projection (as before import_all), and a new import then works."""
    lines, rp, _ = await _source(tmp_path, consumers=3000)
    export = tmp_path / "export.jsonl"
    export.write_text("\n".join(lines) + "\n")
    rng = random.Random(1848343)
    outcomes = set()
    for attempt in range(4):
        db = tmp_path / f"target-{attempt}.db"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "evstore.cli", "import", str(export), "--db", str(db),
            cwd=ROOT, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        await asyncio.sleep(rng.uniform(0.3, 1.5))
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        if not db.exists():
            outcomes.add("no file")
            continue
        async with open_store(f"sqlite:///{db}") as store:
            head = await store.head()
            assert head in (0, len(lines) - 1)
            outcomes.add("whole" if head else "empty")
            if head == 0:  # the same store takes the file afterwards
                assert await store.import_events(lambda: iter(lines)) == len(lines) - 1
            assert (await store.usage(rp))["VCPU"] == 2999
            assert (await store.audit()).clean
    assert outcomes  # (which ones happen depends on the machine's speed; each is checked above)


async def test_a_header_whose_final_hash_alone_is_wrong_is_refused_saying_so(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression: a header whose counts match the rows but whose ``head_hash`` does not was
    refused as "the file ends after N events at position N, but its header promises N events up
    to position N" - counts that agree, and nothing about the hash that does not."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    header = json.loads(lines[0])
    header["head_hash"] = "0" * 64
    with pytest.raises(CorruptEvent, match="head_hash") as info:
        await store.import_events(lambda: [json.dumps(header), *lines[1:]])
    assert "promises" not in info.value.message
    assert info.value.details["reason"] == "truncated"
    assert await store.head() == 0


@pytest.mark.parametrize("field,value", [("events", "7"), ("events", 7.9), ("head", True), ("head_hash", 5)])
async def test_a_header_with_a_field_of_the_wrong_type_is_refused(
    store: AllocationStore, tmp_path: Path, field: str, value: object
) -> None:
    """Regression: the header's fields were coerced (``int("7")``, ``int(7.9)``, ``int(True)``,
    ``str(5)``), so a header no evstore writes was taken, or refused later as a count mismatch."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    header = json.loads(lines[0])
    header[field] = value
    with pytest.raises(CorruptEvent, match="malformed export header") as info:
        await store.import_events(lambda: [json.dumps(header), *lines[1:]])
    assert info.value.details["reason"] == "header"
    assert await store.head() == 0


async def test_open_lines_answering_a_one_shot_iterator_is_refused_saying_so(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression: ``import_events(lambda: f)`` with an open file (or a generator) validated the
    whole file, then found it exhausted on the second call and said "the export file is empty"."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    once = iter(lines)
    with pytest.raises(InvalidInput, match="called twice") as info:
        await store.import_events(lambda: once)
    assert "empty" not in info.value.message
    assert await store.head() == 0


async def test_an_export_saved_with_a_byte_order_mark_imports(store: AllocationStore, tmp_path: Path) -> None:
    """Regression (helper-71): an export re-saved by an editor that adds a UTF-8 byte-order mark was
    refused as "not an evstore export (the first line is not JSON)". The mark is not part of the
    header (nor of the hash chain, which starts at the first row): it is skipped."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    await store.import_events(lambda: ["\ufeff" + lines[0], *lines[1:]])
    assert await store.head() == len(lines) - 1
    assert (await store.audit()).clean


async def test_an_export_says_its_version_and_both_versions_import(
    store: AllocationStore, tmp_path: Path
) -> None:
    """Regression (helper-79): exports now may hold events with optional payload fields an evstore
    of export version 1 refuses (``on_behalf_of``, a deleted child provider's ``parent``); their
    header still said version 1, so such an evstore read the file and called its events corrupt
    at their lines ("on_behalf_of: Extra inputs are not permitted"). The header says version 2,
    which it refuses by the header; this evstore imports both versions (a version-1 file is what
    earlier evstores exported), and names the versions it reads for any other."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    header = json.loads(lines[0])
    assert header["version"] == 2
    for version, accepted in ((1, True), (3, False), (True, False), ("2", False)):
        header["version"] = version
        edited = [json.dumps(header), *lines[1:]]
        async with open_store(f"sqlite:///{tmp_path}/v{version!s}.db") as target:
            if accepted:
                assert await target.import_events(functools.partial(iter, edited)) == len(lines) - 1
                assert (await target.audit()).clean
            else:
                with pytest.raises(CorruptEvent, match="this evstore reads versions 1, 2") as info:
                    await target.import_events(functools.partial(iter, edited))
                assert info.value.details["reason"] == "header"
                assert await target.head() == 0


async def test_the_files_open_lines_opens_are_closed_whether_the_import_succeeds_or_fails(
    backend_name: str, tmp_path: Path
) -> None:
    """Regression (helper s36-A): ``import_events(lambda: open(path))`` - the form its own
    "called twice" error recommends - left each file it opened unclosed, imported or refused:
    a ``ResourceWarning: unclosed file`` per pass (under ``-X dev``, ``-W default``, pytest), and
    the descriptors held until the garbage collector found them. What ``open_lines`` answers is
    the import's: each file is closed once its import has ended, and so is a generator that
    opens the file (as the CLI's does) when the import stops before reading it to its end."""
    from tests.test_import_memory import _fresh_url

    lines, _, _ = await _source(tmp_path, consumers=20)
    good, truncated, repeated = (tmp_path / f"{name}.jsonl" for name in ("good", "truncated", "repeated"))
    good.write_text("".join(f"{line}\n" for line in lines))
    truncated.write_text("".join(f"{line}\n" for line in lines[:-1]))
    rows = [parse_row(text, n) for n, text in enumerate(lines) if n]
    prev, chained = GENESIS_HASH, []
    for row in rows:  # (position 5 repeats the event id of position 4: found as the rows are written)
        row = row._replace(event_id=rows[3].event_id if row.position == 5 else row.event_id)
        row = row._replace(hash=row.chained_hash(prev))
        prev = row.hash
        chained.append(row_line(row))
    header = {**json.loads(lines[0]), "head_hash": prev}
    repeated.write_text("".join(f"{line}\n" for line in [json.dumps(header), *chained]))

    opened: list[TextIO] = []

    def open_file(path: Path) -> Iterable[str]:
        opened.append(path.open(encoding="utf-8"))
        return opened[-1]

    def open_generator(path: Path) -> Iterable[str]:
        def read() -> Iterator[str]:
            with path.open(encoding="utf-8") as stream:
                opened.append(stream)
                yield from stream

        return read()

    for opener in (open_file, open_generator):
        async with open_store(await _fresh_url(backend_name, tmp_path, opener.__name__)) as store:
            for path, refusal in ((truncated, "truncated"), (repeated, "appears twice"), (good, None)):
                opened.clear()
                if refusal is None:
                    assert await store.import_events(functools.partial(opener, path)) == len(lines) - 1
                else:
                    with pytest.raises(CorruptEvent, match=refusal):
                        await store.import_events(functools.partial(opener, path))
                assert opened, (opener.__name__, path.name)
                assert all(stream.closed for stream in opened), (opener.__name__, path.name)


async def test_the_import_leaves_a_standard_stream_open_and_a_failing_close_does_not_undo_it(
    tmp_path: Path,
) -> None:
    """Regression (session 36 review): the import closed what ``open_lines`` answered unless it
    was ``sys.stdin`` itself, so ``lambda: open(0, closefd=...)``-style wrappers of descriptor 0
    had the process's standard input closed under the caller; and a ``close()`` that raised after
    a committed import replaced the import's success with that error (the events were in)."""
    lines, _, _ = await _source(tmp_path, consumers=5)
    source = tmp_path / "good.jsonl"
    source.write_text("".join(f"{line}\n" for line in lines))
    opened: list[TextIO] = []

    def on_zero() -> TextIO:  # (a new file object on descriptor 0 each pass, read from its start)
        opened.append(open(0, encoding="utf-8"))  # (handed to the import)
        opened[-1].seek(0)
        return opened[-1]

    saved = os.dup(0)
    try:
        with source.open("rb") as file:
            os.dup2(file.fileno(), 0)
        async with open_store(f"sqlite:///{tmp_path}/zero.db") as store:
            assert await store.import_events(on_zero) == len(lines) - 1
        assert opened and not any(stream.closed for stream in opened)
        os.fstat(0)  # (still open: raised EBADF before)
    finally:
        for stream in opened:  # (closed while descriptor 0 is still the file, never the real one)
            with contextlib.suppress(OSError):
                stream.close()
        os.dup2(saved, 0)
        os.close(saved)

    class Stubborn:
        def __init__(self) -> None:
            self.stream = source.open(encoding="utf-8")

        def __iter__(self) -> Iterator[str]:
            return iter(self.stream)

        def close(self) -> None:
            self.stream.close()
            raise OSError(5, "Input/output error")

    async with open_store(f"sqlite:///{tmp_path}/stubborn.db") as store:
        assert await store.import_events(Stubborn) == len(lines) - 1
        assert await store.head() == len(lines) - 1
