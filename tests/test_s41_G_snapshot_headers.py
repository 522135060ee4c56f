"""Stop 41: time travel's snapshots are looked at by their headers where their state is not needed,
and two intervals no longer re-save each other's snapshots for good.

- take_snapshots' check of the chains (which snapshots to save again) read every snapshot whole,
  where it needs only its first line (the header, which names its chain) and the segments: now
  ``snapshot_headers`` reads that line alone (SQLite: blob I/O; PostgreSQL: a prefix).
- A question that found more than 8 snapshots in a row whose chain broke folded from position 0,
  saving at every multiple of its interval - also over another interval's usable snapshots, with
  its own segment, which broke that interval's chain after them; its next question did the same
  in turn. Now the snapshots whose chain broke are passed over by their header, and the fold
  starts from the latest usable one: it saves over none that another snapshot's chain needs.
"""

from __future__ import annotations

import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

from evstore import AllocationStore, open_store
from projections import snapshots
from projections.replay import replay
from projections.snapshots import SNAPSHOT_FORMAT
from tests.test_s40_E_review import _tombstones, _unusable_snapshots


def _count_saves(store: AllocationStore, saves: Counter[int]) -> None:
    """Count the snapshots ``store``'s folds save, by position."""
    backend: Any = store.backend
    name = "save_provider_snapshots" if snapshots.supports_provider_snapshots(backend) else "save_snapshot"
    save = getattr(backend, name)

    async def counted(position: int, *args: Any, **kwargs: Any) -> Any:
        saves[position] += 1
        return await save(position, *args, **kwargs)

    setattr(backend, name, counted)


def _count_whole_reads(store: AllocationStore, reads: list[int]) -> None:
    backend: Any = store.backend
    load = backend.load_snapshot

    async def counted(at_most: int, fmt: int) -> Any:
        found = await load(at_most, fmt)
        reads.append(-1 if found is None else found[0])
        return found

    backend.load_snapshot = counted


async def test_two_intervals_stop_re_saving_each_others_snapshots(store_url: str) -> None:
    """Regression: a process taking snapshots every event, another every 10, whose fold (begun
    before the first one saved) replaced the first one's segments at 10, 20 and 30: the first
    one's snapshots 11-19, 21-29, 31 and 32 are then unusable. A question of the first one at 19
    passed over 8 of them, folded from 0 and saved 1-19 - 10 too, with its own segment, which broke
    the second one's 20 and 30; the second one's question at 29 passed over 8, folded from 0 in
    its turn and saved 10 and 20 with its own segments, breaking the first one's 11-19 again: 19
    and 10 saves at every round of these questions, for good (this test, before the fix: rounds 2
    and 3 saved 19 and 10). Now the first round saves again only the snapshots whose chain broke,
    and the rounds after it save nothing."""
    async with (
        open_store(store_url, snapshot_every=1) as a,
        open_store(store_url, snapshot_every=10) as b,
    ):
        await _tombstones(a, 15)
        head = await a.head()
        assert head == 32
        await a.take_snapshots()
        await snapshots.fold_to(b.backend, head, every=10, start_at=0)  # type: ignore[arg-type]
        broken = await _unusable_snapshots(a)
        assert broken == [p for p in range(11, head + 1) if p % 10]
        saves_a: Counter[int] = Counter()
        saves_b: Counter[int] = Counter()
        _count_saves(a, saves_a)
        _count_saves(b, saves_b)
        rounds = []
        for _ in range(3):
            assert (await a.state_at(19)).state == await replay(a.backend.read, 19)
            assert (await b.state_at(29)).state == await replay(b.backend.read, 29)
            assert (await a.state_at(head)).state == await replay(a.backend.read, head)
            rounds.append((sorted(saves_a.elements()), sorted(saves_b.elements())))
            saves_a.clear()
            saves_b.clear()
        assert [(len(saved_a), len(saved_b)) for saved_a, saved_b in rounds[1:]] == [(0, 0), (0, 0)]
        assert rounds[0] == ([*range(11, 20), 31, 32], list(range(21, 30)))
        assert await _unusable_snapshots(a) == []
        for p in range(head + 1):
            want = await replay(a.backend.read, p)
            assert (await a.state_at(p)).state == want, p
            assert (await b.state_at(p)).state == want, p


async def test_a_question_reads_whole_only_the_snapshots_it_decodes(store_url: str) -> None:
    """Past snapshots whose chain broke, a question read each one whole (8 at most) to find it
    unusable; now the latest one, then the first one before it whose chain is whole by the headers."""
    async with (
        open_store(store_url, snapshot_every=1) as a,
        open_store(store_url, snapshot_every=10) as b,
    ):
        await _tombstones(a, 15)
        head = await a.head()
        await a.take_snapshots()
        await snapshots.fold_to(b.backend, head, every=10, start_at=0)  # type: ignore[arg-type]
        reads: list[int] = []
        _count_whole_reads(a, reads)
        assert (await a.state_at(19)).state == await replay(a.backend.read, 19)
        assert reads == [19, 10]  # (19 read whole and found broken; 18-11 by their headers)


async def test_take_snapshots_checks_the_chains_without_reading_a_snapshot_whole(
    store: AllocationStore,
) -> None:
    """take_snapshots' check of the chains read every snapshot whole for its header; now none, and
    it still finds those whose chain broke (and saves them again)."""
    store.snapshot_every = 2
    await _tombstones(store, 10)
    head = await store.head()
    await store.take_snapshots()
    reads: list[int] = []
    _count_whole_reads(store, reads)
    assert await store.take_snapshots() == list(range(2, head + 1, 2))
    assert reads == []
    await snapshots.fold_to(store.backend, head, every=5, start_at=0)  # type: ignore[arg-type]
    assert await _unusable_snapshots(store) == [p for p in range(12, head + 1, 2) if p % 10]
    await store.take_snapshots()
    assert await _unusable_snapshots(store) == []


async def test_snapshot_headers_are_the_first_lines_of_the_usable_snapshots(store: AllocationStore) -> None:
    """A header longer than what is read first (many custom classes: SQLite reads 1 KiB at a
    time, PostgreSQL a 4,096-character prefix) is read whole; text of no newline is its own line;
    snapshots whose event changed, of another format, and the segments are not listed."""
    await _tombstones(store, 4)
    backend: Any = store.backend
    rows = {r.position: r.hash for r in await backend.read_raw(0, 20)}
    long_header = '{"format":6,"custom_classes":["' + "CUSTOM_\u00e9" * 2000 + '"]}'
    await backend.save_snapshot(2, rows[2], SNAPSHOT_FORMAT, long_header + "\nbody\nmore", tombstones="s\nx")
    await backend.save_snapshot(3, rows[3], SNAPSHOT_FORMAT, "no newline at all")
    await backend.save_snapshot(4, rows[4], SNAPSHOT_FORMAT, "\nan empty first line")
    await backend.save_snapshot(5, "not its event's hash", SNAPSHOT_FORMAT, "h5\nbody")
    await backend.save_snapshot(6, rows[6], SNAPSHOT_FORMAT - 1, "h6\nbody")
    await backend.save_snapshot(7, rows[7], SNAPSHOT_FORMAT, "h7\nbody")
    assert await backend.snapshot_headers(20, SNAPSHOT_FORMAT) == [
        (2, long_header),
        (3, "no newline at all"),
        (4, ""),
        (7, "h7"),
    ]
    assert await backend.snapshot_headers(6, SNAPSHOT_FORMAT) == [
        (2, long_header),
        (3, "no newline at all"),
        (4, ""),
    ]
    assert await backend.snapshot_headers(20, SNAPSHOT_FORMAT - 1) == [(6, "h6")]


async def test_sqlite_headers_by_sql_and_of_a_damaged_row(tmp_path: Path) -> None:
    """Blob I/O reads a row's bytes, which are its text's in a UTF-8 file; in a file of another
    text encoding the header is read by SQL (here the same rows, both ways). A row damaged into
    bytes that are no UTF-8 does not fail the read, and time travel still answers as a replay."""
    from evstore.log.sqlite import _first_line

    path = tmp_path / "utf8.db"
    async with open_store(f"sqlite:///{path}", snapshot_every=2) as store:
        await _tombstones(store, 4)
        head = await store.head()
        taken = await store.take_snapshots()
        backend: Any = store.backend
        headers = await backend.snapshot_headers(head, SNAPSHOT_FORMAT)
        assert [p for p, _ in headers] == taken
        conn = sqlite3.connect(path)
        try:
            for p, header in headers:
                found = await backend.load_snapshot(p, SNAPSHOT_FORMAT)
                assert header == found[1].partition("\n")[0]
                assert _first_line(conn, p, True) == _first_line(conn, p, False) == header
                assert _first_line(conn, -p, False) == _first_line(conn, -p, True)  # (its segment)
        finally:
            conn.close()
        await backend.tamper("UPDATE snapshots SET state = X'ff0aff' WHERE position = 4")
        assert dict(await backend.snapshot_headers(head, SNAPSHOT_FORMAT))[4] == "\ufffd"
        await store.take_snapshots()
        for p in range(head + 1):
            assert (await store.state_at(p)).state == await replay(store.backend.read, p), p


async def test_a_sqlite_file_of_utf16_text_opens_and_answers_as_any(tmp_path: Path) -> None:
    """A database file made (by hand) with PRAGMA encoding = 'UTF-16le' before evstore's first
    open: the open raised a bare ValueError ("embedded null byte"), from _file_opened, which read
    the file's name as the bytes of a CAST to BLOB - UTF-16 bytes in such a file. (Found by helper
    G while testing the header reads' SQL path, which such a file takes.) It opens now; commands,
    time travel from snapshots (read through that SQL path) and a reopen answer as on any file."""
    path = tmp_path / "utf16.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA encoding = 'UTF-16le'")
    conn.execute("CREATE TABLE t (x)")  # (the encoding is fixed once the file is written)
    conn.execute("DROP TABLE t")
    conn.close()
    async with open_store(f"sqlite:///{path}", snapshot_every=3) as store:
        await _tombstones(store, 4)
        head = await store.head()
        assert head > 3
        await store.take_snapshots()
        for p in range(head + 1):
            assert (await store.state_at(p)).state == await replay(store.backend.read, p), p
        assert (await store.audit()).clean
    async with open_store(f"sqlite:///{path}") as store:
        assert await store.head() == head
    conn = sqlite3.connect(path)
    assert conn.execute("PRAGMA encoding").fetchone()[0] == "UTF-16le"  # (what the test is about)
    conn.close()
