"""Business rules as given-events / when-command / then-events-or-error, with no database.

Placement-exact where SPEC.md says so: check order, capacity with the over-capacity tolerance,
per-row min/max/step, generation arithmetic.
"""

from __future__ import annotations

import copy
import uuid
from decimal import Decimal
from fractions import Fraction

import pytest

from evstore import errors as err
from evstore import events as ev
from evstore.commands import (
    ConfirmMigration,
    ConsumerWrite,
    CreateProvider,
    CreateResourceClass,
    DeleteConsumer,
    DeleteInventory,
    DeleteProvider,
    Release,
    RenameProvider,
    RevertMigration,
    SetInventories,
    SetInventory,
    StartMigration,
    WriteAllocations,
    decide,
)
from evstore.schema import Inventory, normalize_uuid
from projections.state import ConsumerState, State, evolve

RP1 = "00000000-0000-0000-0000-0000000000a1"
RP2 = "00000000-0000-0000-0000-0000000000a2"
RP3 = "00000000-0000-0000-0000-0000000000a3"
C1 = "00000000-0000-0000-0000-0000000000c1"
C2 = "00000000-0000-0000-0000-0000000000c2"
C3 = "00000000-0000-0000-0000-0000000000c3"
C4 = "00000000-0000-0000-0000-0000000000c4"
C5 = "00000000-0000-0000-0000-0000000000c5"
MIG = "00000000-0000-0000-0000-0000000000f1"


def given(*events: ev.EventBase) -> State:
    state = State()
    for i, e in enumerate(events, start=1):
        evolve(state, e, i)
    return state


def when(state: State, command: object) -> list[ev.EventBase]:
    """Decide, then fold the result into ``state`` (so the next ``when`` sees it)."""
    events = decide(command, state)  # type: ignore[arg-type]
    for e in events:
        evolve(state, e, state.position + 1)
    return events


def provider(uuid: str, name: str, **inventories: Inventory) -> list[ev.EventBase]:
    out: list[ev.EventBase] = [ev.ProviderCreated(provider=uuid, name=name, root=uuid)]
    if inventories:
        out.append(ev.InventoriesReplaced(provider=uuid, inventories=inventories, generation=1))
    return out


def write(
    consumer: str,
    allocs: dict[str, dict[str, int]],
    generation: int | None = None,
    project: str = "p",
    user: str = "u",
    ctype: str = "INSTANCE",
) -> ConsumerWrite:
    return ConsumerWrite(consumer, allocs, project, user, ctype, generation)


def one(*writes: ConsumerWrite) -> WriteAllocations:
    return WriteAllocations(tuple(writes))


def cloud(**inventories: Inventory) -> State:
    return given(*provider(RP1, "rp1", **inventories))


# --- allocations: generations ----------------------------------------------------------------


def test_new_consumer_is_first_seen_at_generation_1_and_provider_bumped_once() -> None:
    state = cloud(VCPU=Inventory(total=8), MEMORY_MB=Inventory(total=1024))
    [e] = when(state, one(write(C1, {RP1: {"VCPU": 2, "MEMORY_MB": 256}})))
    assert isinstance(e, ev.AllocationsReplaced)
    assert e.generation == 1
    assert e.provider_generations == {RP1: 2}
    assert state.consumers[C1].generation == 1
    assert state.providers[RP1].usages == {"VCPU": 2, "MEMORY_MB": 256}


def test_generation_mismatch_uses_placements_wording() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.ConcurrentUpdate, match="consumer generation conflict - expected 1 but got 7"):
        when(state, one(write(C1, {RP1: {"VCPU": 2}}, generation=7)))
    with pytest.raises(err.ConcurrentUpdate, match="expected 1 but got None"):
        when(state, one(write(C1, {RP1: {"VCPU": 2}}, generation=None)))
    with pytest.raises(err.ConcurrentUpdate, match="expected null but got 3"):
        when(state, one(write(C2, {RP1: {"VCPU": 2}}, generation=3)))


def test_generation_checks_run_first_in_the_order_given() -> None:
    # C2 has a stale generation AND RP2 does not exist: the generation error wins (Placement order).
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C2, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.ConcurrentUpdate, match="expected 1 but got 5"):
        when(state, one(write(C1, {RP2: {"VCPU": 1}}), write(C2, {RP1: {"VCPU": 1}}, generation=5)))


def test_unknown_provider_before_inventory_and_capacity() -> None:
    state = cloud(VCPU=Inventory(total=1))
    with pytest.raises(err.ProviderNotFound, match="that does not exist"):
        when(state, one(write(C1, {RP1: {"VCPU": 99}, RP2: {"VCPU": 1}})))
    # ... and before unknown classes (Placement checks the providers first)
    with pytest.raises(err.ProviderNotFound, match="that does not exist"):
        when(state, one(write(C1, {RP1: {"CUSTOM_NOPE": 1}, RP2: {"VCPU": 1}})))


def test_provider_without_inventory_for_any_requested_class() -> None:
    state = cloud(VCPU=Inventory(total=8))
    with pytest.raises(err.InvalidInventory, match="on resource provider"):
        when(state, one(write(C1, {RP1: {"DISK_GB": 10}})))


def test_a_provider_with_none_of_the_classes_is_refused_before_any_row_is_checked() -> None:
    # Placement's order: "no inventory of any class of the command" is checked for every provider
    # named before the rows' constraints and capacity, so RP1's over-capacity row does not win.
    state = given(
        *provider(RP1, "rp1", VCPU=Inventory(total=1)), *provider(RP2, "rp2", DISK_GB=Inventory(total=8))
    )
    with pytest.raises(err.InvalidInventory) as info:
        when(state, one(write(C1, {RP1: {"VCPU": 5}, RP2: {"VCPU": 1}})))
    assert info.value.details["providers"] == [RP2]


def test_missing_class_on_a_provider_that_has_some_other_requested_class() -> None:
    state = given(
        *provider(RP1, "rp1", VCPU=Inventory(total=8)), *provider(RP2, "rp2", DISK_GB=Inventory(total=8))
    )
    with pytest.raises(err.InvalidInventory, match="Inventory for 'DISK_GB' on resource provider"):
        when(state, one(write(C1, {RP1: {"VCPU": 1, "DISK_GB": 1}, RP2: {"DISK_GB": 1}})))


def test_unknown_custom_class_is_rejected_until_created() -> None:
    state = cloud(VCPU=Inventory(total=8))
    with pytest.raises(err.UnknownResourceClass):
        when(state, one(write(C1, {RP1: {"CUSTOM_GOLD": 1}})))
    assert when(state, CreateResourceClass("CUSTOM_GOLD")) == [ev.ResourceClassCreated(name="CUSTOM_GOLD")]
    assert when(state, CreateResourceClass("CUSTOM_GOLD")) == []  # again: nothing new to record
    when(state, SetInventories(RP1, {"VCPU": Inventory(total=8), "CUSTOM_GOLD": Inventory(total=2)}, 1))
    when(state, one(write(C1, {RP1: {"CUSTOM_GOLD": 2}})))
    assert state.providers[RP1].usages == {"CUSTOM_GOLD": 2}


@pytest.mark.parametrize("name", ["CUSTOM_", "VCPU", "GOLD"])
def test_a_custom_class_needs_a_name_after_the_prefix(name: str) -> None:
    # Placement: ^CUSTOM_[A-Z0-9_]+$ ("CUSTOM_" alone was accepted)
    with pytest.raises(err.InvalidInput, match="Custom resource classes must be CUSTOM_ followed by"):
        when(cloud(VCPU=Inventory(total=8)), CreateResourceClass(name))


# --- allocations: rows, constraints and capacity ---------------------------------------------


@pytest.mark.parametrize("amount", [5, 1000 + 10, 15])
def test_min_max_step_per_row(amount: int) -> None:
    state = cloud(DISK_GB=Inventory(total=2048, min_unit=10, max_unit=1000, step_size=10))
    with pytest.raises(err.ConstraintViolation, match="violate inventory constraints"):
        when(state, one(write(C1, {RP1: {"DISK_GB": amount}})))


def test_a_constraint_violation_says_what_placement_says_first() -> None:
    """Regression (stop 23, helper-46): the message began "Unable to allocate inventory: Allocation
    for DISK_GB on resource provider ... violates min_unit ..." - Placement's detail is "Unable to
    allocate inventory: Unable to create allocation for 'DISK_GB' on resource provider '<uuid>'. The
    requested amount would violate inventory constraints." (InvalidAllocationConstraintsViolated
    under the handler's prefix), which a caller written for Placement matches on. Placement's text
    first, then the limits and the amount."""
    state = cloud(DISK_GB=Inventory(total=2048, min_unit=10, max_unit=1000, step_size=10))
    with pytest.raises(err.ConstraintViolation) as caught:
        when(state, one(write(C1, {RP1: {"DISK_GB": 15}})))
    assert caught.value.message == (
        f"Unable to allocate inventory: Unable to create allocation for 'DISK_GB' on resource provider "
        f"'{RP1}'. The requested amount would violate inventory constraints. "
        "(min_unit 10, max_unit 1000, step_size 10; requested 15)"
    )


@pytest.mark.parametrize(
    ("inventory", "amount"),
    [
        (Inventory(total=100, min_unit=20, step_size=10), 10),  # a whole step, below min_unit
        (Inventory(total=100, max_unit=20, step_size=10), 30),  # a whole step, above max_unit
        (Inventory(total=100, min_unit=4, step_size=4), 6),  # between min and max, off the step
    ],
)
def test_each_of_min_max_and_step_refuses_on_its_own(inventory: Inventory, amount: int) -> None:
    state = cloud(DISK_GB=inventory)
    with pytest.raises(err.ConstraintViolation, match="violate inventory constraints"):
        when(state, one(write(C1, {RP1: {"DISK_GB": amount}})))
    assert C1 not in state.consumers


def test_constraints_are_checked_per_row_not_on_the_sum() -> None:
    # Two consumers of 600 each: each row is within max_unit 1000 although the sum is not.
    state = cloud(DISK_GB=Inventory(total=2048, max_unit=1000))
    events = when(state, one(write(C1, {RP1: {"DISK_GB": 600}}), write(C2, {RP1: {"DISK_GB": 600}})))
    assert len(events) == 2
    assert state.providers[RP1].usages == {"DISK_GB": 1200}


def test_capacity_formula_is_a_float_not_truncated() -> None:
    # (3 - 0) * 1.5 = 4.5: 4 fits, 5 does not.
    state = cloud(VCPU=Inventory(total=3, allocation_ratio=1.5))
    when(state, one(write(C1, {RP1: {"VCPU": 4}})))
    with pytest.raises(err.CapacityExceeded, match="exceed the capacity") as info:
        when(state, one(write(C2, {RP1: {"VCPU": 1}})))
    assert info.value.details["capacity"] == 4.5  # (reported as Placement computes it)


def test_a_capacity_error_states_the_capacity_exactly() -> None:
    """Regression (rev22, found by a black-box probe of SPEC's capacity rule): the message printed
    the capacity with ``:g``, six significant digits - "capacity 2.14748e+09" for a provider of
    2147483647 MB - so a person could not see by how much the request missed."""
    state = cloud(MEMORY_MB=Inventory(total=2147483647))
    when(state, one(write(C1, {RP1: {"MEMORY_MB": 2147483000}})))
    with pytest.raises(err.CapacityExceeded) as caught:
        when(state, one(write(C2, {RP1: {"MEMORY_MB": 1000}})))
    assert "(capacity 2147483647, used 2147483000, requested 1000)" in caught.value.message
    # a capacity that is not a whole number is shown as it is compared: not rounded
    state = cloud(VCPU=Inventory(total=7, allocation_ratio=1.1))  # 7.700000000000001
    with pytest.raises(err.CapacityExceeded) as caught:
        when(state, one(write(C1, {RP1: {"VCPU": 8}})))
    assert f"(capacity {7 * 1.1!r}, used 0, requested 8)" in caught.value.message


def test_reserved_reduces_capacity() -> None:
    state = cloud(VCPU=Inventory(total=8, reserved=6))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))
    with pytest.raises(err.CapacityExceeded):
        when(state, one(write(C2, {RP1: {"VCPU": 1}})))


def test_capacity_uses_the_running_sum_of_the_command() -> None:
    state = cloud(VCPU=Inventory(total=4))
    with pytest.raises(err.CapacityExceeded):
        when(state, one(write(C1, {RP1: {"VCPU": 3}}), write(C2, {RP1: {"VCPU": 2}})))
    assert state.providers[RP1].usages == {}


def test_first_failing_row_decides_the_error() -> None:
    state = given(
        *provider(RP1, "rp1", VCPU=Inventory(total=1)),
        *provider(RP2, "rp2", VCPU=Inventory(total=8, step_size=2)),
    )
    # Row order: RP2 VCPU 3 (constraint) comes before RP1 VCPU 5 (capacity).
    with pytest.raises(err.ConstraintViolation):
        when(state, one(write(C1, {RP2: {"VCPU": 3}, RP1: {"VCPU": 5}})))
    with pytest.raises(err.CapacityExceeded):
        when(state, one(write(C1, {RP1: {"VCPU": 5}, RP2: {"VCPU": 3}})))


def test_replace_semantics_let_a_swap_succeed_on_a_full_provider() -> None:
    state = cloud(VCPU=Inventory(total=4))
    when(state, one(write(C1, {RP1: {"VCPU": 4}})))
    events = when(state, one(write(C1, {}, generation=1), write(C2, {RP1: {"VCPU": 3}})))
    assert [type(e) for e in events] == [ev.AllocationsReplaced, ev.AllocationsReplaced]
    # the swap bumps the provider once, carried by the first event naming it
    assert events[0].provider_generations == {RP1: 3}  # type: ignore[attr-defined]
    assert events[1].provider_generations == {}  # type: ignore[attr-defined]
    assert C1 not in state.consumers  # emptied: absent again
    assert state.consumers[C2].generation == 1
    assert state.consumers[C2].on_behalf_of is None  # other amounts: not a move
    assert state.providers[RP1].generation == 3


def test_a_plain_write_that_moves_every_allocation_is_recorded_as_a_migration() -> None:
    state = cloud(VCPU=Inventory(total=4))
    when(state, one(write(C1, {RP1: {"VCPU": 4}})))  # full: only a replace can move it
    events = when(state, one(write(C1, {}, generation=1), write(C2, {RP1: {"VCPU": 4}}, ctype="MIGRATION")))
    assert events == [
        ev.MigrationStarted(
            instance=C1,
            migration=C2,
            allocations={RP1: {"VCPU": 4}},
            project_id="p",
            user_id="u",
            instance_consumer_type="INSTANCE",
            instance_generation=1,
            migration_consumer_type="MIGRATION",
            migration_generation=1,
            provider_generations={RP1: 3},
        )
    ]
    assert C1 not in state.consumers  # the same outcome as the plain write...
    assert state.consumers[C2].generation == 1
    assert state.providers[RP1].generation == 3
    assert state.consumers[C2].on_behalf_of == C1  # ...and C2 holds it for C1
    deleted = when(state, DeleteConsumer(C1))
    assert deleted[0].migrations_released == {C2: {RP1: {"VCPU": 4}}}  # type: ignore[attr-defined]
    # for another project or user, or with a third consumer in the command: plain writes
    when(state, one(write(C3, {RP1: {"VCPU": 2}})))
    for writes in (
        (write(C3, {}, generation=1), write(C4, {RP1: {"VCPU": 2}}, project="q")),
        (write(C3, {}, generation=1), write(C4, {RP1: {"VCPU": 2}}), write(C5, {})),
    ):
        trial = copy.deepcopy(state)
        assert all(isinstance(e, ev.AllocationsReplaced) for e in when(trial, one(*writes)))


def test_a_move_out_of_a_migration_or_onto_a_holding_consumer_stays_a_plain_write() -> None:
    # A migration's allocations given to another consumer: the target does not become a migration
    # of the migration (SPEC: a source that is itself a migration stays a plain write).
    state = migrated()
    events = when(state, one(write(MIG, {}, generation=1), write(C2, {RP1: {"VCPU": 4}})))
    assert [type(e) for e in events] == [ev.AllocationsReplaced, ev.AllocationsReplaced]
    assert MIG not in state.consumers
    assert state.consumers[C2].on_behalf_of is None
    with pytest.raises(err.NotFound):
        when(state, RevertMigration(C2))
    # A target that already holds something is replaced, not started as a migration: its
    # generation goes on from its own.
    when(state, one(write(C3, {RP2: {"VCPU": 1}})))
    events = when(state, one(write(C2, {}, generation=1), write(C3, {RP1: {"VCPU": 4}}, generation=1)))
    assert [type(e) for e in events] == [ev.AllocationsReplaced, ev.AllocationsReplaced]
    assert state.consumers[C3].generation == 2
    assert state.consumers[C3].on_behalf_of is None
    assert state.providers[RP2].usages == {}


def test_over_capacity_tolerance_no_worse_is_accepted() -> None:
    # capacity 6, usage 12 (after a shrink): 12 -> 10 accepted, 10 -> 12 refused, 10 -> 10 accepted.
    state = cloud(VCPU=Inventory(total=16))
    when(state, one(write(C1, {RP1: {"VCPU": 12}})))
    when(state, SetInventories(RP1, {"VCPU": Inventory(total=6)}, state.providers[RP1].generation))
    assert state.providers[RP1].usages == {"VCPU": 12}
    when(state, one(write(C1, {RP1: {"VCPU": 10}}, generation=1)))
    with pytest.raises(err.CapacityExceeded):
        when(state, one(write(C1, {RP1: {"VCPU": 12}}, generation=2)))
    when(state, one(write(C1, {RP1: {"VCPU": 10}}, generation=2)))
    assert state.consumers[C1].generation == 3


def test_a_refusal_on_a_provider_already_over_capacity_says_what_would_be_accepted() -> None:
    """Regression (rev22, found by a black-box probe of the over-capacity tolerance): on a provider
    left over capacity by an inventory shrink, a refusal said only "(capacity 6, used 0, requested
    12)", though a change that leaves the usage no higher than before is accepted - the caller could
    not tell that 10 would go through."""
    state = cloud(VCPU=Inventory(total=16))
    when(state, one(write(C1, {RP1: {"VCPU": 10}})))
    when(state, SetInventories(RP1, {"VCPU": Inventory(total=6)}, state.providers[RP1].generation))
    with pytest.raises(err.CapacityExceeded) as caught:
        when(state, one(write(C1, {RP1: {"VCPU": 12}}, generation=1)))
    assert "(capacity 6, used 0, requested 12;" in caught.value.message
    assert "already over capacity" in caught.value.message
    assert "at or below 10" in caught.value.message
    assert caught.value.details["used_before"] == 10
    # not said where the tolerance cannot help (the provider was within its capacity)
    state = cloud(VCPU=Inventory(total=4))
    with pytest.raises(err.CapacityExceeded) as caught:
        when(state, one(write(C1, {RP1: {"VCPU": 5}})))
    assert "over capacity" not in caught.value.message


def test_rewrite_onto_another_provider_bumps_only_the_provider_named() -> None:
    state = given(
        *provider(RP1, "rp1", VCPU=Inventory(total=8)), *provider(RP2, "rp2", VCPU=Inventory(total=8))
    )
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))
    assert state.providers[RP1].generation == 2
    [e] = when(state, one(write(C1, {RP2: {"VCPU": 2}}, generation=1)))
    assert e.provider_generations == {RP2: 2}  # type: ignore[attr-defined]
    assert state.providers[RP1].generation == 2  # left, not named: not bumped
    assert state.providers[RP1].usages == {}


def test_emptying_a_consumer_bumps_the_providers_it_held() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))
    [e] = when(state, one(write(C1, {}, generation=1)))
    assert e.generation is None  # type: ignore[attr-defined]
    assert e.provider_generations == {RP1: 3}  # type: ignore[attr-defined]
    # absent again: the next write must say null
    with pytest.raises(err.ConcurrentUpdate, match="expected null but got 2"):
        when(state, one(write(C1, {RP1: {"VCPU": 1}}, generation=2)))
    when(state, one(write(C1, {RP1: {"VCPU": 1}}, generation=None)))
    assert state.consumers[C1].generation == 1


def test_empty_write_to_an_absent_consumer_creates_no_orphan() -> None:
    state = cloud(VCPU=Inventory(total=8))
    assert when(state, one(write(C1, {}))) == []
    assert C1 not in state.consumers


def test_release_bumps_nothing_and_needs_allocations() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))
    [e] = when(state, Release(C1))
    assert e == ev.AllocationsReleased(consumer=C1, released={RP1: {"VCPU": 2}})
    assert state.providers[RP1].generation == 2
    assert C1 not in state.consumers
    with pytest.raises(err.NotFound, match="No allocations for consumer"):
        when(state, Release(C1))


def test_a_consumer_twice_in_one_command_is_invalid() -> None:
    state = cloud(VCPU=Inventory(total=8))
    with pytest.raises(err.InvalidInput):
        when(state, one(write(C1, {RP1: {"VCPU": 1}}), write(C1, {RP1: {"VCPU": 1}})))


# --- inventories -------------------------------------------------------------------------------


def test_inventory_generation_check_and_bump() -> None:
    state = given(*provider(RP1, "rp1"))
    [e] = when(state, SetInventories(RP1, {"VCPU": Inventory(total=4)}, 0))
    assert e.generation == 1  # type: ignore[attr-defined]
    with pytest.raises(err.ConcurrentUpdate, match="resource provider generation conflict"):
        when(state, SetInventories(RP1, {"VCPU": Inventory(total=8)}, 0))


def test_shrinking_below_usage_is_allowed_but_removing_a_used_class_is_not() -> None:
    state = cloud(VCPU=Inventory(total=8), DISK_GB=Inventory(total=100))
    when(state, one(write(C1, {RP1: {"VCPU": 6}})))
    gen = state.providers[RP1].generation
    when(state, SetInventories(RP1, {"VCPU": Inventory(total=2), "DISK_GB": Inventory(total=100)}, gen))
    with pytest.raises(err.InventoryInUse, match="in use"):
        when(state, SetInventories(RP1, {"DISK_GB": Inventory(total=100)}, gen + 1))
    with pytest.raises(err.InventoryInUse):
        when(state, DeleteInventory(RP1, "VCPU"))
    # an unused class can go
    when(state, DeleteInventory(RP1, "DISK_GB"))
    assert set(state.providers[RP1].inventories) == {"VCPU"}
    assert state.providers[RP1].generation == gen + 2
    # ... also by a replace that leaves it out
    when(state, SetInventory(RP1, "DISK_GB", Inventory(total=100), gen + 2))
    when(state, SetInventories(RP1, {"VCPU": Inventory(total=2)}, gen + 3))
    assert set(state.providers[RP1].inventories) == {"VCPU"}


def test_reserved_may_equal_total_leaving_no_capacity() -> None:
    # Placement refuses reserved > total only: reserved == total is a provider taken out of use.
    state = cloud(VCPU=Inventory(total=8))
    [e] = when(state, SetInventories(RP1, {"VCPU": Inventory(total=4, reserved=4)}, 1))
    assert e.inventories["VCPU"].capacity == 0  # type: ignore[attr-defined]
    with pytest.raises(err.CapacityExceeded):
        when(state, one(write(C1, {RP1: {"VCPU": 1}})))


def test_set_single_inventory_and_delete_missing() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, SetInventory(RP1, "MEMORY_MB", Inventory(total=512), 1))
    assert set(state.providers[RP1].inventories) == {"VCPU", "MEMORY_MB"}
    with pytest.raises(err.NotFound):
        when(state, DeleteInventory(RP1, "DISK_GB"))


# --- providers -------------------------------------------------------------------------------


def test_provider_rules() -> None:
    state = given(*provider(RP1, "rp1", VCPU=Inventory(total=8)))
    # Placement's wording on create names the column taken (it named the new name for a uuid)
    for command, taken in (
        (CreateProvider(RP2, "rp1"), "name: rp1"),
        (CreateProvider(RP1, "other"), f"uuid: {RP1}"),
        (CreateProvider(RP1, "rp1"), f"uuid: {RP1}, name: rp1"),
    ):
        with pytest.raises(err.DuplicateName) as caught:
            when(state, command)
        assert caught.value.message == f"Conflicting resource provider {taken} already exists."
    # Placement's order: the parent before uniqueness
    with pytest.raises(err.ProviderNotFound, match=f"parent provider {RP2}"):
        when(state, CreateProvider(RP1, "rp1", parent=RP2))
    with pytest.raises(err.InvalidInput, match="its own parent"):
        when(state, CreateProvider(RP1, "rp1", parent=RP1))
    [created] = when(state, CreateProvider(RP2, "child", parent=RP1))
    assert created == ev.ProviderCreated(provider=RP2, name="child", parent=RP1, root=RP1)
    with pytest.raises(err.DuplicateName):  # a child's name is unique too
        when(state, CreateProvider(RP3, "rp1", parent=RP1))
    [grandchild] = when(state, CreateProvider(RP3, "grandchild", parent=RP2))
    assert when(state, RenameProvider(RP3, "grandchild")) == []  # its own name: nothing changes
    assert grandchild == ev.ProviderCreated(provider=RP3, name="grandchild", parent=RP2, root=RP1)
    when(state, DeleteProvider(RP3))
    with pytest.raises(err.CannotDeleteParent):
        when(state, DeleteProvider(RP1))
    with pytest.raises(err.DuplicateName):
        when(state, RenameProvider(RP2, "rp1"))
    when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.CannotDeleteParent):  # (Placement's order: children, then allocations)
        when(state, DeleteProvider(RP1))
    when(state, DeleteProvider(RP2))
    with pytest.raises(err.ProviderInUse):
        when(state, DeleteProvider(RP1))
    when(state, Release(C1))
    when(state, DeleteProvider(RP1))
    assert state.providers == {}


# --- migrations and tombstones ---------------------------------------------------------------


def migrated() -> State:
    state = given(
        *provider(RP1, "src", VCPU=Inventory(total=8)), *provider(RP2, "dst", VCPU=Inventory(total=8))
    )
    when(state, one(write(C1, {RP1: {"VCPU": 4}})))
    when(state, StartMigration(C1, MIG))
    return state


def test_start_migration_moves_everything_to_the_migration_on_behalf_of_the_instance() -> None:
    state = migrated()
    assert C1 not in state.consumers  # absent
    mig = state.consumers[MIG]
    assert mig.allocations == {RP1: {"VCPU": 4}}
    assert mig.on_behalf_of == C1
    assert mig.consumer_type == "MIGRATION"
    assert mig.generation == 1
    assert state.providers[RP1].generation == 3  # one bump for the move
    assert state.providers[RP1].usages == {"VCPU": 4}


def test_revert_replaces_destination_allocations_and_empties_the_migration() -> None:
    state = migrated()
    when(state, one(write(C1, {RP2: {"VCPU": 4}})))  # scheduler claims the destination
    [e] = when(state, RevertMigration(MIG))
    assert isinstance(e, ev.MigrationReverted)
    assert e.replaced == {RP2: {"VCPU": 4}}
    assert state.consumers[C1].allocations == {RP1: {"VCPU": 4}}
    assert state.consumers[C1].generation == 2
    assert MIG not in state.consumers
    assert state.providers[RP2].usages == {}
    assert e.provider_generations == {RP1: 4}  # destination only loses allocations: not bumped


def test_confirm_releases_the_source() -> None:
    state = migrated()
    when(state, one(write(C1, {RP2: {"VCPU": 4}})))
    [e] = when(state, ConfirmMigration(MIG))
    assert e == ev.MigrationConfirmed(migration=MIG, instance=C1, released={RP1: {"VCPU": 4}})
    assert state.providers[RP1].usages == {}
    assert state.consumers[C1].allocations == {RP2: {"VCPU": 4}}
    with pytest.raises(err.NotFound):
        when(state, RevertMigration(MIG))
    # the migration consumer is done with: deleting the instance later does not reach it
    assert MIG not in state.consumers
    when(state, DeleteConsumer(C1))
    when(state, one(write(MIG, {RP1: {"VCPU": 1}})))
    assert state.consumers[MIG].generation == 1


def test_emptying_a_migration_by_a_plain_write_ends_its_link_to_the_instance() -> None:
    # (Nova's move_allocations back: the migration no longer holds anything for anyone)
    state = migrated()
    when(state, one(write(MIG, {}, generation=1)))
    assert MIG not in state.consumers
    when(state, DeleteConsumer(C1))
    [e] = when(state, one(write(MIG, {RP1: {"VCPU": 1}})))
    assert isinstance(e, ev.AllocationsReplaced) and state.consumers[MIG].on_behalf_of is None


def test_delete_releases_the_instance_and_its_migrations_in_one_event() -> None:
    state = migrated()
    when(state, one(write(C1, {RP2: {"VCPU": 4}})))
    [e] = when(state, DeleteConsumer(C1))
    assert e == ev.ConsumerDeleted(
        consumer=C1, released={RP2: {"VCPU": 4}}, migrations_released={MIG: {RP1: {"VCPU": 4}}}
    )
    assert state.providers[RP1].usages == {} and state.providers[RP2].usages == {}
    assert state.consumers[C1].deleted


def test_revert_to_a_tombstoned_instance_is_rejected() -> None:
    state = migrated()
    when(state, DeleteConsumer(C1))
    with pytest.raises(err.ConsumerDeleted) as info:
        when(state, RevertMigration(MIG))
    assert info.value.code == "evstore.consumer.deleted"


def test_a_deleted_migration_consumer_cannot_be_reverted_or_confirmed() -> None:
    state = migrated()
    [e] = when(state, DeleteConsumer(MIG))
    assert e.released == {RP1: {"VCPU": 4}}  # type: ignore[attr-defined]
    for command, verb in ((RevertMigration(MIG), "revert"), (ConfirmMigration(MIG), "confirm")):
        # (regression, rev25: the refusal said "no allocations can be written for it any more",
        # about a write the caller did not ask for)
        with pytest.raises(
            err.ConsumerDeleted, match=f"was deleted at position .*no migration of it to {verb}$"
        ):
            when(state, command)
    assert state.providers[RP1].usages == {}


def test_a_revert_to_a_deleted_instance_is_refused_even_if_its_migration_still_holds() -> None:
    # A log written before delete released migrations (or imported): the instance is tombstoned
    # while its migration still holds. A revert would give the allocations to the tombstone (a
    # leak); a confirm releases them.
    state = migrated()
    evolve(state, ev.ConsumerDeleted(consumer=C1, released={}, migrations_released={}), state.position + 1)
    # (regression, s35: the refusal said "they were released with the instance", which this
    # migration's allocations were not: it names the confirm that releases them)
    with pytest.raises(err.ConsumerDeleted, match=f"still holds them.*confirm migration {MIG}") as info:
        when(state, RevertMigration(MIG))
    assert "released with the instance" not in str(info.value)
    [e] = when(state, ConfirmMigration(MIG))
    assert e == ev.MigrationConfirmed(migration=MIG, instance=C1, released={RP1: {"VCPU": 4}})
    assert state.providers[RP1].usages == {}


def test_what_a_consumer_holds_is_checked_and_recorded_in_one_order_whatever_order_it_is_held() -> None:
    """Regression (s35 acceptance probe): start_migration, revert_migration and the other commands
    that take their rows from what a consumer holds took them in the order the state held them:
    its last write's order in the SQLite writer's cache, sorted once loaded from the database
    (PostgreSQL, a SQLite writer that had not cached it). So one command on one store named
    another class in its refusal - and recorded its payload in another order - by backend and by
    cache. They take them in the order ``allocations()`` shows now."""
    tight = {"VCPU": Inventory(total=16, max_unit=2), "MEMORY_MB": Inventory(total=2048, max_unit=100)}
    refusals: list[tuple[object, ...]] = []
    payloads: list[tuple[str, ...]] = []
    for order in (["VCPU", "MEMORY_MB"], ["MEMORY_MB", "VCPU"]):
        held = {RP1: {rc: {"VCPU": 4, "MEMORY_MB": 500}[rc] for rc in order}}
        roomy = {"VCPU": Inventory(total=16), "MEMORY_MB": Inventory(total=2048)}
        state = cloud(**roomy)
        when(state, one(write(C1, held), write(C2, held)))
        [started] = decide(StartMigration(C1, MIG), state)
        [released] = decide(Release(C2), state)
        [deleted] = decide(DeleteConsumer(C2), state)
        [emptied] = decide(one(write(C2, {}, generation=1)), state)
        when(state, StartMigration(C1, MIG))
        when(state, one(write(C1, held)))
        [reverted] = decide(RevertMigration(MIG), state)
        [confirmed] = decide(ConfirmMigration(MIG), state)
        payloads.append(
            tuple(e.payload_json() for e in (started, released, deleted, emptied, reverted, confirmed))
        )
        when(state, SetInventories(RP1, tight, state.providers[RP1].generation))
        for command in (RevertMigration(MIG), StartMigration(C2, C3)):
            with pytest.raises(err.ConstraintViolation) as info:
                decide(command, state)
            refusals.append((type(command).__name__, str(info.value), info.value.details))
    assert refusals[:2] == refusals[2:]
    assert payloads[0] == payloads[1]
    assert '"MEMORY_MB":500,"VCPU":4' in payloads[0][0]  # (sorted, as allocations() shows it)


@pytest.mark.parametrize("generation", [None, 0, 1, 5])
def test_no_write_can_resurrect_a_tombstoned_consumer(generation: int | None) -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, DeleteConsumer(C1))  # never seen: the tombstone is still recorded
    assert state.consumers[C1].deleted
    with pytest.raises(err.ConsumerDeleted):
        when(state, one(write(C1, {RP1: {"VCPU": 1}}, generation=generation)))
    # the way Nova's move_allocations would revert: empty the migration, fill the instance with null
    with pytest.raises(err.ConsumerDeleted):
        when(state, one(write(C2, {}), write(C1, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.ConsumerDeleted):
        when(state, StartMigration(C2, C1))


def test_deleting_twice_changes_nothing() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, DeleteConsumer(C1))
    assert when(state, DeleteConsumer(C1)) == []


def test_start_migration_preconditions() -> None:
    state = cloud(VCPU=Inventory(total=8))
    with pytest.raises(err.NotFound):
        when(state, StartMigration(C1, MIG))
    when(state, one(write(C1, {RP1: {"VCPU": 1}}), write(C2, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.ConcurrentUpdate, match="expected 1 but got None"):
        when(state, StartMigration(C1, C2))  # the migration consumer must be absent
    with pytest.raises(err.InvalidInput):
        when(state, StartMigration(C1, C1))
    with pytest.raises(err.NotFound):  # an instance holding nothing, before a target holding
        when(state, StartMigration(C3, C2))
    # a migration is not migrated again
    when(state, one(write(C2, {}, generation=1)))
    when(state, StartMigration(C1, MIG))
    with pytest.raises(err.InvalidInput, match="itself a migration"):
        when(state, StartMigration(MIG, C2))
    # a deleted instance: ConsumerDeleted (not "holds nothing")
    when(state, one(write(C3, {RP1: {"VCPU": 1}})))
    when(state, DeleteConsumer(C3))
    with pytest.raises(err.ConsumerDeleted):
        when(state, StartMigration(C3, C4))


def test_the_migration_of_a_deleted_instance_cannot_be_started_again_for_another() -> None:
    """Regression (rev22 conformance probe): once its instance was deleted, a migration consumer
    refused a plain write (ConsumerDeleted) but start_migration(other, it) took it, linking it to
    the other instance: a late revert of the deleted instance's migration would then have moved
    the other instance's allocations. Both refuse now, and nothing is written."""
    state = migrated()
    when(state, DeleteConsumer(C1))
    when(state, one(write(C2, {RP2: {"VCPU": 1}})))
    with pytest.raises(err.ConsumerDeleted, match="was deleted") as caught:
        when(state, StartMigration(C2, MIG))
    assert caught.value.details["migration"] == MIG and caught.value.details["consumer"] == C1
    with pytest.raises(err.ConsumerDeleted):
        when(state, one(write(MIG, {RP2: {"VCPU": 1}}, ctype="MIGRATION")))
    assert state.consumers[C2].allocations == {RP2: {"VCPU": 1}}
    # a migration consumer that was never linked, or whose instance lives, is unaffected
    when(state, StartMigration(C2, C3))
    assert state.consumers[C3].on_behalf_of == C2


def test_a_migration_still_holding_for_a_deleted_instance_is_a_generation_conflict_first() -> None:
    """Only an imported, leaking log has it (the audit reports the leak): a migration consumer still
    holding allocations for a deleted instance. Used for another instance, the refusal is the
    generation conflict Placement's check order gives a target that holds allocations (helper-44),
    not ConsumerDeleted."""
    state = migrated()
    # deleted without releasing its migration (a buggy writer's log)
    state.consumers[C1] = ConsumerState(C1, deleted=True, deleted_at=state.position)
    when(state, one(write(C2, {RP2: {"VCPU": 1}})))
    with pytest.raises(err.ConcurrentUpdate, match="already holds allocations"):
        when(state, StartMigration(C2, MIG))


def test_start_migration_into_a_consumer_holding_allocations_says_so() -> None:
    """Regression (rev22, found by a black-box probe of start_migration's preconditions): the
    refusal was only Placement's "consumer generation conflict - expected 1 but got None", about a
    generation the caller of start_migration never sends; it now names the migration consumer and
    why it must be absent (the code and Placement's words stay first)."""
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1}}), write(C2, {RP1: {"VCPU": 1}})))
    with pytest.raises(err.ConcurrentUpdate) as caught:
        when(state, StartMigration(C1, C2))
    assert caught.value.message.startswith("consumer generation conflict - expected 1 but got None")
    assert f"migration consumer {C2} already holds allocations" in caught.value.message
    assert caught.value.details["consumer"] == C2


def test_revert_after_delete_order_ends_with_zero_usage() -> None:
    state = migrated()
    when(state, RevertMigration(MIG))
    when(state, DeleteConsumer(C1))
    assert state.providers[RP1].usages == {}
    assert MIG not in state.consumers or not state.consumers[MIG].allocations


def test_inventory_rejects_insane_values() -> None:
    from evstore.schema import make_inventory

    with pytest.raises(err.InvalidInput):
        make_inventory(total=4, reserved=5)
    with pytest.raises(err.InvalidInventory):
        make_inventory(total=4, min_unit=5, max_unit=2)
    with pytest.raises(err.InvalidInput):
        make_inventory(total=4, allocation_ratio=0.0)
    with pytest.raises(err.InvalidInput):
        make_inventory(total=4, allocation_ratio=float("nan"))
    # (regression: a Decimal NaN or infinity was refused as 'less than or equal to 3.4e38')
    for ratio in (Decimal("NaN"), Decimal("Infinity"), Decimal("-Infinity")):
        with pytest.raises(err.InvalidInput, match="must be finite"):
            make_inventory(total=4, allocation_ratio=ratio)
    assert make_inventory(total=4, allocation_ratio=Decimal("1.5")).allocation_ratio == 1.5
    assert make_inventory(total=4, allocation_ratio=Fraction(3, 2)).allocation_ratio == 1.5


def test_inventory_generation_is_checked_before_classes_in_use() -> None:
    # Found by the differential test: Placement's PUT /inventories compares the generation first.
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))
    with pytest.raises(err.ConcurrentUpdate, match="resource provider generation conflict"):
        when(state, SetInventories(RP1, {}, 1))
    with pytest.raises(err.InventoryInUse):
        when(state, SetInventories(RP1, {}, 2))


def test_inventory_values_are_checked_after_provider_generation_then_classes_then_use() -> None:
    # Placement 16 (checked against the real one): the provider, its generation, reserved >
    # total (checked as each record is read), unknown classes, then classes in use; evstore's
    # own refusals (min_unit > max_unit) come after what Placement checks.
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))  # VCPU in use; generation 2
    bad = Inventory(total=4, reserved=5)
    with pytest.raises(err.ProviderNotFound):
        when(state, SetInventories(RP2, {"VCPU": bad}, 0))
    with pytest.raises(err.ConcurrentUpdate):
        when(state, SetInventories(RP1, {"VCPU": bad}, 0))
    reserved = "reserved \\(5\\) is greater than total \\(4\\)"
    with pytest.raises(err.InvalidInventory, match=reserved):
        when(state, SetInventories(RP1, {"MEMORY_MB": bad, "CUSTOM_NOPE": Inventory(total=1)}, 2))
    with pytest.raises(err.UnknownResourceClass):
        when(
            state,
            SetInventories(RP1, {"MEMORY_MB": Inventory(total=1), "CUSTOM_NOPE": Inventory(total=1)}, 2),
        )
    with pytest.raises(err.InventoryInUse):
        when(state, SetInventories(RP1, {"MEMORY_MB": Inventory(total=1)}, 2))
    odd = Inventory(total=4, min_unit=3, max_unit=2)
    with pytest.raises(err.UnknownResourceClass):
        when(state, SetInventories(RP1, {"VCPU": odd, "CUSTOM_NOPE": Inventory(total=1)}, 2))
    with pytest.raises(err.InvalidInput, match="min_unit"):
        when(state, SetInventory(RP1, "VCPU", odd, 2))


def test_a_class_in_use_is_reported_before_evstores_own_inventory_refusals() -> None:
    # Regression (rev25, helper-i): min_unit > max_unit (refused by evstore only) was checked
    # before the classes in use, so a PUT /inventories that removes VCPU in use and sets DISK_GB
    # with min_unit 3 > max_unit 2 got evstore.inventory.invalid where the real Placement 16
    # answers 409 placement.inventory.inuse (it accepts min_unit > max_unit).
    state = cloud(VCPU=Inventory(total=8), DISK_GB=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 2}})))  # generation 2
    odd = Inventory(total=4, min_unit=3, max_unit=2)
    with pytest.raises(err.InventoryInUse):
        when(state, SetInventories(RP1, {"DISK_GB": odd}, 2))
    with pytest.raises(err.InvalidInventory, match=f"resource provider '{RP1}': min_unit \\(3\\)"):
        when(state, SetInventories(RP1, {"VCPU": Inventory(total=8), "DISK_GB": odd}, 2))


def test_releasing_a_tombstoned_consumer_is_not_found() -> None:
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    when(state, DeleteConsumer(C1))
    with pytest.raises(err.NotFound, match="deleted at position"):
        when(state, Release(C1))


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab", "6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"),
        ("6F1F4CF0-4A7E-4C5E-9F0E-0123456789AB", "6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"),
        ("{6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab}", "6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"),
        ("6f1f4cf04a7e4c5e9f0e0123456789ab", "6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"),
        (uuid.UUID("6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"), "6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab"),
    ],
)
def test_uuids_are_normalised_to_lowercase_dashed_text(given: object, expected: str) -> None:
    got = normalize_uuid(given, "consumer uuid")
    assert got == expected and type(got) is str


@pytest.mark.parametrize(
    "given",
    ["6f1f4cf0-4a7e-4c5e-9f0e-0123456789ab\n", "6f1f4cf0-4a7e-4c5e-9f0e-0123456789a", "x" * 36, 12, None],
)
def test_malformed_uuids_are_refused_even_near_the_canonical_form(given: object) -> None:
    with pytest.raises(err.InvalidInput, match="Malformed consumer uuid"):
        normalize_uuid(given, "consumer uuid")


def test_a_duplicate_name_on_rename_names_the_provider_as_on_create() -> None:
    """Regression (review 25, helper-h): ``DuplicateName`` from ``rename_provider`` carried only
    ``{"name": ...}``, where the same error from ``create_provider`` carries ``provider`` too:
    a handler logging ``exc.details["provider"]`` got a KeyError for the rename."""
    state = given(*provider(RP1, "rp1"), *provider(RP2, "rp2"))
    with pytest.raises(err.DuplicateName) as created:
        when(state, CreateProvider(RP3, "rp1"))
    with pytest.raises(err.DuplicateName) as renamed:
        when(state, RenameProvider(RP2, "rp1"))
    assert created.value.details == {"provider": RP3, "name": "rp1"}
    assert renamed.value.details == {"provider": RP2, "name": "rp1"}


# --- one error, one shape of details ---------------------------------------------------------


def test_every_invalid_inventory_names_its_providers_and_classes_under_the_same_keys() -> None:
    """Regression (review 27, helper-72): ``InvalidInventory`` carried ``providers`` and
    ``resource_classes`` (lists) when a provider had none of the command's classes, but only
    ``provider`` and ``resource_class`` when one row's class was missing: a handler reading
    ``exc.details["providers"]`` got a KeyError for the second."""
    state = given(
        *provider(RP1, "rp1", VCPU=Inventory(total=8)), *provider(RP2, "rp2", DISK_GB=Inventory(total=8))
    )
    with pytest.raises(err.InvalidInventory) as none_of_them:
        when(state, one(write(C1, {RP1: {"VCPU": 1}, RP2: {"VCPU": 1}})))
    with pytest.raises(err.InvalidInventory) as one_row:
        when(state, one(write(C1, {RP1: {"VCPU": 1, "DISK_GB": 1}})))
    assert none_of_them.value.details["providers"] == [RP2]
    assert one_row.value.details["providers"] == [RP1]
    assert one_row.value.details["resource_classes"] == ["DISK_GB"]
    assert (one_row.value.details["provider"], one_row.value.details["resource_class"]) == (RP1, "DISK_GB")


def test_every_inventory_in_use_names_its_classes_under_the_same_key() -> None:
    """Regression (review 27, helper-72): ``set_inventories`` removing a class in use said
    ``resource_classes``, ``delete_inventory`` of one only ``resource_class``."""
    state = cloud(VCPU=Inventory(total=8), DISK_GB=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1, "DISK_GB": 1}})))
    with pytest.raises(err.InventoryInUse) as replaced:
        when(state, SetInventories(RP1, {}, 2))
    with pytest.raises(err.InventoryInUse) as deleted:
        when(state, DeleteInventory(RP1, "VCPU"))
    assert replaced.value.details["resource_classes"] == ["DISK_GB", "VCPU"]
    assert deleted.value.details["resource_classes"] == ["VCPU"]
    assert deleted.value.details["provider"] == replaced.value.details["provider"] == RP1


def test_releasing_a_deleted_consumer_gives_the_position_of_its_tombstone_as_consumer_deleted_does() -> None:
    """Regression (review 27, helper-72): the NotFound of ``release`` said "deleted at position
    N" in its message but carried only ``deleted: True``; ``ConsumerDeleted`` carries the same
    fact as ``deleted_at``."""
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    when(state, DeleteConsumer(C1))
    tombstone = state.position
    with pytest.raises(err.NotFound) as released:
        when(state, Release(C1))
    with pytest.raises(err.ConsumerDeleted) as written:
        when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    assert released.value.details["deleted_at"] == written.value.details["deleted_at"] == tombstone
    assert released.value.details["deleted"] is True
    with pytest.raises(err.NotFound) as never:
        when(state, Release(C2))
    assert never.value.details["deleted_at"] is None and never.value.details["deleted"] is False


def test_a_migration_of_an_instance_holding_nothing_names_both_consumers() -> None:
    """(review 27, helper-72: the NotFound of ``start_migration`` named only the instance, where
    the other migration refusals name the migration too)"""
    state = cloud(VCPU=Inventory(total=8))
    with pytest.raises(err.NotFound) as info:
        when(state, StartMigration(C1, MIG))
    assert info.value.details == {"consumer": C1, "migration": MIG}


def test_every_refused_revert_or_confirm_of_a_deleted_consumer_names_the_migration() -> None:
    """(review 27, helper-72: a revert refused because its instance was deleted carried
    ``migration``; one refused because the migration consumer itself was deleted did not)"""
    state = cloud(VCPU=Inventory(total=8))
    when(state, one(write(C1, {RP1: {"VCPU": 1}})))
    when(state, StartMigration(C1, MIG))
    when(state, DeleteConsumer(MIG))
    for command in (RevertMigration(MIG), ConfirmMigration(MIG)):
        with pytest.raises(err.ConsumerDeleted) as info:
            when(state, command)
        assert info.value.details["migration"] == info.value.details["consumer"] == MIG
