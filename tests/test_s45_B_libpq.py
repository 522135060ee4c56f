"""Stop 45, helper B: a libpq keyword/value string given as --url is written as the URL to give
by libpq's own reading of it (fe-connect.c's conninfo_parse), left at stop 44:

- a bare value runs to the next space (C's isspace) with a backslash escaping the character after
  it: a ``'`` inside it is one of its characters (``password=ab'cd``); only a value's first ``'``
  quotes it;
- a quoted value ends at its closing ``'``: the next keyword may follow with no space
  (``password='x'host=db``);
- a keyword given twice: the last one counts (conninfo_storeval overwrites), as in the command line;
- a backslash ending a bare value is dropped;
- the URL's host is %-encoded: an IPv6 zone's ``%`` as ``%25`` (RFC 6874; asyncpg decodes it).
These were called "cannot be written as one" (or gave a URL naming another host). The password
is never repeated."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest

from evstore import cli
from evstore import errors as err


@pytest.mark.parametrize(
    ("given", "as_url"),
    [
        ("host=db password=ab'SECRET dbname=x", "postgresql://:***@db/x"),
        ("host=db user=o'brien dbname=x", "postgresql://o%27brien@db/x"),
        ("password='SECRET'host=db dbname=x", "postgresql://:***@db/x"),
        ("dbname='a b'host=db", "postgresql://db/a%20b"),
        ("host=a host=b dbname=x", "postgresql://b/x"),
        ("host=db dbname=x\\", "postgresql://db/x"),
        ("host=db\tdbname=x\x0bport=5433", "postgresql://db:5433/x"),
        ("host=fe80::1%eth0 dbname=x", "postgresql://[fe80::1%25eth0]/x"),
        ("host=a%41b dbname=x", "postgresql://a%2541b/x"),
    ],
)
def test_what_libpq_reads_is_written_as_a_url(given: str, as_url: str) -> None:
    assert cli.libpq_as_url(given) == as_url
    with pytest.raises(err.InvalidInput) as refused:
        cli.resolve_url(None, given)
    message = str(refused.value)
    assert f"this one as a URL: {as_url}" in message, message
    assert "SECRET" not in message, message


def test_an_ipv6_zone_comes_back_as_given() -> None:
    """asyncpg reads the host of the URL %-decoded: the zone as libpq had it."""
    built = cli.libpq_as_url("host=fe80::1%eth0 port=5432 dbname=x")
    assert built is not None
    assert unquote(urlsplit(built).netloc) == "[fe80::1%eth0]:5432"


def test_a_fullwidth_digit_port_is_not_a_url_port() -> None:
    """``str.isdigit`` takes a fullwidth digit (U+FF15); a URL's port is ASCII digits (the port
    stays in the query)."""
    assert cli.libpq_as_url("host=db port=\uff15 dbname=x") == "postgresql://db/x?port=%EF%BC%95"


@pytest.mark.parametrize(
    "given",
    [
        "host=h password='open SECRET",  # a quote left open
        "host=h password='SECRET\\",  # ... its last character escaped
        "host=h frobnicate=1 password=SECRET",  # a keyword libpq does not know
        "host=h Password=SECRET",  # (keywords are case-sensitive)
        "host=h password",  # no "=" after a keyword
        "host=h pass word=SECRET",
    ],
)
def test_what_libpq_refuses_cannot_be_written_as_one(given: str) -> None:
    assert cli.libpq_as_url(given) is None
    with pytest.raises(err.InvalidInput) as refused:
        cli.resolve_url(None, given)
    message = str(refused.value)
    assert "cannot be written as one" in message and "SECRET" not in message, message
