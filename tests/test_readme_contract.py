"""The README read as a contract, from the outside (review 29, helper-92): what a person or a
script relying only on the README's words would check.

README, "Debugging a leak": "errors are one line ``error: <code>: <message>``"; tables and lines
show text "with control characters as ``\\xNN``, so a stored string cannot ... split a line".
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import asyncpg
import pytest

import evstore as evstore_package
from evstore import AllocationStore, ConcurrentUpdate, Inventory, commands, open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore


def test_an_error_naming_a_path_with_a_newline_names_all_of_it_on_one_line(tmp_path: Path) -> None:
    """Regression: the error line was the message's first line, so a path (or URL) holding a
    newline was cut at it: ``--db $'a\\nb.db'`` said ``no database file at a`` - another file than
    the one given - and lost the hint after it. The whole message is shown, its control
    characters as ``\\xNN``, which keeps it one line."""
    odd = tmp_path / "a\nb.db"
    for store in (["--db", str(odd)], ["--url", f"sqlite:///{odd}"]):
        done = evstore("audit", *store)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 1 and len(lines) == 1, done.stderr
        assert lines[0].startswith("error: evstore.not_found: "), done.stderr
        assert "a\\x0ab.db" in lines[0], done.stderr
    done = evstore("audit", "--db", str(odd))
    assert "(check the path, or create one with `evstore demo`)" in done.stderr, done.stderr


async def test_a_role_granted_what_the_readme_names_can_read_audit_and_time_travel(pg_url: str) -> None:
    """README, "SQLite or PostgreSQL?": a read-only role can read, export, audit and time-travel,
    with the grants the README names. ``GRANT SELECT ON ALL TABLES IN SCHEMA`` alone - what one
    writes for a read-only role - leaves out the store's sequence, and the audit (rebuild's check
    too) failed with "permission denied for sequence events_seq_seq" (review 29, helper-92)."""
    schema = dict(parse_qsl(urlsplit(pg_url).query))["search_path"]
    role = f"{schema}_ro"[:63]
    async with open_store(pg_url) as writer:
        rp = await make_provider(writer, VCPU=4)
        await allocate(writer, new_uuid(), {rp: {"VCPU": 1}})
    admin = await asyncpg.connect(pg_url.split("?")[0])
    if not await admin.fetchval(
        "SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user"
    ):
        await admin.close()
        pytest.skip("the test server's role cannot create roles")
    await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        # the README's grants, word for word
        await admin.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        await admin.execute(f'GRANT SELECT ON ALL TABLES IN SCHEMA "{schema}" TO "{role}"')
        parts = urlsplit(pg_url)
        as_role = urlunsplit(parts._replace(netloc=f"{role}@{parts.hostname}:{parts.port}"))
        async with open_store(as_role, create=False) as reader:
            assert (await reader.audit()).clean
            assert await (await reader.state_at(position=2, provider=rp)).usage(rp) == {"VCPU": 0}
            assert (await reader.usage(rp)) == {"VCPU": 1}
            assert len([line async for line in reader.export()]) == 1 + 3
    finally:
        await admin.execute(f'DROP OWNED BY "{role}"; DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def test_set_inventory_adding_a_class_checks_the_generation_as_an_update_does(
    store: AllocationStore,
) -> None:
    """README, "How it works": ``set_inventory`` adds a class the provider lacks - where Placement's
    ``PUT /inventories/{rc}`` answers 400 and adds with a ``POST`` that checks no generation - and
    it checks the provider's generation, as for an update: a stale one is refused, nothing written."""
    rp = await make_provider(store, VCPU=8)  # generation 1
    head = await store.head()
    with pytest.raises(ConcurrentUpdate):
        await store.set_inventory(rp, "DISK_GB", Inventory(total=100), generation=0)
    assert await store.head() == head and "DISK_GB" not in await store.inventories(rp)
    assert await store.set_inventory(rp, "DISK_GB", Inventory(total=100), generation=1) == 2
    assert (await store.inventories(rp))["DISK_GB"].total == 100


def test_the_errors_the_readme_names_have_the_codes_it_gives() -> None:
    """README, "The embedded API": each error class it names with its code - ``ConcurrentUpdate``
    (``placement.concurrent_update``), ... - is importable from ``evstore`` with that ``.code``, and
    the refusals are all of them: every ``EvstoreError`` a command's decision raises is named."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    named = dict(re.findall(r"`([A-Z][A-Za-z]+)`\s+\(`([a-z_]+\.[a-z_.]+)`", readme))
    assert len(named) >= 14, named
    for name, code in named.items():
        cls = getattr(evstore_package, name)
        assert issubclass(cls, evstore_package.EvstoreError) and cls.code == code, (name, code, cls.code)
    decided = set(re.findall(r"err\.([A-Z][A-Za-z]+)\(", Path(commands.__file__).read_text()))
    assert decided - {"InvalidInventoryValue"} <= set(named), decided - set(named)
