"""Every ``InvalidInput`` refusing a malformed argument of an ``AllocationStore`` method names that
argument, as the caller wrote it, in ``details["field"]`` (and, for a problem inside a nested
structure, the keys down to it in ``details["path"]``, starting with the argument's name), so a
program - an HTTP facade answering 400 with a pointer - need not parse the message.

Regression: names, generations, idempotency keys, metadata, project and user ids, consumer types,
amounts, inventories and allocation bodies were refused with ``details == {}``; uuids carried
``field="provider uuid"`` (the message's words), not the argument's name."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from evstore import (
    AllocationStore,
    ConsumerAllocations,
    InvalidInput,
    Inventory,
    Metadata,
    command_metadata,
    open_store,
)
from evstore.schema import make_inventory
from tests.conftest import allocate, make_provider, new_uuid

Call = Callable[[], Awaitable[Any]]
INVALID = "evstore.invalid_input"
UNKNOWN_CLASS = "evstore.resource_class.unknown"
BAD_INVENTORY = "evstore.inventory.invalid"


def _rows(
    store: AllocationStore, rp: str, c: str, gen: int
) -> list[tuple[str, Call, str, str, list[str] | None]]:
    """``(label, call, code, field, path)``: one malformed argument each."""
    s = store
    fresh = new_uuid()
    up = rp.upper()
    ok_alloc = {rp: {"VCPU": 1}}
    owner = {"project_id": "p", "user_id": "u", "consumer_type": "INSTANCE"}

    def ca(**over: Any) -> dict[str, Any]:
        return {"allocations": ok_alloc, **owner, "consumer_generation": None, **over}

    def sa(**over: Any) -> Call:
        kwargs: dict[str, Any] = {**owner, "generation": None, **over}
        consumer = kwargs.pop("consumer", fresh)
        allocations = kwargs.pop("allocations", ok_alloc)
        return lambda: s.set_allocations(consumer, allocations, **kwargs)

    rows: list[tuple[str, Call, str, str, list[str] | None]] = [
        # create_resource_class
        ("crc name pattern", lambda: s.create_resource_class("custom_x"), INVALID, "name", None),
        ("crc name type", lambda: s.create_resource_class(5), INVALID, "name", None),  # type: ignore[arg-type]
        ("crc name standard", lambda: s.create_resource_class("VCPU"), INVALID, "name", None),
        (
            "crc key",
            lambda: s.create_resource_class("CUSTOM_A", idempotency_key=""),
            INVALID,
            "idempotency_key",
            None,
        ),
        (
            "crc key type",
            lambda: s.create_resource_class("CUSTOM_A", idempotency_key=3),
            INVALID,
            "idempotency_key",
            None,
        ),  # type: ignore[arg-type]
        (
            "crc metadata",
            lambda: s.create_resource_class("CUSTOM_A", metadata=[1]),
            INVALID,
            "metadata",
            None,
        ),  # type: ignore[arg-type]
        (
            "crc metadata key",
            lambda: s.create_resource_class("CUSTOM_A", metadata={1: "x"}),
            INVALID,
            "metadata",
            ["metadata", "1"],
        ),  # type: ignore[dict-item]
        (
            "crc metadata json",
            lambda: s.create_resource_class("CUSTOM_A", metadata={"x": object()}),
            INVALID,
            "metadata",
            ["metadata", "x"],
        ),
        (
            "crc metadata nan",
            lambda: s.create_resource_class("CUSTOM_A", metadata={"x": float("nan")}),
            INVALID,
            "metadata",
            ["metadata", "x"],
        ),
        # create_provider
        ("cp uuid", lambda: s.create_provider("nope", "n"), INVALID, "uuid", None),
        ("cp name empty", lambda: s.create_provider(new_uuid(), ""), INVALID, "name", None),
        ("cp name long", lambda: s.create_provider(new_uuid(), "x" * 201), INVALID, "name", None),
        ("cp name nul", lambda: s.create_provider(new_uuid(), "a\x00b"), INVALID, "name", None),
        ("cp name surrogate", lambda: s.create_provider(new_uuid(), "a\ud800"), INVALID, "name", None),
        ("cp parent", lambda: s.create_provider(new_uuid(), "n", parent="x"), INVALID, "parent", None),
        ("cp own parent", lambda: s.create_provider(fresh, "own", parent=fresh), INVALID, "parent", None),
        # rename_provider, delete_provider
        ("rename uuid", lambda: s.rename_provider(7, "n"), INVALID, "uuid", None),  # type: ignore[arg-type]
        ("rename name", lambda: s.rename_provider(rp, None), INVALID, "name", None),  # type: ignore[arg-type]
        ("delete uuid", lambda: s.delete_provider(""), INVALID, "uuid", None),
        # set_inventories
        ("si provider", lambda: s.set_inventories("x", {}, 0), INVALID, "provider", None),
        ("si inventories type", lambda: s.set_inventories(rp, [], gen), INVALID, "inventories", None),  # type: ignore[arg-type]
        (
            "si class",
            lambda: s.set_inventories(rp, {"vcpu": Inventory(total=1)}, gen),
            INVALID,
            "inventories",
            ["inventories", "vcpu"],
        ),
        (
            "si inventory type",
            lambda: s.set_inventories(rp, {"VCPU": 5}, gen),
            INVALID,
            "inventories",
            ["inventories", "VCPU"],
        ),  # type: ignore[dict-item]
        (
            "si inventory field",
            lambda: s.set_inventories(rp, {"VCPU": {"total": 0}}, gen),
            BAD_INVENTORY,
            "inventories",
            ["inventories", "VCPU", "total"],
        ),
        (
            "si inventory extra",
            lambda: s.set_inventories(rp, {"VCPU": {"total": 1, "bogus": 1}}, gen),
            BAD_INVENTORY,
            "inventories",
            ["inventories", "VCPU", "bogus"],
        ),
        (
            "si inventory keys",
            lambda: s.set_inventories(rp, {"VCPU": {1: 1}}, gen),
            BAD_INVENTORY,
            "inventories",
            ["inventories", "VCPU"],
        ),
        ("si generation", lambda: s.set_inventories(rp, {}, 2**64), INVALID, "generation", None),
        ("si generation none", lambda: s.set_inventories(rp, {}, None), INVALID, "generation", None),  # type: ignore[arg-type]
        ("si generation bool", lambda: s.set_inventories(rp, {}, True), INVALID, "generation", None),
        (
            "si reserved",
            lambda: s.set_inventories(rp, {"VCPU": {"total": 1, "reserved": 2}}, gen),
            BAD_INVENTORY,
            "inventories",
            ["inventories", "VCPU"],
        ),
        (
            "si unknown class",
            lambda: s.set_inventories(rp, {"CUSTOM_NONE": {"total": 1}}, gen),
            UNKNOWN_CLASS,
            "inventories",
            ["inventories", "CUSTOM_NONE"],
        ),
        # set_inventory
        (
            "sinv provider",
            lambda: s.set_inventory(None, "VCPU", Inventory(total=1), gen),
            INVALID,
            "provider",
            None,
        ),  # type: ignore[arg-type]
        (
            "sinv class",
            lambda: s.set_inventory(rp, "", Inventory(total=1), gen),
            INVALID,
            "resource_class",
            None,
        ),
        ("sinv inventory", lambda: s.set_inventory(rp, "VCPU", "8", gen), INVALID, "inventory", None),  # type: ignore[arg-type]
        (
            "sinv inventory field",
            lambda: s.set_inventory(rp, "VCPU", {"total": "8"}, gen),
            BAD_INVENTORY,
            "inventory",
            ["inventory", "total"],
        ),
        (
            "sinv generation",
            lambda: s.set_inventory(rp, "VCPU", Inventory(total=1), "0"),
            INVALID,
            "generation",
            None,
        ),  # type: ignore[arg-type]
        (
            "sinv min max",
            lambda: s.set_inventory(rp, "VCPU", {"total": 9, "min_unit": 5, "max_unit": 2}, gen),
            BAD_INVENTORY,
            "inventory",
            None,
        ),
        (
            "sinv unknown class",
            lambda: s.set_inventory(rp, "CUSTOM_NONE", {"total": 1}, gen),
            UNKNOWN_CLASS,
            "resource_class",
            None,
        ),
        # delete_inventory
        ("di provider", lambda: s.delete_inventory("x", "VCPU"), INVALID, "provider", None),
        ("di class", lambda: s.delete_inventory(rp, "VCPU\n"), INVALID, "resource_class", None),
        # set_allocations
        ("sa consumer", sa(consumer="x"), INVALID, "consumer", None),
        ("sa allocations type", sa(allocations=[1]), INVALID, "allocations", None),
        ("sa provider", sa(allocations={"x": {"VCPU": 1}}), INVALID, "allocations", ["allocations", "x"]),
        ("sa provider upper", sa(allocations={up: []}), INVALID, "allocations", ["allocations", rp]),
        ("sa provider empty", sa(allocations={rp: {}}), INVALID, "allocations", ["allocations", rp]),
        (
            "sa placement shape",
            sa(allocations={rp: {"resources": {"VCPU": 1}}}),
            INVALID,
            "allocations",
            ["allocations", rp],
        ),
        (
            "sa provider twice",
            sa(allocations={rp: {"VCPU": 1}, up: {"VCPU": 1}}),
            INVALID,
            "allocations",
            ["allocations", up],
        ),
        ("sa class", sa(allocations={rp: {"vcpu": 1}}), INVALID, "allocations", ["allocations", rp, "vcpu"]),
        ("sa amount", sa(allocations={rp: {"VCPU": 0}}), INVALID, "allocations", ["allocations", rp, "VCPU"]),
        (
            "sa amount type",
            sa(allocations={rp: {"VCPU": 1.0}}),
            INVALID,
            "allocations",
            ["allocations", rp, "VCPU"],
        ),
        (
            "sa amount bool",
            sa(allocations={rp: {"VCPU": True}}),
            INVALID,
            "allocations",
            ["allocations", rp, "VCPU"],
        ),
        (  # (past 4,300 digits str() refuses an int: a bare ValueError escaped, session 37)
            "sa amount of 5,000 digits",
            sa(allocations={rp: {"VCPU": 10**5000}}),
            INVALID,
            "allocations",
            ["allocations", rp, "VCPU"],
        ),
        ("sa project", sa(project_id=""), INVALID, "project_id", None),
        ("sa user", sa(user_id=b"u"), INVALID, "user_id", None),
        ("sa type", sa(consumer_type="instance"), INVALID, "consumer_type", None),
        ("sa generation", sa(generation=2**64), INVALID, "generation", None),
        ("sa generation float", sa(generation=1.0), INVALID, "generation", None),
        ("sa key", sa(idempotency_key="k" * 256), INVALID, "idempotency_key", None),
        ("sa metadata", sa(metadata={"request_id": 5}), INVALID, "metadata", ["metadata", "request_id"]),
        (
            "sa unknown class",
            sa(allocations={rp: {"CUSTOM_NONE": 1}}),
            UNKNOWN_CLASS,
            "allocations",
            ["allocations", rp, "CUSTOM_NONE"],
        ),
        # write_allocations
        ("wa type", lambda: s.write_allocations([]), INVALID, "allocations", None),  # type: ignore[arg-type]
        ("wa empty", lambda: s.write_allocations({}), INVALID, "allocations", None),
        (
            "wa consumer",
            lambda: s.write_allocations({"x": ca()}),
            INVALID,
            "allocations",
            ["allocations", "x"],
        ),
        (
            "wa value type",
            lambda: s.write_allocations({fresh: 5}),
            INVALID,
            "allocations",
            ["allocations", fresh],
        ),  # type: ignore[dict-item]
        (
            "wa project",
            lambda: s.write_allocations({fresh: ca(project_id="")}),
            INVALID,
            "allocations",
            ["allocations", fresh, "project_id"],
        ),
        (
            "wa user missing",
            lambda: s.write_allocations(
                {fresh: {"allocations": {}, "project_id": "p", "consumer_type": "X"}}
            ),
            INVALID,
            "allocations",
            ["allocations", fresh, "user_id"],
        ),
        (
            "wa type field",
            lambda: s.write_allocations({fresh: ca(consumer_type="a b")}),
            INVALID,
            "allocations",
            ["allocations", fresh, "consumer_type"],
        ),
        (
            "wa generation",
            lambda: s.write_allocations({fresh: ca(consumer_generation="1")}),
            INVALID,
            "allocations",
            ["allocations", fresh, "consumer_generation"],
        ),
        (
            "wa both generations",
            lambda: s.write_allocations({fresh: ca(generation=None)}),
            INVALID,
            "allocations",
            ["allocations", fresh, "consumer_generation"],
        ),
        (
            "wa extra",
            lambda: s.write_allocations({fresh: ca(bogus=1)}),
            INVALID,
            "allocations",
            ["allocations", fresh, "bogus"],
        ),
        (
            "wa allocations type",
            lambda: s.write_allocations({fresh: ca(allocations=5)}),
            INVALID,
            "allocations",
            ["allocations", fresh, "allocations"],
        ),
        (
            "wa provider",
            lambda: s.write_allocations({fresh: ca(allocations={"x": {"VCPU": 1}})}),
            INVALID,
            "allocations",
            ["allocations", fresh, "allocations", "x"],
        ),
        (
            "wa amount",
            lambda: s.write_allocations({fresh: ca(allocations={rp: {"VCPU": -1}})}),
            INVALID,
            "allocations",
            ["allocations", fresh, "allocations", rp, "VCPU"],
        ),
        (
            "wa amount of 5,000 digits",
            lambda: s.write_allocations({fresh: ca(allocations={rp: {"VCPU": -(10**5000)}})}),
            INVALID,
            "allocations",
            ["allocations", fresh, "allocations", rp, "VCPU"],
        ),
        (
            "wa class",
            lambda: s.write_allocations({fresh: ca(allocations={rp: {"VCPU ": 1}})}),
            INVALID,
            "allocations",
            ["allocations", fresh, "allocations", rp, "VCPU "],
        ),
        (
            "wa twice",
            lambda: s.write_allocations({fresh: ca(), fresh.upper(): ca()}),
            INVALID,
            "allocations",
            ["allocations", fresh],
        ),
        (
            "wa unknown class",
            lambda: s.write_allocations({fresh: ca(allocations={rp: {"CUSTOM_NONE": 1}})}),
            UNKNOWN_CLASS,
            "allocations",
            ["allocations", fresh, "allocations", rp, "CUSTOM_NONE"],
        ),
        (
            "wa key",
            lambda: s.write_allocations({fresh: ca()}, idempotency_key="a\x00"),
            INVALID,
            "idempotency_key",
            None,
        ),
        ("wa metadata", lambda: s.write_allocations({fresh: ca()}, metadata=5), INVALID, "metadata", None),  # type: ignore[arg-type]
        # consumers and migrations
        ("release", lambda: s.release("x"), INVALID, "consumer", None),
        ("start instance", lambda: s.start_migration("x", fresh), INVALID, "instance", None),
        ("start migration", lambda: s.start_migration(c, 1), INVALID, "migration", None),  # type: ignore[arg-type]
        ("start same", lambda: s.start_migration(c, c.upper()), INVALID, "migration", None),
        ("revert", lambda: s.revert_migration("x"), INVALID, "migration", None),
        ("confirm", lambda: s.confirm_migration(None), INVALID, "migration", None),  # type: ignore[arg-type]
        ("delete consumer", lambda: s.delete_consumer("{x}"), INVALID, "consumer", None),
        # queries
        ("usage", lambda: s.usage("x"), INVALID, "provider", None),
        ("inventories", lambda: s.inventories("x"), INVALID, "provider", None),
        ("provider", lambda: s.provider("x"), INVALID, "provider", None),
        ("allocations", lambda: s.allocations("x"), INVALID, "consumer", None),
        ("provider_allocations", lambda: s.provider_allocations("x"), INVALID, "provider", None),
        ("usages project", lambda: s.usages(""), INVALID, "project_id", None),
        ("usages user", lambda: s.usages("p", 5), INVALID, "user_id", None),  # type: ignore[arg-type]
        ("usages type", lambda: s.usages("p", consumer_type="all "), INVALID, "consumer_type", None),
        ("read after", lambda: s.read(-1), INVALID, "after", None),
        ("read limit", lambda: s.read(0, 0), INVALID, "limit", None),
        ("history uuid", lambda: _first(s.history("x")), INVALID, "uuid", None),
        ("history batch", lambda: _first(s.history(c, batch_size=0)), INVALID, "batch_size", None),
        ("subscribe after", lambda: _first(s.subscribe(-1)), INVALID, "after", None),
        ("subscribe beyond", lambda: _first(s.subscribe(10**6)), INVALID, "after", None),
        # debugging
        ("replay position", lambda: s.replay(-1), INVALID, "to_position", None),
        ("replay beyond", lambda: s.replay(10**6), INVALID, "to_position", None),
        ("replay both", lambda: s.replay(1, at=datetime.now(UTC)), INVALID, "at", None),
        ("replay at", lambda: s.replay(at=datetime(2026, 1, 1)), INVALID, "at", None),
        ("state_at position", lambda: s.state_at("1"), INVALID, "position", None),  # type: ignore[arg-type]
        ("state_at beyond", lambda: s.state_at(10**6), INVALID, "position", None),
        ("state_at neither", lambda: s.state_at(), INVALID, "position", None),
        ("state_at both", lambda: s.state_at(1, at=datetime.now(UTC)), INVALID, "at", None),
        ("state_at at", lambda: s.state_at(at="2026-01-01"), INVALID, "at", None),  # type: ignore[arg-type]
        ("state_at provider", lambda: s.state_at(1, provider="x"), INVALID, "provider", None),
        ("state_at consumer", lambda: s.state_at(1, consumer="x"), INVALID, "consumer", None),
        ("state_at two", lambda: s.state_at(1, provider=rp, consumer=c), INVALID, "consumer", None),
        ("diff a", lambda: s.diff(-1, 1), INVALID, "a", None),
        ("diff b", lambda: s.diff(0, "1"), INVALID, "b", None),  # type: ignore[arg-type]
        ("diff order", lambda: s.diff(2, 1), INVALID, "b", None),
        ("diff beyond", lambda: s.diff(0, 10**6), INVALID, "b", None),
        ("position_of", lambda: s.position_of(None), INVALID, "point", None),  # type: ignore[arg-type]
        ("audit", lambda: s.audit(history=1), INVALID, "history", None),  # type: ignore[arg-type]
        ("rebuild batch", lambda: s.rebuild(0), INVALID, "batch_size", None),
        ("rebuild progress", lambda: s.rebuild(progress=5), INVALID, "progress", None),  # type: ignore[arg-type]
        ("rebuild full", lambda: s.rebuild(full="yes"), INVALID, "full", None),  # type: ignore[arg-type]
        ("take_snapshots", lambda: s.take_snapshots(progress=1), INVALID, "progress", None),  # type: ignore[arg-type]
        ("export", lambda: _first(s.export(batch_size=-5)), INVALID, "batch_size", None),
        ("import open_lines", lambda: s.import_events(5), INVALID, "open_lines", None),  # type: ignore[arg-type]
        ("import batch", lambda: s.import_events(lambda: [], 0), INVALID, "batch_size", None),
        ("import progress", lambda: s.import_events(lambda: [], progress=2), INVALID, "progress", None),  # type: ignore[arg-type]
    ]
    return rows


async def _first(gen: Any) -> Any:
    """The first item of an async generator (its arguments are checked at the call or the first
    iteration: either is the caller's refusal)."""
    async for item in gen:
        return item
    return None


async def test_every_malformed_argument_is_named(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    gen = (await store.inventories(rp)).generation
    wrong = []
    for label, call, code, field, path in _rows(store, rp, c, gen):
        try:
            await call()
        except InvalidInput as exc:
            got = (exc.code, exc.details.get("field"), exc.details.get("path"))
            if got != (code, field, path):
                wrong.append(f"{label}: got {got}, want {(code, field, path)} ({exc.message})")
        else:
            wrong.append(f"{label}: not refused")
    assert not wrong, "\n".join(wrong)


async def test_existing_detail_keys_are_kept(store: AllocationStore) -> None:
    """The keys the details had before ``field`` and ``path`` are still there."""
    rp = await make_provider(store, VCPU=8)
    with pytest.raises(InvalidInput) as caught:
        await store.create_provider("nope", "n")
    assert caught.value.details == {"field": "uuid", "value": "'nope'"}
    with pytest.raises(InvalidInput) as caught:
        await allocate(store, new_uuid(), {rp: {"VCPU": 0}})
    assert caught.value.details["resource_class"] == "VCPU" and caught.value.details["amount"] == 0
    with pytest.raises(InvalidInput) as caught:
        await store.set_inventory(rp, "CUSTOM_NONE", Inventory(total=1), 1)
    assert caught.value.details["resource_class"] == "CUSTOM_NONE" and caught.value.details["provider"] == rp
    assert caught.value.to_dict()["details"]["field"] == "resource_class"


def test_value_types_name_their_keyword() -> None:
    """The public value types refuse a field by the keyword the caller wrote."""
    for make in (lambda: Inventory(total=0), lambda: make_inventory(total=1, reserved=-1)):
        with pytest.raises(InvalidInput) as caught:
            make()
        assert caught.value.details["field"] in ("total", "reserved")
        assert "path" not in caught.value.details  # (a keyword as a whole: no path)
    with pytest.raises(InvalidInput) as caught:
        ConsumerAllocations(allocations={}, project_id="", user_id="u", consumer_type="X")
    assert caught.value.details == {"field": "project_id"}
    rp = str(uuid.uuid4())
    with pytest.raises(InvalidInput) as caught:
        ConsumerAllocations(allocations={rp: {"VCPU": 0}}, project_id="p", user_id="u", consumer_type="X")
    assert (caught.value.details["field"], caught.value.details["path"]) == (
        "allocations",
        ["allocations", rp, "VCPU"],
    )


def test_metadata_built_by_a_caller_refuses_as_invalid_input() -> None:
    """``evstore.Metadata`` is a public value type too. Regression: ``Metadata(request_id=5)`` raised
    pydantic's ValidationError (no code, no field) where Inventory and ConsumerAllocations raise
    InvalidInput; a command given such a value as a mapping already refused it with InvalidInput."""
    with pytest.raises(InvalidInput) as caught:
        Metadata(request_id=5)
    assert caught.value.code == INVALID
    assert caught.value.details["field"] == "request_id"
    assert "request_id" in str(caught.value)
    # what is valid still builds, with a caller's own keys, and typed as Metadata
    built = Metadata(request_id="req-1", tenant={"zone": 3})
    assert built.request_id == "req-1" and built.model_dump()["tenant"] == {"zone": 3}
    # decoding (every read of a stored event) does not go through it: pydantic runs a model's own
    # __init__ for model_validate_json too (1.8 -> 3.5 us per stored event's metadata), so none
    assert not Metadata.__pydantic_custom_init__


async def test_metadata_value_reaches_the_log(store: AllocationStore) -> None:
    """A Metadata built by the caller is accepted by a command and read back as given."""
    rp = await make_provider(store, VCPU=4)
    c = new_uuid()
    receipt = await store.set_allocations(
        c,
        {rp: {"VCPU": 1}},
        project_id="p",
        user_id="u",
        consumer_type="INSTANCE",
        generation=None,
        metadata=Metadata(request_id="req-9", actor="alice"),
    )
    [event] = await store.read(after=receipt.position - 1, limit=1)
    assert (event.metadata.request_id, event.metadata.actor) == ("req-9", "alice")


async def test_metadata_size_is_bounded(store: AllocationStore) -> None:
    """Every event of a command stores its metadata. Regression: it had no bound - a caller's
    10 MB document was copied into each event of the command (and the log kept it for good)."""
    rp = await make_provider(store, VCPU=4)
    head = await store.head()
    owner: dict[str, Any] = {
        "project_id": "p",
        "user_id": "u",
        "consumer_type": "INSTANCE",
        "generation": None,
    }
    big = {"request_id": "r", "note": "x" * 70_000}
    with pytest.raises(InvalidInput) as caught:
        await store.set_allocations(new_uuid(), {rp: {"VCPU": 1}}, **owner, metadata=big)
    assert caught.value.details["field"] == "metadata" and "too large" in str(caught.value)
    # counted as stored: a non-ASCII character is stored escaped (\u00e9: 6 bytes)
    with pytest.raises(InvalidInput):
        await store.set_allocations(
            new_uuid(), {rp: {"VCPU": 1}}, **owner, metadata={"note": "\u00e9" * 40_000}
        )
    with pytest.raises(InvalidInput), command_metadata(note="y" * 70_000):
        pass
    assert await store.head() == head  # nothing written
    # metadata command_metadata accepts is not refused by the commands in it for the keys evstore
    # adds (its name, its id, an idempotency key: helper-120 found them counted against the caller)
    with command_metadata(note="w" * (65_536 - 20)):
        keyed = await store.set_allocations(
            new_uuid(), {rp: {"VCPU": 1}}, **owner, idempotency_key="\U0001f600" * 255
        )
    assert keyed.positions
    # what a service puts there is far below it
    fits = {"request_id": "r", "note": "z" * 60_000}
    receipt = await store.set_allocations(new_uuid(), {rp: {"VCPU": 1}}, **owner, metadata=fits)
    [event] = await store.read(after=receipt.position - 1, limit=1)
    assert event.metadata.model_dump()["note"] == fits["note"]


async def test_time_travel_views_name_their_argument(store: AllocationStore) -> None:
    """``state_at``'s view answers the store's queries with the store's details; a slice asked
    about another entity names the argument too, as ``Diff.consumer`` names its ``uuid``."""
    rp = await make_provider(store, VCPU=8)
    c = new_uuid()
    await allocate(store, c, {rp: {"VCPU": 1}})
    head = await store.head()
    view = await store.state_at(head)
    for call, field in (
        (lambda: view.usage("x"), "provider"),
        (lambda: view.inventories("x"), "provider"),
        (lambda: view.provider_allocations("x"), "provider"),
        (lambda: view.allocations("x"), "consumer"),
        (lambda: view.usages("p", ""), "user_id"),
        (lambda: view.usages("p", consumer_type="x"), "consumer_type"),
    ):
        with pytest.raises(InvalidInput) as caught:
            await call()
        assert caught.value.details["field"] == field
    sliced = await store.state_at(head, provider=rp)
    with pytest.raises(InvalidInput, match="only; ask state_at") as caught:
        await sliced.usage(new_uuid())
    assert caught.value.details["field"] == "provider"
    diff = await store.diff(0, head)
    with pytest.raises(InvalidInput) as caught:
        diff.consumer("x")
    assert caught.value.details["field"] == "uuid"


async def test_every_batch_size_the_checks_accept_works(store_url: str) -> None:
    """Regression: ``batch_size`` is accepted from 1 to 2**63-1 (``_count``), but ``rebuild`` given
    one of 2**31 or more failed with ``evstore.log.corrupt`` "The log holds a number too large to
    store in the projection" - a sound log blamed for the argument (SQLite's ``fetchmany`` and
    asyncpg's cursor take a C int) - and PostgreSQL's ``import_events`` raised a bare
    ``OverflowError``. Each method taking a batch size must work at the top of the range."""
    huge = 2**63 - 1
    async with open_store(store_url) as store:
        rp = await make_provider(store, VCPU=8)
        await allocate(store, new_uuid(), {rp: {"VCPU": 1}})
        head = await store.head()
        assert await store.rebuild(huge) == head
        assert await store.rebuild(huge, full=True) == head
        assert [e.position async for e in store.history(rp, batch_size=huge)] == [1, 2, 3]
        assert (await _first(store.subscribe(0, batch_size=huge))).position == 1
        lines = [line async for line in store.export(huge)]
    other = store_url.replace("evstore.db", "imported.db") if store_url.startswith("sqlite") else None
    if other is None:
        from tests.pg import fresh_database_url

        other = fresh_database_url()
    async with open_store(other) as copy:
        assert await copy.import_events(lambda: iter(lines), batch_size=huge) == head
        assert (await copy.audit()).clean


@pytest.mark.parametrize(
    ("metadata", "path"),
    [
        ({"request_id": "req-\ud800"}, ["metadata", "request_id"]),
        ({"mine": ["ok", {"deep": "x\udfff"}]}, ["metadata", "mine", "1", "deep"]),
        ({"ok": 1, "bad\ud800key": 2}, ["metadata", "bad\ud800key"]),
    ],
)
async def test_a_lone_surrogate_in_metadata_is_named_where_it_is(
    store: AllocationStore, metadata: dict[str, Any], path: list[str]
) -> None:
    """Regression: a string of the metadata that is not valid Unicode text (a lone surrogate) was
    refused as "metadata is not valid: a value is not valid unicode text (Invalid JSON: unexpected
    end of hex escape at line 1 column 89)" - the JSON decoder's words about evstore's own encoding,
    with no ``details["path"]``: the caller could not tell which value. As every other string
    argument says it, and with the keys down to it, as the README promises for a problem inside."""
    with pytest.raises(InvalidInput) as caught:
        await store.create_provider(new_uuid(), "rp", metadata=metadata)
    assert caught.value.details["field"] == "metadata"
    assert caught.value.details["path"] == path
    assert "lone surrogate" in caught.value.message and "Invalid JSON" not in caught.value.message
    assert await store.head() == 0
