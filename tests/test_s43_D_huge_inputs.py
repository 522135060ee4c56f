"""Stop 43, helper D: huge but valid inputs, as a demanding service sends them.

Two refusals named every class or provider of the command in their message, Placement's wording
joined whole: removing the inventory of 10,000 classes in use gave a 170 KB message, an allocation
over 10,000 providers without the inventory asked for 370 KB - and each became a ``command.rejected``
log line of that size. The message now names the first 20 and how many more, saying where the
full list is (``details``, which still holds every one); up to 20 it reads as Placement's."""

from __future__ import annotations

from evstore import AllocationStore, InvalidInput, InvalidInventory, Inventory, InventoryInUse
from tests.conftest import make_provider, new_uuid

MANY = 60


async def test_removing_many_classes_in_use_is_a_short_message_with_every_class_in_details(
    store: AllocationStore,
) -> None:
    classes = [f"CUSTOM_C{i:03d}" for i in range(MANY)]
    for rc in classes:
        await store.create_resource_class(rc)
    rp = new_uuid()
    await store.create_provider(rp, f"rp-{rp}")
    generation = await store.set_inventories(rp, {rc: Inventory(total=5) for rc in classes}, generation=0)
    await store.set_allocations(
        new_uuid(),
        {rp: dict.fromkeys(classes, 1)},
        project_id="p",
        user_id="u",
        consumer_type="I",
        generation=None,
    )
    head = await store.head()
    try:
        await store.set_inventories(rp, {}, generation=generation + 1)
        raise AssertionError("removing inventory in use was accepted")
    except InventoryInUse as exc:
        assert exc.code == "placement.inventory.inuse"
        assert sorted(exc.details["resource_classes"]) == classes
        assert len(exc.message) < 1500, len(exc.message)
        assert "CUSTOM_C000" in exc.message and f"and {MANY - 20} more" in exc.message
        assert 'details["resource_classes"]' in exc.message
    assert await store.head() == head


async def test_a_few_classes_in_use_are_named_as_placement_names_them(store: AllocationStore) -> None:
    rp = await make_provider(store, VCPU=8, MEMORY_MB=1024)
    await store.set_allocations(
        new_uuid(),
        {rp: {"VCPU": 1, "MEMORY_MB": 1}},
        project_id="p",
        user_id="u",
        consumer_type="I",
        generation=None,
    )
    generation = (await store.provider(rp)).generation
    try:
        await store.set_inventories(rp, {}, generation=generation)
        raise AssertionError("removing inventory in use was accepted")
    except InventoryInUse as exc:
        assert exc.message == (
            f"update conflict: Inventory for 'VCPU, MEMORY_MB' on resource provider '{rp}' in use."
        )


async def test_an_allocation_over_many_providers_without_the_class_is_a_short_message(
    store: AllocationStore,
) -> None:
    providers = [await make_provider(store, DISK_GB=10) for _ in range(MANY)]
    head = await store.head()
    try:
        await store.set_allocations(
            new_uuid(),
            {rp: {"VCPU": 1} for rp in providers},
            project_id="p",
            user_id="u",
            consumer_type="I",
            generation=None,
        )
        raise AssertionError("an allocation on providers without the class was accepted")
    except InvalidInventory as exc:
        assert exc.code == "evstore.inventory.invalid"
        assert exc.details["providers"] == providers and exc.details["resource_classes"] == ["VCPU"]
        assert len(exc.message) < 1500, len(exc.message)
        assert providers[0] in exc.message and providers[-1] not in exc.message
        assert f"and {MANY - 20} more" in exc.message and 'details["providers"]' in exc.message
    assert await store.head() == head


class _LibraryInt:
    """An integer of another library, as numpy's ``int64`` is: ``__index__``, a repr like an int's,
    and no subclass of ``int``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return str(self.value)


async def test_an_integer_of_another_library_is_refused_naming_its_type(store: AllocationStore) -> None:
    """It was refused as "Amount of VCPU must be an integer, got 2", which reads as nonsense."""
    rp = await make_provider(store, VCPU=8)
    try:
        await store.set_allocations(
            new_uuid(),
            {rp: {"VCPU": _LibraryInt(2)}},
            project_id="p",
            user_id="u",
            consumer_type="I",
            generation=None,
        )
        raise AssertionError("a non-int amount was accepted")
    except InvalidInput as exc:
        assert exc.details["path"] == ["allocations", rp, "VCPU"]
        assert "_LibraryInt, not int" in exc.message and "int(value)" in exc.message
