"""The events: immutable, past-tense facts, and the envelope they are recorded in.

Every event type is a pydantic model in the discriminated union :data:`Event`. Each carries a
``schema_version``; rows written by an older version are brought up to date on read by the
upcasters registered in :data:`UPCASTERS`, so old logs stay readable forever.
Payloads carry everything needed to fold state, so replay never reads anything else.
"""

from __future__ import annotations

import functools
import gc
import hashlib
import json
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple, cast

import msgspec
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from pydantic_core import SchemaValidator, core_schema

from evstore.errors import CorruptEvent, InvalidInput, SchemaVersionError, shown
from evstore.schema import (
    CANONICAL_UUID,
    MAX_INT,
    RC_PATTERN,
    Inventory,
    pydantic_message,
    pydantic_where,
    refuse_assignment,
)

Allocs = dict[str, dict[str, int]]

_SORTED_JSON = msgspec.json.Encoder(order="sorted").encode


def sorted_json(value: object) -> str | None:
    """``value`` as ``json.dumps(value, separators=(",", ":"), sort_keys=True)`` writes it, in a
    third of the time (msgspec), or None where the two texts may differ: the caller then asks
    json. For values of ``str`` (keys too), ``int``, ``bool``, ``None``, lists and dicts only: no
    float (msgspec writes NaN as ``null``, and some floats otherwise). msgspec writes DEL and
    non-ASCII characters as they are where json escapes them, so a text holding one is None too
    (looked for in the text, not in the value: ~0.1 us)."""
    try:
        text = _SORTED_JSON(value)
    except (TypeError, ValueError, OverflowError):  # (a str or int subclass, an int out of range)
        return None
    # (``find``, not ``in``: ``bytes.__contains__`` first tries its argument as an int, and raises)
    return text.decode() if text.isascii() and text.find(b"\x7f") == -1 else None


class EventBase(BaseModel):
    """Common behaviour of all events. Fields read like attributes or like a mapping."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    SCHEMA_VERSION: ClassVar[int] = 1

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    @property
    def schema_version(self) -> int:
        return self.SCHEMA_VERSION

    @property
    def event_type(self) -> str:
        """The discriminator (``"AllocationsReplaced"``...), typed for callers of the base class."""
        return str(self.__dict__["type"])

    #: fields added to this type after such events were first written: left out of the stored
    #: payload when None, so that events without them are stored as they always were
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ()

    def _not_stored(self) -> set[str]:
        if not self.OMITTED_WHEN_NONE:
            return _TYPE
        return {"type", *(f for f in self.OMITTED_WHEN_NONE if self.__dict__[f] is None)}

    def payload(self) -> dict[str, Any]:
        """The stored JSON payload (without ``type``, nor the ``OMITTED_WHEN_NONE`` fields that are None)."""
        return self.model_dump(mode="json", exclude=self._not_stored())

    def payload_json(self) -> str:
        """:meth:`payload` as stored: compact JSON, encoded by pydantic-core (4x json.dumps)."""
        return self.model_dump_json(exclude=self._not_stored())

    def entities(self) -> set[str]:
        """``consumer:<uuid>`` / ``provider:<uuid>`` keys this event touches (the history index)."""
        raise NotImplementedError


#: what every payload leaves out: the type (the row's own column)
_TYPE: set[str] = {"type"}


def _providers_of(allocs: Allocs) -> set[str]:
    return {f"provider:{p}" for p in allocs}


def _held_for(instance: str | None) -> set[str]:
    return set() if instance is None else {f"consumer:{instance}"}


_ON_BEHALF_OF_DOC = (
    "the instance this consumer held its allocations for when the event happened (it was a "
    "migration consumer), so that the instance's history shows it; None otherwise, and in events "
    "written before evstore recorded it"
)


class ResourceClassCreated(EventBase):
    type: Literal["ResourceClassCreated"] = "ResourceClassCreated"
    name: str

    def entities(self) -> set[str]:
        return {f"resource_class:{self.name}"}


class ProviderCreated(EventBase):
    type: Literal["ProviderCreated"] = "ProviderCreated"
    provider: str
    name: str
    parent: str | None = None
    root: str

    def entities(self) -> set[str]:
        keys = {f"provider:{self.provider}"}
        if self.parent:
            keys.add(f"provider:{self.parent}")
        return keys


class ProviderUpdated(EventBase):
    type: Literal["ProviderUpdated"] = "ProviderUpdated"
    provider: str
    name: str

    def entities(self) -> set[str]:
        return {f"provider:{self.provider}"}


class ProviderDeleted(EventBase):
    type: Literal["ProviderDeleted"] = "ProviderDeleted"
    provider: str
    #: the provider's parent when it was deleted, so that the parent's history shows it (as it
    #: shows the child's creation); None for a root, and in events written before evstore recorded it
    parent: str | None = None
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("parent",)

    def entities(self) -> set[str]:
        keys = {f"provider:{self.provider}"}
        if self.parent:
            keys.add(f"provider:{self.parent}")
        return keys


class InventoriesReplaced(EventBase):
    """The whole inventory of a provider after the change, and its new generation."""

    type: Literal["InventoriesReplaced"] = "InventoriesReplaced"
    provider: str
    inventories: dict[str, Inventory]
    generation: int

    def entities(self) -> set[str]:
        return {f"provider:{self.provider}"}


class AllocationsReplaced(EventBase):
    """One consumer's allocations replaced (Placement's PUT/POST /allocations), replace semantics.

    ``generation`` is the consumer's generation after the write, ``None`` when the write left it
    with nothing (it is absent again). ``provider_generations`` are the new generations of the
    providers this event bumps (in a multi-consumer command, the first event naming a provider
    carries its bump). ``previous`` is what the consumer held before, for history and diff.
    """

    SCHEMA_VERSION: ClassVar[int] = 2
    type: Literal["AllocationsReplaced"] = "AllocationsReplaced"
    consumer: str
    allocations: Allocs
    previous: Allocs = Field(default_factory=dict)
    project_id: str
    user_id: str
    consumer_type: str
    generation: int | None
    provider_generations: dict[str, int] = Field(default_factory=dict)
    on_behalf_of: str | None = Field(default=None, description=_ON_BEHALF_OF_DOC)
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("on_behalf_of",)

    def entities(self) -> set[str]:
        return (
            {f"consumer:{self.consumer}"}
            | _providers_of(self.allocations)
            | _providers_of(self.previous)
            | _held_for(self.on_behalf_of)
        )


class AllocationsReleased(EventBase):
    """A consumer's allocations removed without a generation check (Placement's DELETE)."""

    type: Literal["AllocationsReleased"] = "AllocationsReleased"
    consumer: str
    released: Allocs
    on_behalf_of: str | None = Field(default=None, description=_ON_BEHALF_OF_DOC)
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("on_behalf_of",)

    def entities(self) -> set[str]:
        return {f"consumer:{self.consumer}"} | _providers_of(self.released) | _held_for(self.on_behalf_of)


class MigrationStarted(EventBase):
    """All of ``instance``'s allocations moved to ``migration``, held on the instance's behalf."""

    type: Literal["MigrationStarted"] = "MigrationStarted"
    instance: str
    migration: str
    allocations: Allocs
    project_id: str
    user_id: str
    instance_consumer_type: str
    instance_generation: int
    migration_consumer_type: str = "MIGRATION"
    migration_generation: int = 1
    provider_generations: dict[str, int] = Field(default_factory=dict)

    def entities(self) -> set[str]:
        return {f"consumer:{self.instance}", f"consumer:{self.migration}"} | _providers_of(self.allocations)


class MigrationReverted(EventBase):
    """The migration's allocations given back to its instance (replacing what the instance held)."""

    type: Literal["MigrationReverted"] = "MigrationReverted"
    migration: str
    instance: str
    allocations: Allocs
    replaced: Allocs = Field(default_factory=dict)
    project_id: str
    user_id: str
    instance_consumer_type: str
    instance_generation: int
    provider_generations: dict[str, int] = Field(default_factory=dict)

    def entities(self) -> set[str]:
        return (
            {f"consumer:{self.instance}", f"consumer:{self.migration}"}
            | _providers_of(self.allocations)
            | _providers_of(self.replaced)
        )


class MigrationConfirmed(EventBase):
    """The migration's (source) allocations released; the instance keeps what it holds."""

    type: Literal["MigrationConfirmed"] = "MigrationConfirmed"
    migration: str
    instance: str
    released: Allocs

    def entities(self) -> set[str]:
        return {f"consumer:{self.instance}", f"consumer:{self.migration}"} | _providers_of(self.released)


class ConsumerDeleted(EventBase):
    """The tombstone. Releases the consumer's allocations and those of migrations holding for it."""

    type: Literal["ConsumerDeleted"] = "ConsumerDeleted"
    consumer: str
    released: Allocs = Field(default_factory=dict)
    migrations_released: dict[str, Allocs] = Field(default_factory=dict)
    on_behalf_of: str | None = Field(default=None, description=_ON_BEHALF_OF_DOC)
    OMITTED_WHEN_NONE: ClassVar[tuple[str, ...]] = ("on_behalf_of",)

    def entities(self) -> set[str]:
        keys = {f"consumer:{self.consumer}"} | _providers_of(self.released) | _held_for(self.on_behalf_of)
        for migration, allocs in self.migrations_released.items():
            keys.add(f"consumer:{migration}")
            keys |= _providers_of(allocs)
        return keys


def _allocated(fields: Mapping[str, Any]) -> set[str]:
    return set(fields["allocations"])


#: Event type -> the providers where such an event may raise usage or lower capacity, read from its
#: fields as a mapping (a model's ``__dict__`` or a validated payload dict): what the audit watches
#: for over-capacity. Types that only release or rename are absent (they never add pressure).
CAPACITY_PRESSURE: dict[str, Callable[[Mapping[str, Any]], set[str]]] = {
    "InventoriesReplaced": lambda fields: {fields["provider"]},
    "AllocationsReplaced": _allocated,
    "MigrationStarted": _allocated,
    "MigrationReverted": _allocated,
}


Event = Annotated[
    ResourceClassCreated
    | ProviderCreated
    | ProviderUpdated
    | ProviderDeleted
    | InventoriesReplaced
    | AllocationsReplaced
    | AllocationsReleased
    | MigrationStarted
    | MigrationReverted
    | MigrationConfirmed
    | ConsumerDeleted,
    Field(discriminator="type"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

EVENT_TYPES: dict[str, type[EventBase]] = {
    cls.model_fields["type"].default: cls
    for cls in (
        ResourceClassCreated,
        ProviderCreated,
        ProviderUpdated,
        ProviderDeleted,
        InventoriesReplaced,
        AllocationsReplaced,
        AllocationsReleased,
        MigrationStarted,
        MigrationReverted,
        MigrationConfirmed,
        ConsumerDeleted,
    )
}

# --- payload validators (replay) -------------------------------------------------------------


def _payload_validator(
    cls: type[BaseModel], extra: Literal["forbid", "allow"] = "forbid"
) -> Callable[[str], dict[str, Any]]:
    """Validate a stored payload of ``cls`` into a plain dict of its fields.

    The same field schemas as the model (derived from it, not written twice: types, defaults,
    ``extra="forbid"``), but the result is the dict a model would keep as its ``__dict__``,
    without building the model: ~20% cheaper per event, and decoding is what replay and rebuild
    spend most of their time on. (Replay and rebuild now fold what :data:`PAYLOAD_DECODERS`
    decodes: ``projections.state.FOLDS`` read attributes, of a struct or of the model.)
    """
    schema = cls.__pydantic_core_schema__
    if schema["type"] != "model" or schema["schema"]["type"] != "model-fields":  # pragma: no cover
        raise TypeError(f"{cls.__name__}: unexpected core schema {schema['type']}")
    fields = {
        name: core_schema.typed_dict_field(field["schema"], required=field["schema"]["type"] != "default")
        for name, field in schema["schema"]["fields"].items()
    }
    config = schema.get("config")
    return SchemaValidator(
        core_schema.typed_dict_schema(fields, extra_behavior=extra, total=True), config
    ).validate_json


def _maps_one_to_one(annotation: Any) -> bool:
    """Whether msgspec decodes JSON into this type exactly as pydantic does, or refuses it.

    The vocabulary of event fields: ``str``, ``int``, literal strings, ``X | None`` and
    ``dict[str, X]``. msgspec is stricter than pydantic's lax mode (``"3"`` or ``3.0`` for an
    int), never laxer; what it refuses goes to pydantic. Anything else (a nested model, a float,
    a constrained field) is left to pydantic alone.
    """
    if annotation is str or annotation is int or annotation is type(None):
        return True
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return all(type(arg) is str for arg in args)
    if origin is types.UnionType or origin is typing.Union:
        return all(_maps_one_to_one(arg) for arg in args)
    if origin is dict:
        return args[0] is str and _maps_one_to_one(args[1])
    return False


def _fast_payload_validator(
    cls: type[BaseModel], also: Mapping[str, Any] | None = None, narrowed: Mapping[str, Any] | None = None
) -> Callable[[str], dict[str, Any]] | None:
    """:func:`_payload_validator` for ``extra="forbid"``, decoded by msgspec (~2x faster), or
    ``None`` when a field of ``cls`` is outside :func:`_maps_one_to_one`: the fields of what
    :func:`_fast_payload_decoder` decodes, as a dict."""
    decode = _fast_payload_decoder(cls, also, narrowed)
    if decode is None:
        return None
    as_dict = msgspec.structs.asdict

    def validate(data: str) -> dict[str, Any]:
        return as_dict(decode(data))

    return validate


def _fast_payload_decoder(
    cls: type[BaseModel], also: Mapping[str, Any] | None = None, narrowed: Mapping[str, Any] | None = None
) -> Callable[[str], Any] | None:
    """A msgspec decoder of a stored payload of ``cls`` into a struct with the model's fields as
    attributes (what the folds read), or ``None`` when a field of ``cls`` is outside
    :func:`_maps_one_to_one`.

    A msgspec struct is derived from the model's fields (types, required or default, unknown
    fields refused), so the schema is still written once. Its errors are ``ValueError``s, as
    pydantic's; callers then fall back to ``decode_event``, which accepts what pydantic's lax
    mode accepts, or names what is wrong. ``also``: optional fields (name -> type, default
    ``None``) the struct accepts beyond the model's own.

    Unknown fields are refused, never skipped: msgspec skips a value without the limits pydantic
    applies to it (nesting depth, digits of a number), so a skipped value could pass here and
    fail for pydantic.

    ``narrowed``: field name -> a msgspec type that accepts a subset of what the field's own
    type accepts (the same values come out), for :data:`CHECKED_PAYLOAD_VALIDATORS`.
    """
    fields: list[tuple[str, Any, Any]] = [(name, kind, None) for name, kind in (also or {}).items()]
    for name, info in cls.model_fields.items():
        if info.metadata or not _maps_one_to_one(info.annotation):
            return None
        if info.is_required():
            default: Any = msgspec.NODEFAULT
        elif info.default_factory is dict:
            default = msgspec.field(default_factory=dict)
        elif info.default_factory is None and type(info.default) in (str, int, type(None)):
            default = info.default
        else:  # pragma: no cover - no event has one
            return None
        fields.append((name, (narrowed or {}).get(name, info.annotation), default))
    struct = msgspec.defstruct(
        f"{cls.__name__}{'Checked' if narrowed else ''}Payload",
        fields,
        kw_only=True,
        forbid_unknown_fields=True,
        gc=False,
    )
    decode_struct = msgspec.json.Decoder(struct).decode

    def decode(data: str) -> Any:
        try:
            return decode_struct(data)
        except TypeError:  # not text at all (pydantic raises a ValueError for it)
            raise ValueError(f"expected JSON text, got {type(data).__name__}") from None

    return decode


#: event type -> (its current schema_version, a validator of such a payload into a dict of fields)
PAYLOAD_VALIDATORS: dict[str, tuple[int, Callable[[str], dict[str, Any]]]] = {
    name: (cls.SCHEMA_VERSION, _fast_payload_validator(cls) or _payload_validator(cls))
    for name, cls in EVENT_TYPES.items()
}

#: event type -> (its current schema_version, a decoder of such a payload into an object with
#: the event's fields as attributes: a msgspec struct or, for a type msgspec cannot decode alike,
#: the event model). What replay and rebuild fold (``projections.state.FOLDS`` read attributes):
#: the struct itself, not the dict :data:`PAYLOAD_VALIDATORS` makes of it (~0.5 us per event).
PAYLOAD_DECODERS: dict[str, tuple[int, Callable[[str], Any]]] = {
    name: (cls.SCHEMA_VERSION, _fast_payload_decoder(cls) or cls.__pydantic_validator__.validate_json)
    for name, cls in EVENT_TYPES.items()
}


def payload_dict(payload: Any) -> dict[str, Any]:
    """The fields of what :data:`PAYLOAD_DECODERS` decodes (or of an event model) as a dict."""
    return payload.__dict__ if isinstance(payload, BaseModel) else msgspec.structs.asdict(payload)


# --- upcasters -------------------------------------------------------------------------------

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]
#: (event type, from schema_version) -> function turning that payload into version + 1.
UPCASTERS: dict[tuple[str, int], Upcaster] = {}


def upcaster(event_type: str, from_version: int) -> Callable[[Upcaster], Upcaster]:
    def register(fn: Upcaster) -> Upcaster:
        UPCASTERS[(event_type, from_version)] = fn
        return fn

    return register


@upcaster("AllocationsReplaced", 1)
def _allocations_replaced_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    # Version 1 was written before consumer types (Placement < 1.38): such consumers are
    # shown by Placement as "unknown"; we record them as the UNKNOWN type.
    data = dict(data)
    data.setdefault("consumer_type", "UNKNOWN")
    data.setdefault("previous", {})
    return data


def upcast(event_type: str, version: int, data: dict[str, Any]) -> dict[str, Any]:
    cls = EVENT_TYPES[event_type]
    while version < cls.SCHEMA_VERSION:
        step = UPCASTERS.get((event_type, version))
        if step is None:
            raise SchemaVersionError(f"No upcaster for {event_type} from schema_version {version}")
        data = step(data)
        version += 1
    return data


def describe_error(exc: Exception, whole: str = "payload", most: int = 5) -> str:
    """One line saying what is wrong: for a validation error, each field and what is wrong with it
    (``instance: Field required; colour: Extra inputs are not permitted``), not its first line
    (``1 validation error for MigrationReverted``, which names neither)."""
    if isinstance(exc, ValidationError):
        errors = exc.errors(include_url=False, include_input=False)
        said = [f"{'.'.join(str(p)[:80] for p in e['loc']) or whole}: {e['msg']}" for e in errors[:most]]
        if len(errors) > most:
            said.append(f"and {len(errors) - most} more")
        return "; ".join(said)
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def decode_event(
    event_type: str, version: int, data: str | dict[str, Any], position: int | None = None
) -> EventBase:
    """Turn a stored row into an event, upcasting old versions. Raises CorruptEvent naming the position."""
    cls = EVENT_TYPES.get(event_type)
    if cls is not None and version == cls.SCHEMA_VERSION and isinstance(data, str):
        # The common case (replay, rebuild, audit): pydantic parses and validates the JSON in one
        # pass, several times faster than json.loads followed by model_validate.
        try:
            # the validator itself: model_validate_json's Python wrapper costs ~15% of a decode
            event: EventBase = cls.__pydantic_validator__.validate_json(data)
            return event
        except ValueError:
            pass  # fall through for the error message
    where = f" at position {position}" if position is not None else ""
    if cls is None:
        raise CorruptEvent(
            f"Unknown event type {shown(event_type, 80)}{where}{_NEWER_OR_DAMAGED}",
            position=position,
            reason="unknown_type",
        )
    if type(version) is not int:
        raise CorruptEvent(
            f"{event_type}{where} has schema_version {shown(version, 40)}, not an integer{_DAMAGED}",
            position=position,
            reason="undecodable",
        )
    if version < 1:
        # (no evstore, older or newer, writes one: not a version to upgrade to)
        raise CorruptEvent(
            f"{event_type}{where} has schema_version {shown(version, 40)}; evstore's versions "
            f"start at 1{_DAMAGED}",
            position=position,
            reason="unknown_schema_version",
        )
    if version > cls.SCHEMA_VERSION:
        raise CorruptEvent(
            f"{event_type}{where} has schema_version {shown(version, 40)}; "
            f"this evstore reads up to {cls.SCHEMA_VERSION}{_NEWER_OR_DAMAGED}",
            position=position,
            reason="unknown_schema_version",
        )
    try:
        payload = json.loads(data) if isinstance(data, str) else data
        if not isinstance(payload, dict):
            raise ValueError("payload is not a JSON object")
        payload = upcast(event_type, version, payload)
        return cls.model_validate(payload)
    except (ValueError, ValidationError, SchemaVersionError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else describe_error(exc)
        raise CorruptEvent(
            f"Cannot decode {event_type}{where}: {why}".splitlines()[0] + _DAMAGED,
            position=position,
            reason="undecodable",
        ) from None


#: what to do about a row no evstore writes, said after what is wrong with it
_DAMAGED = (
    " (the row was changed by hand or damaged: `evstore audit` lists every such row; restore the "
    "store from a backup, or import an export taken before the damage)"
)
#: ... and about one a newer evstore may have written
_NEWER_OR_DAMAGED = (
    " (written by a newer evstore? read the store with that version; if not, the row was changed "
    "by hand or damaged: `evstore audit` lists every such row; restore the store from a backup)"
)


def without_advice(message: str) -> str:
    """A decoding error's message without what to do about it (the audit, which lists such rows,
    says what is wrong with each)."""
    return message.removesuffix(_DAMAGED).removesuffix(_NEWER_OR_DAMAGED)


# --- values no command writes (import refuses them, the audit reports them) -------------------

#: the largest generation evstore writes (``schema.validate_generation``'s bound); the smallest is
#: 0, not 1: evstore's own start at 1, but Placement gives the consumers it creates for allocations
#: written without one generation 0, and their logs come here by import
MAX_GENERATION = 2**62


class ValueCheck:
    """Whether a decoded event's values are ones evstore's commands could have written.

    Decoding checks types only (an int is an int); a log that did not come from ``decide`` (an
    import, a row altered in place) can still hold amounts of 0 or below, or beyond the 32-bit
    limit, negative generations, ids that are not canonical uuids (no query can name them: the
    API normalises to lower case), class names off the pattern, or empty project and user ids.
    Folding such events gives states no command can reach (a negative amount hides usage and
    lets the provider be over-committed). Import refuses them (:meth:`problem`); the audit
    reports them, checking every event of the log: numbers and lengths in the decoder
    (:data:`CHECKED_PAYLOAD_VALIDATORS`), ids and class names with :attr:`sound`, against the
    ones seen valid before (a log names the same ones again and again), and consumer ids at the
    end (``projections.audit.consumer_id_findings``).
    """

    __slots__ = ("_classes", "_ids", "refused", "sound")

    #: past this many remembered ids, start again (memory stays bounded)
    LIMIT = 100_000

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._classes: set[str] = set()
        #: ids found not to be uuids (each reported once)
        self.refused: set[str] = set()
        #: event type -> whether the provider ids and class names of such an event are sound,
        #: read as attributes of the decoded payload (a struct of :data:`PAYLOAD_DECODERS`, or the
        #: model: no dict made of it) - fast, for a caller that checks numbers otherwise; consumer
        #: ids are not looked at, see _sound_check; when not, :meth:`problem` says what is wrong
        self.sound: dict[str, Callable[[Any], bool]] = {
            name: make(self._ids, self._classes, self) for name, make in _SOUND.items()
        }

    def problem(self, event_type: str, fields: Mapping[str, Any]) -> str | None:
        """What is wrong with the first bad value of the event (``None``: nothing)."""
        for name, kind in _VALUE_PLAN[event_type]:
            value = fields[name]
            if kind == "id":
                if value is not None and value not in self._ids and not self._id(value):
                    return f"{name} {shown(value, 80)} is not a uuid in canonical form"
            elif kind == "allocs":
                if value:
                    bad = self._allocations(value)
                    if bad is not None:
                        return f"{name}: {bad}"
            elif kind == "generation":
                if value is not None and not 0 <= value <= MAX_GENERATION:
                    return f"{name} {value} is not between 0 and {MAX_GENERATION}"
            elif kind == "class":
                if value not in self._classes and not self._class(value):
                    return f"{name} {shown(value, 80)} does not match ^[A-Z0-9_]+$"
            elif kind == "owner":
                if not 1 <= len(value) <= 255:
                    return f"{name} {shown(value, 80)} is not 1..255 characters"
            elif kind == "bumps":
                for provider, generation in value.items():
                    if provider not in self._ids and not self._id(provider):
                        return f"{name} names {shown(provider, 80)}, not a uuid in canonical form"
                    if not 0 <= generation <= MAX_GENERATION:
                        return f"generation {generation} of provider {provider} is out of 0..{MAX_GENERATION}"
            elif kind == "inventories":
                for rc in value:
                    if rc not in self._classes and not self._class(rc):
                        return f"inventory class {shown(rc, 80)} does not match ^[A-Z0-9_]+$"
            elif kind == "per_migration":
                for migration, allocs in value.items():
                    if migration not in self._ids and not self._id(migration):
                        return f"{name} names {shown(migration, 80)}, not a uuid in canonical form"
                    bad = self._allocations(allocs)
                    if bad is not None:
                        return f"{name} of {migration}: {bad}"
            elif kind == "custom_class":
                if not (value.startswith("CUSTOM_") and self._class(value)):
                    return f"resource class {shown(value, 80)} is not a custom class (CUSTOM_[A-Z0-9_]+)"
            elif kind == "provider_name":
                if not 1 <= len(value) <= 200:
                    return f"provider name {shown(value, 80)} is not 1..200 characters"
        return None

    def _ids_sound(self, values: Iterable[str]) -> bool:
        return all(self._id(v) for v in values)

    def _classes_sound(self, values: Iterable[str]) -> bool:
        return all(self._class(v) for v in values)

    def consumer_id_problem(self, uuid: object) -> str | None:
        """What is wrong with a consumer id not refused before (``None``: nothing, or refused)."""
        if uuid in self.refused or self._id(uuid):
            return None
        return f"consumer id {shown(uuid, 80)} is not a uuid in canonical form"

    def _id(self, value: object) -> bool:
        if type(value) is not str or not CANONICAL_UUID.match(value):
            if type(value) is str and len(self.refused) < self.LIMIT:
                self.refused.add(value)
            return False
        if len(self._ids) >= self.LIMIT:
            self._ids.clear()
        self._ids.add(value)
        return True

    def _class(self, value: object) -> bool:
        if type(value) is not str or len(value) > 255:
            return False
        # (evstore before 6da287b matched ^[A-Z0-9_]+$ with re.match, which takes a final newline:
        # its logs may hold such names, and old events stay readable - and importable - forever)
        if not RC_PATTERN.fullmatch(value[:-1] if value.endswith("\n") else value):
            return False
        if len(self._classes) < self.LIMIT:
            self._classes.add(value)
        return True

    def _allocations(self, allocs: Mapping[str, Mapping[str, int]]) -> str | None:
        ids, classes = self._ids, self._classes
        for provider, resources in allocs.items():
            if provider not in ids and not self._id(provider):
                return f"provider {shown(provider, 80)} is not a uuid in canonical form"
            if not resources:
                return f"provider {provider} with no resource class"
            for rc, amount in resources.items():
                if not 0 < amount <= MAX_INT:
                    return f"{amount} of {rc} on provider {provider} is not between 1 and {MAX_INT}"
                if rc not in classes and not self._class(rc):
                    return f"class {shown(rc, 80)} on provider {provider} does not match ^[A-Z0-9_]+$"
        return None


#: how each field of an event is checked, by its name (``ValueCheck``); other fields are not
_VALUE_KINDS = {
    "consumer": "id",
    "provider": "id",
    "instance": "id",
    "migration": "id",
    "on_behalf_of": "id",
    "parent": "id",
    "root": "id",
    "allocations": "allocs",
    "previous": "allocs",
    "released": "allocs",
    "replaced": "allocs",
    "migrations_released": "per_migration",
    "generation": "generation",
    "instance_generation": "generation",
    "migration_generation": "generation",
    "provider_generations": "bumps",
    "project_id": "owner",
    "user_id": "owner",
    "consumer_type": "class",
    "instance_consumer_type": "class",
    "migration_consumer_type": "class",
    "inventories": "inventories",
}
_VALUE_PLAN: dict[str, tuple[tuple[str, str], ...]] = {
    name: tuple((f, _VALUE_KINDS[f]) for f in cls.model_fields if f in _VALUE_KINDS)
    + ((("name", "custom_class"),) if name == "ResourceClassCreated" else ())
    + ((("name", "provider_name"),) if name in ("ProviderCreated", "ProviderUpdated") else ())
    for name, cls in EVENT_TYPES.items()
}


#: ValueCheck.sound's test of a field ``v`` of each kind (see _sound_check); kinds not here are
#: the checked decoder's (numbers, lengths) or left out (consumer ids)
_SOUND_CODE = {
    "id": ["if v is not None and v not in ids and not check._id(v): return False"],
    "class": ["if v not in classes and not check._class(v): return False"],
    "allocs": [
        "if not ids.issuperset(v) and not check._ids_sound(v): return False",
        "for r in v.values():",
        "    if not classes.issuperset(r) and not check._classes_sound(r): return False",
    ],
    "bumps": ["if not ids.issuperset(v) and not check._ids_sound(v): return False"],
    "inventories": ["if not classes.issuperset(v) and not check._classes_sound(v): return False"],
    # (rare: the whole check says)
    "per_migration": ["if v: return False"],
    "custom_class": ["return False"],
    "provider_name": ["return False"],
}


def _sound_check(plan: tuple[tuple[str, str], ...]) -> Callable[..., Callable[[Any], bool]]:
    """``ValueCheck.sound`` for one event type, written out field by field (the audit runs it for
    every event: a loop dispatching on each field's kind cost twice as much). Consumer ids are
    not checked: nearly every event names a new one (a regex each, the cost of decoding the
    event); the audit checks the ids of the consumers the fold keeps, once, at the end (one that
    is forgotten again holds nothing)."""
    lines = ["def make(ids, classes, check):", "  def sound(f):"]
    for name, kind in plan:
        if kind in _SOUND_CODE and not (kind == "id" and name in ("consumer", "instance", "migration")):
            lines.append(f"    v = f.{name}")  # (an attribute: the audit makes no dict of the fields)
            lines.extend(f"    {code}" for code in _SOUND_CODE[kind])
    lines += ["    return True", "  return sound"]
    scope: dict[str, Any] = {}
    exec("\n".join(lines), scope)  # (code written here, from the fixed field plans)
    make: Callable[..., Callable[[Any], bool]] = scope["make"]
    return make


_SOUND: dict[str, Callable[..., Callable[[Any], bool]]] = {
    name: _sound_check(plan) for name, plan in _VALUE_PLAN.items()
}


_AMOUNT = Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
_HELD = dict[str, Annotated[dict[str, _AMOUNT], msgspec.Meta(min_length=1)]]
_GENERATION = Annotated[int, msgspec.Meta(ge=0, le=MAX_GENERATION)]
_NARROWED_KINDS = {
    "allocs": _HELD,
    "per_migration": dict[str, _HELD],
    "bumps": dict[str, _GENERATION],
    "owner": Annotated[str, msgspec.Meta(min_length=1, max_length=255)],
}


def _narrowed(cls: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, info in cls.model_fields.items():
        kind = _VALUE_KINDS.get(name)
        if kind == "generation":
            out[name] = _GENERATION | None if type(None) in typing.get_args(info.annotation) else _GENERATION
        elif kind in _NARROWED_KINDS:
            out[name] = _NARROWED_KINDS[kind]
    return out


#: event type -> a validator as in :data:`PAYLOAD_VALIDATORS` that also refuses the amounts,
#: generations and lengths :class:`ValueCheck` refuses (in msgspec, at no measurable cost);
#: ``ValueCheck.sound`` does the rest. Types without a msgspec validator are not here.
CHECKED_PAYLOAD_VALIDATORS: dict[str, tuple[int, Callable[[str], dict[str, Any]]]] = {
    name: (cls.SCHEMA_VERSION, checked)
    for name, cls in EVENT_TYPES.items()
    if (checked := _fast_payload_validator(cls, narrowed=_narrowed(cls))) is not None
}
#: :data:`CHECKED_PAYLOAD_VALIDATORS`' decoders, as :data:`PAYLOAD_DECODERS` (the struct itself)
CHECKED_PAYLOAD_DECODERS: dict[str, tuple[int, Callable[[str], Any]]] = {
    name: (cls.SCHEMA_VERSION, checked)
    for name, cls in EVENT_TYPES.items()
    if (checked := _fast_payload_decoder(cls, narrowed=_narrowed(cls))) is not None
}


if TYPE_CHECKING:
    from pydantic._internal._model_construction import ModelMetaclass as _ModelMeta
else:
    _ModelMeta = type(BaseModel)


class _RefusesAsInvalidInput(_ModelMeta):
    """``Metadata(...)`` built by a caller refuses a wrong value with InvalidInput, as Inventory and
    ConsumerAllocations do. Here rather than in an ``__init__``: pydantic calls a model's own
    ``__init__`` for every ``model_validate_json`` too, which doubled the decode of every event's
    stored metadata (1.8 -> 3.5 us); the metaclass's ``__call__`` is only the direct call."""

    if not TYPE_CHECKING:  # (a checker keeps the model's own signature and type for Metadata(...))

        def __call__(cls, /, *args: Any, **kwargs: Any) -> Any:
            try:
                built = super().__call__(*args, **kwargs)
            except ValidationError as exc:
                raise InvalidInput(
                    f"Invalid metadata: {pydantic_message(exc)}", **pydantic_where(exc)
                ) from None
            _refuse_what_a_command_would(built)
            return built


def _refuse_what_a_command_would(built: BaseModel) -> None:
    """Refuse the metadata a caller built as every command given it would (``store._metadata_json``,
    as ``command_metadata`` does: the same code, message and details) - a key that is not a
    string at any depth, NaN, a value that is not JSON, more than 64 KiB of JSON, a lone
    surrogate, too deep -, not at the first command, far from where it was made. evstore's own
    keys are not looked at (a command replaces them). Only for a direct call: reads of stored
    metadata (``model_validate_json``) and the command's own check do not come here."""
    own, bound, check = _command_check()
    if not _plainly_sound(built, own, bound):
        mine = {k: v for k, v in built.model_dump(exclude_none=True).items() if k not in own}
        if mine:
            check(mine, True)


def _plainly_sound(built: BaseModel, own: frozenset[str], bound: int) -> bool:
    """Whether ``built`` holds only ASCII strings (and ``None``), too short to reach ``bound``
    bytes of JSON: most metadata (ids, an actor), nothing in which a command refuses, known
    without its check (~4 us per Metadata built). JSON writes an ASCII character as at most 6 (a
    control character's \\u00XX); a key's quotes, colon and comma are the 6 counted with it."""
    size = 0
    for values in (built.__dict__, built.__pydantic_extra__ or {}):
        for k, v in values.items():
            if v is None or k in own:
                continue
            if type(v) is not str or not (k.isascii() and v.isascii()):
                return False
            size += len(k) + len(v) + 6
    return 6 * size < bound  # (the JSON: at most 1 + 6 * size bytes, its braces and commas counted)


@functools.cache
def _command_check() -> tuple[frozenset[str], int, Callable[[dict[str, Any], bool], str]]:
    """evstore's own metadata keys, the most JSON a caller's metadata may take, and a command's
    check of a caller's metadata (imported at the first use, once: evstore.store imports this
    module)."""
    from evstore.store import _METADATA_MAX_BYTES, _OWN_METADATA_KEYS, _metadata_json

    return _OWN_METADATA_KEYS, _METADATA_MAX_BYTES, _metadata_json


class Metadata(BaseModel, metaclass=_RefusesAsInvalidInput):
    """Who asked and why: carried with every event of a command, shown by history."""

    model_config = ConfigDict(extra="allow", frozen=True)

    request_id: str | None = None
    correlation_id: str | None = None
    causation_id: str | None = None
    actor: str | None = None
    command: str | None = None
    command_id: str | None = None

    if TYPE_CHECKING:
        # (for type checkers, as Inventory's: mypy reads a model's fields as its constructor's
        # arguments from the dataclass_transform on pydantic's metaclass, not through a subclass
        # of it, so Metadata(request_id=5) passed mypy --strict; and keys of a caller's own,
        # extra="allow", are any JSON values)
        def __init__(
            self,
            /,
            *,
            request_id: str | None = None,
            correlation_id: str | None = None,
            causation_id: str | None = None,
            actor: str | None = None,
            command: str | None = None,
            command_id: str | None = None,
            **extra: Any,
        ) -> None: ...

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_assignment(self, name)  # (Python's FrozenInstanceError, not pydantic's error)

    def __delattr__(self, name: str) -> None:
        refuse_assignment(self, name)

    @property
    def idempotency_key(self) -> str | None:
        """The command's idempotency key (evstore writes it; ``None`` for a command sent without).

        A property over the extra keys, not a field: what readers accept and what ``model_dump``
        shows of stored metadata stay as they were."""
        value = (self.__pydantic_extra__ or {}).get("idempotency_key")
        return None if value is None else str(value)


#: what every reader checks a stored metadata text against, as a dict
METADATA_VALIDATOR = _payload_validator(Metadata, extra="allow")
#: the metadata evstore itself writes (the model's fields and an idempotency key); a row with any
#: other key (a caller's own) is checked by pydantic alone. (The decoder, not the validator: a
#: check needs no dict of the struct, ~0.3 us per row of the audit.)
_METADATA_FAST_CHECK = _fast_payload_decoder(Metadata, also={"idempotency_key": str | None})


def check_metadata(text: str) -> None:
    """Raise ``ValueError`` unless ``text`` decodes as every reader decodes metadata (the audit
    runs this per row). msgspec first (3x faster than pydantic, and never laxer), pydantic for
    what msgspec refuses."""
    if _METADATA_FAST_CHECK is not None:
        try:
            _METADATA_FAST_CHECK(text)
            return
        except (ValueError, TypeError, RecursionError):
            pass
    METADATA_VALIDATOR(text)


#: a set of field names -> the one set object the models decoded by a read share as their
#: ``__pydantic_fields_set__`` (see :func:`share_fields_set`)
_FIELDS_SETS: dict[frozenset[str], set[str]] = {}
#: distinct sets kept at most (metadata may carry a caller's own keys: their combinations are not bounded)
_FIELDS_SETS_MAX = 4096


def share_fields_set(model: BaseModel) -> None:
    """Give ``model`` the shared set of its field names in place of its own.

    pydantic gives every model a new ``set`` of the fields set (``model_fields_set``), and a set
    is always tracked by the cyclic collector: two of the seven tracked objects of a decoded
    ``RecordedEvent`` (its event's and its metadata's). A read of 50,000 events kept 350,000
    tracked objects alive, and the collection scanning them (on whatever thread allocated next)
    held the GIL - the event loop - for 130-280 ms. The models are frozen: pydantic never adds to
    the set of a frozen model (assignment is refused first; ``model_copy`` copies the set), so
    one set per distinct set of names is shared, as read-only as the model it describes.
    """
    own: set[str] = model.__pydantic_fields_set__
    key = frozenset(own)
    shared = _FIELDS_SETS.get(key)
    if shared is None:
        if len(_FIELDS_SETS) >= _FIELDS_SETS_MAX:
            return
        shared = _FIELDS_SETS.setdefault(key, own)
    object.__setattr__(model, "__pydantic_fields_set__", shared)


def _gc_untracker() -> Callable[[object], None] | None:
    """CPython's ``PyObject_GC_UnTrack`` (its stable C API; ``None`` elsewhere)."""
    if sys.implementation.name != "cpython":  # pragma: no cover
        return None
    try:
        import ctypes

        untrack = ctypes.pythonapi.PyObject_GC_UnTrack
    except (ImportError, AttributeError):  # pragma: no cover
        return None
    untrack.argtypes = (ctypes.py_object,)
    untrack.restype = None
    return cast("Callable[[object], None]", untrack)


_UNTRACK = _gc_untracker()
is_tracked = gc.is_tracked


def _untrack_tree(value: object) -> bool:
    """Untrack ``value`` and what it holds, when it is a dict or a frozen model of this module's
    (a tree of them, down to strings and numbers); whether ``value`` is untracked now. Anything
    else (a list in a caller's metadata) stays tracked, and so do the dicts holding it."""
    if not is_tracked(value):
        return True
    kind = type(value)
    if kind is dict:
        children: Iterable[object] = cast("dict[str, object]", value).values()
    elif kind in _FROZEN_MODELS:
        model = cast(BaseModel, value)
        children = (model.__dict__, model.__pydantic_extra__)
    else:
        return False
    if not all([_untrack_tree(child) for child in children]):
        return False
    assert _UNTRACK is not None
    _UNTRACK(value)
    return True


def untrack_recorded(recorded: RecordedEvent) -> None:
    """Take a decoded event out of the cyclic collector's sight (CPython; nothing elsewhere).

    A page of a read lives on in the caller, and each of its tracked objects (five an event: the
    ``RecordedEvent``, its event, the event's ``__dict__`` and nested dicts, its metadata) was
    scanned, with the GIL held, by every collection that reached it: ``read(0, 50000)`` on a
    165k-event store stalled the event loop 130-280 ms in one collection on SQLite, in full
    collections of 330-350 ms on PostgreSQL, and a subscriber catching up ran 19 full
    collections of up to 85 ms. The objects of a decoded event form a tree (frozen models,
    dicts of strings and numbers, the shared fields sets): they cannot be part of a cycle, and
    reference counting frees them, so the collector has nothing to find in them. (A caller that
    puts the event inside its own payload dicts makes a cycle the collector will not free.)
    Untracking does not stop anything from tracking them again: CPython re-tracks a dict when a
    tracked object is put in it.
    """
    untrack = _UNTRACK
    if untrack is None:  # pragma: no cover
        return
    # (written out for the common shapes: the generic walk cost half as much as the decoding)
    event, metadata = recorded.event, recorded.metadata
    fields = event.__dict__
    if is_tracked(fields):
        for name in _NESTED_FIELDS[event.__class__]:
            value = fields[name]
            if is_tracked(value) and not _untrack_tree(value):
                return
        if any(map(is_tracked, fields.values())):
            return
        untrack(fields)
    if event.__pydantic_extra__ is not None:  # pragma: no cover - events forbid extra fields
        return
    untrack(event)
    if is_tracked(metadata):  # (not when shared with the event before it, see decode_raw)
        if not (_untrack_tree(metadata.__pydantic_extra__) and not is_tracked(metadata.__dict__)):
            return
        untrack(metadata)
    untrack(recorded)


def untrack_rows(rows: Iterable[object]) -> None:
    """Untrack database rows whose values are strings, numbers and None (the caller knows its
    columns): asyncpg's Records are tracked, one an event of a page (CPython; nothing elsewhere)."""
    untrack = _UNTRACK
    if untrack is None:  # pragma: no cover
        return
    for row in rows:
        untrack(row)


@dataclass(frozen=True, slots=True)
class RecordedEvent:
    """An event as stored in the log, with its envelope: position, id, time and metadata."""

    position: int
    event_id: str
    recorded_at: datetime
    metadata: Metadata
    event: EventBase

    @property
    def type(self) -> str:
        return self.event.event_type

    @property
    def schema_version(self) -> int:
        return self.event.schema_version

    @property
    def payload(self) -> EventBase:
        """The typed event; also readable as a mapping (``payload["consumer"]``)."""
        return self.event

    @property
    def data(self) -> dict[str, Any]:
        return self.event.payload()

    def entities(self) -> set[str]:
        return self.event.entities()

    def __hash__(self) -> int:
        # (the generated hash reached the payload's dicts and raised TypeError for most events;
        # equal recorded events have the same position and id)
        return hash((self.position, self.event_id))

    def to_json(self) -> str:
        """The event and its envelope as one JSON text (:meth:`to_dict`'s values), as
        ``Receipt.to_json`` answers text. (It answered the dict until stop 33.)"""
        return json.dumps(self.to_dict(), separators=(",", ":"), ensure_ascii=False)

    def to_dict(self) -> dict[str, Any]:
        """The event and its envelope as plain JSON-ready values: ``position``, ``event_id``,
        ``type``, ``schema_version``, ``recorded_at`` (ISO 8601, UTC), ``metadata`` (without the
        keys not given) and ``data`` (the payload)."""
        return {
            "position": self.position,
            "event_id": self.event_id,
            "type": self.type,
            "schema_version": self.schema_version,
            "recorded_at": self.recorded_at.isoformat(),
            "metadata": self.metadata.model_dump(exclude_none=True),
            "data": self.data,
        }


GENESIS_HASH = "0" * 64


def event_hash(
    prev_hash: str,
    position: int,
    event_id: str,
    event_type: str,
    schema_version: int,
    data: str,
    metadata: str,
    recorded_at: str,
) -> str:
    """The tamper-evident chain: each row's hash covers the previous hash and its own content."""
    h = hashlib.sha256()
    h.update(
        "\x1f".join(
            (prev_hash, str(position), event_id, event_type, str(schema_version), data, metadata, recorded_at)
        ).encode()
    )
    return h.hexdigest()


class RawEvent(NamedTuple):
    """A stored row before decoding (what export, import and the integrity audit see).

    A named tuple: the audit and export read a million of them per million events, and
    building one from a database row (``RawEvent._make(row)``) costs a fifth of a frozen
    dataclass's ``__init__``.
    """

    position: int
    event_id: str
    type: str
    schema_version: int
    data: str
    metadata: str
    recorded_at: str
    hash: str

    def chained_hash(self, prev_hash: str) -> str:
        """What this row's hash must be after ``prev_hash`` (audit and import check it)."""
        return event_hash(
            prev_hash,
            self.position,
            self.event_id,
            self.type,
            self.schema_version,
            self.data,
            self.metadata,
            self.recorded_at,
        )


#: the models a decoded event is made of (``_untrack_tree`` untracks these and dicts, nothing else)
_FROZEN_MODELS: frozenset[type] = frozenset({*EVENT_TYPES.values(), Metadata, Inventory})
#: event type -> its fields that may hold tracked objects (dicts of dicts, models)
_NESTED_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(
        name
        for name, info in cls.model_fields.items()
        if typing.get_origin(info.annotation) is dict
        and typing.get_args(info.annotation)[1] not in (int, str)
    )
    for cls in EVENT_TYPES.values()
}
