"""evstore: an async, event-sourced allocation store with Placement semantics.

Every change to providers, inventories and allocations is an immutable event; current state is a
projection of the log; rules (capacity, generations, tombstones) are enforced atomically at
append time. Start with ``async with evstore.open_store("sqlite:///evstore.db") as store:``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from evstore.errors import (
    CannotDeleteParent,
    CapacityExceeded,
    ConcurrentUpdate,
    ConstraintViolation,
    ConsumerDeleted,
    CorruptEvent,
    DuplicateName,
    EvstoreError,
    IdempotencyConflict,
    InvalidInput,
    InvalidInventory,
    InvalidInventoryValue,
    InventoryInUse,
    NotFound,
    ProjectionCorrupt,
    ProviderInUse,
    ProviderNotFound,
    SchemaVersionError,
    StorageError,
    StoreClosed,
    UnknownResourceClass,
    WrongEventLoop,
)

if TYPE_CHECKING:
    from evstore.events import Metadata, RecordedEvent
    from evstore.log import Rebuilt, Receipt
    from evstore.schema import ConsumerAllocations, Inventory
    from evstore.store import (
        AllocationsByConsumer,
        AllocationStore,
        ProviderAllocations,
        StoreOpener,
        StoreOptions,
        command_metadata,
        open_store,
    )
    from projections.audit import AuditReport, Finding
    from projections.diff import ConsumerChange, Diff, UsageDelta
    from projections.replay import StateView
    from projections.state import State
    from projections.views import (
        ConsumerView,
        ProjectUsages,
        ProviderInventories,
        ProviderUsage,
        ProviderView,
    )

__version__ = "0.1.0"

# The store pulls in the projections package, which itself imports evstore.events: load it on
# first use so that `import evstore` stays light and the import graph cannot cycle. The models
# (pydantic, ~0.1 s to import) too: the `evstore` script imports this package before it can
# catch a Ctrl-C (evstore/__main__.py), and a command that needs none of them - `--help` - loads none.
_LAZY = {
    "Metadata": "evstore.events",
    "RecordedEvent": "evstore.events",
    "ConsumerAllocations": "evstore.schema",
    "Inventory": "evstore.schema",
    "open_store": "evstore.store",
    "AllocationStore": "evstore.store",
    "command_metadata": "evstore.store",
    # what open_store takes and answers (for annotations)
    "StoreOpener": "evstore.store",
    "StoreOptions": "evstore.store",
    # the allocation bodies' types (for annotations)
    "ProviderAllocations": "evstore.store",
    "AllocationsByConsumer": "evstore.store",
    "Receipt": "evstore.log",
    # what rebuild answers (an int, with snapshots_dropped)
    "Rebuilt": "evstore.log",
    "AuditReport": "projections.audit",
    "Finding": "projections.audit",
    # what the queries answer (for annotations)
    "ProviderUsage": "projections.views",
    "ProviderInventories": "projections.views",
    "ProviderView": "projections.views",
    "ConsumerView": "projections.views",
    "ProjectUsages": "projections.views",
    "StateView": "projections.replay",
    "State": "projections.state",
    "Diff": "projections.diff",
    "UsageDelta": "projections.diff",
    "ConsumerChange": "projections.diff",
}

#: the submodules `import evstore` imported, and so bound as its attributes, before they were lazy
_SUBMODULES = frozenset({"events", "schema"})


if not TYPE_CHECKING:  # (to a type checker a module __getattr__ says that every name exists)

    def __getattr__(name: str) -> Any:
        import importlib

        module = _LAZY.get(name)
        if module is None:
            if name in _SUBMODULES:  # (bound by `import evstore` when it imported them eagerly)
                return importlib.import_module(f"evstore.{name}")
            raise AttributeError(f"module 'evstore' has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AllocationStore",
    "AllocationsByConsumer",
    "AuditReport",
    "CannotDeleteParent",
    "CapacityExceeded",
    "ConcurrentUpdate",
    "ConstraintViolation",
    "ConsumerAllocations",
    "ConsumerChange",
    "ConsumerDeleted",
    "ConsumerView",
    "CorruptEvent",
    "Diff",
    "DuplicateName",
    "EvstoreError",
    "Finding",
    "IdempotencyConflict",
    "InvalidInput",
    "InvalidInventory",
    "InvalidInventoryValue",
    "Inventory",
    "InventoryInUse",
    "Metadata",
    "NotFound",
    "ProjectUsages",
    "ProjectionCorrupt",
    "ProviderAllocations",
    "ProviderInUse",
    "ProviderInventories",
    "ProviderNotFound",
    "ProviderUsage",
    "ProviderView",
    "Rebuilt",
    "Receipt",
    "RecordedEvent",
    "SchemaVersionError",
    "State",
    "StateView",
    "StorageError",
    "StoreClosed",
    "StoreOpener",
    "StoreOptions",
    "UnknownResourceClass",
    "UsageDelta",
    "WrongEventLoop",
    "command_metadata",
    "open_store",
]
