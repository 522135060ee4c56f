"""The demo cloud: concurrent builds, migrations and deletes racing reverts end with a clean audit."""

from __future__ import annotations

from pathlib import Path

from evstore import open_store
from evstore.demo import plan_cloud, run_demo


async def _play(url: str, seed: int) -> tuple[object, ...]:
    async with open_store(url) as store:
        report = await run_demo(store, seed=seed, nodes=4, instances=80)
        audit = await store.audit()
        assert audit.clean, audit.to_dict()
        usage = {name: dict(await store.usage(uuid)) for uuid, name in report.providers}
        for instance, migration in report.rejected_reverts:
            # the delete won: the instance is tombstoned and neither it nor its migration holds anything
            gone = await store.allocations(instance)
            assert gone.deleted and not gone.allocations
            assert not (await store.allocations(migration)).allocations
        for instance, migration in report.deleted_mid_migration:
            assert (await store.allocations(instance)).deleted
            assert not (await store.allocations(migration)).allocations
        return (dict(report.counts), dict(report.rejected), report.head, usage)


async def test_demo_is_deterministic_and_its_races_leak_nothing(tmp_path: Path) -> None:
    first = await _play(f"sqlite:///{tmp_path}/a.db", seed=11)
    second = await _play(f"sqlite:///{tmp_path}/b.db", seed=11)
    assert first == second
    counts, rejected, _head, _ = first
    assert isinstance(counts, dict) and isinstance(rejected, dict)
    # both orders of the delete/revert race happened, and the lost reverts were rejected with the code
    assert counts["races_delete_won"] > 0 and counts["races_revert_won"] > 0
    assert rejected["evstore.consumer.deleted"] == counts["races_delete_won"]
    assert counts["builds"] > 0 and counts["confirmed"] > 0 and counts["reverted"] > 0


async def test_usage_equals_the_allocations_of_the_surviving_instances(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/c.db") as store:
        report = await run_demo(store, seed=3, nodes=3, instances=40)
        totals: dict[str, dict[str, int]] = {}
        _, plans = plan_cloud(3, 3, 40)
        for plan in plans:
            for provider, resources in (await store.allocations(plan.uuid)).allocations.items():
                for rc, amount in resources.items():
                    totals.setdefault(provider, {}).setdefault(rc, 0)
                    totals[provider][rc] += amount
        for uuid, _ in report.providers:
            used = {rc: n for rc, n in (await store.usage(uuid)).items() if n}
            assert used == totals.get(uuid, {})
