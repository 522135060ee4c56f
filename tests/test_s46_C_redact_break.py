"""Stop 46, helper C: passwords holding each character that matters, through the public paths
(``open_store`` errors, ``evstore --url ... audit``), on both backends (README: passwords never
appear in error messages).

Found and fixed here: a password written unencoded with an "&" in a URL's query
(``?password=ab&cd&sslmode=disable``: "bad query field: 'cd'"), or with a space, a tab, a line
break or a quote in a libpq keyword string (``password=ab cd dbname=x``,
``password='ab'cd'``), showed its second piece: the value was hidden as the parsers read it, up
to the "&" or the space, and the rest of it, no parameter, was shown.

Also fixed (by the lead, in evstore/log/sqlite.py): the SQLite backend's "SQLite URL must look
like ...", "Not a SQLite URL" and "sets ... more than once" quoted the URL as given, so
``sqlite://u:pw@/x.db`` showed its password (test_a_sqlite_url_with_a_password_does_not_show_it).
"""

from __future__ import annotations

import asyncio
import os
from urllib.parse import quote, urlsplit

import pytest

from evstore import cli
from evstore import errors as err
from evstore.store import open_store

pytestmark = pytest.mark.usefixtures("logging_as_it_was")

_CHARS = [
    "@",
    ":",
    "/",
    "?",
    "#",
    "&",
    "=",
    "%",
    "+",
    " ",
    "\n",
    "\t",
    "'",
    '"',
    "\\",
    "é",
    "€",
    ",",
    "[",
    "]",
]
_MARKS = ("QWE", "RTY")


def _forms(password: str) -> list[str]:
    encoded = quote(password, safe="")
    forms = [
        f"postgresql://u:{password}@127.0.0.1:1/db",
        f"postgresql://u:{encoded}@127.0.0.1:1/db",
        f"postgresql://u:{encoded}@127.0.0.1:1/db?application_name=a@b",
        f"postgresql://u:{password}@127.0.0.1:1/db?application_name=a@b",
        f"postgresql://u@127.0.0.1:1/db?password={encoded}",
        f"postgresql://u@127.0.0.1:1/db?password={password}&sslmode=disable",
        f"postgresql://u:{encoded}@[::1]:1/db",
        f"postgresql://u:{password}@[::1]:1/db",
        f"postgresql://u:{encoded}@127.0.0.1:1,127.0.0.2:2/db",
        f"postgresql://u:{password}@127.0.0.1:1,127.0.0.2:2/db",
        f"u:{password}@127.0.0.1:1/db",
        f"host=127.0.0.1 port=1 password='{password}' dbname=db",
        f"host=127.0.0.1 port=1 password={password} dbname=db",
        f"sqlite:///no/such/dir/x.db?password={encoded}",
    ]
    pg = os.environ.get("EVSTORE_TEST_POSTGRES_URL")
    if pg:  # (a role that does not exist: the server refuses the login)
        user = urlsplit(pg).username
        forms += [pg.replace(f"//{user}@", f"//nosuchrole:{p}@", 1) for p in (encoded, password)]
    return forms


async def _open(url: str) -> None:
    async with open_store(url, connect_timeout=3):
        pass


@pytest.mark.parametrize("char", _CHARS)
def test_no_piece_of_the_password_is_shown(char: str, capsys: pytest.CaptureFixture[str]) -> None:
    password = f"QWE{char}RTY"
    for url in _forms(password):
        shown = err.redact_url(url)
        assert not any(mark in shown for mark in _MARKS), (url, shown)
        with pytest.raises(err.EvstoreError) as refused:
            asyncio.run(_open(url))
        said = f"{refused.value} {refused.value.details!r}"
        assert not any(mark in said for mark in _MARKS), (url, said)
        capsys.readouterr()
        with pytest.raises(SystemExit):
            cli.main(["audit", "--url", url])
        out = capsys.readouterr()
        assert out.err.startswith("error: evstore."), (url, out.err)
        assert not any(mark in out.out + out.err for mark in _MARKS), (url, out)


@pytest.mark.parametrize(
    ("url", "shown", "message"),
    [
        (
            "postgresql://u@h/db?password=QWE&RTY&sslmode=disable",
            "postgresql://u@h/db?password=***&sslmode=disable",
            "bad query field: 'RTY' (RTY)",
        ),
        ("host=h password=QWE RTY dbname=db", "host=h password=*** dbname=db", 'missing "=" after "RTY"'),
        ("host=h password=QWE\tRTY dbname = db", "host=h password=*** dbname = db", "RTY"),
        ("host=h password='QWE'RTY' dbname=db", "host=h password=*** dbname=db", "RTY'"),
    ],
)
def test_the_rest_of_a_password_cut_by_its_parser_is_hidden(url: str, shown: str, message: str) -> None:
    assert err.redact_url(url) == shown
    assert "RTY" not in err.redact_text(message, url)


def test_what_follows_a_password_and_is_a_parameter_still_shows() -> None:
    assert (
        err.redact_url("postgresql://u@h/db?password=a&sslmode=require&application_name=x")
        == "postgresql://u@h/db?password=***&sslmode=require&application_name=x"
    )
    assert err.redact_url("host=h password=a dbname=x user = me") == "host=h password=*** dbname=x user = me"


def test_a_sqlite_url_mistyped_with_a_password_does_not_show_it() -> None:
    """(``sqlite:u:pw@x.db`` holds no file name: the SQLite rule - the user's ":" right after
    ``sqlite://``, a file name may hold ":" and "@" - found no password in it)"""
    assert err.redact_url("sqlite:u:QWE@/x.db") == "sqlite:u:***@/x.db"
    assert err.redact_url("sqlite:QWE@/x.db") == "sqlite:***@/x.db"
    assert err.redact_url("sqlite:////srv/u:b@c.db") == "sqlite:////srv/u:b@c.db"


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://u:QWE@RTY@/no/such/dir/x.db",  # ("must look like sqlite:///relative.db ...")
        "sqlite:u:QWE@/x.db",  # ("Not a SQLite URL")
        "sqlite:///no/such/dir/x.db?password=QWE&password=RTY",  # ("sets password more than once")
    ],
)
def test_a_sqlite_url_with_a_password_does_not_show_it(url: str) -> None:
    with pytest.raises(err.EvstoreError) as refused:
        asyncio.run(_open(url))
    assert "QWE" not in str(refused.value), refused.value


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://u:127@127.0.0.1:1/db", "postgresql://u:***@***.0.0.1:1/db"),
        ("postgresql://u:0.0@127.0.0.1:1/db", "postgresql://u:***@127.***.1:1/db"),
        ("postgresql://u:1@127.0.0.1:1/db", "postgresql://u:***@127.0.0.***:***/db"),
        ("postgresql://u:db@127.0.0.1:1/db", "postgresql://u:***@127.0.0.1:1/***"),
        ("postgresql://u@127.0.0.1:1/db?password=127", "postgresql://u@***.0.0.1:1/db?password=***"),
    ],
)
def test_a_password_that_is_part_of_the_host_is_not_told_by_where_the_message_hides_it(
    url: str, shown: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The message hid the password's text in the host it quotes ("Connect call failed
    ('***.0.0.1', 1)") while the URL beside it showed the host (``127.0.0.1``): the reader read the
    password off the difference. The URL hides it there too."""
    assert err.redact_url(url) == shown
    with pytest.raises(err.EvstoreError) as refused:
        asyncio.run(_open(url))
    assert str(refused.value).startswith(f"Cannot connect to PostgreSQL at {shown}: "), refused.value
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["audit", "--url", url])
    assert f"at {shown}: " in capsys.readouterr().err
