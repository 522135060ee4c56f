"""`evstore demo` and `evstore audit`, run as a user would, on real database files."""

from __future__ import annotations

import json
import shlex
import sqlite3
import subprocess
import sys
from pathlib import Path

from tests.test_cli_support import demo_db, evstore


def test_demo_prints_usage_summary_and_a_clean_audit(tmp_path: Path) -> None:
    db = tmp_path / "demo.db"
    first = evstore("demo", "--db", str(db), "--seed", "5", "--instances", "20", "--nodes", "4")
    assert first.returncode == 0, first.stderr
    # a previous demo's database is replaced, and the demo says so
    done = evstore("demo", "--db", str(db), "--seed", "5", "--instances", "50", "--nodes", "4")
    assert done.returncode == 0, done.stderr
    assert "removed existing demo.db" in done.stderr
    assert "compute-01" in done.stdout and "VCPU" in done.stdout
    assert "instances built" in done.stdout
    assert "race won by the delete" in done.stdout
    assert "evstore.consumer.deleted" in done.stdout
    assert "clean" in done.stdout
    assert "Traceback" not in done.stderr


def test_demo_refuses_to_replace_a_file_it_did_not_write(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a database")
    store = demo_db(tmp_path / "cloud.db", instances=10)
    with sqlite3.connect(store) as conn:  # one event the demo did not write: another store now
        conn.execute('UPDATE events SET metadata = \'{"actor":"nova"}\' WHERE position = 1')
    before = store.read_bytes()
    empty = tmp_path / "empty.db"  # an evstore store without events: it may be anyone's
    with sqlite3.connect(empty) as conn:
        conn.execute("CREATE TABLE events (position INTEGER PRIMARY KEY, metadata TEXT)")
        conn.execute("CREATE TABLE precious (x)")
    for path in (text, store, empty):
        for how in (("--db", str(path)), ("--url", f"sqlite:///{path}")):
            done = evstore("demo", *how, "--instances", "10")
            assert done.returncode == 1
            assert "evstore.invalid_input" in done.stderr and "not a database the demo wrote" in done.stderr
            assert "Traceback" not in done.stderr
    assert text.read_text() == "not a database"
    assert store.read_bytes() == before
    with sqlite3.connect(empty) as conn:
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE name = 'precious'").fetchone() == (1,)


def test_a_database_the_demo_wrote_is_replaced_however_it_is_named(tmp_path: Path) -> None:
    """Regression (helper-31): the help says a database a previous demo wrote is replaced; with
    --url sqlite:///... or EVSTORE_URL naming it, the demo refused it ('already has events')."""
    db = demo_db(tmp_path / "cloud.db", instances=10)
    url = f"sqlite:///{db}"
    for done in (
        evstore("demo", "--url", url, "--instances", "10", "--json"),
        evstore("demo", "--instances", "10", "--json", env={"EVSTORE_URL": url}),
    ):
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["audit"]["clean"]


def test_version_and_a_bare_command(tmp_path: Path) -> None:
    """Regression (helper-31): `evstore --version` was a usage error, and a bare `evstore` printed
    the whole help as one 'error: evstore.usage: Usage: ...' message."""
    version = evstore("--version")
    assert version.returncode == 0 and version.stdout.startswith("evstore "), version.stderr
    bare = evstore()
    assert bare.returncode == 2
    assert bare.stderr.startswith("Usage: evstore") and "error:" not in bare.stderr


def test_read_only_commands_never_turn_a_file_into_a_store(tmp_path: Path) -> None:
    blank = tmp_path / "blank.db"
    blank.write_bytes(b"")
    foreign = tmp_path / "app.db"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY)")
    for path in (blank, foreign):
        before = path.read_bytes()
        for command in ("audit", "stats", "rebuild"):
            done = evstore(command, "--db", str(path))
            assert done.returncode == 1, (command, done.stdout, done.stderr)
            assert "evstore.not_found" in done.stderr and "no evstore tables" in done.stderr
        assert path.read_bytes() == before


def test_demo_json_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    runs = []
    for name in ("a.db", "b.db"):
        done = evstore("demo", "--db", str(tmp_path / name), "--seed", "9", "--instances", "40", "--json")
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout))
    a, b = runs
    assert a["audit"]["clean"] is True
    for key in ("head", "counts", "rejected", "usage", "deleted_mid_migration", "rejected_reverts"):
        assert a[key] == b[key], key
    assert a["counts"]["deletes"] >= len(a["deleted_mid_migration"]) > 0


def test_audit_exit_codes_clean_findings_error(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "cloud.db", instances=30)
    clean = evstore("audit", "--db", str(db), "--json")
    assert clean.returncode == 0, clean.stderr
    report = json.loads(clean.stdout)
    assert report["clean"] is True and report["head"] > 0
    assert report["url"] == f"sqlite:///{db.absolute()}"  # (as stats and demo name the store)

    # EVSTORE_URL works in place of --db
    via_env = evstore("audit", env={"EVSTORE_URL": f"sqlite:///{db}"})
    assert via_env.returncode == 0 and "clean" in via_env.stdout

    with sqlite3.connect(db) as conn:  # silently corrupt the persisted projection
        conn.execute("UPDATE p_providers SET usages = '{\"VCPU\": 9999}' WHERE name = 'compute-01'")
    dirty = evstore("audit", "--db", str(db), "--json")
    assert dirty.returncode == 3, dirty.stderr
    found = json.loads(dirty.stdout)
    assert found["clean"] is False
    assert any(
        f["kind"] == "drift" and f["details"].get("resource_class") == "VCPU" for f in found["findings"]
    )
    human = evstore("audit", "--db", str(db))
    assert human.returncode == 3 and "drift" in human.stdout

    missing = evstore("audit", "--db", str(tmp_path / "nope.db"))
    assert missing.returncode == 1
    assert missing.stderr.startswith("error: evstore.not_found: ")
    assert len(missing.stderr.strip().splitlines()) == 1


def test_errors_are_one_line_with_a_code(tmp_path: Path) -> None:
    nothing = evstore("audit")  # a usage error: exit 2, as the README says
    assert nothing.returncode == 2
    assert nothing.stderr.strip() == (
        "error: evstore.usage: no store given: use --db PATH, --url URL or set EVSTORE_URL"
    )
    both = evstore("audit", "--db", str(tmp_path / "a.db"), "--url", "sqlite:///b.db")
    assert both.returncode == 2
    assert both.stderr.strip() == "error: evstore.usage: give either --db or --url, not both"
    # conflicting options of one command: a usage error too (helper-28: it exited 1)
    rp = "5b9a2ad6-67b7-4cb7-989b-ec8a1e41b594"
    two = evstore("state", "--provider", rp, "--consumer", rp, "--db", str(tmp_path / "a.db"))
    assert two.returncode == 2
    assert two.stderr.strip() == "error: evstore.usage: give --provider or --consumer, not both"
    # a store whose schema version row was deleted: damaged, not "no evstore tables" (helper-28)
    damaged = demo_db(tmp_path / "damaged.db", instances=10, nodes=2)
    with sqlite3.connect(damaged) as conn:
        conn.execute("DELETE FROM meta WHERE key = 'schema_version'")
    conn.close()
    lost = evstore("audit", "--db", str(damaged))
    assert lost.returncode == 1 and lost.stderr.startswith("error: evstore.schema.version: "), lost.stderr
    assert "no schema version" in lost.stderr
    bad_url = evstore("audit", "--url", "mysql://x")
    assert bad_url.returncode == 1 and bad_url.stderr.startswith("error: evstore.invalid_input: ")
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"this is not sqlite" * 100)
    broken = evstore("audit", "--db", str(junk))
    assert broken.returncode == 1 and broken.stderr.startswith("error: evstore.storage: ")
    assert "Traceback" not in broken.stderr
    usage = evstore("audit", "--bogus")
    assert usage.returncode == 2 and usage.stderr.startswith("error: evstore.usage: ")


def test_demo_audit_and_debugging_commands_on_postgres(tmp_path: Path) -> None:
    from tests.pg import fresh_database_url  # skips without a configured server

    url = fresh_database_url()
    done = evstore("demo", "--url", url, "--instances", "30", "--nodes", "3", "--json")
    assert done.returncode == 0, done.stderr
    demo = json.loads(done.stdout)
    assert demo["audit"]["clean"] is True
    env = {"EVSTORE_URL": url}
    assert evstore("audit", env=env).returncode == 0
    stats = json.loads(evstore("stats", "--json", env=env).stdout)
    assert stats["head"] == demo["head"]
    # the test server trusts any password: one in the URL must be printed by no command
    # (regression, helper-28: stats, the demo's "Try:" line and its "needs an empty store")
    secret = "://" + url.split("://", 1)[1].replace("@", ":hunter2@", 1)
    secret_url = url.split("://", 1)[0] + secret
    assert evstore("stats", "--url", secret_url).stdout.count("***") == 1
    again = evstore("demo", "--url", secret_url)  # never wipes a server store: it must be empty
    assert again.returncode == 1 and "needs an empty store" in again.stderr
    for done in (again, evstore("stats", "--url", secret_url), evstore("audit", "--url", secret_url)):
        assert "hunter2" not in done.stdout + done.stderr
    # a PostgreSQL log exported and imported into SQLite keeps its hashes: the audit is clean
    dump = tmp_path / "pg.jsonl"
    assert evstore("export", "-o", str(dump), env=env).returncode == 0
    imported = evstore("import", str(dump), "--db", str(tmp_path / "copy.db"))
    assert imported.returncode == 0, imported.stderr
    assert evstore("export", "--db", str(tmp_path / "copy.db")).stdout == dump.read_text()


def test_the_readmes_walkthrough_holds_on_every_run(tmp_path: Path) -> None:
    """Regression: the demo's 200 instances ran as a free-for-all of tasks, so which commands
    shared a group commit - and the order of the log - depended on timing: the README's positions
    held in 4 of 10 runs. The demo runs in rounds now. This runs the README's "Debugging a leak"
    on the default demo, twice, and its legacy-log snippet, taken from the README itself."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    migration, instance = "5b9a2ad6-67b7-4cb7-989b-ec8a1e41b594", "bf68ade6-6d47-45e5-8ecd-9f44777982e2"
    for name in ("a.db", "b.db"):
        db = str(tmp_path / name)
        assert evstore("demo", "--db", db).returncode == 0
        history = evstore("history", migration, "--db", db, "--json")
        events = [(e["position"], e["type"]) for e in json.loads(history.stdout)["events"]]
        assert events == [(216, "MigrationStarted"), (432, "ConsumerDeleted")]
        assert "#  432  ConsumerDeleted" in readme
    held = json.loads(evstore("state", "--at", "431", "--consumer", migration, "--db", db, "--json").stdout)
    gone = json.loads(evstore("state", "--at", "432", "--consumer", migration, "--db", db, "--json").stdout)
    assert held["on_behalf_of"] == instance and held["allocations"] and not gone["allocations"]
    # the legacy log: the README's snippet, run where the export is
    export = evstore("export", "--db", db)
    (tmp_path / "demo.jsonl").write_text(export.stdout)
    snippet = readme.split("```python\n")[2].split("```")[0]
    assert "MigrationReverted(" in snippet
    done = subprocess.run(
        [sys.executable, "-c", snippet], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    legacy = str(tmp_path / "legacy.db")
    assert evstore("import", str(tmp_path / "legacy.jsonl"), "--db", legacy).returncode == 3
    audit = json.loads(evstore("audit", "--db", legacy, "--json").stdout)
    [leak] = audit["findings"]
    assert leak["kind"] == "leak" and leak["positions"] == [432, 567]
    assert "#  leak │ 432, 567 │" in readme
    state = evstore("state", "--consumer", instance, "--db", legacy)
    status = "deleted (tombstone), yet holds allocations: a leak"
    assert state.stdout.splitlines()[0].endswith(f": {status}") and f"   # {status}" in readme
    # how to clear it, as the README says the messages say it: and that clears it
    clear = f"clear it with `evstore release {instance}` (store.release('{instance}'))"
    assert leak["message"].endswith(f"; {clear}") and "clear it with\n#" in readme
    assert "#                     `evstore release bf68ade6-…` (store.release('bf68ade6-…'))" in readme
    told = json.loads(evstore("history", instance, "--db", legacy, "--json").stdout)["events"]
    [culprit] = [e for e in told if e["position"] == 567]
    assert culprit["summary"].endswith(f"given to a consumer deleted at position 432: a leak; {clear}")
    assert "given to a consumer deleted at position 432: a leak; clear it with `evstore release " in readme
    assert "`evstore release CONSUMER` (`store.release(consumer)`)\nfor a deleted consumer's" in readme
    # the README's command clears it, saying what it says there; run again, nothing to release
    released = evstore("release", instance, "--db", legacy)
    assert released.returncode == 0 and not released.stderr, released.stderr
    said = released.stdout.strip()
    assert said == (
        f"consumer {instance}: released compute-02: DISK_GB=80 MEMORY_MB=8192 VCPU=4 at position 568; "
        "the leak is cleared"
    )
    assert f"evstore release {instance} --db legacy.db\n# {said.replace(instance, 'bf68ade6-…')}\n" in readme
    assert evstore("audit", "--db", legacy).returncode == 0
    again = evstore("release", instance, "--db", legacy)
    assert again.returncode == 0 and "nothing to release (deleted at position 432)" in again.stdout


def test_audit_history_checks_the_history_index(tmp_path: Path) -> None:
    db = demo_db(tmp_path / "demo.db", instances=20)
    done = evstore("audit", "--history", "--json", "--db", str(db))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["clean"] is True
    conn = sqlite3.connect(db)
    with conn:
        conn.execute("DELETE FROM event_entities WHERE position = 5")
    conn.close()
    assert evstore("audit", "--db", str(db)).returncode == 0  # (not checked by default)
    done = evstore("audit", "--history", "--json", "--db", str(db))
    assert done.returncode == 3, done.stderr
    [finding] = json.loads(done.stdout)["findings"]
    assert finding["kind"] == "integrity" and finding["details"]["reason"] == "history_index"
    assert finding["positions"] == [5]


def test_the_demos_try_line_is_one_command_that_runs_as_printed(tmp_path: Path) -> None:
    """Regression (review 25, helper-e): the demo's closing "Try: evstore history ..." pasted the
    --db path unquoted (a directory with a space split it into two arguments) and let rich wrap
    the line at the terminal's width (``--url '...'`` went to a line of its own), so the command
    it suggested did not run as printed."""
    folder = tmp_path / "my clouds"
    folder.mkdir()
    db = folder / "it's.db"
    narrow = {"COLUMNS": "80"}
    for how in (["--db", str(db)], ["--url", f"sqlite:///{db}"]):
        done = evstore("demo", *how, "--instances", "20", "--nodes", "3", env=narrow)
        assert done.returncode == 0, done.stderr
        [hint] = [line for line in done.stdout.splitlines() if line.startswith("Try: ")]
        argv = shlex.split(hint.removeprefix("Try: "))
        assert argv[:2] == ["evstore", "history"] and argv[-1] in (str(db), f"sqlite:///{db}"), hint
        tried = evstore(*argv[1:], "--json")
        assert tried.returncode == 0, tried.stderr
        assert json.loads(tried.stdout)["events"]


async def test_demo_does_not_remove_a_database_another_process_has_open(tmp_path: Path) -> None:
    """Regression (helper-75): `evstore demo` unlinked a previous demo's database, -wal and -shm
    while other processes had it open: their later commands, acknowledged, went to the unlinked
    file and were lost (two demos started 1.5 s apart both reported a clean audit; only the
    second's log was left), and SQLite's own guide lists deleting a live -wal as corruption.
    An open store holds a shared lock on the file: the demo now refuses while anyone does."""
    from evstore import open_store
    from tests.conftest import make_provider

    db = demo_db(tmp_path / "cloud.db", instances=10)
    async with open_store(f"sqlite:///{db}") as store:  # (another process, as the demo sees it)
        head = await store.head()
        for how in (("--db", str(db)), ("--url", f"sqlite:///{db}")):
            done = evstore("demo", *how, "--instances", "10")
            assert done.returncode == 1, done.stdout
            assert done.stderr.startswith("error: evstore.storage: "), done.stderr
            assert "open in another process" in done.stderr
        await make_provider(store, VCPU=1)  # (acknowledged: it must be in the file)
        assert await store.head() == head + 2
    async with open_store(f"sqlite:///{db}") as store:
        assert await store.head() == head + 2
    done = evstore("demo", "--db", str(db), "--instances", "10")  # (once it is closed: replaced)
    assert done.returncode == 1 and "not a database the demo wrote" in done.stderr  # (it is not, now)
