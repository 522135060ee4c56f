"""Stop 44, helper E: what reviewing the stop's changes (e364e6e..) found."""

from __future__ import annotations

import pytest

from evstore import cli
from evstore import errors as err


def test_a_libpq_sslpassword_is_not_repeated_in_the_url_the_refusal_suggests() -> None:
    """README: passwords never appear in error messages. A libpq keyword string given as --url is
    answered with the URL to give (68ea835): its ``password`` was shown as ``***``, but its
    ``sslpassword`` (the client key's passphrase) went into that URL's query as given."""
    given = "host=db dbname=x sslpassword=SECRETpass sslkey=/k.pem"
    with pytest.raises(err.InvalidInput) as refused:
        cli.resolve_url(None, given)
    message = str(refused.value)
    assert "SECRETpass" not in message, message
    assert "sslpassword=***" in message, message  # (still named: the URL asyncpg needs has it)
    assert "postgresql://db/x?" in message, message
    assert cli.libpq_as_url("host=db sslpassword='a b'") == "postgresql://db?sslpassword=***"


@pytest.mark.parametrize(
    "given",
    ["host=h dbname='user=u password=SECRETpass'", "host=h dbname=postgresql://u:SECRETpass@h/db"],
)
def test_a_libpq_dbname_that_is_a_connection_string_is_not_repeated(given: str) -> None:
    """libpq reads a ``dbname`` holding ``=`` or a URL as a connection string of its own (its
    "expand_dbname"), password and all: the URL the refusal suggested put it in its path,
    %-encoded but legible (``/user%3Du%20password%3DSECRETpass``). It is not one URL's database
    name: the refusal says the string cannot be written as one, and repeats nothing of it."""
    with pytest.raises(err.InvalidInput) as refused:
        cli.resolve_url(None, given)
    message = str(refused.value)
    assert "SECRETpass" not in message, message
    assert "cannot be written as one" in message, message


def test_a_libpq_bare_password_holding_an_ampersand_is_hidden_whole() -> None:
    """README: passwords never appear in error messages. In a libpq keyword string ``&`` is a
    character of a bare value (``password=ab&SECRET``: that whole is the password); the redaction
    stopped there, as it does in a URL's query, and ``open_store``'s 'Unsupported store URL'
    showed ``password=***&SECRET``. A URL query's parameter still ends at its ``&``."""
    assert err.redact_url("host=x password=ab&SECRETpass dbname=y") == "host=x password=*** dbname=y"
    given = "host=x password=ab&SECRETpass dbname=y"
    assert "SECRETpass" not in err.redact_text(f"server said: bad 'ab&SECRETpass' in {given}", given)
    query = "postgresql://u@h/db?password=ab&sslmode=require&sslpassword=cd&x=1"
    assert err.redact_url(query) == "postgresql://u@h/db?password=***&sslmode=require&sslpassword=***&x=1"


def test_open_store_given_a_libpq_password_with_an_ampersand_hides_it() -> None:
    import asyncio

    from evstore.store import open_store

    async def given(url: str) -> None:
        async with open_store(url):
            pass

    with pytest.raises(err.InvalidInput) as refused:
        asyncio.run(given("host=x password=ab&SECRETpass dbname=y"))
    assert "SECRETpass" not in str(refused.value), str(refused.value)
