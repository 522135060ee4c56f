"""diff names what moved besides a consumer's allocations (stop 42, the lead, from helper D's note)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from evstore import AllocationStore, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore


async def test_a_change_of_project_or_user_alone_says_what_moved(store: AllocationStore) -> None:
    """Regression: a consumer written again with the same allocations for another project and user
    was listed ``changed`` with equal ``before`` and ``after``, and nothing in the answer (JSON or
    text) said what had changed. ``labels_changed`` gives each label that differs, before and after."""
    p = await make_provider(store, "p", VCPU=8)
    c, same = new_uuid(), new_uuid()
    await allocate(store, c, {p: {"VCPU": 2}}, project_id="project-A", user_id="user-A")
    await allocate(store, same, {p: {"VCPU": 1}}, project_id="project-A", user_id="user-A")
    start = await store.head()
    await store.release(c)
    await allocate(store, c, {p: {"VCPU": 2}}, project_id="project-B", user_id="user-A")
    await allocate(store, same, {p: {"VCPU": 2}}, project_id="project-A", user_id="user-A", generation=1)
    d = await store.diff(start, await store.head())
    moved = d.consumer(c)
    assert moved is not None and moved.change == "changed" and moved.before == moved.after
    assert moved.labels_changed == {"project": ("project-A", "project-B")}
    assert moved.to_dict()["labels_changed"] == {"project": ["project-A", "project-B"]}
    grew = d.consumer(same)  # (only its allocations moved)
    assert grew is not None and grew.change == "changed" and grew.labels_changed == {}
    assert grew.to_dict()["labels_changed"] == {}
    # a consumer created in the span has no "before" to compare with
    fresh = new_uuid()
    at = await store.head()
    await allocate(store, fresh, {p: {"VCPU": 1}}, project_id="project-C", user_id="user-C")
    created = (await store.diff(at, await store.head())).consumer(fresh)
    assert created is not None and created.change == "created" and created.labels_changed == {}


def test_the_command_line_says_what_moved_besides_the_allocations(tmp_path: Path) -> None:
    db = tmp_path / "s.db"
    c = new_uuid()

    async def fill() -> tuple[int, int]:
        async with open_store(f"sqlite:///{db}") as store:
            p = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, c, {p: {"VCPU": 2}}, project_id="project-A", user_id="user-A")
            start = await store.head()
            await store.release(c)
            await allocate(store, c, {p: {"VCPU": 2}}, project_id="project-A", user_id="user-B")
            return start, await store.head()

    a, b = asyncio.run(fill())
    done = evstore("diff", str(a), str(b), "--db", str(db), "--json")
    assert done.returncode == 0, done.stderr
    (change,) = json.loads(done.stdout)["consumers"]
    assert change["change"] == "changed" and change["labels_changed"] == {"user": ["user-A", "user-B"]}
    text = evstore("diff", str(a), str(b), "--db", str(db))
    assert text.returncode == 0, text.stderr
    assert f"consumer {c}: user user-A → user-B" in text.stdout.replace("\n", "")
