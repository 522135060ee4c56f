"""Stop 41, helper K: a stored idempotency fingerprint that is damaged is damage, not a conflict."""

from __future__ import annotations

import pytest

from evstore import AllocationStore, IdempotencyConflict, StorageError
from tests.conftest import allocate, make_provider, new_uuid


async def _claim(store: AllocationStore, consumer: str, rp: str) -> object:
    return await store.set_allocations(
        consumer,
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        idempotency_key="key-1",
    )


async def _null_fingerprint(store: AllocationStore) -> None:
    """The key's fingerprint set to NULL (the column's NOT NULL dropped first, as a hand-made
    table or a bad restore would have it)."""
    if store.url.startswith("sqlite"):
        for sql in (
            "CREATE TABLE idempotency_k (key TEXT PRIMARY KEY, fingerprint TEXT, receipt TEXT NOT NULL)",
            "INSERT INTO idempotency_k SELECT key, NULL, receipt FROM idempotency",
            "DROP TABLE idempotency",
            "ALTER TABLE idempotency_k RENAME TO idempotency",
        ):
            await store.backend.tamper(sql)
    else:
        await store.backend.tamper("ALTER TABLE idempotency ALTER COLUMN fingerprint DROP NOT NULL")
        await store.backend.tamper("UPDATE idempotency SET fingerprint = NULL")


@pytest.mark.parametrize(
    "damaged",
    [
        "NULL",
        "''",
        "'not a fingerprint'",
        "upper(fingerprint)",  # (evstore writes lowercase hex digits)
        "substr(fingerprint, 1, 63)",  # (one digit short)
        "fingerprint || ' '",
        "fingerprint || '0'",  # (one digit more)
        "CAST(fingerprint AS BLOB)",  # (SQLite only: the digits, stored as bytes)
    ],
)
async def test_a_damaged_fingerprint_is_damage_not_a_conflict(store: AllocationStore, damaged: str) -> None:
    """Finding (stop 41, helper K): a retry whose key's stored fingerprint (the SHA-256 of the
    command the key was used for: 64 lowercase hex digits) was damaged - NULL, empty, cut, edited
    by hand - was refused as ``IdempotencyConflict`` ("already used for a different command"),
    where a damaged receipt in the same row is ``evstore.storage`` with ``reason="damaged"``. A
    fingerprint that is no SHA-256 digest names no command, so nothing says the retry is another
    one: it is damage, said as such (the key, ``outcome_unknown`` False), on both backends; the
    store goes on."""
    if damaged.startswith("CAST") and not store.url.startswith("sqlite"):
        pytest.skip("PostgreSQL's column is text: it holds no bytes")
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await _claim(store, c, rp)
    head = await store.head()
    if damaged == "NULL":
        await _null_fingerprint(store)
    else:
        await store.backend.tamper(
            f"UPDATE idempotency SET fingerprint = {damaged} WHERE key = ?", ("key-1",)
        )
    with pytest.raises(StorageError) as caught:
        await _claim(store, c, rp)
    assert caught.value.code == "evstore.storage"
    assert caught.value.details["reason"] == "damaged", caught.value.message
    assert caught.value.details["idempotency_key"] == "key-1"
    assert caught.value.details["outcome_unknown"] is False
    assert "key-1" in caught.value.message and "fingerprint" in caught.value.message
    assert await store.head() == head
    await allocate(store, new_uuid(), {rp: {"VCPU": 1}})  # (the store goes on)


async def test_a_well_formed_fingerprint_of_another_command_is_still_a_conflict(
    store: AllocationStore,
) -> None:
    """A stored fingerprint in evstore's form that is not this command's cannot be told from one
    another command left: it stays ``IdempotencyConflict``, and so does a retry of another command
    under an intact key."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await _claim(store, c, rp)
    with pytest.raises(IdempotencyConflict):
        await _claim(store, new_uuid(), rp)  # (another consumer: another command)
    await store.backend.tamper("UPDATE idempotency SET fingerprint = ? WHERE key = ?", ("0" * 64, "key-1"))
    with pytest.raises(IdempotencyConflict) as caught:
        await _claim(store, c, rp)
    assert caught.value.details["idempotency_key"] == "key-1"
