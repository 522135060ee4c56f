"""Replay reads only what a fold needs (``read_payloads``); every way of reading folds the same."""

from __future__ import annotations

import asyncio
import json
import random
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evstore import AllocationStore, CorruptEvent, InvalidInput, Inventory
from evstore import events as ev
from evstore.events import PAYLOAD_VALIDATORS, decode_event
from projections.replay import replay
from projections.state import fold
from tests.conftest import make_provider, new_uuid

FIXTURES = Path(__file__).parent / "fixtures"


async def _workload(store: AllocationStore) -> list[str]:
    a = await make_provider(store, VCPU=16, MEMORY_MB=Inventory(total=4096, step_size=256))
    b = await make_provider(store, VCPU=16)
    instances = [new_uuid() for _ in range(6)]
    for i, c in enumerate(instances):
        await store.set_allocations(
            c,
            {a if i % 2 else b: {"VCPU": 1 + i % 3}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
    migration = new_uuid()
    await store.start_migration(instances[0], migration)
    await store.revert_migration(migration)
    await store.start_migration(instances[1], new_uuid())
    await store.delete_consumer(instances[1])  # its migration is released with it
    await store.delete_consumer(instances[2])
    return instances


async def test_every_read_path_folds_the_same_state(store: AllocationStore) -> None:
    await _workload(store)
    backend = store.backend
    head = await store.head()
    for position in (1, head // 2, head - 1, head):
        via_payloads = await replay(backend.read_payloads, position, batch_size=3)
        via_raw = await replay(backend.read_raw, position, batch_size=4)
        via_recorded = await replay(backend.read, position)
        assert via_payloads == via_raw == via_recorded, position
        assert via_payloads.position == position
    assert await store.replay() == await replay(backend.read_raw)
    rows = await backend.read_payloads(0, 2)
    assert [r[0] for r in rows] == [1, 2] and all(len(r) == 4 for r in rows)


async def test_replay_recounts_the_usage_that_folding_event_by_event_keeps(store: AllocationStore) -> None:
    # replay defers providers' usages and recounts them from the allocations at the end;
    # ``fold`` (evolve, what the write path and the audit use) keeps them event by event.
    await _workload(store)
    head = await store.head()
    recorded = [(r.position, r.event) for r in await store.backend.read(0, head)]
    for position in range(1, head + 1):
        replayed = await replay(store.backend.read_payloads, position)
        assert not replayed.usages_deferred
        assert replayed == fold(recorded[:position]), position
    live = {p: (await store.usage(p)).usages for p in (await store.replay()).providers}
    assert live == {p: prov.usage_view() for p, prov in fold(recorded).providers.items()}
    assert any(any(u.values()) for u in live.values()), "the workload leaves something allocated"


async def test_payload_validators_give_a_models_fields_and_its_errors(store: AllocationStore) -> None:
    await _workload(store)
    rows = await store.backend.read_payloads(0, 1000)
    assert {r[1] for r in rows} >= {"AllocationsReplaced", "MigrationStarted", "ConsumerDeleted"}
    for position, etype, version, data in rows:
        assert PAYLOAD_VALIDATORS[etype][0] == version
        assert PAYLOAD_VALIDATORS[etype][1](data) == decode_event(etype, version, data, position).__dict__
    validate = PAYLOAD_VALIDATORS["AllocationsReleased"][1]
    good = {"consumer": new_uuid(), "released": {new_uuid(): {"VCPU": 1}}}
    assert validate(json.dumps(good)) == {"type": "AllocationsReleased", **good, "on_behalf_of": None}
    # a defaulted field may be missing, as for the model
    assert validate(json.dumps({"consumer": good["consumer"], "released": {}}))["released"] == {}
    for bad in ({**good, "extra": 1}, {"released": {}}, {**good, "released": {"p": {"VCPU": "many"}}}):
        with pytest.raises(ValueError):
            validate(json.dumps(bad))
        with pytest.raises(CorruptEvent):
            decode_event("AllocationsReleased", 1, json.dumps(bad))


@pytest.mark.parametrize(
    "edit",
    [
        "json_set(data, '$.surprise', 1)",  # a field no version of the event has
        "json_remove(data, '$.consumer')",
        "json_set(data, '$.allocations', 'all of it')",
    ],
)
async def test_replay_rejects_an_edited_payload_by_position(sqlite_url: str, edit: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await _workload(store)
        rows = await store.backend.read_payloads(0, 100)
        target = next(r[0] for r in rows if r[1] == "AllocationsReplaced")
        await store.backend.tamper(f"UPDATE events SET data = {edit} WHERE position = ?", (target,))
        with pytest.raises(CorruptEvent) as caught:
            await store.replay()
        assert caught.value.details["position"] == target
        assert caught.value.details["reason"] == "undecodable"


async def test_replay_names_the_position_of_a_corrupt_row(store: AllocationStore) -> None:
    await _workload(store)
    await store.backend.tamper("UPDATE events SET data = '{\"consumer\": 42' WHERE position = 5")
    with pytest.raises(CorruptEvent) as caught:
        await store.replay()
    assert caught.value.details["position"] == 5
    assert (await store.replay(to_position=4)).position == 4, "the rows before it still fold"


async def test_replay_refuses_a_position_beyond_the_head_as_state_at_does(store: AllocationStore) -> None:
    await _workload(store)
    head = await store.head()
    assert (await store.replay(to_position=head)).position == head
    for ask in (store.replay(to_position=head + 1), store.state_at(position=head + 1)):
        with pytest.raises(InvalidInput, match=f"beyond the head of the log \\({head}\\)"):
            await ask  # replay silently answered with the state at the head


async def test_replay_upcasts_an_old_row(sqlite_url: str) -> None:
    from evstore import open_store

    fixture = json.loads((FIXTURES / "allocations_replaced_v1.json").read_text())
    async with open_store(sqlite_url) as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        await store.set_allocations(
            consumer,
            {rp: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        position = await store.head()
        old = dict(
            fixture["data"], consumer=consumer, allocations={rp: {"VCPU": 2}}, provider_generations={rp: 2}
        )
        await store.backend.tamper(
            "UPDATE events SET schema_version = 1, data = ? WHERE position = ?", (json.dumps(old), position)
        )
        state = await store.replay()
        assert state.consumers[consumer].consumer_type == "UNKNOWN"  # what the v1 -> v2 upcaster fills in
        assert state.providers[rp].usages == {"VCPU": 2}


def _random_event(rng: random.Random) -> ev.EventBase:
    providers, consumers = ["p1", "p2", "p3"], ["c1", "c2", "c3", "c4"]
    c, m = rng.sample(consumers, 2)
    p = rng.choice(providers)
    held = {q: {"VCPU": rng.randint(1, 4)} for q in rng.sample(providers, rng.randint(0, 2))}
    common: dict[str, Any] = {"project_id": "x", "user_id": "y", "instance_consumer_type": "I"}
    kind = rng.randrange(8)
    if kind == 0:
        return ev.AllocationsReplaced(
            consumer=c, allocations=held, consumer_type="I", generation=1, project_id="x", user_id="y"
        )
    if kind == 1:
        return ev.AllocationsReleased(consumer=c, released={})
    if kind == 2:
        return ev.MigrationStarted(instance=c, migration=m, allocations=held, instance_generation=1, **common)
    if kind == 3:
        return ev.MigrationReverted(
            migration=m, instance=c, allocations=held, instance_generation=2, **common
        )
    if kind == 4:
        return ev.MigrationConfirmed(migration=m, instance=c, released={})
    if kind == 5:
        return ev.ConsumerDeleted(consumer=c, migrations_released={m: {}})
    if kind == 6:
        return ev.ProviderDeleted(provider=p)
    return ev.ProviderCreated(provider=p, name=p, root=p)


def _random_log(rng: random.Random) -> list[tuple[int, ev.EventBase]]:
    """Events no correct writer would all append (providers deleted while allocated, created
    twice, allocations naming absent providers) - what an imported log may hold."""
    start: list[ev.EventBase] = [ev.ProviderCreated(provider=p, name=p, root=p) for p in ("p1", "p2")]
    return list(enumerate(start + [_random_event(rng) for _ in range(30)], 1))


async def test_replay_of_any_log_folds_like_evolve_even_with_provider_churn() -> None:
    # Regression: replay recounted usage at the end for every log, so a provider deleted while
    # allocated and created again (or allocations naming an absent provider) gave other usage
    # than the event-by-event fold the audit and time travel use.
    for seed in range(300):
        events = _random_log(random.Random(seed))
        rows = [(p, e.event_type, e.schema_version, e.payload_json()) for p, e in events]

        async def read(after: int, limit: int, rows: list[Any] = rows) -> list[Any]:
            return [r for r in rows if r[0] > after][:limit]

        assert await replay(read, batch_size=7) == fold(events), seed
        half = fold(events[:15])
        assert await replay(read, state=half) == fold(events), seed  # a given state: no recount


# --- the msgspec payload validators against pydantic's -----------------------------------------

_FAST = sorted(name for name, (_, validate) in PAYLOAD_VALIDATORS.items() if "_fast" in validate.__qualname__)
_PLAIN_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=8)
_ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


def _values_of(annotation: Any) -> st.SearchStrategy[Any]:
    """Values a model field of this type holds (what a correct writer stores)."""
    if annotation is str:
        return _PLAIN_TEXT
    if annotation is int:
        return st.integers(min_value=-(2**63), max_value=2**63 - 1)
    if annotation is type(None):
        return st.none()
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is dict:
        return st.dictionaries(_PLAIN_TEXT, _values_of(args[1]), max_size=3)
    return st.one_of([_values_of(a) for a in args])  # X | None


@st.composite
def _stored_payloads(draw: st.DrawFn) -> tuple[str, str, bool]:
    """(event type, payload text, whether it is one a correct writer stores)."""
    etype = draw(st.sampled_from(_FAST))
    cls = ev.EVENT_TYPES[etype]
    payload = {
        name: draw(_values_of(info.annotation))
        for name, info in cls.model_fields.items()
        if name != "type" and (info.is_required() or draw(st.booleans()))
    }
    valid = True
    for _ in range(draw(st.integers(0, 2))):
        valid = False
        how = draw(st.sampled_from(["drop", "extra", "replace", "type"]))
        if how == "drop" and payload:
            payload.pop(draw(st.sampled_from(sorted(payload))))
        elif how == "extra":
            payload[draw(st.text(max_size=5))] = draw(_ANY_JSON)
        elif how == "replace" and payload:
            payload[draw(st.sampled_from(sorted(payload)))] = draw(_ANY_JSON)
        elif how == "type":
            payload["type"] = draw(st.sampled_from([etype, "ProviderDeleted", 1]))
    return etype, json.dumps(payload, ensure_ascii=draw(st.booleans())), valid


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_stored_payloads())
def test_fast_payload_validators_accept_only_what_pydantic_accepts_and_give_the_same(
    case: tuple[str, str, bool],
) -> None:
    # Replay, rebuild and the audit decode with msgspec structs derived from the event models;
    # what they refuse goes to decode_event (pydantic). So the fast path may refuse more than
    # pydantic (a lax "3" for an int), but must never accept what pydantic refuses, nor give
    # another value (1 for True, 1.0 for 1) for what both accept.
    etype, text, valid = case
    version, validate = PAYLOAD_VALIDATORS[etype]
    try:
        fast: dict[str, Any] | None = validate(text)
    except ValueError:
        fast = None
    try:
        slow: dict[str, Any] | None = decode_event(etype, version, text).__dict__
    except CorruptEvent:
        slow = None
    if valid:
        assert fast is not None, "a payload a correct writer stores takes the fast path"
    if fast is not None:
        assert slow is not None, f"accepted only by the fast path: {text}"
        assert json.dumps(fast, sort_keys=True) == json.dumps(slow, sort_keys=True)


def test_the_hot_event_types_take_the_fast_path() -> None:
    # (InventoriesReplaced nests the Inventory model: pydantic alone)
    hot = {"AllocationsReplaced", "MigrationStarted", "MigrationReverted", "MigrationConfirmed"}
    assert hot | {"ConsumerDeleted", "AllocationsReleased", "ProviderCreated"} <= set(_FAST)
    assert "InventoriesReplaced" not in _FAST


async def test_replay_folds_a_payload_only_pydantic_accepts_like_decode_event(store: AllocationStore) -> None:
    # A lax value (an int stored as "2") is refused by the fast path and accepted by decode_event:
    # replay must fold it, as it did before the fast path, and as history reads it.
    await _workload(store)
    rows = await store.backend.read_payloads(0, 1000)
    target = next(r for r in rows if r[1] == "AllocationsReplaced" and '"generation":1' in r[3])
    lax = target[3].replace('"generation":1', '"generation":"1"')
    with pytest.raises(ValueError):
        PAYLOAD_VALIDATORS["AllocationsReplaced"][1](lax)
    await store.backend.tamper("UPDATE events SET data = ? WHERE position = ?", (lax, target[0]))
    head = await store.head()
    recorded = [(r.position, r.event) for r in await store.backend.read(0, head)]
    assert recorded[target[0] - 1][1]["generation"] == 1
    assert await store.replay() == fold(recorded)


@st.composite
def _metadata_texts(draw: st.DrawFn) -> str:
    known = ["request_id", "correlation_id", "causation_id", "actor", "command", "command_id"]
    meta = {
        key: draw(st.none() | _PLAIN_TEXT | _ANY_JSON)
        for key in draw(st.lists(st.sampled_from([*known, "idempotency_key", "x"]), unique=True))
    }
    value: Any = meta if draw(st.integers(0, 9)) else draw(_ANY_JSON)  # sometimes not an object
    return json.dumps(value, ensure_ascii=draw(st.booleans()))


def _accepts(check: Callable[[str], object], text: str) -> bool:
    try:
        check(text)
    except ValueError:
        return False
    return True


@settings(max_examples=800, deadline=None)
@given(_metadata_texts())
def test_the_audits_metadata_check_refuses_exactly_what_readers_refuse(text: str) -> None:
    # The audit checks each row's metadata with msgspec first (unknown keys refused), pydantic
    # for what msgspec refuses: it must agree with the readers' pydantic decoding on every text.
    readers_accept = _accepts(ev.METADATA_VALIDATOR, text)
    assert _accepts(ev.check_metadata, text) == readers_accept, text
    if ev._METADATA_FAST_CHECK is not None:
        try:
            ev._METADATA_FAST_CHECK(text)
        except ValueError:
            return
        assert readers_accept, f"accepted only by the fast check: {text}"


async def test_replay_keeps_one_copy_of_each_project_user_and_type_label(store: AllocationStore) -> None:
    # Regression: with payloads decoded by msgspec, every consumer kept its own copies of its
    # project, user and type strings (pydantic's string cache had shared them): 765k strings,
    # +35 MiB of peak memory for a replay of 1M events. Folds intern these labels.
    await _workload(store)
    state = await store.replay()
    consumers = [c for c in state.consumers.values() if c.project_id is not None]
    assert len(consumers) >= 4
    for label in ("project_id", "user_id", "consumer_type"):
        values = [getattr(c, label) for c in consumers]
        assert len({id(v) for v in values}) == len(set(values)), label


@pytest.mark.parametrize("data", [None, 5, ["not", "an", "object"]])
def test_a_payload_that_is_not_text_is_a_corrupt_event_naming_its_position(data: Any) -> None:
    # Regression: msgspec raises TypeError for anything but text or bytes (pydantic a ValueError),
    # so such a row escaped the fold as a bare TypeError instead of a CorruptEvent.
    from projections.replay import fold_payloads
    from projections.state import State

    with pytest.raises(CorruptEvent) as caught:
        fold_payloads(State(), [(7, "ConsumerDeleted", 1, data)])
    assert caught.value.details["position"] == 7
    with pytest.raises(ValueError):
        PAYLOAD_VALIDATORS["ConsumerDeleted"][1](data)


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(
    "text",
    [
        '{"actor": "a", "x": ' + _nested(250) + "}",  # deeper than pydantic accepts
        '{"actor": "a", "x": ' + _nested(1200) + "}",  # deep enough for a RecursionError in msgspec
        '{"x": ' + "9" * 4301 + "}",  # more digits than Python's int conversion allows
        '{"x": ' + "9" * 4301 + ".5}",
        '{"actor": ' + _nested(1200) + "}",
        '{"idempotency_key": "k-1", "command": "CreateProvider", "command_id": "0"}',
        '{"idempotency_key": 5}',
    ],
)
def test_the_audits_metadata_check_agrees_with_readers_on_extreme_values(text: str) -> None:
    # Regression: the fast check skipped unknown keys without pydantic's limits, so it accepted
    # what readers refuse, and a value nested 1200 deep escaped as a RecursionError that aborted
    # the whole audit. (Found by a review of the change; the property test's values are small.)
    assert _accepts(ev.check_metadata, text) == _accepts(ev.METADATA_VALIDATOR, text)


async def test_the_audit_reports_metadata_nested_too_deep_instead_of_failing(sqlite_url: str) -> None:
    from evstore import open_store

    async with open_store(sqlite_url) as store:
        await _workload(store)
        deep = '{"actor": "a", "x": ' + _nested(1200) + "}"
        await store.backend.tamper("UPDATE events SET metadata = ? WHERE position = 3", (deep,))
        report = await store.audit()
    assert not report.clean
    assert any(f.positions == (3,) and f.details.get("reason") == "undecodable" for f in report.findings)


@pytest.mark.parametrize("work", ["replay", "audit", "diff", "state_at", "take_snapshots"])
async def test_bulk_folds_let_other_tasks_run_between_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, work: str
) -> None:
    """Regression: replay, rebuild, the audit, diff and time travel folded each batch a read
    returned (5,000 events) in one go, and encoded or decoded a whole-store snapshot on the event
    loop: other tasks stood still for up to hundreds of milliseconds on a large store. They now
    yield to the loop every FOLD_SLICE events (and code snapshots on a thread): counted by the
    folds themselves, no more than FOLD_SLICE events are folded between two turns of another task."""
    from evstore import open_store
    from projections.replay import FOLD_SLICE
    from projections.state import FOLDS

    async with open_store(f"sqlite:///{tmp_path / 's.db'}", synchronous="OFF", snapshot_every=2500) as store:
        rp = await make_provider(store, VCPU=10**6)
        for _ in range(6):
            await asyncio.gather(
                *(
                    store.set_allocations(
                        new_uuid(),
                        {rp: {"VCPU": 1}},
                        project_id="p",
                        user_id="u",
                        consumer_type="X",
                        generation=None,
                    )
                    for _ in range(1000)
                )
            )
        head = await store.head()
        folded = {"since_turn": 0, "most": 0, "all": 0}

        def counting(fold: Callable[..., None]) -> Callable[..., None]:
            def counted(*args: Any) -> None:
                folded["since_turn"] += 1
                folded["all"] += 1
                folded["most"] = max(folded["most"], folded["since_turn"])
                fold(*args)

            return counted

        for name, fold in list(FOLDS.items()):
            monkeypatch.setitem(FOLDS, name, counting(fold))
        stop = False

        async def turns() -> None:
            while not stop:
                folded["since_turn"] = 0
                await asyncio.sleep(0)

        other = asyncio.create_task(turns())
        await asyncio.sleep(0)
        if work == "replay":
            await store.replay()
        elif work == "audit":
            assert (await store.audit()).clean
        elif work == "diff":
            await store.diff(1, head)
        elif work == "state_at":
            await store.state_at(head)
        else:
            await store.take_snapshots()
        stop = True
        await other
        assert folded["all"] >= head - 1
        assert folded["most"] <= FOLD_SLICE, folded
