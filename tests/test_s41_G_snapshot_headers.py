"""Stop 41: time travel's snapshots are looked at by their headers where their state is not needed.

- take_snapshots' check of the chains (which snapshots to save again) read every snapshot whole,
  where it needs only its first line (the header, which names its chain) and the segments: now
  ``snapshot_headers`` reads that line alone (SQLite: blob I/O; PostgreSQL: a prefix).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from evstore import AllocationStore, open_store
from evstore.errors import EvstoreError
from projections import snapshots
from projections.replay import replay
from projections.snapshots import SNAPSHOT_FORMAT
from tests.test_s40_E_review import _tombstones, _unusable_snapshots


def _count_whole_reads(store: AllocationStore, reads: list[int]) -> None:
    backend: Any = store.backend
    load = backend.load_snapshot

    async def counted(at_most: int, fmt: int) -> Any:
        found = await load(at_most, fmt)
        reads.append(-1 if found is None else found[0])
        return found

    backend.load_snapshot = counted


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


@pytest.mark.xfail(strict=True, reason="SQLite file of UTF-16 text: its open fails (helper G's finding)")
async def test_a_sqlite_file_of_utf16_text_opens_or_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    """A database file made (by hand) with PRAGMA encoding = 'UTF-16le' before evstore's first
    open: the open raised a bare ValueError ("embedded null byte"), from _file_opened, which reads
    the file's name as the bytes of a CAST to BLOB - UTF-16 bytes in such a file. (Found while
    testing the header reads' SQL path, which such a file takes.)"""
    path = tmp_path / "utf16.db"
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA encoding = 'UTF-16le'")
    conn.execute("CREATE TABLE t (x)")  # (the encoding is fixed once the file is written)
    conn.execute("DROP TABLE t")
    conn.close()
    try:
        async with open_store(f"sqlite:///{path}") as store:
            await _tombstones(store, 2)
    except EvstoreError:
        pass  # (refused with a typed error: as good)
