"""A replay-debugging session, as a person would run it: which event released this allocation?"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore


def _json(*args: str) -> Any:
    done = evstore(*args, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_find_the_event_that_released_a_migrations_allocation(tmp_path: Path) -> None:
    db = str(tmp_path / "cloud.db")
    demo = _json("demo", "--db", db, "--seed", "21", "--instances", "60", "--nodes", "4")
    assert demo["rejected_reverts"], "the seed must produce a revert that lost its race"
    instance, migration = demo["rejected_reverts"][0]

    # 1. the migration's story: started, then something released it
    story = _json("history", migration, "--db", db)["events"]
    assert next(e["type"] for e in story) == "MigrationStarted"
    released_by = story[-1]
    assert released_by["type"] == "ConsumerDeleted"
    assert released_by["data"]["consumer"] == instance
    p = released_by["position"]
    assert migration in released_by["data"]["migrations_released"]
    assert "its migration" in released_by["summary"]

    # 2. just before that event the migration held resources on the instance's behalf; at it, nothing
    before = _json("state", "--at", str(p - 1), "--consumer", migration, "--db", db)
    assert before["allocations"] and before["on_behalf_of"] == instance
    after = _json("state", "--at", str(p), "--consumer", migration, "--db", db)
    assert after["allocations"] == {} and after["position"] == p
    inst_after = _json("state", "--at", str(p), "--consumer", instance, "--db", db)
    assert inst_after["deleted"] is True and inst_after["deleted_at"] == p

    # 3. the diff over that one event says the same, and names the event
    change = _json("diff", str(p - 1), str(p), "--db", db)
    by_consumer = {c["consumer"]: c for c in change["consumers"]}
    assert by_consumer[migration]["change"] == "released"
    assert by_consumer[migration]["positions"] == [p]
    assert by_consumer[instance]["change"] == "deleted"
    assert change["usage"] and all(u["delta"] < 0 and u["positions"] == [p] for u in change["usage"])

    # 4. time travel by the event's recorded time lands on (at least) that event
    at_time = _json("state", "--at", released_by["recorded_at"], "--consumer", instance, "--db", db)
    assert at_time["deleted"] is True and at_time["position"] >= p

    # 5. the human forms of the same commands
    human = evstore("history", instance, "--db", db)
    assert human.returncode == 0 and "ConsumerDeleted" in human.stdout and "tombstone" in human.stdout
    # the time the table shows leads back to the event (it showed whole seconds: state --at that
    # time answered a position before it, 0 in a demo that ran within one second)
    [shown] = [line for line in human.stdout.splitlines() if "ConsumerDeleted" in line]
    stamp = next(word for word in shown.split() if word.startswith(released_by["recorded_at"][:10]))
    assert datetime.fromisoformat(stamp) == datetime.fromisoformat(released_by["recorded_at"])
    assert _json("state", "--at", stamp, "--db", db)["position"] >= p
    human_diff = evstore("diff", str(p - 1), str(p), "--db", db)
    assert human_diff.returncode == 0 and "released" in human_diff.stdout and migration in human_diff.stdout
    human_state = evstore("state", "--at", str(p - 1), "--consumer", migration, "--db", db)
    assert human_state.returncode == 0 and "holds allocations" in human_state.stdout


async def _whole_state_of(db: str, position: int, provider: str) -> dict[str, Any]:
    async with open_store(f"sqlite:///{db}") as store:
        view = await store.state_at(position=position)
        usage = await view.usage(provider)
        return {
            "usages": dict(usage.usages),
            "generation": usage.generation,
            "allocations": await view.provider_allocations(provider),
        }


def test_state_views_and_bad_points(tmp_path: Path) -> None:
    db = str(tmp_path / "c.db")
    demo = _json("demo", "--db", db, "--instances", "20", "--nodes", "3")
    head = demo["head"]
    now = _json("state", "--db", db)
    assert now["position"] == head and len(now["providers"]) == 3
    assert now["providers"] == demo["usage"]
    assert _json("state", "--at", str(head), "--db", db)["providers"] == demo["usage"]
    early = _json("state", "--at", "4", "--db", db)
    assert early["position"] == 4 and early["consumers_holding_allocations"] == 0
    rp = demo["usage"][0]["provider"]
    one = _json("state", "--provider", rp, "--db", db)
    assert one["provider"]["provider"] == rp and isinstance(one["allocations"], dict)
    # --at folds only the provider's slice: the same answer as the live projection and the whole fold
    at_head = _json("state", "--at", str(head), "--provider", rp, "--db", db)
    assert (at_head["provider"], at_head["allocations"]) == (one["provider"], one["allocations"])
    for position in (head // 3, head // 2, head - 1):
        sliced = _json("state", "--at", str(position), "--provider", rp, "--db", db)
        whole = asyncio.run(_whole_state_of(db, position, rp))
        assert {rc: u["used"] for rc, u in sliced["provider"]["usages"].items()} == whole["usages"], position
        assert sliced["provider"]["generation"] == whole["generation"], position
        assert sliced["allocations"] == whole["allocations"], position

    beyond = evstore("state", "--at", str(head + 1), "--db", db)
    assert beyond.returncode == 1 and beyond.stderr.startswith("error: evstore.invalid_input: ")
    naive = evstore("state", "--at", "2026-01-01T00:00:00", "--db", db)
    assert naive.returncode == 1 and "no time zone" in naive.stderr
    garbage = evstore("diff", "yesterday", "5", "--db", db)
    assert garbage.returncode == 1 and garbage.stderr.startswith("error: evstore.invalid_input: A must be")
    backwards = evstore("diff", "9", "5", "--db", db)  # (conflicting arguments: see test_cli_probe_33)
    assert backwards.returncode == 2 and "give the earlier point first" in backwards.stderr
    unknown = evstore("history", "not-a-uuid", "--db", db)
    assert unknown.returncode == 1 and unknown.stderr.startswith("error: evstore.invalid_input: ")
    superscript = evstore("state", "--at", "\u00b2", "--db", db)  # str.isdigit() says yes; int() says no
    assert superscript.returncode == 1
    assert superscript.stderr.startswith("error: evstore.invalid_input: --at must be a position")
    stranger = "0b59e5ad-6c6a-4bde-9dbb-5b4a1d9a04a4"
    for extra in ((), ("--json",)):  # the same exit code with or without --json
        nothing = evstore("history", stranger, "--db", db, *extra)
        assert nothing.returncode == 1, extra
        assert nothing.stderr.startswith("error: evstore.not_found: no event in this log touches")


def test_diff_lists_the_providers_created_and_deleted(tmp_path: Path) -> None:
    db = str(tmp_path / "cloud.db")
    demo = _json("demo", "--db", db, "--instances", "4", "--nodes", "2")
    # demo --json gives every count the table shows, those that stayed 0 too (it left them out)
    shown = {"builds", "migrations_no_valid_host", "races_delete_won", "races_revert_won"}
    assert shown <= set(demo["counts"])
    assert 0 in demo["counts"].values()
    both = _json("diff", "0", "4", "--db", db)
    assert len(both["providers_created"]) == 2
    human = evstore("diff", "0", "4", "--db", db)
    assert human.returncode == 0, human.stderr
    line = next(x for x in human.stdout.splitlines() if x.startswith("providers created"))
    assert line.startswith("providers created (2): ")
    for uuid in both["providers_created"]:
        assert uuid in human.stdout.replace("\n", "")


def test_diff_names_providers_as_they_were_not_as_they_are_today(tmp_path: Path) -> None:
    # The consumers table and the providers created/deleted used today's names: a provider
    # deleted since showed as a bare uuid (or an 8-character stub in a consumer's allocations),
    # and a renamed one under a name the usage table of the same diff did not use.
    db = tmp_path / "c.db"
    host, child, server = (
        "5b1e4c1e-0c5f-4c55-8a38-3f0d2b0d4e11",
        "7c3a2b1d-4e5f-4a6b-8c7d-9e0f1a2b3c4d",
        "9d2f1a3b-7a4e-4f0e-9a55-0c3e2b1d6f22",
    )

    async def seed() -> tuple[int, int]:
        async with open_store(f"sqlite:///{db}") as store:
            await store.create_provider(host, "compute-1")
            await store.set_inventories(host, {"VCPU": {"total": 8}}, generation=0)
            await store.create_provider(child, "compute-1-numa0", parent=host)
            await store.set_inventories(child, {"VCPU": {"total": 8}}, generation=0)
            await store.set_allocations(
                server, {child: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                generation=None,
            )  # fmt: skip
            start = await store.head()
            await store.delete_consumer(server)
            await store.delete_provider(child)
            end = await store.head()
            await store.rename_provider(host, "compute-1-renamed")  # (after the span asked about)
            await store.set_allocations(
                server.replace("9d", "8d", 1), {host: {"VCPU": 1}}, project_id="p", user_id="u",
                consumer_type="INSTANCE", generation=None,
            )  # fmt: skip
            return start, end

    start, end = asyncio.run(seed())
    human = evstore("diff", str(start), str(end), "--db", str(db))
    assert human.returncode == 0, human.stderr
    text = human.stdout.replace("\n", "")
    assert f"providers deleted (1): compute-1-numa0 ({child})" in text
    [row] = [line for line in human.stdout.splitlines() if server in line]
    assert "compute-1-numa0: VCPU=2" in row, row
    change = _json("diff", str(start), str(end), "--db", str(db))
    assert change["providers_deleted"] == [child]
    assert change["provider_names"] == {child: "compute-1-numa0"}
    renamed = _json("diff", "0", str(end), "--db", str(db))
    assert renamed["provider_names"][host] == "compute-1"  # (its name then; renamed later)


def test_history_names_a_provider_as_it_was_called_at_each_event(tmp_path: Path) -> None:
    # history named every provider by today's name: "provider cn-040 created", then on the next
    # line "inventory of renamed-393-bfdd", a name given 130,000 events later; a rename did not
    # say what it renamed from, and a deleted provider's own events named it by uuid only.
    db = tmp_path / "c.db"
    host, gone = "5b1e4c1e-0c5f-4c55-8a38-3f0d2b0d4e11", "7c3a2b1d-4e5f-4a6b-8c7d-9e0f1a2b3c4d"

    async def seed() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            await store.create_provider(host, "cn-040")
            await store.set_inventories(host, {"VCPU": {"total": 8}}, generation=0)
            await store.rename_provider(host, "cn-040-new")
            await store.set_inventories(host, {"VCPU": {"total": 16}}, generation=1)
            await store.create_provider(gone, "cn-old")
            await store.set_inventories(gone, {"VCPU": {"total": 8}}, generation=0)
            await store.delete_provider(gone)

    asyncio.run(seed())
    human = evstore("history", host, "--db", str(db))
    assert human.returncode == 0, human.stderr
    text = " ".join(human.stdout.replace("│", " ").split())
    assert "inventory of cn-040: VCPU=8" in text, text
    assert f"provider {host} renamed from cn-040 to cn-040-new" in text, text
    assert "inventory of cn-040-new: VCPU=16" in text, text
    summaries = [e["summary"] for e in _json("history", host, "--db", str(db))["events"]]
    assert summaries[1] == "inventory of cn-040: VCPU=8", summaries
    deleted = [e["summary"] for e in _json("history", gone, "--db", str(db))["events"]]
    assert deleted[1:] == ["inventory of cn-old: VCPU=8", "provider cn-old deleted"], deleted
    # tail does the same, starting from the names at the position it starts after
    tail = evstore("tail", "--db", str(db), "--after", "2", "--no-follow")
    assert tail.returncode == 0, tail.stderr
    assert f"provider {host} renamed from cn-040 to cn-040-new" in tail.stdout, tail.stdout


def test_rebuild_snapshot_and_stats(tmp_path: Path) -> None:
    db = tmp_path / "c.db"
    demo = _json("demo", "--db", str(db), "--instances", "30", "--nodes", "3")
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM p_allocations")
    assert evstore("audit", "--db", str(db)).returncode == 3
    rebuilt = evstore("rebuild", "--db", str(db), "--batch-size", "17")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert f"from {demo['head']} events" in rebuilt.stdout
    assert evstore("audit", "--db", str(db)).returncode == 0
    assert _json("state", "--db", str(db))["providers"] == demo["usage"]
    with sqlite3.connect(db) as conn:  # --full rewrites every row, even of a sound projection
        conn.execute("CREATE TABLE t_writes (n INTEGER)")
        conn.execute(
            "CREATE TRIGGER t_w AFTER INSERT ON p_consumers BEGIN INSERT INTO t_writes VALUES (1); END"
        )
    assert evstore("rebuild", "--db", str(db), "--full").returncode == 0
    with sqlite3.connect(db) as conn:
        assert (
            conn.execute("SELECT count(*) FROM t_writes").fetchone()[0]
            == conn.execute("SELECT count(*) FROM p_consumers").fetchone()[0]
            > 0
        )

    snap = _json("snapshot", "--every", "25", "--db", str(db))
    assert snap["snapshot_positions"] == list(range(25, demo["head"] + 1, 25))
    stats = _json("stats", "--db", str(db))
    assert stats["head"] == demo["head"]
    assert sum(stats["events_by_type"].values()) == demo["head"]
    assert stats["snapshot_positions"] == snap["snapshot_positions"]
    assert stats["db_bytes"] > 0
    human = evstore("stats", "--db", str(db))
    assert (
        human.returncode == 0
        and "MigrationStarted" in human.stdout
        and "snapshots at positions: 25" in human.stdout
    )


def test_state_of_a_consumer_before_the_first_event_says_so(tmp_path: Path) -> None:
    # position 0 has no time: the header said "(None)", a Python value, where the whole state
    # says "before the first event"
    db = tmp_path / "c.db"
    provider, consumer = "5b1e4c1e-0c5f-4c55-8a38-3f0d2b0d4e11", "9d2f1a3b-7a4e-4f0e-9a55-0c3e2b1d6f22"

    async def seed() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            await store.create_provider(provider, "compute-1")
            await store.delete_consumer(consumer)  # (a consumer the log names: absent at 0)

    asyncio.run(seed())
    at_zero = evstore("state", "--at", "0", "--consumer", consumer, "--db", str(db))
    assert at_zero.returncode == 0, at_zero.stderr
    first = at_zero.stdout.splitlines()[0]
    assert "None" not in first and "(before the first event)" in first, first


def test_history_shows_the_events_before_a_damaged_row(tmp_path: Path) -> None:
    """Regression (review 24, helper-53): `evstore history` of a consumer whose last event was
    damaged printed only the error, none of the events that led up to it (`tail` prints them)."""
    from tests.test_cli_support import demo_db

    db = demo_db(tmp_path / "s.db", seed=21, instances=20, nodes=2)
    demo = _json("stats", "--db", str(db))
    assert demo["head"] > 10
    with sqlite3.connect(db) as conn:
        consumer = conn.execute(
            "SELECT substr(entity, 10) FROM event_entities WHERE entity LIKE 'consumer:%' "
            "GROUP BY entity HAVING count(*) >= 3 ORDER BY entity LIMIT 1"
        ).fetchone()[0]
    story = [e["position"] for e in _json("history", consumer, "--db", str(db))["events"]]
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE events SET data = '{not json' WHERE position = ?", (story[-1],))
    done = evstore("history", consumer, "--db", str(db))
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.log.corrupt: "), done.stderr
    assert f"position {story[-1]}" in done.stderr
    rows = [
        line.split()[1]
        for line in done.stdout.splitlines()
        if line.startswith("│ ") and line.split()[1].isdigit()
    ]
    assert rows == [str(p) for p in story[:-1]], done.stdout
    as_json = evstore("history", consumer, "--db", str(db), "--json")  # (only the error: no half document)
    assert as_json.returncode == 1 and as_json.stdout == "", as_json.stdout


def test_history_does_not_keep_every_event_of_a_busy_provider(tmp_path: Path) -> None:
    """Regression (review 24, helper-60): `evstore history` kept every event it read (decoded,
    ~2.7 KB each) until the end, then built the whole JSON document in memory as well: the
    history of one provider of a 400k-event log (112k events) peaked at ~1.3 GB with --json.
    Now --json spools the encoded events to a temporary file and the table keeps only its cells,
    so no decoded event outlives its row. Checked structurally: the decoded events still alive
    when the store's history runs out (before: all of them; now at most the last batch read)."""
    import os
    import subprocess
    import sys
    import textwrap

    from tests.test_cli_support import REPO, demo_db

    db = demo_db(tmp_path / "s.db", seed=3, instances=60, nodes=2)
    with sqlite3.connect(db) as conn:
        provider, count = conn.execute(
            "SELECT substr(entity, 10), count(*) FROM event_entities WHERE entity LIKE 'provider:%' "
            "GROUP BY entity ORDER BY 2 DESC LIMIT 1"
        ).fetchone()
    assert count >= 100
    script = textwrap.dedent(
        """
        import gc, sys
        from evstore.events import RecordedEvent
        from evstore.store import AllocationStore
        plain = AllocationStore._history
        async def counted(self, key, batch_size):
            # (batches of 10: the last batch read may stay referenced by its future)
            async for recorded in plain(self, key, 10):
                yield recorded
            del recorded
            gc.collect()
            alive = sum(1 for o in gc.get_objects() if type(o) is RecordedEvent)
            print(f"ALIVE {alive}", file=sys.stderr)
        AllocationStore._history = counted
        from evstore.cli import main
        main(sys.argv[1:])
        """
    )
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, "-c", script, "history", provider, "--db", str(db), *extra],
            capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
            env={**{k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}, "COLUMNS": "250"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        alive = int(done.stderr.split("ALIVE ")[1].split()[0])
        assert alive <= 12, (extra, alive, count)
        if extra:
            events = json.loads(done.stdout)["events"]
            assert len(events) == count
            assert [e["position"] for e in events] == sorted(e["position"] for e in events)
        else:
            assert sum(1 for line in done.stdout.splitlines() if line.startswith("│ ")) >= count


def test_a_date_without_a_time_of_day_is_refused_as_such(tmp_path: Path) -> None:
    # '2099-01-01Z' was refused with "has no time zone: add Z or +00:00" - it has one: Python
    # reads a date with a zone as naive (and '2026-12-05+05:30' as 05:30), so the advice was wrong
    db = tmp_path / "c.db"

    async def seed() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            await store.create_provider("5b1e4c1e-0c5f-4c55-8a38-3f0d2b0d4e11", "compute-1")

    asyncio.run(seed())
    for text in ("2099-01-01Z", "2026-12-05+05:30", "2026-12-05"):
        done = evstore("state", "--at", text, "--db", str(db))
        assert done.returncode == 1, done.stdout
        assert done.stderr.startswith("error: evstore.invalid_input: "), done.stderr
        assert "is a date without a time of day" in done.stderr and "add Z" not in done.stderr, done.stderr
    naive = evstore("diff", "2026-12-05T04:05:27", "1", "--db", str(db))
    assert "has no time zone: add Z or +00:00" in naive.stderr, naive.stderr


def _table_row(text: str, label: str) -> str:
    """The value cell of the row ``label`` in a two-column table (``state --consumer``)."""
    row = next(line for line in text.splitlines() if line.startswith(f"│ {label} "))
    return row.split("│")[2].strip()


async def _a_migration_whose_instance_was_deleted(db: Path) -> dict[str, Any]:
    """An instance on node-a, migrated (mig holds node-a for it, the instance node-b), then
    deleted - which releases what mig holds - and node-a renamed afterwards."""
    async with open_store(f"sqlite:///{db}") as store:
        a = await make_provider(store, "node-a", VCPU=8)
        b = await make_provider(store, "node-b", VCPU=8)
        inst, mig = new_uuid(), new_uuid()
        await allocate(store, inst, {a: {"VCPU": 2}})
        allocated = await store.head()
        started = (await store.start_migration(inst, mig)).position
        await allocate(store, inst, {b: {"VCPU": 2}})
        deleted = (await store.delete_consumer(inst)).position
        await store.rename_provider(a, "node-a-renamed")
        return {"a": a, "b": b, "inst": inst, "mig": mig, "allocated": allocated,
                "started": started, "deleted": deleted}  # fmt: skip


def test_state_json_carries_what_its_table_shows(tmp_path: Path) -> None:
    """Regression: ``state --consumer --json`` lacked the "last allocation change at" the table
    shows (and the providers' names the table gives), ``state --provider --json`` the holders'
    types, and ``history --json`` the provider's name in the table's title."""
    db = tmp_path / "c.db"
    s = asyncio.run(_a_migration_whose_instance_was_deleted(db))
    a, inst, mig = s["a"], s["inst"], s["mig"]
    for position, consumer, changed in (
        (s["allocated"], inst, s["allocated"]),
        (s["started"], mig, s["started"]),
        (s["deleted"], mig, s["deleted"]),  # (released by the deletion: a change of allocations)
    ):
        at = ("--at", str(position), "--consumer", consumer, "--db", str(db))
        doc = _json("state", *at)
        table = evstore("state", *at)
        assert table.returncode == 0, table.stderr
        assert doc["allocated_at"] == changed == int(_table_row(table.stdout, "last allocation change at"))
        # the names the table gives the providers, as they were then (node-a was renamed since)
        expected_names = {a: "node-a"} if doc["allocations"] else {}
        assert doc["provider_names"] == expected_names, position
        assert ("node-a:" in _table_row(table.stdout, "allocations")) == bool(expected_names)
    holders = _json("state", "--at", str(s["started"]), "--provider", a, "--db", str(db))
    assert holders["allocations"] == {mig: {"VCPU": 2}}
    assert holders["consumer_types"] == {mig: "MIGRATION"}
    assert _json("history", a, "--db", str(db))["name"] == "node-a-renamed"
    assert _json("history", inst, "--db", str(db))["name"] is None  # (a consumer has no name)


def test_a_class_used_without_inventory_is_in_state_json_as_in_the_table(tmp_path: Path) -> None:
    """Regression: an imported log's inventory change that removed a class still in use (what
    ``decide`` refuses, an older writer did not) leaves a usage without inventory: ``state
    --json`` left it out, and the table had no column for it unless another provider had that
    class ("3/-" then)."""
    from tests.test_audit_findings import append_row, chained

    source, imported = tmp_path / "source.db", tmp_path / "imported.db"

    async def log() -> tuple[str, list[str]]:
        async with open_store(f"sqlite:///{source}") as store:
            node = await make_provider(store, "node", VCPU=8)
            await allocate(store, new_uuid(), {node: {"VCPU": 3}})
            lines = [line async for line in store.export()]
            [last] = await store.backend.read_raw(await store.head() - 1, 1)
        emptied = {"provider": node, "inventories": {}, "generation": 3}
        append_row(lines, chained(last, "InventoriesReplaced", emptied))
        return node, lines

    node, lines = asyncio.run(log())
    (tmp_path / "log.jsonl").write_text("\n".join(lines) + "\n")
    done = evstore("import", str(tmp_path / "log.jsonl"), "--db", str(imported))
    assert done.returncode in (0, 3), done.stderr
    head = _json("stats", "--db", str(imported))["head"]
    for at in ((), ("--at", str(head))):  # (the projection, and a fold)
        [shown] = _json("state", *at, "--db", str(imported))["providers"]
        assert shown["usages"] == {"VCPU": {"used": 3, "capacity": None}}, at
        table = evstore("state", *at, "--db", str(imported))
        assert table.returncode == 0, table.stderr
        assert "VCPU" in table.stdout and "3/-" in next(x for x in table.stdout.splitlines() if node in x)
    one = _json("state", "--provider", node, "--at", str(head), "--db", str(imported))
    assert one["provider"]["usages"] == shown["usages"]


def test_a_migration_released_by_its_instances_deletion_says_so(tmp_path: Path) -> None:
    """Regression: a migration consumer released when its instance was deleted keeps the link
    (SPEC: a late revert must learn that the instance is gone), and ``state --consumer`` showed
    it as "absent" with "on behalf of (migration of) <instance>", as if it still held something
    for it. The table now says it was released and holds nothing for it; the data is unchanged."""
    db = tmp_path / "c.db"
    s = asyncio.run(_a_migration_whose_instance_was_deleted(db))
    inst, mig = s["inst"], s["mig"]
    holding = evstore("state", "--at", str(s["started"]), "--consumer", mig, "--db", str(db))
    assert holding.returncode == 0, holding.stderr
    assert holding.stdout.splitlines()[0].endswith(": holds allocations")
    assert _table_row(holding.stdout, "on behalf of (migration of)") == inst
    released = evstore("state", "--at", str(s["deleted"]), "--consumer", mig, "--db", str(db))
    assert released.returncode == 0, released.stderr
    assert released.stdout.splitlines()[0].endswith(f": released (was on behalf of {inst})")
    assert _table_row(released.stdout, "was on behalf of (migration of)") == inst
    assert not any(line.startswith("│ on behalf of") for line in released.stdout.splitlines())
    doc = _json("state", "--at", str(s["deleted"]), "--consumer", mig, "--db", str(db))
    assert (doc["allocations"], doc["on_behalf_of"], doc["deleted"]) == ({}, inst, False)
    # a consumer that was no migration yet, holding nothing: still plainly absent
    never = evstore("state", "--at", str(s["allocated"]), "--consumer", mig, "--db", str(db))
    assert never.returncode == 0 and never.stdout.splitlines()[0].endswith(": absent"), never.stdout


class _CountedNames(dict[str, str]):
    """Today's names, counting every walk over them (a copy is one)."""

    walks = 0

    def __iter__(self) -> Any:
        type(self).walks += 1
        return super().__iter__()

    def keys(self) -> Any:
        type(self).walks += 1
        return super().keys()

    def items(self) -> Any:
        type(self).walks += 1
        return super().items()


async def test_history_names_providers_as_they_were_without_copying_todays_names(tmp_path: Path) -> None:
    """Regression (helper B, stop 31): ``NamesThen.at`` copied today's names - every provider's -
    for each event of the history that named a provider called otherwise since (~18 us an event
    with 5,000 providers here, ~70 us on a busier machine). It now lays the few old names over
    today's: no walk over them, and each event described as before, with the names the providers
    had then."""
    from evstore.cli import NamesThen, describe, provider_names

    async with open_store(f"sqlite:///{tmp_path / 'n.db'}") as store:
        hosts = [await make_provider(store, f"cn-{i:03}", VCPU=8) for i in range(30)]
        instance = new_uuid()
        for i, host in enumerate(hosts):  # (the instance moves host to host; each renamed once left)
            generation = (await store.allocations(instance)).generation if i else None
            await allocate(store, instance, {host: {"VCPU": 1}}, generation=generation)
            if i:
                await store.rename_provider(hosts[i - 1], f"cn-{i - 1:03}-renamed")
        today = await provider_names(store)
        plain = {**{new_uuid(): f"other-{i}" for i in range(5000)}, **today}
        names = _CountedNames(plain)
        then_of = NamesThen(store, instance)
        described = []
        async for recorded in store.history(instance):
            then = await then_of.at(recorded, names)
            # what the copy gave: today's names, those of the event's providers as they were then
            expected = dict(plain)
            for key in recorded.entities():
                kind, _, provider = key.partition(":")
                if kind == "provider":
                    expected[provider] = f"cn-{hosts.index(provider):03}"
            text = describe(recorded.event, then)
            assert text == describe(recorded.event, expected), recorded.position
            described.append(text)
            assert then.get(hosts[-1]) == "cn-029"  # (not in this event: today's)
    assert len(described) == 30 and all("renamed" not in text for text in described), described
    assert "cn-000: VCPU=1 (was nothing)" in described[0] and "cn-028: VCPU=1" in described[-1]
    assert _CountedNames.walks == 0, "today's names were walked over (copied) for an event"
