"""The ``evstore`` command line: run the demo cloud, audit a store, debug it from its log, and
clear a leak the audit found (``release``, ``confirm-migration``: the API calls its message names).

Every command names its store with ``--db PATH`` (SQLite file), ``--url URL`` (``sqlite:///...``
or ``postgresql://...``) or the ``EVSTORE_URL`` environment variable. Output is a readable table by
default and JSON with ``--json``. Exit status: 0 success (a clean audit), 1 error, 2 usage error,
3 audit findings. A usage error is a command line that is wrong in itself (an option missing, unknown,
empty or conflicting, a number out of range); what evstore finds wrong in a value it was given -
a missing file, a directory, a malformed uuid - is an error (1). An error is one line on stderr,
``error: <code>: <message>``, never a traceback.
"""

from __future__ import annotations

import asyncio
import bisect
import codecs
import collections
import contextlib
import errno
import functools
import io
import json
import logging
import os
import re
import shlex
import shutil
import signal
import sqlite3
import stat
import sys
import tempfile
import threading
import unicodedata
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, Unpack

import structlog
import typer
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from typer._click.core import Command
from typer._click.exceptions import ClickException, NoArgsIsHelpError, NoSuchOption, UsageError
from typer.core import TyperArgument, TyperCommand, TyperGroup

from evstore import errors as err
from evstore.logs import get_logger

if TYPE_CHECKING:
    from evstore.store import AllocationStore, StoreOptions
    from projections.audit import AuditReport
    from projections.state import State

#: the largest position, evstore.log.MAX_POSITION (tests/test_cli_probe_33.py checks they agree),
#: written out so that the options are declared without loading the log and its models: pydantic
#: and the projections are imported once a command runs, not for `--help` or a usage error
MAX_POSITION = 2**63 - 1

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FINDINGS = 3
#: an import stopped by SIGTERM (128 + its number, as a shell reports a process it ended)
EXIT_TERMINATED = 128 + signal.SIGTERM

DEFAULT_DEMO_DB = Path("evstore-demo.db")

app = typer.Typer(
    name="evstore",
    help="Event-sourced allocation store: demo, audit, replay debugging, clearing a leak.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _Argument(TyperArgument):
    """An argument given a metavar is shown by it alone (``UUID``): typer added its Python type,
    "uuid <str>", in the help of every argument - a type, not what to give."""

    def display_type_rich(self, ctx: Any) -> str | None:
        return None if self.metavar is not None else super().display_type_rich(ctx)


class _Command(TyperCommand):
    """The commands' class: their arguments are :class:`_Argument`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = _Argument


# (a str, not a click Path: the CLI checks paths itself, so that a missing file, a directory and
# an empty value get the same code and exit status whichever option or argument names them)
DbOption = Annotated[
    str | None, typer.Option("--db", help="SQLite database file.", metavar="<file>", show_default=False)
]
UrlOption = Annotated[
    str | None,
    typer.Option(
        "--url",
        help="Store URL (sqlite:///path.db, postgresql://...); default $EVSTORE_URL.",
        metavar="<url>",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


# --- plumbing -----------------------------------------------------------------------------------


class _LibraryLog(logging.Handler):
    """The libraries' own log lines (asyncpg's pool while a server restarts: "Failed to restore
    the pool connection floor; retrying") as one line each on stderr, the exception named in it;
    its traceback only with -vv. (Unhandled, Python printed each with its traceback.)"""

    def __init__(self, tracebacks: bool) -> None:
        super().__init__()
        self.tracebacks = tracebacks

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = visible(record.getMessage())
            exc = record.exc_info[1] if record.exc_info else None
            if exc is not None and not self.tracebacks:
                why = str(exc).splitlines()[0] if str(exc).strip() else ""
                text += f" ({type(exc).__name__}{': ' if why else ''}{visible(why)})"
            elif exc is not None:
                text += "\n" + logging.Formatter().formatException(record.exc_info).rstrip()  # type: ignore[arg-type]
            print(f"{record.levelname.lower()}: {record.name}: {text}", file=sys.stderr, flush=True)
        except Exception:
            # (handleError writes to stderr too, and lets a closed one's ValueError through: raised
            # from asyncio's "Using selector" line at -vv, it failed the event loop's making)
            with contextlib.suppress(Exception):
                self.handleError(record)


def configure_logging(verbosity: int) -> None:
    """structlog to stderr: WARNING by default, INFO with -v, DEBUG with -vv; the libraries'
    logging likewise, one line a record (:class:`_LibraryLog`)."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _LibraryLog)]:
        root.removeHandler(handler)
    root.addHandler(_LibraryLog(tracebacks=verbosity >= 2))
    root.setLevel(level)
    # (aiosqlite logs two debug lines per database call: at -vv they buried evstore's own lines)
    logging.getLogger("aiosqlite").setLevel(max(level, logging.INFO))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class StdoutFailed(OSError):
    """Standard output could not be written (a full disk, ``> /dev/full``, an I/O error): its
    error said only "[Errno 28] No space left on device", naming no file."""


@contextlib.contextmanager
def to_stdout() -> Iterator[None]:
    """Writing standard output: a failure (other than the reader gone, which ends the command
    quietly) is :class:`StdoutFailed`, which says what could not be written."""
    try:
        yield
    except BrokenPipeError:
        raise
    except StdoutFailed:
        raise
    except OSError as exc:
        raise StdoutFailed(exc.errno, exc.strerror or str(exc)) from exc


class _Console(Console):
    def print(self, *objects: Any, **kwargs: Any) -> None:
        if self.file is sys.stdout:
            with to_stdout():
                self._print(*objects, **kwargs)
        else:
            self._print(*objects, **kwargs)

    def _print(self, *objects: Any, **kwargs: Any) -> None:
        for table in objects:
            if isinstance(table, Table):
                _never_cropped(table)
                # (narrower than its uuids and a few characters a column, rich gave the other
                # columns no width at all: laid out wider, the terminal wraps its lines instead)
                if (least := _least_width(self, table)) > self.width:
                    table.width, kwargs["soft_wrap"] = least, True  # (soft: lines not cut at the width)
        super().print(*objects, **kwargs)

    def on_broken_pipe(self) -> None:
        # rich exits 1 (an error, by our exit codes) when the reader goes away; end as run() does
        _reader_gone()


def _never_cropped(table: Table) -> None:
    """A table narrower than its text (an 80-column terminal: ``evstore state`` of the demo's six
    classes, ``diff``'s consumers) folds a cell's text onto more lines, where rich cut it short
    with an ellipsis - "103/2…" for 103/256, "rel…" for released: a number or a word the operator
    could not read, and could misread. The columns laid out never to wrap (uuids) stay so, and so
    do the right-justified ones, numbers: folded, "149504/583680" read "14950" on its first line,
    a whole-looking number that is neither (the table is laid out wider instead: _least_width)."""
    for column in table.columns:
        if column.justify == "right":
            column.no_wrap = True
        elif not column.no_wrap and column.overflow == "ellipsis":
            column.overflow = "fold"


def _least_width(out: Console, table: Table) -> int:
    """The width ``table`` needs to show every column: its unwrapped columns (uuids, numbers) whole,
    the others at least 4 characters wide (folded), with its borders and padding."""
    need = 1 + 3 * len(table.columns)
    for column in table.columns:
        if column.no_wrap:
            need += max(
                Measurement.get(out, out.options, cell).maximum for cell in [column.header, *column.cells]
            )
        else:
            need += 4
    return max(need, table.min_width or 0)


def _reader_gone() -> NoReturn:
    """The reader of our output went away (`evstore tail | head`): stop quietly, as other tools do."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    raise typer.Exit(141)


def console() -> Console:
    return _Console(highlight=False, soft_wrap=False, width=output_width(sys.stdout))


def output_width(stream: Any) -> int:
    """The width tables are laid out in: COLUMNS when it is a width; else the terminal's; else,
    piped (scripts, tests), 200 - not rich's 80, which folds uuids (36 characters). (Left to
    rich, COLUMNS=0, which some containers and CI runners export, made it render nothing at all.)
    Never below :data:`MIN_WIDTH`: 7 or fewer, rich failed to lay out ``state``'s table at all."""
    columns = os.environ.get("COLUMNS", "").strip()
    if columns.isascii() and columns.isdigit() and int(columns) > 0:
        return max(int(columns), MIN_WIDTH)
    try:
        if stream.isatty():
            return max(os.get_terminal_size(stream.fileno()).columns or 80, MIN_WIDTH)
    except (AttributeError, ValueError, OSError):  # (no descriptor, or not a terminal after all)
        pass
    return 200


#: the narrowest layout of tables (a uuid, never folded, is 36 wide): the terminal wraps what is wider
MIN_WIDTH = 40


#: C0 and C1 control characters and DEL: never sent to the terminal as they are
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def safe(text: object) -> str:
    """Text from the log or the store (names, request ids, messages) as printed in tables and
    lines: rich markup escaped, and control characters (ESC, BEL, a newline...) shown as ``\\xNN``,
    so that a stored string can neither restyle nor drive the operator's terminal, nor split a
    ``tail`` line in two. (``--json`` output carries the strings as they are, JSON-escaped.)
    A character standard output cannot encode is escaped here too (``\\u0153`` in an ASCII or
    Latin-1 locale), before rich lays out a table: escaped as it was written (see
    :func:`_escape_what_cannot_be_encoded`), the cell was wider than its column was made for,
    and the table's borders no longer lined up."""
    return escape(_encodable(visible(str(text))))


def _encodable(text: str) -> str:
    """``text`` with the characters standard output's encoding has not shown as their escapes
    (``visible``'s form); the bytes of an undecodable file name, which a ``surrogateescape``
    stream writes back as they were, are left to it."""
    if text.isascii():
        return text
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
        return text
    except (UnicodeEncodeError, LookupError):
        pass
    kept_bytes = getattr(sys.stdout, "errors", None) in ("surrogateescape", _ESCAPE_OR_BYTES)

    def shown(ch: str) -> str:
        if kept_bytes and "\udc80" <= ch <= "\udcff":
            return ch
        try:
            ch.encode(encoding)
            return ch
        except (UnicodeEncodeError, LookupError):
            return _escaped_char(ch)

    return "".join(map(shown, text))


def visible(text: str) -> str:
    """``text`` with its control characters shown as ``\\xNN`` (see :func:`safe`), and, beyond
    ASCII, the characters that split a line or reorder or hide what is shown - the line and
    paragraph separators (U+2028, U+2029) and the format characters (bidi overrides such as
    U+202E, zero-width spaces and joiners, U+FEFF) - as ``\\uNNNN``."""
    text = _CONTROL.sub(_escaped, text)
    if text.isascii():
        return text
    return "".join(_escaped_char(ch) if unicodedata.category(ch) in _HIDDEN else ch for ch in text)


#: Unicode categories shown escaped (Cc, the controls, is _CONTROL's)
_HIDDEN = frozenset({"Zl", "Zp", "Cf"})


def _escaped(match: re.Match[str]) -> str:
    return _escaped_char(match.group())


def _escaped_char(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def shown(url: str) -> str:
    """A store URL as printed: without its password."""
    return err.redact_url(url)


def note(message: str) -> None:
    """A human remark on stderr (keeps stdout clean for --json)."""
    to_stderr(message)


def to_stderr(line: str) -> None:
    """``line`` on standard error, whose failure (``2>/dev/full``, a closed file) is not the
    command's: its exit status stays the one it decided (an error line that raised turned a
    usage error's 2, or a success's 0, into 1 and a traceback)."""
    with contextlib.suppress(OSError, ValueError):
        print(line, file=sys.stderr, flush=True)


#: the names (its URL, password hidden, and a SQLite store's path) of the store of this command
#: when its URL came from EVSTORE_URL: an error naming it says so (a stale export puzzled)
_STORE_FROM_ENVIRONMENT: list[str] = []


def _names_of(url: str) -> list[str]:
    names = [shown(url)]
    if url.startswith("sqlite:"):
        from evstore.log.sqlite import parse_sqlite_url

        with contextlib.suppress(Exception):  # (a malformed URL: its open says so)
            names.append(parse_sqlite_url(url)[0])
    return [name for name in names if name.strip()]


def _naming_the_environment(message: str) -> str:
    """``message`` with "(from EVSTORE_URL)" when it names a store whose URL came from there."""
    if "EVSTORE_URL" in message:
        return message
    for name in _STORE_FROM_ENVIRONMENT:
        # (the name as a whole word: not "d.db" in "old.db")
        if re.search(rf"(?<![\w./~-]){re.escape(name)}(?![\w/-])", message):
            return f"{message} (from EVSTORE_URL)"
    return message


def _from_the_environment(exc: err.EvstoreError) -> None:
    """Mark ``exc``, an error about the store's URL or its opening, "(from EVSTORE_URL)" when
    that URL came from there, though its message names no store ("Unknown SQLite store
    option(s) frob": its reader never typed that URL). An error about what the store holds (a
    consumer, a position) is not about where it is: left as it is."""
    if _STORE_FROM_ENVIRONMENT and "EVSTORE_URL" not in exc.message:
        exc.message = f"{exc.message} (from EVSTORE_URL)"
        exc.args = (exc.message,)


@contextlib.asynccontextmanager
async def opened(target: str, **options: Unpack[StoreOptions]) -> AsyncIterator[AllocationStore]:
    """``open_store(target, **options)``, an error in its opening marked as
    :func:`_from_the_environment` says."""
    from evstore.store import open_store

    entered = False
    try:
        async with open_store(target, **options) as store:
            entered = True
            yield store
    except err.EvstoreError as exc:
        if not entered:
            if isinstance(exc, err.NotFound) and "create" not in options and _create_false(target):
                # (demo, import: "create a store, e.g. with `evstore demo`", said to `evstore demo`)
                exc.message = (
                    f"{exc.message}; this command makes one, but the URL sets create=false, which "
                    "forbids that: remove it"
                )
                exc.args = (exc.message,)
            _from_the_environment(exc)
        raise


def _create_false(url: str) -> bool:
    """Whether the store URL ``url`` sets ``?create=false`` (or 0)."""
    from urllib.parse import parse_qsl

    query = url.split("?", 1)[1] if "?" in url else ""
    return any(k == "create" and v.lower() in ("false", "0") for k, v in parse_qsl(query))


def fail(code: str, message: str, exit_code: int = EXIT_ERROR) -> NoReturn:
    # (all of it, its control characters shown as \xNN, which keeps it one line: its first line
    # alone cut a path or URL holding a newline at it, naming another file than the one given)
    text = _naming_the_environment(message.strip()) or "(no message)"
    to_stderr(f"error: {code}: {visible(text)}")
    raise typer.Exit(exit_code)


def sqlite_url(path: Path) -> str:
    text = str(path.expanduser().absolute())
    if "?" in text:  # (a store URL's options start there: the rest would name another file)
        raise err.InvalidInput(
            f"{path} has a '?' in it, which a store URL reads as the start of its options, so "
            "evstore cannot name that file: rename it (or its directory)"
        )
    return "sqlite:///" + text


def given_path(value: str, option: str, *, must_exist: bool, what: str = "file", expand: bool = True) -> Path:
    """A path given on the command line, checked by one rule (README, "Debugging a leak"): an
    empty value is a usage error (exit 2, as an empty --url is); a directory where a file belongs
    is ``evstore.invalid_input`` and, when the file must exist, a missing one ``evstore.not_found``
    (exit 1, as every error evstore finds in a value it was given). ``expand``: a leading ``~`` is
    the home directory (not in a URL's path: SQLite opens ``sqlite:///~/x.db`` as written)."""
    if not value.strip():
        fail("evstore.usage", f"{option} is empty: give a {what}", EXIT_USAGE)
    path = Path(value).expanduser() if expand else Path(value)
    if path.is_dir():
        raise err.InvalidInput(f"{value} is a directory, not a {what}")
    if must_exist and not path.exists():
        hint = " (check the path, or create one with `evstore demo`)" if option == "--db" else ""
        if value != value.strip():  # ("no database file at demo.db " hid the space it looked for)
            raise err.NotFound(f"no {what} at {value!r}: its name has white space around it{hint}")
        raise err.NotFound(f"no {what} at {value}{hint}")
    if not must_exist and (blocked := _file_in_the_way(path)) is not None:
        # (SQLite's open said "directory notdb.txt does not exist" of a regular file)
        raise err.InvalidInput(f"{blocked} is a file, not a directory: {value} cannot be made in it")
    return path


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of the missing ``path`` when it is not a directory (a regular
    file, say: ``notdb.txt`` of ``notdb.txt/x.db``), else None."""
    if os.path.lexists(path):
        return None
    for parent in path.parents:
        if os.path.lexists(parent):
            # (a symbolic link to nothing is no file: the open says the directory does not exist)
            return None if parent.is_dir() or not parent.exists() else parent
    return None


def not_empty(value: str | None, option: str, what: str) -> None:
    """An option or argument given as an empty string (``--at "$UNSET"``) is a usage error (exit
    2), as an empty --db or --url is, not a malformed value."""
    if value is not None and not value.strip():
        fail("evstore.usage", f"{option} is empty: give {what}", EXIT_USAGE)


def resolve_url(db: str | None, url: str | None, *, must_exist: bool = True) -> str:
    """The store URL from --db, --url or $EVSTORE_URL (in that order); one of them is required."""
    _STORE_FROM_ENVIRONMENT.clear()
    if db is not None and url is not None:  # usage errors (exit 2), as click reports a bad option
        fail("evstore.usage", "give either --db or --url, not both", EXIT_USAGE)
    if db is not None:
        return sqlite_url(given_path(db, "--db", must_exist=must_exist, what="database file"))
    if url is not None and not url.strip():  # (`--url "$UNSET"`: not a silent fallback)
        fail(
            "evstore.usage",
            "--url is empty: give a store URL, or leave --url out to use EVSTORE_URL",
            EXIT_USAGE,
        )
    chosen = url
    if chosen is None:
        chosen = os.environ.get("EVSTORE_URL")
        if chosen is not None and not chosen.strip():  # (`export EVSTORE_URL=" "`: as an empty --url)
            fail(
                "evstore.usage",
                "no store given: EVSTORE_URL is empty; use --db PATH, --url URL or set EVSTORE_URL "
                "to a store URL",
                EXIT_USAGE,
            )
        if chosen:
            _STORE_FROM_ENVIRONMENT.extend(_names_of(chosen))
    if not chosen:
        fail("evstore.usage", "no store given: use --db PATH, --url URL or set EVSTORE_URL", EXIT_USAGE)
    if re.match(r"\s+[A-Za-z][A-Za-z0-9+.-]*://", chosen):
        # (`--url " sqlite:///x.db"`, pasted: it was "a path, not a URL; use --db ' sqlite:///x.db'")
        where = " (from EVSTORE_URL)" if url is None else ""
        raise err.InvalidInput(
            f"Unsupported store URL {shown(chosen.lstrip())!r}{where}: "
            "it has white space before it; remove it"
        )
    first = None if re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", chosen) else _LIBPQ_FIRST_KEYWORD.match(chosen)
    if first and first.group(1) in LIBPQ_KEYWORDS:  # (`--url "host=db dbname=x"`, as psql takes it)
        raise err.InvalidInput(_not_a_url(chosen, from_environment=url is None))
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", chosen) and "=" not in chosen and shown(chosen) == chosen:
        # (a path where a URL belongs, `--url ./x.db`: say how to name that file; not a libpq
        # keyword string, "host=... password=...", which the open refuses with its password hidden)
        absolute = str(Path(chosen).expanduser().absolute())
        raise err.InvalidInput(
            f"Unsupported store URL {shown(chosen)!r}: a path, not a URL; use --db {shlex.quote(chosen)} "
            f"or sqlite:///{chosen if not chosen.startswith(('/', '~')) else absolute}"
        )
    if chosen.startswith("sqlite:"):
        from evstore.log.sqlite import SqliteBackend, parse_sqlite_url

        try:
            path, _ = parse_sqlite_url(chosen)
            # (its options - an unknown one, a malformed value - checked as the open checks them,
            # before the file is looked for: `?frob=1` on a missing file said only not_found, and
            # the fix of that was then refused for the option; PostgreSQL's come first too)
            with contextlib.suppress(OSError):  # (a working directory gone: the open says so)
                SqliteBackend(chosen)
        except err.EvstoreError as exc:
            _from_the_environment(exc)
            raise
        if path != ":memory:":  # (said as --db says it)
            given_path(path, "--db", must_exist=must_exist, what="database file", expand=False)
    return chosen


#: the keywords of libpq's "keyword=value" connection strings (PostgreSQL 18's list - its protocol
#: versions, SCRAM keys, OAuth, sslkeylogfile, servicefile - and requiressl, older libpqs')
LIBPQ_KEYWORDS = frozenset(
    """host hostaddr port dbname user password passfile require_auth channel_binding connect_timeout
    client_encoding options application_name fallback_application_name keepalives keepalives_idle
    keepalives_interval keepalives_count tcp_user_timeout replication gssencmode sslmode sslnegotiation
    requiressl sslcompression sslcert sslkey sslpassword sslcertmode sslrootcert sslcrl sslcrldir sslsni
    requirepeer ssl_min_protocol_version ssl_max_protocol_version krbsrvname gsslib gssdelegation
    service servicefile target_session_attrs load_balance_hosts min_protocol_version max_protocol_version
    scram_client_key scram_server_key sslkeylogfile oauth_issuer oauth_client_id oauth_client_secret
    oauth_scope""".split()
)

#: a store "URL" that starts as a libpq keyword string does: ``host=...``, ``dbname = ...``
_LIBPQ_FIRST_KEYWORD = re.compile(r"\s*([A-Za-z_]+)\s*=")

#: the characters C's isspace() takes (libpq's separators; Python's \s takes more)
_LIBPQ_SPACES = frozenset(" \t\n\v\f\r")


def _libpq_pairs(text: str) -> dict[str, str] | None:
    """The keywords and values of libpq's keyword/value connection string ``text``, read as libpq
    reads it (``conninfo_parse`` in fe-connect.c): a keyword, ``=`` (spaces around it), a value -
    single-quoted (``\\'`` and ``\\\\`` escaped in it; the next keyword may follow the closing
    quote at once) or bare (up to the next space, a backslash escaping the character after it, a
    ``'`` after its first character one of its characters); a keyword given twice: the last one
    counts. None: libpq would refuse it - a quote left open, a keyword it does not know, one
    without ``=``."""
    pairs: dict[str, str] = {}
    at, end = 0, len(text)
    while at < end:
        if text[at] in _LIBPQ_SPACES:
            at += 1
            continue
        start = at
        while at < end and text[at] != "=" and text[at] not in _LIBPQ_SPACES:
            at += 1
        keyword = text[start:at]
        while at < end and text[at] in _LIBPQ_SPACES:
            at += 1
        if at == end or text[at] != "=":
            return None
        at += 1
        while at < end and text[at] in _LIBPQ_SPACES:
            at += 1
        value: list[str] = []
        if at < end and text[at] == "'":
            at += 1
            while True:
                if at == end:  # (a quote left open, or its last character escaped)
                    return None
                char = text[at]
                at += 1
                if char == "'":
                    break
                if char == "\\":
                    if at == end:
                        return None
                    char = text[at]
                    at += 1
                value.append(char)
        else:
            while at < end:
                char = text[at]
                at += 1
                if char in _LIBPQ_SPACES:
                    break
                if char == "\\":
                    if at == end:  # (a backslash at the very end escapes nothing: dropped)
                        break
                    char = text[at]
                    at += 1
                value.append(char)
        if keyword not in LIBPQ_KEYWORDS:
            return None
        pairs[keyword] = "".join(value)
    return pairs or None


def libpq_as_url(text: str) -> str | None:
    """The ``postgresql://`` URL that names the connection of libpq's keyword/value string ``text``,
    its password shown as ``***`` (None: ``text`` is not a string libpq would read). user, password,
    a single host (not a socket directory: those go in the query, as ``?host=``), port and dbname
    take their places in the URL; the other keywords are its query, which asyncpg reads as libpq
    does (``sslmode``, ``connect_timeout``, ``service``...)."""
    from urllib.parse import quote, urlencode

    pairs = _libpq_pairs(text)
    if pairs is None:
        return None
    user, password = pairs.pop("user", None), pairs.pop("password", None)
    host, port, dbname = pairs.get("host"), pairs.get("port"), pairs.pop("dbname", None)
    if dbname is not None and ("=" in dbname or dbname.startswith(("postgresql://", "postgres://"))):
        # (libpq reads such a dbname as a connection string of its own, which may hold a password:
        # not one URL's database name, and not to be repeated)
        return None
    netloc = ""
    if host and "/" not in host and "," not in host:
        del pairs["host"]
        # (%-encoded, an IPv6 zone's "%" too - fe80::1%25eth0, RFC 6874 - as asyncpg decodes it)
        netloc = f"[{quote(host, safe=':')}]" if ":" in host else quote(host, safe=".-_~")
        if port and re.fullmatch(r"[0-9]+", port):
            netloc += f":{pairs.pop('port')}"
    if user is not None or password is not None:
        who = quote(user or "", safe="")
        netloc = f"{who}{':***' if password is not None else ''}@{netloc}"
    path = f"/{quote(dbname, safe='')}" if dbname else ""
    # (sslpassword, the client key's passphrase, oauth_client_secret and the SCRAM keys are secrets
    # as the password is: named, not shown)
    secrets = [f"{name}=***" for name in err.SECRET_KEYWORDS[1:] if pairs.pop(name, None) is not None]
    query = "&".join(part for part in (urlencode(pairs, safe="/,"), *secrets) if part)
    return f"postgresql://{netloc}{path}{'?' if query else ''}{query}"


def _not_a_url(text: str, *, from_environment: bool = False) -> str:
    """What to say of a libpq keyword/value string given where evstore takes a store URL (the
    string itself is not quoted: its password, in whatever quoting, is not repeated)."""
    first = _LIBPQ_FIRST_KEYWORD.match(text)
    keyword = first.group(1) if first else "keyword"
    message = (
        f"Unsupported store URL{' (from EVSTORE_URL)' if from_environment else ''} (a libpq keyword/value "
        f"connection string, {keyword}=...): evstore "
        "takes a URL, postgresql://USER:PASSWORD@HOST:PORT/DBNAME for PostgreSQL (or sqlite:///PATH, "
        "or --db PATH)"
    )
    built = libpq_as_url(text)
    if built is None:
        return (
            f"{message}; this one cannot be written as one: a keyword libpq does not know or without "
            "'=', a quote left open, or a dbname that is itself a connection string"
        )
    hint = " (put your password in place of ***, %-encoded)" if "***" in built else ""
    return f"{message}; this one as a URL: {built}{hint}"


@contextlib.asynccontextmanager
async def open_existing(target: str, **options: Unpack[StoreOptions]) -> AsyncIterator[AllocationStore]:
    """Open a store that must already exist: a database (file or PostgreSQL schema) without one is
    refused with NotFound, never turned into an empty store. Unless ``upgrade`` (rebuild,
    snapshot, upgrade), a store an older evstore wrote is refused (``evstore.schema.version``,
    nothing written) rather than upgraded: the upgrade closes it to the older evstore processes
    still using it, which a command that only reads (audit, history, state, diff, tail, stats,
    export: debugging, often on a live store) or clears one leak (release, confirm-migration) must
    not do behind its user's back; ``evstore upgrade`` does it, once those processes are stopped.
    So is a store that lost tables or indexes (or, on PostgreSQL, awaits an upgrade's refold),
    which the open would otherwise make again and refold: ``evstore upgrade`` repairs it."""
    options["create"] = False
    options.setdefault("upgrade", False)
    async with opened(target, **options) as store:
        yield store


def run(
    work: Callable[[], Coroutine[Any, Any, int]],
    interrupt_code: int = 130,
    terminate_code: int | None = None,
) -> NoReturn:
    """Run one command's coroutine; turn every failure into one line on stderr and an exit code.

    ``terminate_code``: SIGTERM ends the command as Ctrl-C does - its coroutine cancelled, so its
    ``except`` and ``finally`` undo what it began - with this exit status, instead of the default
    action's death (for the commands that leave something behind: a half-written export, the
    store a demo or import created)."""
    if terminate_code is not None:
        with sigterm_raises():  # (before and after the loop runs the coroutine)
            try:
                _run(_sigterm_cancels(work, terminate_code), interrupt_code)
            except Terminated:
                raise typer.Exit(terminate_code) from None
    _run(work, interrupt_code)


def _sigterm_cancels(
    work: Callable[[], Coroutine[Any, Any, int]], terminate_code: int
) -> Callable[[], Coroutine[Any, Any, int]]:
    """``work`` with SIGTERM cancelling it (:class:`SigtermCancels`), then ending as ``terminate_code``."""

    async def cancelled_by_sigterm() -> int:
        with SigtermCancels() as sigterm:
            try:
                return await work()
            except asyncio.CancelledError:
                if sigterm.received:
                    raise typer.Exit(terminate_code) from None
                raise

    return cancelled_by_sigterm


def _run(work: Callable[[], Coroutine[Any, Any, int]], interrupt_code: int) -> NoReturn:
    coroutine = work()
    try:
        code = asyncio.run(coroutine)
    except typer.Exit:
        raise
    except err.EvstoreError as exc:
        fail(exc.code, exc.message)
    except KeyboardInterrupt:
        raise typer.Exit(interrupt_code) from None
    except BrokenPipeError:
        _reader_gone()
    except StdoutFailed as exc:  # (named: the error alone, "[Errno 28] ...", named no file)
        fail("evstore.io", f"cannot write standard output: {exc.strerror}")
    except OSError as exc:
        fail("evstore.io", str(exc))
    except Exception as exc:  # a bug: still one line, the traceback only at -vv
        # (guarded: a logging configuration that fails - standard error closed or full, a
        # processor that raises - is reported, and neither replaces this error nor its status)
        get_logger("evstore").debug("cli.crash", exc_info=True)
        fail("evstore.internal", f"{type(exc).__name__}: {_text_of(exc)}")
    finally:
        # (a signal before the loop ran it - Ctrl-C, SIGTERM under sigterm_raises - leaves it
        # unstarted: closed, not "never awaited", a warning on stderr at exit)
        coroutine.close()
    raise typer.Exit(code)


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, or what it is when its ``__str__`` fails (a bug's exception may be broken too)."""
    try:
        return str(exc)
    except Exception as failed:
        return f"(its message could not be read: {type(failed).__name__})"


class SigtermCancels:
    """Inside ``with`` (in a coroutine of the running loop): SIGTERM - kill, systemd, a container
    stopping - cancels the current task, as Ctrl-C does, instead of the default action's death
    in the middle of a write; ``received`` says whether it came. Where the loop takes no signal
    handlers (not the main thread), the default stays. A second SIGTERM does what the handler
    that was there before does (see :func:`_second_sigterm`), as a second Ctrl-C ends asyncio.run.
    On leaving, the handler that was there before is put back (the loop's own removal would
    leave the default action)."""

    def __init__(self) -> None:
        self.received = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._before: Any = signal.SIG_DFL

    def __enter__(self) -> SigtermCancels:
        task = asyncio.current_task()

        def terminate() -> None:
            self.received = True
            if task is not None:
                task.cancel()

        loop = asyncio.get_running_loop()
        before = signal.getsignal(signal.SIGTERM)
        try:
            loop.add_signal_handler(signal.SIGTERM, terminate)
            # (the loop takes each SIGTERM - terminate, at its next turn - by the wake-up
            # descriptor its handler set; this one is where the main thread is, between two of
            # its steps: a second SIGTERM goes to the handler that was there before)
            signal.signal(signal.SIGTERM, functools.partial(_second_sigterm, [0], before))
        except (NotImplementedError, RuntimeError):
            return self
        self._loop, self._before = loop, before
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                self._loop.remove_signal_handler(signal.SIGTERM)
                if self._before is not None:  # (None: not set from Python; the default stays)
                    signal.signal(signal.SIGTERM, self._before)
            self._loop = None


def _second_sigterm(count: list[int], before: Any, signum: int, frame: Any) -> None:
    """What :class:`SigtermCancels` has SIGTERM do where the main thread is: nothing the first
    time (the loop cancels the task), and from the second on what the handler before it did -
    sigterm_raises' :class:`Terminated`, or the default action. A cancellation waits for the
    loop's next turn, which a write blocked on a full pipe (``evstore export | less``, the pager
    stopped) never gives: SIGTERM, however often sent, then left it running, where asyncio.run
    ends on a second Ctrl-C and the default action ended it at once."""
    count[0] += 1
    if count[0] < 2:
        return
    if callable(before):
        before(signum, frame)
    elif before != signal.SIG_IGN:  # (the default, or a handler not set from Python: the default)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM, raised where the main thread is while :func:`sigterm_raises` is in force, as
    Ctrl-C raises KeyboardInterrupt (a BaseException, so that no ``except Exception`` takes it
    for an error)."""


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Inside ``with`` (in the main thread, around an event loop's run): SIGTERM raises
    :class:`Terminated` where the program is, so that the ``except`` and ``finally`` that undo
    a Ctrl-C's half-done work (``import -``'s temporary copy of its input, the file it created)
    undo a SIGTERM's too, instead of the default action's death. A coroutine inside takes the
    signal over with :class:`SigtermCancels` (which puts this handler back on leaving). The
    handler that was there before is put back at the end."""

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated

    try:
        before = signal.signal(signal.SIGTERM, raise_terminated)
    except ValueError:  # (not the main thread: the default stays)
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Inside ``with``: SIGINT and SIGTERM wait, to be taken once it ends - for a step that must
    not be cut in two (a temporary file made, and its name kept for the cleanup)."""
    held = {signal.SIGINT, signal.SIGTERM}
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def emit_json(value: Any) -> None:
    with to_stdout():
        print(json.dumps(value, indent=2, sort_keys=False, default=str), flush=True)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"evstore {version('evstore')}")
        except PackageNotFoundError:  # (run from a checkout that was never installed)
            print("evstore (not installed)")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _root(
    verbose: Annotated[
        int, typer.Option("--verbose", "-v", count=True, help="Log to stderr: -v info, -vv debug.")
    ] = 0,
    _version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    configure_logging(verbose)


# --- rendering ----------------------------------------------------------------------------------


def usage_table(state: State, title: str) -> Table:
    """Per provider: each class as used/capacity (red when over capacity); a class used without
    inventory (only an imported log's allocations do that) as used/-."""
    from projections.invariants import format_amount

    classes = sorted({rc for p in state.providers.values() for rc in (*p.inventories, *p.usages)})
    table = Table(title=title, min_width=len(title))  # (a narrow table must not fold its title)
    table.add_column("provider")
    table.add_column("uuid", no_wrap=True)
    table.add_column("gen", justify="right")
    for rc in classes:
        table.add_column(rc, justify="right")
    for prov in sorted(state.providers.values(), key=lambda p: p.name):
        cells = []
        for rc in classes:
            inv = prov.inventories.get(rc)
            used = prov.usages.get(rc, 0)
            if inv is None:
                cells.append(f"{used}/-" if used else "-")
                continue
            text = f"{used}/{format_amount(inv.capacity)}"
            cells.append(f"[red]{text}[/red]" if used > inv.capacity else text)
        table.add_row(safe(prov.name), prov.uuid, str(prov.generation), *cells)
    return table


def usage_json(state: State) -> list[dict[str, Any]]:
    """What :func:`usage_table` shows: a class used without inventory has ``capacity`` null."""
    return [
        {
            "provider": p.uuid,
            "name": p.name,
            "generation": p.generation,
            "usages": {
                rc: {"used": p.usages.get(rc, 0), "capacity": inv.capacity if inv is not None else None}
                for rc in sorted(p.inventories.keys() | p.usages.keys())
                for inv in (p.inventories.get(rc),)
            },
        }
        for p in sorted(state.providers.values(), key=lambda p: p.name)
    ]


def print_audit(out: Console, report: AuditReport, url: str) -> None:
    verdict = "[green]clean[/green]" if report.clean else f"[red]{len(report.findings)} finding(s)[/red]"
    head, checked = report.head, report.events_checked
    out.print(f"Audit of {safe(shown(url))}: head {head}, {checked} events checked: {verdict}")
    if report.clean:
        return
    table = Table()
    table.add_column("kind")
    table.add_column("positions", no_wrap=True)
    table.add_column("finding")
    for f in report.findings:
        table.add_row(f.kind, ", ".join(map(str, f.positions)) or "-", safe(f.message))
    out.print(table)


# --- commands -----------------------------------------------------------------------------------


@app.command(cls=_Command)
def demo(
    db: DbOption = None,
    url: UrlOption = None,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of the simulated cloud (same seed, same plan).",
            min=0,
            max=2**128 - 1,
            metavar="<seed>",
        ),
    ] = 1848343,
    nodes: Annotated[int, typer.Option(help="Compute nodes.", min=2, max=100, metavar="<count>")] = 6,
    instances: Annotated[
        int, typer.Option(help="Instances to build.", min=1, max=100_000, metavar="<count>")
    ] = 200,
    json_out: JsonOption = False,
) -> None:
    """Simulate a small cloud (builds, resizes, migrations, deletes racing reverts), then audit it.

    Uses ./evstore-demo.db unless told otherwise; a SQLite file a previous demo wrote is replaced,
    any other existing file is refused (on PostgreSQL the schema must hold no events). Exit 0 only
    when the final audit is clean.
    """

    created: list[Path] = []  # the SQLite file this demo creates: removed if it ends with no event
    # (once the demo found its store empty and began to fill it: the options that name it, as
    # given; and, for a store that is no file - PostgreSQL -, the events it held once stopped)
    began: list[tuple[str, str]] = []
    left: list[int] = []

    async def work() -> int:
        if db is None and url is None and not os.environ.get("EVSTORE_URL"):
            target = sqlite_url(_fresh_file(DEFAULT_DEMO_DB))
            where = f"--db {DEFAULT_DEMO_DB}"
        elif db is not None and url is None:
            target = sqlite_url(_fresh_file(given_path(db, "--db", must_exist=False, what="database file")))
            where = f"--db {shlex.quote(str(db))}"
        else:
            target = resolve_url(db, url, must_exist=False)
            where = f"--url {shlex.quote(shown(target))}"
            if target.startswith("sqlite:"):  # (a file the demo wrote is replaced, however named)
                from evstore.log.sqlite import parse_sqlite_url

                path, _ = parse_sqlite_url(target)
                if path != ":memory:":
                    _fresh_file(Path(path))
        created.extend(_new_file(target))
        try:
            return await fill(target, where)
        except asyncio.CancelledError:
            # (stopped - Ctrl-C, SIGTERM -, the store closed: what it holds, to say so, below;
            # a SQLite file is counted once the loop is gone, a PostgreSQL schema now)
            if began and created == [] and not target.startswith("sqlite:"):
                with contextlib.suppress(Exception):
                    async with open_existing(target) as store:
                        left.append(await store.head())
            raise

    async def fill(target: str, where: str) -> int:
        from evstore.demo import COUNTS, run_demo

        # (upgrade=False: an older store is refused as it is, not upgraded and then refused for
        # its events, closed to the older evstore processes still using it by a refused demo)
        async with opened(target, upgrade=False) as store:
            if await store.head() != 0:
                shown_url = shown(target)
                # (a SQLite file the demo wrote was replaced above: this is a PostgreSQL schema's)
                hint = (
                    ""
                    if target.startswith("sqlite:")
                    else (": give it a schema without events (another ?search_path=, or database)")
                )
                raise err.InvalidInput(
                    f"the demo needs an empty store and {shown_url} already has events{hint}"
                )
            began.append((target, where))
            report = await run_demo(store, seed=seed, nodes=nodes, instances=instances)
            state = await store.backend.load_state()
            audit = await store.audit()
        if json_out:
            emit_json(
                {
                    "url": shown(target),
                    "seed": seed,
                    "head": report.head,
                    # (every count, 0 included, as the table shows them)
                    "counts": {k: report.counts[k] for k in sorted({*COUNTS, *report.counts})},
                    "rejected": dict(sorted(report.rejected.items())),
                    "deleted_mid_migration": [list(p) for p in report.deleted_mid_migration],
                    "rejected_reverts": [list(p) for p in report.rejected_reverts],
                    "usage": usage_json(state),
                    "audit": audit.to_dict(),
                }
            )
        else:
            out = console()
            out.print(usage_table(state, f"Usage after the demo (seed {seed}, {report.head} events)"))
            summary = Table(title="What happened")
            summary.add_column("what")
            summary.add_column("count", justify="right")
            c = report.counts
            for label, value in (
                ("instances built", c["builds"]),
                ("builds with no valid host", c["builds_failed"]),
                ("migrations started", c["migrations_started"]),
                ("resizes started", c["resizes_started"]),
                ("migrations/resizes confirmed", c["confirmed"]),
                ("migrations/resizes reverted", c["reverted"]),
                ("rolled back (no valid host)", c["migrations_no_valid_host"]),
                ("instances deleted", c["deletes"]),
                ("  deleted mid-migration, racing a revert", len(report.deleted_mid_migration)),
                ("  race won by the delete (revert rejected)", c["races_delete_won"]),
                ("  race won by the revert (then deleted)", c["races_revert_won"]),
            ):
                summary.add_row(label, str(value))
            for code, n in sorted(report.rejected.items()):
                summary.add_row(f"rejected: {code}", str(n))
            out.print(summary)
            print_audit(out, audit, target)
            in_memory = target.startswith("sqlite:") and _sqlite_file(target) is None
            if report.rejected_reverts and not in_memory:
                # (an in-memory store is gone once the demo ends: nothing to try it on - whatever
                # options its URL sets, ?busy_timeout=5 too)
                inst, _ = report.rejected_reverts[0]
                # (one line, however narrow the terminal, and quoted for the shell: pasted, it runs)
                out.print(f"Try: evstore history {inst} {safe(where)}", soft_wrap=True)
        return EXIT_OK if audit.clean else EXIT_FINDINGS

    try:
        run(work, terminate_code=EXIT_TERMINATED)
    except typer.Exit as exc:
        with signals_held():  # (a second signal waits until what the demo leaves is cleaned up)
            # Ended before its first event (Ctrl-C or SIGTERM in its first moments, a failure): the
            # empty store it created would be refused by the next demo as not its own (an empty
            # store may be anyone's), so it goes, as a refused import's does
            if (
                exc.exit_code in (EXIT_ERROR, 130, EXIT_TERMINATED)
                and created
                and _holds_no_events(created[0])
            ):
                _remove_database(created[0])
            elif exc.exit_code in (130, EXIT_TERMINATED):
                how = "interrupted" if exc.exit_code == 130 else "terminated"
                _say_what_the_demo_left(how, created, began, left)
        raise


def _say_what_the_demo_left(
    how: str, created: list[Path], began: list[tuple[str, str]], left: list[int]
) -> None:
    """The line a demo stopped after its first event ends with (Ctrl-C, SIGTERM): how many events
    the store holds, a demo that did not finish, and how to check them or start again. (It said
    nothing: a store of part of a demo was left where the user expected the demo's, as if it had
    finished.) One stopped before it - its store removed, or never made - says nothing, as before."""
    if not began:
        return
    target, where = began[0]
    if target.startswith("sqlite:") and not created:  # (in memory: gone with the process)
        return
    count = _event_count(created[0]) if created else (left[0] if left else None)
    if count == 0:
        return
    if count is None:  # (a store that could not be read again)
        note(f"{how}: the demo did not finish; {shown(target)} may hold some of its events")
        return
    store = visible(str(created[0])) if created else shown(target)
    if created:
        command = "evstore demo" if where == f"--db {DEFAULT_DEMO_DB}" else f"evstore demo {where}"
        again = f"the next `{command}` replaces it"
    else:  # (PostgreSQL: a demo needs a schema without events)
        again = "the next demo needs a store without events (another ?search_path=, or database)"
    note(
        f"{how} after the demo wrote {count} events: {store} holds them, a demo that did not finish "
        f"(`evstore audit {where}` checks them; {again})"
    )


def _new_file(url: str) -> list[Path]:
    """The SQLite file opening ``url`` would create ([] when it exists, or is no file)."""
    file = _sqlite_file(url)
    return [Path(file)] if file is not None and not Path(file).exists() else []


def _remove_database(path: Path) -> None:
    """Remove a SQLite database and its -wal and -shm files."""
    for suffix in ("", "-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)


def _only_reading(path: Path) -> sqlite3.Connection:
    """A connection that reads the SQLite file at ``path`` and changes nothing. A read-only one
    (``mode=ro``) on a file in WAL mode makes its -wal and -shm files where there were none and
    cannot remove them, so a look at a store - the demo's at another application's file it then
    refused, or at what a stopped demo or import left - left them beside it. The mode is the
    store's own looks' (:func:`evstore.log.sqlite.looking_mode`): read-write, writing nothing
    (``query_only``), where no -wal or -journal exists and the file may be written - closing
    removes them -, else read-only, leaving the files byte for byte as they were."""
    from evstore.log.sqlite import looking_mode

    conn = sqlite3.connect(f"{path.absolute().as_uri()}?mode={looking_mode(path.absolute())}", uri=True)
    try:
        conn.execute("PRAGMA query_only = ON")
    except BaseException:
        conn.close()
        raise
    return conn


def _is_demo_database(path: Path) -> bool:
    """Whether ``path`` is an evstore database every event of which the demo wrote."""
    try:
        conn = _only_reading(path.resolve())
    except sqlite3.Error:
        return False
    try:
        events, others = conn.execute(
            "SELECT count(*), total(coalesce(json_extract(metadata, '$.actor'), '') NOT LIKE 'demo-%') "
            "FROM events"
        ).fetchone()
        return bool(events) and not others  # an empty store is not the demo's: it may be anyone's
    except sqlite3.Error:  # not SQLite, or not an evstore store
        return False
    finally:
        conn.close()


def _fresh_file(path: Path) -> Path:
    """Remove a previous demo database (and its WAL files) so the demo starts empty.

    Anything else at ``path`` (another store, any other file) is left alone: the demo refuses.
    """
    from evstore.log.sqlite import not_a_regular_file

    kind = not_a_regular_file(str(path))  # (a FIFO: reading it would wait for a writer for ever)
    if kind is not None:
        fail("evstore.invalid_input", f"{path} {kind}, not a database file: give the demo a file path")
    if path.exists() and not os.access(path.absolute().parent, os.W_OK):
        # (_is_demo_database cannot read a WAL database there either: not a reason to call it foreign)
        fail(
            "evstore.storage",
            f"cannot write in {path.absolute().parent}: the demo (re)creates its database and WAL "
            "files there. Give another --db.",
        )
    if path.exists() and not _is_demo_database(path):
        fail(
            "evstore.invalid_input",
            f"{path} exists and is not a database the demo wrote: the demo replaces only its own "
            "files. Give another --db (or --url), or remove it yourself.",
        )
    removed = []
    with _alone_with(path):
        for suffix in ("", "-wal", "-shm"):
            candidate = Path(str(path) + suffix)
            if candidate.exists():
                candidate.unlink()
                removed.append(candidate.name)
    if removed:
        note(f"removed existing {', '.join(removed)}")
    return path


@contextlib.contextmanager
def _alone_with(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the database at ``path`` (if there is one), or refuse: every
    connection that has read it - a store, a tail, another demo - holds a shared lock for as
    long as it is open, and removing its files under it would lose what it commits next."""
    if not path.exists():
        yield
        return
    conn = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        try:
            conn.execute("PRAGMA locking_mode = EXCLUSIVE")
            conn.execute("BEGIN EXCLUSIVE")
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) and "busy" not in str(exc):
                raise
            fail(
                "evstore.storage",
                f"{path} is open in another process (a store, a tail, another demo): removing it would "
                "lose what that process writes next. Stop it and run the demo again, or give another "
                "--db (or --url).",
            )
        yield
    finally:
        conn.close()


@app.command(cls=_Command)
def audit(
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
    history: Annotated[
        bool,
        typer.Option(
            "--history",
            help="Also check the history index (what history and state --provider read) "
            "against the log: a second pass, about as long as rebuild --full's.",
        ),
    ] = False,
) -> None:
    """Replay the log and check it: drift, leaks, over-capacity, integrity. Exit 3 on findings."""

    async def work() -> int:

        target = resolve_url(db, url)
        async with open_existing(target) as store:
            report = await store.audit(history=history)
        if json_out:
            emit_json({"url": shown(target), **report.to_dict()})  # (as stats and demo say it)
        else:
            print_audit(console(), report, target)
        return EXIT_OK if report.clean else EXIT_FINDINGS

    run(work)


# --- debugging: history, state, diff, tail ------------------------------------------------------

Names = dict[str, str]


def fmt_allocs(allocs: dict[str, dict[str, int]], names: Mapping[str, str]) -> str:
    """``compute-01: VCPU=2 MEMORY_MB=4096`` (providers by name where known)."""
    if not allocs:
        return "nothing"
    parts = []
    for provider, resources in sorted(allocs.items(), key=lambda kv: names.get(kv[0], kv[0])):
        amounts = " ".join(f"{rc}={n}" for rc, n in sorted(resources.items()))
        parts.append(f"{names.get(provider, provider[:8])}: {amounts}")
    return "; ".join(parts)


def describe(event: Any, names: Mapping[str, str], short: bool = False, learned: Names | None = None) -> str:
    """One line saying what an event did, for people (``short``: consumer uuids cut to 8 characters;
    ``learned``: the names the events listed before this one gave, see :func:`learn_name`)."""
    from evstore import events as ev

    def u(uuid: str) -> str:
        return uuid[:8] if short else uuid

    def held_for(event: Any) -> str:  # (a migration consumer's event, in its instance's history too)
        instance = event.on_behalf_of
        return "" if instance is None else f" (migration of instance {u(instance)})"

    match event:
        case ev.AllocationsReplaced():
            return (
                f"consumer {u(event.consumer)} ({event.consumer_type}){held_for(event)} now holds "
                f"{fmt_allocs(event.allocations, names)} (was {fmt_allocs(event.previous, names)}), "
                f"generation {event.generation}"
            )
        case ev.AllocationsReleased():
            return (
                f"consumer {u(event.consumer)}{held_for(event)} released {fmt_allocs(event.released, names)}"
            )
        case ev.MigrationStarted():
            return (
                f"instance {u(event.instance)} moved {fmt_allocs(event.allocations, names)} "
                f"to migration {u(event.migration)}"
            )
        case ev.MigrationReverted():
            return (
                f"migration {u(event.migration)} gave {fmt_allocs(event.allocations, names)} back to "
                f"instance {u(event.instance)} (replacing {fmt_allocs(event.replaced, names)})"
            )
        case ev.MigrationConfirmed():
            return (
                f"migration {u(event.migration)} released {fmt_allocs(event.released, names)}; "
                f"instance {u(event.instance)} keeps its allocations"
            )
        case ev.ConsumerDeleted():
            released = fmt_allocs(event.released, names)
            text = f"consumer {u(event.consumer)}{held_for(event)} deleted (tombstone), released {released}"
            for migration, allocs in event.migrations_released.items():
                text += f"; its migration {u(migration)} released {fmt_allocs(allocs, names)}"
            return text
        case ev.InventoriesReplaced():
            invs = ", ".join(
                f"{rc}={inv.total}" + (f" x{inv.allocation_ratio:g}" if inv.allocation_ratio != 1 else "")
                for rc, inv in sorted(event.inventories.items())
            )
            return f"inventory of {names.get(event.provider, event.provider)}: {invs or 'none'}"
        case ev.ProviderCreated():
            parent = f" under {names.get(event.parent, event.parent)}" if event.parent else ""
            return f"provider {event.name} ({event.provider}) created{parent}"
        case ev.ProviderUpdated():
            old = (learned or {}).get(event.provider)  # (today's name is no clue to the old one)
            was = f" from {old}" if old is not None and old != event.name else ""
            return f"provider {event.provider} renamed{was} to {event.name}"
        case ev.ProviderDeleted():
            parent = f" (a child of {names.get(event.parent, event.parent)})" if event.parent else ""
            return f"provider {names.get(event.provider, event.provider)}{parent} deleted"
        case ev.ResourceClassCreated():
            return f"resource class {event.name} created"
    return str(event.event_type)


def learn_name(names: Names, learned: Names, recorded: Any) -> None:
    """After describing ``recorded``: the name its provider has from then on (created, renamed),
    so that a listing in log order (``history``, ``tail``) names each provider as it was called
    at each event, not as it is called today (or, once deleted, not at all). ``learned`` keeps
    only the names the listing's own events gave (what a rename was renamed from)."""
    if recorded.type in ("ProviderCreated", "ProviderUpdated"):
        names[recorded.event["provider"]] = learned[recorded.event["provider"]] = recorded.event["name"]


class NamesThen:
    """The names the other providers an entity's events name had at each of those events: its
    history lists its own events, not their renames (nor the deletion of a host decommissioned
    since), so each is read once from that provider's own history: the events that named it."""

    #: the events that give a provider its name (only these of its history are read)
    NAMING = ("ProviderCreated", "ProviderUpdated")

    def __init__(self, store: Any, listed: str) -> None:
        self.store, self.listed = store, listed
        #: provider: (positions, names given there, the last position its history could be read to)
        self.given: dict[str, tuple[list[int], list[str], int | None]] = {}

    async def at(self, recorded: Any, names: Names) -> Mapping[str, str]:
        """``names``, with each other provider ``recorded`` names as it was called before it: the
        few names that differ laid over ``names`` (a copy of it cost ~70 us an event with 5,000
        providers). Read it before ``names`` changes (``learn_name``)."""
        then: dict[str, str] | None = None
        for key in recorded.entities():
            kind, _, provider = key.partition(":")
            if kind != "provider" or provider == self.listed:
                continue
            positions, given, readable_to = await self._given(provider)
            if readable_to is not None and recorded.position > readable_to:
                continue  # (past a damaged row of its history: no telling, today's name)
            i = bisect.bisect_left(positions, recorded.position)
            if i:
                then = then if then is not None else {}
                then[provider] = given[i - 1]
        return names if then is None else collections.ChainMap(then, names)

    async def _given(self, provider: str) -> tuple[list[int], list[str], int | None]:
        if provider not in self.given:
            readable_to: int | None = None
            while True:
                try:
                    positions, given = await self._naming(provider, readable_to)
                    break
                except err.CorruptEvent as exc:  # (the listing reports its own damaged rows, not these)
                    damaged = int(exc.details.get("position") or 1)
                    if readable_to is not None and damaged > readable_to:  # (no progress: no names)
                        positions, given, readable_to = [], [], 0
                        break
                    readable_to = damaged - 1  # (read again, up to it)
            self.given[provider] = (positions, given, readable_to)
        return self.given[provider]

    async def _naming(self, provider: str, until: int | None) -> tuple[list[int], list[str]]:
        named = await provider_events(self.store, provider, until, self.NAMING)
        return [recorded.position for recorded in named], [recorded.event["name"] for recorded in named]


async def provider_events(
    store: Any, provider: str, until: int | None, types: Sequence[str], kind: str = "provider"
) -> list[Any]:
    """The events of ``types`` in ``provider``'s history (or, ``kind`` "consumer", a consumer's)
    up to ``until``, read through the history index without decoding the others (a provider's
    naming events are few)."""
    found: list[Any] = []
    while batch := await store.backend.read_entities(
        [f"{kind}:{provider}"], found[-1].position if found else 0, 1000, until, types=types
    ):
        found += batch
    return found


def event_json(recorded: Any, names: Mapping[str, str], learned: Names | None = None) -> dict[str, Any]:
    out: dict[str, Any] = recorded.to_dict()
    out["summary"] = describe(recorded.event, names, learned=learned)
    return out


def events_table(title: str) -> Table:
    table = Table(title=title)
    table.add_column("position", justify="right", no_wrap=True)
    table.add_column("recorded_at", no_wrap=True)
    table.add_column("type", no_wrap=True)
    table.add_column("request / actor", max_width=22)
    table.add_column("what happened", ratio=1)
    return table


def event_row(
    recorded: Any, names: Mapping[str, str], learned: Names | None = None
) -> tuple[str, str, str, str, str]:
    """One event's cells in an :func:`events_table`."""
    meta = recorded.metadata
    who = " / ".join(x for x in (meta.request_id, meta.actor) if x) or "-"
    return (
        str(recorded.position),
        recorded.recorded_at.isoformat(timespec="microseconds"),
        recorded.type,
        safe(who),
        safe(describe(recorded.event, names, short=True, learned=learned)),
    )


def uuid_arg(value: str, what: str = "uuid") -> str:
    """A uuid argument in the canonical form the API keeps (``normalize_uuid``: upper case, no
    dashes, braces and ``urn:uuid:`` taken too), the whitespace around it - a pasted uuid's, a
    spreadsheet cell's - trimmed first, as ``--at``'s is (:func:`parse_point`). The API itself
    refuses such a string: a program passing one has a bug to see; a command line is typed."""
    from evstore.schema import normalize_uuid

    return normalize_uuid(value.strip(), what)


async def _provider_named(
    exc: err.InvalidInput, text: str, db: str | None, url: str | None, command: str
) -> err.InvalidInput:
    """``exc``, a malformed uuid, naming the provider whose name ``text`` is in the store (tables
    show providers by name: ``compute-02``, typed back where its uuid belongs), with the command
    to give (``command``, its ``{uuid}`` filled in); ``exc`` itself when no provider has that name,
    or the store cannot be opened (the malformed uuid is the error then)."""
    given = [value for value in (db, url) if value is not None]
    if len(given) > 1 or any(not value.strip() for value in given):
        return exc  # (a usage error, which the command reports once it opens its store)
    if not given and not os.environ.get("EVSTORE_URL", "").strip():
        return exc
    try:
        async with open_existing(resolve_url(db, url)) as store:
            names = await provider_names(store)
    except Exception:  # (no store to look in: a missing, damaged or older one)
        return exc
    found = sorted(uuid for uuid, name in names.items() if name == text.strip())
    if not found:
        return exc
    again = f"evstore {command.format(uuid=found[0])}"
    return err.InvalidInput(
        f"{exc.message}: it is the name of provider {found[0]}; give its uuid ({again} ...)", **exc.details
    )


def parse_point(text: str, what: str = "--at") -> int | datetime:
    """A position (``1234``) or an ISO 8601 time with a zone (``2026-01-02T03:04:05Z``). A number
    out of the positions' range (``-1``, past 2**63-1) is a usage error (exit 2), as ``tail
    --after -1`` is; one the log has not reached yet is for the store to refuse (exit 1)."""
    text = text.strip()
    if _NUMBER.fullmatch(text):
        try:
            number = int(text)
        except ValueError:  # (more digits than Python converts: out of range all the same)
            number = -1
        if not 0 <= number <= MAX_POSITION:
            fail(
                "evstore.usage",
                f"{what} is out of range: a position is from 0 to 2**63-1, got {text:.60}",
                EXIT_USAGE,
            )
        return number
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise err.InvalidInput(
            f"{what} must be a position (e.g. 120) or an ISO time with a zone (e.g. 2026-01-02T03:04:05Z), "
            f"got {text!r}"
        ) from None
    if moment.tzinfo is None:
        if _DATE_ONLY.fullmatch(text):  # (Python reads "2026-12-05+05:30" as 05:30, no zone)
            raise err.InvalidInput(
                f"{what} time {text!r} is a date without a time of day: give one, e.g. {text[:10]}T00:00:00Z"
            )
        raise err.InvalidInput(f"{what} time {text!r} has no time zone: add Z or +00:00")
    return moment


def _say_if_future(point: int | datetime, what: str, position: int) -> None:
    """A note on stderr when ``point`` is a time still to come: the state shown for it is the
    head's now (its title, "position N of N", said only that), and what is appended before that
    time will change it."""
    from datetime import UTC

    if isinstance(point, datetime) and point > datetime.now(UTC):
        note(
            f"note: {what} {point.isoformat()} is in the future: shown as of position {position}, the head "
            "now; events appended before that time will change what it shows"
        )


def parse_position(text: str, option: str) -> int:
    """A position given to ``option`` (``tail --after``), read as :func:`parse_point` reads one:
    ASCII digits, a sign and spaces around them allowed (``+5``, `` 5``); empty, malformed or out
    of range, a usage error (exit 2) - click's int took ``1_0`` as 10, and said an empty value was
    not "a valid integer" where every other option says it is empty."""
    if not text.strip():
        raise UsageError(f"{option} is empty: give a position")
    if not _NUMBER.fullmatch(text.strip()):
        raise UsageError(f"{option} must be a position (e.g. 120), got {text!r}")
    point = parse_point(text, option)
    assert isinstance(point, int)
    return point


#: a whole number, signed or not, in ASCII digits (str.isdigit also accepts '²', which int() refuses)
_NUMBER = re.compile(r"[+-]?[0-9]+")

#: a date, with or without a zone, and no time of day (``2026-12-05Z``, ``2026-12-05+05:30``)
_DATE_ONLY = re.compile(r"\d{4}-\d{2}-\d{2}([Zz]|[+-]\d{2}(:?\d{2})?)?")


async def provider_names(store: Any) -> Names:
    return {uuid: name for uuid, name in await store.providers()}


async def provider_names_at(store: Any, position: int, head: int) -> Names | None:
    """The providers' names as they were at ``position``: what a listing of the events after it
    (``tail --after``) starts from, learning each later name from them (today's names at the
    head, none at 0); None when the log cannot be read (a damaged row is the listing's to report).

    Today's names, but for the providers the events after ``position`` create, rename or delete
    (found in their payloads, undecoded): those read from their own events up to ``position``
    (the history index). Not a fold of the log up to ``position``, as ``state_at`` makes: that
    took 29 s and wrote snapshots into the store for a tail near the head of a 200k-event log."""
    if position == 0:
        return {}
    names = await provider_names(store)
    touched: set[str] = set()
    after = position
    try:
        while after < head and (rows := await store.backend.read_payloads(after, 1000)):
            for at, kind, _, data in rows:
                if at <= head and kind in NAMED_BY:
                    touched.add(json.loads(data)["provider"])
            after = rows[-1][0]
    # (a payload that cannot be read: no JSON, not an object, no provider, nested too deeply)
    except (err.CorruptEvent, ValueError, KeyError, TypeError, RecursionError):
        return None
    for provider in touched:
        try:
            events = await provider_events(store, provider, position, tuple(NAMED_BY))
        except err.CorruptEvent:
            return None
        if events and events[-1].type != "ProviderDeleted":
            names[provider] = events[-1].event["name"]
        else:  # (made after it, or deleted by then)
            names.pop(provider, None)
    return names


#: the events after which a provider is called otherwise (or no longer at all)
NAMED_BY = frozenset({"ProviderCreated", "ProviderUpdated", "ProviderDeleted"})


def left_holding(migration: str) -> str:
    """What a tombstone listed in its instance's migration's history did to it (it names only the
    instance): see ``AllocationStore.history``; said on that tombstone's line in the instance's
    history too."""
    return f"left its migration {migration} holding what it held: a leak"


class LeakNotes:
    """What ``history`` says on the lines of the events that made a leak (the audit's), which the
    events' own words do not: an instance's delete that left its migration holding - on its line
    in the migration's history, where it is listed although it does not name the migration (see
    ``AllocationStore.history``), and in the instance's - and an event that gave allocations to a
    consumer deleted before it (an older writer's revert), known when this history listed that
    delete; each with how to clear the leak while it is one still (at the head)."""

    def __init__(self, store: AllocationStore, listed: str) -> None:
        self.store, self.listed = store, listed
        #: the instance the listed consumer last held for, as a migration
        self.instance: str | None = None
        #: the migrations the listed consumer started, as an instance
        self.migrations: set[str] = set()
        #: the consumers whose delete this history listed: the first one's position
        self.tombstones: dict[str, int] = {}
        #: consumer: whether it holds a leak now (read once)
        self.leaked_now: dict[str, bool] = {}
        #: consumer: the position of its tombstone in the store (read once), see _deleted_before
        self.deleted_at: dict[str, int | None] = {}

    async def on(self, recorded: Any) -> list[tuple[str, str]]:
        """The notes on ``recorded``'s line, each in full and with the consumer uuids it names cut
        to 8 characters (for the table). Called for each event listed, in order."""
        from evstore import events as ev

        event, key = recorded.event, self.listed
        notes: list[tuple[str, str]] = []
        match event:
            case ev.MigrationStarted():
                if event.migration == key:
                    self.instance = event.instance
                if event.instance == key:
                    self.migrations.add(event.migration)
                if event.allocations:
                    mine = key in (event.instance, event.migration)
                    notes += await self._given(event.migration, recorded.position, mine)
                    # (an older writer's move of a deleted instance's allocations: the migration
                    # holds them for it, the audit's leak; this evstore refuses such a move)
                    if not notes and (mine or event.instance in self.tombstones):
                        notes += await self._held_for(event.migration, event.instance, recorded.position)
            case ev.ConsumerDeleted() if event.consumer not in self.tombstones:
                # (a consumer's first tombstone only: a second - an older writer's delete of a
                # deleted consumer - left nothing holding that was not a leak already)
                if event.consumer == self.instance and f"consumer:{key}" not in recorded.entities():
                    notes.append(await self._left(key))  # (listed although it does not name it)
                elif event.consumer == key:
                    for migration in sorted(self.migrations - set(event.migrations_released)):
                        if await self._left_by(migration, recorded.position):
                            notes.append(await self._left(migration))
                self.tombstones.setdefault(event.consumer, recorded.position)
            case ev.MigrationReverted() if event.allocations:
                notes += await self._given(event.instance, recorded.position, event.instance == key)
            case ev.AllocationsReplaced() if event.allocations:
                notes += await self._given(event.consumer, recorded.position, event.consumer == key)
                # (an older writer's write to a migration its instance's delete emptied: it holds
                # for that deleted instance again, as the fold keeps the link)
                instance = event.on_behalf_of or (self.instance if event.consumer == key else None)
                mine = key in (event.consumer, instance) or instance in self.tombstones
                if not notes and instance is not None and mine:
                    held = await self._held_for(event.consumer, instance, recorded.position)
                    if held and await self._leaked_then(event.consumer, instance, recorded.position):
                        notes += held
        return notes

    async def _given(self, consumer: str, position: int, mine: bool) -> list[tuple[str, str]]:
        """The note on an event at ``position`` that gave ``consumer`` allocations, if it was
        deleted before (the store asked, when this history may not list that delete: ``mine``)."""
        if consumer not in self.tombstones and not mine:
            return []
        deleted_at = await self._deleted_before(consumer, position)
        if deleted_at is None:
            return []
        said = f"given to a consumer deleted at position {deleted_at}: a leak"
        said += await self._clear(consumer, deleted=True)
        return [(said, said)]

    async def _held_for(self, migration: str, instance: str, position: int) -> list[tuple[str, str]]:
        """The note on an event at ``position`` that gave ``migration`` allocations held for
        ``instance``, if that instance was deleted before."""
        deleted_at = await self._deleted_before(instance, position)
        if deleted_at is None:
            return []
        said = f"held for an instance deleted at position {deleted_at}: a leak"
        said += await self._clear(migration, deleted=False)
        return [(said, said)]

    async def _leaked_then(self, migration: str, instance: str, position: int) -> bool:
        """Whether ``migration`` held a leak for ``instance`` right after ``position`` (its own
        events folded: whether the link to its instance held then)."""
        try:
            view = await self.store.state_at(position=position, consumer=migration)
        except err.CorruptEvent:  # (the listing reports its own damaged rows)
            return False
        held = await view.allocations(migration)
        return held.leaked and held.on_behalf_of == instance

    async def _deleted_before(self, consumer: str, position: int) -> int | None:
        """The position of ``consumer``'s tombstone (its first: permanent) if it is before
        ``position``: this history's, or else, the tombstone not listed in it (the instance's in
        its migration's history), the store's."""
        if consumer in self.tombstones:
            deleted_at: int | None = self.tombstones[consumer]
        else:
            if consumer not in self.deleted_at:
                self.deleted_at[consumer] = (await self.store.allocations(consumer)).deleted_at
            deleted_at = self.deleted_at[consumer]
        return deleted_at if deleted_at is not None and deleted_at < position else None

    async def _left(self, migration: str) -> tuple[str, str]:
        clear = await self._clear(migration, deleted=False)
        return left_holding(migration) + clear, left_holding(migration[:8]) + clear

    async def _left_by(self, migration: str, tombstone: int) -> bool:
        """Whether the listed instance's tombstone at ``tombstone`` left ``migration`` holding
        allocations for it (the migration's own events up to there, and that tombstone)."""
        try:
            view = await self.store.state_at(position=tombstone, consumer=migration)
        except err.CorruptEvent:  # (the listing reports its own damaged rows, not the migration's)
            return False
        held = await view.allocations(migration)
        return held.leaked and held.on_behalf_of == self.listed

    async def _clear(self, consumer: str, deleted: bool) -> str:
        """``; clear it with ...`` while ``consumer`` holds a leak (else nothing: cleared since)."""
        from projections.invariants import clear_leak

        if consumer not in self.leaked_now:
            self.leaked_now[consumer] = (await self.store.allocations(consumer)).leaked
        return f"; {clear_leak(consumer, deleted)}" if self.leaked_now[consumer] else ""


class TailLeakNotes:
    """What ``tail`` says on the line of an event that made a leak (an older writer's, in an
    imported log: this evstore refuses them), as ``history`` does: one that gave allocations to a
    consumer deleted before it (a revert, a write, a move onto a deleted migration) or to a
    migration held for an instance deleted before it, and a delete that left the instance's
    migration holding; each with how to clear it while it is one still. What came after
    ``start`` is learned from the listed events themselves (the tombstones, the migrations
    started and ended); what came before, from the store, once a consumer (a tombstone is
    permanent): ``tail --after 0`` reads nothing more than the log. For the events up to ``head``
    (those the log held when the tail began) that is read a page of events at a time, for all the
    consumers the page names, in one read of the log before ``start`` for the tombstones and one for
    the migrations (see :meth:`_look_ahead`); it was read a consumer at a time, one or two reads of
    the store each: ``tail --after 1`` took 1.5 times as long as ``--after 0``."""

    #: the events of an instance's history that start or end its migrations
    ENDS = ("MigrationStarted", "MigrationConfirmed", "MigrationReverted")
    #: how many of the events up to the head one look ahead covers
    AHEAD = 500

    def __init__(self, store: AllocationStore, start: int, head: int, limit: int | None = None) -> None:
        self.store, self.start, self.head = store, start, head
        #: how many events one look ahead reads (no more than the listing shows: ``--limit``)
        self.page = min(self.AHEAD, limit or self.AHEAD)
        #: the last position a look ahead covered (nothing to look up before position 0)
        self.ahead = start if start else head
        #: consumer: the position of its first tombstone (None: not deleted, when known)
        self.deleted_at: dict[str, int | None] = {}
        #: instance: the migrations started for it and not ended (since ``start``, or read)
        self.open: dict[str, dict[str, None]] = {}
        #: the instances whose migrations before ``start`` were read into ``open``
        self.read: set[str] = set()
        #: consumer: whether it holds a leak now (read once)
        self.leaked_now: dict[str, bool] = {}

    async def on(self, recorded: Any) -> list[str]:
        from evstore import events as ev

        event, position, notes = recorded.event, recorded.position, []
        if self.ahead < position <= self.head:
            await self._look_ahead(position)
        given: str | None = None
        instance: str | None = None
        match event:
            case ev.ConsumerDeleted():
                if await self._deleted_before(event.consumer, position) is None:
                    # (its first tombstone: a second left nothing holding that was not a leak)
                    for migration in await self._left(event, position):
                        notes.append(left_holding(migration) + await self._clear(migration, False))
                    self.deleted_at[event.consumer] = position
            case ev.MigrationStarted():
                (await self._open(event.instance))[event.migration] = None
                if event.allocations:
                    given, instance = event.migration, event.instance
            case ev.MigrationConfirmed():
                (await self._open(event.instance)).pop(event.migration, None)
            case ev.MigrationReverted():
                (await self._open(event.instance)).pop(event.migration, None)
                given = event.instance if event.allocations else None
            case ev.AllocationsReplaced() if event.allocations:
                given, instance = event.consumer, event.on_behalf_of
        if given is not None and (at := await self._deleted_before(given, position)) is not None:
            notes.append(
                f"given to a consumer deleted at position {at}: a leak{await self._clear(given, True)}"
            )
        elif (
            given is not None
            and instance is not None
            and (at := await self._deleted_before(instance, position))
        ):
            notes.append(
                f"held for an instance deleted at position {at}: a leak{await self._clear(given, False)}"
            )
        return notes

    async def _look_ahead(self, position: int) -> None:
        """Read what came before ``start`` for every consumer the events from ``position`` on (a
        page of them, up to the head) name: the first tombstone of each (as :meth:`_deleted_before`
        reads it) and the migrations open for each instance (as :meth:`_open` reads them), each in
        one read of the log (per 500 consumers). A damaged row leaves it to those, a consumer at a
        time: the listing reports its own damaged rows."""
        from evstore import events as ev

        self.ahead = self.head  # (also when a read below fails: not tried again for each event)
        try:
            page = await self.store.read(position - 1, min(self.page, self.head - position + 1))
            if page:
                self.ahead = page[-1].position
            deleted: dict[str, int | None] = {}
            instances: dict[str, dict[str, None]] = {}
            for recorded in page:
                match event := recorded.event:
                    case ev.ConsumerDeleted():
                        deleted[event.consumer] = None
                        instances[event.consumer] = {}
                    case ev.MigrationStarted():
                        deleted[event.migration] = deleted[event.instance] = None
                        instances[event.instance] = {}
                    case ev.MigrationConfirmed():
                        instances[event.instance] = {}
                    case ev.MigrationReverted():
                        deleted[event.instance] = None
                        instances[event.instance] = {}
                    case ev.AllocationsReplaced():
                        deleted[event.consumer] = None
                        if event.on_behalf_of is not None:
                            deleted[event.on_behalf_of] = None
            deleted = {c: None for c in deleted if c not in self.deleted_at}
            instances = {i: {} for i in instances if i not in self.read}
            for recorded in await self._before_start(deleted, ("ConsumerDeleted",)):
                event = recorded.event
                if (
                    isinstance(event, ev.ConsumerDeleted)
                    and event.consumer in deleted
                    and deleted[event.consumer] is None
                ):
                    deleted[event.consumer] = recorded.position  # (its first: the tombstone)
            for recorded in await self._before_start(instances, self.ENDS):
                event = recorded.event
                if (started := instances.get(event.instance)) is not None:
                    if isinstance(event, ev.MigrationStarted):
                        started[event.migration] = None
                    else:
                        started.pop(event.migration, None)
        except err.CorruptEvent:
            return
        self.deleted_at.update(deleted)
        self.open.update(instances)
        self.read.update(instances)

    async def _before_start(self, consumers: Iterable[str], types: Sequence[str]) -> list[Any]:
        """The events of ``types`` up to ``start`` that name one of ``consumers``, in order."""
        keys = [f"consumer:{c}" for c in consumers]
        found: dict[int, Any] = {}
        for first in range(0, len(keys), 500):
            chunk, after = keys[first : first + 500], 0
            while batch := await self.store.backend.read_entities(
                chunk, after, 1000, self.start, types=types
            ):
                found.update((recorded.position, recorded) for recorded in batch)
                if len(batch) < 1000:
                    break
                after = batch[-1].position
        return [found[at] for at in sorted(found)]

    async def _open(self, instance: str) -> dict[str, None]:
        """The migrations of ``instance`` open now (those before ``start`` read once)."""
        if instance not in self.read:
            self.read.add(instance)
            started = self.open.setdefault(instance, {})
            if self.start:
                from evstore import events as ev

                before: dict[str, None] = {}
                for recorded in await provider_events(
                    self.store, instance, self.start, self.ENDS, "consumer"
                ):
                    e = recorded.event
                    if isinstance(e, ev.MigrationStarted) and e.instance == instance:
                        before[e.migration] = None
                    elif e.instance == instance:
                        before.pop(e.migration, None)
                self.open[instance] = {**before, **started}
        return self.open[instance]

    async def _left(self, event: Any, position: int) -> list[str]:
        """The migrations the delete ``event`` at ``position`` left holding a leak for its
        consumer: open, not released by it, and holding one right after (each folded alone)."""
        left = []
        for migration in await self._open(event.consumer):
            if migration in event.migrations_released:
                continue
            try:
                view = await self.store.state_at(position=position, consumer=migration)
            except err.CorruptEvent:  # (the tail reports its own damaged rows)
                continue
            held = await view.allocations(migration)
            if held.leaked and held.on_behalf_of == event.consumer:
                left.append(migration)
        return left

    async def _deleted_before(self, consumer: str, position: int) -> int | None:
        """``consumer``'s first tombstone if it is before ``position``."""
        if consumer not in self.deleted_at:
            # (after start, its tombstone would have been listed: only one before needs reading)
            self.deleted_at[consumer] = (
                (await self.store.allocations(consumer)).deleted_at if self.start else None
            )
        at = self.deleted_at[consumer]
        return at if at is not None and at < position else None

    async def _clear(self, consumer: str, deleted: bool) -> str:
        from projections.invariants import clear_leak

        if consumer not in self.leaked_now:
            self.leaked_now[consumer] = (await self.store.allocations(consumer)).leaked
        return f"; {clear_leak(consumer, deleted)}" if self.leaked_now[consumer] else ""


@app.command(cls=_Command)
def history(
    uuid: Annotated[str, typer.Argument(help="Consumer or provider uuid.", metavar="UUID")],
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """Every event that touched a consumer or provider, oldest first, with who asked and what changed."""

    async def work() -> int:
        not_empty(uuid, "the uuid", "a consumer or provider uuid")
        try:
            key = uuid_arg(uuid)
        except err.InvalidInput as exc:
            raise await _provider_named(exc, uuid, db, url, "history {uuid}") from None
        target = resolve_url(db, url)
        async with open_existing(target) as store:
            names = await provider_names(store)
            learned: Names = {}  # (see learn_name)
            names_then = NamesThen(store, key)
            leak_notes = LeakNotes(store, key)
            # Neither the decoded events nor the whole document are kept (a busy provider's
            # history is a good part of the log: 112k events of a 400k-event log took 1.3 GB):
            # with --json each event's text goes to a temporary file, printed once the history
            # was read whole (a damaged row: only the error); the table keeps only its cells.
            rows: list[tuple[str, ...]] = []
            count = 0
            with tempfile.TemporaryFile("w+", encoding="utf-8") as spool:
                try:
                    async for recorded in store.history(key):
                        then = await names_then.at(recorded, names)
                        notes = await leak_notes.on(recorded)
                        if json_out:
                            if count:
                                spool.write(",\n")
                            doc = event_json(recorded, then, learned)
                            doc["summary"] += "".join(f"; {full}" for full, _ in notes)
                            text = json.dumps(doc, indent=2, default=str)
                            spool.write("    " + text.replace("\n", "\n    "))
                        else:
                            cells = event_row(recorded, then, learned)
                            if notes:
                                said = "".join(f"; {short}" for _, short in notes)
                                cells = (*cells[:4], f"{cells[4]}{safe(said)}")
                            rows.append(cells)
                        learn_name(names, learned, recorded)
                        count += 1
                except err.CorruptEvent:
                    # a damaged row: the events before it first (as tail does), then the error; with
                    # --json only the error (a document that stops short would look complete)
                    if rows:
                        table = events_table(
                            f"History of {safe(names.get(key, key))} (up to a damaged event)"
                        )
                        for row in rows:
                            table.add_row(*row)
                        console().print(table)
                    raise
                if not count:  # (with --json too: the same exit code either way)
                    raise err.NotFound(f"no event in this log touches {key}")
                if json_out:
                    # (the bytes emit_json prints for {"url": ..., "uuid": key, "name": ...,
                    # "events": [...]}; name: the provider's, as the table's title gives it,
                    # null for a consumer)
                    fields = {"url": shown(target), "uuid": key, "name": names.get(key)}
                    with to_stdout():
                        sys.stdout.write("{\n")
                        for field, value in fields.items():
                            sys.stdout.write(f"  {json.dumps(field)}: {json.dumps(value)},\n")
                        sys.stdout.write('  "events": [\n')
                        spool.seek(0)
                        shutil.copyfileobj(spool, sys.stdout)
                        sys.stdout.write("\n  ]\n}\n")
                        sys.stdout.flush()
                    return EXIT_OK
        table = events_table(f"History of {safe(names.get(key, key))}")
        for row in rows:
            table.add_row(*row)
        del rows
        console().print(table)
        return EXIT_OK

    run(work)


def consumer_json(view: Any, migrations: list[str], allocated_at: int | None, names: Names) -> dict[str, Any]:
    """``state --consumer --json``: the table's fields (``allocated_at``: its "last allocation
    change at"; ``provider_names``: the names it gives the providers of the allocations, as they
    were then; ``leaked``: the view's, what its status line calls a leak, as the audit and diff do). Its
    allocations in key order (``sorted_holdings``): the same bytes whichever way the state was
    read (the projection at the head, a fold for ``--at``) and on either backend."""
    from projections.views import sorted_holdings

    return {
        "consumer": view.consumer,
        "allocations": sorted_holdings(view.allocations),
        "project_id": view.project_id,
        "user_id": view.user_id,
        "consumer_type": view.consumer_type,
        "generation": view.generation,
        "deleted": view.deleted,
        "deleted_at": view.deleted_at,
        "on_behalf_of": view.on_behalf_of,
        "leaked": view.leaked,
        "migrations_holding_for_it": migrations,
        "allocated_at": allocated_at,
        "provider_names": {uuid: names[uuid] for uuid in sorted(view.allocations) if uuid in names},
    }


@app.command(cls=_Command)
def state(
    at: Annotated[
        str | None,
        typer.Option(
            "--at",
            help="Position or ISO time with zone; default: now (the head).",
            metavar="<position|time>",
        ),
    ] = None,
    provider: Annotated[
        str | None, typer.Option("--provider", help="Show one provider.", metavar="<uuid>")
    ] = None,
    consumer: Annotated[
        str | None, typer.Option("--consumer", help="Show one consumer.", metavar="<uuid>")
    ] = None,
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """The state as it was at a position or time (time travel), or as it is now."""

    async def work() -> int:
        from projections.invariants import clear_leak, leak_of
        from projections.replay import StateView
        from projections.views import sorted_holdings

        if provider is not None and consumer is not None:  # (a usage error, as --db with --url)
            fail("evstore.usage", "give --provider or --consumer, not both", EXIT_USAGE)
        not_empty(at, "--at", "a position or an ISO time with a zone")
        not_empty(provider, "--provider", "a provider uuid")
        not_empty(consumer, "--consumer", "a consumer uuid")
        point = None if at is None else parse_point(at)  # (a usage error before the store is opened)
        if provider is not None:
            try:
                uuid_arg(provider, "provider uuid")
            except err.InvalidInput as exc:
                again = " ".join(["state", *(["--at", shlex.quote(at.strip())] if at is not None else [])])
                raise await _provider_named(exc, provider, db, url, again + " --provider {uuid}") from None
        target = resolve_url(db, url)
        leaked_now = False
        provider_leaks: dict[str, tuple[bool, bool]] = {}
        async with open_existing(target) as store:
            head = await store.head()
            if point is None:
                view = StateView(await store.backend.load_state())
            else:
                position = await store.position_of(point)
                if position > head:
                    raise err.InvalidInput(f"position {position} is beyond the head of the log ({head})")
                _say_if_future(point, "--at", position)
                if provider is not None:
                    # only the provider's slice (its snapshots and history): milliseconds on a
                    # long log, where the whole state is a fold from the nearest snapshot
                    puuid = uuid_arg(provider, "provider uuid")
                    try:
                        view = await store.state_at(position=position, provider=puuid)
                    except err.ProviderNotFound as exc:
                        raise await _no_such_provider(store, exc, puuid) from None
                else:
                    view = await store.state_at(position=position)
            if consumer is not None:
                cuuid = uuid_arg(consumer, "consumer uuid")
                if cuuid not in view.state.consumers and not await _consumer_in_log(store, cuuid):
                    # (as history and state --provider refuse a uuid the log does not know: a
                    # mistyped uuid is an error a script can see, not "absent"; one the log
                    # names, absent at this point - not yet created, released - is absent)
                    raise await _no_such_consumer(store, cuuid)
                # (whether it holds a leak now, at the head: one then that is cleared since has
                # nothing left to clear)
                leaked_now = (await store.allocations(cuuid)).leaked
            if provider is not None:
                puuid = uuid_arg(provider, "provider uuid")
                try:
                    on_it = await view.provider_allocations(puuid)
                except err.ProviderNotFound as exc:
                    raise await _no_such_provider(store, exc, puuid) from None
                provider_leaks = await _leaks_among(store, view, on_it, sliced=point is not None)
            position = view.position
            when: str | None = None
            if position:
                [last] = await store.read(position - 1, 1)
                when = last.recorded_at.isoformat()
        st = view.state
        names = {p.uuid: p.name for p in st.providers.values()}
        header = {"url": shown(target), "position": position, "head": head, "recorded_at": when}
        shown_when = when or "before the first event"  # (position 0 has no time)
        out = console()
        if provider is not None:
            puuid = uuid_arg(provider, "provider uuid")
            usage = await view.usage(puuid)
            holders = await view.provider_allocations(puuid)
            prov = st.providers[puuid]
            if json_out:
                emit_json(
                    {
                        **header,
                        "provider": usage_json(_only(st, puuid))[0],
                        "allocations": sorted_holdings(holders),
                        "consumer_types": {
                            cuuid: c.consumer_type if (c := st.consumers.get(cuuid)) else None
                            for cuuid in sorted(holders)
                        },
                        "leaks": sorted(provider_leaks),
                    }
                )
                return EXIT_OK
            out.print(
                f"Provider {safe(prov.name)} at position {position} ({shown_when}), "
                f"generation {usage.generation}"
            )
            out.print(usage_table(_only(st, puuid), "usage"))
            table = Table(title="allocations on it")
            table.add_column("consumer", no_wrap=True)
            table.add_column("type")
            table.add_column("allocations")
            if provider_leaks:
                table.add_column("leak")
            for cuuid, resources in holders.items():
                c = st.consumers.get(cuuid)
                leak = [] if not provider_leaks else ["-"]
                if cuuid in provider_leaks:
                    deleted, still = provider_leaks[cuuid]
                    leak = ["a leak" + (f": {clear_leak(cuuid, deleted)}" if still else " (cleared since)")]
                table.add_row(
                    cuuid,
                    (c.consumer_type if c else None) or "-",
                    safe(fmt_allocs({puuid: resources}, names)),
                    *map(safe, leak),
                )
            out.print(table)
            if provider_leaks:
                out.print(
                    f"{len(provider_leaks)} of them leaks: allocations held while deleted, or as the "
                    "migration of a deleted instance"
                )
            return EXIT_OK
        if consumer is not None:
            cuuid = uuid_arg(consumer, "consumer uuid")
            cview = await view.allocations(cuuid)
            migrations = sorted(m.uuid for m in st.migrations_for(cuuid))
            known = st.consumers.get(cuuid)
            doc = consumer_json(cview, migrations, known.allocated_at if known else None, names)
            clear = cview.leaked and leaked_now
            if json_out:
                emit_json({**header, **doc})
                return EXIT_OK
            # A migration consumer emptied by its instance's deletion keeps its on_behalf_of (so a
            # late revert learns the instance is gone): it holds nothing for it any more.
            behalf_label = "on behalf of (migration of)"
            # (a migration still holding for a deleted instance holds the audit's leak: say so here
            # too, where the instance's own status is only "deleted")
            holding_label = "migrations holding for it"
            if cview.deleted and migrations:
                holding_label += " (leaks: it is deleted)"
            if cview.on_behalf_of is not None and not cview.allocations:
                behalf_label = "was on behalf of (migration of)"
            status = (
                "deleted (tombstone), yet holds allocations: a leak"
                if cview.leaked and cview.deleted
                else f"holds allocations for deleted instance {cview.on_behalf_of}: a leak"
                if cview.leaked
                else "deleted (tombstone)"
                if cview.deleted
                else "holds allocations"
                if cview.allocations
                else f"released (was on behalf of {cview.on_behalf_of})"
                if cview.on_behalf_of is not None
                else "absent"
            )
            out.print(f"Consumer {cuuid} at position {position} ({shown_when}): {safe(status)}")
            table = Table(show_header=False)
            table.add_column("field")
            table.add_column("value")
            for label, value in (
                ("allocations", fmt_allocs(cview.allocations, names)),
                ("generation", cview.generation),
                ("project / user", f"{cview.project_id or '-'} / {cview.user_id or '-'}"),
                ("type", cview.consumer_type),
                ("deleted at position", cview.deleted_at),
                (behalf_label, cview.on_behalf_of),
                (holding_label, ", ".join(migrations) or "-"),
                ("last allocation change at", doc["allocated_at"]),
                *([("still a leak now", clear_leak(cuuid, cview.deleted))] if clear else []),
            ):
                table.add_row(label, safe("-" if value is None else str(value)))
            out.print(table)
            return EXIT_OK
        holding = [c for c in st.consumers.values() if c.allocations]
        leaks = {c.uuid for c in holding if leak_of(st, c) is not None}  # (the audit's)
        summary = {
            "consumers_holding_allocations": len(holding),
            "tombstones": sum(1 for c in st.consumers.values() if c.deleted),
            # (a migration of a deleted instance is a leak: no revert or confirm will end it)
            "migrations_in_flight": sum(1 for c in holding if c.on_behalf_of and c.uuid not in leaks),
            "leaks": len(leaks),
        }
        if json_out:
            emit_json({**header, **summary, "providers": usage_json(st)})
            return EXIT_OK
        out.print(usage_table(st, f"State at position {position} of {head} ({shown_when})"))
        out.print(
            f"{summary['consumers_holding_allocations']} consumers hold allocations, "
            f"{summary['migrations_in_flight']} of them migrations in flight, "
            f"{summary['leaks']} of them leaks; {summary['tombstones']} tombstones"
        )
        if leaks:
            out.print(
                "leaks: allocations held while deleted, or as the migration of a deleted instance "
                "(evstore audit lists them, and how to clear each)"
            )
        return EXIT_OK

    run(work)


async def _leaks_among(
    store: AllocationStore, view: Any, holders: Mapping[str, Any], *, sliced: bool
) -> dict[str, tuple[bool, bool]]:
    """The consumers of ``holders`` (a provider's, in ``view``) that hold a leak there - the
    audit's, as ``state`` and ``state --consumer`` count them: {consumer: (deleted, whether it
    still holds one now)}. ``sliced``: ``view`` is the provider's slice of time travel, which does
    not know every tombstone (an instance's, for its migration): each consumer that is deleted now
    or holds for an instance (its tombstone, if any, is permanent) is folded on its own then."""
    from projections.invariants import leak_of

    state, found = view.state, {}
    # (a provider's slice keeps no consumer's link to its instance, and a migration released
    # since has none now: the migrations among the holders, from the events that made them so)
    migrations = await _migrations_among(store, holders, view.position) if sliced else set()
    for consumer in holders:
        known = state.consumers.get(consumer)
        if not sliced:
            leak = leak_of(state, known) if known is not None else None
            if known is not None and leak is not None:
                found[consumer] = (known.deleted, True)
            continue
        now = await store.allocations(consumer)
        if not (now.deleted or now.on_behalf_of or consumer in migrations):
            continue
        then = await (await store.state_at(position=view.position, consumer=consumer)).allocations(consumer)
        if then.leaked:
            found[consumer] = (then.deleted, now.leaked)
    return found


async def _migrations_among(store: AllocationStore, consumers: Iterable[str], position: int) -> set[str]:
    """Those of ``consumers`` that a ``MigrationStarted`` up to ``position`` made a migration (a
    ``write_allocations`` move is recorded as one too)."""
    wanted = set(consumers)
    keys = [f"consumer:{c}" for c in sorted(wanted)]
    found: set[str] = set()
    after = 0
    while keys:
        batch = await store.backend.read_entities(keys, after, 1000, position, types=("MigrationStarted",))
        found.update(m for e in batch if (m := getattr(e.event, "migration", None)) in wanted)
        if len(batch) < 1000:
            break
        after = batch[-1].position
    return found


async def _consumer_in_log(store: AllocationStore, consumer: str) -> bool:
    """Whether any event of the log touches the consumer ``consumer`` (its history is not empty)."""
    return bool(await store.backend.read_entities([f"consumer:{consumer}"], 0, 1))


async def _no_such_consumer(store: AllocationStore, consumer: str) -> err.NotFound:
    """The refusal of a uuid no event names as a consumer; one the log names as a provider's -
    pasted from a usage table - says so (it is named on every line of its history)."""
    message = f"no event in this log touches consumer {consumer}"
    if await store.backend.read_entities([f"provider:{consumer}"], 0, 1):
        message += f": it is a resource provider's uuid (`evstore state --provider {consumer}` shows it)"
    return err.NotFound(message, consumer=consumer)


async def _no_such_provider(
    store: AllocationStore, exc: err.ProviderNotFound, provider: str
) -> err.ProviderNotFound:
    """``exc`` (``state --provider`` of a uuid that is no provider there), saying so when the
    uuid is a consumer's."""
    if not await _consumer_in_log(store, provider):
        return exc
    told = f"{exc.message}: it is a consumer's uuid (`evstore state --consumer {provider}` shows it)"
    return err.ProviderNotFound(told, **exc.details)


def _only(state: State, provider: str) -> State:
    from projections.state import State

    return State(state.position, {provider: state.providers[provider]})


def backwards(a: str, b: str) -> NoReturn:
    """``diff A B`` with A after B: arguments that conflict, a usage error (exit 2), as ``--db``
    with ``--url`` is - not a reverse diff, whose "events that did it" would be none."""
    fail(
        "evstore.usage",
        f"A ({a.strip():.60}) is after B ({b.strip():.60}): diff shows what changed from A to B; "
        "give the earlier point first",
        EXIT_USAGE,
    )


def _positions(positions: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(map(str, positions[:limit]))
    return shown + (f" (+{len(positions) - limit} more)" if len(positions) > limit else "")


@app.command(cls=_Command)
def diff(
    a: Annotated[str, typer.Argument(help="From: position or ISO time with zone.", metavar="A")],
    b: Annotated[str, typer.Argument(help="To: position or ISO time with zone.", metavar="B")],
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """What changed between two points of the log, and which events (positions) did it."""

    async def work() -> int:
        from projections.invariants import clear_leak

        not_empty(a, "A", "a position or an ISO time with a zone")
        not_empty(b, "B", "a position or an ISO time with a zone")
        start, end = parse_point(a, "A"), parse_point(b, "B")  # (before the store is opened)
        if type(start) is type(end) and start > end:  # type: ignore[operator]
            backwards(a, b)
        target = resolve_url(db, url)
        async with open_existing(target) as store:
            if type(start) is not type(end):  # (a time and a position: the log says which is first)
                start, end = await store.position_of(start), await store.position_of(end)
                if start > end:
                    backwards(a, b)
            result = await store.diff(start, end)
            _say_if_future(parse_point(a, "A"), "A", result.from_position)
            _say_if_future(parse_point(b, "B"), "B", result.to_position)
            # (names as the usage deltas give them, at b or else at a; today's only for a
            # provider neither end holds: allocations an imported log left on an absent one)
            names = {**await provider_names(store), **result.provider_names}
            # the consumers leaked at b that still are, at the head: how to clear each
            still_leaked = []
            if not json_out:
                for c in result.of_change("leaked"):
                    if (now := await store.allocations(c.consumer)).leaked:
                        still_leaked.append(now)
        if json_out:
            emit_json({"url": shown(target), **result.to_dict()})
            return EXIT_OK
        out = console()
        n = sum(result.events_by_type.values())
        kinds = ", ".join(f"{t} {c}" for t, c in sorted(result.events_by_type.items())) or "none"
        events = f"{n} event" if n == 1 else f"{n} events"
        out.print(f"From position {result.from_position} to {result.to_position}: {events} ({kinds})")
        for label, uuids in (
            ("providers created", result.providers_created),
            ("providers deleted", result.providers_deleted),
        ):
            if uuids:
                listed = ", ".join(f"{names[u]} ({u})" if u in names else u for u in uuids)
                out.print(f"{label} ({len(uuids)}): {safe(listed)}")
        usage = Table(title="usage deltas")
        for col in ("provider", "class", "before", "after", "delta", "events"):
            usage.add_column(col, justify="right" if col in ("before", "after", "delta") else "left")
        for u in result.usage:
            usage.add_row(safe(u.name), u.resource_class, str(u.before), str(u.after), f"{u.delta:+d}",
                          _positions(u.positions))  # fmt: skip
        out.print(usage)
        consumers = Table(title="consumers")
        # (a migration's instance, as --json's on_behalf_of names it: a column only when one is there)
        instances = any(c.on_behalf_of for c in result.consumers)
        for col in (
            "consumer",
            "change",
            "type",
            *(["instance"] if instances else []),
            "before",
            "after",
            "events",
        ):
            consumers.add_column(col, no_wrap=col == "consumer")
        for c in result.consumers:
            consumers.add_row(
                c.consumer,
                c.change,
                c.consumer_type or "-",
                *([c.on_behalf_of or "-"] if instances else []),
                safe(fmt_allocs(c.before, names)),
                safe(fmt_allocs(c.after, names)),
                _positions(c.positions),
            )
        out.print(consumers)
        for c in result.consumers:  # (what else moved: why equal allocations are "changed")
            if c.labels_changed:
                moved = ", ".join(f"{k} {v[0] or '-'} → {v[1] or '-'}" for k, v in c.labels_changed.items())
                out.print(f"consumer {c.consumer}: {safe(moved)}")
        for now in still_leaked:
            out.print(f"consumer {now.consumer} still holds a leak: {clear_leak(now.consumer, now.deleted)}")
        return EXIT_OK

    run(work)


@app.command(cls=_Command)
def tail(
    after: Annotated[
        int | None,
        typer.Option(
            "--after",
            parser=functools.partial(parse_position, option="--after"),
            metavar="<position>",
            help="Start after this position (default: the head).  [0<=x<=9223372036854775807]",
        ),
    ] = None,
    limit: Annotated[
        int | None, typer.Option("--limit", min=1, help="Stop after this many events.", metavar="<count>")
    ] = None,
    follow: Annotated[bool, typer.Option("--follow/--no-follow", help="Wait for new events.")] = True,
    db: DbOption = None,
    url: UrlOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Print events as they are appended (by any process), until interrupted (Ctrl-C or SIGTERM)."""

    refuse_closed_stdout("tail", "its events", " (redirect it to a file or a pipe)")

    async def follow_log() -> int:
        async with open_existing(resolve_url(db, url)) as store:
            head = await store.head()
            start = head if after is None else after
            if start > head:  # (as state and diff: a position the log has not reached)
                raise err.InvalidInput(f"position {start} is beyond the head of the log ({head})")
            then = await provider_names_at(store, start, head)
            names = await provider_names(store) if then is None else then
            learned: Names = dict(then or {})  # (see learn_name: known names, as of start)
            out = console()
            file = await _file_of(store)  # (before "following": what the file must stay)
            if follow:
                # (--limit: it stops after that many events, wherever the head is by then)
                count = "" if limit is None else f" for {limit} event{'s' if limit != 1 else ''}"
                note(f"following {shown(store.url)} after position {start}{count} (Ctrl-C to stop)")
            else:
                # (positions are gap-free: --limit N ends it at start + N when the head is past that)
                end = head if limit is None else min(head, start + limit)
                also = f" (--limit {limit}; the head is {head})" if end < head else ""
                note(f"events of {shown(store.url)} after position {start} up to {end}{also}")
            seen = 0
            if not follow and start >= head:
                return EXIT_OK
            leak_notes = TailLeakNotes(store, start, head, limit)
            async for recorded in _following(store, start, follow, file):
                if not follow and recorded.position > head:
                    break
                said = "".join(f"; {text}" for text in await leak_notes.on(recorded))
                if json_out:
                    doc = event_json(recorded, names, learned)
                    doc["summary"] += said  # (as history's)
                    with to_stdout():
                        print(json.dumps(doc, default=str), flush=True)
                else:
                    meta = recorded.metadata  # (as history shows it: request / actor)
                    who = " / ".join(x for x in (meta.request_id, meta.actor) if x) or "-"
                    what = describe(recorded.event, names, short=True, learned=learned) + said
                    out.print(  # (never folded: one event, one line, for grep)
                        f"{recorded.position:>8} {recorded.recorded_at.isoformat(timespec='microseconds')} "
                        f"{recorded.type:<20} {safe(who)}  {safe(what)}",
                        soft_wrap=True,
                    )
                    sys.stdout.flush()
                learn_name(names, learned, recorded)
                seen += 1
                if (limit is not None and seen >= limit) or (not follow and recorded.position >= head):
                    break
        return EXIT_OK

    # SIGTERM (kill, systemd, a container stopping) stops it as Ctrl-C does: the store closed,
    # exit 0 - not the default action's death mid-write
    run(_sigterm_cancels(follow_log, EXIT_OK), interrupt_code=EXIT_OK)


#: PostgreSQL's answers when the store's tables or its schema are gone (dropped while followed)
GONE_SQLSTATES = frozenset({"42P01", "3F000"})


async def _following(store: Any, after: int, follow: bool, file: os.stat_result | None = None) -> Any:
    """``store.subscribe(after)``; when following, a storage failure (a server restart, a lost
    connection) is reported on stderr and the subscription starts again after the last event
    delivered, once a second has passed, instead of ending the follow. A damaged row, a schema
    of another version or a closed store still end it, and so does a store that is gone (its
    SQLite file removed or replaced - ``evstore demo`` replaces its file -, its PostgreSQL tables
    dropped): ``evstore.not_found``, not a follow of nothing for ever. ``file``: the SQLite
    file's ``os.stat`` when the store was opened (:func:`_file_of`), what it must stay."""
    fatal = (err.CorruptEvent, err.SchemaVersionError, err.StoreClosed)
    gone: list[str] = []  # (why the store was closed under the subscriber, if it was)
    watch = asyncio.ensure_future(_file_gone(store, file, gone)) if follow and file else None
    try:
        while True:
            try:
                async for recorded in store.subscribe(after):
                    after = recorded.position
                    yield recorded
                return
            except err.StoreClosed:
                if gone:
                    raise err.NotFound(gone[0]) from None
                raise
            except err.StorageError as exc:
                if exc.details.get("sqlstate") in GONE_SQLSTATES:
                    raise err.NotFound(
                        f"The store's tables are gone ({first_line(exc.message, 200)}): it was "
                        "dropped while tail followed it"
                    ) from None
                if not follow or isinstance(exc, fatal):
                    raise
                why = first_line(exc.message, 200)
                note(f"reading the log failed ({exc.code}: {why}); trying again")
                await asyncio.sleep(1)
    finally:
        if watch is not None:
            watch.cancel()


def first_line(text: str, limit: int) -> str:
    """The first line of ``text`` in at most ``limit`` characters: cut at a word, with an
    ellipsis, when it is longer (a note of a failed read, one line)."""
    lines = text.splitlines()
    line = lines[0] if lines else ""
    if len(line) <= limit:
        return line
    cut = line[: limit - 1]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(" :,;") + "…"


def _sqlite_file(url: str) -> str | None:
    """The file of a SQLite store's URL (None: in memory, or PostgreSQL)."""
    if not url.startswith("sqlite:"):
        return None
    from evstore.log.sqlite import parse_sqlite_url

    path, _ = parse_sqlite_url(url)
    return None if path == ":memory:" else path


def _path_of(store: Any) -> str | None:
    """The file of a SQLite store (None: in memory, or PostgreSQL)."""
    return _sqlite_file(str(getattr(store, "url", "")))


async def _file_of(store: Any) -> os.stat_result | None:
    """``os.stat`` of a SQLite store's file, taken as it is opened (None: no file to watch)."""
    path = _path_of(store)
    if path is None:
        return None
    try:
        return await asyncio.to_thread(os.stat, path)
    except OSError:
        return None


async def _file_gone(store: Any, first: os.stat_result, gone: list[str], every: float = 1.0) -> None:
    """For a followed SQLite store: wait until its file is removed or replaced by another (the
    subscriber would follow the unlinked file for ever, printing nothing), then close the store
    (ending the subscriber), having said in ``gone`` what happened."""
    path = _path_of(store)
    assert path is not None
    while True:
        await asyncio.sleep(every)
        try:
            now: os.stat_result | None = await asyncio.to_thread(os.stat, path)
        except FileNotFoundError:
            now = None
        except OSError:
            continue
        if now is None or (now.st_dev, now.st_ino) != (first.st_dev, first.st_ino):
            what = "removed" if now is None else "replaced by another file"
            gone.append(f"The database {path} was {what} while tail followed it: run tail again")
            with contextlib.suppress(Exception):  # (its error would go unheard in this task)
                await store.close()
            return


# --- clearing a leak: release, confirm-migration ------------------------------------------------

#: the actor the events these commands write record (``history``'s "request / actor"): a person
#: at the command line, where a service's commands carry its own
CLI_ACTOR = "evstore-cli"


@app.command(cls=_Command)
def release(
    consumer: Annotated[str, typer.Argument(help="Consumer uuid.", metavar="CONSUMER")],
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """Release every allocation a consumer holds (store.release): how a deleted consumer's leak is cleared."""
    run(functools.partial(_clear, consumer, db, url, json_out, migration=False))


@app.command("confirm-migration", cls=_Command)
def confirm_migration(
    migration: Annotated[str, typer.Argument(help="Migration consumer uuid.", metavar="MIGRATION")],
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """Confirm a migration, releasing what it holds (store.confirm_migration): how the leak of a
    deleted instance's migration is cleared."""
    run(functools.partial(_clear, migration, db, url, json_out, migration=True))


async def _clear(given: str, db: str | None, url: str | None, json_out: bool, *, migration: bool) -> int:
    """``release`` or ``confirm-migration``: the API call, and what it released. Every refusal is
    the API's, but for two: a uuid no event names is ``evstore.not_found`` (as for ``history`` and
    ``state --consumer``), and a consumer the log names that holds nothing has nothing to release
    (exit 0: a second run, or one after the instance's delete released it, leaves what was asked)."""
    from evstore import events as ev
    from projections.invariants import clear_leak
    from projections.views import sorted_holdings

    what = "migration" if migration else "consumer"
    not_empty(given, f"the {what}", f"a {what} uuid")
    key = uuid_arg(given, f"{what} uuid")
    target = resolve_url(db, url)
    nothing: err.EvstoreError | None = None
    instance: str | None = None  # (a migration's: the one confirmed, or the one the log names)
    # Nothing is read before the command: another writer may change the consumer in between
    # (what it says is the log's: the refusal's, or the state its own event released from)
    cleared = False
    async with open_existing(target) as store:
        command = store.confirm_migration if migration else store.release
        try:
            receipt = await command(key, metadata={"actor": CLI_ACTOR})
        except (err.NotFound, err.ConsumerDeleted) as exc:
            if not await _consumer_in_log(store, key):
                raise await _no_such_consumer(store, key) from None
            # (a release is refused only for a consumer that held nothing when it was decided:
            # what it holds by now, another writer's since, is no reason to fail)
            if migration and (now := await store.allocations(key)).allocations:
                # (it holds allocations, but not as a migration the API confirms: a deleted
                # consumer's leak, which the refusal says nothing of, is released otherwise)
                if now.leaked and now.deleted:
                    told = f"{exc.message}; it holds a leak: {clear_leak(key, True)}"
                    raise type(exc)(told, **exc.details) from None
                raise await _its_migrations_said(store, exc, key) from None
            instance = await _instance_of(store, key) if migration else None
            if migration and instance is None:
                # (not a migration: an instance's uuid given by mistake is not "nothing")
                raise await _its_migrations_said(store, exc, key) from None
            nothing = exc
        released: dict[str, dict[str, int]] = {}
        position: int | None = None
        if nothing is None:
            [position] = receipt.positions  # (one event: what it released, exactly)
            [recorded] = await store.read(position - 1, 1)
            event = recorded.event
            assert isinstance(event, ev.AllocationsReleased | ev.MigrationConfirmed), event
            released = sorted_holdings(event.released)
            instance = event.instance if isinstance(event, ev.MigrationConfirmed) else None
            # (whether what it released was a leak: the consumer as the log has it just before)
            then = await store.state_at(position=position - 1, consumer=key)
            cleared = (await then.allocations(key)).leaked
        after = await store.allocations(key)  # (its tombstone, if any: permanent)
        # (a deleted instance's migrations may hold a leak for it still: its release left them)
        still = await _leaking_migrations(store, key) if after.deleted and not migration else []
        names = await provider_names(store)
    if json_out:
        emit_json(
            {
                "url": shown(target),
                what: key,
                **({"instance": instance} if migration else {}),
                "released": released,
                "position": position,  # (null: nothing to release)
                "leak_cleared": cleared,
                **({} if migration else {"migrations_leaking": still}),
                "provider_names": {uuid: names[uuid] for uuid in released if uuid in names},
            }
        )
        return EXIT_OK
    if nothing is not None:
        # (a migration's instance named as its --json names it, and as its confirmation does)
        who = f"migration {key} of instance {instance}" if migration else f"consumer {key}"
        line = f"{who} holds nothing: nothing to release"
        if isinstance(nothing, err.ConsumerDeleted):  # (why a migration has nothing left: the API's words)
            line += f" ({nothing.message})"
        elif after.deleted:
            line += f" (deleted at position {after.deleted_at})"
    else:
        done = f"migration {key} of instance {instance} confirmed" if migration else f"consumer {key}"
        line = f"{done}: released {fmt_allocs(released, names)} at position {position}"
        if cleared:
            line += "; its leak is cleared" if still else "; the leak is cleared"
    for m in still:  # (said also when it held nothing: its migrations' leaks are what is left)
        line += f"; migration {m} still holds a leak for it: {clear_leak(m, False)}"
    console().print(safe(line), soft_wrap=True)
    return EXIT_OK


async def _migrations_of(store: AllocationStore, instance: str) -> list[str]:
    """The migrations started for ``instance`` (its history names them), oldest first."""
    from evstore import events as ev

    started: dict[str, None] = {}
    async for recorded in store.history(instance):
        if isinstance(event := recorded.event, ev.MigrationStarted) and event.instance == instance:
            started.setdefault(event.migration, None)
    return list(started)


async def _leaking_migrations(store: AllocationStore, instance: str) -> list[str]:
    """The migrations started for ``instance`` that hold a leak now."""
    return [m for m in await _migrations_of(store, instance) if (await store.allocations(m)).leaked]


async def _its_migrations_said(
    store: AllocationStore, exc: err.EvstoreError, consumer: str
) -> err.EvstoreError:
    """``exc``, the refusal of ``confirm-migration CONSUMER`` for a consumer that is no migration,
    naming the command to run when ``consumer`` is an instance whose migrations hold allocations
    for it now (the instance's uuid given where its migration's belongs)."""
    holding = []
    for m in await _migrations_of(store, consumer):
        view = await store.allocations(m)
        if view.allocations and view.on_behalf_of == consumer:
            holding.append(m)
    if not holding:
        return exc
    commands = " or ".join(f"`evstore confirm-migration {m}`" for m in holding)
    told = f"{exc.message}; {consumer} is an instance: its migration holds allocations for it, {commands}"
    return type(exc)(told, **exc.details)


async def _instance_of(store: AllocationStore, consumer: str) -> str | None:
    """The instance ``consumer`` was last a migration of (None: never a migration consumer): the
    last event that moved an instance's allocations to it (a confirm or revert forgets the link,
    its instance's delete keeps it; the log still names it)."""
    from evstore import events as ev

    instance: str | None = None
    async for recorded in store.history(consumer):
        if isinstance(event := recorded.event, ev.MigrationStarted) and event.migration == consumer:
            instance = event.instance
    return instance


# --- maintenance: rebuild, snapshot, stats, export, import --------------------------------------


def progress_bar() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True, width=output_width(sys.stderr)),
        transient=False,
        disable=not sys.stderr.isatty(),  # piped: no bar (and no stray newline before an error line)
    )


@app.command(cls=_Command)
def rebuild(
    db: DbOption = None,
    url: UrlOption = None,
    batch_size: Annotated[
        int, typer.Option(min=1, max=MAX_POSITION, help="Events folded per batch.", metavar="<events>")
    ] = 5000,
    full: Annotated[
        bool,
        typer.Option(
            "--full", help="Rewrite every row and rebuild every index (default: only what differs)."
        ),
    ] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Rebuild even when the log lost its last events (the audit's log_truncated): forgets them.",
        ),
    ] = False,
    json_out: JsonOption = False,
) -> None:
    """Refold the persisted projection from the log and repair it (snapshots are dropped too)."""

    async def work() -> int:
        target = resolve_url(db, url)
        async with open_existing(target, upgrade=True) as store:
            head = await store.head()
            with progress_bar() as bar:
                task = bar.add_task("rebuilding", total=head or 1)
                folded = await store.rebuild(
                    batch_size, lambda done, total: bar.update(task, completed=done), full=full, force=force
                )
                bar.update(task, completed=head or 1)
            # (the rebuild dropped the time-travel snapshots, in its transaction: say how many, which
            # `snapshot` took ahead of the questions, perhaps - or state and diff saved on their way)
            snapshots = folded.snapshots_dropped
        if json_out:
            emit_json({"url": shown(target), "events": folded, "head": head, "snapshots_dropped": snapshots})
        else:
            dropped = (
                f"; dropped its {snapshots} time-travel snapshot{'s' if snapshots != 1 else ''} "
                "(`evstore snapshot` takes them again)"
                if snapshots
                else ""
            )
            console().print(f"rebuilt the projection from {folded} events (head {head}){dropped}")
        return EXIT_OK

    run(work)


@app.command(cls=_Command)
def snapshot(
    db: DbOption = None,
    url: UrlOption = None,
    every: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=MAX_POSITION,
            help="Events between snapshots (default: the store's, 10000).",
            metavar="<events>",
        ),
    ] = None,
    json_out: JsonOption = False,
) -> None:
    """Take the missing snapshots of the folded state (every N events) so time travel is fast."""

    async def work() -> int:
        options: StoreOptions = {"upgrade": True}
        if every is not None:
            options["snapshot_every"] = every
        target = resolve_url(db, url)
        async with open_existing(target, **options) as store:
            head = await store.head()
            with progress_bar() as bar:
                task = bar.add_task("folding", total=head or 1)
                positions = await store.take_snapshots(lambda done: bar.update(task, completed=done))
        if json_out:
            emit_json({"url": shown(target), "head": head, "snapshot_positions": positions})
        else:
            console().print(
                f"snapshots at positions: {', '.join(map(str, positions)) or 'none'} (head {head})"
            )
        return EXIT_OK

    run(work)


@app.command(cls=_Command)
def stats(db: DbOption = None, url: UrlOption = None, json_out: JsonOption = False) -> None:
    """Event counts by type, head position, database size and snapshot positions."""

    async def work() -> int:

        target = resolve_url(db, url)
        async with open_existing(target) as store:
            found = {"url": shown(target), **await store.stats()}
        snaps = found["snapshot_positions"]
        if json_out:
            emit_json(found)
            return EXIT_OK
        out = console()
        size = found["db_bytes"]
        out.print(
            f"{safe(shown(target))}: head {found['head']}" + (f", {size:,} bytes" if size is not None else "")
        )
        table = Table(title="events by type")
        table.add_column("type")
        table.add_column("count", justify="right")
        for etype, count in found["events_by_type"].items():
            table.add_row(safe(etype), str(count))
        out.print(table)
        out.print(f"snapshots at positions: {', '.join(map(str, snaps)) or 'none'}")
        if found["backend"].get("unpositioned"):
            out.print(
                f"{found['backend']['unpositioned']} committed event(s) not yet given a position "
                "(the next command or read of the log positions them)"
            )
        return EXIT_OK

    run(work)


@app.command(cls=_Command)
def upgrade(db: DbOption = None, url: UrlOption = None, json_out: JsonOption = False) -> None:
    """Upgrade a store an older evstore wrote to this evstore's schema version.

    Stop the processes running an older evstore on it first: the upgrade closes the store to them.
    The commands that only read refuse such a store (evstore.schema.version) rather than upgrade
    it, as do release and confirm-migration, and demo and import (which need an empty store);
    rebuild and snapshot upgrade it as they open it, as open_store does.
    """

    async def work() -> int:
        target = resolve_url(db, url)
        path = _sqlite_file(target)
        async with open_existing(target, upgrade=True) as store:
            upgraded_from = store.backend.upgraded_from  # (the open upgrades it, in one transaction)
            repaired = store.backend.repaired  # (or repairs a current one that lost schema objects)
            log_lost = repaired is not None and "events" in repaired.made_again
            # (also when nothing was repaired now: an upgrade run again on a store whose log was
            # lost, or that lost its last events, said "already", exit 0, as for a sound store)
            lost = await store.backend.lost_tail()
        if path is not None:
            from evstore.log.sqlite import SCHEMA_VERSION
        else:
            from evstore.log.postgres import SCHEMA_VERSION
        if json_out:
            # (upgraded_from: the version it had, when this upgraded it; null when it was current.
            # repaired: what it made again, dropped, refolded in a current store; null: nothing)
            emit_json(
                {
                    "url": shown(target),
                    "schema_version": SCHEMA_VERSION,
                    "upgraded_from": upgraded_from,
                    "repaired": None if repaired is None else repaired.to_dict(),
                }
            )
        elif upgraded_from is not None:
            console().print(
                f"{safe(shown(target))}: upgraded from schema version {upgraded_from} to {SCHEMA_VERSION}"
            )
        elif repaired is not None:
            done = []
            if repaired.made_again:
                done.append(f"made {', '.join(repaired.made_again)} again")
            if log_lost:
                done.append("the log is empty: the events it held are lost")
            if repaired.dropped:
                done.append(f"dropped {', '.join(repaired.dropped)} (indexes of an earlier version)")
            if repaired.refolded:
                done.append("refolded the projection from the log")
            if not done:  # (a refold left pending, and refused: the log cannot be folded)
                done.append("its projection was not refolded (`evstore audit` says why)")
            console().print(
                f"{safe(shown(target))}: at schema version {SCHEMA_VERSION}, repaired: {'; '.join(done)}"
            )
        elif lost is not None:
            console().print(f"{safe(shown(target))}: at schema version {SCHEMA_VERSION}; its log is damaged")
        else:
            console().print(f"{safe(shown(target))}: at schema version {SCHEMA_VERSION} already")
        if lost is not None and not log_lost:
            # (the audit's log_truncated, which rebuild refuses to forget: said as they say it)
            fail(err.CorruptEvent.code, f"{shown(target)}: {lost.message()}")
        if log_lost:
            # (the table of the log itself was gone - dropped, left out of a restore: the one made
            # again is empty, and what it held is not in the store any more; "repaired" alone read
            # as if all were well)
            kept = ""
            advice = (
                "restore the store from a backup, or `evstore import` an export of it into a new, empty store"
            )
            if repaired is not None and repaired.refolded:  # (nothing recorded a lost event's position)
                kept = "; the projection was refolded from it, and is empty too"
            else:
                if lost is not None:  # (as the audit's log_truncated finding says, and a rebuild refuses)
                    upto = f" (up to position {lost.position})" if lost.position > lost.head else ""
                    kept = f"; the projection still records what the lost events did{upto}, left as it was"
                advice += (
                    "; `evstore audit` shows what the projection holds, and `evstore rebuild --force` "
                    "accepts the loss (it empties the projection)"
                )
            fail(
                err.CorruptEvent.code,
                f"the events table of {shown(target)} was missing (dropped, or left out of a restore): "
                f"the log is lost, and upgrade made an empty one{kept}: {advice}",
            )
        return EXIT_OK

    run(work)


@app.command(cls=_Command)
def export(
    db: DbOption = None,
    url: UrlOption = None,
    output_path: Annotated[
        str | None,
        typer.Option("--output", "-o", help="File to write (default, or -: stdout).", metavar="<file>"),
    ] = None,
    json_out: Annotated[
        bool,
        typer.Option(
            "--json",
            help="With --output: what was written, as JSON on stdout (the export is JSON lines always).",
        ),
    ] = False,
) -> None:
    """Write the whole log as JSON lines (a header, then every row verbatim, hashes included)."""
    output = None
    if output_path is not None and output_path != "-":
        try:
            output = given_path(output_path, "--output", must_exist=False)
        except err.EvstoreError as exc:
            fail(exc.code, exc.message)
    if output is None:
        refuse_closed_stdout("export", "the log", " (give --output FILE, or redirect it)")
    else:
        _refuse_a_closed_stream(output)
        _refuse_a_descriptor_not_open(output)

    async def work() -> int:

        source = resolve_url(db, url)
        async with open_existing(source) as store:
            head = await store.head()
            if output is None:
                async for line in store.export():
                    with to_stdout():
                        sys.stdout.write(line + "\n")
                with to_stdout():
                    sys.stdout.flush()
                return EXIT_OK
            final, in_place = _export_target(output)
            _refuse_own_database(source, final)
            sink_path = final if in_place else final.with_name(final.name + ".partial")
            try:
                # (in place: appending, as a shell's >> or a pipe expects; never truncating)
                sink = await _open_in_place(sink_path) if in_place else sink_path.open("w", encoding="utf-8")
                with progress_bar() as bar, sink:
                    task = bar.add_task("exporting", total=head or 1)
                    written = -1  # the header is not an event
                    async for line in store.export():
                        sink.write(line + "\n")
                        written += 1
                        if written % 1000 == 0:
                            bar.update(task, completed=written)
                    bar.update(task, completed=head or 1)
                if not in_place:
                    sink_path.replace(final)
            except BaseException as exc:
                if not in_place:
                    sink_path.unlink(missing_ok=True)  # (a failed export must not leave a disk full)
                if isinstance(exc, OSError) and not isinstance(exc, BrokenPipeError):
                    # (which file it could not write: the error alone named none, "[Errno 28] ...")
                    fail("evstore.io", f"cannot write the export to {output}: {exc.strerror or exc}")
                raise
        # (what was written: the export reads its own head, after the one above, and writers
        # may have appended in between)
        if json_out and not _is_stdout(output):  # (-o /dev/stdout: the lines are the output)
            emit_json({"url": shown(source), "output": str(output), "exported": written})
        else:
            note(f"exported {written} events to {output}")
        return EXIT_OK

    # (SIGTERM as Ctrl-C: the half-written FILE.partial removed, exit 143)
    run(work, terminate_code=EXIT_TERMINATED)


async def _open_in_place(path: Path) -> io.TextIOWrapper:
    """``path`` opened for appending text, as ``open(path, "a")`` does, but a named pipe no process
    reads yet is waited for here, at the loop's turns, not in the kernel: the open of a FIFO for
    writing blocks until a reader opens it, and a signal's handler ran there without ending it (the
    loop's cancellation waits for its next turn), so the first Ctrl-C or SIGTERM did nothing and
    only a second one ended ``export -o FIFO``. Opened without blocking (a FIFO with no reader:
    ENXIO, tried again), then made blocking again for the writes."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
    try:
        fifo = stat.S_ISFIFO(os.stat(path).st_mode)
    except OSError:
        fifo = False  # (the open says why)
    if not fifo or not hasattr(os, "O_NONBLOCK"):
        return path.open("a", encoding="utf-8")
    while True:
        try:
            fd = os.open(path, flags | os.O_NONBLOCK, 0o666)
        except OSError as exc:
            if exc.errno != errno.ENXIO:  # (ENXIO: no reader yet)
                raise
            await asyncio.sleep(0.05)
            continue
        break
    try:
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a", encoding="utf-8")  # (closed by the caller's with)
    except BaseException:
        os.close(fd)
        raise


def _is_stdout(path: Path) -> bool:
    """Whether ``path`` is the file, pipe or terminal standard output writes to."""
    try:
        mine, theirs = os.fstat(sys.stdout.fileno()), os.stat(path)
    except (OSError, ValueError):  # (no stdout, or one without a descriptor)
        return False
    return (mine.st_dev, mine.st_ino) == (theirs.st_dev, theirs.st_ino)


def _refuse_own_database(url: str, output: Path) -> None:
    """``export -o`` naming the SQLite database it exports (or its -wal, -shm or -journal file)
    would replace the store with its export: refused before anything is written."""
    path = _sqlite_file(url)
    if path is None:
        return
    database = Path(path).resolve()
    own = [Path(f"{database}{suffix}") for suffix in ("", "-wal", "-shm", "-journal")]
    try:
        hit = output.resolve() in own or (output.exists() and os.path.samefile(output, database))
    except OSError:
        hit = False
    if hit:
        fail(
            "evstore.invalid_input",
            f"--output {output} is the database being exported ({database}) or one of its files: "
            "writing the export there would destroy the store; name another file",
        )


def _export_target(output: Path) -> tuple[Path, bool]:
    """Where ``export -o`` writes, and whether in place. A regular file (a symlink's target) is
    written beside it and renamed over it, so a half-written export never carries the final
    name. Anything else is written to as it is: a pipe or a device (renaming over one would
    replace it with a file and write nothing to it), and a file reached through a descriptor
    link (``/dev/stdout``, ``/dev/fd/3``, ``/proc/self/fd/1``: the shell opened it, perhaps for
    appending, and replacing it would lose what it held)."""
    try:
        st = os.stat(output)  # (follows links, /proc/self/fd/N to a pipe included)
    except FileNotFoundError:
        st = None
    except OSError as exc:  # a symlink loop, a path through a file...
        fail("evstore.io", f"cannot write the export to {output}: {exc.strerror or exc}")
    absolute = Path(os.path.abspath(output))
    through_descriptor = absolute.parts[1:2] in (("dev",), ("proc",))
    if st is not None and (not stat.S_ISREG(st.st_mode) or through_descriptor):
        return output, True
    try:
        final = output.resolve()
    except (OSError, RuntimeError) as exc:  # (RuntimeError: a symlink loop, on Python 3.11)
        fail("evstore.io", f"cannot write the export to {output}: {exc}")
    if not final.parent.is_dir():
        fail("evstore.not_found", f"cannot write the export to {output}: no directory {final.parent}")
    return final, False


@app.command("import", cls=_Command)
def import_(
    file: Annotated[
        str, typer.Argument(help="An export (JSON lines); - reads standard input.", metavar="FILE")
    ],
    db: DbOption = None,
    url: UrlOption = None,
    json_out: JsonOption = False,
) -> None:
    """Load an export into an empty store: validated first, positions, ids, hashes and times kept.

    The imported log is then audited: exit 0 when clean, 3 when the log itself holds findings
    (e.g. leaks written by an older writer), 1 when the file was refused (nothing is imported).
    """
    try:
        target = resolve_url(db, url, must_exist=False)
        if target.startswith("sqlite:") and _sqlite_file(target) is None:
            # (it said "imported N events" into a store gone as the command ended: the one rule of
            # the commands that write - the others refuse a store in memory, which holds none)
            raise err.InvalidInput(
                f"{shown(target)} is a store in memory, gone when the command ends: an import into it "
                "keeps nothing; import into a database file (--db PATH) or a PostgreSQL schema"
            )
        stdin = file in ("-", "/dev/stdin", "/dev/fd/0", "/proc/self/fd/0")
        if sys.stdin is None and stdin:
            # (`<&-`: its descriptor would be the next file opened - the spool's own, or the store)
            fail(
                "evstore.io",
                "standard input is closed: nothing to import; give the export's file, or pipe it in "
                "(evstore export --db a.db | evstore import - --db b.db)",
            )
        # (`-`: standard input, as most tools read it; the spool below copies it)
        export_file = Path("/dev/stdin") if file == "-" else given_path(file, "FILE", must_exist=True)
    except err.EvstoreError as exc:
        fail(exc.code, exc.message)
    created: Path | None = None  # a SQLite file this command creates: removed if the import is refused
    if target.startswith("sqlite:"):
        from evstore.log.sqlite import foreign_tables, parse_sqlite_url

        path, _ = parse_sqlite_url(target)
        if path != ":memory:" and not Path(path).exists():
            created = Path(path)
        else:
            try:
                others = foreign_tables(target)
            except err.EvstoreError as exc:  # (locked past busy_timeout, unreadable: as the open says it)
                fail(exc.code, exc.message)
            if others:
                fail(
                    "evstore.invalid_input",
                    f"{path} is not an evstore store: it holds another application's tables "
                    f"({', '.join(others[:5])}{', ...' if len(others) > 5 else ''}); import into a new file",
                )

    imported: list[int] = []  # (set once the import committed)
    source = export_file
    spooled: list[Path] = []  # the temporary copy of piped input, once made (removed at the end)

    async def work() -> int:
        def lines() -> Any:
            with source.open(encoding="utf-8") as stream:
                try:
                    yield from stream
                except UnicodeDecodeError:
                    raise err.InvalidInput(
                        f"{export_file} is not UTF-8 text: not an evstore export"
                    ) from None

        # (upgrade=False: an older store - one with events, which the import refuses - is refused
        # as it is, not upgraded first; `evstore upgrade` upgrades one to import into)
        async with opened(target, upgrade=False) as store:
            # (the bar's total: the events the header promises - read from the file, or from the
            # copy of piped input, never from the pipe a second time; the import checks it)
            total = await asyncio.to_thread(_promised_events, source)
            with progress_bar() as bar:
                tasks: dict[str, Any] = {}

                def on_progress(phase: str, done: int) -> None:
                    if phase not in tasks:
                        tasks[phase] = bar.add_task(
                            "validating" if phase == "validate" else "importing", total=total
                        )
                    bar.update(tasks[phase], completed=done)

                try:
                    count = await store.import_events(lines, progress=on_progress)
                except err.InvalidInput as exc:
                    if exc.details.get("reason") == "not_empty":
                        raise _not_empty(target, await store.head()) from None
                    if exc.details.get("reason") == "empty":  # (named: a file, or what was piped in)
                        raise err.InvalidInput(
                            "standard input was empty: nothing to import; pipe an export in "
                            "(evstore export --db a.db | evstore import - --db b.db)"
                            if stdin
                            else f"{file} is empty: nothing to import (an export holds a "
                            "header line, then its events)",
                            field="FILE",
                            reason="empty",
                        ) from None
                    raise
            imported.append(count)
            report = await store.audit()
            head = await store.head()
        if json_out:
            emit_json({"url": shown(target), "imported": count, "head": head, "audit": report.to_dict()})
        else:
            console().print(
                f"imported {count} events (head {head}); audit: {'clean' if report.clean else 'FINDINGS'}"
            )
        return EXIT_OK if report.clean else EXIT_FINDINGS

    try:
        # SIGTERM while piped input is copied ends the import as it does during the write (run's
        # terminate_code), and as Ctrl-C does anywhere: exit 143, and nothing left behind
        with sigterm_raises():
            try:
                if not export_file.is_file():
                    # a pipe (`evstore export ... | evstore import -`), FIFO or `<(...)`: the import
                    # reads its input twice (validating, then writing); a pipe is empty the second time
                    source = _spool(export_file, spooled)
                # (SIGTERM during the write stops it as Ctrl-C does: the import rolled back, a
                # file it created removed, below - not the default action's death mid-write)
                run(work, terminate_code=EXIT_TERMINATED)
            except KeyboardInterrupt:
                raise typer.Exit(130) from None
            except Terminated:
                raise typer.Exit(EXIT_TERMINATED) from None
    except typer.Exit as exc:
        with signals_held():  # (a second signal waits until what the import leaves is cleaned up)
            if exc.exit_code in (130, EXIT_TERMINATED):  # (say whether anything was imported)
                how = "interrupted" if exc.exit_code == 130 else "terminated"
                if imported:
                    note(f"{how} after {imported[0]} events were imported (`evstore audit` checks them)")
                else:
                    note(f"{how}: nothing was imported")
            if (
                exc.exit_code in (EXIT_ERROR, 130, EXIT_TERMINATED)
                and created is not None
                and _holds_no_events(created)
            ):
                _remove_database(created)  # leave nothing behind from a refused import
            for spool in spooled:
                spool.unlink(missing_ok=True)
        raise
    finally:
        for spool in spooled:
            spool.unlink(missing_ok=True)


def _not_empty(target: str, head: int) -> err.InvalidInput:
    """The refusal of an import into a store that has events, naming it (the store's own said only
    "this one already has events": which one, to a script importing into several, or a URL
    from EVSTORE_URL, it did not say)."""
    where = (
        "import into a new file (--db NEW.db)"
        if target.startswith("sqlite:")
        else "import into another schema (?search_path=SCHEMA, an empty one)"
    )
    return err.InvalidInput(
        f"import needs an empty store: {shown(target)} already has events (head {head}); {where}",
        reason="not_empty",
        head=head,
    )


def _spool(export_file: Path, spooled: list[Path]) -> Path:
    """Copy ``export_file`` (piped input) to a temporary file and answer its path, which is put
    in ``spooled`` as soon as the file exists, for the caller to remove whatever happens next."""
    with signals_held():  # (a signal between the file's making and its naming would leave it)
        fd, name = tempfile.mkstemp(prefix="evstore-import-", suffix=".jsonl")
        spooled.append(Path(name))
        copy = open(fd, "wb")  # (closed below, once the file is named)
    with copy:
        try:
            with export_file.open("rb") as stream:
                shutil.copyfileobj(stream, copy)
        except OSError as exc:
            fail("evstore.io", f"cannot copy {export_file} to a temporary file ({name}): {exc}")
    return Path(name)


def _promised_events(path: Path) -> int | None:
    """How many events the export at ``path`` says it holds, in its header line - its first, as
    :func:`projections.exchange.parse_header` reads it (None: no such header, unreadable; the
    import says why). Counting its lines would read the whole file a third time."""
    from projections.exchange import parse_header

    try:
        with path.open(encoding="utf-8") as stream:
            first = stream.readline(1 << 16)
        return parse_header(first).events
    except (OSError, ValueError, err.EvstoreError):
        return None


def _event_count(path: Path) -> int | None:
    """How many events the SQLite store at ``path`` holds (None: no such store, or unreadable)."""
    if not path.exists():
        return None
    try:
        conn = _only_reading(path)
        try:
            return int(conn.execute("SELECT count(*) FROM events").fetchone()[0])
        finally:
            conn.close()
    except sqlite3.Error:
        return None


def _holds_no_events(path: Path) -> bool:
    """Whether the SQLite file an import created holds no event (so removing it loses nothing:
    the import was refused or interrupted before it committed)."""
    if not path.exists():
        return False
    try:
        conn = _only_reading(path)
        try:
            return int(conn.execute("SELECT count(*) FROM events").fetchone()[0]) == 0
        finally:
            conn.close()
    except sqlite3.Error as exc:
        return "no such table" in str(exc)  # (created, not yet a store)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``evstore`` script."""
    _STORE_FROM_ENVIRONMENT.clear()
    _open_closed_streams()
    _escape_what_cannot_be_encoded()
    try:
        code = app(args=list(argv) if argv is not None else None, standalone_mode=False, prog_name="evstore")
    except NoArgsIsHelpError as exc:  # (a bare `evstore`: the help, not an error line holding it)
        to_stderr(exc.format_message())
        _exit(EXIT_USAGE)
    except ClickException as exc:
        message = exc.format_message()
        if isinstance(exc, NoSuchOption) and re.fullmatch(r"-[0-9]", exc.option_name[:2]):
            # (`diff -1 3`: a negative position taken for an option; -- before it passes it on)
            message += " (a negative number is no position: a position is from 0 to 2**63-1)"
        elif isinstance(exc, NoSuchOption) and (hint := _misplaced_option(exc, argv)):
            message = f"No such option: {exc.option_name} ({hint})"
        if message:
            to_stderr(f"error: evstore.usage: {message}")
        _exit(exc.exit_code)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    except OSError as exc:  # (writing the help or the version)
        _exit(_output_failed(exc))
    _exit(code if isinstance(code, int) else EXIT_OK)


def _misplaced_option(exc: NoSuchOption, argv: Sequence[str] | None) -> str:
    """Where an option refused as unknown goes, when it is known on the other side of the command
    (`evstore --db x.db audit`, `evstore audit -vv`: README writes `evstore <command> --db PATH`,
    and -vv is evstore's own), else "" (click's "Possible options" then stand)."""
    ctx = exc.ctx
    if ctx is None:
        return ""
    root = ctx.find_root().command
    if not isinstance(root, TyperGroup):
        return ""
    args = list(argv) if argv is not None else sys.argv[1:]
    name = exc.option_name
    # (as typed: -vv for the -v click names, --db for --db=x.db)
    pattern = rf"{re.escape(name)}(?:{re.escape(name[1:])})*" if len(name) == 2 else re.escape(name)
    typed = next((arg for arg in args if re.fullmatch(pattern, arg.split("=", 1)[0])), name).split("=", 1)[0]

    def takes(command: Command) -> bool:
        return any(name in param.opts for param in command.params if param.name != "help")

    if ctx.parent is None:
        takers = [command for command, known in root.commands.items() if takes(known)]
        if not takers:
            return ""
        given = next((arg for arg in args if arg in takers), None)
        where = given or (takers[0] if len(takers) == 1 else "COMMAND")
        of = "the commands" if len(takers) > 1 else takers[0]
        return f"{name} is an option of {of}: give it after the command, evstore {where} {typed} ..."
    if takes(root):
        if name == "--version":  # (before a command, it prints the version and runs none)
            return (
                f"{name} is an option of evstore itself: evstore --version (it prints the version, "
                "and runs no command)"
            )
        # (every -v given, as given: `audit -v -v` is evstore -v -v, the -vv README's traceback
        # needs, not one -v; `-vvx`'s -vv - its x no option of evstore's either)
        verbose = [
            flag.group() for arg in args if (flag := re.match(r"-v+(?=[^-]|$)|--verbose$", arg)) is not None
        ]
        before = f"evstore {' '.join(verbose) or typed} {ctx.info_name} ..."
        return f"{name} is an option of evstore itself: give it before the command, {before}"
    return ""


def _open_closed_streams() -> None:
    """Started with stdout or stderr closed (``>&-``, a daemon without them), Python has ``None``
    for it: output then goes to /dev/null instead of failing the command (after its work, for a
    rebuild) or sending error lines to stdout."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            stream = open(os.devnull, "w")  # (for the process's life)
            setattr(sys, name, stream)
            (_CLOSED_STDOUT if name == "stdout" else _CLOSED_STDERR).append(stream)


#: the /dev/null :func:`_open_closed_streams` put in the place of a closed standard output
_CLOSED_STDOUT: list[io.TextIOWrapper] = []
#: ... and of a closed standard error
_CLOSED_STDERR: list[io.TextIOWrapper] = []


def _refuse_a_closed_stream(output: Path) -> None:
    """``export -o`` naming standard output or standard error (``/dev/stdout``, ``/dev/fd/2``,
    ``//dev/stderr``, ``/proc/thread-self/fd/1``, a symbolic link to one) when the command was
    started without it: the /dev/null put in its place would take the whole log, the export
    saying it succeeded - refused as ``export`` to a closed standard output is."""
    descriptor = _descriptor_named(output)
    for name, number, closed in (("output", 1, _CLOSED_STDOUT), ("error", 2, _CLOSED_STDERR)):
        stream = getattr(sys, f"std{'out' if number == 1 else 'err'}")
        if not closed or stream is not closed[-1]:
            continue  # (the stream is there: written to as named)
        named = str(output) in (f"/dev/std{'out' if number == 1 else 'err'}", f"/dev/fd/{number}")
        if named or descriptor in (number, closed[-1].fileno()):
            fail(
                "evstore.io",
                f"standard {name} is closed: export has nowhere to write the log "
                "(give --output FILE, or redirect it)",
            )


def _refuse_a_descriptor_not_open(output: Path) -> None:
    """``export -o /dev/fd/N`` (``/proc/self/fd/N``, a link to one) when N is no descriptor the
    command was started with: once the store was open, N was one of its own - the database (refused
    as "the database being exported"), its event loop's socket ("No such device or address"), a
    /dev/null the export then "succeeded" into - or nothing ("No such file or directory"). Refused
    before the store is opened, saying the descriptor is not open and how a shell opens one."""
    descriptor = _descriptor_named(output)
    if descriptor is None:
        return
    try:
        os.fstat(descriptor)
    except (OSError, OverflowError, ValueError):
        fail(
            "evstore.io",
            f"cannot write the export to {output}: descriptor {descriptor} is not open (a shell opens "
            f"it for the command: evstore export ... -o {output} {descriptor}> FILE; or give -o FILE)",
        )


def _descriptor_named(path: Path) -> int | None:
    """The descriptor of this process that ``path`` reaches through ``/proc/<pid>/fd`` (as
    ``/dev/stdout``, ``/dev/fd/N``, ``/proc/self/fd/N`` and links to them do), the last link -
    to the file open there - not followed; None for any other path, or one that cannot be read."""
    own = {("proc", str(os.getpid()), "fd")}
    pending = str(path).split("/")
    current: list[str] = [] if str(path).startswith("/") else os.getcwd().split("/")[1:]
    hops = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current[:-1]
            continue
        if part.isdigit() and (
            tuple(current) in own
            or (
                len(current) == 5
                and tuple(current[:3]) == ("proc", str(os.getpid()), "task")
                and current[4] == "fd"
            )
        ):
            return int(part)
        try:
            target = os.readlink("/" + "/".join([*current, part]))
        except OSError:  # (not a link - or nothing there: walked as it is)
            current.append(part)
            continue
        hops += 1
        if hops > 40:  # (a link loop: the open says so)
            return None
        if target.startswith("/"):
            current = []
        pending[:0] = target.split("/")
    return None


def refuse_closed_stdout(command: str, what: str, instead: str = "") -> None:
    """Fail, ``evstore.io``, when standard output is closed and ``command``'s output is what it is
    run for (``what``: the export, tail's events): /dev/null in its place would lose it all -
    the command saying it succeeded, or following the log forever to nothing."""
    if _CLOSED_STDOUT and sys.stdout is _CLOSED_STDOUT[-1]:
        fail("evstore.io", f"standard output is closed: {command} has nowhere to write {what}{instead}")


def _escape_what_cannot_be_encoded() -> None:
    """A character of a stored name that standard output's encoding cannot show (a Latin-1 or
    ASCII locale, PYTHONIOENCODING, a Windows code page when redirected) is printed as its escape
    (``\\u0153``), as a control character is shown ``\\xNN`` (:func:`visible`), instead of ending
    the command with a UnicodeEncodeError. (``--json`` is ASCII, and the export is written as
    UTF-8 text ASCII-escaped: neither is changed.) In the C or POSIX locale, with its coercion to
    UTF-8 turned off (PYTHONCOERCECLOCALE=0), Python writes with ``surrogateescape`` - which puts
    back the bytes of a file name it could not decode, and fails on any other character: that is
    kept for those bytes, the escape used for the rest."""
    stream = sys.stdout
    if not isinstance(stream, io.TextIOWrapper):
        return
    if stream.errors == "strict":
        stream.reconfigure(errors="backslashreplace")
    elif stream.errors == "surrogateescape":
        try:
            codecs.lookup_error(_ESCAPE_OR_BYTES)
        except LookupError:  # (registered once a process: main may run more than once in one)
            codecs.register_error(_ESCAPE_OR_BYTES, _escape_or_bytes)
        stream.reconfigure(errors=_ESCAPE_OR_BYTES)


#: the error handler of :func:`_escape_or_bytes`
_ESCAPE_OR_BYTES = "evstore.surrogateescape_or_backslashreplace"


def _escape_or_bytes(exc: UnicodeError) -> tuple[str | bytes, int]:
    """``surrogateescape`` where it applies (the bytes of an undecodable file name, put back),
    else ``backslashreplace`` (a character the encoding has not: its escape)."""
    try:
        return _SURROGATEESCAPE(exc)
    except UnicodeError:
        return codecs.backslashreplace_errors(exc)


_SURROGATEESCAPE = codecs.lookup_error("surrogateescape")


def _exit(code: int) -> NoReturn:
    try:
        sys.stdout.flush()
    except OSError as exc:
        code = _output_failed(exc)
    # A storage failure while opening can leave a database worker thread behind (non-daemon);
    # a command line must still end with its exit status rather than hang.
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def _output_failed(exc: OSError) -> int:
    """The exit status when standard output cannot be written outside :func:`run` (the help, the
    version: written to a full disk, they ended with a traceback), as ``run`` answers it:
    ``evstore.io``, or 141 quietly for a reader gone. (click itself ends a help piped to a reader
    gone with 1, saying nothing: left so.)"""
    if not isinstance(exc, BrokenPipeError):
        text = f"cannot write standard output: {exc.strerror or exc}"
        to_stderr(f"error: evstore.io: {visible(text)}")
    # (what stays in its buffer would fail Python's own flush at exit again)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141 if isinstance(exc, BrokenPipeError) else EXIT_ERROR


if __name__ == "__main__":
    main()
