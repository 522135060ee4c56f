"""One rule for the CLI's exit statuses, and one shape for what both backends print.

The rule (README, "Debugging a leak"): 2 is a usage error - the command line itself is wrong: a
missing, unknown, empty or conflicting option or argument, or an out-of-range number; 1 is every
error evstore finds in what it was given, a path included - a file that does not exist
(``evstore.not_found``), a directory where a file belongs (``evstore.invalid_input``), a file
that is not a database.

From review 23 (helper-47): each test failed on e6d333f. There, click's ``Path`` checks answered
some path problems with exit 2 and others fell through to evstore with exit 1 (``--db missing.db``
1 but ``--db DIR`` and ``import missing.jsonl`` 2; ``--url sqlite:///DIR`` 1 but ``--db DIR`` 2),
and ``--db ''`` said "file '' is a directory". ``stats --json`` had other keys on PostgreSQL.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import demo_db, evstore


def _error(done: object) -> tuple[int, str]:
    """(exit status, the error line's code) of a finished command; asserts it is one line."""
    returncode: int = done.returncode  # type: ignore[attr-defined]
    stderr: str = done.stderr  # type: ignore[attr-defined]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return returncode, lines[0].split(": ", 2)[1]


def test_a_directory_as_the_database_is_refused_alike_through_db_and_url(tmp_path: Path) -> None:
    folder = tmp_path / "adir.db"
    folder.mkdir()
    dump = tmp_path / "d.jsonl"
    dump.write_text("{}\n")
    history = ["history", "5b9a2ad6-67b7-4cb7-989b-ec8a1e41b594"]
    for command in (["audit"], ["stats"], history, ["import", str(dump)]):
        for store in (["--db", str(folder)], ["--url", f"sqlite:///{folder}"]):
            done = evstore(*command, *store)
            assert _error(done) == (1, "evstore.invalid_input"), (command, store)
            assert "is a directory" in done.stderr
    done = evstore("demo", "--db", str(folder))  # (not "exists and is not a database the demo wrote")
    assert _error(done) == (1, "evstore.invalid_input") and "is a directory" in done.stderr, done.stderr


def test_an_empty_db_is_an_empty_option_as_an_empty_url_is(tmp_path: Path) -> None:
    for command in (["audit"], ["demo"], ["import", str(tmp_path / "x.jsonl")]):
        for store in (["--db", ""], ["--url", ""]):
            done = evstore(*command, *store)
            assert _error(done) == (2, "evstore.usage"), (command, store)
            assert "is a directory" not in done.stderr and "is empty" in done.stderr, done.stderr


async def test_a_missing_directory_for_a_new_database_is_not_found_as_exports_is(tmp_path: Path) -> None:
    """Regression (helper-65): ``demo`` or ``import`` with ``--db no-such-dir/x.db`` (and
    ``open_store`` of such a URL) said ``evstore.storage`` where ``export -o no-such-dir/x.jsonl``
    says ``evstore.not_found``, the README's code for a path that does not exist."""
    import evstore as api

    target = tmp_path / "no-such-dir" / "x.db"
    dump = tmp_path / "d.jsonl"
    db = demo_db(tmp_path / "demo.db", instances=4)
    assert evstore("export", "--db", str(db), "-o", str(dump)).returncode == 0
    for done in (
        evstore("demo", "--db", str(target), "--instances", "4"),
        evstore("import", str(dump), "--db", str(target)),
    ):
        assert _error(done) == (1, "evstore.not_found"), done.stderr
        assert "no-such-dir does not exist" in done.stderr
    try:
        async with open_store(f"sqlite:///{target}"):
            raise AssertionError("opened a store in a directory that does not exist")
    except api.NotFound as exc:
        assert "does not exist" in exc.message
    assert not target.parent.exists()


def test_a_missing_input_file_is_not_found_as_a_missing_database_is(tmp_path: Path) -> None:
    missing_db = evstore("audit", "--db", str(tmp_path / "missing.db"))
    assert _error(missing_db) == (1, "evstore.not_found")
    missing_export = evstore("import", str(tmp_path / "missing.jsonl"), "--db", str(tmp_path / "new.db"))
    assert _error(missing_export) == (1, "evstore.not_found"), missing_export.stderr
    assert "missing.jsonl" in missing_export.stderr
    assert not (tmp_path / "new.db").exists()
    folder = tmp_path / "dump"
    folder.mkdir()
    a_directory = evstore("import", str(folder), "--db", str(tmp_path / "new.db"))
    assert _error(a_directory) == (1, "evstore.invalid_input") and "is a directory" in a_directory.stderr
    assert not (tmp_path / "new.db").exists()
    empty = evstore("import", "", "--db", str(tmp_path / "new.db"))
    assert _error(empty) == (2, "evstore.usage") and "is a directory" not in empty.stderr, empty.stderr


def test_an_empty_point_or_uuid_is_an_empty_option_not_a_malformed_value(tmp_path: Path) -> None:
    """Regression (review 24, helper-53): an empty ``--at``, ``--provider``, ``--consumer``, history
    uuid or diff bound (``--at "$UNSET"``) was answered as a malformed value (exit 1,
    ``evstore.invalid_input``: "got ''"), where the rule and an empty ``--db``, ``--url``, ``-o`` or
    import file say usage error (exit 2)."""
    db = demo_db(tmp_path / "s.db", instances=5, nodes=2)
    store = ["--db", str(db)]
    for command in (
        ["state", "--at", ""],
        ["state", "--at", "  "],
        ["state", "--provider", ""],
        ["state", "--consumer", " "],
        ["state", "--at", "1", "--consumer", ""],
        ["history", ""],
        ["diff", "", "1"],
        ["diff", "0", " "],
    ):
        done = evstore(*command, *store)
        assert _error(done) == (2, "evstore.usage"), (command, done.stderr)
        assert "is empty" in done.stderr, done.stderr
    malformed = evstore("state", "--at", "soon", *store)  # (a value given, and wrong: still 1)
    assert _error(malformed) == (1, "evstore.invalid_input"), malformed.stderr


def test_an_export_to_a_path_it_cannot_write_is_an_error_not_a_usage_error(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "s.db", instances=5, nodes=2)
    folder = tmp_path / "out"
    folder.mkdir()
    done = evstore("export", "--db", str(db), "-o", str(folder))
    assert _error(done) == (1, "evstore.invalid_input") and "is a directory" in done.stderr, done.stderr
    done = evstore("export", "--db", str(db), "-o", str(tmp_path / "no-such-dir" / "x.jsonl"))
    assert _error(done) == (1, "evstore.not_found"), done.stderr
    done = evstore("export", "--db", str(db), "-o", "")
    assert _error(done) == (2, "evstore.usage") and "is a directory" not in done.stderr, done.stderr


def _stats_shape(stats: dict[str, object]) -> None:
    assert list(stats) == ["url", "backend", "head", "events_by_type", "db_bytes", "snapshot_positions"]
    by_type = stats["events_by_type"]
    assert isinstance(by_type, dict) and list(by_type) == sorted(by_type)


def test_stats_json_has_the_same_keys_on_both_backends(tmp_path: Path) -> None:
    from tests.pg import fresh_database_url  # skips without a configured server

    db = demo_db(tmp_path / "s.db", instances=10, nodes=2)
    lite = json.loads(evstore("stats", "--db", str(db), "--json").stdout)
    _stats_shape(lite)
    assert lite["backend"] == {"name": "sqlite"}
    url = fresh_database_url()
    dump = tmp_path / "s.jsonl"
    assert evstore("export", "--db", str(db), "-o", str(dump)).returncode == 0
    assert evstore("import", str(dump), "--url", url).returncode == 0
    pg = json.loads(evstore("stats", "--url", url, "--json").stdout)
    _stats_shape(pg)
    assert pg["backend"] == {"name": "postgresql", "unpositioned": 0, "pool_size": 10}
    for key in ("head", "events_by_type", "snapshot_positions"):
        assert pg[key] == lite[key], key


async def test_the_apis_stats_are_the_clis_without_the_url(store_url: str) -> None:
    """Regression (rev25-d): store.stats() answered the backend's raw counts - no
    snapshot_positions, and PostgreSQL's unpositioned and pool_size beside head on one backend
    only - while `evstore stats --json`, documented with the same keys on both backends, had
    them under "backend": two shapes for one question."""
    async with open_store(store_url, snapshot_every=2) as store:
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        assert await store.take_snapshots() == [2]
        stats = await store.stats()
    cli = json.loads(evstore("stats", "--url", store_url, "--json").stdout)
    del cli["url"]
    assert isinstance(stats["db_bytes"], int) and isinstance(cli["db_bytes"], int)
    stats["db_bytes"] = cli["db_bytes"]  # (SQLite's WAL is checkpointed into the file on close)
    assert stats == cli
    assert list(stats) == ["backend", "head", "events_by_type", "db_bytes", "snapshot_positions"]


def test_state_json_at_the_head_is_the_same_read_now_or_with_at(tmp_path: Path) -> None:
    """The projection (no --at) and a fold (--at HEAD) listed a provider's or a consumer's
    allocations with their classes in different orders (DISK_GB first, VCPU first): the same
    state, printed as different JSON - and differently again on PostgreSQL."""
    db = demo_db(tmp_path / "s.db", instances=30, nodes=2)
    head = str(json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"])
    state = json.loads(evstore("state", "--db", str(db), "--json").stdout)
    provider = state["providers"][0]["provider"]
    holders = json.loads(evstore("state", "--provider", provider, "--db", str(db), "--json").stdout)
    consumer = next(c for c, amounts in holders["allocations"].items() if len(amounts) > 1)
    for entity in ([], ["--provider", provider], ["--consumer", consumer]):
        now = evstore("state", *entity, "--db", str(db), "--json")
        then = evstore("state", *entity, "--at", head, "--db", str(db), "--json")
        assert now.returncode == then.returncode == 0, now.stderr + then.stderr
        assert now.stdout == then.stdout, entity


def test_the_state_before_the_first_event_says_so_on_one_line(tmp_path: Path) -> None:
    """`state --at 0` (or a time before the log) printed an empty table whose title was folded
    to its width: "State at position 0 of  / 37 (before the first / event)"."""
    db = demo_db(tmp_path / "s.db", instances=10, nodes=2)
    head = json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"]
    for at in ("0", "2000-01-01T00:00:00Z"):
        done = evstore("state", "--at", at, "--db", str(db))
        assert done.returncode == 0, done.stderr
        assert f"State at position 0 of {head} (before the first event)" in done.stdout, done.stdout


def test_a_fifo_as_the_database_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Regression (stop 23, helper-47): ``mkfifo f; evstore audit --db f`` (and ``demo --db f``,
    ``--url sqlite:///f``) blocked for ever: SQLite, and the demo's look at what the file holds,
    opened the pipe and waited for a writer. A FIFO is refused as a directory is."""
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    for command in (["audit"], ["stats"], ["demo"]):
        for store in (["--db", str(fifo)], ["--url", f"sqlite:///{fifo}"]):
            done = evstore(*command, *store, timeout=30)
            assert _error(done) == (1, "evstore.invalid_input"), (command, store, done.stderr)
            assert "FIFO" in done.stderr, done.stderr


def test_an_import_into_a_fifo_is_refused_not_waited_on(tmp_path: Path) -> None:
    """Regression (review 23, helper-49): ``mkfifo f; evstore import dump.jsonl --db f`` blocked
    for ever - the import's look for another application's tables (``foreign_tables``) opened the
    pipe before the store's open could refuse it."""
    fifo = tmp_path / "pipe.db"
    os.mkfifo(fifo)
    source = demo_db(tmp_path / "source.db", instances=2, nodes=2)
    dump = tmp_path / "d.jsonl"
    assert evstore("export", "--db", str(source), "-o", str(dump)).returncode == 0
    for store in (["--db", str(fifo)], ["--url", f"sqlite:///{fifo}"]):
        done = evstore("import", str(dump), *store, timeout=30)
        assert _error(done) == (1, "evstore.invalid_input"), (store, done.stderr)
        assert "FIFO" in done.stderr, done.stderr
    assert fifo.is_fifo()


def test_a_db_path_with_a_question_mark_is_refused_not_cut_at_it(tmp_path: Path) -> None:
    """Regression (helper-56): ``evstore demo --db 'we?ird.db'`` exited 0 having written its store
    to a file named ``we`` (the path became ``sqlite:///.../we?ird.db``, whose ``?`` starts the
    URL's options), and ``evstore stats --db 'we?ird.db'`` then said there was no database."""
    weird = tmp_path / "we?ird.db"
    export = tmp_path / "x.jsonl"
    export.write_text("")
    for command in (["demo"], ["import", str(export)]):
        done = evstore(*command, "--db", str(weird))
        assert _error(done) == (1, "evstore.invalid_input"), (command, done.stderr)
        assert "'?'" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]  # (no "we")
    weird.write_bytes(b"")  # a file of that name exists: it is still not opened as "we"
    done = evstore("stats", "--db", str(weird))
    assert _error(done) == (1, "evstore.invalid_input") and "'?'" in done.stderr, done.stderr


async def test_rebuild_refuses_a_log_that_lost_its_last_events_unless_forced(tmp_path: Path) -> None:
    """`evstore rebuild` on a log whose last event (a tombstone) was deleted: refused, exit 1
    `evstore.log.corrupt`, naming --force; with --force it rebuilds (helper-64's report)."""
    import sqlite3

    db = tmp_path / "t.db"
    async with open_store(f"sqlite:///{db}") as store:
        rp = await make_provider(store, VCPU=8)
        c = new_uuid()
        await allocate(store, c, {rp: {"VCPU": 2}})
        last = (await store.delete_consumer(c)).position
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM events WHERE position = ?", (last,))
    refused = evstore("rebuild", "--db", str(db))
    assert _error(refused) == (1, "evstore.log.corrupt") and "--force" in refused.stderr, refused.stderr
    forced = evstore("rebuild", "--db", str(db), "--force")
    assert forced.returncode == 0, forced.stderr
    assert evstore("audit", "--db", str(db)).returncode == 0


def test_snapshot_every_beyond_the_largest_position_is_out_of_range(tmp_path: Path) -> None:
    """Regression (stop 29's note): ``snapshot --every 1180591620717411303424`` (2**70) exited 0
    having taken no snapshot - an interval no position reaches means "never" - where every other
    out-of-range number is a usage error."""
    db = demo_db(tmp_path / "s.db", instances=5, nodes=2)
    for every in (str(2**63), str(2**70)):
        done = evstore("snapshot", "--every", every, "--db", str(db))
        assert _error(done) == (2, "evstore.usage") and "--every" in done.stderr, done.stderr
    largest = evstore("snapshot", "--every", str(2**63 - 1), "--db", str(db), "--json")
    assert largest.returncode == 0, largest.stderr
    assert json.loads(largest.stdout)["snapshot_positions"] == []


def test_an_out_of_range_position_is_a_usage_error_whichever_option_gives_it(tmp_path: Path) -> None:
    """Regression (stop 29's note): ``state --at -1`` exited 1 (``evstore.invalid_input``, "must be
    a position ... got '-1'") where ``tail --after -1`` exits 2: one out-of-range number, two exit
    statuses. So did a position past 2**63-1 (``state --at``, a diff bound: "must be an integer
    position from 0 to 2**63-1", 1; ``tail --after``: "beyond the head", 1) and a ``rebuild
    --batch-size`` past it. Every position or count out of its range is a usage error (exit 2),
    and is found before the store is opened, as click finds ``--after -1``; a position the log has
    not reached yet is still an error evstore finds in the store (1), everywhere alike."""
    db = demo_db(tmp_path / "s.db", instances=5, nodes=2)
    missing = tmp_path / "missing.db"
    huge = str(2**63)
    for command in (
        ["state", "--at", "-1"],
        ["state", "--at", " -7 "],
        ["state", "--at", huge],
        ["state", "--at", "-1", "--consumer", new_uuid()],
        ["diff", "--", "-1", "3"],
        ["diff", "0", huge],
        ["diff", huge, "2026-01-02T03:04:05Z"],
        ["tail", "--after", "-1", "--no-follow"],
        ["tail", "--after", huge, "--no-follow"],
        ["rebuild", "--batch-size", huge],
    ):
        for store in (str(db), str(missing)):  # (a usage error whatever the store is)
            if command[:2] == ["diff", "--"]:
                done = evstore("diff", "--db", store, *command[1:])
            else:
                done = evstore(*command, "--db", store)
            assert _error(done) == (2, "evstore.usage"), (command, store, done.stderr)
    assert not missing.exists()
    head = json.loads(evstore("stats", "--db", str(db), "--json").stdout)["head"]
    beyond = str(head + 1)
    for command in (
        ["state", "--at", beyond],
        ["diff", "0", beyond],
        ["tail", "--after", beyond, "--no-follow"],
    ):
        done = evstore(*command, "--db", str(db))
        assert _error(done) == (1, "evstore.invalid_input"), (command, done.stderr)
        assert "beyond the head" in done.stderr, done.stderr
    largest = str(2**63 - 1)  # (in range, and beyond the head: 1, as any position past it)
    for command in (["state", "--at", largest], ["tail", "--after", largest, "--no-follow"]):
        done = evstore(*command, "--db", str(db))
        assert _error(done) == (1, "evstore.invalid_input"), (command, done.stderr)
    for at in ("+3", "3"):  # (a sign is a number's, as click reads --after +3)
        done = evstore("state", "--at", at, "--db", str(db), "--json")
        assert done.returncode == 0 and json.loads(done.stdout)["position"] == 3, done.stderr


async def test_a_consumer_no_event_names_is_not_found_by_state_as_by_history(store_url: str) -> None:
    """Regression: ``state --consumer <uuid no event names>`` printed "absent" and exited 0 where
    ``history <uuid>`` and ``state --provider <uuid>`` exit 1 (a mistyped uuid is an error a script
    must see). A consumer the log names but that holds nothing at that point - not yet created,
    released - is still "absent", exit 0."""
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        before = await store.head()
        consumer = new_uuid()
        await allocate(store, consumer, {rp: {"VCPU": 1}})
        await store.release(consumer)
    stranger = new_uuid()
    for extra in ((), ("--json",), ("--at", str(before))):
        for who in (stranger, stranger.upper()):
            done = evstore("state", "--consumer", who, "--url", store_url, *extra)
            assert _error(done) == (1, "evstore.not_found"), extra
            assert f"no event in this log touches consumer {stranger}" in done.stderr
        if "--at" not in extra:
            history = evstore("history", stranger, "--url", store_url, *extra)
            assert _error(history) == (1, "evstore.not_found")
    for extra in ((), ("--at", str(before))):  # (released now; not yet created then)
        absent = evstore("state", "--consumer", consumer, "--url", store_url, *extra)
        assert absent.returncode == 0, absent.stderr
        assert absent.stdout.splitlines()[0].endswith(": absent"), absent.stdout


def test_an_option_given_twice_takes_its_last_value(tmp_path: Path) -> None:
    """Decided (session 36, helper C), not a usage error: an option given twice counts once, the
    last time, as click - the CLI's framework - and most command lines (git, psql, kubectl) take
    it, so that a wrapper's defaults can be overridden after them (``alias et='evstore tail
    --no-follow'``, then ``et --follow``). It is no conflict in the README's sense (``--db`` with
    ``--url``, ``--provider`` with ``--consumer``: two things asked at once); a store URL's ``?k=v``
    given twice is refused, since a URL has no order of precedence to read it by."""
    db = demo_db(tmp_path / "s.db", instances=5, nodes=2)
    stats = evstore("stats", "--db", str(tmp_path / "missing.db"), "--db", str(db), "--json")
    assert stats.returncode == 0 and json.loads(stats.stdout)["url"].endswith("/s.db"), stats.stderr
    state = evstore("state", "--at", "3", "--at", "5", "--db", str(db), "--json")
    assert state.returncode == 0 and json.loads(state.stdout)["position"] == 5, state.stderr
    tail = evstore("tail", "--follow", "--after", "0", "--no-follow", "--db", str(db), "--json", timeout=60)
    assert tail.returncode == 0 and len(tail.stdout.splitlines()) == json.loads(stats.stdout)["head"]
    missing = evstore("stats", "--db", str(db), "--db", str(tmp_path / "missing.db"))
    assert _error(missing) == (1, "evstore.not_found"), missing.stderr


def test_h_is_the_help_as_help_is() -> None:
    """Regression: ``evstore -h`` and ``evstore audit -h`` were usage errors (exit 2, "No such
    option: -h"); most command lines answer ``-h`` with their help, and no evstore option uses it."""
    for args in (["-h"], ["audit", "-h"], ["diff", "-h"]):
        short, long = evstore(*args), evstore(*args[:-1], "--help")
        assert short.returncode == 0, short.stderr
        assert short.stdout == long.stdout and short.stdout.startswith("Usage: "), short.stdout


def _every_json_names_its_store(
    store: str, empty: str, shown_store: str, shown_empty: str, tmp: Path
) -> None:
    """Each command's ``--json`` run on ``store`` (a demo's) and, for demo and import, ``empty``:
    a ``url`` key first, the store as :func:`evstore.errors.redact_url` shows it."""
    dump = tmp / "dump.jsonl"
    assert evstore("export", "--url", store, "-o", str(dump)).returncode == 0
    consumer = json.loads(dump.read_text().splitlines()[-1])["data"]
    consumer = json.loads(consumer).get("consumer") or json.loads(consumer).get("instance")
    provider = json.loads(json.loads(dump.read_text().splitlines()[1])["data"])["provider"]
    runs = {
        "audit": ["audit"],
        "stats": ["stats"],
        "upgrade": ["upgrade"],
        "export": ["export", "-o", str(tmp / "again.jsonl")],
        "state": ["state"],
        "state --at": ["state", "--at", "3"],
        "state --consumer": ["state", "--consumer", consumer],
        "state --provider": ["state", "--provider", provider],
        "diff": ["diff", "0", "5"],
        "history": ["history", provider],
        "rebuild": ["rebuild"],
        "snapshot": ["snapshot", "--every", "50"],
    }
    for name, args in runs.items():
        done = evstore(*args, "--url", store, "--json")
        assert done.returncode == 0, (name, done.stderr)
        assert "hunter2" not in done.stdout + done.stderr, name
        answer = json.loads(done.stdout)
        assert list(answer)[:1] == ["url"] and answer["url"] == shown_store, name
    done = evstore("import", str(dump), "--url", empty, "--json")
    assert done.returncode == 0, done.stderr
    assert list(json.loads(done.stdout))[:1] == ["url"] and json.loads(done.stdout)["url"] == shown_empty
    assert "hunter2" not in done.stdout + done.stderr


def test_every_json_output_names_its_store_sqlite(tmp_path: Path) -> None:
    """Regression (stop 37): the --json of import, rebuild, snapshot, history, state and diff had no
    ``url`` key, where audit, stats, upgrade, export and demo's name the store (a script that
    collects several stores' outputs could not tell them apart)."""
    db = demo_db(tmp_path / "s.db", instances=10, nodes=2)
    empty = tmp_path / "empty.db"
    _every_json_names_its_store(
        f"sqlite:///{db}", f"sqlite:///{empty}", f"sqlite:///{db}", f"sqlite:///{empty}", tmp_path
    )


def test_every_json_output_names_its_store_postgres_password_hidden(tmp_path: Path) -> None:
    from evstore.errors import redact_url
    from tests.pg import fresh_database_url  # skips without a configured server

    def with_password(url: str) -> str:  # (the test server trusts any password)
        scheme, rest = url.split("://", 1)
        return f"{scheme}://{rest.replace('@', ':hunter2@', 1)}"

    store, empty = with_password(fresh_database_url()), with_password(fresh_database_url())
    assert "hunter2" in store and "hunter2" not in redact_url(store)
    done = evstore("demo", "--url", store, "--instances", "10", "--nodes", "2", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["url"] == redact_url(store) and "hunter2" not in done.stdout
    _every_json_names_its_store(store, empty, redact_url(store), redact_url(empty), tmp_path)
