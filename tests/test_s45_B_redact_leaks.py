"""Stop 45, helper B: passwords ``redact_url`` showed (README: passwords never appear in error
messages).

- a URL's userinfo password holding a line break (``postgresql://u:ab<LF>SECRET@h/db``): the
  pattern read to the last "@" of the line only, found none, and hid nothing - while urlsplit
  drops the line break and asyncpg connects with ``abSECRET``;
- a URL query's password holding a space (``?password=ab SECRET&sslmode=...``): hidden up to the
  space, though a query's parameter ends only at "&" (``parse_qsl`` reads ``ab SECRET``);
- a libpq keyword string's bare password holding a space that is not C's (``isspace``: space,
  \\t \\n \\v \\f \\r) - a no-break space, an em space, \\x1c: libpq reads on past it, the pattern's
  ``\\s`` stopped there."""

from __future__ import annotations

import pytest

from evstore import errors as err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u:ab\nSECRETpw@127.0.0.1:1/db",
        "postgresql://u:ab\r\nSECRETpw@127.0.0.1:1/db",
        "postgresql://u@127.0.0.1:1/db?password=ab SECRETpw&sslmode=disable",
        "postgresql://u@127.0.0.1:1/db?sslmode=disable&password=ab\tSECRETpw",
        "postgresql://u@127.0.0.1:1/db?sslpassword=ab\nSECRETpw&sslmode=disable",
        "host=x password=ab\xa0SECRETpw dbname=y",
        "host=x password=ab\u2003SECRETpw dbname=y",
        "host=x password=ab\x1cSECRETpw dbname=y",
        "host=x sslpassword=ab\x85SECRETpw",
    ],
)
def test_a_password_holding_a_space_or_a_line_break_is_hidden_whole(url: str) -> None:
    shown = err.redact_url(url)
    assert "SECRET" not in shown, shown
    assert "***" in shown, shown
    assert "SECRET" not in err.redact_text(f"could not connect to {url}: refused", url)


def test_what_is_not_a_password_still_shows() -> None:
    """(the host, database and other parameters stay: a message must still say which store)"""
    assert (
        err.redact_url("postgresql://u:ab\nSECRET@db.example/evstore")
        == "postgresql://u:***@db.example/evstore"
    )
    assert (
        err.redact_url("postgresql://u@h/db?password=ab cd&sslmode=require")
        == "postgresql://u@h/db?password=***&sslmode=require"
    )
    assert err.redact_url("host=x password=ab\xa0cd dbname=y") == "host=x password=*** dbname=y"


def test_open_store_does_not_repeat_such_a_password() -> None:
    import asyncio

    from evstore.store import open_store

    async def given(url: str) -> None:
        async with open_store(url, connect_timeout=2):
            pass

    for url in (
        "postgresql://u:ab\nSECRETpw@127.0.0.1:1/db",
        "postgresql://u@127.0.0.1:1/db?password=ab SECRETpw&sslmode=disable",
        "host=x password=ab\xa0SECRETpw dbname=y",
    ):
        with pytest.raises(err.EvstoreError) as refused:
            asyncio.run(given(url))
        assert "SECRET" not in str(refused.value), refused.value
        assert "SECRET" not in repr(refused.value.details), refused.value.details
