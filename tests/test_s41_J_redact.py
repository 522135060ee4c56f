"""Stop 41, helper J: a short password hidden where it is the password, not wherever its letters
appear (evstore.errors.redact_text; helper J's finding, fixed by the lead after its suggestion: a
password of 4 characters or more is still hidden wherever its text appears)."""

from __future__ import annotations

import os
import re

import pytest

from tests.test_cli_support import evstore


def test_a_one_letter_password_is_hidden_in_the_url_not_inside_the_words_of_a_message() -> None:
    """(no server needed: the URL parser's own message about a malformed port)"""
    done = evstore("stats", "--url", "postgresql://evstore:t@127.0.0.1:5432:99999/x")
    assert done.returncode == 1, done.stderr
    # the password hidden in the URL shown
    assert "postgresql://evstore:***@127.0.0.1" in done.stderr, done.stderr
    # and nowhere else: the parser's words as it wrote them, the quoted port shown
    assert "Port could not be cast to integer value" in done.stderr, done.stderr


@pytest.mark.skipif(not os.environ.get("EVSTORE_TEST_POSTGRES_URL"), reason="needs EVSTORE_TEST_POSTGRES_URL")
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


def test_a_short_password_is_still_hidden_wherever_it_stands_as_a_value() -> None:
    from evstore.errors import redact_text

    url = "postgresql://evstore:t@db.example:5432/x"
    said = redact_text("connect to postgresql://evstore:t@db.example failed: password=t, 't'; try later", url)
    assert "evstore:***@db.example" in said and "password=***" in said, said
    assert "'t'" not in said and "try later" in said, said  # (a quoted value too; words left whole)


def test_a_password_of_four_characters_or_more_is_hidden_inside_words_too() -> None:
    from evstore.errors import redact_text

    url = "postgresql://evstore:hunter2@db.example/x"
    said = redact_text(
        "role evstorehunter2x: hunter2 refused at postgresql://evstore:hunter2@db.example", url
    )
    assert "hunter2" not in said, said
