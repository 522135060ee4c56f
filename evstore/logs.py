"""evstore's own log lines, through structlog, guarded: a host's logging configuration that fails
(a processor that raises, a ``PrintLogger`` on a closed file) changes no call's outcome and stops
no thread of evstore's. The failure is reported on stderr, as the standard library reports a
failed handler's, and the call goes on. Every module of evstore logs through :func:`get_logger`
(or, on the command path, a :class:`BoundOnce`)."""

from __future__ import annotations

import logging
import operator
import sys
import traceback
from typing import Any

import structlog

__all__ = ["BoundOnce", "Guarded", "get_logger", "info_enabled", "log_failed"]


def log_failed(event: object) -> None:
    """A log line the host's structlog configuration failed to emit (a processor that raised, a
    closed sink): reported on stderr, as the standard library's ``Handler.handleError`` reports
    a handler's failure (and, as it, not when ``logging.raiseExceptions`` is off). Never raised: a
    command's outcome is its receipt or its refusal, whatever becomes of the line about it (a
    committed command answered with the logging's exception is retried, and doubled, by a caller
    that sees it fail; a line failing on the writer would leave its batch's other callers waiting;
    one failing in a rollback's or a close's clean-up would replace the error it reports)."""
    # (no stderr - None under pythonw, or dropped by a daemon - reports nothing, as handleError:
    # print and print_exception given file=None write on stdout, which may carry an export's lines)
    stream = sys.stderr
    if not logging.raiseExceptions or stream is None:
        return
    try:
        print(
            f"--- evstore: log line {event!r} not emitted: the application's structlog configuration"
            " raised (fix its processors or logger factory; the call it describes was not affected) ---",
            file=stream,
        )
        # (without its context: raised while a refusal was handled, it would print that refusal's chain)
        traceback.print_exception(sys.exception(), chain=False, file=stream)
    except Exception:  # (no stderr, or one that fails too: nothing more to do)
        pass


class Guarded:
    """A structlog logger whose lines cannot fail the call that logs them (see :func:`log_failed`)."""

    __slots__ = ("_logger",)

    def __init__(self, logger: Any) -> None:
        self._logger = logger

    def _emit(self, level: str, event: str, kw: dict[str, Any]) -> None:
        try:
            getattr(self._logger, level)(event, **kw)
        except Exception:
            log_failed(event)

    def debug(self, event: str, **kw: Any) -> None:
        self._emit("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._emit("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._emit("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._emit("error", event, kw)

    def exception(self, event: str, **kw: Any) -> None:
        """:meth:`error` with the exception being handled (structlog's ``exception``)."""
        self._emit("exception", event, kw)


def get_logger(name: str) -> Guarded:
    """structlog's lazy logger ``name`` (a configuration made later applies), its lines guarded."""
    return Guarded(structlog.get_logger(name))


class BoundOnce:
    """A logger bound once per structlog configuration. The lazy proxy ``get_logger`` returns binds
    anew on every call (with the default PrintLoggerFactory, a new PrintLogger that looks up a
    lock): ~4 us per command, 15 us measured on a busy store's event loop; every command logs.
    ``structlog.configure`` (and ``capture_logs``) made later still apply: the configuration is
    compared, by identity, at each use (0.25 us)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._config: dict[str, Any] | None = None
        self._bound: Any = None
        self._guarded = Guarded(None)

    def _current(self) -> Any:
        config = structlog.get_config()
        seen = self._config
        # (one C-level walk of the two value lists, not a generator expression: per command)
        if (
            seen is None
            or len(config) != len(seen)
            or any(map(operator.is_not, config.values(), seen.values()))
        ):
            # (the bound logger's lazy proxy binds each line anew, so its factory's failure is the line's)
            try:
                self._bound = structlog.get_logger(self._name).bind()
            except Exception:
                self._bound = structlog.get_logger(self._name)
            self._guarded = Guarded(self._bound)
            self._config = config
        return self._bound

    def get(self) -> Guarded:
        """The logger, its lines guarded (:class:`Guarded`: a failing configuration fails no call)."""
        self._current()
        return self._guarded

    def for_info(self) -> Guarded | None:
        """:meth:`get`, or None when the logger says it drops info lines (the line need not be built).

        Asked at each use, not once per configuration: a ``structlog.stdlib`` logger answers from
        the standard library logger's level, which a host changes without reconfiguring structlog
        (``setLevel``, ``dictConfig``), and a line dropped once must come back when it is raised."""
        bound = self._current()
        return self._guarded if info_enabled(bound) else None


def info_enabled(bound: Any) -> bool:
    """Whether ``bound`` says it emits info lines: asked only of a wrapper class that defines
    ``is_enabled_for`` (structlog's filtering loggers, ``structlog.stdlib.BoundLogger``). The
    generic ``structlog.BoundLogger`` answers any attribute with a method that logs it (through
    the processors, to the wrapped logger, which has no such method: AttributeError); any other
    doubt logs the line, as before this was asked."""
    enabled = getattr(type(bound), "is_enabled_for", None)
    if not callable(enabled):
        return True
    try:
        return bool(enabled(bound, logging.INFO))
    except Exception:
        return True
