"""Value types of the domain and the validation of everything a caller hands in.

Inventory and ConsumerAllocations are pydantic models with Placement's defaults and ranges;
the ``normalize_*`` helpers turn loose caller input (str or UUID, any mapping) into the
canonical form the rest of the code relies on, or raise :class:`InvalidInput`.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import re
import uuid as _uuid
from collections.abc import Mapping, Sequence
from decimal import Decimal
from fractions import Fraction
from typing import TYPE_CHECKING, Any, NoReturn, Self

import os_resource_classes
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from evstore.errors import InvalidInput, InvalidInventoryValue, shown

MAX_INT = 2147483647
#: the largest amount a command takes: Placement's schema takes any integer from 1, and its row checks
#: refuse one above every ``max_unit`` (at most ``MAX_INT``) as a constraint violation, in their
#: order (after the consumer generations, the providers, the classes); past 64 bits it is bad input
MAX_AMOUNT = 2**63 - 1
RC_PATTERN = re.compile(r"[A-Z0-9_]+")  # (used with fullmatch: "$" would let a final newline through)
CUSTOM_PREFIX = "CUSTOM_"
STANDARD_CLASSES: frozenset[str] = frozenset(os_resource_classes.STANDARDS)
#: a standard class's id in Placement (its index in os-resource-classes' list); custom ones come after
_STANDARD_IDS: dict[str, int] = {name: i for i, name in enumerate(os_resource_classes.STANDARDS)}


def placement_class_order(name: str) -> tuple[int, str]:
    """A sort key putting resource classes in Placement's order (by their id: the standard ones as
    os-resource-classes lists them, then the custom ones - Placement's by creation, here by name),
    the order its messages name several in (``Inventory for 'VCPU, DISK_GB' ... in use.``)."""
    return _STANDARD_IDS.get(name, len(_STANDARD_IDS)), name


UuidLike = str | _uuid.UUID


def where(field: str, path: Sequence[str] | None = None) -> dict[str, Any]:
    """The details naming what an :class:`InvalidInput` refuses: ``field``, the argument as the
    caller wrote it, and ``path``, for a problem inside a nested structure, the keys from that
    argument down to it (``["allocations", "<provider uuid>", "VCPU"]``; a uuid key in its
    canonical form, any other key as given). No ``path`` for the argument as a whole."""
    if path is None or len(path) <= 1:
        return {"field": field}
    return {"field": field, "path": list(path)}


def path_key(key: object) -> str:
    """A mapping key as an element of ``details["path"]``: text as given, anything else as its
    str (a ``uuid.UUID``) or repr, cut short."""
    if isinstance(key, str):
        return key
    return str(key) if isinstance(key, _uuid.UUID) else repr(key)[:100]


#: a uuid already in the form normalize_uuid returns (the common case: checked without parsing)
CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")
#: the other spellings accepted (any case): dashed, 32 hex digits, in braces, or as a urn:uuid: URN.
#: (uuid.UUID alone also takes whitespace, signs, underscores, other scripts' digits and dashes
#: anywhere, and turns a truncated uuid into another one.)
_UUID_SPELLINGS = re.compile(
    r"(?:urn:uuid:)?(?:[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
    r"|[0-9a-fA-F]{32}|\{[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\})",
    re.ASCII,
)


def normalize_uuid(
    value: object, what: str = "uuid", field: str | None = None, path: Sequence[str] | None = None
) -> str:
    """Return the lowercase dashed form of a uuid given as ``str`` or ``UUID``. ``what`` names it
    in the message, ``field`` (``what`` by default) and ``path`` in the details (see :func:`where`)."""
    if type(value) is str and CANONICAL_UUID.match(value):
        return value
    if isinstance(value, _uuid.UUID):
        return str(value)
    if isinstance(value, str) and _UUID_SPELLINGS.fullmatch(value):
        return str(_uuid.UUID(value))
    raise InvalidInput(
        f"Malformed {what}: {shown(value, 80)} is not a UUID",
        **where(field or what, path),
        value=repr(value)[:100],
    )


def validate_resource_class_name(
    name: object, field: str = "resource_class", path: Sequence[str] | None = None
) -> str:
    if not isinstance(name, str) or not RC_PATTERN.fullmatch(name) or len(name) > 255:
        raise InvalidInput(
            f"Invalid resource class {shown(name, 80)}: it must match ^[A-Z0-9_]+$ (at most 255 characters)",
            # (as every other refusal has it: the name as given, not its repr in quotes)
            resource_class=name[:100] if isinstance(name, str) else repr(name)[:100],
            **where(field, path),
        )
    return name


_SHOWN_INT_LIMIT = 10**30


def _shown_int(value: int) -> str:
    """An integer for a message: as it is, or, past 64 bits by far, said so (its digits could be
    more than ``str()`` converts: a ``ValueError`` past 4,300 of them)."""
    return str(value) if abs(value) < _SHOWN_INT_LIMIT else "an integer past 64 bits"


def _another_int(value: object) -> bool:
    """Whether ``value``, no ``int``, is an integer of another library (``numpy.int64``): it
    converts to the int it shows itself as. Not a bool (``True`` shows as ``True``; ``int(True)``
    would turn the mistake into an amount of 1), a float or a text."""
    if isinstance(value, bool | float | str):
        return False
    try:
        index = operator.index(value)  # type: ignore[arg-type]
        return str(value) == str(index)
    except Exception:  # (whatever another library's __index__ or __str__ raises: no hint)
        return False


def validate_amount(
    amount: object, resource_class: str, field: str = "amount", path: Sequence[str] | None = None
) -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        # (an integer of another library - numpy.int64, whose repr may be "2" - said to be one:
        # "must be an integer, got 2" read as nonsense)
        kind = type(amount)
        other = (
            f" ({kind.__module__}.{kind.__qualname__}, not int: give int(value))"
            if _another_int(amount)
            else ""
        )
        raise InvalidInput(
            f"Amount of {resource_class} must be an integer, got {shown(amount, 80)}{other}",
            resource_class=resource_class,
            **where(field, path),
        )
    if amount < 1 or amount > MAX_AMOUNT:
        said = _shown_int(amount)
        raise InvalidInput(
            f"Amount of {resource_class} must be between 1 and 2**63-1, got {said}",
            resource_class=resource_class,
            **({"amount": amount} if abs(amount) < _SHOWN_INT_LIMIT else {}),
            **where(field, path),
        )
    return amount


def normalize_allocations(value: object, what: str = "allocations") -> dict[str, dict[str, int]]:
    """``{provider: {class: amount}}`` with canonical uuids, order preserved (it decides errors).
    ``what``: the argument's name (the errors' ``field``, and the first key of their ``path``)."""
    if not isinstance(value, Mapping):
        raise InvalidInput(f"{what} must be a mapping of provider uuid to {{class: amount}}", field=what)
    out: dict[str, dict[str, int]] = {}
    for provider, resources in value.items():
        try:
            puuid = normalize_uuid(provider, "provider uuid", what)
        except InvalidInput as exc:  # (the path built only for an error: every write comes here)
            exc.details.update(where(what, [what, path_key(provider)]))
            raise
        if not isinstance(resources, Mapping):
            raise InvalidInput(
                f"{what} for provider {puuid} must be a mapping of class to amount",
                **where(what, [what, puuid]),
            )
        if not resources:
            raise InvalidInput(
                f"{what} for provider {puuid} names no resource class", **where(what, [what, puuid])
            )
        if isinstance(resources.get("resources"), Mapping):
            raise InvalidInput(
                f"{what} for provider {puuid} are in Placement's shape {{'resources': {{...}}}}; evstore "
                f"takes {{provider: {{class: amount}}}}, e.g. {{'{puuid}': {{'VCPU': 2}}}}",
                **where(what, [what, puuid]),
            )
        if puuid in out:
            raise InvalidInput(
                f"{what} name provider {puuid} twice (spelled {shown(provider, 60)} the second time)",
                **where(what, [what, path_key(provider)]),
            )
        row = out[puuid] = {}
        for rc, amount in resources.items():
            try:
                rc = validate_resource_class_name(rc, what)
                row[rc] = validate_amount(amount, rc, what)
            except InvalidInput as exc:  # (the path built only for an error)
                exc.details.update(where(what, [what, puuid, path_key(rc)]))
                raise
    return out


def validate_name(value: object, what: str, max_len: int = 255, field: str | None = None) -> str:
    """Text of 1..``max_len`` characters; ``what`` names it in the message, ``field`` (``what`` by
    default) in the details."""
    if not isinstance(value, str) or not (1 <= len(value) <= max_len):
        raise InvalidInput(
            f"{what} must be a string of 1..{max_len} characters, got {shown(value, 80)}", field=field or what
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidInput(
            f"{what} must be valid Unicode text (no lone surrogates), got {shown(value, 80)}",
            field=field or what,
        ) from None
    if "\x00" in value:  # (PostgreSQL cannot store it: refused on every backend alike)
        raise InvalidInput(
            f"{what} must not contain NUL characters, got {shown(value, 80)}", field=field or what
        )
    return value


def validate_consumer_type(value: object, query: bool = False) -> str:
    """A consumer type as a command records it; ``query``: as ``usages()`` filters by it, which
    also takes Placement's ``"all"`` and ``"unknown"`` (checked by the caller; named in the error)."""
    if not isinstance(value, str) or not RC_PATTERN.fullmatch(value) or len(value) > 255:
        also = ', or "all" or "unknown"' if query else ""
        raise InvalidInput(
            f"consumer_type must match ^[A-Z0-9_]+$ (at most 255 characters){also}, got {shown(value, 80)}",
            field="consumer_type",
        )
    return value


#: the generations a caller may give: any 64-bit integer. One that no provider or consumer can
#: have (below 0, past the 2**62 evstore writes at most) is a generation conflict, as in Placement
#: (409 ``expected 1 but got -1``), not malformed input; past 64 bits it is refused as malformed.
GIVEN_GENERATION_MIN = -(2**63)
GIVEN_GENERATION_MAX = 2**63


def validate_generation(
    value: object, what: str = "generation", nullable: bool = True, field: str = "generation"
) -> int | None:
    if value is None and nullable:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not GIVEN_GENERATION_MIN <= value <= GIVEN_GENERATION_MAX
    ):
        said = (
            _shown_int(value) if isinstance(value, int) and not isinstance(value, bool) else shown(value, 80)
        )
        raise InvalidInput(
            f"{what} must be an integer from -2**63 to 2**63{' or None' if nullable else ''}, got {said}",
            field=field,
        )
    return value


def pydantic_path(exc: ValidationError) -> list[str]:
    """Where the first problem of ``exc`` is: its field and the keys below it (a nested
    InvalidInput's own ``path`` where a validator raised one)."""
    errors = exc.errors()
    if not errors:
        return []
    first = errors[0]
    cause = getattr(first.get("ctx", {}).get("error"), "__cause__", None)
    if isinstance(cause, InvalidInput) and "path" in cause.details:
        return list(cause.details["path"])
    return [str(p) for p in first["loc"]]


def pydantic_where(exc: ValidationError) -> dict[str, Any]:
    """The ``field`` and ``path`` details of a refusal of a value type's keyword arguments."""
    parts = pydantic_path(exc)
    return where(parts[0], parts) if parts else {}


def _inner_path(exc: InvalidInput) -> list[str]:
    """Where a value type's refusal is, inside the value: its ``path``, or its ``field`` alone."""
    if "path" in exc.details:
        return list(exc.details["path"])
    return [exc.details["field"]] if "field" in exc.details else []


def pydantic_message(exc: ValidationError) -> str:
    """What ``exc`` refused, field by field. A validator's own refusal (pydantic's "Value error,
    ..." of a ValueError) is given in its own words, and without the field's name when those
    already name it."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "value"
        raised = err.get("ctx", {}).get("error") if err["type"] == "value_error" else None
        if isinstance(raised, Exception):
            said = str(raised)
            named = bool(err["loc"]) and said.startswith(f"{err['loc'][-1]} ")
            parts.append(said if named else f"{loc}: {said}")
        else:
            parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def refuse_assignment(value: object, name: str) -> NoReturn:
    """An immutable value type's answer to an assignment (or deletion) of an attribute: Python's
    own ``FrozenInstanceError``, as the frozen dataclasses evstore answers raise - an
    ``AttributeError`` -, not the ``ValidationError`` pydantic raises for a frozen model."""
    kind = type(value).__name__
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to field {name!r}: {kind} values are immutable "
        f"(make another {kind} with the new values)"
    )


class _RefusesAsInvalidInput(BaseModel):
    """A value type whose pydantic constructors - ``model_validate``, ``model_validate_json`` and
    ``model_validate_strings``, how a mapping or JSON read from a file becomes one - refuse a bad
    value as a call of the type does (``_refused``): a typed evstore error with a stable code, also a
    ValueError, not pydantic's ValidationError."""

    @classmethod
    def _refused(cls, exc: ValidationError) -> InvalidInput:
        raise NotImplementedError

    def __setattr__(self, name: str, value: Any) -> None:
        refuse_assignment(self, name)

    def __delattr__(self, name: str) -> None:
        refuse_assignment(self, name)

    @classmethod
    def _refusal(cls, exc: ValidationError) -> InvalidInput:
        # (pydantic runs the type's own __init__, whose refusal it wraps: that one, as it was)
        errors = exc.errors()
        made = errors[0].get("ctx", {}).get("error") if len(errors) == 1 else None
        return made if isinstance(made, InvalidInput) else cls._refused(exc)

    @classmethod
    def model_validate(cls, obj: Any, **options: Any) -> Self:
        try:
            return super().model_validate(obj, **options)
        except ValidationError as exc:
            raise cls._refusal(exc) from None

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **options: Any) -> Self:
        try:
            return super().model_validate_json(json_data, **options)
        except ValidationError as exc:
            raise cls._refusal(exc) from None

    @classmethod
    def model_validate_strings(cls, obj: Any, **options: Any) -> Self:
        try:
            return super().model_validate_strings(obj, **options)
        except ValidationError as exc:
            raise cls._refusal(exc) from None


class Inventory(_RefusesAsInvalidInput):
    """The inventory of one resource class on one provider (Placement's fields and defaults)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    total: int = Field(ge=1, le=MAX_INT)
    reserved: int = Field(default=0, ge=0, le=MAX_INT)
    min_unit: int = Field(default=1, ge=1, le=MAX_INT)
    max_unit: int = Field(default=MAX_INT, ge=1, le=MAX_INT)
    step_size: int = Field(default=1, ge=1, le=MAX_INT)
    allocation_ratio: float = Field(default=1.0, gt=0, le=3.40282e38)

    if TYPE_CHECKING:
        # What type checkers see: the fields (the ``**data`` below would hide them, and a
        # misspelt or mistyped field would pass ``mypy --strict`` and pyright).
        def __init__(
            self,
            /,
            *,
            total: int,
            reserved: int = 0,
            min_unit: int = 1,
            max_unit: int = MAX_INT,
            step_size: int = 1,
            allocation_ratio: float | Decimal | Fraction = 1.0,
        ) -> None: ...

    else:

        def __init__(self, /, **data: Any) -> None:
            # Bad values are bad input: a typed evstore error (also a ValueError), not pydantic's.
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise self._refused(exc) from None

    @classmethod
    def _refused(cls, exc: ValidationError) -> InvalidInput:
        return InvalidInventoryValue(f"Invalid inventory: {pydantic_message(exc)}", **pydantic_where(exc))

    @field_validator("allocation_ratio", mode="before")
    @classmethod
    def _finite_ratio(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError("allocation_ratio must be a number")
        if isinstance(v, int | Decimal | Fraction):
            try:
                v = float(v)
            except OverflowError:
                raise ValueError("allocation_ratio is too large") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError("allocation_ratio must be finite")
        return v

    def problems(self) -> list[str]:
        """Cross-field contradictions (checked when the inventory is set, after the provider's
        generation, as Placement orders its checks)."""
        found = []
        if self.reserved > self.total:
            found.append(f"reserved ({self.reserved}) is greater than total ({self.total})")
        if self.min_unit > self.max_unit:
            found.append(f"min_unit ({self.min_unit}) is greater than max_unit ({self.max_unit})")
        return found

    @property
    def capacity(self) -> float:
        """``(total - reserved) * allocation_ratio``, a float, as Placement computes it."""
        return (self.total - self.reserved) * self.allocation_ratio


def coerce_inventory(
    value: object, resource_class: str, field: str = "inventory", path: Sequence[str] = ()
) -> Inventory:
    """``path``: where the inventory is inside the argument ``field`` (``[class]`` in a mapping of
    inventories), for the errors' details."""
    at = [field, *path]
    if isinstance(value, Inventory):
        # Checked again: model_copy(update=...) and model_construct make instances that never were
        # (an event with an inventory of total 0 could never be decoded again).
        value = value.model_dump()
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise InvalidInventoryValue(
                f"Invalid inventory for {resource_class}: field names must be strings",
                resource_class=resource_class,
                **where(field, at),
            )
        try:
            return Inventory(**dict(value))
        except InvalidInventoryValue as exc:
            problem = exc.message.removeprefix("Invalid inventory: ")
            raise InvalidInventoryValue(
                f"Invalid inventory for {resource_class}: {problem}",
                resource_class=resource_class,
                **where(field, [*at, *_inner_path(exc)]),
            ) from None
    raise InvalidInput(
        f"Inventory for {resource_class} must be an Inventory or a mapping, got {type(value).__name__}",
        **where(field, at),
    )


def make_inventory(**fields: Any) -> Inventory:
    """Build a sane Inventory, raising InvalidInventoryValue (an InvalidInput) on any problem."""
    try:
        inventory = Inventory(**fields)
    except ValidationError as exc:
        raise InvalidInventoryValue(
            f"Invalid inventory: {pydantic_message(exc)}", **pydantic_where(exc)
        ) from None
    if inventory.problems():
        raise InvalidInventoryValue(
            f"Invalid inventory: {'; '.join(inventory.problems())}",
            field="reserved" if inventory.reserved > inventory.total else "min_unit",
        )
    return inventory


class ConsumerAllocations(_RefusesAsInvalidInput):
    """One consumer's part of a ``write_allocations`` command (Placement's POST /allocations entry).

    ``consumer_generation=None`` means "I expect this consumer not to exist".
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    allocations: dict[str, dict[str, int]]
    #: (strict, here and for the type: bytes are not text; and the same checks as set_allocations: no
    #: lone surrogate, no NUL)
    project_id: StrictStr = Field(min_length=1, max_length=255)
    user_id: StrictStr = Field(min_length=1, max_length=255)
    #: (pydantic's patterns are Rust regexes, where "$" is the very end: no final newline gets through)
    consumer_type: StrictStr = Field(min_length=1, max_length=255, pattern=r"^[A-Z0-9_]+$")
    #: strict: a bool, a string or a float is not a generation (``set_allocations`` refuses them too)
    consumer_generation: StrictInt | None = Field(
        default=None,
        ge=GIVEN_GENERATION_MIN,
        le=GIVEN_GENERATION_MAX,
        validation_alias=AliasChoices("consumer_generation", "generation"),
    )

    if TYPE_CHECKING:
        # What type checkers see (see Inventory); ``generation`` is an alias of
        # ``consumer_generation``, and provider uuids may be ``uuid.UUID``.
        def __init__(
            self,
            /,
            *,
            allocations: (
                Mapping[str, Mapping[str, int]]
                | Mapping[_uuid.UUID, Mapping[str, int]]
                | Mapping[str | _uuid.UUID, Mapping[str, int]]
            ),
            project_id: str,
            user_id: str,
            consumer_type: str,
            consumer_generation: int | None = None,
            generation: int | None = None,
        ) -> None: ...

    else:

        def __init__(self, /, **data: Any) -> None:
            if "generation" in data and "consumer_generation" in data:
                # (pydantic took one and called the other "Extra inputs are not permitted")
                raise InvalidInput(
                    "Invalid consumer allocations: give consumer_generation or its alias generation, "
                    "not both",
                    field="consumer_generation",
                )
            try:
                super().__init__(**data)
            except ValidationError as exc:
                raise self._refused(exc) from None

    @classmethod
    def _refused(cls, exc: ValidationError) -> InvalidInput:
        return InvalidInput(f"Invalid consumer allocations: {pydantic_message(exc)}", **pydantic_where(exc))

    # (before pydantic's own checks of the fields, so that their refusals say what set_allocations'
    # do: "project_id must be a string of 1..255 characters, got ''")
    @field_validator("project_id", "user_id", mode="before")
    @classmethod
    def _text(cls, v: object, info: ValidationInfo) -> str:
        try:
            return validate_name(v, str(info.field_name))
        except InvalidInput as exc:
            raise ValueError(exc.message) from None

    @field_validator("consumer_type", mode="before")
    @classmethod
    def _type(cls, v: object) -> str:
        try:
            return validate_consumer_type(v)
        except InvalidInput as exc:
            raise ValueError(exc.message) from None

    @field_validator("allocations", mode="before")
    @classmethod
    def _normalize(cls, v: Any) -> Any:
        try:
            return normalize_allocations(v)
        except InvalidInput as exc:
            raise ValueError(exc.message) from exc  # (its details: see pydantic_path)


def coerce_consumer_allocations(
    value: object, consumer: str, field: str = "allocations"
) -> ConsumerAllocations:
    """One consumer's entry of ``write_allocations``' argument ``field``."""
    at = [field, consumer]
    if isinstance(value, ConsumerAllocations):
        value = value.model_dump()  # (checked again: see coerce_inventory)
    if isinstance(value, Mapping):
        try:
            return ConsumerAllocations(**{str(k): v for k, v in value.items()})
        except InvalidInput as exc:
            problem = exc.message.removeprefix("Invalid consumer allocations: ")
            raise InvalidInput(
                f"Invalid allocations for consumer {consumer}: {problem}",
                **where(field, [*at, *_inner_path(exc)]),
            ) from None
    raise InvalidInput(
        f"Allocations for consumer {consumer} must be a ConsumerAllocations or a mapping", **where(field, at)
    )


def is_known_class(name: str, custom: set[str] | frozenset[str]) -> bool:
    return name in STANDARD_CLASSES or name in custom


def validate_int_option(value: object, name: str, least: int, most: int = 1_000_000) -> int:
    """An integer store option (``open_store(..., name=value)``): bools and floats refused."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise InvalidInput(
            f"{name} must be an integer from {least} to {most}, got {shown(value, 40)}", field=name
        )
    return value


def validate_seconds_option(value: object, name: str, most: float = 86_400) -> float:
    """A duration store option in seconds, from a millisecond (nan and inf refused). Less is no
    duration a poll, a connection or a statement can keep: ``poll_interval=1e-320`` polled the head
    of the log in a busy loop, a ``connect_timeout`` of 1e-9 timed every connection out at once."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not _LEAST_SECONDS <= value <= most:
        raise InvalidInput(
            f"{name} must be a number of seconds from {_LEAST_SECONDS:g} to {most:g}, got {shown(value, 40)}",
            field=name,
        )
    return float(value)


#: the shortest duration a store option (``poll_interval``, ``connect_timeout``, ``command_timeout``) takes
_LEAST_SECONDS = 0.001


def validate_flag_option(value: object, name: str) -> bool:
    """A yes/no store option given as a keyword (``create``, ``upgrade``): a bool, nothing else
    (``"false"`` and ``0`` are truthy or falsy by accident). One message for both backends."""
    if not isinstance(value, bool):
        raise InvalidInput(f"{name} must be True or False, got {shown(value, 40)}", field=name)
    return value


def flag_option_from_url(text: str, name: str) -> bool:
    """A yes/no store option given as ``?name=text`` in a URL: true/false or 1/0, any case."""
    if text.lower() not in ("true", "false", "1", "0"):
        raise InvalidInput(f"{name} must be true or false, got {shown(text, 40)}", field=name)
    return text.lower() in ("true", "1")
