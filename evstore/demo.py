"""A small simulated cloud, run against a real store: what ``evstore demo`` does.

Compute nodes get inventories; instances are built, resized and migrated by many concurrent
tasks; some migrations are reverted, some confirmed, and some instances are deleted while their
migration is in flight, *racing the revert* (Nova bug 1848343). Every random choice is drawn
up front from one seeded generator, so a seed always produces the same plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import uuid as _uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Literal

from evstore import errors as err
from evstore.logs import get_logger
from evstore.schema import Inventory
from evstore.store import AllocationStore, command_metadata

log = get_logger("evstore")

Flavor = dict[str, int]
FLAVORS: dict[str, Flavor] = {
    "m1.small": {"VCPU": 1, "MEMORY_MB": 2048, "DISK_GB": 20},
    "m1.medium": {"VCPU": 2, "MEMORY_MB": 4096, "DISK_GB": 40},
    "m1.large": {"VCPU": 4, "MEMORY_MB": 8192, "DISK_GB": 80},
    "m1.xlarge": {"VCPU": 8, "MEMORY_MB": 16384, "DISK_GB": 160},
}
#: asks for more than any node has: the scheduler finds no valid host (a rejected build).
HUGE_FLAVOR: Flavor = {"VCPU": 1024, "MEMORY_MB": 2048, "DISK_GB": 20}
NODE_INVENTORY = {
    "VCPU": Inventory(total=64, allocation_ratio=4.0),
    "MEMORY_MB": Inventory(total=393216, reserved=4096, allocation_ratio=1.5),
    "DISK_GB": Inventory(total=4000, reserved=100),
}
PROJECTS = ("project-alpha", "project-beta", "project-gamma")

Fate = Literal[
    "keep", "migrate_confirm", "migrate_revert", "resize_confirm", "resize_revert", "delete", "race"
]
FATES: tuple[tuple[Fate, int], ...] = (
    ("keep", 30),
    ("migrate_confirm", 14),
    ("migrate_revert", 12),
    ("resize_confirm", 8),
    ("resize_revert", 6),
    ("delete", 10),
    ("race", 20),
)


@dataclass(frozen=True, slots=True)
class InstancePlan:
    uuid: str
    project_id: str
    user_id: str
    flavor: str
    hosts: tuple[int, ...]  # scheduling preference: try these nodes in order
    fate: Fate
    migration: str
    new_flavor: str
    delete_first: bool  # in a race: the delete task is started before the revert task


#: every count a demo keeps (0 until it happens), as its summary lists them
COUNTS = (
    "builds",
    "builds_failed",
    "migrations_started",
    "resizes_started",
    "confirmed",
    "reverted",
    "migrations_no_valid_host",
    "deletes",
    "races_delete_won",
    "races_revert_won",
)


@dataclass(slots=True)
class DemoReport:
    """What happened, for printing and for tests."""

    seed: int
    providers: list[tuple[str, str]] = field(default_factory=list)  # (uuid, name)
    counts: Counter[str] = field(default_factory=Counter)
    #: error code -> how many commands were rejected with it
    rejected: Counter[str] = field(default_factory=Counter)
    #: instances deleted while a migration held their resources, and that migration
    deleted_mid_migration: list[tuple[str, str]] = field(default_factory=list)
    #: (instance, migration) pairs whose revert lost the race and was rejected with ConsumerDeleted
    rejected_reverts: list[tuple[str, str]] = field(default_factory=list)
    head: int = 0


def _uuid_from(rng: random.Random) -> str:
    return str(_uuid.UUID(int=rng.getrandbits(128), version=4))


def plan_cloud(seed: int, nodes: int, instances: int) -> tuple[list[tuple[str, str]], list[InstancePlan]]:
    """Everything random, drawn from ``seed``: node uuids and names, and each instance's story."""
    rng = random.Random(seed)
    providers = [(_uuid_from(rng), f"compute-{i + 1:02d}") for i in range(nodes)]
    fates = [f for f, _ in FATES]
    weights = [w for _, w in FATES]
    plans = []
    for _ in range(instances):
        hosts = list(range(nodes))
        rng.shuffle(hosts)
        flavor = rng.choice(list(FLAVORS))
        plans.append(
            InstancePlan(
                uuid=_uuid_from(rng),
                project_id=rng.choice(PROJECTS),
                user_id=f"user-{rng.randint(1, 5)}",
                flavor=flavor,
                hosts=tuple(hosts),
                fate=rng.choices(fates, weights)[0],
                migration=_uuid_from(rng),
                new_flavor=rng.choice([f for f in FLAVORS if f != flavor]),
                delete_first=rng.random() < 0.5,
            )
        )
    return providers, plans


#: One command of a story: the store call to make (with its request metadata), made when the
#: round reaches the story. A story is a generator: it yields the commands of its next step and is
#: sent back their outcomes (a receipt or the error), in the same order.
Call = Callable[[], Awaitable[object]]
Story = Generator[list[Call], list[object], None]


#: at most this many instances' stories are in flight at once; a larger demo starts the next one
#: as one ends (memory stays bounded: a demo of 100,000 instances held all their stories)
IN_FLIGHT = 1000


class _Cloud:
    def __init__(self, store: AllocationStore, report: DemoReport, remember_full: bool = False) -> None:
        self.store = store
        self.report = report
        self.nodes = [u for u, _ in report.providers]
        #: node -> flavors it refused since the last time something was freed on it. Only for demos
        #: larger than IN_FLIGHT: once the cloud is full, every further build would try every node
        #: (a demo of 20,000 instances on 6 nodes made 119,000 refused claims); the scheduler skips
        #: nodes it saw refuse the flavor, or a smaller one, as Nova's skips hosts placement reports
        #: full. (Smaller demos try every node: their logs stay what they always were.)
        self.full: dict[int, list[Flavor]] | None = {} if remember_full else None

    def _seen_full(self, host: int, flavor: Flavor) -> bool:
        if self.full is None:
            return False
        refused = self.full.get(host, ())
        return any(all(flavor[rc] >= amount for rc, amount in smaller.items()) for smaller in refused)

    def _freed(self, *hosts: int | None) -> None:
        if self.full is not None:
            for host in hosts:
                if host is not None:
                    self.full.pop(host, None)

    def _reject(self, exc: err.EvstoreError) -> None:
        self.report.rejected[exc.code] += 1

    def _call(self, fn: Callable[[], Awaitable[object]], **metadata: str) -> Call:
        async def call() -> object:
            with command_metadata(**metadata):
                return await fn()

        return call

    def _place(
        self, plan: InstancePlan, flavor: Flavor, avoid: int | None = None
    ) -> Generator[list[Call], list[object], int | None]:
        """Write the instance's allocations on the first node (in its preference order) with room."""
        for host in plan.hosts:
            if host == avoid or self._seen_full(host, flavor):
                continue
            [outcome] = yield [
                self._call(
                    functools.partial(
                        self.store.set_allocations,
                        plan.uuid,
                        {self.nodes[host]: flavor},
                        project_id=plan.project_id,
                        user_id=plan.user_id,
                        consumer_type="INSTANCE",
                        generation=None,
                    ),
                    request_id=f"req-{plan.uuid[:8]}",
                    actor="demo-scheduler",
                )
            ]
            if isinstance(outcome, err.CapacityExceeded):
                self._reject(outcome)  # the scheduler's claim failed on a full node: try the next one
                if self.full is not None:
                    self.full.setdefault(host, []).append(flavor)
                continue
            _raise_unexpected(outcome)
            return host
        return None

    def story(self, plan: InstancePlan) -> Story:
        scheduler = {"request_id": f"req-{plan.uuid[:8]}", "actor": "demo-scheduler"}
        host = yield from self._place(plan, FLAVORS[plan.flavor])
        if host is None:
            self.report.counts["builds_failed"] += 1
            return
        self.report.counts["builds"] += 1
        if plan.fate == "keep":
            return
        if plan.fate == "delete":
            [outcome] = yield [
                self._call(functools.partial(self.store.delete_consumer, plan.uuid), **scheduler)
            ]
            _raise_unexpected(outcome)
            self._freed(host)
            self.report.counts["deletes"] += 1
            return
        resize = plan.fate.startswith("resize")
        flavor = FLAVORS[plan.new_flavor if resize else plan.flavor]
        start = functools.partial(self.store.start_migration, plan.uuid, plan.migration)
        [outcome] = yield [self._call(start, **scheduler)]
        _raise_unexpected(outcome)
        self.report.counts["resizes_started" if resize else "migrations_started"] += 1
        dest = yield from self._place(plan, flavor, avoid=host)
        revert = functools.partial(self.store.revert_migration, plan.migration)
        if dest is None:
            # NoValidHost: the conductor rolls the migration back.
            [outcome] = yield [self._call(revert, **scheduler)]
            _raise_unexpected(outcome)
            self.report.counts["migrations_no_valid_host"] += 1
            return
        if plan.fate in ("migrate_confirm", "resize_confirm"):
            confirm = functools.partial(self.store.confirm_migration, plan.migration)
            [outcome] = yield [self._call(confirm, **scheduler)]
            _raise_unexpected(outcome)
            self._freed(host)
            self.report.counts["confirmed"] += 1
        elif plan.fate in ("migrate_revert", "resize_revert"):
            [outcome] = yield [self._call(revert, **scheduler)]
            _raise_unexpected(outcome)
            self._freed(dest)
            self.report.counts["reverted"] += 1
        else:
            yield from self._race(plan, revert)
            self._freed(host, dest)

    def _race(self, plan: InstancePlan, revert: Callable[[], Awaitable[object]]) -> Story:
        """The user deletes the instance while the compute service reverts its migration: both
        commands are in flight at once (the one the plan starts first is queued first)."""
        delete = self._call(
            functools.partial(self.store.delete_consumer, plan.uuid),
            request_id=f"req-del-{plan.uuid[:8]}",
            actor="demo-user",
        )
        reverting = self._call(revert, request_id=f"req-rev-{plan.uuid[:8]}", actor="demo-compute")
        if plan.delete_first:
            delete_result, revert_result = yield [delete, reverting]
        else:
            revert_result, delete_result = yield [reverting, delete]
        _raise_unexpected(delete_result)
        self.report.counts["deletes"] += 1
        self.report.deleted_mid_migration.append((plan.uuid, plan.migration))
        if isinstance(revert_result, err.ConsumerDeleted | err.NotFound):
            self._reject(revert_result)
            self.report.counts["races_delete_won"] += 1
            self.report.rejected_reverts.append((plan.uuid, plan.migration))
        else:
            _raise_unexpected(revert_result)
            self.report.counts["races_revert_won"] += 1


def _raise_unexpected(outcome: object) -> None:
    if isinstance(outcome, BaseException):
        raise outcome


async def _in_rounds(stories: Iterable[Story], in_flight: int = IN_FLIGHT) -> None:
    """Run the stories concurrently, in rounds: every story still going puts the commands of its
    next step in flight, all at once (they share group commits), and the round ends when all
    are answered. Commands enter the store's queue in story order, which fixes the order of the
    log: a seed gives the same positions on every run (with a free-for-all of tasks, which
    commands share a group commit - and so the order they come back in - depends on timing).
    At most ``in_flight`` stories go at once: the next ones start, in order, as stories end."""
    pending = iter(stories)
    running: dict[int, Story] = {}
    steps: dict[int, list[Call]] = {}
    started = 0

    def start_more() -> None:
        nonlocal started
        while len(steps) < in_flight:
            story = next(pending, None)
            if story is None:
                return
            with contextlib.suppress(StopIteration):
                steps[started] = next(story)
                running[started] = story
            started += 1

    start_more()
    while steps:
        order = sorted(steps)
        calls = [call() for i in order for call in steps[i]]
        # (gather starts its tasks in this order; each queues its command before it first waits)
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        following: dict[int, list[Call]] = {}
        at = 0
        for i in order:
            mine, at = list(outcomes[at : at + len(steps[i])]), at + len(steps[i])
            try:
                following[i] = running[i].send(mine)
            except StopIteration:
                del running[i]
        steps = following
        start_more()


async def run_demo(
    store: AllocationStore, seed: int = 1848343, nodes: int = 6, instances: int = 200
) -> DemoReport:
    """Play a seeded cloud against ``store`` (which should be empty) and report what happened."""
    if nodes < 2:
        raise err.InvalidInput("the demo needs at least 2 compute nodes (migrations need a destination)")
    if instances < 1:
        raise err.InvalidInput("the demo needs at least 1 instance")
    providers, plans = plan_cloud(seed, nodes, instances)
    report = DemoReport(seed, providers)
    with command_metadata(actor="demo-operator"):
        await asyncio.gather(*(store.create_provider(u, name) for u, name in providers))
        await asyncio.gather(*(store.set_inventories(u, NODE_INVENTORY, generation=0) for u, _ in providers))
    cloud = _Cloud(store, report, remember_full=instances > IN_FLIGHT)
    await _in_rounds(cloud.story(p) for p in plans)
    # A build the scheduler cannot place anywhere: every node refuses it.
    huge = InstancePlan(
        str(_uuid.UUID(int=seed, version=4)), PROJECTS[0], "user-1", "huge", tuple(range(nodes)),
        "keep", "", "", False,
    )  # fmt: skip
    placed: list[int | None] = []

    def build_huge() -> Story:
        placed.append((yield from cloud._place(huge, HUGE_FLAVOR)))

    await _in_rounds([build_huge()])
    if placed == [None]:
        report.counts["builds_failed"] += 1
    report.head = await store.head()
    log.info("demo.done", seed=seed, head=report.head, **report.counts)
    return report
