"""export / import through the CLI: a faithful copy, and refusal of anything broken."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.test_cli_support import REPO, demo_db, evstore


def test_export_import_reproduces_the_log_exactly(tmp_path: Path) -> None:
    source = demo_db(tmp_path / "source.db", instances=40)
    dump = tmp_path / "log.jsonl"
    exported = evstore("export", "--db", str(source), "-o", str(dump))
    assert exported.returncode == 0, exported.stderr
    lines = dump.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["format"] == "evstore-export" and header["events"] == len(lines) - 1

    target = tmp_path / "copy.db"
    imported = evstore("import", str(dump), "--db", str(target), "--json")
    assert imported.returncode == 0, imported.stderr
    result = json.loads(imported.stdout)
    assert result["imported"] == header["events"] and result["audit"]["clean"] is True
    again = evstore("export", "--db", str(target))
    assert again.returncode == 0
    assert again.stdout == dump.read_text()  # same positions, event ids, payload bytes, times and hashes
    same = [
        json.loads(evstore("state", "--db", str(db), "--json").stdout)["providers"] for db in (source, target)
    ]
    assert same[0] == same[1]

    refused = evstore("import", str(dump), "--db", str(target))
    assert refused.returncode == 1
    assert refused.stderr.startswith("error: evstore.invalid_input: import needs an empty store")


def _import_fails(tmp_path: Path, lines: list[str], name: str) -> str:
    broken = tmp_path / f"{name}.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    target = tmp_path / f"{name}.db"
    done = evstore("import", str(broken), "--db", str(target))
    assert done.returncode == 1, done.stdout
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not target.exists()  # a refused import leaves no database behind
    return done.stderr


def test_import_refuses_broken_files(tmp_path: Path) -> None:
    source = demo_db(tmp_path / "source.db", instances=20)
    lines = evstore("export", "--db", str(source)).stdout.splitlines()

    altered = list(lines)
    row = json.loads(altered[10])
    row["metadata"] = json.dumps({"actor": "mallory"})
    altered[10] = json.dumps(row)
    err = _import_fails(tmp_path, altered, "altered")
    assert err.startswith("error: evstore.log.corrupt: line 11: hash chain broken at position 10")

    err = _import_fails(tmp_path, lines[:5] + lines[6:], "gap")
    assert "position 6 where 5 was expected" in err

    err = _import_fails(tmp_path, lines[:-1], "truncated")
    assert "truncated" in err

    err = _import_fails(tmp_path, [*lines[:3], "{not json", *lines[4:]], "garbage")
    assert err.startswith("error: evstore.log.corrupt: line 4: not an event row")

    err = _import_fails(tmp_path, lines[1:], "headless")
    assert "not an evstore export" in err

    binary = tmp_path / "binary.jsonl"  # not UTF-8: was evstore.internal (UnicodeDecodeError)
    binary.write_bytes(b"\xff\xfe\x00garbage\n" * 10)
    done = evstore("import", str(binary), "--db", str(tmp_path / "binary.db"))
    assert done.returncode == 1
    assert done.stderr.startswith("error: evstore.invalid_input: ") and "not UTF-8" in done.stderr
    assert not (tmp_path / "binary.db").exists()

    # through --url too: a refused import leaves no file behind (it left an empty store)
    target = tmp_path / "by-url.db"
    truncated = tmp_path / "truncated.jsonl"
    done = evstore("import", str(truncated), "--url", f"sqlite:///{target}")
    assert done.returncode == 1 and "truncated" in done.stderr
    assert not any(tmp_path.glob("by-url.db*"))


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """Regression: `evstore export ... | head -1` printed 'error: evstore.io: [Errno 32] Broken pipe';
    a table (rich) exited 1, an error by the README's exit codes."""
    db = demo_db(tmp_path / "demo.db", instances=200)
    for command in (["export"], ["tail", "--after", "0", "--no-follow"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "evstore.cli", *command, "--db", str(db)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=REPO,
        )
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline()
        proc.stdout.close()
        assert proc.wait(timeout=60) == 141, command
        assert b"error" not in proc.stderr.read(), command


def test_a_postgresql_url_without_asyncpg_says_what_to_install() -> None:
    script = (
        "import sys; sys.modules['asyncpg'] = None\n"
        "from evstore.store import make_backend\n"
        "from evstore import InvalidInput\n"
        "try:\n    make_backend('postgresql://u@h/db')\n"
        "except InvalidInput as exc:\n    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert "pip install asyncpg" in done.stdout, done.stdout + done.stderr
    assert "'evstore[postgres]'" not in done.stdout  # (evstore is installed from a checkout, not PyPI)


def test_export_to_a_symlink_a_pipe_or_a_failure_leaves_each_as_it_should(tmp_path: Path) -> None:
    """Regression (helper-28): `export -o PATH` wrote PATH.partial and renamed it over PATH, which
    replaced a symlink with a file (its target kept the old content), replaced a pipe (its reader
    got nothing; as root, /dev/full became a file), and a failed export left the .partial behind."""
    import os
    import sqlite3
    import threading

    db = demo_db(tmp_path / "demo.db", instances=30)
    expected = evstore("export", "--db", str(db)).stdout
    assert expected.count("\n") > 60

    real = tmp_path / "real.jsonl"
    real.write_text("original\n")
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    done = evstore("export", "--db", str(db), "-o", str(link))
    assert done.returncode == 0, done.stderr
    assert link.is_symlink() and real.read_text() == expected

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    received: list[str] = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_text()))
    reader.start()
    done = evstore("export", "--db", str(db), "-o", str(fifo))
    reader.join(timeout=60)
    assert done.returncode == 0, done.stderr
    assert received == [expected] and fifo.is_fifo()

    # through a descriptor link: an anonymous pipe, and a file the shell opened for appending
    # (regression, helper-30: resolving /proc/self/fd/N found no file; the append lost the file)
    piped = evstore("export", "--db", str(db), "-o", "/dev/stdout")
    assert piped.returncode == 0 and piped.stdout == expected, piped.stderr
    log = tmp_path / "app.log"
    log.write_text("PRECIOUS\n")
    with log.open("a") as appended:
        done = subprocess.run(
            [sys.executable, "-m", "evstore.cli", "export", "--db", str(db), "-o", "/dev/stdout"],
            stdout=appended,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    assert log.read_text() == "PRECIOUS\n" + expected
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    for bad, code in ((loop, "evstore.io"), (tmp_path / "no-such-dir" / "x.jsonl", "evstore.not_found")):
        done = evstore("export", "--db", str(db), "-o", str(bad))  # (a path evstore checks: exit 1)
        assert done.returncode == 1 and done.stderr.startswith(f"error: {code}: "), done.stderr

    with sqlite3.connect(db) as conn:  # a row no export can write, half-way through the log
        conn.execute("UPDATE events SET data = x'00ff' WHERE position = 50")
    out = tmp_path / "out.jsonl"
    done = evstore("export", "--db", str(db), "-o", str(out))
    assert done.returncode == 1 and "position 50" in done.stderr, done.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


def test_a_demo_seed_out_of_range_is_a_usage_error_before_anything_is_written(tmp_path: Path) -> None:
    """Regression (helper-28): --seed -5 ran the demo, then failed with evstore.internal at the
    599th event (the seed names a uuid: 0 <= seed < 2**128)."""
    for seed in ("-5", str(2**128)):
        done = evstore("demo", "--db", str(tmp_path / "d.db"), "--seed", seed)
        assert done.returncode == 2 and done.stderr.startswith("error: evstore.usage: "), done.stderr
        assert not (tmp_path / "d.db").exists()


def test_import_refuses_another_applications_database(tmp_path: Path) -> None:
    """Regression (helper-28): import wrote evstore's tables beside another application's (and
    left them there when the file was refused); the other commands refuse such a file."""
    import sqlite3

    db = demo_db(tmp_path / "demo.db", instances=10, nodes=2)
    dump = tmp_path / "demo.jsonl"
    dump.write_text(evstore("export", "--db", str(db)).stdout)
    other = tmp_path / "other.db"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE foo (x)")
    conn.close()
    done = evstore("import", str(dump), "--db", str(other))
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("error: evstore.invalid_input: ") and "(foo)" in done.stderr
    with sqlite3.connect(other) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["foo"]
    conn.close()
    # one whose own key/value meta table even holds a schema_version (helper-30: taken for a store)
    lookalike = tmp_path / "lookalike.db"
    with sqlite3.connect(lookalike) as conn:
        conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT)")
        conn.execute("INSERT INTO meta VALUES ('schema_version', '2')")
        conn.execute("CREATE TABLE users (name)")
    conn.close()
    done = evstore("import", str(dump), "--db", str(lookalike))
    assert done.returncode == 1 and "(users)" in done.stderr, done.stdout + done.stderr
    empty = tmp_path / "empty.db"  # an empty file (no tables) still becomes a store
    empty.touch()
    assert evstore("import", str(dump), "--db", str(empty)).returncode == 0


def test_export_refuses_to_write_over_the_database_it_exports(tmp_path: Path) -> None:
    """Regression: ``evstore export --db store.db -o store.db`` (a slip for another name) renamed
    the export over the database: the store was gone, and every later command said
    ``evstore.storage: file is not a database``."""
    source = demo_db(tmp_path / "store.db", instances=10)
    before = source.read_bytes()
    for target in (source, Path(f"{source}-wal"), tmp_path / "." / "store.db"):
        done = evstore("export", "--db", str(source), "-o", str(target))
        assert done.returncode == 1, done.stderr
        assert done.stderr.startswith("error: evstore.invalid_input: "), done.stderr
        assert "database" in done.stderr
    assert source.read_bytes() == before
    assert evstore("audit", "--db", str(source)).returncode == 0


_EXPORT_WHILE_A_WRITER_APPENDS = """
import sys, uuid
from evstore.cli import main
from evstore.store import AllocationStore

export = AllocationStore._export

async def appended_meanwhile(self, batch_size):
    # another process's command, committed after the CLI read the head and before the export began
    await self.create_provider(str(uuid.uuid4()), "late")
    async for line in export(self, batch_size):
        yield line

AllocationStore._export = appended_meanwhile
main(sys.argv[1:])
"""


def test_export_reports_the_events_it_wrote_while_writers_append(tmp_path: Path) -> None:
    """Regression (helper-75): `export -o` said 'exported N events' with N the head it read before
    the export began, so with writers appending meanwhile the note counted fewer events than the
    file (and its header) held: 1229 said, 1254 written, in a run beside four writers."""
    source = demo_db(tmp_path / "source.db", instances=10)
    dump = tmp_path / "log.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", _EXPORT_WHILE_A_WRITER_APPENDS, "export", "--db", str(source), "-o", dump],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    lines = dump.read_text().splitlines()
    header = json.loads(lines[0])
    assert header["events"] == len(lines) - 1 == json.loads(lines[-1])["position"]
    assert done.stderr.strip().splitlines()[-1] == f"exported {header['events']} events to {dump}"
