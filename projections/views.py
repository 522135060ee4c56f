"""Read models returned by queries: the same shapes for the live store and for time travel."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from evstore.schema import Inventory
from projections.state import ConsumerState, ProviderState, State


def _equal(self: Any, other: object) -> Any:
    """A view equals a view of its kind with the same fields, and any mapping with its items (as a
    dict would): ``await store.usage(rp) == {"VCPU": 2}``."""
    names = [f.name for f in fields(self)]
    if type(other) is type(self):
        return all(getattr(self, name) == getattr(other, name) for name in names)
    if isinstance(other, Mapping):
        return dict(self.items()) == dict(other.items())
    return NotImplemented


def _to_dict(self: Any) -> dict[str, Any]:
    """Every field, as plain JSON-ready values."""
    return asdict(self)


def _sorted(amounts: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(amounts.items()))


def sorted_holdings(held: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    """``{entity: {class: amount}}`` in one order, whatever order it was stored or folded in
    (each backend's rows, and the events of time travel, come in their own)."""
    return {key: _sorted(amounts) for key, amounts in sorted(held.items())}


@dataclass(frozen=True, slots=True, eq=False)
class ProviderUsage(Mapping[str, int]):
    """``usage(provider)``: the generation and one entry per inventory class (0 where unused)."""

    provider: str
    generation: int
    usages: dict[str, int]

    def __getitem__(self, key: str) -> int:
        return self.usages[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.usages)

    def __len__(self) -> int:
        return len(self.usages)

    __eq__ = _equal
    __hash__ = None  # type: ignore[assignment]  # (a mapping of mutable values, as a dict is)
    to_dict = _to_dict

    @classmethod
    def of(cls, p: ProviderState) -> ProviderUsage:
        return cls(p.uuid, p.generation, _sorted(p.usage_view()))


@dataclass(frozen=True, slots=True, eq=False)
class ProviderInventories(Mapping[str, Inventory]):
    """``inventories(provider)``: one :class:`~evstore.Inventory` per resource class, with the
    provider's generation (Placement's GET /resource_providers/{uuid}/inventories): the
    generation to pass to ``set_inventories`` / ``set_inventory`` / ``delete_inventory``."""

    provider: str
    generation: int
    inventories: dict[str, Inventory]

    def __getitem__(self, key: str) -> Inventory:
        return self.inventories[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.inventories)

    def __len__(self) -> int:
        return len(self.inventories)

    __eq__ = _equal
    __hash__ = None  # type: ignore[assignment]

    def to_dict(self) -> dict[str, Any]:
        """Every field, as plain JSON-ready values (each inventory as a dict of its fields)."""
        return {
            "provider": self.provider,
            "generation": self.generation,
            "inventories": {rc: inv.model_dump() for rc, inv in self.inventories.items()},
        }

    @classmethod
    def of(cls, p: ProviderState) -> ProviderInventories:
        return cls(p.uuid, p.generation, dict(sorted(p.inventories.items())))


@dataclass(frozen=True, slots=True)
class ProviderView:
    """``provider(uuid)``: Placement's GET /resource_providers/{uuid} - its name, generation,
    parent (None for a root) and root (itself for a root)."""

    uuid: str
    name: str
    generation: int
    parent: str | None
    root: str

    to_dict = _to_dict

    @classmethod
    def of(cls, p: ProviderState) -> ProviderView:
        return cls(p.uuid, p.name, p.generation, p.parent, p.root)


@dataclass(frozen=True, slots=True, eq=False)
class ConsumerView(Mapping[str, dict[str, int]]):
    """``allocations(consumer)``: what it holds, its owner and generation; empty when absent or
    deleted - unless a log imported from an older writer left it holding while deleted, or as the
    migration of a deleted instance: ``leaked`` says that, the audit's leak
    (:func:`projections.invariants.leak_of`, as ``evstore state --consumer`` and ``diff`` call it)."""

    consumer: str
    allocations: dict[str, dict[str, int]]
    project_id: str | None
    user_id: str | None
    consumer_type: str | None
    generation: int | None
    deleted: bool
    deleted_at: int | None = None
    on_behalf_of: str | None = None
    leaked: bool = False

    def __getitem__(self, key: str) -> dict[str, int]:
        return self.allocations[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.allocations)

    def __len__(self) -> int:
        return len(self.allocations)

    __eq__ = _equal
    __hash__ = None  # type: ignore[assignment]  # (a mapping of mutable values, as a dict is)
    to_dict = _to_dict

    @classmethod
    def in_state(cls, uuid: str, state: State) -> ConsumerView:
        """The consumer ``uuid`` of ``state``, ``leaked`` as the audit has it in that state (which
        must hold the instance of a migration consumer, to tell whether it was deleted)."""
        from projections.invariants import leak_of  # (it imports this module)

        c = state.consumers.get(uuid)
        return cls.of(uuid, c, leaked=c is not None and leak_of(state, c) is not None)

    @classmethod
    def of(cls, uuid: str, c: ConsumerState | None, leaked: bool = False) -> ConsumerView:
        """``c`` as a view (``leaked``: see :meth:`in_state`, which works it out)."""
        if c is None:
            return cls(uuid, {}, None, None, None, None, False)
        return cls(
            uuid,
            sorted_holdings(c.allocations),
            c.project_id if c.allocations else (c.project_id if c.deleted else None),
            c.user_id if c.allocations else (c.user_id if c.deleted else None),
            c.consumer_type if c.allocations else (c.consumer_type if c.deleted else None),
            c.generation if c.allocations else None,
            c.deleted,
            c.deleted_at,
            c.on_behalf_of,
            leaked,
        )


@dataclass(frozen=True, slots=True, eq=False)
class ProjectUsages(Mapping[str, int]):
    """``usages(project_id, user_id, consumer_type)``: totals per class, and per consumer type.

    ``by_consumer_type[TYPE]`` maps classes to totals plus ``consumer_count``.
    """

    usages: dict[str, int]
    consumer_count: int
    by_consumer_type: dict[str, dict[str, int]] = field(default_factory=dict)

    def __getitem__(self, key: str) -> int:
        return self.usages[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.usages)

    def __len__(self) -> int:
        return len(self.usages)

    __eq__ = _equal
    __hash__ = None  # type: ignore[assignment]  # (a mapping of mutable values, as a dict is)
    to_dict = _to_dict

    @classmethod
    def from_rows(cls, rows: list[tuple[str | None, str, str, int]]) -> ProjectUsages:
        """From one row ``(consumer_type, consumer, class, amount)`` per allocation held."""
        return cls.from_groups(groups_from_rows(rows))

    @classmethod
    def from_groups(cls, groups: Iterable[UsageGroup]) -> ProjectUsages:
        """From ``(consumer_type, consumer_count, {class: amount})`` groups of disjoint consumers
        (per user and type: a consumer has one of each, so counts add up)."""
        totals: dict[str, int] = {}
        by_type: dict[str, dict[str, int]] = {}
        counts: dict[str, int] = {}
        for ctype, count, usages in groups:
            if count <= 0:
                continue
            t = ctype or "unknown"
            counts[t] = counts.get(t, 0) + count
            group = by_type.setdefault(t, {})
            for rc, used in usages.items():
                totals[rc] = totals.get(rc, 0) + used
                group[rc] = group.get(rc, 0) + used
        groups_out = {t: {**_sorted(by_type[t]), "consumer_count": counts[t]} for t in sorted(by_type)}
        return cls(_sorted(totals), sum(counts.values()), groups_out)


#: ``(consumer_type, consumer_count, {class: amount})``: what a set of consumers of one type holds
UsageGroup = tuple[str | None, int, Mapping[str, int]]


def groups_from_rows(rows: Iterable[tuple[str | None, str, str, int]]) -> list[UsageGroup]:
    """One group per consumer type from one row ``(consumer_type, consumer, class, amount)`` per
    allocation held."""
    consumers: dict[str | None, set[str]] = {}
    amounts: dict[str | None, dict[str, int]] = {}
    for ctype, consumer, rc, used in rows:
        consumers.setdefault(ctype, set()).add(consumer)
        group = amounts.setdefault(ctype, {})
        group[rc] = group.get(rc, 0) + used
    return [(t, len(consumers[t]), amounts[t]) for t in consumers]


#: Placement's reserved ``consumer_type`` values (microversion 1.38): every consumer, grouped as
#: "all", or only the consumers without a type (evstore records those as UNKNOWN)
RESERVED_CONSUMER_TYPES = ("all", "unknown")


def reserved_type_usages(groups: Iterable[UsageGroup], consumer_type: str) -> ProjectUsages:
    """``usages`` for a reserved ``consumer_type``, from the groups of every consumer type."""
    if consumer_type == "unknown":
        groups = [g for g in groups if g[0] in (None, "UNKNOWN")]
    return ProjectUsages.from_groups((consumer_type, count, usages) for _, count, usages in groups)


def project_usage_rows(
    state: State, project_id: str, user_id: str | None, consumer_type: str | None
) -> list[tuple[str | None, str, str, int]]:
    rows = []
    for c in state.consumers.values():
        if c.project_id != project_id or not c.allocations:
            continue
        if user_id is not None and c.user_id != user_id:
            continue
        if consumer_type is not None and c.consumer_type != consumer_type:
            continue
        for res in c.allocations.values():
            for rc, used in res.items():
                rows.append((c.consumer_type, c.uuid, rc, used))
    return rows


def provider_allocations(state: State, provider: str) -> dict[str, dict[str, int]]:
    return sorted_holdings(
        {c.uuid: res for c in state.consumers.values() if (res := c.allocations.get(provider))}
    )
