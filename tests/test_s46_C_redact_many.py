"""Stop 46, helper C: redaction linear in the number of passwords.

``errors.redact_text`` searched the text once for each of the URL's passwords: a URL (or libpq
keyword string) of many distinct ``password=`` parameters, quoted whole by its message, took time
quadratic in their number (4,000: 0.6 s; 8,000: 4.4 s; 40,000: minutes). They are now all found
in one pass over the text (``_shown_secrets``, checked here against a search for each one), and a
quoted value's pieces are looked up in a suffix automaton of the passwords (``_Substrings``), not
in each password in turn."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

from hypothesis import given, settings
from hypothesis import strategies as st

from evstore import errors

_ALPHABET = "ab:@/ é1_"


def _covered(text: str, spans: list[tuple[int, int]]) -> set[int]:
    return {i for start, end in spans for i in range(start, end)}


def _each_secret(text: str, secrets: list[str]) -> list[tuple[int, int]]:
    """(the rule, one secret at a time, each place it is: a short one with no letter or digit
    next to it)"""
    spans = []
    for secret in secrets:
        if len(secret) >= errors._WORDLIKE_SECRET:
            pattern = f"(?={re.escape(secret)})"
        else:
            pattern = rf"(?<![^\W_])(?={re.escape(secret)}(?![^\W_]))"
        spans += [(m.start(), m.start() + len(secret)) for m in re.finditer(pattern, text)]
    return spans


@settings(max_examples=400, deadline=None)
@given(
    st.text(_ALPHABET, max_size=40),
    st.lists(st.text(_ALPHABET, min_size=1, max_size=6), min_size=1, max_size=8),
)
def test_one_pass_hides_what_a_search_for_each_secret_finds(text: str, secrets: list[str]) -> None:
    """(both ways: a search for each when they are few, one pass when they are many)"""
    few = errors._SEARCHED_SECRETS
    for errors._SEARCHED_SECRETS in (few, 0):
        try:
            found = errors._shown_secrets(text, secrets)
        finally:
            errors._SEARCHED_SECRETS = few
        assert _covered(text, found) == _covered(text, _each_secret(text, secrets))
        assert all(text[start:end] in secrets for start, end in found)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(_ALPHABET, min_size=1, max_size=8), min_size=1, max_size=6),
    st.text(_ALPHABET, max_size=5),
)
def test_the_substring_index_answers_as_each_secret_does(secrets: list[str], piece: str) -> None:
    index = errors._Substrings(secrets)
    assert (piece in index) == any(piece in secret for secret in secrets)
    for secret in secrets:
        assert all(secret[i:j] in index for i in range(len(secret)) for j in range(i, len(secret) + 1))


def test_a_message_quoting_a_url_of_many_passwords_hides_each() -> None:
    url = "postgresql://u:FIRSTpw@h/db?" + "&".join(f"password=v{i:04d}" for i in range(2000))
    said = errors.redact_text(f"invalid DSN: {url} ('v0007' and 'v1999x')", url)
    assert "FIRST" not in said and "v0" not in said and "v1" not in said, said[:300]
    assert said.startswith("invalid DSN: postgresql://u:***@h/db?password=***&password=***&")


def test_many_distinct_passwords_do_not_hang() -> None:
    script = textwrap.dedent(
        """
        from evstore import errors
        url = "postgresql://h/db?" + "&".join(f"password=v{i:06d}" for i in range(40_000))
        keywords = " ".join(f"password=v{i:06d}" for i in range(40_000))
        a = errors.redact_text(f"invalid DSN: {url}", url)
        b = errors.redact_text(f"bad conninfo: {keywords}", keywords)
        print("v0" in a or "v0" in b)
        """
    )
    # (about 2 s; a search of the text for each password took minutes: no run near the limit)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    assert ran.stdout.strip() == "False", ran.stderr


@settings(max_examples=300, deadline=None)
@given(
    st.text("ab:@/p=&?", min_size=1, max_size=30).map(lambda rest: "postgresql://u:" + rest),
    st.lists(st.text("ab:@/p=&?", min_size=1, max_size=6), min_size=1, max_size=6),
)
def test_a_value_looked_up_in_the_urls_automata_is_hidden_as_one_searched_for(
    url: str, values: list[str]
) -> None:
    """(past the first _SEARCHED_VALUES distinct values a message quotes, the URL is no longer
    searched for each: the same answer, from the counts of its places in and outside the passwords)"""
    count = errors._in_secrets(url, errors._secret_spans(url))
    secrets = errors._Substrings(errors.url_secrets(url))
    where = errors._InUrl(url, count)
    for value in values + [url[i:j] for i in range(0, len(url), 3) for j in range(i + 1, len(url) + 1, 4)]:
        searched = errors._holds_a_secret(value, url, secrets, count)
        assert errors._holds_a_secret(value, url, secrets, count, where) == searched, (url, value)


def test_a_message_quoting_many_values_hides_those_that_show_a_password() -> None:
    url = "postgresql://u:FIRSTpw@h/db?" + "&".join(f"password=v{i:04d}" for i in range(200))
    values = [f"v{i:04d}" for i in range(200)] + [f"h/db{i}" for i in range(100)] + ["FIRSTp", "h/db"]
    said = errors.redact_text(" ".join(repr(value) for value in values), url)
    assert said.count("'***'") == 201 and "'h/db'" in said, said[-200:]
