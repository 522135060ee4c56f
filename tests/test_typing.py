"""The public API type-checks as users write it: ``mypy --strict`` on typical service code."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent

USER_CODE = """
from __future__ import annotations

import uuid

from evstore import (
    AllocationsByConsumer, AllocationStore, ConsumerAllocations, Metadata, ProviderAllocations, Receipt,
)


async def claim(store: AllocationStore, server: str, allocs: dict[str, dict[str, int]]) -> Receipt:
    return await store.set_allocations(
        server, allocs, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None,
        metadata=Metadata(request_id="req-1"),
    )


async def claim_by_uuid(
    store: AllocationStore, server: uuid.UUID, allocs: dict[uuid.UUID, dict[str, int]]
) -> Receipt:
    return await store.set_allocations(
        server, allocs, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )


async def post(store: AllocationStore, body: dict[str, ConsumerAllocations]) -> Receipt:
    return await store.write_allocations(body, metadata={"request_id": "req-2"})


async def post_raw(store: AllocationStore, body: dict[str, dict[str, object]]) -> Receipt:
    return await store.write_allocations(body)


async def aliases(store: AllocationStore, a: ProviderAllocations, b: AllocationsByConsumer) -> int:
    r = await store.set_allocations(
        "c", a, project_id="p", user_id="u", consumer_type="INSTANCE", generation=None
    )
    return len((await store.write_allocations(b)).positions) + len(r.positions)
"""

#: the same calls with mistakes mypy must report (so the check above is not vacuous)
WRONG = """
from evstore import AllocationStore, Receipt


async def wrong(store: AllocationStore, allocs: dict[str, dict[str, str]]) -> Receipt:
    return await store.set_allocations(
        "c", allocs, project_id="p", user_id="u", consumer_type="INSTANCE", generation="0"
    )
"""


_CACHES: dict[str, Path] = {}


def _cache_dir(config: Path) -> Path:
    """One mypy cache per config for this test process: a fresh cache re-checks evstore, pydantic
    and asyncio's stubs each time (~12 s a run, a dozen runs); a shared one checks them once.
    (mypy re-checks ``service.py``, a new file each time, from its contents.)"""
    if not _CACHES:
        root = Path(tempfile.mkdtemp(prefix="evstore-mypy-cache-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _CACHES[""] = root
    return _CACHES.setdefault(str(config), _CACHES[""] / str(len(_CACHES)))


def _mypy(
    tmp_path: Path, source: str, config: Path = ROOT / "pyproject.toml"
) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mypy")
    path = tmp_path / "service.py"
    path.write_text(source)
    env = {**os.environ, "MYPYPATH": str(ROOT)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--config-file",
            str(config),
            "--cache-dir",
            str(_cache_dir(config)),
            str(path),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )


def test_allocation_bodies_type_check_with_ordinary_dicts(tmp_path: Path) -> None:
    result = _mypy(tmp_path, USER_CODE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistakes_in_the_same_calls_are_reported(tmp_path: Path) -> None:
    result = _mypy(tmp_path, WRONG)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "set_allocations" in result.stdout and "generation" in result.stdout, result.stdout


def test_the_export_docstring_shows_its_example_as_written() -> None:
    """Regression (review 25, helper-e): ``help(AllocationStore.export)`` showed its example as
    ``f.write(line + "`` and ``")`` on two lines: the docstring's ``"\\n"`` was a real newline."""
    from evstore import AllocationStore

    doc = AllocationStore.export.__doc__ or ""
    assert 'f.write(line + "\\n")' in doc, doc


#: the value types' constructors as the README writes them, and with the mistakes a checker must see
CONSTRUCTORS = """
from __future__ import annotations

import uuid
from decimal import Decimal

from evstore import ConsumerAllocations, Inventory

ok = [
    Inventory(total=16, allocation_ratio=4.0),
    Inventory(total=16, reserved=1, min_unit=1, max_unit=8, step_size=1, allocation_ratio=Decimal("1.5")),
]
body = ConsumerAllocations(
    allocations={uuid.uuid4(): {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE",
    consumer_generation=None,
)
also = ConsumerAllocations(
    allocations={"rp": {"VCPU": 1}}, project_id="p", user_id="u", consumer_type="INSTANCE", generation=3
)
"""

CONSTRUCTOR_MISTAKES = """
from evstore import ConsumerAllocations, Inventory

a = Inventory(totl=16)  # line 4
b = Inventory(total="16")  # line 5
c = ConsumerAllocations(  # line 6
    alocations={}, project_id="p", user_id="u", consumer_type="INSTANCE"
)
d = ConsumerAllocations(allocations={"rp": {"VCPU": 1}}, project_id=1, user_id="u", consumer_type="X")  # 9
"""


def test_value_types_construct_as_documented(tmp_path: Path) -> None:
    result = _mypy(tmp_path, CONSTRUCTORS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistakes_in_value_type_constructors_are_reported(tmp_path: Path) -> None:
    """Regression (review 25, helper-h): ``Inventory`` and ``ConsumerAllocations`` declared
    ``__init__(self, /, **data: Any)`` (to turn pydantic's errors into evstore's), which hid the
    fields from type checkers: ``Inventory(totl=16)`` and ``Inventory(total="16")`` passed
    ``mypy --strict`` and pyright, and failed only when run."""
    result = _mypy(tmp_path, CONSTRUCTOR_MISTAKES)
    assert result.returncode == 1, result.stdout + result.stderr
    for line in (4, 5, 6, 9):
        assert f"service.py:{line}: error" in result.stdout, result.stdout


METADATA_MISTAKES = """
from evstore import Metadata

ok = Metadata(request_id="req-1", actor="me", ticket="T-1")
wrong = Metadata(request_id=5)  # line 5
"""


def test_a_wrong_metadata_field_is_reported_without_the_pydantic_plugin(tmp_path: Path) -> None:
    """Regression (review 33, helper-R): the metaclass that turns ``Metadata(...)``'s pydantic error
    into InvalidInput (f7e2ca8) hid the model's fields from mypy, which reads them from the
    ``dataclass_transform`` on pydantic's own metaclass only: ``Metadata(request_id=5)`` passed
    ``mypy --strict`` in a project without the pydantic plugin (most users'), as it had not. A
    caller's own keys (``extra="allow"``) type-check, as they run; with the plugin too."""
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n\n[mypy-os_resource_classes,aiosqlite.*]\nignore_missing_imports = True\n")
    for result in (_mypy(tmp_path, METADATA_MISTAKES, config), _mypy(tmp_path, METADATA_MISTAKES)):
        assert result.returncode == 1, result.stdout + result.stderr
        assert "service.py:5: error" in result.stdout and "request_id" in result.stdout, result.stdout
        assert "service.py:4:" not in result.stdout, result.stdout


MISSPELT_NAMES = """
import evstore
from evstore import ConsumerDeletd  # line 3


def handle(exc: Exception) -> bool:
    return isinstance(exc, evstore.CapacityExeeded)  # line 7
"""


def test_a_misspelt_name_from_evstore_is_reported(tmp_path: Path) -> None:
    """Regression (review 25, helper-h): the module ``__getattr__`` that loads the store lazily
    told type checkers that *every* name exists in ``evstore`` (as ``Any``): ``from evstore import
    ConsumerDeletd`` or ``except evstore.CapacityExeeded:`` passed ``mypy --strict`` and pyright."""
    result = _mypy(tmp_path, MISSPELT_NAMES)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "service.py:3: error" in result.stdout and "service.py:7: error" in result.stdout, result.stdout


def test_every_exported_name_is_known_to_type_checkers(tmp_path: Path) -> None:
    import evstore

    names = ", ".join(evstore.__all__)
    result = _mypy(tmp_path, f"from evstore import {names}\n\nprint({names})\n")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_metadata_evstore_writes_is_typed(tmp_path: Path) -> None:
    """(review 25, helper-h: ``.idempotency_key`` was no attribute of ``Metadata`` for mypy)"""
    source = (
        "from evstore import RecordedEvent\n\n\n"
        "def keys(e: RecordedEvent) -> tuple[str | None, str | None, str | None]:\n"
        "    return e.metadata.request_id, e.metadata.command_id, e.metadata.idempotency_key\n"
    )
    result = _mypy(tmp_path, source)
    assert result.returncode == 0, result.stdout + result.stderr


#: every documented ``open_store`` option, typed as the README gives them (both backends' and the store's)
OPEN_STORE_OPTIONS = """
from __future__ import annotations

from evstore import AllocationStore, StoreOpener, StoreOptions, open_store


def sqlite() -> StoreOpener:
    return open_store(
        "sqlite:///cloud.db", synchronous="NORMAL", busy_timeout=5, create=False, max_batch=64,
        poll_interval=0.1, snapshot_every=1000,
    )


def postgres() -> StoreOpener:
    return open_store(
        "postgresql://db/evstore", pool_size=20, min_pool_size=2, connect_timeout=10,
        command_timeout=30.0, max_retries=5, statement_cache_size=0, create=True,
    )


def from_config(config: StoreOptions) -> StoreOpener:
    return open_store("sqlite:///cloud.db", **config)


async def use() -> AllocationStore:
    async with sqlite() as store:
        pass
    return await postgres()
"""

OPEN_STORE_MISTAKES = """
from evstore import open_store

a = open_store("sqlite:///cloud.db", pool_sise=20)  # line 4
b = open_store("sqlite:///cloud.db", busy_timeout="30")  # line 5
c = open_store("sqlite:///cloud.db", create="false")  # line 6
"""


def test_open_store_options_type_check_as_documented(tmp_path: Path) -> None:
    result = _mypy(tmp_path, OPEN_STORE_OPTIONS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mistakes_in_open_store_options_are_reported(tmp_path: Path) -> None:
    """Regression (review 27, helper-72): ``open_store(url, **options: Any)`` returned the private
    ``_StoreOpener``: a service could not annotate what it holds, and ``pool_sise=20`` or
    ``busy_timeout="30"`` passed ``mypy --strict`` and failed only when the store opened."""
    result = _mypy(tmp_path, OPEN_STORE_MISTAKES)
    assert result.returncode == 1, result.stdout + result.stderr
    for line in (4, 5, 6):
        assert f"service.py:{line}: error" in result.stdout, result.stdout


def test_store_options_name_every_option_the_store_and_its_backends_take() -> None:
    """``StoreOptions`` (what checkers see of ``open_store``'s keywords) stays the list the store
    and both backends accept at run time, which still refuse anything else."""
    pytest.importorskip("asyncpg")
    from evstore import StoreOptions
    from evstore.log import STORE_KEYWORDS, postgres, sqlite

    accepted = {*STORE_KEYWORDS, *sqlite.OPTIONS, *postgres.OPTIONS}
    assert set(StoreOptions.__optional_keys__) == accepted
    assert not StoreOptions.__required_keys__


async def test_an_unknown_open_store_option_is_still_refused_when_it_opens() -> None:
    from evstore import InvalidInput, open_store

    options: dict[str, Any] = {"pool_sise": 20}
    with pytest.raises(InvalidInput, match="pool_sise"):
        async with open_store("sqlite://", **options):
            pass


#: what ``help()`` of each write must tell a person: what it takes and what it raises
WRITE_DOCS = {
    "write_allocations": (
        "ConsumerAllocations",
        "consumer_generation",
        "{provider: {class: amount}}",
        "project_id",
        "ConcurrentUpdate",
        "ConsumerDeleted",
        "ProviderNotFound",
        "UnknownResourceClass",
        "InvalidInventory",
        "ConstraintViolation",
        "CapacityExceeded",
        "Receipt",
    ),
    "set_allocations": (
        "{provider: {class: amount}}",
        "generation=None",
        "ConcurrentUpdate",
        "ConsumerDeleted",
        "ProviderNotFound",
        "UnknownResourceClass",
        "InvalidInventory",
        "ConstraintViolation",
        "CapacityExceeded",
        "Receipt",
    ),
    "set_inventories": (
        "Inventory",
        "generation",
        "ConcurrentUpdate",
        "InventoryInUse",
        "UnknownResourceClass",
    ),
    "set_inventory": (
        "Inventory",
        "generation",
        "ConcurrentUpdate",
        "UnknownResourceClass",
        "ProviderNotFound",
    ),
    "release": ("NotFound", "generation"),
    "delete_consumer": ("tombstone", "ConsumerDeleted", "migration"),
}


@pytest.mark.parametrize("method", sorted(WRITE_DOCS))
def test_help_of_each_write_says_what_it_takes_and_raises(method: str) -> None:
    """Regression (review 27, helper-72): ``help(AllocationStore.write_allocations)`` said only
    "Replace the allocations of one or more consumers atomically": not the body's shape, the
    generation rule or a single error; ``set_allocations`` and the inventory writes named no error."""
    import inspect

    from evstore import AllocationStore

    doc = inspect.getdoc(getattr(AllocationStore, method)) or ""
    missing = [word for word in WRITE_DOCS[method] if word not in doc]
    assert not missing, f"{method}'s docstring does not mention {missing}:\n{doc}"


COMMAND_METADATA = """
from evstore import command_metadata

with command_metadata(request_id="req-1", correlation_id="c", causation_id="x", actor="me", tenant="t"):
    pass
with command_metadata(request_id=5):  # line 6
    pass
with command_metadata(actor=["me"]):  # line 8
    pass
"""


def test_command_metadata_shows_its_documented_keywords_to_checkers(tmp_path: Path) -> None:
    """(review 27, helper-72: ``command_metadata(**metadata: Any)`` let ``request_id=5`` through
    the checker, refused only when run; the documented keys are typed now, others still allowed)"""
    result = _mypy(tmp_path, COMMAND_METADATA)
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error" in line]
    assert [e.split(":")[1] for e in errors] == ["6", "8"], result.stdout
