"""Acceptance checks of the debugging commands, driven as a person would: in a subprocess.

The scenario every check here starts from is a leak investigation months later: the hosts the
consumer lived on have since been renamed or decommissioned. What the commands print about past
events must name the hosts as they were called then (as ``diff`` and a provider's own ``history``
do), not by today's name, nor by a bare uuid stub once a host is gone.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from evstore import EvstoreError, Inventory, open_store
from tests.test_cli_support import evstore

HOST = "aaaaaaaa-0000-4000-8000-000000000001"
GONE = "bbbbbbbb-0000-4000-8000-000000000002"
SERVER = "cccccccc-0000-4000-8000-000000000003"
MIGRATION = "dddddddd-0000-4000-8000-000000000004"


def _renamed_and_decommissioned(db: Path) -> None:
    """compute-1 and compute-2 hold a server that migrates and is deleted mid-migration; then
    compute-1 is renamed rack7-compute-1 and compute-2 is removed (positions 1-10)."""

    async def write() -> None:
        async with open_store(f"sqlite:///{db}") as store:
            await store.create_provider(HOST, "compute-1")  # 1
            await store.set_inventories(HOST, {"VCPU": Inventory(total=8)}, generation=0)  # 2
            await store.create_provider(GONE, "compute-2")  # 3
            await store.set_inventories(GONE, {"VCPU": Inventory(total=8)}, generation=0)  # 4
            await store.set_allocations(  # 5
                SERVER, {GONE: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                generation=None, metadata={"request_id": "req-build", "actor": "nova"},
            )  # fmt: skip
            await store.start_migration(SERVER, MIGRATION)  # 6: the migration holds compute-2
            await store.set_allocations(  # 7: the server on compute-1
                SERVER, {HOST: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                generation=None,
            )  # fmt: skip
            await store.delete_consumer(SERVER, metadata={"request_id": "req-del"})  # 8: both released
            await store.rename_provider(HOST, "rack7-compute-1")  # 9
            await store.delete_provider(GONE)  # 10

    asyncio.run(write())


def _summaries(*args: str) -> list[str]:
    done = evstore(*args, "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    return [e["summary"] for e in out["events"]]


def test_a_consumers_history_names_its_hosts_as_they_were_called_then(tmp_path: Path) -> None:
    """Regression: a consumer's history named each host by today's name ("now holds
    rack7-compute-1", a name given after the consumer was gone) and a decommissioned host by an
    8-character uuid stub ("bbbbbbbb: VCPU=2"), so the story did not match the operator's
    records of the time, nor what ``diff`` over the same events says."""
    db = tmp_path / "leak.db"
    _renamed_and_decommissioned(db)
    summaries = _summaries("history", SERVER, "--db", str(db))
    assert len(summaries) == 4, summaries
    assert "now holds compute-2: VCPU=2" in summaries[0], summaries[0]
    assert "moved compute-2: VCPU=2 to migration" in summaries[1], summaries[1]
    assert "now holds compute-1: VCPU=2" in summaries[2], summaries[2]
    assert "released compute-1: VCPU=2" in summaries[3], summaries[3]
    assert "its migration dddddddd-0000-4000-8000-000000000004 released compute-2: VCPU=2" in summaries[3]
    for text in summaries:
        assert "rack7" not in text and "bbbbbbbb:" not in text, text
    # the migration's own history, and the table a person reads, say the same
    assert "released compute-2: VCPU=2" in _summaries("history", MIGRATION, "--db", str(db))[-1]
    table = evstore("history", SERVER, "--db", str(db))
    assert table.returncode == 0, table.stderr
    assert "compute-2: VCPU=2" in table.stdout and "rack7" not in table.stdout, table.stdout
    # (diff over the deletion already named them so: the two agree)
    change = json.loads(evstore("diff", "7", "8", "--db", str(db), "--json").stdout)
    assert change["provider_names"] == {HOST: "compute-1", GONE: "compute-2"}


def test_a_provider_history_names_the_other_providers_as_they_were_called_then(tmp_path: Path) -> None:
    """The same in a provider's history: the events of consumers that also held other providers
    name those as they were called at the event (the provider's own name was already right)."""
    db = tmp_path / "leak.db"
    _renamed_and_decommissioned(db)
    summaries = _summaries("history", HOST, "--db", str(db))
    deletion = next(s for s in summaries if "deleted (tombstone)" in s)
    assert "released compute-1: VCPU=2" in deletion and "released compute-2: VCPU=2" in deletion, deletion
    assert summaries[-1] == f"provider {HOST} renamed from compute-1 to rack7-compute-1", summaries


def _tail(db: Path, after: int, *args: str) -> list[str]:
    done = evstore("tail", "--db", str(db), "--after", str(after), "--no-follow", *args)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_tail_after_a_position_names_providers_as_they_were_called_then(tmp_path: Path) -> None:
    """Regression: ``tail --after N`` (N > 0) started from today's names, so the events it printed
    from the past named a host by a name it got later ("inventory of rack7-compute-1" before
    the rename) and a removed host by a uuid stub - unlike ``tail --after 0``, which learns each
    name from the log as it goes, and ``history``."""
    db = tmp_path / "leak.db"
    _renamed_and_decommissioned(db)
    whole = [json.loads(line)["summary"] for line in _tail(db, 0, "--json")]
    for after in range(1, 10):
        lines = _tail(db, after, "--json")
        assert [json.loads(line)["summary"] for line in lines] == whole[after:], after
        assert [json.loads(line)["position"] for line in lines] == list(range(after + 1, 11))
    human = _tail(db, 4)
    assert "compute-2: VCPU=2" in human[0] and "compute-2 deleted" in human[-1], human
    assert "rack7-compute-1" not in "\n".join(human[:-2]), human
    # (a rename at the first line printed: its old name is the name at the position tail starts after)
    assert _tail(db, 8)[0].endswith(f"provider {HOST} renamed from compute-1 to rack7-compute-1")


def _run(*args: str) -> tuple[int, str, str]:
    done = evstore(*args)
    return done.returncode, done.stdout, done.stderr


def test_time_points_the_commands_take_and_refuse(tmp_path: Path) -> None:
    """``--at`` and diff's points: positions 0 and the head, an event's own time in any zone (the
    same instant answers alike) and a microsecond before it, a time before the first event
    (position 0) or after the head (the head), for the whole store and one entity; a negative,
    fractional, hexadecimal or exponent position is a one-line ``evstore.invalid_input``, exit 1."""
    db = tmp_path / "leak.db"
    _renamed_and_decommissioned(db)
    events = [json.loads(line) for line in _tail(db, 0, "--json")]
    deleted_at = events[7]["recorded_at"]  # (position 8, the tombstone)

    def state(at: str, *scope: str) -> Any:
        code, out, err = _run("state", "--at", at, *scope, "--db", str(db), "--json")
        assert code == 0, err
        return json.loads(out)

    assert state("0")["position"] == 0
    assert state("10")["position"] == 10
    assert state("1999-01-01T00:00:00Z")["position"] == 0
    assert state("2999-01-01T00:00:00+14:00")["position"] == 10
    at_tombstone = state(deleted_at, "--consumer", SERVER)
    assert at_tombstone["position"] == 8 and at_tombstone["deleted"] is True
    moment = datetime.fromisoformat(deleted_at)
    elsewhere = moment.astimezone(timezone(timedelta(hours=-9, minutes=-30))).isoformat()
    assert state(elsewhere, "--consumer", SERVER) == at_tombstone
    just_before = (moment - timedelta(microseconds=1)).isoformat()
    earlier = max(e["position"] for e in events if datetime.fromisoformat(e["recorded_at"]) < moment)
    before = state(just_before, "--consumer", MIGRATION)
    assert before["position"] == earlier and before["on_behalf_of"] == SERVER and before["allocations"]
    assert state(just_before, "--provider", GONE)["position"] == earlier
    for point in ("1.5", "0x10", "1e3"):  # (past the head, no zone, words: test_cli_debugging)
        code, out, err = _run("state", "--at", point, "--db", str(db))
        assert (code, out) == (1, ""), (point, code, out, err)
        assert err.startswith("error: evstore.invalid_input: ") and err.count("\n") == 1, err
    code, out, err = _run("state", "--at", "-1", "--db", str(db))  # out of range: a usage error
    assert (code, out) == (2, ""), (code, out, err)
    assert err.startswith("error: evstore.usage: ") and err.count("\n") == 1, err
    code, out, err = _run("diff", deleted_at, "8", "--db", str(db), "--json")
    assert code == 0, err
    assert (json.loads(out)["from_position"], json.loads(out)["events_by_type"]) == (8, {})


def test_every_history_tells_each_event_as_the_whole_log_does(tmp_path: Path) -> None:
    """On a mixed workload (renames, a provider's uuid used again, migrations, deletes), each
    provider's and consumer's ``history --json`` describes every event as ``tail --after 0``,
    which reads the whole log in order and so knows each name as it was, describes it."""
    from tests.test_acceptance_debugging import _mixed_workload

    db = tmp_path / "mixed.db"

    async def write() -> list[str]:
        async with open_store(f"sqlite:///{db}") as store:
            await _mixed_workload(store, seed=3, commands=90)
            keys = {key for e in await store.read(0, 10_000) for key in e.entities()}
            return sorted(
                uuid for kind, _, uuid in map(lambda k: k.partition(":"), keys) if kind != "resource_class"
            )

    entities = asyncio.run(write())
    told = {(row := json.loads(line))["position"]: row["summary"] for line in _tail(db, 0, "--json")}
    assert any(" renamed from " in text for text in told.values())
    for entity in entities:
        done = evstore("history", entity, "--db", str(db), "--json")
        assert done.returncode == 0, done.stderr
        for event in json.loads(done.stdout)["events"]:
            assert event["summary"] == told[event["position"]], (entity, event["position"])


def test_a_damaged_row_in_another_providers_history_does_not_stop_a_history(tmp_path: Path) -> None:
    """The names a history reads from the other providers' histories are a courtesy: a damaged
    row there (here the host's rename) leaves the names before it known and fails nothing; the
    listing reports only its own damaged rows. So for tail's names at the position it starts
    after."""
    import sqlite3

    db = tmp_path / "leak.db"
    _renamed_and_decommissioned(db)
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE events SET data = '{' WHERE position = 9")  # (the rename of HOST)
    conn.close()
    summaries = _summaries("history", SERVER, "--db", str(db))
    assert "now holds compute-1: VCPU=2" in summaries[2] and "released compute-1: VCPU=2" in summaries[3]
    own = evstore("history", HOST, "--db", str(db), "--json")
    assert own.returncode == 1 and own.stderr.startswith("error: evstore.log.corrupt: "), own.stderr
    # tail after the damaged row cannot fold the names up to it: it prints with today's
    assert [line.split()[0] for line in _tail(db, 9)] == ["10"]


def test_an_operator_finds_a_hand_edited_projection_and_repairs_it_on_either_backend(store_url: str) -> None:
    """Drift through ``--url`` on both backends: a usage counter and a tombstone edited away by
    hand; ``audit`` exits 3 naming both (with the events behind them), the projection and a fold
    at the head disagree as the audit says, ``rebuild`` repairs it, the audit exits 0 and the
    tombstone refuses a late write again."""
    other = "eeeeeeee-0000-4000-8000-000000000005"

    async def write() -> None:
        async with open_store(store_url) as store:
            await store.create_provider(HOST, "compute-1")
            await store.set_inventories(HOST, {"VCPU": Inventory(total=8)}, generation=0)
            for consumer in (SERVER, other):
                await store.set_allocations(
                    consumer, {HOST: {"VCPU": 2}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                    generation=None,
                )  # fmt: skip
            await store.delete_consumer(other)  # position 5

    async def tamper() -> None:
        edits = (
            ("UPDATE p_providers SET usages = '{\"VCPU\": 7}' WHERE uuid = ?", HOST),
            ("DELETE FROM p_consumers WHERE uuid = ?", other),
        )
        if store_url.startswith("sqlite"):
            import sqlite3

            with sqlite3.connect(store_url.removeprefix("sqlite:///")) as conn:
                for sql, arg in edits:
                    conn.execute(sql, (arg,))
            conn.close()
        else:
            from tests.test_postgres import admin_fetch

            for sql, arg in edits:
                await admin_fetch(store_url, sql.replace("?", "$1"), arg)

    asyncio.run(write())
    asyncio.run(tamper())
    at = ["--url", store_url, "--json"]
    found = evstore("audit", *at)
    assert found.returncode == 3, found.stderr
    drift = [f for f in json.loads(found.stdout)["findings"] if f["kind"] == "drift"]
    assert {f["details"].get("provider") or f["details"].get("consumer") for f in drift} == {HOST, other}, (
        drift
    )
    assert all(f["positions"] for f in drift)
    assert next(f["positions"] for f in drift if f["details"].get("consumer") == other) == [5]
    stored = json.loads(evstore("state", "--provider", HOST, *at).stdout)["provider"]["usages"]["VCPU"]
    folded = json.loads(evstore("state", "--at", "5", "--provider", HOST, *at).stdout)["provider"]["usages"][
        "VCPU"
    ]
    assert (stored["used"], folded["used"]) == (7, 2)
    assert evstore("rebuild", *at).returncode == 0
    clean = evstore("audit", *at)
    assert clean.returncode == 0 and json.loads(clean.stdout)["clean"] is True, clean.stdout
    assert evstore("state", "--provider", HOST, *at).stdout.replace('"head": 5', "") == evstore(
        "state", "--at", "5", "--provider", HOST, *at
    ).stdout.replace('"head": 5', "")

    async def late_write() -> str:
        async with open_store(store_url) as store:
            try:
                await store.set_allocations(
                    other, {HOST: {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE",
                    generation=None,
                )  # fmt: skip
            except EvstoreError as exc:
                return exc.code
            return "accepted"

    assert asyncio.run(late_write()) == "evstore.consumer.deleted"


async def test_the_names_tail_starts_from_are_the_folds_and_nothing_is_written(tmp_path: Path) -> None:
    """Regression (helper-107): ``tail --after N`` took its starting names from ``state_at(N)``,
    which folds the log up to N and saves snapshots on the way: 29 s, 284 MB and 20 snapshots
    written into the store for a tail near the head of a 200k-event log (1.2 s before). The names
    come from the events after N and the renamed providers' own naming events now; they must
    equal the fold's at every position, and nothing may be written."""
    from evstore.cli import provider_names_at

    hosts = [str(uuid.UUID(int=i + 1)) for i in range(4)]
    async with open_store(f"sqlite:///{tmp_path}/names.db", snapshot_every=3) as store:
        for i, host in enumerate(hosts):
            await store.create_provider(host, f"cn-{i}")
        await store.rename_provider(hosts[0], "rack1-cn-0")
        await store.delete_provider(hosts[1])
        await store.create_provider(hosts[1], "cn-1-again")  # (a uuid used again)
        await store.rename_provider(hosts[0], "rack2-cn-0")
        await store.delete_provider(hosts[2])
        await store.create_provider(str(uuid.UUID(int=99)), "late")
        head = await store.head()
        assert await store.snapshot_positions() == []
        for position in range(head + 1):
            got = await provider_names_at(store, position, head)
            assert await store.snapshot_positions() == [], position
            folded = dict(await (await store.state_at(position=position)).providers())
            await store.backend.drop_snapshots()
            assert got == folded, position
