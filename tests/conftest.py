"""Shared fixtures. ``store`` runs every backend-agnostic test on each configured backend."""

from __future__ import annotations

import os
import random
import uuid
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

from evstore import AllocationStore, Inventory, open_store
from tests.peers.placement_client import PlacementPeer
from tests.peers.venv import PeerUnavailable, placement_python

# pytest-xdist's workers (the suite runs on one per core: pyproject's addopts) start with COLUMNS=80
# and LINES in their environment where the pytest that started them had none: the CLI, run in-process
# by many tests, then folds its lines at 80 columns where a serial run's pipe gets 200. Tests that
# want a width set COLUMNS themselves.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.pop("COLUMNS", None)
    os.environ.pop("LINES", None)

#: the backends a test parametrised by hand runs on: PostgreSQL where a server is configured
BACKENDS = ["sqlite"]
if os.environ.get("EVSTORE_TEST_POSTGRES_URL"):
    BACKENDS.append("postgres")


def new_uuid() -> str:
    return str(uuid.uuid4())


def campaign_seed(name: str) -> int:
    """The seed of a randomized campaign (the command mix of cross-process races, say):
    ``EVSTORE_SEED`` if set (to replay a printed one); under CI (``CI=true``, or
    ``EVSTORE_FIXED_SEEDS=1``, which .ci/run sets) one fixed per campaign, so that the gating run
    explores the same mixes every time - their interleavings still vary - and a new seed's find
    turns up locally or in the slow profile rather than failing a landing; otherwise a fresh one."""
    given = os.environ.get("EVSTORE_SEED")
    if given:
        return int(given)
    if os.environ.get("CI") == "true" or os.environ.get("EVSTORE_FIXED_SEEDS") == "1":
        return zlib.crc32(name.encode()) % (1 << 30)
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run:  # (one fresh seed for the run: every pytest-xdist worker must collect the same ids)
        return zlib.crc32(f"{name} {run}".encode()) % (1 << 30)
    return random.randrange(1 << 30)


@pytest.fixture(scope="session")
def placement_peer() -> Iterator[PlacementPeer]:
    """The real OpenStack Placement 16.0.0, driven in its own venv (built once); skipped where it
    cannot be installed, except under CI, where its absence fails."""
    try:
        python = placement_python()
    except PeerUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"the Placement 16.0.0 peer is required under CI: {exc}")
        pytest.skip(f"Placement 16.0.0 peer unavailable: {exc}")
    peer = PlacementPeer(python)
    try:
        yield peer
    finally:
        peer.close()


# (both, always: without a server a backend-agnostic test's PostgreSQL run is skipped with its reason,
# and fails under CI=true, by fresh_database_url - rather than quietly not being there)
@pytest.fixture(params=["sqlite", "postgres"])
def backend_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def store_url(backend_name: str, tmp_path: Path) -> str:
    """A URL to a fresh, empty store on the backend under test."""
    if backend_name == "sqlite":
        return f"sqlite:///{tmp_path}/evstore.db"
    from tests.pg import fresh_database_url

    return fresh_database_url()


@pytest.fixture
async def store(store_url: str) -> AsyncIterator[AllocationStore]:
    async with open_store(store_url) as s:
        yield s


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path}/evstore.db"


ProviderFactory = Callable[..., object]


async def make_provider(
    store: AllocationStore, name: str | None = None, parent: str | None = None, **inventories: Inventory | int
) -> str:
    """Create a provider with inventories given as ``VCPU=8`` (total) or ``VCPU=Inventory(...)``."""
    rp = new_uuid()
    await store.create_provider(rp, name or f"rp-{rp}", parent=parent)
    if inventories:
        invs = {
            rc: inv if isinstance(inv, Inventory) else Inventory(total=inv) for rc, inv in inventories.items()
        }
        await store.set_inventories(rp, invs, generation=0)
    return rp


async def allocate(
    store: AllocationStore,
    consumer: str,
    allocations: dict[str, dict[str, int]],
    generation: int | None = None,
    project_id: str = "project",
    user_id: str = "user",
    consumer_type: str = "INSTANCE",
) -> None:
    await store.set_allocations(
        consumer,
        allocations,
        project_id=project_id,
        user_id=user_id,
        consumer_type=consumer_type,
        generation=generation,
    )


@pytest.fixture
def logging_as_it_was() -> Iterator[None]:
    """(``cli.main`` run in this process configures structlog and the root logger to print on this
    test's captured stderr, closed after it: put back as they were - tests/test_s40_B_tail.py says why)"""
    import logging

    import structlog

    config, root, aiosqlite = structlog.get_config(), logging.getLogger(), logging.getLogger("aiosqlite")
    handlers, level, aiosqlite_level = root.handlers[:], root.level, aiosqlite.level
    try:
        yield
    finally:
        structlog.configure(**config)
        root.handlers[:] = handlers
        root.setLevel(level)
        aiosqlite.setLevel(aiosqlite_level)


@pytest.fixture
def pg_url() -> str:
    """A URL to a fresh, empty PostgreSQL store (skipped without a server, a failure under CI=true)."""
    from tests.pg import fresh_database_url

    return fresh_database_url()


def pytest_configure(config: pytest.Config) -> None:
    # The library logs every command at info; keep failing tests' output readable.
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
