"""Stop 46, helper A: a server-wide setting in the PostgreSQL URL (``?shared_buffers=``) - one no
session may set, whatever its value (SQLSTATE 55P02) - is told to be left out of the URL, not to
have its value checked."""

from __future__ import annotations

import pytest

from evstore import InvalidInput, open_store


@pytest.mark.parametrize(
    ("setting", "field", "named"),
    [
        ("shared_buffers=1GB", "shared_buffers", "(shared_buffers)"),  # (a restart's)
        ("max_connections=5", "max_connections", "(max_connections)"),
        (
            "archive_timeout=5",
            "archive_timeout",
            "(archive_timeout)",
        ),  # (a reload's: "cannot be changed now")
        ("options=-c%20shared_buffers%3D1GB", "options", "(shared_buffers, in options)"),
    ],
)
async def test_a_server_wide_setting_in_the_url_is_to_be_left_out(
    pg_url: str, setting: str, field: str, named: str
) -> None:
    """Regression: ``?shared_buffers=1GB`` was refused "parameter "shared_buffers" cannot be
    changed without restarting the server ... check its value (shared_buffers)" - no value would
    do: the setting is the server's, set in its configuration. ``InvalidInput`` naming the key
    (``field``), saying to leave it out of the URL and where it is set."""
    with pytest.raises(InvalidInput) as refused:
        async with open_store(f"{pg_url}&{setting}", create=False):
            pass
    failed = refused.value
    assert failed.code == "evstore.invalid_input"
    assert failed.details["field"] == field
    assert failed.details["sqlstate"] == "55P02"
    assert "transient" not in failed.details
    assert "check its value" not in failed.message, failed.message
    assert "leave it out of the URL" in failed.message, failed.message
    assert "postgresql.conf" in failed.message and named in failed.message, failed.message


async def test_a_value_the_server_refuses_is_still_to_be_checked(pg_url: str) -> None:
    """(Unchanged: a setting a session may set, with a value the server refuses, 22023.)"""
    with pytest.raises(InvalidInput) as refused:
        async with open_store(f"{pg_url}&lock_timeout=soon", create=False):
            pass
    assert refused.value.details["field"] == "lock_timeout"
    assert "check its value (lock_timeout)" in refused.value.message
