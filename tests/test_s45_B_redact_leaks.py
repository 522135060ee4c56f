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

# (cli.main, run in this process, configures logging to this test's captured streams, closed after it)
pytestmark = pytest.mark.usefixtures("logging_as_it_was")


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


@pytest.mark.parametrize(
    "url",
    [
        "postgresql:/u:SECRETpw@127.0.0.1:1/db",  # one "/"
        "postgresql:u:SECRETpw@127.0.0.1:1/db",  # none
        "postgresql//u:SECRETpw@127.0.0.1:1/db",  # no ":"
        "//u:SECRETpw@127.0.0.1:1/db",  # no scheme
        "u:SECRETpw@127.0.0.1:1/db",
        "postgresql:///u:SECRETpw@127.0.0.1:1/db",  # three (a PostgreSQL URL: host empty)
        "postgresql:\\\\u:SECRETpw@127.0.0.1:1/db",  # backslashes
        "postgresql:SECRETpw@127.0.0.1:1/db",  # no user
    ],
)
def test_a_mistyped_url_does_not_show_its_password(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A URL typed with one slash too few or too many, or none, is refused ("Unsupported store
    URL ...", "a path, not a URL", or asyncpg's connection error naming the URL): the message
    quoted it whole, password and all - the userinfo pattern wanted "://" just before the user.
    What sits between the user's ":" and the last "@" is hidden wherever the "//" went."""
    from evstore import cli

    assert "SECRET" not in err.redact_url(url), err.redact_url(url)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["audit", "--url", url])
    said = capsys.readouterr().err
    assert said.startswith("error: evstore.") and "SECRET" not in said, said


def test_the_userinfo_hidden_covers_what_the_earlier_pattern_hid() -> None:
    """(never less: every span the pattern found is inside the one found now)"""
    import random
    import re

    old = re.compile(r"(?s)(://[^:/@]*):(.*)@")
    rng = random.Random(4545)
    alphabet = ["://", ":", "/", "@", "\n", "a", "b", "x:", "?", "[", "]", "\\"]
    for _ in range(5000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 25)))
        now = err._userinfo_passwords(text)
        for start, end in (m.span(2) for m in old.finditer(text)):
            assert any(s <= start and end <= e for s, e in now), (text, now)


def test_a_user_holding_an_at_sign_does_not_show_the_password() -> None:
    """Azure Database for PostgreSQL's users are ``user@server``, and one written unencoded in a
    URL - ``postgresql://me@srv:SECRET@srv.example.com/db``, whose password urlsplit reads as
    ``SECRET`` - is refused ("more than one '@' before the host"): that message showed the
    password, the userinfo pattern wanting no "@" in the user."""
    url = "postgresql://me@srv:SECRETpw@srv.postgres.database.azure.com/db"
    assert err.redact_url(url) == "postgresql://me@srv:***@srv.postgres.database.azure.com/db"
    assert "SECRET" not in err.redact_text(f"cannot connect to {url}: 'SECRETpw' refused", url)


def test_a_sqlite_file_name_with_a_colon_and_an_at_sign_is_shown_as_it_is() -> None:
    assert err.redact_url("sqlite:///srv/a:b@c.db") == "sqlite:///srv/a:b@c.db"
