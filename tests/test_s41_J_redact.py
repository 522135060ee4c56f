"""Stop 41, helper J: a short password hidden where it is the password, not wherever its letters
appear. The hiding is evstore.errors.redact_text's (not the command line's): strict xfails here,
for whoever owns evstore/errors.py (a fix is suggested in helper J's report)."""

from __future__ import annotations

import os
import re

import pytest

from tests.test_cli_support import evstore

_SHORT_PASSWORD_REASON = (
    "redact_text replaces every occurrence of the password in the driver's message, inside other "
    "words too: a one-letter password 'p' gives 'rejected SSL u***grade' (evstore/errors.py, not "
    "owned by helper J)"
)


@pytest.mark.xfail(strict=True, reason=_SHORT_PASSWORD_REASON)
def test_a_one_letter_password_is_hidden_in_the_url_not_inside_the_words_of_a_message() -> None:
    """(no server needed: the URL parser's own message about a malformed port)"""
    done = evstore("stats", "--url", "postgresql://evstore:t@127.0.0.1:5432:99999/x")
    assert done.returncode == 1, done.stderr
    # the password hidden in the URL shown
    assert "postgresql://evstore:***@127.0.0.1" in done.stderr, done.stderr
    # and nowhere else: the parser's words as it wrote them, the quoted port shown
    assert "Port could not be cast to integer value" in done.stderr, done.stderr


@pytest.mark.skipif(not os.environ.get("EVSTORE_TEST_POSTGRES_URL"), reason="needs EVSTORE_TEST_POSTGRES_URL")
@pytest.mark.xfail(strict=True, reason=_SHORT_PASSWORD_REASON)
def test_a_one_letter_password_is_hidden_in_a_servers_refusal_only_where_it_is_the_password() -> None:
    """The server's refusals (SSL asked of a server without it, a database that does not exist),
    said in their own words; the password, one letter, hidden in the URL."""
    server = re.sub(r"^postgresql://[^@/]*@", "", os.environ["EVSTORE_TEST_POSTGRES_URL"]).split("/")[0]
    for url, words in (
        (f"postgresql://evstore:p@{server}/evstore_test?sslmode=require", "rejected SSL upgrade"),
        (f"postgresql://evstore:e@{server}/no_such_db_s41j", 'database "no_such_db_s41j" does not exist'),
    ):
        done = evstore("stats", "--url", url)
        assert done.returncode == 1, done.stderr
        assert f"postgresql://evstore:***@{server}" in done.stderr, done.stderr
        assert words in done.stderr, done.stderr
