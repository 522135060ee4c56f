"""Stop 43, helper E: every column of every projection table, damaged by hand, is found by the
audit and put right by ``rebuild`` (on both backends).

Earlier tests damage a handful of columns (usages, generations, resources, counters); this one
goes through each column of each ``p_*`` table - and a row deleted, and a row added - one damage at
a time on one store: the audit must report something, a rebuild must bring the projection back to
what it was (the same rows, every column), and the audit must then be clean.
"""

from __future__ import annotations

import re
from typing import Any

from evstore import AllocationStore, Inventory, open_store
from evstore.errors import ProjectionCorrupt
from tests.conftest import allocate, make_provider, new_uuid

GHOST = "00000000-0000-4000-8000-00000000abcd"

# (table, what is done to it, the row it is done to): one damage each, SQL in the backend's dialect
# with ``?`` placeholders (the PostgreSQL backend's tamper turns them into $n).
COMMON: list[tuple[str, str]] = [
    ("p_providers.name", "UPDATE p_providers SET name = name || '-x' WHERE uuid = :child"),
    ("p_providers.parent", "UPDATE p_providers SET parent = NULL WHERE uuid = :child"),
    ("p_providers.parent(set)", "UPDATE p_providers SET parent = :child WHERE uuid = :root"),
    ("p_providers.root", "UPDATE p_providers SET root = :child WHERE uuid = :child"),
    ("p_providers.generation", "UPDATE p_providers SET generation = generation + 1 WHERE uuid = :root"),
    ("p_providers.inventories", "UPDATE p_providers SET inventories = '{}' WHERE uuid = :root"),
    ("p_providers.uuid", "UPDATE p_providers SET uuid = :ghost WHERE uuid = :child"),
    ("p_providers(deleted row)", "DELETE FROM p_providers WHERE uuid = :child"),
    (
        "p_providers(extra row)",
        "INSERT INTO p_providers SELECT :ghost, 'ghost', NULL, :ghost, 0, inventories, usages "
        "FROM p_providers WHERE uuid = :root",
    ),
    ("p_consumers.project_id", "UPDATE p_consumers SET project_id = 'other' WHERE uuid = :server"),
    ("p_consumers.user_id", "UPDATE p_consumers SET user_id = 'other' WHERE uuid = :server"),
    ("p_consumers.consumer_type", "UPDATE p_consumers SET consumer_type = 'X' WHERE uuid = :server"),
    ("p_consumers.generation", "UPDATE p_consumers SET generation = generation + 1 WHERE uuid = :server"),
    ("p_consumers.generation(null)", "UPDATE p_consumers SET generation = NULL WHERE uuid = :server"),
    ("p_consumers.deleted(set)", "UPDATE p_consumers SET deleted = 1 WHERE uuid = :server"),
    ("p_consumers.deleted(unset)", "UPDATE p_consumers SET deleted = 0 WHERE uuid = :gone"),
    ("p_consumers.deleted_at", "UPDATE p_consumers SET deleted_at = deleted_at - 1 WHERE uuid = :gone"),
    ("p_consumers.deleted_at(null)", "UPDATE p_consumers SET deleted_at = NULL WHERE uuid = :gone"),
    ("p_consumers.on_behalf_of", "UPDATE p_consumers SET on_behalf_of = :server WHERE uuid = :migration"),
    ("p_consumers.on_behalf_of(null)", "UPDATE p_consumers SET on_behalf_of = NULL WHERE uuid = :migration"),
    ("p_consumers.on_behalf_of(set)", "UPDATE p_consumers SET on_behalf_of = :gone WHERE uuid = :server"),
    (
        "p_consumers.allocated_at",
        "UPDATE p_consumers SET allocated_at = allocated_at - 1 WHERE uuid = :server",
    ),
    ("p_consumers.instance_type", "UPDATE p_consumers SET instance_type = 'X' WHERE uuid = :migration"),
    ("p_consumers.instance_type(set)", "UPDATE p_consumers SET instance_type = 'X' WHERE uuid = :server"),
    ("p_consumers.uuid", "UPDATE p_consumers SET uuid = :ghost WHERE uuid = :server"),
    ("p_consumers(deleted tombstone)", "DELETE FROM p_consumers WHERE uuid = :gone"),
    ("p_consumers(deleted holder)", "DELETE FROM p_consumers WHERE uuid = :server"),
    (
        "p_consumers(extra tombstone)",
        "INSERT INTO p_consumers SELECT :ghost, project_id, user_id, consumer_type, generation, deleted, "
        "deleted_at, on_behalf_of, allocated_at, instance_type FROM p_consumers WHERE uuid = :gone",
    ),
    ("p_allocations.consumer", "UPDATE p_allocations SET consumer = :other WHERE consumer = :server"),
    ("p_allocations.provider", "UPDATE p_allocations SET provider = :child WHERE consumer = :server"),
    ("p_allocations(deleted row)", "DELETE FROM p_allocations WHERE consumer = :server"),
    ("p_classes.name", "UPDATE p_classes SET name = 'CUSTOM_OTHER'"),
    ("p_classes(deleted row)", "DELETE FROM p_classes"),
    ("p_classes(extra row)", "INSERT INTO p_classes VALUES ('CUSTOM_EXTRA')"),
]
SQLITE_ONLY: list[tuple[str, str]] = [
    ("p_providers.usages", "UPDATE p_providers SET usages = '{\"VCPU\":1}' WHERE uuid = :root"),
    (
        "p_allocations.resources",
        "UPDATE p_allocations SET resources = '{\"VCPU\":3}' WHERE consumer = :server",
    ),
    (
        "p_allocations(extra row)",
        "INSERT INTO p_allocations SELECT :gone, provider, resources FROM p_allocations "
        "WHERE consumer = :server",
    ),
    ("p_usages.project_id", "UPDATE p_usages SET project_id = 'other' WHERE project_id = 'acme'"),
    ("p_usages.user_id", "UPDATE p_usages SET user_id = 'other' WHERE project_id = 'acme'"),
    ("p_usages.counters", "UPDATE p_usages SET counters = '{}' WHERE project_id = 'acme'"),
    ("p_usages(deleted row)", "DELETE FROM p_usages WHERE project_id = 'acme'"),
    ("p_usages(extra row)", "INSERT INTO p_usages SELECT 'ghost', user_id, counters FROM p_usages LIMIT 1"),
]
POSTGRES_ONLY: list[tuple[str, str]] = [
    ("p_providers.usages", "UPDATE p_providers SET usages = '{\"VCPU\":1}' WHERE uuid = :root"),
    ("p_allocations.rc", "UPDATE p_allocations SET rc = 'DISK_GB' WHERE consumer = :server AND rc = 'VCPU'"),
    ("p_allocations.used", "UPDATE p_allocations SET used = used + 1 WHERE consumer = :server"),
    (
        "p_allocations(extra row)",
        "INSERT INTO p_allocations SELECT :gone, provider, rc, used FROM p_allocations "
        "WHERE consumer = :server",
    ),
]


async def _projection(store: AllocationStore) -> list[Any]:
    """Every row of every projection table, sorted, as the backend stores them."""
    backend: Any = store.backend
    try:
        state = await backend.load_state()
    except ProjectionCorrupt as exc:  # (unreadable: the audit says so too)
        return [exc.code]
    return [
        sorted((repr(k), repr(v)) for k, v in state.providers.items()),
        sorted((repr(k), repr(v)) for k, v in state.consumers.items()),
        sorted(map(repr, state.custom_classes)),
        sorted(map(repr, (state.project_usages or {}).items())),
    ]


def _bind(sql: str, names: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """``:name`` placeholders to ``?`` ones, in order."""
    params: list[str] = []

    def one(match: re.Match[str]) -> str:
        params.append(names[match.group(1)])
        return "?"

    return re.sub(r":([a-z]+)\b", one, sql), tuple(params)


async def test_every_damaged_projection_column_is_found_and_rebuilt(store_url: str) -> None:
    async with open_store(store_url) as store:
        await store.create_resource_class("CUSTOM_GPU")
        root = await make_provider(store, "root", VCPU=Inventory(total=32), MEMORY_MB=4096, CUSTOM_GPU=4)
        child = await make_provider(store, "child", parent=root, VCPU=16, DISK_GB=100)
        server, other, gone, migration = new_uuid(), new_uuid(), new_uuid(), new_uuid()
        await allocate(store, server, {root: {"VCPU": 2, "MEMORY_MB": 512}}, project_id="acme")
        await allocate(store, other, {child: {"VCPU": 1, "DISK_GB": 10}}, project_id="acme")
        moving = new_uuid()
        await allocate(store, moving, {root: {"CUSTOM_GPU": 1}, child: {"DISK_GB": 5}}, project_id="beta")
        await store.start_migration(moving, migration)
        await allocate(store, gone, {child: {"VCPU": 3}})
        await store.delete_consumer(gone)
        names = {"root": root, "child": child, "server": server, "other": other, "gone": gone}
        names |= {"migration": migration, "ghost": GHOST}
        assert (await store.audit()).clean
        sound = await _projection(store)
        cases = COMMON + (SQLITE_ONLY if store_url.startswith("sqlite") else POSTGRES_ONLY)
        missed, unrepaired = [], []
        backend: Any = store.backend
        for label, sql in cases:
            text, params = _bind(sql, names)
            await backend.tamper(text, params)
            assert await _projection(store) != sound, f"{label}: changed nothing (the test's fault)"
            report = await store.audit()
            if report.clean:
                missed.append(label)
            await store.rebuild()
            if await _projection(store) != sound or not (await store.audit()).clean:
                unrepaired.append(label)
                await store.rebuild(full=True)
                assert await _projection(store) == sound, f"{label}: not even a full rebuild repaired it"
        assert missed == [], f"the audit did not see: {missed}"
        assert unrepaired == [], f"rebuild did not repair: {unrepaired}"
