"""Stop 46, helper A: the audit's history check and a full rebuild stage the history index's rows
in a TEMP table; a session that may not create one is told so - a read-only session (a hot
standby, ``default_transaction_read_only``) that the audit's --history check does not work there,
though the read_only hint says the audit does; a role without the database's TEMP privilege what
to grant - not "this role may not write the store" nor the server's words alone."""

from __future__ import annotations

import asyncpg
import pytest

from evstore import StorageError, open_store
from evstore.log.postgres import _storage_error
from tests.conftest import make_provider


async def test_the_audits_history_check_in_a_read_only_session_says_it_needs_one_that_writes(
    pg_url: str,
) -> None:
    """Regression: ``audit(history=True)`` with ``?default_transaction_read_only=on`` (as on a hot
    standby) failed "cannot execute CREATE TABLE in a read-only transaction (this session may not
    write: ... reads, export, audit and time travel work here)" - the audit it had just run.
    It says the check needs a TEMP table, to run it on the primary, and that the plain audit
    works here; ``reason`` ``read_only``."""
    async with open_store(pg_url) as store:
        await make_provider(store, VCPU=2)
    async with open_store(f"{pg_url}&default_transaction_read_only=on", create=False, upgrade=False) as store:
        assert (await store.audit()).clean
        with pytest.raises(StorageError) as failed:
            await store.audit(history=True)
    assert failed.value.details == {"sqlstate": "25006", "reason": "read_only"}
    assert "TEMP table" in failed.value.message
    assert "the audit without it works here" in failed.value.message
    assert "audit and time travel work here" not in failed.value.message


@pytest.mark.parametrize("committing", [None, False])
def test_a_role_without_temp_is_told_to_grant_it_not_that_it_may_not_write(committing: bool | None) -> None:
    """Regression: "permission denied to create temporary tables in database" (TEMP revoked from
    PUBLIC, a hardening some sites apply) in a full rebuild was told ``read_only``, "this role may
    not write the store: it lacks a privilege on its tables ... grant them" - a role that may;
    in the audit's --history check the server's words alone. Both name TEMP now. (Not made real
    here: revoking TEMP from PUBLIC on the shared test server would change every other test's
    roles.)"""
    exc = asyncpg.exceptions.InsufficientPrivilegeError(
        'permission denied to create temporary tables in database "x"'
    )
    failed = _storage_error(exc, "rebuilding the projection", committing)
    assert failed.details.get("reason") is None, failed.details
    assert failed.details["sqlstate"] == "42501"
    assert "GRANT TEMPORARY ON DATABASE" in failed.message, failed.message
    assert "may not write the store" not in failed.message
