"""Black-box acceptance against the real Placement 16.0.0 (stop 38, helper D): each refusal a
command can meet, made on both, through evstore's public API only, on every backend.

README ("How it works", "The embedded API") promises: the error kinds and check order of Placement,
each refusal's message beginning with Placement's detail, Placement's code where Placement gives one
of its own and an ``evstore.*`` code where Placement says ``placement.undefined_code``, nothing
written by a refusal - and lists what is deliberately different. These tests hold the README to
both halves: what matches is compared, and each departure it lists for text and codes is shown to
be one (Placement answers otherwise) and to hold (evstore refuses, writing nothing).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

from evstore import (
    AllocationStore,
    EvstoreError,
    InvalidInput,
    UnknownResourceClass,
    open_store,
)
from tests.conftest import BACKENDS, new_uuid
from tests.peers.placement_client import PlacementPeer
from tests.test_differential_placement import evstore_kind, placement_kind

UNDEFINED = "placement.undefined_code"
OWNER = {"project_id": "proj", "user_id": "user", "consumer_type": "INSTANCE"}
VCPU_MEM = {
    "VCPU": {"total": 8, "allocation_ratio": 1.5, "max_unit": 8},
    "MEMORY_MB": {"total": 64, "reserved": 4, "min_unit": 4, "step_size": 4},
}


def put_body(allocations: dict[str, dict[str, int]], generation: int | None, **owner: str) -> dict[str, Any]:
    return {
        "allocations": {p: {"resources": r} for p, r in allocations.items()},
        **(OWNER | owner),
        "consumer_generation": generation,
    }


def error_of(answer: Any) -> tuple[str, str]:
    """Placement's error ``(code, detail)``: the detail without webob's explanation before it."""
    error = answer["errors"][0]
    detail = str(error["detail"])
    return str(error["code"]), (detail.split("\n\n", 1)[1] if "\n\n" in detail else detail).strip()


class Both:
    """One Placement database and one evstore store, driven with the same requests."""

    def __init__(self, store: AllocationStore, peer: PlacementPeer) -> None:
        self.store = store
        self.peer = peer

    async def provider(
        self, name: str, inventories: dict[str, Any] | None = None, parent: str | None = None
    ) -> str:
        rp = new_uuid()
        body: dict[str, Any] = {"uuid": rp, "name": name}
        if parent is not None:
            body["parent_provider_uuid"] = parent
        assert (await self.peer.acall("POST", "/resource_providers", body))[0] == 200
        await self.store.create_provider(rp, name, parent)
        if inventories:
            request = {"resource_provider_generation": 0, "inventories": inventories}
            assert (await self.peer.acall("PUT", f"/resource_providers/{rp}/inventories", request))[0] == 200
            await self.store.set_inventories(rp, inventories, 0)
        return rp

    async def allocate(self, consumer: str, allocations: dict[str, dict[str, int]]) -> None:
        status, _ = await self.peer.acall("PUT", f"/allocations/{consumer}", put_body(allocations, None))
        assert status == 204
        await self.store.set_allocations(consumer, allocations, generation=None, **OWNER)

    async def refused_by_evstore(self, call: Callable[[], Awaitable[Any]]) -> EvstoreError:
        head = await self.store.head()
        with pytest.raises(EvstoreError) as caught:
            await call()
        assert await self.store.head() == head, "a refused command wrote something"
        return caught.value

    async def provider_states(self, providers: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
        placement, evstore = {}, {}
        for rp in providers:
            _, body = await self.peer.acall("GET", f"/resource_providers/{rp}/usages")
            placement[rp] = (body["resource_provider_generation"], body["usages"])
            usage = await self.store.usage(rp)
            evstore[rp] = (usage.generation, dict(usage))
        return placement, evstore


def side_by_side(backend: str, peer: PlacementPeer, scenario: Callable[[Both], Awaitable[None]]) -> None:
    async def main(tmp: Path) -> None:
        await asyncio.to_thread(peer.reset, tmp / "placement.sqlite")
        if backend == "sqlite":
            url = f"sqlite:///{tmp}/evstore.db"
        else:
            from tests.pg import fresh_database_url

            url = fresh_database_url()
        async with open_store(url) as store:
            await scenario(Both(store, peer))

    with tempfile.TemporaryDirectory(prefix="evstore-s38d-") as tmp, structlog.testing.capture_logs():
        asyncio.run(main(Path(tmp)))


Refusal = tuple[str, str, str, Any, Callable[[], Awaitable[Any]], str]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_refusal_has_placements_kind_code_and_detail_and_writes_nothing(
    placement_peer: PlacementPeer, backend: str
) -> None:
    """Each refusal of each command, on both: the same kind (Placement's status and detail, evstore's
    error class), Placement's code where Placement has one of its own, ``placement.undefined_code``
    on Placement's side where evstore has its own ``evstore.*`` code (README: "And the error
    codes"), evstore's message beginning with Placement's detail (jsonschema's wording aside: bad
    input is refused by evstore's own checks), nothing written, and the providers' generations and
    usages equal afterwards."""

    async def scenario(both: Both) -> None:
        s = both.store
        rp = await both.provider("rp", VCPU_MEM)
        parent = await both.provider("parent", {"VCPU": {"total": 4}})
        await both.provider("child", parent=parent)
        bare = await both.provider("bare")
        held = new_uuid()
        await both.allocate(held, {rp: {"VCPU": 5, "MEMORY_MB": 8}})
        missing, fresh, unknown = new_uuid(), new_uuid(), new_uuid()
        gone = {"VCPU": {"total": 8}}
        stale_vcpu = {"resource_provider_generation": 1, "total": 8}
        only_memory = {"MEMORY_MB": VCPU_MEM["MEMORY_MB"]}
        too_much = {"VCPU": {"total": 4, "reserved": 5}}
        nope = {"CUSTOM_NOPE": {"total": 1}}
        two = {
            fresh: {**OWNER, "allocations": {rp: {"VCPU": 5}}},
            missing: {**OWNER, "allocations": {rp: {"VCPU": 5}}},
        }
        first_stale = {
            fresh: {**OWNER, "allocations": {missing: {"VCPU": 1}}, "consumer_generation": 3},
            held: {**OWNER, "allocations": {rp: {"VCPU": 1}}, "consumer_generation": 9},
        }

        def write(consumer: str, allocations: dict[str, dict[str, int]], generation: int | None) -> Any:
            return lambda: s.set_allocations(consumer, allocations, generation=generation, **OWNER)

        rps, invs = "/resource_providers", f"/resource_providers/{rp}/inventories"
        # (name, method, path, body, the evstore call, the code evstore answers)
        cases: list[Refusal] = [
            (
                "duplicate uuid",
                "POST",
                rps,
                {"uuid": rp, "name": "x"},
                lambda: s.create_provider(rp, "x"),
                "placement.duplicate_name",
            ),
            (
                "duplicate name",
                "POST",
                rps,
                {"uuid": fresh, "name": "rp"},
                lambda: s.create_provider(fresh, "rp"),
                "placement.duplicate_name",
            ),
            (
                "a missing parent",
                "POST",
                rps,
                {"uuid": fresh, "name": "orphan", "parent_provider_uuid": missing},
                lambda: s.create_provider(fresh, "orphan", missing),
                "placement.resource_provider.not_found",
            ),
            (
                "its own parent",
                "POST",
                rps,
                {"uuid": fresh, "name": "selfish", "parent_provider_uuid": fresh},
                lambda: s.create_provider(fresh, "selfish", fresh),
                "evstore.invalid_input",
            ),
            (
                "rename to a taken name",
                "PUT",
                f"{rps}/{rp}",
                {"name": "parent"},
                lambda: s.rename_provider(rp, "parent"),
                "placement.duplicate_name",
            ),
            (
                "rename a missing provider",
                "PUT",
                f"{rps}/{missing}",
                {"name": "zz"},
                lambda: s.rename_provider(missing, "zz"),
                "placement.resource_provider.not_found",
            ),
            (
                "delete a missing provider",
                "DELETE",
                f"{rps}/{missing}",
                None,
                lambda: s.delete_provider(missing),
                "placement.resource_provider.not_found",
            ),
            (
                "delete a parent",
                "DELETE",
                f"{rps}/{parent}",
                None,
                lambda: s.delete_provider(parent),
                "placement.resource_provider.cannot_delete_parent",
            ),
            (
                "delete a provider in use",
                "DELETE",
                f"{rps}/{rp}",
                None,
                lambda: s.delete_provider(rp),
                "placement.resource_provider.inuse",
            ),
            (
                "inventories, stale generation",
                "PUT",
                invs,
                {"resource_provider_generation": 0, "inventories": VCPU_MEM},
                lambda: s.set_inventories(rp, VCPU_MEM, 0),
                "placement.concurrent_update",
            ),
            (
                "inventories, missing provider",
                "PUT",
                f"{rps}/{missing}/inventories",
                {"resource_provider_generation": 0, "inventories": gone},
                lambda: s.set_inventories(missing, gone, 0),
                "placement.resource_provider.not_found",
            ),
            (
                "inventories, unknown class",
                "PUT",
                f"{rps}/{bare}/inventories",
                {"resource_provider_generation": 0, "inventories": nope},
                lambda: s.set_inventories(bare, nope, 0),
                "evstore.resource_class.unknown",
            ),
            (
                "inventories, reserved above total",
                "PUT",
                f"{rps}/{bare}/inventories",
                {"resource_provider_generation": 0, "inventories": too_much},
                lambda: s.set_inventories(bare, too_much, 0),
                "evstore.inventory.invalid",
            ),
            (
                "inventories, a class in use removed",
                "PUT",
                invs,
                {"resource_provider_generation": 2, "inventories": only_memory},
                lambda: s.set_inventories(rp, only_memory, 2),
                "placement.inventory.inuse",
            ),
            (
                "one inventory, stale generation",
                "PUT",
                f"{invs}/VCPU",
                stale_vcpu,
                lambda: s.set_inventory(rp, "VCPU", {"total": 8}, 1),
                "placement.concurrent_update",
            ),
            (
                "one inventory, missing provider",
                "PUT",
                f"{rps}/{missing}/inventories/VCPU",
                stale_vcpu,
                lambda: s.set_inventory(missing, "VCPU", {"total": 8}, 1),
                "placement.resource_provider.not_found",
            ),
            (
                "one inventory, reserved above total",
                "PUT",
                f"{invs}/VCPU",
                {"resource_provider_generation": 2, "total": 2, "reserved": 3},
                lambda: s.set_inventory(rp, "VCPU", {"total": 2, "reserved": 3}, 2),
                "evstore.inventory.invalid",
            ),
            (
                "delete an inventory the provider lacks",
                "DELETE",
                f"{invs}/DISK_GB",
                None,
                lambda: s.delete_inventory(rp, "DISK_GB"),
                "evstore.not_found",
            ),
            (
                "delete an inventory of a missing provider",
                "DELETE",
                f"{rps}/{missing}/inventories/VCPU",
                None,
                lambda: s.delete_inventory(missing, "VCPU"),
                "placement.resource_provider.not_found",
            ),
            # (a documented departure: Placement's code here is placement.concurrent_update)
            (
                "delete an inventory in use",
                "DELETE",
                f"{invs}/VCPU",
                None,
                lambda: s.delete_inventory(rp, "VCPU"),
                "placement.inventory.inuse",
            ),
            (
                "write, null for an existing consumer",
                "PUT",
                f"/allocations/{held}",
                put_body({rp: {"VCPU": 1}}, None),
                write(held, {rp: {"VCPU": 1}}, None),
                "placement.concurrent_update",
            ),
            (
                "write, stale generation",
                "PUT",
                f"/allocations/{held}",
                put_body({rp: {"VCPU": 1}}, 7),
                write(held, {rp: {"VCPU": 1}}, 7),
                "placement.concurrent_update",
            ),
            (
                "write, a generation for a new consumer",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"VCPU": 1}}, 0),
                write(fresh, {rp: {"VCPU": 1}}, 0),
                "placement.concurrent_update",
            ),
            (
                "write, missing provider",
                "PUT",
                f"/allocations/{fresh}",
                put_body({missing: {"VCPU": 1}}, None),
                write(fresh, {missing: {"VCPU": 1}}, None),
                "placement.resource_provider.not_found",
            ),
            (
                "write, unknown class",
                "PUT",
                f"/allocations/{unknown}",
                put_body({rp: {"CUSTOM_NOPE": 1}}, None),
                write(unknown, {rp: {"CUSTOM_NOPE": 1}}, None),
                "evstore.resource_class.unknown",
            ),
            (
                "write, no inventory of any class",
                "PUT",
                f"/allocations/{fresh}",
                put_body({bare: {"VCPU": 1}}, None),
                write(fresh, {bare: {"VCPU": 1}}, None),
                "evstore.inventory.invalid",
            ),
            (
                "write, one class without inventory",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"VCPU": 1, "DISK_GB": 1}}, None),
                write(fresh, {rp: {"VCPU": 1, "DISK_GB": 1}}, None),
                "evstore.inventory.invalid",
            ),
            (
                "write, off the step",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"MEMORY_MB": 6}}, None),
                write(fresh, {rp: {"MEMORY_MB": 6}}, None),
                "evstore.allocation.constraint_violation",
            ),
            (
                "write, below min_unit",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"MEMORY_MB": 2}}, None),
                write(fresh, {rp: {"MEMORY_MB": 2}}, None),
                "evstore.allocation.constraint_violation",
            ),
            (
                "write, above max_unit",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"VCPU": 9}}, None),
                write(fresh, {rp: {"VCPU": 9}}, None),
                "evstore.allocation.constraint_violation",
            ),
            (
                "write, capacity (12, 5 held)",
                "PUT",
                f"/allocations/{fresh}",
                put_body({rp: {"VCPU": 8}}, None),
                write(fresh, {rp: {"VCPU": 8}}, None),
                "evstore.allocation.capacity_exceeded",
            ),
            (
                "two consumers, their running sum over capacity",
                "POST",
                "/allocations",
                {c: put_body({rp: {"VCPU": 5}}, None) for c in two},
                lambda: s.write_allocations(two),
                "evstore.allocation.capacity_exceeded",
            ),
            (
                "two consumers, the first stale generation decides",
                "POST",
                "/allocations",
                {fresh: put_body({missing: {"VCPU": 1}}, 3), held: put_body({rp: {"VCPU": 1}}, 9)},
                lambda: s.write_allocations(first_stale),
                "placement.concurrent_update",
            ),
            (
                "release of nothing",
                "DELETE",
                f"/allocations/{fresh}",
                None,
                lambda: s.release(fresh),
                "evstore.not_found",
            ),
        ]
        for name, method, path, body, call, code in cases:
            status, answer = await both.peer.acall(method, path, body)
            await asyncio.to_thread(both.peer.purge_orphans)  # (Placement's, after a 400: a departure)
            assert status >= 400, (name, answer)
            their_code, detail = error_of(answer)
            exc = await both.refused_by_evstore(call)
            assert evstore_kind(exc) == placement_kind(status, answer), (name, exc, answer)
            assert exc.code == code, (name, exc.code, exc.message)
            if name == "delete an inventory in use":
                assert their_code == "placement.concurrent_update", their_code
            elif code.startswith("placement.") and code != "placement.resource_provider.not_found":
                assert their_code == code, (name, their_code)
            else:
                assert their_code == UNDEFINED, (name, their_code)
            # (a 404 of Placement's can say its text twice, "M: M", webob's and the exception's)
            if not detail.startswith("JSON does not validate") and detail != f"{exc.message}: {exc.message}":
                assert exc.message.startswith(detail), (name, exc.message, detail)
        placement, evstore = await both.provider_states([rp, parent, bare])
        assert placement == evstore

    side_by_side(backend, placement_peer, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_departures_the_readme_lists_for_text_are_departures_and_hold(
    placement_peer: PlacementPeer, backend: str
) -> None:
    """README ("Text is checked more strictly than Placement checks it"): each case Placement takes
    (or answers otherwise) and evstore refuses, writing nothing. If Placement changed its answer the
    README would be wrong: the Placement half fails then too."""

    async def scenario(both: Both) -> None:
        s, p = both.store, both.peer
        rp = await both.provider("rp", {"VCPU": {"total": 8}})
        renamed = await both.provider("renamed")
        # a NUL in a provider name, on create and on rename: stored by Placement
        nul = new_uuid()
        assert (await p.acall("POST", "/resource_providers", {"uuid": nul, "name": "a\x00b"}))[0] == 200
        assert (
            await both.refused_by_evstore(lambda: s.create_provider(nul, "a\x00b"))
        ).code == InvalidInput.code
        assert (await p.acall("PUT", f"/resource_providers/{renamed}", {"name": "c\x00"}))[0] == 200
        assert (
            await both.refused_by_evstore(lambda: s.rename_provider(renamed, "c\x00"))
        ).code == InvalidInput.code
        # an empty name: Placement refuses it on create only
        status, _ = await p.acall("POST", "/resource_providers", {"uuid": new_uuid(), "name": ""})
        assert status == 400
        assert (await p.acall("PUT", f"/resource_providers/{renamed}", {"name": ""}))[0] == 200
        assert (
            await both.refused_by_evstore(lambda: s.rename_provider(renamed, ""))
        ).code == InvalidInput.code
        # a NUL in a project or user id, and a consumer type ending in a newline: stored by Placement
        for owner in ({"project_id": "p\x00"}, {"user_id": "\x00"}, {"consumer_type": "INSTANCE\n"}):
            consumer = new_uuid()
            body = put_body({rp: {"VCPU": 1}}, None, **owner)
            assert (await p.acall("PUT", f"/allocations/{consumer}", body))[0] == 204, owner
            _, shown = await p.acall("GET", f"/allocations/{consumer}")
            assert {k: shown[k] for k in owner} == owner
            exc = await both.refused_by_evstore(
                lambda c=consumer, o=owner: s.set_allocations(
                    c, {rp: {"VCPU": 1}}, generation=None, **(OWNER | o)
                )
            )
            assert exc.code == InvalidInput.code, owner
        # a malformed class name in inventories: an unknown class to Placement, after the generation
        status, answer = await p.acall(
            "PUT",
            f"/resource_providers/{rp}/inventories",
            {"resource_provider_generation": 0, "inventories": {"vcpu": {"total": 1}}},
        )
        assert (status, error_of(answer)[0]) == (409, "placement.concurrent_update")
        exc = await both.refused_by_evstore(lambda: s.set_inventories(rp, {"vcpu": {"total": 1}}, 0))
        assert exc.code == InvalidInput.code
        # usages() filters: Placement takes anything beginning with "all" (answering {}), a NUL, and a
        # type ending in a newline (here that of the consumer it stored above)
        newline = {"usages": {"INSTANCE\n": {"VCPU": 1, "consumer_count": 1}}}
        for query, placement_answers, call in (
            ("consumer_type=allx", {"usages": {}}, lambda: s.usages("proj", consumer_type="allx")),
            ("consumer_type=all%20in", {"usages": {}}, lambda: s.usages("proj", consumer_type="all in")),
            ("consumer_type=all%00", {"usages": {}}, lambda: s.usages("proj", consumer_type="all\x00")),
            ("consumer_type=INSTANCE%0A", newline, lambda: s.usages("proj", consumer_type="INSTANCE\n")),
            ("user_id=u%00", {"usages": {}}, lambda: s.usages("proj", "u\x00")),
        ):
            assert await p.acall("GET", f"/usages?project_id=proj&{query}") == (200, placement_answers), query
            with pytest.raises(InvalidInput):
                await call()
        assert await p.acall("GET", "/usages?project_id=p%00") == (
            200,
            {"usages": {"INSTANCE": {"VCPU": 1, "consumer_count": 1}}},
        )
        with pytest.raises(InvalidInput):
            await s.usages("p\x00")
        # set_inventory of a class that exists nowhere: Placement's 404, evstore's unknown class (on a
        # provider of its own: the writes Placement took above moved rp's generation there)
        other = await both.provider("other")
        status, answer = await p.acall(
            "PUT",
            f"/resource_providers/{other}/inventories/CUSTOM_NOPE",
            {"resource_provider_generation": 0, "total": 1},
        )
        assert status == 404 and error_of(answer) == (UNDEFINED, "No such resource class CUSTOM_NOPE.")
        exc = await both.refused_by_evstore(lambda: s.set_inventory(other, "CUSTOM_NOPE", {"total": 1}, 0))
        assert isinstance(exc, UnknownResourceClass)
        # (evstore holds nothing on rp: it refused every one of those writes)
        assert await s.usage(rp) == {"VCPU": 0}

    side_by_side(backend, placement_peer, scenario)


async def test_a_refused_parent_begins_with_placements_detail(store: AllocationStore) -> None:
    """Regression (stop 38, helper D): ``create_provider`` with a missing parent said "The parent
    provider P of resource provider R does not exist", and with itself as parent "A resource provider
    cannot be its own parent", where every other refusal begins with Placement's detail - here
    ``POST /resource_providers``' 400s (the Placement half:
    ``test_every_refusal_has_placements_kind_code_and_detail_and_writes_nothing``)."""
    rp, parent = new_uuid(), new_uuid()
    cannot = f'Unable to create resource provider "node", {rp}: Object action create failed because: '
    with pytest.raises(EvstoreError) as caught:
        await store.create_provider(rp, "node", parent)
    assert caught.value.code == "placement.resource_provider.not_found"
    assert caught.value.message.startswith(f"{cannot}parent provider UUID does not exist.")
    assert caught.value.details == {"provider": parent}
    with pytest.raises(InvalidInput) as refused:
        await store.create_provider(rp, "node", rp)
    assert refused.value.message.startswith(
        f"{cannot}parent provider UUID cannot be same as UUID. Please set parent provider UUID to None if "
        "there is no parent."
    )
    assert refused.value.details == {"field": "parent"}
    assert await store.head() == 0
