"""Stop 45, helper G: review of helper B's redaction rewrite (errors.redact_url / redact_text).

README: passwords never appear in error messages or logs. Found by comparing the rewrite with the
patterns it replaced (4cb21c1) on generated URLs and messages:

- ``_userinfo_passwords`` hides from the first ":" after the scheme's to the text's LAST "@". When
  that ":" comes before a ``password=`` (a port, an IPv6 host, ``host=::1`` of a keyword string)
  and the password holds an "@", the span swallows ``password=`` and the start of the password,
  ends at the password's own "@", and the query/keyword pattern - run on the text already
  hidden - no longer finds a ``password=``: the password's tail is shown. The earlier patterns hid
  ``postgresql://u@h:5432/db?password=p@SECRET`` and ``host=::1 password=p@SECRET`` whole.
- ``redact_text`` replaces each secret in turn; once the (now wider) userinfo secret is replaced,
  the query/keyword password it overlaps is no longer in the text whole and is not found.
- (also before the rewrite) a URL query's password that starts with a quote
  (``?password='a'SECRET``): the query pattern's quoted alternative stops at the second quote,
  while ``parse_qsl`` - and asyncpg - read the value to the next "&".
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from evstore import errors as err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@db.example:5432/x?password=p@SECRETpw",  # (hidden whole at 4cb21c1)
        "postgresql://db.example/x?host=::1&password=p@SECRETpw",  # (hidden whole at 4cb21c1)
        "host=::1 port=5432 password=p@SECRETpw dbname=x",  # (hidden whole at 4cb21c1)
        "hostaddr=::1 password='p@SECRETpw'",  # (hidden whole at 4cb21c1)
        "postgresql://db.example:5432/x?password=p@SECRETpw",  # (shown at 4cb21c1 too)
    ],
)
def test_a_password_holding_an_at_sign_after_a_colon_is_hidden_whole(url: str) -> None:
    shown = err.redact_url(url)
    assert "SECRET" not in shown, shown
    assert "***" in shown


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (
            "postgresql://u@db.example:5432/x?password=p@SECRETpw",
            "could not connect to postgresql://u@db.example:5432/x?password=p@SECRETpw",
        ),
        ("host=::1 password=p@SECRETpw", "bad conninfo: host=::1 password=p@SECRETpw"),
        ("password=SECRETa?b::SECRETc user=a@b", "bad conninfo: password=SECRETa?b::SECRETc user=a@b"),
        # (an Azure-style user, hidden at 4cb21c1: the piece between quotes is hidden first and
        # the password around it is then no longer found)
        ("postgres://me@srv:SECRETa'SECRETb'SECRETc@db.example/x", "bad SECRETa'SECRETb'SECRETc"),
    ],
)
def test_redact_text_hides_a_password_the_userinfo_span_overlaps(url: str, message: str) -> None:
    shown = err.redact_text(message, url)
    assert "SECRET" not in shown, shown


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://u@db.example/x?password='a'SECRETpw",
        "postgresql://u@db.example/x?password='a'SECRETpw&sslmode=disable",
    ],
)
def test_a_query_password_starting_with_a_quote_is_hidden_whole(url: str) -> None:
    from urllib.parse import parse_qsl, urlsplit

    assert dict(parse_qsl(urlsplit(url).query))["password"] == "'a'SECRETpw"  # (what asyncpg reads)
    shown = err.redact_url(url)
    assert "SECRET" not in shown, shown


@pytest.mark.skipif(os.environ.get("EVSTORE_SLOW") != "1", reason="10 s against a hang: EVSTORE_SLOW=1")
def test_a_short_message_about_a_long_url_of_many_passwords_does_not_hang() -> None:
    script = textwrap.dedent(
        """
        from evstore import errors
        url = "postgresql://h/db?" + "&".join(f"password=v{i:05d}" for i in range(20_000))
        errors.redact_text("invalid value 'a'", url)  # ('a': in each 'password', in no span)
        print("done")
        """
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=10)
    assert ran.stdout.strip() == "done", ran.stderr


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("postgresql://u:SECRET%21pw@db.example/x", "bad 'SECRET!pw'"),
        ("postgresql://u:%53ECRETpw@db.example/x", "rejected SECRETpw"),
        ("postgresql://u@db.example/x?password=SECRET%21pw", "bad 'SECRET!pw'"),
        ("postgresql://u@db.example/x?password=SECRET+pw", "password 'SECRET pw' rejected"),
    ],
)
def test_a_password_shown_decoded_is_hidden(url: str, message: str) -> None:
    shown = err.redact_text(message, url)
    assert "SECRET" not in shown, shown
