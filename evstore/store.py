"""The async facade: ``async with open_store(url) as store:``.

Commands are validated here (bad arguments raise :class:`InvalidInput`), queued, and executed by
one writer in batches: several queued commands share one transaction (group commit) while each
succeeds or fails on its own. On SQLite the writer connection's thread takes the batches off the
queue itself (``drain``) and answers each batch's callers as soon as it commits. A caller
cancelled while its command waits in the queue removes it; a command already in a transaction is
committed or rolled back whole.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import copy
import functools
import hashlib
import importlib
import inspect
import itertools
import json
import operator
import sys
import traceback
import uuid as _uuid
import warnings
import weakref
from collections.abc import (
    AsyncGenerator,
    Awaitable,
    Callable,
    Coroutine,
    Generator,
    Iterable,
    Iterator,
    Mapping,
)
from dataclasses import asdict
from datetime import UTC, date, datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeAlias, TypedDict, TypeVar, Unpack, cast

from pydantic import BaseModel, ValidationError

from evstore import commands as cmd
from evstore import errors as err
from evstore.errors import shown
from evstore.events import GENESIS_HASH, Metadata, RecordedEvent, sorted_json
from evstore.log import (
    MAX_POSITION,
    Backend,
    Job,
    Outcome,
    RawEvent,
    Rebuilt,
    Receipt,
    check_held_amount,
    follows_on,
    random_bits,
)
from evstore.logs import BoundOnce, get_logger
from evstore.schema import (
    ConsumerAllocations,
    Inventory,
    _shown_int,
    coerce_consumer_allocations,
    coerce_inventory,
    normalize_allocations,
    normalize_uuid,
    path_key,
    validate_consumer_type,
    validate_generation,
    validate_int_option,
    validate_name,
    validate_resource_class_name,
    validate_seconds_option,
    where,
)
from projections import audit as _audit
from projections.audit import AuditReport
from projections.diff import Diff
from projections.replay import StateView, gapless, replay
from projections.state import ConsumerState, ProviderState, State, evolve
from projections.views import (
    RESERVED_CONSUMER_TYPES,
    ConsumerView,
    ProjectUsages,
    ProviderInventories,
    ProviderUsage,
    ProviderView,
    reserved_type_usages,
    sorted_holdings,
)

#: ``set_allocations``' body: resources by provider uuid. Keys may be ``str`` or ``UUID`` (checked when
#: the command runs: a malformed one is ``InvalidInput``). One ``Mapping`` with ``Any`` keys, not a union
#: of ``Mapping[str, ...]`` and ``Mapping[UUID, ...]``: a mapping is invariant in its key type, and a
#: checker cannot infer a literal against a union (one mixing ``str`` and ``UUID`` keys was refused).
ProviderAllocations: TypeAlias = Mapping[Any, Mapping[str, int]]
_ConsumerBody: TypeAlias = ConsumerAllocations | Mapping[str, Any]
#: ``write_allocations``' body: each consumer's ``ConsumerAllocations`` (or a mapping of its fields);
#: a literal may mix the two (Nova's move: the migration's ``ConsumerAllocations`` beside the instance's
#: mapping)
AllocationsByConsumer: TypeAlias = Mapping[Any, _ConsumerBody]

_command_metadata: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "evstore_command_metadata", default=None
)


log = get_logger("evstore")

_command_log = BoundOnce("evstore")

_P = ParamSpec("_P")
_R = TypeVar("_R")
_Method: TypeAlias = Callable[Concatenate[Any, _P], Coroutine[Any, Any, _R]]


def _named(value: Any) -> list[str] | None:
    """Entities as a caller named them, for a log line about a command refused before it was
    queued (possibly malformed, so as text, cut short): the ones given as a mapping's keys too."""
    if value is None:
        return None
    try:
        values = itertools.islice(value, 20) if isinstance(value, Mapping) else [value]
        return [str(v)[:100] for v in values] or None
    except Exception:  # (a caller's object whose str() or iteration fails: the log line must not)
        return [type(value).__name__]


def _request_id(meta: Any) -> Any:
    """The request id of a refused command's metadata, for its log line (the metadata may be what
    was refused: a caller's object whose attribute or ``get`` raises must not replace the error)."""
    try:
        found = meta.get("request_id") if isinstance(meta, Mapping) else getattr(meta, "request_id", None)
    except Exception:
        return None
    if found is None or type(found) in (int, float, bool):
        return found
    # (as text any log stream can hold: the refusal may be of a lone surrogate, which structlog's
    # default line, printed to stdout in UTF-8, cannot encode; nor may a repr that raises break it)
    try:
        text = found if isinstance(found, str) else repr(found)[:100]
    except Exception:
        return type(found).__name__
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _logs_rejections(
    command: str, **entities: tuple[str, ...]
) -> Callable[[_Method[_P, _R]], _Method[_P, _R]]:
    """A command method whose every rejection is logged as ``command.rejected``: those the
    writer decides (logged by ``_submit``, with the command's entities) and those refused
    before the command is queued (a malformed argument, metadata or key; a closed store), with
    the consumers or providers the arguments name (``entities``: parameter names by kind)."""

    def wrap(method: _Method[_P, _R]) -> _Method[_P, _R]:
        params = list(inspect.signature(method).parameters)[1:]  # (after self)
        where = {kind: [(params.index(name), name) for name in names] for kind, names in entities.items()}

        @functools.wraps(method)
        async def logged(self: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            try:
                return await method(self, *args, **kwargs)
            except err.EvstoreError as exc:
                if exc.__dict__.pop("_evstore_logged", False):
                    raise
                named: dict[str, Any] = {}
                for kind, places in where.items():
                    for index, name in places:
                        found = _named(args[index] if len(args) > index else kwargs.get(name))
                        if found:
                            named.setdefault(kind, []).extend(found)
                request_id = _request_id(kwargs.get("metadata"))
                if request_id is None:
                    request_id = (_command_metadata.get() or {}).get("request_id")
                if request_id is not None:  # (else the host's bound one shows: see _log_context)
                    named["request_id"] = request_id
                _command_log.get().info(
                    "command.rejected", command=command, code=exc.code, error=exc.message, **named
                )
                raise

        return logged

    return wrap


#: the ``command_metadata`` blocks entered in this context (this task), innermost last, each with
#: the token of what it set: per task, where one scope object can be entered by several at once
_metadata_scopes: contextvars.ContextVar[
    tuple[tuple[_MetadataScope, contextvars.Token[dict[str, Any] | None]], ...]
] = contextvars.ContextVar("evstore_metadata_scopes", default=())


class _MetadataScope:
    """What :func:`command_metadata` answers: a context manager (``with`` and ``async with``) and a
    decorator. Decorating an ``async def`` (a request handler) sets the metadata for each call's
    run - each await of it -, not for the making of its coroutine, which ends before it runs (as
    ``contextlib.contextmanager``'s decorator did: the metadata was silently dropped)."""

    __slots__ = ("_given",)

    def __init__(self, given: dict[str, Any]) -> None:
        self._given = given

    def _set(self) -> contextvars.Token[dict[str, Any] | None]:
        current = dict(_command_metadata.get() or {})
        current.update(self._given)
        # (refused where it was given rather than by each command in it: evstore's own keys are
        # replaced by each command, so whatever was given for them does not matter)
        _metadata_json({k: v for k, v in current.items() if k not in _OWN_METADATA_KEYS}, True)
        return _command_metadata.set(current)

    def __enter__(self) -> None:
        token = self._set()
        _metadata_scopes.set((*_metadata_scopes.get(), (self, token)))

    def __exit__(self, *exc_info: object) -> None:
        # (this task's innermost entry of this scope: the tokens were kept on the object, shared
        # by every task entering it - a module-level scope -, and the first of two overlapping
        # blocks to end reset the other task's token: a bare ValueError, its metadata left set)
        entered = _metadata_scopes.get()
        for n in range(len(entered) - 1, -1, -1):
            if entered[n][0] is self:
                break
        else:
            raise err.InvalidInput(
                "this command_metadata(...) block was not entered in this task: enter and leave it in "
                "the same task (`with` / `async with` around the commands)",
                field="command_metadata",
            )
        _metadata_scopes.set(entered[:n] + entered[n + 1 :])
        try:
            _command_metadata.reset(entered[n][1])
        except ValueError:  # (entered in this task's parent, whose context this one copied)
            raise err.InvalidInput(
                "this command_metadata(...) block was entered in another task (this one's parent): "
                "enter and leave it in the same task",
                field="command_metadata",
            ) from None

    async def __aenter__(self) -> None:
        self.__enter__()

    async def __aexit__(self, *exc_info: object) -> None:
        self.__exit__()

    def __call__(self, func: Callable[_P, _R]) -> Callable[_P, _R]:
        if not callable(func):
            raise err.InvalidInput(
                f"command_metadata(...) decorates a function, got {shown(func, 60)}: use "
                "`with command_metadata(...):` around the commands",
                field="command_metadata",
            )
        call = _call_of(func)
        # (func itself too: an AsyncMock, or an object marked as a coroutine function, whose
        # __call__ is a plain method)
        if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(call):
            run = cast("Callable[..., Awaitable[Any]]", func)

            @functools.wraps(func)
            async def scoped_run(*args: Any, **kwargs: Any) -> Any:
                token = self._set()
                try:
                    return await run(*args, **kwargs)
                finally:
                    _command_metadata.reset(token)

            return scoped_run  # type: ignore[return-value]
        if inspect.isasyncgenfunction(call) or inspect.isgeneratorfunction(call):
            raise err.InvalidInput(
                "command_metadata(...) cannot decorate a generator: use `with command_metadata(...):`"
                " inside it, around the commands",
                field="command_metadata",
            )

        @functools.wraps(func)
        def scoped(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            token = self._set()
            try:
                made = func(*args, **kwargs)
            finally:
                _command_metadata.reset(token)
            if inspect.iscoroutine(made):  # (a plain function answering a coroutine: its run)
                return self._around(made)  # type: ignore[return-value]
            return made

        return scoped

    async def _around(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """``coroutine`` run with the metadata set (one a plain function made, which the caller
        awaits after the function's own call has ended)."""
        token = self._set()
        try:
            return await coroutine
        finally:
            _command_metadata.reset(token)


def _call_of(func: Callable[..., Any]) -> Callable[..., Any]:
    """What calling ``func`` runs, to tell an ``async def`` from a plain function: through
    ``functools.partial``, and an object's ``__call__`` (a handler class with ``async def
    __call__``, which ``inspect.iscoroutinefunction`` calls plain: its metadata was dropped)."""
    while isinstance(func, functools.partial):
        func = func.func
    if isinstance(func, type) or inspect.isroutine(func):
        return func
    return getattr(type(func), "__call__", func)  # noqa: B004 (the method itself, not a test of callable)


def command_metadata(
    *,
    request_id: str | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    actor: str | None = None,
    **metadata: Any,
) -> _MetadataScope:
    """Attach metadata (``request_id``, ``correlation_id``, ``causation_id``, ``actor``, and any
    other JSON value under a key of the caller's) to every command issued in this context (it
    follows the current task and its children); ``None`` leaves a key as the enclosing context
    set it. ``with command_metadata(...):``, ``async with``, or a decorator - of an ``async def``
    too: the metadata is set for each call's run.

    ``command``, ``command_id`` and ``idempotency_key`` are written by evstore for each command;
    values given for them here or in ``metadata=`` are replaced."""
    named = {
        "request_id": request_id,
        "correlation_id": correlation_id,
        "causation_id": causation_id,
        "actor": actor,
    }
    given = {k: v for k, v in {**named, **metadata}.items() if v is not None}
    _metadata_json({k: v for k, v in given.items() if k not in _OWN_METADATA_KEYS}, True)
    return _MetadataScope(given)


def _metadata_dict(metadata: Mapping[str, Any] | Metadata | None) -> dict[str, Any]:
    """The caller's metadata (this context's, then the command's own), not yet checked."""
    merged = dict(_command_metadata.get() or {})
    if isinstance(metadata, Metadata):
        merged.update(metadata.model_dump(exclude_none=True))
    elif metadata is not None:
        if not isinstance(metadata, Mapping):
            raise err.InvalidInput("metadata must be a mapping or evstore.Metadata", field="metadata")
        for key in metadata:
            if not isinstance(key, str):
                raise _metadata_fault_error(([], key, "key"))
        merged.update({k: v for k, v in metadata.items() if v is not None})
    return merged


#: metadata keys evstore writes itself for each command (a caller's values are replaced)
_OWN_METADATA_KEYS = frozenset({"command", "command_id", "idempotency_key"})

# (json.dumps makes a new encoder for every call with options; metadata is encoded per command)
# (allow_nan=False: NaN and Infinity are not JSON; the log must stay readable by any JSON parser)
_METADATA_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True, allow_nan=False)

# a version-4 uuid's fixed bits: version (4) and RFC 4122 variant (0b10)
_UUID4_CLEAR = ~((0xF << 76) | (0x3 << 62)) & (2**128 - 1)
_UUID4_SET = (0x4 << 76) | (0x2 << 62)


def _command_id() -> str:
    """A random (version 4) uuid's 32 hex digits, without building a UUID object (2x faster)."""
    return f"{random_bits(128) & _UUID4_CLEAR | _UUID4_SET:032x}"


#: (the log's readers decode JSON at most 200 levels deep; deeper metadata was reported as "not
#: valid unicode text", or past Python's recursion limit as "not JSON-serialisable")
_METADATA_TOO_DEEP = (
    "metadata is nested too deeply: the log's readers decode at most 200 levels of lists and mappings"
)


#: the most JSON text a caller's metadata for one command may take (each of its events stores a
#: copy; the envelope's ids and a caller's short facts are ~100-300 bytes) ...
_METADATA_MAX_BYTES = 65_536


def _own_keys_size(meta: dict[str, Any]) -> int:
    """The bytes evstore's own keys in ``meta`` (the command's name, its id, an idempotency key) add
    to its JSON text beside a caller's keys: ``"key":value`` and a comma each. They are not counted
    against the caller's ``_METADATA_MAX_BYTES``: metadata ``command_metadata`` accepted is not
    refused by the commands run in it, and what a command accepts is what ``command_metadata`` does."""
    return sum(
        len(_METADATA_ENCODER.encode(k)) + len(_METADATA_ENCODER.encode(meta[k])) + 2
        for k in _OWN_METADATA_KEYS
        if k in meta
    )


def _metadata_fault(value: Any, keys: list[str], text: bool) -> tuple[list[str], Any, str] | None:
    """The first thing inside ``value`` (metadata) that the log cannot give back as the caller
    gave it, with the keys down to it (list items by their index), as ``(keys, what, kind)``:
    ``kind`` "key" for a key of a mapping that is not a string (JSON would write ``1`` as ``"1"``,
    ``None`` as ``"null"``: the log would hold other keys than the caller's, or one twice) - the
    keys down to that mapping, and the key; each mapping's keys are looked at before what it holds.
    With ``text``, also a string that is not valid Unicode text (a lone surrogate, which JSON
    escapes but no reader of the log decodes): ``kind`` "text_key" for a key (the keys down to it,
    itself included), "text" for a value. None: there is none."""
    if isinstance(value, str):
        return (keys, value, "text") if text and not _is_text(value) else None
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                return keys, key, "key"
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        if text and not _is_text(key):
            return [*keys, str(key)], key, "text_key"
        if isinstance(item, Mapping | list | tuple) or (text and isinstance(item, str)):
            if (found := _metadata_fault(item, [*keys, str(key)], text)) is not None:
                return found
    return None


def _not_json(value: Any, keys: list[str]) -> tuple[list[str], Any] | None:
    """The first value inside ``value`` (metadata, its keys already found to be strings) that the
    JSON encoder refuses, with the keys down to it (list items by their index). None: there is none."""
    if value is None or isinstance(value, str | bool):
        return None
    if isinstance(value, int | float):
        try:
            _METADATA_ENCODER.encode(value)  # (NaN and Infinity; an int past str()'s digit limit)
        except ValueError:
            return keys, value
        return None
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list | tuple):
        items = enumerate(value)
    else:
        return keys, value
    for key, item in items:
        if (found := _not_json(item, [*keys, str(key)])) is not None:
            return found
    return None


def _is_text(value: Any) -> bool:
    """Whether ``value`` is not a string holding a lone surrogate (see :func:`_metadata_fault`)."""
    if not isinstance(value, str):
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _metadata_fault_error(fault: tuple[list[str], Any, str]) -> err.InvalidInput:
    """What :func:`_metadata_fault` found, as the caller is told it (with ``details["path"]``)."""
    keys, found, kind = fault
    if kind == "key":
        inside = ".".join(keys) or "the metadata"
        return err.InvalidInput(
            f"metadata keys must be strings, at any depth: {inside} has the key {shown(found, 60)}",
            **where("metadata", ["metadata", *keys, path_key(found)]),
        )
    inside = ".".join(keys[:-1]) or "the metadata"
    what = f"a key of {inside}" if kind == "text_key" else ".".join(keys)
    return err.InvalidInput(
        f"metadata is not valid: {what} must be valid Unicode text (no lone surrogates), "
        f"got {shown(found, 80)}",
        **where("metadata", ["metadata", *keys]),
    )


def _metadata_json(meta: dict[str, Any], check: bool, own_keys: bool = False) -> str:
    """``meta`` as the JSON text every event of the command carries, checked (``check``: it holds
    caller values) as every reader of the log decodes it: from that text. ``own_keys``: it holds
    evstore's own keys, whose bytes are not counted against the caller (see :func:`_own_keys_size`:
    worked out only for a text over the bound, off every command's path)."""
    text = None
    for value in meta.values():
        if type(value) is not str:
            break
    else:  # (most metadata is strings only - evstore's own keys, request ids: the same text, 10x faster)
        text = sorted_json(meta)
    if text is None and check:
        try:
            fault = _metadata_fault(meta, [], text=False)
        except RecursionError:
            raise err.InvalidInput(_METADATA_TOO_DEEP, field="metadata") from None
        if fault is not None:
            raise _metadata_fault_error(fault)
    try:
        if text is None:
            text = _METADATA_ENCODER.encode(meta)
    except RecursionError:
        raise err.InvalidInput(_METADATA_TOO_DEEP, field="metadata") from None
    except (TypeError, ValueError):
        try:
            found = _not_json(meta, [])
        except RecursionError:
            found = None
        keys, value = found if found is not None else ([], None)
        said = (
            f": {'.'.join(keys)} is {shown(value, 60)} ({type(value).__name__})" if found is not None else ""
        )
        raise err.InvalidInput(
            "metadata values must be JSON-serialisable (strings, numbers other than NaN and Infinity, "
            f"integers within Python's int-to-text digit limit, booleans, null, lists and dicts){said}",
            **where("metadata", ["metadata", *keys]),
        ) from None
    if check:
        # (the text is ASCII - JSON escapes the rest - so its length is its size in bytes)
        if (
            len(text) > _METADATA_MAX_BYTES
            and (size := len(text) - (_own_keys_size(meta) if own_keys else 0)) > _METADATA_MAX_BYTES
        ):
            raise err.InvalidInput(
                f"metadata is too large: {size:,} bytes of JSON, at most {_METADATA_MAX_BYTES:,} (every "
                "event of the command carries it: keep ids and short facts there, not documents)",
                field="metadata",
            )
        try:
            Metadata.model_validate_json(text)
        except ValidationError as exc:
            if any("recursion limit" in e["msg"] for e in exc.errors()):
                raise err.InvalidInput(_METADATA_TOO_DEEP, field="metadata") from None
            # (the keys were looked at above: a string that is not text is what is left to find)
            if (fault := _metadata_fault(meta, [], text=True)) is not None:
                raise _metadata_fault_error(fault) from None
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg'].lower()}"
                if e["loc"]
                else f"a value is not valid unicode text ({e['msg']})"  # (what _metadata_fault did not find)
                for e in exc.errors()
            )
            first = [str(p) for p in exc.errors()[0]["loc"]] if exc.errors() else []
            raise err.InvalidInput(
                f"metadata is not valid: {problems}", **where("metadata", ["metadata", *first])
            ) from None
    return text


def _fingerprints(command: cmd.Command) -> tuple[str, str]:
    """The fingerprint an idempotency key records for ``command``, and the one an evstore before
    81f4e10 recorded for it where that differs ("" where it does not): a retry after the upgrade
    of a command such a store accepted is that command."""

    def default(o: Any) -> Any:
        if isinstance(o, BaseModel):
            return o.model_dump()
        raise TypeError(type(o).__name__)

    def digest(fields: dict[str, Any]) -> str:
        payload = json.dumps([type(command).__name__, fields], default=default, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()

    fields = asdict(command)
    if isinstance(command, cmd.WriteAllocations):
        # a mapping of consumers, as Placement's POST /allocations body is a JSON object: its order
        # is not part of the command (as the order of providers and classes is not; sort_keys)
        given = fields["consumers"]
        fields["consumers"] = sorted(given, key=lambda w: str(w["consumer"]))
        if fields["consumers"] != given:  # (older evstores hashed them in the order given)
            return digest(fields), digest({**fields, "consumers": given})
    return digest(fields), ""


def _check_progress(value: object, signature: str) -> None:
    if value is not None and not callable(value):
        raise err.InvalidInput(
            f"progress must be None or a callable {signature}, got {type(value).__name__}", field="progress"
        )


def _position(value: object, what: str = "position", time_in: str | None = None) -> int:
    """A position argument. ``time_in``: where the same call takes a time instead (``at=``), said
    to a caller who gave one here."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_POSITION:
        hint = f" (a time goes in {time_in})" if time_in is not None and isinstance(value, date) else ""
        raise err.InvalidInput(
            f"{what} must be an integer position from 0 to 2**63-1, got {_given(value)}{hint}", field=what
        )
    return value


def _instant(at: datetime) -> timedelta:
    """A timezone-aware time as a key ordering the instants it names: Python compares two times of
    one ``tzinfo`` object by their wall clocks, so a time in a zone's repeated hour (``fold=1``,
    the later instant) came before an earlier one of its first pass. (Its distance from
    ``datetime.min`` in UTC, which cannot overflow as ``astimezone`` can near year 1 or 9999.)"""
    return at.replace(tzinfo=None) - datetime.min - (at.utcoffset() or timedelta(0))


def _beyond_head(position: int, head: int, field: str, cursor: bool = False) -> err.InvalidInput:
    """The refusal of a position the log has not reached, in one wording wherever a position is
    taken, with the head in ``details["head"]``. ``cursor``: where reading goes on from it
    (``read``, ``subscribe``), which says where such a cursor comes from."""
    hint = (
        ": not a position of this store (a checkpoint from another store, or from before a restore?)"
        if cursor
        else ""
    )
    return err.InvalidInput(
        f"position {position} is beyond the head of the log ({head}){hint}", field=field, head=head
    )


def _zone_failure(value: datetime) -> str | None:
    """Why ``value``'s time zone cannot say its offset from UTC (a caller's ``tzinfo`` whose
    ``utcoffset`` raises, or returns what Python refuses), or None when it can."""
    try:
        value.utcoffset()
    except Exception as exc:  # (a caller's tzinfo: whatever it raises is its own bug, told as such)
        return f"{type(exc).__name__}: {str(exc)[:120]}"
    return None


def _given(value: object) -> str:
    """What a caller gave where a position or a time belongs, for the message refusing it: a date
    or time in ISO form (its repr was cut at 60 characters, inside the tzinfo)."""
    if isinstance(value, datetime) and (failed := _zone_failure(value)) is not None:
        return (
            f"a datetime {value.replace(tzinfo=None).isoformat()} whose time zone "
            f"({type(value.tzinfo).__name__}) failed to give its offset from UTC ({failed})"
        )
    if isinstance(value, datetime) and value.utcoffset() is None:
        return f"a naive datetime {value.isoformat()}"
    if isinstance(value, date):
        return f"{type(value).__name__} {value.isoformat()}"
    if isinstance(value, int) and not isinstance(value, bool):
        # (past 64 bits by far, said so: str() of more than 4,300 digits raises ValueError)
        return _shown_int(value)
    return f"{type(value).__name__} {shown(value, 60)}"


def _time_hint(value: object) -> str:
    """What to do instead with a value refused as a time: a date has no time of day, and a
    naive datetime no zone."""
    if isinstance(value, datetime) and _zone_failure(value) is not None:
        return ""  # (_given said what failed)
    if isinstance(value, datetime):
        return " (no time zone: e.g. .replace(tzinfo=UTC) if it is UTC)"
    if isinstance(value, date):
        return (
            f" (a date has no time of day: datetime({value.year}, {value.month}, {value.day}, "
            "tzinfo=UTC) is its start in UTC)"
        )
    return ""


def _point(value: object, what: str, field: str) -> int | datetime:
    """A position-or-time argument (``diff``'s ``a`` and ``b``, ``position_of``): an integer
    position or a timezone-aware datetime; anything else refused in one wording naming both."""
    if isinstance(value, datetime) and _zone_failure(value) is None and value.utcoffset() is not None:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_POSITION:
        return value
    hint = (
        " (a string: int(text) for a position, datetime.fromisoformat(text) for a time)"
        if isinstance(value, str)
        else _time_hint(value)
    )
    raise err.InvalidInput(
        f"{what} must be a position (an integer from 0 to 2**63-1) or a timezone-aware datetime, "
        f"e.g. datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), got {_given(value)}{hint}",
        field=field,
    )


_Positioned = TypeVar("_Positioned", RecordedEvent, RawEvent)
_position_of = operator.attrgetter("position")


def _check_chained(raw: RawEvent, prev_hash: str) -> None:
    """Refuse to export a row whose hash does not follow on from ``prev_hash``: it, or one before
    it, was altered since it was written (the audit's ``hash_chain`` finding)."""
    try:
        sound = raw.chained_hash(prev_hash) == raw.hash
    except (TypeError, ValueError):  # (a field stored with another type than evstore writes)
        sound = False
    if not sound:
        raise err.CorruptEvent(
            f"Cannot export: the hash chain is broken at position {raw.position} - this row, or one "
            "before it, was altered since it was written, and an import would refuse the file (`evstore "
            "audit` lists the damage; restore the log from a backup)",
            position=raw.position,
            reason="hash_chain",
        )


def _contiguous(after: int, batch: list[_Positioned]) -> list[_Positioned]:
    """``batch`` (events read after ``after``) if its positions follow on (see ``follows_on``)."""
    return follows_on(after, batch, _position_of)


def _aware_time(value: object, what: str = "at") -> datetime:
    """A time argument: a timezone-aware datetime, refused in one wording everywhere otherwise."""
    if isinstance(value, datetime) and _zone_failure(value) is None and value.utcoffset() is not None:
        return value
    got = _given(value)
    hint = " (a string: datetime.fromisoformat(text))" if isinstance(value, str) else _time_hint(value)
    raise err.InvalidInput(
        f"{what} must be a timezone-aware datetime, e.g. datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), "
        f"got {got}{hint}",
        field=what,
    )


def _count(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_POSITION:
        raise err.InvalidInput(
            f"{what} must be an integer from 1 to 2**63-1, got {_given(value)}", field=what
        )
    return value


#: the most rows a backend fetches at once (SQLite's ``fetchmany`` and asyncpg's cursor take a C
#: int): a larger ``batch_size`` - accepted, up to 2**63-1 - fetches this many, which is all of any
#: log that fits in memory anyway
_MOST_PER_FETCH = 2**31 - 1


def _batch(value: object) -> int:
    """A ``batch_size`` argument, checked as a count and capped at what one fetch can take."""
    return min(_count(value, "batch_size"), _MOST_PER_FETCH)


def _validate_key(key: object) -> str | None:
    if key is None:
        return None
    return validate_name(key, "idempotency_key", 255)  # (text the database can store: no lone surrogate)


def _log_context(job: Job) -> dict[str, Any]:
    """What every log line about a queued command says of it. Its request id only when its
    metadata has one: a ``request_id`` the host bound with ``structlog.contextvars`` then shows
    (``merge_contextvars`` fills only the keys a line lacks)."""
    context = {
        "command": job.metadata["command"],
        "consumer": sorted(job.needs.consumers) or None,
        "provider": sorted(job.needs.providers) or None,
    }
    request_id = job.metadata.get("request_id")
    if request_id is not None:
        context["request_id"] = request_id
    return context


def _in_callers_context(log_line: Callable[..., None], job: Job, *args: Any, **kwargs: Any) -> None:
    """``log_line(job, ...)`` run in the context the command was issued in (the writer, which logs
    a cancelled caller's command, runs in the context of whoever opened the store, or none)."""
    if job.context is None:
        log_line(job, *args, **kwargs)
    else:
        job.context.run(log_line, job, *args, **kwargs)


def _log_outcome(job: Job, outcome: Outcome, **extra: Any) -> None:
    """``command.accepted`` or ``command.rejected`` for a command's outcome."""
    logger = _command_log.for_info()
    if logger is None:
        return
    context = _log_context(job)
    if isinstance(outcome, Receipt):
        if context["provider"] is None:  # (a command naming consumers: the providers it changed)
            context["provider"] = sorted(outcome.provider_generations) or None
        changed, named = outcome.consumer_generations, context["consumer"] or ()
        if changed and (len(changed) != len(named) or any(c not in changed for c in named)):
            # (and the consumers it changed that it did not name: a revert's instance, the
            # migrations a delete released; a log searched by an instance's uuid finds them)
            context["consumer"] = sorted({*named, *changed})
        logger.info(
            "command.accepted",
            positions=list(outcome.positions),
            position=outcome.position,
            replayed=outcome.replayed,
            **context,
            **extra,
        )
    else:
        logger.info("command.rejected", code=outcome.code, error=outcome.message, **context, **extra)


def _log_not_run(job: Job) -> None:
    """A queued command whose caller was cancelled before it began: it did not run."""
    _command_log.get().info("command.cancelled", **_log_context(job), caller_cancelled=True)


def _waiting(fut: asyncio.Future[Receipt]) -> bool:
    """Whether a command's caller still waits for it (not cancelled, not answered)."""
    return not fut.done()


def _still_waiting(batch: list[tuple[Job, asyncio.Future[Receipt]]]) -> list[bool]:
    """Whether each caller of a batch still waits (asked on the backend's writer thread: only
    the loop changes a future, and its ``done()`` is one read, as ``_take_batch``'s)."""
    return [not fut.done() for _, fut in batch]


def _own_copy(exc: BaseException) -> Exception:
    """A copy of ``exc`` for one of the several tasks it is raised in (one exception object raised
    in each would gather every task's traceback); a failure that is not evstore's (a backend bug)
    as a ``StorageError``, as the writer reports one."""
    if isinstance(exc, err.EvstoreError):
        failed = copy.copy(exc)
        failed.details = dict(exc.details)
        return failed
    return err.StorageError(f"Storage failure: {exc!r}")


#: a subscriber's read of the log, or the poller's read of the head, that failed for a reason
#: that may pass (``details["transient"]``, which only PostgreSQL's backend sets: a connection
#: lost, refused or timed out - a server restart, a failover, a pooled connection reset; see
#: subscribe for what is not) is tried again after pauses that double from
#: the first to the last, for up to ``_OUTAGE_RETRY_FOR`` seconds of consecutive failures; then,
#: or at once for any other failure, the subscribers end with it
_OUTAGE_RETRY_FOR = 30.0
_OUTAGE_FIRST_PAUSE = 0.25
_OUTAGE_LAST_PAUSE = 5.0


class _Outage:
    """The consecutive transient failures of one reader of the log for subscribers (the poller,
    or one subscriber): how many so far, and when the first was."""

    __slots__ = ("attempts", "since")

    def __init__(self) -> None:
        self.attempts = 0
        self.since = 0.0

    def pause_after(self, exc: BaseException) -> float | None:
        """The pause before reading again after ``exc``, or None when ``exc`` is to be raised: it
        is not transient, or the failures have gone on for longer than ``_OUTAGE_RETRY_FOR``."""
        if not isinstance(exc, err.StorageError) or exc.details.get("transient") is not True:
            return None
        now = asyncio.get_running_loop().time()
        if not self.attempts:
            self.since = now
        elif now - self.since > _OUTAGE_RETRY_FOR:
            return None
        self.attempts += 1
        return min(_OUTAGE_LAST_PAUSE, _OUTAGE_FIRST_PAUSE * 2.0 ** min(self.attempts - 1, 16))


class _SharedRead:
    """One read of the log in flight for the subscribers at one position (see
    :meth:`AllocationStore._read_for_subscriber`): its task, the subscribers' wake-ups counter
    when it began, and how many subscribers wait for it."""

    __slots__ = ("task", "waiters", "wakes")

    def __init__(self, task: asyncio.Task[list[RecordedEvent]], wakes: int) -> None:
        self.task = task
        self.wakes = wakes
        self.waiters = 0


class _HoldingFor:
    """What a history listing needs to know of its consumer to find the tombstones of its instance
    that left it holding (see ``AllocationStore.history``): the consumer folded from its own
    events, and while it holds allocations as a migration, the instance and the position since
    which it has. (An event of its own that leaves it holding nothing - this evstore's delete of
    the instance, a revert, a confirm - ends that span, so only a delete that left it holding is
    found between two of its events.)"""

    __slots__ = ("_backend", "_batch", "_instance", "_key", "_migrated", "_since", "_state")

    def __init__(self, key: str, backend: Backend, batch_size: int) -> None:
        self._key, self._backend, self._batch = key, backend, batch_size
        self._state = State()  # (the slice its own events fold, as ``state_at(consumer=)``)
        self._instance: str | None = None
        self._since = 0
        self._migrated = False

    def fold(self, recorded: RecordedEvent) -> None:
        """After ``recorded`` was listed: fold it, if it names the consumer (not only a provider
        of that uuid), and note what the consumer then holds for whom. Nothing is folded before
        the consumer's first start as a migration (only that gives it an instance, and it sets
        what it holds whole): a provider's or an instance's history costs a comparison an event."""
        if not self._migrated:
            if recorded.type != "MigrationStarted" or recorded.event["migration"] != self._key:
                return
            self._migrated = True
        if f"consumer:{self._key}" not in recorded.event.entities():
            return
        evolve(self._state, recorded.event, recorded.position)
        c = self._state.consumers.get(self._key)
        self._instance = c.on_behalf_of if c is not None and c.allocations else None
        self._since = recorded.position

    async def tombstones(self, until: int | None) -> list[RecordedEvent]:
        """The instance's tombstone that left the consumer holding, if it lies after the last
        position looked at and up to ``until`` (None: the end), while the consumer holds
        allocations for it: none when it holds none. Only the instance's first tombstone - its
        deletion, the fold's ``deleted_at``: a second one (an older writer's delete of a deleted
        consumer) left nothing holding that was not a leak already."""
        if self._instance is None or (until is not None and until <= self._since):
            return []
        first = await _first_tombstone(self._backend, self._instance, until)
        found = [first] if first is not None and first.position > self._since else []
        self._since = until if until is not None else max(self._since, first.position if first else 0)
        return found


async def _first_tombstone(backend: Backend, consumer: str, until: int | None) -> RecordedEvent | None:
    """The consumer's own first ``ConsumerDeleted`` up to ``until`` (None: the end): its deletion,
    the fold's ``deleted_at``. Its history lists other deletes too - of a migration of it (they
    record it as ``on_behalf_of``), of a consumer that released it as its migration - which are
    not its tombstone."""
    after = 0
    while True:
        batch = await backend.read_entities(
            [f"consumer:{consumer}"], after, 64, until, types=("ConsumerDeleted",)
        )
        for recorded in batch:
            if recorded.event["consumer"] == consumer:
                return recorded
        if len(batch) < 64:
            return None
        after = batch[-1].position


async def _fold_instance_tombstone(backend: Backend, state: State, consumer: str, position: int) -> None:
    """Into a consumer's slice (``state_at(consumer=)``, folded from its own events): when it holds
    allocations as a migration, its instance's first tombstone up to ``position``, if any - an
    older, Placement-style writer's delete of the instance does not name the migration it left
    holding, so the slice would not know its allocations are the audit's leak
    (``ConsumerView.leaked``). The tombstone is folded on its own (the fold's one ``evolve``) and
    only the instance taken from it: folded into the slice, after the migration's later events,
    it would replay what it did to them out of order."""
    c = state.consumers.get(consumer)
    if c is None or not c.allocations or c.deleted or c.on_behalf_of is None:
        return
    instance = c.on_behalf_of
    known = state.consumers.get(instance)
    if known is not None and known.deleted:
        return
    found = await _first_tombstone(backend, instance, position)
    if found is not None:
        apart = evolve(State(), found.event, found.position)
        state.consumers[instance] = apart.consumers[instance]


class AllocationStore:
    """Providers, inventories, consumers and their allocations, kept as an event log.

    Example::

        async with open_store("sqlite:///cloud.db") as store:
            await store.create_provider(node, "compute-1")
            gen = await store.set_inventories(node, {"VCPU": Inventory(total=8)}, generation=0)
            await store.set_allocations(server, {node: {"VCPU": 2}}, project_id="p", user_id="u",
                                        consumer_type="INSTANCE", generation=None)
    """

    def __init__(self, backend: Backend, *, max_batch: int = 256, poll_interval: float = 0.2) -> None:
        validate_int_option(max_batch, "max_batch", 1, 100_000)
        validate_seconds_option(poll_interval, "poll_interval", 3600)
        self._snapshot_every = 10_000
        self._impl = backend
        #: the URL as messages show it, passwords hidden: worked out now, since ``__del__`` needs it
        #: where it may not work it out (at the interpreter's exit nothing can be imported, and
        #: ``re``'s replacement templates import)
        self._shown_url = err.redact_url(backend.url)
        #: the loop that opened the store: its queue, futures and connections belong to it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._max_batch = max_batch
        self._poll_interval = poll_interval
        self._queue: collections.deque[tuple[Job, asyncio.Future[Receipt]]] = collections.deque()
        self._wake = asyncio.Event()
        #: wake-ups of the subscribers so far (this process's commits, the poller, close): a
        #: subscriber that saw it change since it began its read reads again instead of waiting
        self._wakes = 0
        #: subscribers waiting for appends, each with the position it has delivered up to
        self._idle: dict[asyncio.Future[None], int] = {}
        #: the one task polling the head for them (other processes' appends): None when none waits
        self._poller: asyncio.Task[None] | None = None
        #: what the poller's pause between reads waits for: set to end it early (_until_appended)
        self._poller_nap: asyncio.Future[None] | None = None
        #: the reads of the log in flight for subscribers, by (after, limit): subscribers at the same
        #: position share one (a commit wakes them all at once)
        self._reads: dict[tuple[int, int], _SharedRead] = {}
        self._writer: asyncio.Task[None] | None = None
        self._closing = False
        self._closed: asyncio.Future[None] | None = None
        #: done once open() has connected (or failed to): close() waits for it
        self._opening: asyncio.Future[None] | None = None
        #: batches or jobs running (PostgreSQL): kept alive until they end, even if the writer is
        #: cancelled, and waited for by close()
        self._running: set[asyncio.Future[Any]] = set()
        #: where it was opened (in asyncio's debug mode, ``python -X dev``): the warning for a
        #: store never closed names it
        self._source_traceback: traceback.StackSummary | None = None

    def __del__(self, _warn: Callable[..., None] = warnings.warn) -> None:
        # A store dropped, or left at exit, without close(): say so as asyncio's and sqlite3's
        # resources do (a ResourceWarning, shown under -X dev or -W default), and let go of its
        # connections and writer task without the loop's help - it may be closed already. What
        # was committed is durable either way; commands queued had no caller left to answer.
        # (``_warn``: bound now, as asyncio's own __del__ do - late in the interpreter's exit the
        # module's globals may be gone)
        loop: asyncio.AbstractEventLoop | None = getattr(self, "_loop", None)
        if loop is None or self._closing or self._closed is not None:
            return  # (never opened - its options refused, even - or closed)
        message = f"unclosed store {self!r}"
        with contextlib.suppress(Exception):  # (at exit, formatting the traceback may need an import)
            where = (
                ", opened at (most recent call last):\n" + "".join(self._source_traceback.format()).rstrip()
                if self._source_traceback
                else " (python -X dev shows where it was opened)"
            )
            message += f": close it (`async with open_store(...)`, or `await store.close()`){where}"
        self._closing = True
        writer = self._writer
        with contextlib.suppress(Exception):
            if writer is not None and not writer.done():
                if loop.is_closed():  # (nothing will run it again: asyncio need not say it was pending)
                    writer._log_destroy_pending = False  # type: ignore[attr-defined]
                else:
                    loop.call_soon_threadsafe(writer.cancel)
        with contextlib.suppress(Exception):
            self._impl.abandon()
        # (last: -W error makes it raise)
        _warn(message, ResourceWarning, source=self)

    @property
    def url(self) -> str:
        """The URL the store was opened with."""
        return self._impl.url

    def __repr__(self) -> str:
        # (the URL as every message shows it: a password never reaches a debugger's or a log's text)
        return f"AllocationStore({self._shown_url!r}{', closed' if self._closing else ''})"

    @property
    def backend(self) -> Backend:
        """The storage backend (SQLite or PostgreSQL) under the store."""
        return self._impl

    @property
    def _backend(self) -> Backend:
        self._check_loop()
        return self._impl

    def _check_loop(self) -> None:
        """Refuse use from a loop other than the one that opened the store (a command queued
        from another loop would commit and its caller never hear of it)."""
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:  # (not in a coroutine: a property read from plain code)
            return
        if running is not loop and loop.is_closed():
            raise err.WrongEventLoop(
                "The event loop that opened this store has ended without closing it (its queue, futures "
                "and connections belonged to that loop): open a new store in this loop, and close a "
                "store before its loop ends (`async with open_store(...)`, or `await store.close()` "
                "in that loop)"
            )
        if running is not loop:
            raise err.WrongEventLoop(
                "This store was opened on another event loop and can only be used there (its queue, "
                "futures and connections belong to that loop): open one store per event loop, or run "
                "the call on the store's loop, e.g. with asyncio.run_coroutine_threadsafe"
            )

    @property
    def snapshot_every(self) -> int:
        """Time travel snapshots the folded state every this many events (``open_store(snapshot_every=)``,
        10,000); settable on an open store, checked as the option is: 1 to 2**63-1."""
        return self._snapshot_every

    @snapshot_every.setter
    def snapshot_every(self, value: int) -> None:
        # (a plain attribute took anything: 1.5 failed a later state_at as a storage error, None
        # and "10" as a bare TypeError)
        self._snapshot_every = validate_int_option(value, "snapshot_every", 1, MAX_POSITION)

    # --- lifecycle ------------------------------------------------------------------------

    async def open(self) -> AllocationStore:
        """Open the connections and start the writer (``open_store`` does this). Opening an
        open store again does nothing; a closed store cannot be reopened: open a new one."""
        if self._closed is not None or self._closing:
            raise err.StoreClosed(
                "This store was closed and cannot be reopened: open a new one, e.g. with open_store(url)"
            )
        if self._loop is not None:
            self._check_loop()
            if self._writer is None and self._opening is not None:
                await asyncio.shield(self._opening)  # (another task is opening it: its outcome)
                if self._closing:
                    raise err.StoreClosed("The store was closed while it was being opened")
                if self._writer is None:
                    return await self.open()  # (that open failed or was cancelled: this one tries)
            return self
        self._loop = asyncio.get_running_loop()
        self._opening = self._loop.create_future()
        try:
            await self._impl.open()
        except BaseException:
            self._loop = None
            raise
        finally:
            self._opening.set_result(None)  # (a close() waiting for this open goes on)
        if self._closing:
            # close() was called while this connected: it waited for the connections to be
            # made and closes them now; nothing may use them
            raise err.StoreClosed("The store was closed while it was being opened")
        if self._loop.get_debug():
            self._source_traceback = traceback.extract_stack(sys._getframe(1))
        # (the writer holds the store weakly while it waits for commands: a store its program
        # dropped without closing it is collected, and warns, rather than kept by its own task)
        self._writer = self._loop.create_task(
            _write_loop(weakref.ref(self), self._wake), name="evstore-writer"
        )
        return self

    async def close(self) -> None:
        """Answer every queued command, then close the connections.

        Cancelling ``close()`` (a shutdown deadline) does not cut that short: the closing goes
        on in the background, and a second ``close()`` waits for it.
        """
        self._check_loop()
        if self._closed is None or self._closed.cancelled():
            # (a closing cancelled itself - a shutdown cancelling every task: see below - never
            # finished: it is begun again, not waited for, which raised CancelledError for ever)
            self._closed = asyncio.ensure_future(self._close())
        try:
            await asyncio.shield(self._closed)
        except asyncio.CancelledError:
            if self._closed.cancelled():
                # The closing task was cancelled too: a shutdown cancels every task at once,
                # and one made a moment before never took its first step (nothing was closed).
                # Begun again, in the background, as a cancelled close() goes on.
                self._closed = asyncio.ensure_future(self._close())
            raise

    async def _close(self) -> None:
        self._closing = True
        self._wake_subscribers()  # subscribers waiting for appends learn of it now, not at their next poll
        if self._poller is not None:
            self._poller.cancel()
        stop_waiting = getattr(self._impl, "stop_waiting", None)
        if stop_waiting is not None and self._opening is not None and not self._opening.done():
            # (SQLite: an open waiting for another process's write lock stops waiting - no one
            # will use what it opens - instead of holding the close for up to busy_timeout. The
            # commands queued are different: their callers still wait for them, and close()
            # answers every one, within busy_timeout as ever; a command whose caller gave up -
            # a shutdown that cancelled its tasks - is dropped at the writer's next slice.)
            stop_waiting()
        try:
            if self._opening is not None:  # (an open() in progress: let it make what is to be closed)
                await asyncio.shield(self._opening)
            if self._poller is not None:  # (cancelled above: it ends before the connections close)
                await asyncio.wait([self._poller])
            if self._writer is not None:
                # The writer finishes the batch in its transaction and everything queued, then
                # stops: every caller gets its answer before the connections close.
                self._wake.set()
                await asyncio.wait([self._writer])  # (it may have been cancelled: that is no error here)
            while self._running:  # (jobs the writer started on their own: PostgreSQL's)
                await asyncio.wait(list(self._running))
        finally:
            try:
                await self._backend.close()
            finally:
                # The subscribers' reads still in flight (PostgreSQL's pool closes once their
                # queries have returned their rows, which they then decode) are cancelled, and
                # their subscribers end with StoreClosed, before close() returns - also when the
                # backend's close failed: it returned with them pending, and a loop closed after
                # it said "Task was destroyed but it is pending!"
                while self._reads:
                    reads = [shared.task for shared in self._reads.values()]
                    for task in reads:
                        task.cancel()
                    await asyncio.wait(reads)

    async def __aenter__(self) -> AllocationStore:
        return await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- the writer -----------------------------------------------------------------------

    async def _write_queued(self) -> bool:
        """Run what is queued; True once the store closes, False when the queue is empty (the
        writer then waits for ``_wake``, see :func:`_write_loop`)."""
        drain = getattr(self._backend, "drain", None)
        while True:
            if not self._queue:
                return self._closing
            if drain is not None:
                # The backend's writer thread takes batches off the queue itself, one after the
                # other, and delivers each batch's outcomes back on the loop: no loop round trip
                # between batches, and one fewer per command. The thread delivers even if this
                # task is cancelled meanwhile.
                try:
                    await drain(self._take_batch, self._deliver, _still_waiting)
                except asyncio.CancelledError:
                    # Cancelled while the thread drains (a shutdown: asyncio.run's end cancels every
                    # task, then closes the loop): the thread goes on with the batch it holds and
                    # hands its outcomes to the loop, which must still be running then (a thread
                    # handing them to a closed loop died of "Event loop is closed", and held the
                    # store until then: a store left open at exit was not warned of). What is
                    # queued fails now, so the thread takes nothing more; this waits for its turn
                    # to end (a second cancellation stops the wait).
                    self._fail_queued(err.StoreClosed("The store was closed before this command ran"))
                    settle = getattr(self._backend, "settle", None)
                    if settle is not None:
                        await settle()
                    raise
                except Exception as exc:
                    # Every batch the thread took was delivered; this is the hop itself failing
                    # (the connection is gone): what is still queued can never run.
                    log.warning("writer.drain_failed", error=repr(exc))
                    self._fail_queued(
                        exc
                        if isinstance(exc, err.EvstoreError)
                        else err.StorageError(f"Storage failure: {exc!r}")
                    )
                continue
            batch = self._take_batch()
            if batch is None:
                continue
            start = getattr(self._backend, "start_jobs", None)
            if start is not None:
                self._start(start, batch[1])
                continue
            # The batch runs to its end even if the writer task is cancelled meanwhile, and its
            # callers are answered when it ends (not when this task resumes, which a cancelled
            # task never does): they were taken off the queue, no one else would answer them.
            running = asyncio.ensure_future(self._backend.run_jobs([j for j, _ in batch[1]]))  # noqa: RUF006
            self._running.add(running)  # (the loop keeps only a weak reference to a task)
            running.add_done_callback(self._running.discard)
            running.add_done_callback(functools.partial(self._deliver_when_done, batch[1]))
            with contextlib.suppress(Exception):  # (its callers hear of it from _deliver_when_done)
                await asyncio.shield(running)

    def _start(
        self,
        start: Callable[[list[Job], list[Callable[[], bool]]], list[asyncio.Task[Outcome]]],
        batch: list[tuple[Job, asyncio.Future[Receipt]]],
    ) -> None:
        """Start a batch's jobs on a backend that runs each job on its own (PostgreSQL) and go on:
        the next queued commands start while these run. Each caller is answered when its job
        ends, even if the writer task is cancelled meanwhile (the job goes on without it)."""
        try:
            tasks = start([j for j, _ in batch], [functools.partial(_waiting, fut) for _, fut in batch])
        except Exception as exc:
            self._deliver(batch, exc)
            return
        for (job, fut), task in zip(batch, tasks, strict=True):
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(functools.partial(self._deliver_when_done, [(job, fut)]))

    def _deliver_when_done(
        self,
        batch: list[tuple[Job, asyncio.Future[Receipt]]],
        running: asyncio.Future[list[Outcome]] | asyncio.Future[Outcome],
    ) -> None:
        outcomes: list[Outcome] | BaseException
        if running.cancelled():
            keyed = all(job.idempotency_key is not None for job, _ in batch)
            outcomes = err.StorageError(
                "The command was cancelled while it ran; its outcome is unknown ("
                + (
                    "retry it with the same idempotency_key)"
                    if keyed
                    else "it had no idempotency_key: look at the log before running it again)"
                ),
                outcome_unknown=True,
            )
        elif (failed := running.exception()) is not None:
            outcomes = failed
        else:
            result = running.result()
            outcomes = result if isinstance(result, list) else [result]
        self._deliver(batch, outcomes)

    def _take_batch(self) -> tuple[list[Job], list[tuple[Job, asyncio.Future[Receipt]]]] | None:
        """Up to ``max_batch`` queued commands whose callers still wait (``None``: none).

        May run on the backend's writer thread (``drain``): it only pops from the queue, which
        only the loop appends to (both atomic on a deque).
        """
        batch: list[tuple[Job, asyncio.Future[Receipt]]] = []
        queue = self._queue
        while queue and len(batch) < self._max_batch:
            job, fut = queue.popleft()
            if not fut.done():
                batch.append((job, fut))
            elif fut.cancelled() and self._loop is not None:  # (logged on the loop, not this thread)
                self._loop.call_soon_threadsafe(_log_not_run, job, context=job.context)
        if not batch:
            return None
        return [j for j, _ in batch], batch

    def _deliver(
        self, batch: list[tuple[Job, asyncio.Future[Receipt]]], outcomes: list[Outcome] | BaseException
    ) -> None:
        """Answer each caller of a batch (on the loop)."""
        if isinstance(outcomes, BaseException):
            exc = outcomes
            if not isinstance(exc, err.EvstoreError):  # a backend bug must not kill the writer
                # (whether the batch committed, the backend did not say: unknown)
                exc = err.StorageError(f"Storage failure: {exc!r}", outcome_unknown=True)
            outcomes = [exc] * len(batch)
        appended = False
        for (job, fut), outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, err.ProjectionCorrupt):
                # (met reading or writing the projection inside the command's transaction, before
                # its COMMIT, on every backend: rolled back, nothing of it written)
                outcome.details.setdefault("outcome_unknown", False)
            if isinstance(outcome, Receipt):
                appended = appended or bool(outcome.positions)
                if not fut.done():
                    fut.set_result(outcome)
            elif not fut.done():
                fut.set_exception(outcome)
            if fut.cancelled():
                # Its caller was cancelled (a timeout, a shutdown) once the command had begun: no
                # one hears the outcome, so the log says whether it committed.
                if isinstance(outcome, err.EvstoreError) and outcome.details.get("not_run"):
                    _in_callers_context(_log_not_run, job)
                else:
                    _in_callers_context(_log_outcome, job, outcome, caller_cancelled=True)
            # (answered: its context is needed no more. An error's traceback holds the writer's
            # frames, which hold every job of the batch: a caller keeping its error must not keep
            # what the other callers bound in their contexts)
            object.__setattr__(job, "context", None)
        if appended:
            self._wake_subscribers()

    def _fail_queued(self, exc: err.EvstoreError) -> None:
        while True:
            try:
                job, fut = self._queue.popleft()
            except IndexError:  # (empty; or emptied between a check and the pop by a draining thread)
                return
            if not fut.done():
                fut.set_exception(exc)
            elif fut.cancelled():  # (its caller was cancelled too: a shutdown cancelling every task)
                _in_callers_context(_log_not_run, job)

    async def _submit(
        self,
        command: cmd.Command,
        idempotency_key: object = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        if self._closing or self._writer is None:
            raise err.StoreClosed("The store is closed (use it inside `async with open_store(...)`)")
        self._check_loop()
        if self._writer.done():
            raise err.StoreClosed("The store's writer task was cancelled: close the store and open it again")
        key = _validate_key(idempotency_key)
        meta = _metadata_dict(metadata)
        from_caller = bool(meta)
        meta["command"] = type(command).__name__
        meta["command_id"] = _command_id()
        if key is not None:
            meta["idempotency_key"] = key
        elif "idempotency_key" in meta:
            del meta["idempotency_key"]  # (evstore's key: a caller's value would pose as one used)
        n = cmd.needs(command)
        job = Job(
            command,
            meta,
            _metadata_json(meta, from_caller, own_keys=from_caller),
            n,
            key,
            *(_fingerprints(command) if key is not None else ("", "")),
            context=contextvars.copy_context(),
        )
        # (the store's loop, which _check_loop found running: asking asyncio again costs a getpid)
        fut: asyncio.Future[Receipt] = (self._loop or asyncio.get_running_loop()).create_future()
        self._queue.append((job, fut))
        self._wake.set()
        try:
            receipt = await fut
        except err.EvstoreError as exc:
            # (the future holds the error, whose traceback holds this frame: a reference cycle,
            # left for the cyclic collector with the command and all it names, unless let go)
            del fut
            _log_outcome(job, exc)
            exc.__dict__["_evstore_logged"] = True  # (not again by the method: _logs_rejections)
            raise
        except asyncio.CancelledError:
            # Cancelled once the outcome had arrived (before this task resumed): it is logged
            # here. Otherwise the future was cancelled with the caller, and the writer logs what
            # became of the command (see _deliver and _take_batch).
            if fut.done() and not fut.cancelled():
                failed = fut.exception()
                if failed is None:
                    _log_outcome(job, fut.result(), caller_cancelled=True)
                elif isinstance(failed, err.EvstoreError):  # (anything else: the cancellation goes on)
                    _log_outcome(job, failed, caller_cancelled=True)
            del fut
            raise
        _log_outcome(job, receipt)
        return receipt

    # --- commands -------------------------------------------------------------------------

    @_logs_rejections("CreateResourceClass")
    async def create_resource_class(
        self,
        name: str,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Create a custom resource class ``CUSTOM_*`` (Placement's PUT /resource_classes/{name};
        creating one that exists changes nothing). Raises ``InvalidInput`` for a name off the
        pattern or a standard class."""
        return await self._submit(
            cmd.CreateResourceClass(validate_resource_class_name(name, "name")), idempotency_key, metadata
        )

    @_logs_rejections("CreateProvider", provider=("uuid",))
    async def create_provider(
        self,
        uuid: str | _uuid.UUID,
        name: str,
        parent: str | _uuid.UUID | None = None,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Create a resource provider (generation 0), optionally in ``parent``'s tree.

        Raises ``DuplicateName`` (name or uuid taken), ``ProviderNotFound`` (parent),
        ``InvalidInput`` (malformed uuid, empty or over-long name)."""
        command = cmd.CreateProvider(
            normalize_uuid(uuid, "provider uuid", "uuid"),
            validate_name(name, "provider name", 200, "name"),
            normalize_uuid(parent, "parent provider uuid", "parent") if parent is not None else None,
        )
        return await self._submit(command, idempotency_key, metadata)

    @_logs_rejections("RenameProvider", provider=("uuid",))
    async def rename_provider(
        self,
        uuid: str | _uuid.UUID,
        name: str,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Give a provider a new (unique) name; its generation stays (as in Placement, only
        inventory changes and allocation writes bump it). Raises ``ProviderNotFound``,
        ``DuplicateName``."""
        command = cmd.RenameProvider(
            normalize_uuid(uuid, "provider uuid", "uuid"), validate_name(name, "provider name", 200, "name")
        )
        return await self._submit(command, idempotency_key, metadata)

    @_logs_rejections("DeleteProvider", provider=("uuid",))
    async def delete_provider(
        self,
        uuid: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Delete a provider. Raises ``ProviderNotFound``, ``ProviderInUse`` (it holds allocations)
        and ``CannotDeleteParent`` (it has children), as Placement does."""
        return await self._submit(
            cmd.DeleteProvider(normalize_uuid(uuid, "provider uuid", "uuid")), idempotency_key, metadata
        )

    @_logs_rejections("SetInventories", provider=("provider",))
    async def set_inventories(
        self,
        provider: str | _uuid.UUID,
        inventories: Mapping[str, Inventory | Mapping[str, Any]],
        generation: int,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> int:
        """Replace the provider's whole inventory; returns the new provider generation.

        ``inventories``: ``{class: Inventory(total=..., ...)}`` (or a mapping of its fields);
        ``generation``: the provider's current one (``(await store.inventories(p)).generation``).
        Shrinking below current usage is allowed (the audit reports it as over capacity).
        Raises ``ProviderNotFound``, ``ConcurrentUpdate`` (another generation),
        ``InvalidInventory`` (``reserved > total``, ``min_unit > max_unit``: an
        ``InvalidInput`` too), ``UnknownResourceClass``, ``InventoryInUse`` (removing a class
        that allocations hold)."""
        puuid = normalize_uuid(provider, "provider uuid", "provider")
        if not isinstance(inventories, Mapping):
            raise err.InvalidInput(
                "inventories must be a mapping of resource class to Inventory", field="inventories"
            )
        invs = {
            validate_resource_class_name(rc, "inventories", ["inventories", path_key(rc)]): coerce_inventory(
                inv, rc, "inventories", [rc]
            )
            for rc, inv in inventories.items()
        }
        gen = validate_generation(generation, "provider generation", nullable=False)
        assert gen is not None
        receipt = await self._submit(cmd.SetInventories(puuid, invs, gen), idempotency_key, metadata)
        return receipt.provider_generations[puuid]

    @_logs_rejections("SetInventory", provider=("provider",))
    async def set_inventory(
        self,
        provider: str | _uuid.UUID,
        resource_class: str,
        inventory: Inventory | Mapping[str, Any],
        generation: int,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> int:
        """Add or update one class of the provider's inventory; returns the new generation.

        ``inventory``: an ``Inventory`` (or a mapping of its fields); ``generation``: the
        provider's current one. Raises ``ProviderNotFound``, ``ConcurrentUpdate``,
        ``InvalidInventory`` and ``UnknownResourceClass`` as ``set_inventories`` does."""
        puuid = normalize_uuid(provider, "provider uuid", "provider")
        rc = validate_resource_class_name(resource_class)
        gen = validate_generation(generation, "provider generation", nullable=False)
        assert gen is not None
        command = cmd.SetInventory(puuid, rc, coerce_inventory(inventory, rc), gen)
        receipt = await self._submit(command, idempotency_key, metadata)
        return receipt.provider_generations[puuid]

    @_logs_rejections("DeleteInventory", provider=("provider",))
    async def delete_inventory(
        self,
        provider: str | _uuid.UUID,
        resource_class: str,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> int:
        """Remove one class from the provider's inventory; returns the new provider generation.
        Raises ``InventoryInUse`` while allocations hold that class, ``NotFound`` if it has none."""
        puuid = normalize_uuid(provider, "provider uuid", "provider")
        command = cmd.DeleteInventory(puuid, validate_resource_class_name(resource_class))
        receipt = await self._submit(command, idempotency_key, metadata)
        return receipt.provider_generations[puuid]

    @_logs_rejections("WriteAllocations", consumer=("allocations",))
    async def write_allocations(
        self,
        allocations: AllocationsByConsumer,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Replace the allocations of one or more consumers atomically (Placement's POST /allocations).

        ``allocations``: ``{consumer: ConsumerAllocations(allocations=..., project_id=...,
        user_id=..., consumer_type=..., consumer_generation=...)}`` (or a mapping of those
        fields), each consumer's ``allocations`` as ``{provider: {class: amount}}`` - ``{}``
        empties it. ``consumer_generation``: the consumer's current generation, or ``None`` (or
        left out) for "I expect this consumer not to exist". Each consumer's allocations are
        replaced, not added to. Emptying one consumer into another holding nothing (exactly its
        allocations, same project and user) is recorded as a migration start (Nova's
        ``move_allocations``). Returns the ``Receipt``: the positions appended and each
        consumer's and provider's new generation.

        Refused, with nothing written, in Placement's check order: ``ConcurrentUpdate`` (a
        consumer generation that does not match: ``exc.details`` name the ``consumer``, the
        stored generation ``expected`` and the one it ``got``), ``ConsumerDeleted`` (a
        tombstoned consumer, or a migration of a deleted instance), ``ProviderNotFound``,
        ``UnknownResourceClass``,
        ``InvalidInventory`` (a provider without inventory of the class), ``ConstraintViolation``
        (min_unit, max_unit, step_size), ``CapacityExceeded``; ``InvalidInput`` for a malformed
        argument, ``IdempotencyConflict`` for a key used by another command.
        """
        if not isinstance(allocations, Mapping) or not allocations:
            raise err.InvalidInput(
                "write_allocations needs a non-empty mapping of consumer to ConsumerAllocations",
                field="allocations",
            )
        writes = []
        for consumer, value in allocations.items():
            try:
                cuuid = normalize_uuid(consumer, "consumer uuid", "allocations")
            except err.InvalidInput as exc:  # (the path built only for an error)
                exc.details.update(where("allocations", ["allocations", path_key(consumer)]))
                raise
            ca = coerce_consumer_allocations(value, cuuid)
            writes.append(
                cmd.ConsumerWrite(
                    cuuid, ca.allocations, ca.project_id, ca.user_id, ca.consumer_type, ca.consumer_generation
                )
            )
        return await self._submit(cmd.WriteAllocations(tuple(writes)), idempotency_key, metadata)

    @_logs_rejections("WriteAllocations", consumer=("consumer",))
    async def set_allocations(
        self,
        consumer: str | _uuid.UUID,
        allocations: ProviderAllocations,
        *,
        project_id: str,
        user_id: str,
        consumer_type: str,
        generation: int | None,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Replace one consumer's allocations (Placement's PUT /allocations/{consumer}).

        ``allocations``: ``{provider: {class: amount}}`` (``{}`` empties the consumer, which is
        then absent again: its next write sends ``generation=None``). ``generation``: the
        consumer's current one (``(await store.allocations(c)).generation``); ``generation=None``
        means "I expect this consumer not to exist". Returns the ``Receipt`` (the consumer's new
        generation in ``.consumer_generations``).

        Refused, with nothing written, in Placement's check order: ``ConcurrentUpdate`` (a
        consumer generation that does not match: ``exc.details`` name the ``consumer``, the
        stored generation ``expected`` and the one it ``got``), ``ConsumerDeleted`` (a
        tombstoned consumer, or a migration of a deleted instance), ``ProviderNotFound``,
        ``UnknownResourceClass``,
        ``InvalidInventory`` (a provider without inventory of the class), ``ConstraintViolation``
        (min_unit, max_unit, step_size), ``CapacityExceeded``; ``InvalidInput`` for a malformed
        argument, ``IdempotencyConflict`` for a key used by another command.
        """
        write = cmd.ConsumerWrite(
            normalize_uuid(consumer, "consumer uuid", "consumer"),
            normalize_allocations(allocations),
            validate_name(project_id, "project_id"),
            validate_name(user_id, "user_id"),
            validate_consumer_type(consumer_type),
            validate_generation(generation, "consumer generation"),
        )
        try:
            return await self._submit(cmd.WriteAllocations((write,)), idempotency_key, metadata)
        except err.InvalidInput as exc:
            # (the writer names where write_allocations' argument has it: {consumer: {"allocations":
            # {provider: ...}}}; this argument is the inner {provider: ...})
            path = exc.details.get("path")
            if isinstance(path, list) and path[:3] == ["allocations", write.consumer, "allocations"]:
                exc.details["path"] = ["allocations", *path[3:]]
            raise

    @_logs_rejections("Release", consumer=("consumer",))
    async def release(
        self,
        consumer: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Remove all of a consumer's allocations (Placement's DELETE /allocations/{consumer}):
        no generation check, no provider generation bump; the consumer is absent again (not
        deleted: ``delete_consumer`` tombstones). Raises ``NotFound`` when it holds nothing
        (``exc.details["deleted_at"]``: its tombstone's position, if it was deleted)."""
        return await self._submit(
            cmd.Release(normalize_uuid(consumer, "consumer uuid", "consumer")), idempotency_key, metadata
        )

    @_logs_rejections("StartMigration", consumer=("instance", "migration"))
    async def start_migration(
        self,
        instance: str | _uuid.UUID,
        migration: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Move every allocation of ``instance`` to the empty consumer ``migration``, held on the
        instance's behalf (Nova's resize/migration start). Raises ``NotFound`` (the instance holds
        nothing), ``ConsumerDeleted`` (either is tombstoned), ``ConcurrentUpdate`` (the migration
        already holds allocations), ``InvalidInput`` (same uuid twice, or the instance is itself a
        migration), and, as Nova's ``move_allocations`` is refused by Placement, ``ConstraintViolation``
        when the inventory changed since so that the amounts break its ``min_unit``/``max_unit``/
        ``step_size`` (the move's rows are checked as a write's; no room is needed: usage does not grow)."""
        command = cmd.StartMigration(
            normalize_uuid(instance, "instance uuid", "instance"),
            normalize_uuid(migration, "migration uuid", "migration"),
        )
        return await self._submit(command, idempotency_key, metadata)

    @_logs_rejections("RevertMigration", consumer=("migration",))
    async def revert_migration(
        self,
        migration: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Give the migration's allocations back to its instance and empty the migration (a failed
        resize). Raises ``ConsumerDeleted`` when the instance was deleted meanwhile (nothing is
        written: the leak of Placement bug 1848343 cannot happen), ``NotFound`` when ``migration``
        holds nothing for a migration in progress, ``ConstraintViolation`` when the source's
        inventory changed since so that the amounts break its ``min_unit``/``max_unit``/``step_size``.
        A revert never needs room: no provider's usage grows, so a source whose total shrank below
        its usage meanwhile still takes the allocations back (Placement's over-capacity tolerance)."""
        return await self._submit(
            cmd.RevertMigration(normalize_uuid(migration, "migration uuid", "migration")),
            idempotency_key,
            metadata,
        )

    @_logs_rejections("ConfirmMigration", consumer=("migration",))
    async def confirm_migration(
        self,
        migration: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Release what the migration holds (the resize succeeded; the instance keeps its claim on
        the destination). Raises ``NotFound`` when ``migration`` holds nothing for a migration in
        progress, ``ConsumerDeleted`` when its instance was deleted and nothing is left to release."""
        return await self._submit(
            cmd.ConfirmMigration(normalize_uuid(migration, "migration uuid", "migration")),
            idempotency_key,
            metadata,
        )

    @_logs_rejections("DeleteConsumer", consumer=("consumer",))
    async def delete_consumer(
        self,
        consumer: str | _uuid.UUID,
        *,
        idempotency_key: str | None = None,
        metadata: Mapping[str, Any] | Metadata | None = None,
    ) -> Receipt:
        """Tombstone a consumer, forever: release its allocations and those of every migration
        holding resources on its behalf, in one event. Any later write that would give it (or
        such a migration) allocations - a late revert, a racing build - is refused with
        ``ConsumerDeleted``. A consumer never seen, or absent, is tombstoned all the same;
        deleting a deleted one changes nothing (the receipt has no positions)."""
        return await self._submit(
            cmd.DeleteConsumer(normalize_uuid(consumer, "consumer uuid", "consumer")),
            idempotency_key,
            metadata,
        )

    # --- queries --------------------------------------------------------------------------

    async def usage(self, provider: str | _uuid.UUID) -> ProviderUsage:
        """A provider's usage per class (a read-only mapping, 0 for stocked classes nobody holds),
        with ``.provider`` (its uuid) and ``.generation``. Raises ``ProviderNotFound``."""
        return ProviderUsage.of(await self._provider_state(provider))

    async def inventories(self, provider: str | _uuid.UUID) -> ProviderInventories:
        """A provider's inventories (a read-only mapping of class to :class:`Inventory`, by class),
        with ``.provider`` and ``.generation`` - the generation the inventory commands expect.
        Raises ``ProviderNotFound``."""
        return ProviderInventories.of(await self._provider_state(provider))

    async def provider(self, provider: str | _uuid.UUID) -> ProviderView:
        """A provider's ``.uuid``, ``.name``, ``.generation``, ``.parent`` (None for a root) and
        ``.root``. Raises ``ProviderNotFound``."""
        return ProviderView.of(await self._provider_state(provider))

    async def _provider_state(self, provider: str | _uuid.UUID) -> ProviderState:
        uuid = normalize_uuid(provider, "provider uuid", "provider")
        prov: ProviderState | None = await self._backend.query("provider", uuid)
        if prov is None:
            raise err.ProviderNotFound(f"No resource provider with uuid {uuid} found", provider=uuid)
        return prov

    async def allocations(self, consumer: str | _uuid.UUID) -> ConsumerView:
        """A consumer's allocations ``{provider: {class: amount}}`` (empty for an unknown or absent
        consumer), with ``.generation``, ``.project_id``, ``.user_id``, ``.consumer_type``,
        ``.on_behalf_of`` (a migration's instance), ``.deleted`` (tombstoned) and ``.leaked``
        (what it holds is the audit's leak: allocations while deleted, or as the migration of a
        deleted instance - only a log imported from an older writer holds one)."""
        uuid = normalize_uuid(consumer, "consumer uuid", "consumer")
        c: ConsumerState | None = await self._backend.query("consumer", uuid)
        state = State()
        if c is not None and c.allocations and not c.deleted and c.on_behalf_of is not None:
            instance: ConsumerState | None = await self._backend.query("consumer", c.on_behalf_of)
            if instance is not None and instance.deleted:
                # Read again, after the tombstone (permanent): the migration as it is with its
                # instance deleted - this evstore's delete released it in the same commit, which
                # the first read may have come just before.
                c = await self._backend.query("consumer", uuid)
                state.consumers[instance.uuid] = instance
        if c is not None:
            state.consumers[uuid] = c
        return ConsumerView.in_state(uuid, state)

    async def provider_allocations(self, provider: str | _uuid.UUID) -> dict[str, dict[str, int]]:
        """``{consumer: {class: amount}}`` of every consumer holding resources of the provider
        (Placement's GET /resource_providers/{uuid}/allocations). Raises ``ProviderNotFound``."""
        uuid = normalize_uuid(provider, "provider uuid", "provider")
        found: dict[str, dict[str, int]] | None = await self._backend.query("provider_allocations", uuid)
        if found is None:
            raise err.ProviderNotFound(f"No resource provider with uuid {uuid} found", provider=uuid)
        for consumer, resources in found.items():
            # (as a consumer's rows are checked when a command or allocations() loads them: an
            # amount evstore never writes is a damaged row, not a holding to sum)
            for rc, amount in resources.items():
                check_held_amount(consumer, uuid, rc, amount)
        return sorted_holdings(found)

    async def usages(
        self, project_id: str, user_id: str | None = None, consumer_type: str | None = None
    ) -> ProjectUsages:
        """Totals per class of a project's (and user's) consumers, and per consumer type with a
        consumer count. ``consumer_type``: one type, or Placement's ``"all"`` (every consumer,
        grouped as "all") or ``"unknown"`` (consumers recorded without a type)."""
        validate_name(project_id, "project_id")
        if user_id is not None:
            validate_name(user_id, "user_id")
        if consumer_type in RESERVED_CONSUMER_TYPES:
            groups = await self._backend.query("project_usages", project_id, user_id, None)
            return reserved_type_usages(groups, consumer_type)
        if consumer_type is not None:
            validate_consumer_type(consumer_type, query=True)
        groups = await self._backend.query("project_usages", project_id, user_id, consumer_type)
        return ProjectUsages.from_groups(groups)

    async def providers(self) -> list[tuple[str, str]]:
        """``(uuid, name)`` of every provider, by name."""
        result: list[tuple[str, str]] = await self._backend.query("providers")
        return [(u, n) for u, n in result]

    async def head(self) -> int:
        """The position of the last recorded event (0 for an empty log)."""
        return await self._backend.head()

    async def read(self, after: int = 0, limit: int = 1000) -> list[RecordedEvent]:
        """Recorded events after ``after``, in order (at most ``limit``); none when ``after`` is the
        head.

        An ``after`` beyond the head of the log (a checkpoint from another store, from before a
        restore, or lost with a PostgreSQL server's crash under ``synchronous_commit=off``) is
        refused (``InvalidInput``, the head in ``details["head"]``), as ``subscribe`` refuses it: a
        poller answered "nothing new" would wait until the log reached it, then skip what was
        appended meanwhile. A hole in the positions (rows deleted from the log by hand) is a
        ``CorruptEvent`` naming the first missing position, as a damaged row is: never skipped in
        silence."""
        after, limit = _position(after, "after"), _count(limit, "limit")
        if after:
            # The event at ``after`` read too: it is there unless ``after`` is beyond the head (or
            # a hole), which one read finds, where reading the head as well doubled the cost of a
            # poll that finds nothing new (another hop to SQLite's reader, two more round trips
            # on PostgreSQL). The head, read after the log, can only have grown since: an
            # ``after`` the log had reached is never refused.
            try:
                rows = await self._backend.read(after - 1, min(limit, MAX_POSITION - 1) + 1)
            except err.CorruptEvent as exc:
                if exc.details.get("position") != after:
                    raise
                rows = None  # (the event at ``after`` is damaged: its reader is past it)
            if rows:
                return _contiguous(after, rows[1 : limit + 1] if rows[0].position == after else rows[:limit])
            if rows is not None and after > (head := await self._backend.head()):
                raise _beyond_head(after, head, "after", cursor=True)
        return _contiguous(after, await self._backend.read(after, limit))

    def history(
        self, uuid: str | _uuid.UUID, *, batch_size: int = 1000
    ) -> AsyncGenerator[RecordedEvent, None]:
        """Every recorded event touching the consumer or provider ``uuid``, oldest first.

        A migration consumer's history also lists each tombstone of its instance that left it
        holding allocations (only an older, Placement-style writer's delete does: this one's
        releases the migration's and names it), although that event does not name it: the event
        that made its allocations the audit's leak, as the leak and ``diff`` cite it.

        The arguments are checked at the call (``InvalidInput``), not at the first iteration."""
        key = normalize_uuid(uuid)
        _count(batch_size, "batch_size")
        return self._history(key, batch_size)

    async def _history(self, key: str, batch_size: int) -> AsyncGenerator[RecordedEvent, None]:
        entities = [f"consumer:{key}", f"provider:{key}"]
        holding = _HoldingFor(key, self._backend, batch_size)
        after = 0
        while True:
            try:
                batch = await self._backend.read_entities(entities, after, batch_size)
            except err.CorruptEvent as exc:
                # As subscribe: the entity's events before the damaged row first (what a person
                # debugging it wants to see), then the error.
                damaged = exc.details.get("position")
                if not isinstance(damaged, int) or damaged <= after + 1:
                    raise
                for recorded in await self._backend.read_entities(entities, after, batch_size, damaged - 1):
                    for tombstone in await holding.tombstones(recorded.position - 1):
                        yield tombstone
                    yield recorded
                    holding.fold(recorded)
                for tombstone in await holding.tombstones(damaged - 1):
                    yield tombstone
                raise
            for recorded in batch:
                for tombstone in await holding.tombstones(recorded.position - 1):
                    yield tombstone
                yield recorded
                holding.fold(recorded)
            if len(batch) < batch_size:
                for tombstone in await holding.tombstones(None):
                    yield tombstone
                return
            after = batch[-1].position

    def subscribe(self, after: int = 0, *, batch_size: int = 500) -> AsyncGenerator[RecordedEvent, None]:
        """Every recorded event after ``after``: catch up, then follow new appends live.

        Wakes on this process's commits at once; other processes' commits are seen within about
        ``poll_interval``, by one task per store that polls the head of the log while any subscriber
        waits (idle subscribers read nothing themselves, however many there are). Subscribers at
        the same position (and ``batch_size``) share one read of the log (a commit wakes them
        all), so they are handed the same event objects: treat events as read-only. The
        arguments are checked at the call (``InvalidInput``); an ``after`` beyond the head of the
        log (a checkpoint from another store, or from before a restore) is refused at the first
        iteration, as ``state_at`` refuses it: followed, it would skip the events appended until
        the log reached it.

        A read that fails for a reason that may pass (PostgreSQL's connection lost, refused, reset
        or timed out, the server shutting down, starting up or full, its host name not resolved,
        its Unix socket gone - a server restart, a failover: ``details["transient"]``) is tried
        again, with pauses growing to 5 s (each logged as a warning, with its attempt), for up to
        30 s of consecutive failures; one that goes on longer, and any other failure, ends the
        subscriber with its error: an answer of the server (a permission, a missing table, a
        failed login, a statement_timeout; a database that does not exist is ``NotFound``), a
        connect refused for good (``PermissionError`` on its socket, a certificate not trusted),
        a damaged row, a closed store - and every SQLite error (the file is local: a lock is
        already waited for ``busy_timeout``, and a file deleted, replaced or unreadable does not
        come back by itself; a subscriber waiting on a store whose file was deleted, moved or
        replaced, to which no commit can come any more, ends with ``file_replaced``). Subscribe
        again then with ``after=`` the last position delivered: nothing is skipped or repeated.
        """
        _position(after, "after")
        _count(batch_size, "batch_size")
        return self._subscribe(after, batch_size)

    async def _subscribe(self, after: int, batch_size: int) -> AsyncGenerator[RecordedEvent, None]:
        if self._closing:  # (closed before the first iteration: not "while it followed")
            raise err.StoreClosed("The store is closed (use it inside `async with open_store(...)`)")
        outage: _Outage | None = None  # (while reads fail for a reason that may pass)
        # The event at ``after`` is read with those after it, as read() reads it: gone, the log
        # went back under this cursor (a caller's from another store or from before a restore; or,
        # while it follows, an older backup restored in place, or PostgreSQL's last commits lost
        # in a crash under synchronous_commit=off), and new events written at the positions it
        # delivered would be skipped once the head passed it again; another event there, they
        # were: refused either way. ``delivered``: the id of the event at ``after`` it delivered.
        delivered: str | None = None
        checked = not after  # (a caller's after beyond the head is refused: read the head first, retried too)
        while True:
            if self._closing:
                raise err.StoreClosed("The store was closed while this subscriber followed it")
            try:
                if not checked:
                    if after > (head := await self._backend.head()):
                        raise _beyond_head(after, head, "after", cursor=True)
                    checked = True
                if after:
                    try:
                        read, wakes = await self._read_for_subscriber(
                            after - 1, min(batch_size, MAX_POSITION - 1) + 1
                        )
                    except err.CorruptEvent as exc:
                        if exc.details.get("position") != after:
                            raise
                        # (the event at ``after`` damaged since: this subscriber is past it)
                        read, wakes = await self._read_for_subscriber(after, batch_size)
                    else:
                        read = await self._cursor_holds(after, delivered, read)
                else:
                    read, wakes = await self._read_for_subscriber(after, batch_size)
                batch = _contiguous(after, read)
            except err.CorruptEvent as exc:
                # Deliver what comes before the damaged row first (a debugging tool must show the
                # events leading up to it), then raise.
                damaged = exc.details.get("position")
                if not isinstance(damaged, int) or damaged <= after + 1:
                    raise
                batch, _ = await self._read_for_subscriber(after, damaged - after - 1)
                for recorded in batch:
                    yield recorded
                raise
            except err.StorageError as exc:
                # (a server restart must not end every service following the log: read again once
                # it may be back - woken sooner by the poller finding the head beyond ``after``)
                outage = outage or _Outage()
                pause = outage.pause_after(exc)
                if pause is None:
                    raise
                log.warning(
                    "subscribe.read_retry",
                    error=exc.message,
                    after=after,
                    attempt=outage.attempts,
                    retry_in=pause,
                )
                await self._until_appended(after, self._wakes, pause)
                continue
            outage = None
            for recorded in batch:
                if self._closing:  # (closed while the caller had the batch's earlier events: no more)
                    raise err.StoreClosed("The store was closed while this subscriber followed it")
                yield recorded
                after, delivered = recorded.position, recorded.event_id
            if len(batch) < batch_size:
                await self._until_appended(after, wakes)

    async def _cursor_holds(
        self, after: int, delivered: str | None, read: list[RecordedEvent]
    ) -> list[RecordedEvent]:
        """The events after ``after`` in ``read`` (a read from ``after - 1``), once the event at
        ``after`` is found there - the one a subscriber delivered (``delivered``, its id; None for
        a cursor the caller gave). Refused (``InvalidInput``, the head in ``details["head"]``) when
        the log no longer reaches ``after``, or holds another event there. (A hole at ``after``,
        rows deleted by hand, leaves the rows as read: what follows is checked as read() checks it.)"""
        if read and read[0].position == after:
            if delivered is not None and read[0].event_id != delivered:
                head = await self._backend.head()
                raise err.InvalidInput(
                    f"position {after}, where this subscriber had got to, now holds another event than the "
                    f"one it delivered (the log went back under it - an older backup restored, or a "
                    f"PostgreSQL server's last commits lost in a crash under synchronous_commit=off - and "
                    f"was written again): the events it delivered up to {after} are not all in the log any "
                    f"more, and the new ones at those positions were not delivered; subscribe again from "
                    f"a position both agree on (the head is {head})",
                    field="after",
                    head=head,
                    reason="cursor_rewritten",
                )
            return read[1:]
        if not read and after > (head := await self._backend.head()):
            raise _beyond_head(after, head, "after", cursor=True)
        return read

    async def _read_for_subscriber(self, after: int, limit: int) -> tuple[list[RecordedEvent], int]:
        """The events after ``after`` (at most ``limit``) for a subscriber, and :attr:`_wakes` as
        the read began (what the subscriber waits from when the batch was short). Subscribers at
        the same position share one read: a commit wakes them all at once, and K of them reading
        it each cost K reads, decodes and (PostgreSQL) pool connections per commit. The read runs
        as a task of its own, so a subscriber cancelled while others wait for it does not cancel
        it (it is cancelled once none waits); a read that fails raises a copy of its error in each
        (as :meth:`_fail_idle`), and one cancelled from outside (a shutdown cancelling tasks) is
        begun again by those still waiting. The subscribers share the same event objects: events
        are read-only (README)."""
        self._check_loop()  # (a subscriber resumed on another loop: its shared read is not there)
        while True:
            key = (after, limit)
            shared = self._reads.get(key)
            if shared is None:
                if self._closing:  # (a read begun now would outlive close(), which ends them)
                    raise err.StoreClosed("The store was closed while this subscriber followed it")
                # (in a context of its own, as the poller: not the first subscriber's)
                task = asyncio.get_running_loop().create_task(
                    self._backend.read(after, limit),
                    name="evstore-subscribers-read",
                    context=contextvars.Context(),
                )
                shared = self._reads[key] = _SharedRead(task, self._wakes)
                task.add_done_callback(functools.partial(self._read_ended, key, shared))
            shared.waiters += 1
            try:
                await asyncio.wait([shared.task])
            finally:
                shared.waiters -= 1
                if not shared.waiters and not shared.task.done():
                    # (the last subscriber waiting for it was cancelled: as its own read would be,
                    # and, as one awaiting its own read did, it ends once the read has - a
                    # PostgreSQL read ends after the server answers the cancellation, on the pool)
                    shared.task.cancel()
                    self._read_ended(key, shared)
                    await asyncio.wait([shared.task])
            if shared.task.cancelled():
                if self._closing:
                    raise err.StoreClosed("The store was closed while this subscriber followed it")
                continue
            failed = shared.task.exception()
            if failed is not None:
                raise _own_copy(failed)
            return shared.task.result(), shared.wakes

    def _read_ended(self, key: tuple[int, int], shared: _SharedRead, *_: object) -> None:
        """Take a read that ended (or is being cancelled) off :attr:`_reads`: a subscriber that
        comes later reads anew (what it shares is a read in flight, never an older result)."""
        if self._reads.get(key) is shared:
            del self._reads[key]
        if shared.task.done() and not shared.task.cancelled():
            shared.task.exception()  # (retrieved: each waiter raised its own copy)

    async def _until_appended(self, after: int, wakes: int, at_most: float | None = None) -> None:
        """Wait, as a subscriber that has delivered up to ``after``, until the log may hold more:
        a commit of this process, the poller finding the head beyond ``after``, or the store
        closing (or ``at_most`` seconds, when given). ``wakes``: :attr:`_wakes` before the
        subscriber's last read (a wake-up since then may be for what that read missed: no wait).
        Raises what the poller's read of the head raised, when it failed while this waited.
        ``WrongEventLoop`` when the subscriber was resumed on a loop other than the store's: a
        wait there would be for ever (no commit of the store wakes a future of that loop, and a
        poller started there cannot read)."""
        self._check_loop()
        if self._wakes != wakes or self._closing:
            return
        # (a plain await of a future: wait_for on Python 3.11 swallowed a cancellation that
        # arrived as the wake-up fired, and the subscriber followed forever)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle[waiter] = after
        if self._poller is None:
            # (in a context of its own: not the first waiting subscriber's, whose bound request
            # id would be on the poller's log lines)
            self._poller_nap = asyncio.get_running_loop().create_future()
            self._poller = asyncio.get_running_loop().create_task(
                self._poll_for_subscribers(self._poller_nap),
                name="evstore-subscribers-poller",
                context=contextvars.Context(),
            )
            self._poller.add_done_callback(self._poller_ended)
        cancelled = False
        try:
            if at_most is None:
                await waiter
            else:
                # (asyncio.wait, not wait_for: see above; the waiter is not cancelled at the timeout)
                await asyncio.wait([waiter], timeout=at_most)
                if waiter.done():
                    waiter.result()  # (the poller's failure, if it failed)
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            del self._idle[waiter]
            nap = self._poller_nap
            if cancelled and not self._idle and nap is not None and not nap.done():
                # (the last waiting subscriber was cancelled: the poller ends now, not at its next
                # tick up to poll_interval later; not at a wake-up or an outage's pause, after
                # which the subscriber waits again at once)
                nap.set_result(None)
            if waiter.done() and not waiter.cancelled():
                # (this subscriber was cancelled as the poller failed: its copy of the error is
                # retrieved here, not logged as "never retrieved")
                waiter.exception()

    def _wake_subscribers(self) -> None:
        """Wake every subscriber waiting for appends (each reads what is new, or finds the store
        closed)."""
        self._wakes += 1
        for waiter in self._idle:
            if not waiter.done():
                waiter.set_result(None)

    async def _poll_for_subscribers(self, nap: asyncio.Future[None]) -> None:
        """Every ``poll_interval`` while a subscriber waits, read the head of the log (on
        PostgreSQL that also positions what a writer that died left unpositioned, as a read
        does) and wake the subscribers when it is beyond what one of them has delivered: other
        processes' appends, which no commit of this store announces. One read per interval
        however many subscribers wait (each polling on its own cost 2,500 reads a second for
        500 of them). Ends when none waits at a tick, or the store closes. A read of the head
        that failed for a reason that may pass (see ``_OUTAGE_RETRY_FOR``) is tried again after
        a pause (``poll_interval`` at least), the subscribers waiting on; a failure that goes on
        longer, or any other, is raised in every waiting subscriber, as its own read would have
        raised it, and ends this task (the next subscriber to wait starts another). ``nap``: what
        its pauses wait for, which the last waiting subscriber's cancellation ends."""
        outage: _Outage | None = None
        pause = self._poll_interval
        # (optional: the error that says no append can reach the store any more - SQLite's file
        # deleted or replaced - rather than subscribers waiting for ever)
        check_followable = getattr(self._impl, "check_followable", None)
        while True:
            # (a pause that the last waiting subscriber's cancellation ends: see _until_appended;
            # one that came during a read ends the next pause at once)
            self._poller_nap = nap
            await asyncio.wait([nap], timeout=pause)
            if self._closing or not self._idle:
                return
            if nap.done():
                # (where the subscribers find it at once: the last one cancelled during the read
                # below ends the next pause; the ended one left there, it ended nothing, and the
                # poller paused a full poll_interval with nobody waiting)
                nap = self._poller_nap = asyncio.get_running_loop().create_future()
            try:
                if check_followable is not None:
                    await check_followable()
                head = await self._impl.head()
            except Exception as exc:
                outage = outage or _Outage()
                retry = outage.pause_after(exc)
                if retry is None:
                    self._fail_idle(exc, outage.attempts)
                    return
                pause = max(self._poll_interval, retry)
                log.warning(
                    "subscribe.poll_retry",
                    error=str(exc),
                    attempt=outage.attempts,
                    retry_in=pause,
                    subscribers=len(self._idle),
                )
                continue
            if outage is not None:
                log.info("subscribe.poll_recovered", attempts=outage.attempts)
                outage, pause = None, self._poll_interval
            # (a head below a subscriber's cursor too: the log went back under it, which its read
            # refuses, rather than wait until new events pass it and skip those written up to it)
            if any(after != head for after in self._idle.values()):
                self._wake_subscribers()

    def _poller_ended(self, poller: asyncio.Task[None]) -> None:
        if self._poller is poller:
            self._poller = None
        if self._idle and not self._closing:
            # (cancelled - a shutdown cancelling tasks, even before it first ran - or failed: who
            # still waits must not wait for a poller that is gone; it reads, the next wait starts one)
            self._wake_subscribers()

    def _fail_idle(self, exc: Exception, retried: int = 0) -> None:
        """Raise the poller's failure in each waiting subscriber (a copy each: an exception raised
        in several tasks would gather every task's traceback); ``retried``: the transient failures
        before it."""
        log.warning("subscribe.poll_failed", error=repr(exc), retried=retried, subscribers=len(self._idle))
        for waiter in self._idle:
            if not waiter.done():
                waiter.set_exception(_own_copy(exc))

    async def audit(self, *, history: bool = False) -> AuditReport:
        """Replay the log, check its integrity and compare with the persisted projection.

        ``history=True`` also checks the history index (what ``history`` and the entity slices
        of ``state_at`` read) against the log: a second pass over it, about as long as
        ``rebuild(full=True)``'s; a damaged index is an ``integrity`` finding."""
        if not isinstance(history, bool):
            raise err.InvalidInput(
                f"history must be True or False, got {shown(history, 40)}", field="history"
            )
        check = getattr(self._backend, "check_history", None) if history else None
        return await _audit.audit(
            self._backend.read_raw,
            self._backend.load_state,
            last_positions=getattr(self._backend, "last_positions", None),
            check_history=None if check is None else functools.partial(check, 5000),
            lost_tail=self._backend.lost_tail,
        )

    async def rebuild(
        self,
        batch_size: int = 5000,
        progress: Callable[[int, int], None] | None = None,
        *,
        full: bool = False,
        force: bool = False,
    ) -> Rebuilt:
        """Refold the persisted projection from the log and make it equal the fold; returns the
        events folded, a :class:`Rebuilt` (an ``int``) whose ``snapshots_dropped`` says how many
        time-travel snapshots it dropped.

        Refused (``CorruptEvent``, reason ``log_truncated``) when the projection records changes
        by events the log no longer holds - the audit's ``log_truncated`` finding: the log lost
        its last events, and a rebuild would forget them for good (a tombstone among them).
        ``force=True`` rebuilds anyway, accepting the loss.

        On SQLite only the rows that differ are written (a sound projection: none) and missing or
        altered projection indexes are recreated; ``full=True`` rewrites every row and rebuilds
        every index regardless (for storage-level damage, e.g. an index that lost entries), on
        both backends writing the history index (what ``history`` and the entity slices of
        ``state_at`` read) again from the log.
        Snapshots are dropped too, in the rebuild's own transaction (they are re-made on demand by the
        current fold: one an older evstore folded otherwise is forgotten with the projection).

        ``progress(events_folded, head)`` is called on the event loop's thread, last with both at
        the head; an exception it raises ends the rebuild, the projection left as it was."""
        for name, flag in (("full", full), ("force", force)):
            if not isinstance(flag, bool):
                raise err.InvalidInput(f"{name} must be True or False, got {shown(flag, 40)}", field=name)
        _check_progress(progress, "progress(events_folded, head)")
        if not force and (lost := await self._backend.lost_tail()) is not None:
            raise err.CorruptEvent(lost.message(), **lost.details())
        try:
            folded = await self._backend.rebuild(_batch(batch_size), progress, full=full)
        except OverflowError:
            # (only a log no command wrote holds such numbers: an import refuses them)
            raise err.CorruptEvent(
                "The log holds a number too large to store in the projection (an amount or a "
                "generation beyond 64 bits): the projection was left as it was; `evstore audit` "
                "names the event",
                reason="invalid_value",
            ) from None
        # (the backend dropped the snapshots in the rebuild's own transaction, and counted them)
        return Rebuilt(folded, folded.snapshots_dropped)

    async def replay(self, to_position: int | None = None, *, at: datetime | None = None) -> State:
        """The state folded from the log from its first event, up to ``to_position`` or to the
        last event recorded at or before ``at`` (a timezone-aware time); all of it by default.
        (``state_at`` answers the same question from the nearest snapshot.)"""
        if at is not None:
            if to_position is not None:
                raise err.InvalidInput("replay takes at most one of to_position or at=", field="at")
            to_position = await self._position_at(_aware_time(at))
        if to_position is not None:
            _position(to_position, "to_position", time_in="at=")
            head = await self._backend.head()
            if to_position > head:  # (as state_at and diff: a position the log has not reached)
                raise _beyond_head(to_position, head, "at" if at is not None else "to_position")
        return await replay(gapless(self._backend.read_payloads), to_position)

    async def state_at(
        self,
        position: int | None = None,
        at: datetime | None = None,
        *,
        provider: str | _uuid.UUID | None = None,
        consumer: str | _uuid.UUID | None = None,
    ) -> StateView:
        """The state as it was at a position or a time (exactly one of them).

        By default the whole state (from the nearest snapshot). With ``provider=`` or
        ``consumer=``, only the slice that answers for that one entity, folded from its own
        history (and, for a provider, its latest slice snapshot): far faster on a long log.
        """
        if provider is not None and consumer is not None:
            raise err.InvalidInput("state_at takes at most one of provider= or consumer=", field="consumer")
        if (position is None) == (at is None):
            raise err.InvalidInput(
                "state_at needs exactly one of position= or at=", field="position" if at is None else "at"
            )
        if at is not None:
            position = await self._position_at(_aware_time(at))
        given = "position" if at is None else "at"
        position = _position(position, time_in="at=")
        head = await self._backend.head()
        if position > head:  # (as diff and the CLI: a position the log has not reached yet)
            raise _beyond_head(position, head, given)
        if provider is not None or consumer is not None:
            from projections import snapshots

            kind, uuid = ("provider", provider) if provider is not None else ("consumer", consumer)
            entity = f"{kind}:{normalize_uuid(uuid, f'{kind} uuid', kind)}"
            state = await snapshots.fold_entity_to(
                self._backend, self._backend.read_entities, entity, position
            )
            if kind == "consumer":  # (whether what it holds is a leak: see there)
                await _fold_instance_tombstone(self._backend, state, entity.partition(":")[2], position)
            return StateView(state, scope=entity)
        return StateView(await self._fold_to(position))

    async def stats(self) -> dict[str, Any]:
        """Counts for operators, what ``evstore stats --json`` prints (without its ``url``), with
        the same keys on every backend: ``backend`` (its ``name`` and what only it has:
        PostgreSQL's ``unpositioned``, events committed but not yet given a position, and
        ``pool_size``), ``head``, ``events_by_type``, ``db_bytes`` and ``snapshot_positions``."""
        raw = dict(await self._backend.stats())
        common = ("head", "events_by_type", "db_bytes")
        return {
            "backend": {
                "name": "sqlite" if self.url.startswith("sqlite:") else "postgresql",
                **{k: v for k, v in raw.items() if k not in common},
            },
            "head": raw.get("head", 0),
            "events_by_type": dict(sorted(raw.get("events_by_type", {}).items())),
            "db_bytes": raw.get("db_bytes"),
            "snapshot_positions": await self.snapshot_positions(),
        }

    # --- snapshots, diff, export and import (time travel and debugging) ---------------------

    async def _fold_to(self, position: int) -> State:
        """The state at ``position``, from the nearest snapshot when the backend keeps them."""
        from projections import snapshots

        if snapshots.supports_snapshots(self._backend):
            backend: Any = self._backend
            return await snapshots.fold_to(backend, position, self.snapshot_every)
        return await replay(gapless(self._backend.read_payloads), position)

    async def take_snapshots(self, progress: Callable[[int], None] | None = None) -> list[int]:
        """Fold the log to its head, saving a snapshot every ``snapshot_every`` events; their positions."""
        from projections import snapshots

        _check_progress(progress, "progress(position)")
        if not snapshots.supports_snapshots(self._backend):
            raise err.InvalidInput("this backend does not keep snapshots")
        backend: Any = self._backend
        return await snapshots.take_snapshots(backend, self.head, self.snapshot_every, progress)

    async def snapshot_positions(self) -> list[int]:
        """Positions of the whole-state time-travel snapshots kept (none on a backend without them)."""
        from projections import snapshots

        if not snapshots.supports_snapshots(self._backend):
            return []
        positions: list[int] = await self._backend.snapshot_positions()  # type: ignore[attr-defined]
        return positions

    async def position_of(self, point: int | datetime) -> int:
        """A position given as itself or as a timezone-aware time: the last event at or before it
        (0 before the first event, the head after the last). A position beyond the head of the
        log is refused (``InvalidInput``, the head in ``details["head"]``), as ``state_at`` and
        ``diff`` refuse it."""
        point = _point(point, "point", "point")  # (naive: no tzinfo, or one that gives no offset)
        if isinstance(point, datetime):
            return await self._position_at(point)
        if point > (head := await self._backend.head()):
            raise _beyond_head(point, head, "point")
        return point

    async def _position_at(self, at: datetime) -> int:
        """The position of the last event recorded at or before the timezone-aware ``at`` (0 when
        none is)."""
        try:
            at.astimezone(UTC)
        except OverflowError:  # within hours of datetime.min or .max: not a time UTC can say
            return 0 if at.year == 1 else await self._backend.head()
        return await self._backend.position_at(at)

    async def diff(self, a: int | datetime, b: int | datetime) -> Diff:
        """What changed between ``a`` and ``b`` (positions or times): usage deltas per provider and
        class, consumers created, changed, released, deleted, ``transient`` (touched in between and
        holding nothing at either end) or ``leaked`` (holding at ``b`` what the audit calls a leak:
        allocations while deleted, or as a migration for a deleted instance, what only an imported
        log holds), and the events responsible. ``a`` after ``b`` is refused (``InvalidInput``):
        two times as two positions, whether or not events lie between them."""
        from projections.diff import diff_states

        a, b = _point(a, "diff's a (from)", "a"), _point(b, "diff's b (to)", "b")
        # (two times backwards are refused as two positions are, also when no event lies between
        # them: the log must not decide whether the same mistake is one)
        if isinstance(a, datetime) and isinstance(b, datetime) and _instant(a) > _instant(b):
            raise err.InvalidInput(
                f"diff needs a <= b, got times {a.isoformat()} and {b.isoformat()}: give the earlier first",
                field="b",
            )
        if isinstance(a, int) and isinstance(b, int) and a > b:
            raise err.InvalidInput(f"diff needs a <= b, got positions {a} and {b}", field="b")
        start = a if isinstance(a, int) else await self._position_at(a)
        end = b if isinstance(b, int) else await self._position_at(b)
        head = await self._backend.head()  # (after the times: a position a time gave is at most it)
        for bound, field in ((start, "a"), (end, "b")):
            if bound > head:
                raise _beyond_head(bound, head, field)
        if start > end:  # (a time and a position: the log says which comes first)
            raise err.InvalidInput(f"diff needs a <= b, got positions {start} and {end}", field="b")
        return await diff_states(await self._fold_to(start), gapless(self._backend.read_raw), end)

    def export(self, batch_size: int = 1000) -> AsyncGenerator[str, None]:
        """The log as JSON lines: a header, then every row verbatim (see projections/exchange.py),
        each line without its newline (``f.write(line + "\\n")``; ``import_events`` takes them
        either way). The argument is checked at the call."""
        _count(batch_size, "batch_size")
        return self._export(batch_size)

    async def _export(self, batch_size: int) -> AsyncGenerator[str, None]:
        from projections.exchange import ExportHeader, row_line

        head = await self.head()
        last = await self._backend.read_raw(head - 1, 1) if head else []
        yield ExportHeader(head, head, last[0].hash if last else GENESIS_HASH).to_line()
        after = 0
        prev_hash = GENESIS_HASH
        while after < head:
            # (a hole stops an export as it stops a read: the file would claim a log that an
            # import refuses, and a backup taken so would hide the damage)
            batch = _contiguous(after, await self._backend.read_raw(after, min(batch_size, head - after)))
            if not batch:
                # (the header promised ``head`` events: a file that ends short of it would read as a
                # whole backup, which an import refuses only for its count)
                from projections.replay import ended_short

                raise ended_short(after, head, "export")
            for raw in batch:
                line = row_line(raw)
                # (a row altered by hand likewise: the hash chain covers every field of every row)
                _check_chained(raw, prev_hash)
                prev_hash = raw.hash
                yield line
            after = batch[-1].position

    async def import_events(
        self,
        open_lines: Callable[[], Iterable[str]],
        batch_size: int = 1000,
        progress: Callable[[str, int], None] | None = None,
    ) -> int:
        """Load an export into this (empty) store, reproducing positions, ids, hashes and times.

        ``open_lines`` is called twice: the whole file is validated first (chain, positions,
        payloads, header counts, and that every event folds) and nothing is written unless all
        of that is sound; then the rows and the projection folded from them are written in one
        transaction, so no command (of this process or another) is decided against a
        half-imported store, and a failed or killed import leaves the store empty. An event id
        the file repeats is found as the rows are written (by the database: no set of every id
        is kept) and refused in that transaction, which rolls back; ``open_lines`` is then
        called a third time, to name the line. Memory is bounded by the state folded (providers,
        consumers, tombstones), not by the number of events.
        ``progress(phase, events)`` reports both passes ("validate", "import"), on the event
        loop's thread; an exception it raises ends the import, nothing kept, and reaches the caller.
        What ``open_lines`` answers is closed (when it has ``close()``: a file, a generator reading
        one) once the import has ended, imported or refused.
        """
        batch_size = _batch(batch_size)
        _check_progress(progress, "progress(phase, events)")
        if not callable(open_lines):
            raise err.InvalidInput(
                "open_lines must be a callable returning the export's lines, such as `lambda: open(path)` "
                "(it is called twice, and a third time to name a repeated event id)",
                field="open_lines",
            )
        importer: Any = self._backend
        if not callable(getattr(importer, "import_all", None)):
            raise err.InvalidInput("this backend cannot import a log")
        if await self.head() != 0:
            raise err.InvalidInput(
                "import needs an empty store: this one already has events", reason="not_empty"
            )

        answered: list[object] = []  # (what open_lines answered: closed when the import ends)

        def lines() -> Iterable[str]:
            opened = open_lines()
            answered.append(opened)
            if not isinstance(opened, Iterable) or isinstance(opened, str | bytes):
                got = "bytes" if isinstance(opened, bytes) else _an(type(opened).__name__)
                raise err.InvalidInput(
                    f"open_lines() must return the lines (a file, a list...), got {got}"
                    + _not_lines_hint(opened),
                    field="open_lines",
                )
            return opened

        try:
            return await self._import_passes(importer, lines, batch_size, progress)
        finally:
            _close_answered(answered)

    async def _import_passes(
        self,
        importer: Any,
        lines: Callable[[], Iterable[str]],
        batch_size: int,
        progress: Callable[[str, int], None] | None,
    ) -> int:
        """:meth:`import_events`' passes over the file (``lines()`` opens it): validate, import,
        and, for an event id the file repeats, find its line."""
        from projections.exchange import ChainCheck, duplicate_id, read_export, second_row_of

        def drain(rows: Iterator[Any]) -> int:
            return sum(1 for _ in zip(range(batch_size), rows, strict=False))

        validated = ChainCheck()
        rows = read_export(lines(), validated)
        done = 0
        while counted := await asyncio.to_thread(drain, rows):
            done += counted
            if progress is not None:
                progress("validate", done)
        ends_at = validated.prev_hash
        del validated, rows  # (its fold: not kept through the import)
        # (the import pass checks the rows again without folding: they must be the same rows)
        again = read_export(lines(), ChainCheck(fold=False, ends_at=ends_at))
        report = None if progress is None else functools.partial(progress, "import")
        try:
            imported: int = await importer.import_all(again, batch_size, report)
            # (its commit appended the whole log: the store's subscribers learn of it now, as of
            # a command's - not at their next poll, which is for other processes' appends)
            self._wake_subscribers()
        except err.CorruptEvent as exc:
            if exc.details.get("reason") != "duplicate_id" or "line" in exc.details:
                raise
            event_id = str(exc.details["event_id"])
            try:  # (the backend sees rows, not lines: read the file again for the line)
                found = await asyncio.to_thread(second_row_of, lines(), event_id)
            except Exception:  # (no line to name: the refusal stands without it)
                raise exc from None
            if found is None:
                raise
            line, position = found
            raise duplicate_id(event_id, position, line) from None
        return imported


def _an(name: str) -> str:
    """``name`` after its indefinite article: "an int", "a coroutine"."""
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _not_lines_hint(opened: object) -> str:
    """What to give ``import_events`` instead of ``opened``, which is no iterable of lines."""
    if inspect.isawaitable(opened) or hasattr(opened, "__aiter__"):
        return (
            ": the lines are read synchronously (twice, on a thread), so give a plain function answering "
            "a file or a list, not an async one - e.g. lambda: open(path)"
        )
    if isinstance(opened, bytes):
        return ": that is bytes, not lines of text - answer data.decode().splitlines(), or open(path)"
    if isinstance(opened, str):
        return ": that is one text, not its lines - answer text.splitlines(), or open(path)"
    return ""


def _close_answered(answered: list[object]) -> None:
    """Close what ``import_events``' ``open_lines`` answered, once the import has ended: files it
    opened (``lambda: open(path)``, the form the import's own "called twice" error recommends)
    were left to the garbage collector, each a ``ResourceWarning: unclosed file``, and a
    generator reading one held it open after a refusal. Each object once; never the process's
    standard streams (not the import's to close, if a caller handed one over: ``sys.stdin``, or
    another file object on descriptor 0, 1 or 2, such as ``open(0)``). A close that fails is
    logged, not raised: the import's outcome - its events committed, or its refusal - stands."""
    for n, opened in enumerate(answered):
        if any(opened is other for other in (*answered[:n], sys.stdin, sys.__stdin__)):
            continue
        close = getattr(opened, "close", None)
        if not callable(close) or _on_a_standard_stream(opened):
            continue
        try:
            close()
        except ValueError as exc:
            # (a generator still running on the worker thread a cancelled pass left it on -
            # "generator already executing" - is left to the garbage collector)
            log.debug("import.close_skipped", error=repr(exc)[:200])
        except Exception as exc:
            log.warning("import.close_failed", what=type(opened).__name__, error=repr(exc)[:200])


def _on_a_standard_stream(opened: object) -> bool:
    fileno = getattr(opened, "fileno", None)
    if not callable(fileno):
        return False
    try:
        return fileno() in (0, 1, 2)
    except (OSError, ValueError):  # (io.UnsupportedOperation is both; a closed file: ValueError)
        return False


#: the module of each URL scheme's backend
_BACKEND_MODULES = {
    "sqlite": "evstore.log.sqlite",
    "postgresql": "evstore.log.postgres",
    "postgres": "evstore.log.postgres",
}


def make_backend(url: str, **options: Any) -> Backend:
    if not isinstance(url, str):
        raise err.InvalidInput("url must be a string such as sqlite:///evstore.db", field="url")
    postgres = url.startswith(("postgresql://", "postgres://"))
    if "\x00" in url or (postgres and "%00" in url):
        # (neither a file name nor a PostgreSQL connection can hold one, %-encoded in a libpq URL:
        # SQLite raised a bare ValueError from os.stat, PostgreSQL a storage error - the server
        # refused the startup packet - for what is the caller's input)
        raise err.InvalidInput(f"The store URL {err.redact_url(url)!r} contains a NUL character")
    if url.startswith("sqlite:"):
        from evstore.log.sqlite import SqliteBackend

        return SqliteBackend(url, **options)
    if postgres:
        try:
            from evstore.log.postgres import PostgresBackend  # type: ignore[import-not-found,unused-ignore]
        except ImportError as exc:
            if exc.name != "asyncpg" and not str(exc.name or "").startswith("asyncpg."):
                # (not a missing asyncpg: saying so would send the reader the wrong way)
                raise err.InvalidInput(
                    f"The PostgreSQL backend cannot be imported ({exc}): the evstore installation is "
                    "broken or mixes two versions; reinstall it"
                ) from None
            raise err.InvalidInput(
                f"The PostgreSQL backend needs asyncpg ({exc}): pip install asyncpg (or, from an evstore "
                "checkout, pip install '.[postgres]')"
            ) from None
        return PostgresBackend(url, **options)  # type: ignore[no-any-return,unused-ignore]
    shown = err.redact_url(url)
    raise err.InvalidInput(f"Unsupported store URL {shown!r}: use sqlite:///path.db or postgresql://...")


_NOT_SYNC = (
    "open_store(url) is an async context manager: use `async with open_store(url) as store:` (the "
    "store is closed when the block ends), or `store = await open_store(url)` and `await store.close()`"
)


async def _write_loop(ref: weakref.ref[AllocationStore], wake: asyncio.Event) -> None:
    """The store's writer task: runs the queued commands, then waits for more holding only a weak
    reference to the store, so that a store its program dropped unclosed is collected (its
    ``__del__`` warns and lets go of its connections) instead of living as long as its loop."""
    while (store := ref()) is not None:
        try:
            stopped = await store._write_queued()
        except BaseException as exc:
            # Cancelled (e.g. a shutdown that cancels every task): what is still queued will never
            # run, and its callers must hear so rather than wait forever. The task keeps the
            # exception, whose frames (this one's, the store's methods') hold the store: a cycle
            # through ``store._writer`` that only the cyclic GC frees, so a store left open at
            # exit warned or not, at random (1 in 15 runs did not). Its frames let go of it.
            store._fail_queued(err.StoreClosed("The store was closed before this command ran"))
            traceback.clear_frames(exc.__traceback__)
            del store
            raise
        if stopped:  # (closed)
            store._fail_queued(err.StoreClosed("The store was closed before this command ran"))
            return
        del store
        wake.clear()  # (the queue was found empty just now, with no await since: no wake-up lost)
        try:
            await wake.wait()
        except BaseException:
            if (store := ref()) is not None:
                store._fail_queued(err.StoreClosed("The store was closed before this command ran"))
            del store
            raise


class StoreOptions(TypedDict, total=False):
    """The keywords of ``open_store`` (every one optional; see the README for each). A service that
    reads them from its configuration can annotate that mapping with this type. The store's own:
    ``max_batch``, ``poll_interval``, ``snapshot_every``; SQLite's: ``synchronous``,
    ``busy_timeout``, ``create``, ``upgrade``; PostgreSQL's: ``pool_size``, ``min_pool_size``,
    ``connect_timeout``, ``command_timeout``, ``max_retries``, ``statement_cache_size``,
    ``create``, ``upgrade``. A backend refuses another backend's option (``InvalidInput``), as it refuses any
    unknown one."""

    #: commands per group commit (256)
    max_batch: int
    #: seconds between a subscriber's polls for other processes' appends (0.2; 0.001 to 3600)
    poll_interval: float
    #: events between time-travel snapshots (10,000; 1 to 2**63-1)
    snapshot_every: int
    #: False: refuse a file or schema that holds no store instead of creating one (True)
    create: bool
    #: False: refuse a store an older evstore wrote instead of upgrading it (True)
    upgrade: bool
    #: SQLite: OFF, NORMAL, FULL (the default) or EXTRA
    synchronous: str
    #: SQLite: seconds a transaction waits for another connection's write lock (30)
    busy_timeout: float
    #: PostgreSQL: connections in the pool (10)
    pool_size: int
    #: PostgreSQL: connections the pool keeps open (1)
    min_pool_size: int
    #: PostgreSQL: seconds to connect, and to wait for another open's migration (10; 0.001 to 86400)
    connect_timeout: float
    #: PostgreSQL: seconds a statement may take (None: no limit, the default; else 0.001 to 86400)
    command_timeout: float | None
    #: PostgreSQL: retries of a deadlock or serialization failure (10)
    max_retries: int
    #: PostgreSQL: prepared statements cached per connection (100; 0 behind pgbouncer)
    statement_cache_size: int


class StoreOpener(contextlib.AbstractAsyncContextManager[AllocationStore]):
    """What ``open_store`` answers: ``async with`` it (the store is closed at the block's end), or
    await it for an open store the caller closes (as ``aiosqlite.connect`` and asyncpg's pools
    allow). A plain ``with`` is a typed error that says so."""

    __slots__ = ("_entered", "_options", "_store", "_url")

    def __init__(self, url: str, options: StoreOptions) -> None:
        self._url = url
        self._options: dict[str, Any] = dict(options)
        self._store: AllocationStore | None = None
        #: an ``async with`` of this opener has begun and not ended (its store may still be opening)
        self._entered = False

    async def _open(self) -> AllocationStore:
        options = dict(self._options)
        given = "snapshot_every" in options  # (None too: refused below, as every other option's)
        snapshot_every = options.pop("snapshot_every", None)
        store_options = {k: options.pop(k) for k in ("max_batch", "poll_interval") if k in options}
        module = _BACKEND_MODULES.get(str(self._url).split(":", 1)[0])
        if module is not None and module not in sys.modules:
            # (imported on a thread: the first open of a process ran the backend's module code,
            # and the projections' it imports, on the event loop - ~26 ms. Failures are left to
            # make_backend, which says what is missing)
            with contextlib.suppress(ImportError):
                await asyncio.to_thread(importlib.import_module, module)
        store = AllocationStore(make_backend(self._url, **options), **store_options)
        if given:
            # (a snapshot is taken at each position that is a multiple of it: one beyond the
            # largest position the log holds, 2**63-1, would mean "never")
            store.snapshot_every = snapshot_every
        return await store.open()

    async def __aenter__(self) -> AllocationStore:
        # (a second store would be lost: only one __aexit__ to close it. Noted before the open's
        # first await: another task entering while this one opens was let in, and the first block
        # to end closed the other's store under it, its own never closed)
        if self._entered:
            raise err.InvalidInput(
                "this open_store(...) is in use by an `async with` that has not ended: call open_store "
                "again for another store",
                field="open_store",
            )
        self._entered = True
        try:
            self._store = await self._open()
        except BaseException:
            self._entered = False
            raise
        return self._store

    async def __aexit__(self, *exc: object) -> None:
        store, self._store = self._store, None
        self._entered = False
        if store is not None:
            await store.close()

    def __await__(self) -> Generator[Any, None, AllocationStore]:
        return self._open().__await__()

    def __enter__(self) -> AllocationStore:
        raise err.InvalidInput(_NOT_SYNC, field="open_store")

    def __exit__(self, *exc: object) -> None:  # (never entered: __enter__ raises)
        return None


def open_store(url: str, **options: Unpack[StoreOptions]) -> StoreOpener:
    """Open a store: ``async with open_store("sqlite:///evstore.db") as store: ...`` (closed at the
    block's end), or ``store = await open_store(url)`` (the caller then awaits ``store.close()``).

    ``url``: ``sqlite:///relative.db``, ``sqlite:////absolute.db``, ``sqlite://`` (in memory) or
    ``postgresql://user@host/db``. Options of every store (keywords only): ``max_batch`` (commands
    per group commit, 256), ``poll_interval`` (seconds between a subscriber's polls for other
    processes' appends, 0.2; 0.001 to 3600), ``snapshot_every`` (events between time-travel snapshots, 10,000;
    at most 2**63-1). The backend's own (keywords, or ``?k=v`` in the URL): SQLite ``synchronous``
    (FULL by default; NORMAL trades the last commits on power loss for speed), ``busy_timeout``
    (seconds, 30), ``create`` (false: refuse a file holding no store), ``upgrade`` (false: refuse
    a store an older evstore wrote rather than upgrade it, or one that lost schema objects rather
    than repair it: nothing written); PostgreSQL ``pool_size``,
    ``min_pool_size``, ``connect_timeout``, ``command_timeout``, ``max_retries``,
    ``statement_cache_size``, ``create``, ``upgrade`` (see the README); their types are :class:`StoreOptions`.
    Unknown options are refused (``InvalidInput``). The store belongs to the running event loop.
    """
    return StoreOpener(url, options)
