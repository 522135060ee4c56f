"""Stop 46, helper C: a URL's password hidden, and nothing else (README: passwords never appear in
error messages; the store is still named by the rest of its URL).

- an "@" in a URL's query (``?application_name=a@b``, ``?user=me@srv``) widened the password
  hidden to it: ``postgresql://u:pw@h:5432/db?application_name=a@b`` was shown as
  ``postgresql://u:***@b`` - no host, port, database or settings left to say which store;
- a URL without a scheme (``u:pw@h:5432/db?x=a@b``) showed its password: its user was taken for
  a scheme, the port's ":" for the user's, and ``5432/db?x=a`` was hidden instead.

What may still be a password stays hidden: the userinfo as each client reads it (urlsplit,
asyncpg, libpq), and a password with an unencoded "/", "?" or "#" up to the "@" after it.
"""

from __future__ import annotations

import pytest

from evstore import errors as err


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://u:SECRETpw@h:5432/db?application_name=a@b",
            "postgresql://u:***@h:5432/db?application_name=a@b",
        ),
        (
            "postgresql://u:SECRETpw@db.example/x?user=me@srv&sslmode=require",
            "postgresql://u:***@db.example/x?user=me@srv&sslmode=require",
        ),
        (
            "postgresql://u:SECRETpw@[::1]:5432/db?application_name=a@b",
            "postgresql://u:***@[::1]:5432/db?application_name=a@b",
        ),
        (
            "postgresql://u:SECRETpw@h1:5432,h2:5433/db?application_name=a@b&target_session_attrs=any",
            "postgresql://u:***@h1:5432,h2:5433/db?application_name=a@b&target_session_attrs=any",
        ),
        (
            "postgres://me@srv:SECRETpw@srv.example.com/db?application_name=x@y",
            "postgres://me@srv:***@srv.example.com/db?application_name=x@y",
        ),
        ("u:SECRETpw@h:5432/db?x=a@b", "u:***@h:5432/db?x=a@b"),
        ("u:SECRETpw@h:5432/db", "u:***@h:5432/db"),
        ("postgresql://h:5432/db?application_name=a@b", "postgresql://h:5432/db?application_name=a@b"),
        ("postgresql://u@h:5432/db?application_name=a@b", "postgresql://u@h:5432/db?application_name=a@b"),
    ],
)
def test_only_the_password_is_hidden(url: str, shown: str) -> None:
    assert err.redact_url(url) == shown
    said = err.redact_text(f"could not connect to {url}: password authentication failed", url)
    assert said == f"could not connect to {shown}: password authentication failed"


@pytest.mark.parametrize(
    "url",
    [
        "u:SECRET:pw@h:5432/db?x=a@b",  # (the user is not a scheme: the password holds a ":")
        "u:SECRET@pw@h:5432/db?x=a@b",
        "postgresql://u:SECRET@pw@h:5432/db?x=a@b",
        "postgresql://u:SECRET@pw/x@h/db?x=a@b",  # ("@" and "/" unencoded: up to the path's "@")
        "postgresql://u:SECRET/pw?x=a@h/db",  # (the host part "u:SECRET" is no host and port)
        "postgresql://u:SECRET/pw?x=a@h",
        "postgresql://u:SECRET#pw@h/db?application_name=a@b",
        "postgresql://h:5432?application_name=SECRETpw@b",  # (libpq: user h, password 5432?...)
        "postgresql://u:SECRET?pw@h/db?application_name=a@b",  # (libpq: the first "@" before a "/")
        "postgresql:u:SECRETpw@h/db?x=a@b",
        "postgresql:SECRETpw@h/db?x=a@b",
        "//u:SECRETpw@h/db?x=a@b",
    ],
)
def test_what_may_be_a_password_is_still_hidden(url: str) -> None:
    shown = err.redact_url(url)
    assert "SECRET" not in shown and "***" in shown, shown
    said = err.redact_text(f"invalid DSN {url!r}: bad port 'SECRET'", url)
    assert "SECRET" not in said, said
