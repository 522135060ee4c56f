"""Typed errors with stable codes.

Every error the store raises on purpose is an :class:`EvstoreError` with a ``code`` that
scripts can match on. Where OpenStack Placement has a code for the same condition we reuse
it (``placement.*``); conditions Placement does not name get an ``evstore.*`` code.
"""

from __future__ import annotations

import ast
import re
import sys
from typing import Any, ClassVar
from urllib.parse import unquote, unquote_plus, urlsplit

#: digits past which an integer is not written out in a message (one this long is no value anyone
#: meant): its number of digits is given instead
_SHOWN_DIGITS = 40


def shown(value: object, limit: int = 80) -> str:
    """``repr(value)`` for a message: cut to ``limit`` characters with an ellipsis when longer (a
    cut quote would read as the whole value); an integer of more than 40 digits said to be one of
    so many digits - or of more than Python's int-to-text limit (4,300 by default), past which its
    ``repr`` raises ``ValueError``; a value whose ``repr`` fails named by its type."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**_SHOWN_DIGITS:
        most = sys.get_int_max_str_digits()
        if most and abs(value) >= 10**most:
            return f"an integer of more than {most} digits"
        return f"an integer of {len(str(abs(value)))} digits"
    try:
        text = repr(value)
    except Exception:  # (a caller's object: its __repr__ may fail)
        return f"a {type(value).__name__}"
    return text if len(text) <= limit else text[:limit] + "…"


class EvstoreError(Exception):
    """Base of every error evstore raises on purpose.

    ``code`` is stable across releases; ``message`` is for people; ``details`` carries the
    machine-readable facts (uuids, amounts, positions) behind the message.
    """

    code: ClassVar[str] = "evstore.error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def __str__(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class InvalidInput(EvstoreError, ValueError):
    """An argument to a store method is malformed (bad uuid, amount, name, class...)."""

    code = "evstore.invalid_input"


class UnknownResourceClass(InvalidInput):
    """A resource class that is neither standard nor a created ``CUSTOM_*`` class."""

    code = "evstore.resource_class.unknown"


class NotFound(EvstoreError):
    """The thing asked for does not exist (e.g. releasing a consumer that holds nothing)."""

    code = "evstore.not_found"


class ProviderNotFound(NotFound):
    code = "placement.resource_provider.not_found"


class ConcurrentUpdate(EvstoreError):
    """A generation (optimistic-concurrency token) did not match."""

    code = "placement.concurrent_update"


class ConsumerDeleted(EvstoreError):
    """The command would give allocations to (or act for) a tombstoned consumer."""

    code = "evstore.consumer.deleted"


class CapacityExceeded(EvstoreError):
    code = "evstore.allocation.capacity_exceeded"


class ConstraintViolation(EvstoreError):
    """An amount violates min_unit, max_unit or step_size of the inventory."""

    code = "evstore.allocation.constraint_violation"


class InvalidInventory(EvstoreError):
    """No usable inventory for an allocation, or an inventory record that cannot be.

    Refusing an allocation, ``details`` name the ``providers`` and ``resource_classes`` (lists:
    one check names several), and ``provider`` and ``resource_class`` when one row decided."""

    code = "evstore.inventory.invalid"


class InvalidInventoryValue(InvalidInput, InvalidInventory):
    """An inventory record whose fields cannot describe a real inventory (reserved > total...)."""

    code = "evstore.inventory.invalid"


class InventoryInUse(EvstoreError):
    """Removing inventory that allocations hold: ``details`` name the ``provider`` and the
    ``resource_classes`` in use (and ``resource_class`` from ``delete_inventory``)."""

    code = "placement.inventory.inuse"


class ProviderInUse(EvstoreError):
    code = "placement.resource_provider.inuse"


class CannotDeleteParent(EvstoreError):
    code = "placement.resource_provider.cannot_delete_parent"


class DuplicateName(EvstoreError):
    code = "placement.duplicate_name"


class IdempotencyConflict(EvstoreError):
    """An idempotency key was reused for a different command."""

    code = "evstore.idempotency.conflict"


class StorageError(EvstoreError):
    """The storage backend failed (locked too long, disk error, lost connection...)."""

    code = "evstore.storage"


class CorruptEvent(StorageError):
    """A stored event row cannot be decoded. ``details['position']`` names it."""

    code = "evstore.log.corrupt"


class ProjectionCorrupt(StorageError):
    """A row of the persisted projection cannot be read; ``evstore rebuild`` refolds it from the log."""

    code = "evstore.projection.corrupt"


class SchemaVersionError(StorageError):
    """The database or an event was written by a newer, unknown schema version."""

    code = "evstore.schema.version"


class StoreClosed(EvstoreError):
    code = "evstore.store.closed"


class WrongEventLoop(EvstoreError):
    """A store was used from an event loop other than the one that opened it (its queue, futures
    and connections belong to that loop)."""

    code = "evstore.store.wrong_loop"


#: a URL's scheme, and its ":"
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
#: a SQLite URL's userinfo password, as redaction finds one (the user after "://", then ":")
_USERINFO_START = re.compile(r"://[^:/@]*:")
#: (libpq escapes a quote or a backslash in a quoted value, a space in a bare one, with a backslash:
#: the value goes on past them; a quote never closed hides the rest of the text). A URL query's
#: parameter (after "?" or "&") ends at the next "&" only (``parse_qsl`` reads ``password=ab cd``
#: as ``ab cd``); a keyword string's bare value at a space as libpq reads one, C's isspace() - a
#: no-break or an em space is one of its characters, as "&" is (``password=ab&cd``: ``ab&cd``)
#: the libpq keywords whose value is a secret (PostgreSQL 18: an OAuth client's secret, and the
#: SCRAM keys, which log in as the password does): hidden wherever password is
SECRET_KEYWORDS = ("password", "sslpassword", "oauth_client_secret", "scram_client_key", "scram_server_key")
_SECRET_KEYWORD = r"(?:(?:ssl)?password|oauth_client_secret|scram_(?:client|server)_key)"
#: What follows a password's value and is no parameter - a URL query's "&" pieces without "=", a
#: keyword string's words without one, or text right after a quoted value - is the rest of a
#: password written with an unencoded "&", a space or a quote (``password=ab&cd&sslmode=require``:
#: "bad query field: 'cd'"; ``password=ab cd dbname=x``): the third group, hidden too.
_QUERY_PASSWORD = re.compile(
    r"(?i)(?<=[?&])("
    + _SECRET_KEYWORD
    + r"\s*=\s*)('(?:[^'\\]|\\.?)*(?:'|$)(?:[^&\\]|\\.?)*|(?:[^&\\]|\\.?)*)"
    + r"((?:&[^&=]*(?=&|$))*)"
)
#: what parts the pieces of the third group
_PIECE_SEPARATORS = re.compile(r"[& \t\n\r\f\v]+")
_KEYWORD_PASSWORD = re.compile(
    r"(?i)(?<![?&])\b("
    + _SECRET_KEYWORD
    + r"\s*=\s*)('(?:[^'\\]|\\.?)*(?:'|$)|(?:[^ \t\n\r\f\v\\]|\\.?)*)"
    + r"([^ \t\n\r\f\v]*(?:[ \t\n\r\f\v]+[^ \t\n\r\f\v=]+(?=[ \t\n\r\f\v]|$)(?![ \t\n\r\f\v]*=))*)"
)


#: the schemes evstore knows: in a text without "//" after its first ":" (``postgresql:u:pw@h``),
#: the word before is the scheme; any other word may be a user name (``u:pw@h``)
_KNOWN_SCHEMES = ("sqlite:", "postgresql:", "postgres:")
#: the end of a URL's host part (urlsplit's netloc), and of a URL's path
_HOST_PART_END = re.compile(r"[/?#]")
#: a host part that reads as hosts and ports only (``h``, ``h:5432``, ``[::1]:5432``,
#: ``h1:5432,h2:5433``, ``%2Ftmp``): no user name, no password with a "/", "?" or "#" cut off
#: after it (a port that is no number, a character no host name holds)
_SOUND_HOST = r"(?:\[[\w:.%-]*\]|[\w.~%-]*)(?::[0-9]*)?"
_SOUND_HOSTS = re.compile(rf"{_SOUND_HOST}(?:,{_SOUND_HOST})*")


def _userinfo_end(url: str, start: int, host_end: int) -> int:
    """The last "@" of ``url`` that may end its userinfo (-1: none), the host part running from
    ``start`` to ``host_end``: the host part's last (urlsplit's; asyncpg's is its first), the first
    before a "/" (libpq's, which reads on past "?" and "#"), and any later one - a password with an
    unencoded "/", "?" or "#" ends the host part early (``u:p@ss/x@h/db``: the password is
    ``p@ss/x``) - but one in a query parameter's value (after its "=", no "/" after it in that
    parameter: ``?application_name=a@b``, ``?user=me@srv``) of a URL whose host part is sound (it
    holds the userinfo's "@", or reads as hosts and ports only): that "@" is the query's."""
    last = url.rfind("@")
    if last < host_end or not (
        url.find("@", start, host_end) >= 0 or _SOUND_HOSTS.fullmatch(url, start, host_end)
    ):
        return last
    slash = url.find("/", start)
    libpq = url.find("@", start, slash if slash >= 0 else len(url))
    query = url.find("?", host_end)
    fragment = url.find("#", host_end)
    if query < 0 or 0 <= fragment < query:
        return last  # (no query: a path's or a fragment's "@" is taken for the password's)
    query_end = fragment if fragment >= 0 else len(url)
    found = max(libpq, url.rfind("@", 0, query), url.rfind("@", query_end))
    begin = query + 1
    while begin <= query_end:
        end = url.find("&", begin, query_end)
        end = end if end >= 0 else query_end
        equals = url.find("=", begin, end)
        own_from = max(equals, url.rfind("/", begin, end)) if equals >= 0 else end
        found = max(found, url.rfind("@", begin, own_from))
        begin = end + 1
    return found


def _userinfo_passwords(url: str) -> list[tuple[int, int]]:
    """Where ``url``'s userinfo password is written (start, end), at most once: from the user's ":"
    to the "@" that ends the userinfo (:func:`_userinfo_end`). The user's ":" is the first after
    the scheme's (``postgresql://u:pw@h``), also when the user holds an "@" (Azure's
    ``user@server:pw@host``, which urlsplit reads so) or the "//" was mistyped
    (``postgresql:/u:pw@h``, ``postgresql:u:pw@h``, ``//u:pw@h``: the scheme's own ":" when no
    other comes before the "@", ``postgresql:pw@h``); a text without "//" whose first word is no
    scheme evstore knows starts with the user (``u:pw@h:5432/db``: its first ":" is the user's).
    The password may hold a line break (urlsplit drops it) or an unencoded "/" or "@". Only the
    password is hidden in a sound URL (an "@" in its query is the query's:
    ``h:5432/db?application_name=a@b``); more than the password in odd cases, never less. A
    SQLite URL's file name may hold ":" and "@": there (after ``sqlite://``) the user's ":" is that
    of a ``://[^:/@]*:`` match. (Found in linear time: the pattern ``(://[^:/@]*):(.*)@``, tried again
    at every "://" of a text with many and no "@", read the rest of the text each time - 40 KB
    took 1 s.)"""
    if "@" not in url:
        return []
    scheme = _SCHEME.match(url)
    after = scheme.end() if scheme else 0
    start = after
    while start < len(url) and url[start] in "/\\":
        start += 1
    host_end = _HOST_PART_END.search(url, start)
    at = _userinfo_end(url, start, host_end.start() if host_end else len(url))
    name = scheme.group().lower() if scheme else ""
    if name == "sqlite:" and url.startswith("//", after):  # (not sqlite:u:pw@x.db, which holds no path)
        found = _USERINFO_START.search(url, 0, at)
        colon = found.end() - 1 if found else -1
    elif scheme and start == after and name not in _KNOWN_SCHEMES:
        colon = after - 1  # ("u:pw@h", "u:p:w@h": the first ":" is the user's)
    else:
        colon = url.find(":", start, at)
        if colon < 0 and scheme and not url.startswith("/", after):
            colon = after - 1  # ("postgresql:pw@h": no user)
    return [(colon + 1, at)] if 0 <= colon < at else []


#: a value a parser's message quotes, as Python's repr writes it: in single quotes, or in double
#: quotes when it holds a single one, with backslash escapes (the pattern ``'(?:[^'\\\n]|\\.)*'``
#: and its double-quoted twin, matched in linear time by :func:`_quoted_spans`)
_QUOTE_CHARS = re.compile("['\"]")


def _quoted_spans(text: str) -> list[tuple[int, int]]:
    """Where ``text`` quotes values (start, end), as ``re.finditer`` of the pattern above would
    find them, in linear time: that pattern, tried again at every quote of a text holding many
    escaped ones and no closing one, read the rest of the line each time (24 KB: 2 s). A quote's
    value, read from one place, ends where it does read from any other place its reading passes
    through: each place's closing quote (or -1: none before the line ends) is worked out once,
    from the text's end."""
    if _QUOTE_CHARS.search(text) is None:
        return []
    n = len(text)
    closing: dict[str, list[int]] = {}
    for quote in "'\"":
        ends = [-1] * (n + 2)
        for i in range(n - 1, -1, -1):
            char = text[i]
            if char == quote:
                ends[i] = i
            elif char == "\\":
                ends[i] = ends[i + 2] if i + 1 < n and text[i + 1] != "\n" else -1
            elif char != "\n":
                ends[i] = ends[i + 1]
        closing[quote] = ends
    spans: list[tuple[int, int]] = []
    pos = 0
    while (m := _QUOTE_CHARS.search(text, pos)) is not None:
        start = m.start()
        end = closing[m.group()][start + 1]
        if end < 0:
            pos = start + 1
        else:
            spans.append((start, end + 1))
            pos = end + 1
    return spans


#: where a parser may cut a URL (a password with one of these unencoded is cut in pieces)
_URL_DELIMITERS = re.compile(r"[/?#@:\[\],]")


def url_secrets(url: str) -> list[str]:
    """The passwords in a store URL (or libpq keyword string), as :func:`redact_url` finds them,
    and as a URL parser does (a later "@" may widen the former: :func:`_userinfo_end`)."""
    found = [url[start:end] for start, end in _userinfo_passwords(url)]
    for m in (m for p in (_QUERY_PASSWORD, _KEYWORD_PASSWORD) for m in p.finditer(url)):
        found.append(m.group(2).strip("'"))
        if m.group(3):  # (the rest of a password with an unencoded "&", space or quote: each piece)
            found += [url[m.start(2) : m.end(3)], *_PIECE_SEPARATORS.split(m.group(3).strip("'"))]
    try:
        found.append(urlsplit(url).password or "")
    except ValueError:  # (no URL a parser takes: the patterns above are all there is)
        pass
    # (as the driver reads them too: %-decoded - and a query's "+" a space)
    found += [decoded for secret in found for decoded in (unquote(secret), unquote_plus(secret))]
    return [secret for secret in dict.fromkeys(found) if secret]


def _secret_spans(url: str) -> list[tuple[int, int]]:
    """Where in ``url`` its passwords are written (as :func:`redact_url` finds them: they cover
    what a URL parser takes for the password)."""
    spans = _userinfo_passwords(url)
    spans += [(m.start(2), m.end(3)) for p in (_QUERY_PASSWORD, _KEYWORD_PASSWORD) for m in p.finditer(url)]
    return [(start, end) for start, end in spans if end > start]


def _unquoted(literal: str) -> str:
    """The value a quoted ``literal`` in a message stands for (a repr's escapes undone)."""
    try:
        value = ast.literal_eval(literal)
    except (ValueError, SyntaxError):
        return literal[1:-1]
    return value if isinstance(value, str) else literal[1:-1]


def _in_secrets(url: str, spans: list[tuple[int, int]]) -> list[int]:
    """For each offset ``i`` of ``url``, how many of its first ``i`` characters are inside a password
    span: a piece ``[a, b)`` overlaps one iff ``count[b] - count[a] > 0`` - each place a quoted value
    stands in the URL is checked at once, not against every span (a URL of many ``password=``
    parameters made that quadratic)."""
    depth = [0] * (len(url) + 1)
    for begin, end in spans:
        depth[begin] += 1
        depth[end] -= 1
    count = [0] * (len(url) + 1)
    inside = total = 0
    for i in range(len(url)):
        inside += depth[i]
        total += inside > 0
        count[i + 1] = total
    return count


def _holds_a_secret(
    value: str, url: str, secrets: _Substrings, count: list[int], where: _InUrl | None = None
) -> bool:
    """Whether ``value``, quoted by a parser's message about ``url``, shows any of a password: where
    it is written in the URL, it overlaps a password there (a parser that cuts the URL elsewhere
    than at its "@" quotes a piece of the password, or one with more of the URL after it: "Port
    could not be cast to integer value as 'pass'", asyncpg's "invalid literal for int() with
    base 10: 'word@db.example:5432'"); a value the URL does not hold as written (decoded, pieced
    together) is hidden when it, or a piece of it between the URL's delimiters, is part of one.
    (``where``, for a message quoting many values: the URL's places looked up in its automata,
    not searched for each value.)"""
    if not value:
        return False
    if where is not None and "\x00" not in value:
        places = where.url.occurrences(value)
        if places:
            return places > where.free.occurrences(value)
        pieces = [value, *(piece for piece in _URL_DELIMITERS.split(value) if piece)]
        return any(piece in secrets for piece in pieces)
    start = url.find(value)
    if start < 0:
        pieces = [value, *(piece for piece in _URL_DELIMITERS.split(value) if piece)]
        return any(piece in secrets for piece in pieces)
    while start >= 0:
        if count[start + len(value)] > count[start]:
            return True
        start = url.find(value, start + 1)
    return False


class _Substrings:
    """Whether a text is part of any of some secrets, answered in the text's length (a suffix
    automaton of the secrets, each followed by a NUL: a text holding one may be found across two
    secrets, and hidden, which is too much, not too little). Looking every piece up in every
    secret made a message quoting many values about a URL of many passwords quadratic. Built at
    the first look-up."""

    def __init__(self, secrets: list[str]) -> None:
        self._secrets = secrets
        self._next: list[dict[str, int]] = []
        self._places: list[int] = []  # (how many times each state's texts are in the secrets)

    def _build(self) -> None:
        self._next = [{}]
        link = [-1]
        length = [0]
        places = [0]
        last = 0
        for char in "".join(secret + "\x00" for secret in self._secrets):
            node = len(length)
            self._next.append({})
            length.append(length[last] + 1)
            link.append(0)
            places.append(1)
            state = last
            while state >= 0 and char not in self._next[state]:
                self._next[state][char] = node
                state = link[state]
            if state >= 0:
                same = self._next[state][char]
                if length[state] + 1 == length[same]:
                    link[node] = same
                else:
                    clone = len(length)
                    self._next.append(dict(self._next[same]))
                    length.append(length[state] + 1)
                    link.append(link[same])
                    places.append(0)
                    while state >= 0 and self._next[state].get(char) == same:
                        self._next[state][char] = clone
                        state = link[state]
                    link[same] = link[node] = clone
            last = node
        for state in sorted(range(1, len(length)), key=length.__getitem__, reverse=True):
            places[link[state]] += places[state]  # (a state's texts end wherever a longer one's do)
        self._places = places

    def _state(self, text: str) -> int:
        if not self._next:
            self._build()
        state = 0
        for char in text:
            found = self._next[state].get(char)
            if found is None:
                return -1
            state = found
        return state

    def __contains__(self, text: str) -> bool:
        return self._state(text) >= 0

    def occurrences(self, text: str) -> int:
        """How many times ``text`` (not empty) is in the secrets, overlapping ones each."""
        state = self._state(text)
        return self._places[state] if state >= 0 else 0


class _InUrl:
    """Where values are in a URL, for a message quoting many: how many times each is in the URL
    and in its text outside the passwords (a NUL in place of each of their characters) - a value
    in the URL more often than outside them overlaps one. Searching the URL for each value made
    a message quoting many distinct ones quadratic."""

    def __init__(self, url: str, count: list[int]) -> None:
        self.url = _Substrings([url])
        self.free = _Substrings(
            ["".join("\x00" if count[i + 1] > count[i] else char for i, char in enumerate(url))]
        )


#: distinct values a message quotes that are searched for in the URL each; past them, the URL's
#: automata (:class:`_InUrl`) answer
_SEARCHED_VALUES = 32


def _shown_secrets(text: str, secrets: list[str]) -> list[tuple[int, int]]:
    """Where ``text`` shows one of ``secrets`` (start, end): one of :data:`_WORDLIKE_SECRET`
    characters or more wherever its text is, a shorter one where no letter or digit is next to it;
    overlapping ones each. Found in one pass over the text for them all (Aho-Corasick): a search
    of the text for each secret made redaction quadratic in their number (a URL of 4,000
    ``password=`` parameters, quoted by its message: 0.6 s). Each place keeps the longest secret
    that ends there, which covers the others (a short one must also have no letter or digit
    before it: the longest of those that do). A long one - a few, at most, in a URL - is searched
    for on its own, in C, which a trie of it in Python is slower than (a value of 1 MB); so are
    all, when they are few (the usual one or two: a pass in Python over a long text is slower)."""
    spans: list[tuple[int, int]] = []
    few = sum(len(secret) <= _TRIE_SECRET for secret in secrets) <= _SEARCHED_SECRETS
    for secret in secrets:
        if len(secret) >= _WORDLIKE_SECRET and (few or len(secret) > _TRIE_SECRET):
            at = text.find(secret)
            while at >= 0:
                spans.append((at, at + len(secret)))
                at = text.find(secret, at + 1)
        elif few:
            pattern = rf"(?<![^\W_])(?={re.escape(secret)}(?![^\W_]))"
            spans += [(m.start(), m.start() + len(secret)) for m in re.finditer(pattern, text)]
    if few:
        return spans
    goto: list[dict[str, int]] = [{}]
    longest = [0]
    short: set[str] = set()
    for secret in (secret for secret in secrets if len(secret) <= _TRIE_SECRET):
        node = 0
        for char in secret:
            found = goto[node].get(char)
            if found is None:
                found = len(goto)
                goto[node][char] = found
                goto.append({})
                longest.append(0)
            node = found
        longest[node] = len(secret)
        if len(secret) < _WORDLIKE_SECRET:
            short.add(secret)
    fail = [0] * len(goto)
    level = list(goto[0].values())  # (breadth first: a node's fallback is shallower, done before it)
    while level:
        deeper: list[int] = []
        for node in level:
            longest[node] = max(longest[node], longest[fail[node]])
            for char, child in goto[node].items():
                back = fail[node]
                while back and char not in goto[back]:
                    back = fail[back]
                found = goto[back].get(char, 0)
                fail[child] = found if node and found != child else 0
                deeper.append(child)
        level = deeper
    node = 0
    for end, char in enumerate(text, 1):
        while node and char not in goto[node]:
            node = fail[node]
        node = goto[node].get(char, 0)
        size = longest[node]
        if size >= _WORDLIKE_SECRET:
            spans.append((end - size, end))
        elif size and not (end < len(text) and text[end].isalnum()):  # ([^\W_]: a letter or digit)
            for start in range(end - size, end):
                if text[start:end] in short and not (start and text[start - 1].isalnum()):
                    spans.append((start, end))
                    break
    return spans


def redact_text(text: str, url: str) -> str:
    """``text`` - a parser's or driver's message about ``url`` - with the URL's passwords hidden:
    each one, and any value the text quotes that shows any of one (:func:`_holds_a_secret`).
    Hides too much rather than too little."""
    secrets = url_secrets(url)
    if not secrets:
        return text
    count: list[int] = []  # (made at the first quoted value: see _in_secrets)
    index = _Substrings(secrets)

    holds: dict[str, bool] = {}  # (a value quoted many times is looked for in the URL once)

    where: list[_InUrl] = []  # (made past the first _SEARCHED_VALUES values)

    def quoted(literal: str) -> str:
        value = _unquoted(literal)
        if value not in holds:
            if not count:
                count.extend(_in_secrets(url, _secret_spans(url)))
            if len(holds) >= _SEARCHED_VALUES and not where:
                where.append(_InUrl(url, count))
            holds[value] = _holds_a_secret(value, url, index, count, where[0] if where else None)
        return "'***'" if holds[value] else literal

    quoted_at = {span for span in _quoted_spans(text) if quoted(text[slice(*span)]) != text[slice(*span)]}
    hidden = list(quoted_at) + _shown_secrets(text, secrets)
    pieces: list[str] = []
    done = 0
    for start, end in sorted(hidden):
        if start > done or not pieces:
            pieces += [text[done:start], "***" if (start, end) not in quoted_at else "'***'"]
        done = max(done, end)
    return "".join(pieces) + text[done:]


#: a password longer than this is searched for on its own (:func:`_shown_secrets`), and all of
#: them when no more than _SEARCHED_SECRETS are not
_TRIE_SECRET = 64
_SEARCHED_SECRETS = 8
#: a password at least this long is hidden wherever its text appears, inside a word too
_WORDLIKE_SECRET = 4


def redact_url(url: str) -> str:
    """A store URL (or a libpq keyword string) fit for a message or a log: every password
    hidden, wherever it is written (``user:secret@``, ``?password=``, ``password=...``), also in
    text no URL parser accepts (a password with an unencoded ``/`` or ``@``). Hides more than the
    password in odd cases (up to a later ``@``: :func:`_userinfo_end`), never less. A password's
    text is hidden where else the URL holds it too, as :func:`redact_text` hides it in a message
    (``postgresql://u:127@127.0.0.1/db``: ``***@***.0.0.1``): a message that hid it in the host it
    quotes (``Connect call failed ('***.0.0.1', 1)``) beside a URL that showed the host told
    the password."""
    spans = _userinfo_passwords(url)  # (all found on the URL as given; an empty one shown as *** too)
    spans += [(m.start(2), m.end(3)) for p in (_QUERY_PASSWORD, _KEYWORD_PASSWORD) for m in p.finditer(url)]
    if spans:
        spans += _shown_secrets(url, url_secrets(url))
    pieces: list[str] = []
    done = 0
    for start, end in sorted(spans):
        if start > done or not pieces:
            pieces += [url[done:start], "***"]
        done = max(done, end)
    return "".join(pieces) + url[done:]
