"""Stop 45, helper J's review of errors.py's redaction (a334ee8): the prefix count ``_in_secrets``
answers, for every piece of the URL, what the walk over every password span it replaced did
(checked against that walk on generated spans; the parent commit's redact_url/redact_text were
compared with a334ee8's on 50,000 generated URLs and messages by hand: none showed more of a
password)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from evstore.errors import _in_secrets, _secret_spans, redact_text


def _walk(start: int, length: int, spans: list[tuple[int, int]]) -> bool:
    # (the check a334ee8 replaced, span by span)
    return any(start < end and begin < start + length for begin, end in spans)


@st.composite
def _cases(draw: st.DrawFn) -> tuple[int, list[tuple[int, int]], int, int]:
    n = draw(st.integers(1, 40))
    spans = [
        (a, b)
        for a, b in draw(st.lists(st.tuples(st.integers(0, n), st.integers(0, n)).map(sorted), max_size=6))
        if b > a  # (_secret_spans keeps no empty one)
    ]
    start = draw(st.integers(0, n - 1))
    return n, spans, start, draw(st.integers(1, n - start))


@settings(max_examples=300, deadline=None)
@given(_cases())
def test_the_prefix_count_answers_as_the_walk_over_every_span(
    case: tuple[int, list[tuple[int, int]], int, int],
) -> None:
    n, spans, start, length = case
    count = _in_secrets("x" * n, spans)
    assert (count[start + length] > count[start]) == _walk(start, length, spans)


def test_a_quoted_piece_across_two_passwords_is_hidden_whole() -> None:
    url = "postgresql://u:FIRSTpw@h:5432/db?password=SECONDpw&sslmode=require"
    assert all(end > begin for begin, end in _secret_spans(url))
    text = f"invalid literal for int() with base 10: {url[15:60]!r}"
    shown = redact_text(text, url)
    assert "FIRST" not in shown and "SECOND" not in shown and "'***'" in shown, shown
