"""Issue 2 ("Core"), read literally: packaging (point 1), the README's two set-up commands (2),
``.ci/run`` (3), the public API's exact names, keyword names and return shapes (4), and a library
that never configures logging (11). Each check is what an acceptance test written from the issue's
words would do, through the installed package, its files and its public API."""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import re
import sqlite3
import subprocess
import sys
import tomllib
import uuid
from pathlib import Path

import pytest

import evstore
from evstore import AllocationStore, Inventory, open_store

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _names(requirements: list[str]) -> dict[str, str]:
    """``{"pydantic": "pydantic>=2.6,<3", ...}`` from a list of requirement strings."""
    out = {}
    for requirement in requirements:
        found = re.match(r"\s*([A-Za-z0-9_.-]+)", requirement)
        assert found, requirement
        out[found[1].lower().replace("_", "-")] = requirement
    return out


# --- point 1: packaging ------------------------------------------------------------------------


def test_pyproject_declares_python_the_runtime_deps_the_test_extra_and_the_console_script() -> None:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    assert re.fullmatch(r">=\s*3\.11", project["requires-python"]), project["requires-python"]
    runtime = _names(project["dependencies"])
    for name in ("aiosqlite", "pydantic", "structlog"):
        assert name in runtime, f"runtime dependency {name} missing: {sorted(runtime)}"
    # pydantic v2: a lower bound of 2.x and nothing that admits 3
    assert re.search(r">=\s*2(\.|$|,)", runtime["pydantic"]) and "<3" in runtime["pydantic"], runtime[
        "pydantic"
    ]
    test_extra = _names(project["optional-dependencies"]["test"])
    for name in ("pytest", "pytest-asyncio", "hypothesis", "ruff", "mypy"):
        assert name in test_extra, f"the test extra lacks {name}: {sorted(test_extra)}"
    assert project["scripts"]["evstore"].split(":")[0] in ("evstore.__main__", "evstore.cli")


def test_the_installed_distribution_has_the_evstore_script_and_ships_py_typed() -> None:
    dist = importlib.metadata.distribution("evstore")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert "evstore" in scripts, scripts
    # the console script is on the venv's PATH, runs, and names the version
    script = Path(sys.executable).parent / "evstore"
    assert script.exists(), script
    done = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0 and evstore.__version__ in done.stdout, (done.stdout, done.stderr)
    # PEP 561: both packages carry a py.typed marker, and the build configuration ships it
    for package in ("evstore", "projections"):
        marker = Path(__import__(package).__file__).parent / "py.typed"
        assert marker.is_file(), marker
    package_data = _pyproject()["tool"]["setuptools"]["package-data"]  # type: ignore[index]
    assert "py.typed" in package_data["evstore"], package_data


# --- point 2: the README's two set-up commands -------------------------------------------------


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", section, re.S)]


def test_the_readme_gives_exactly_two_set_up_commands_demo_and_tests() -> None:
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    demo, tests = commands
    for command in commands:
        assert "\n" not in command, f"a set-up command is one line: {command!r}"
        assert "python3 -m venv" in command and "pip install" in command, command
    assert demo.endswith("evstore demo"), demo
    assert re.search(r"\bpytest\b", tests) and "[test]" in tests, tests


@pytest.mark.skipif(
    not os.environ.get("EVSTORE_SLOW"), reason="builds a fresh venv from PyPI (EVSTORE_SLOW=1 runs it)"
)
def test_the_readmes_demo_command_works_in_a_fresh_venv_from_a_fresh_copy(tmp_path: Path) -> None:
    """The first set-up command, word for word, in a fresh copy of the repository (a ``git clone``,
    so only committed files) and a fresh venv: it installs and runs ``evstore demo``, exit 0, clean."""
    copy = tmp_path / "fresh"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(copy)], check=True, timeout=120)
    demo, _ = _quick_start_commands()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "EVSTORE_", "PYTHON"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if "venv" not in p)
    done = subprocess.run(
        ["bash", "-c", demo], cwd=copy, capture_output=True, text=True, timeout=900, env=env, check=False
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "clean" in done.stdout.lower(), done.stdout[-2000:]
    assert (copy / "evstore-demo.db").exists()


# --- point 3: .ci/run --------------------------------------------------------------------------


def test_ci_run_makes_a_fresh_venv_lints_type_checks_and_runs_the_readmes_test_command() -> None:
    script = (ROOT / ".ci" / "run").read_text()
    assert os.access(ROOT / ".ci" / "run", os.X_OK)
    assert re.search(r"-m venv", script) and re.search(r"pip install [^\n]*\.\[test\]", script), script
    assert re.search(r"^ruff check\b", script, re.M), "ruff check"
    assert re.search(r"^mypy --strict evstore projections\b", script, re.M), (
        "mypy --strict evstore projections"
    )
    _, tests = _quick_start_commands()
    readme_pytest = tests.split("&&")[-1].strip()
    assert re.search(rf"^{re.escape(readme_pytest)}\s*$", script, re.M), (readme_pytest, script)


# --- point 4: the public API's exact names ----------------------------------------------------

#: method -> (positional-or-keyword parameter names, keyword-only names it must take), from the issue
SIGNATURES: dict[str, tuple[list[str], set[str]]] = {
    "create_provider": (["uuid", "name", "parent"], {"idempotency_key"}),
    "delete_provider": (["uuid"], {"idempotency_key"}),
    "set_inventories": (["provider", "inventories", "generation"], {"idempotency_key"}),
    "write_allocations": (["allocations"], {"idempotency_key"}),
    "set_allocations": (
        ["consumer", "allocations"],
        {"project_id", "user_id", "consumer_type", "generation", "idempotency_key"},
    ),
    "release": (["consumer"], {"idempotency_key"}),
    "start_migration": (["instance", "migration"], {"idempotency_key"}),
    "revert_migration": (["migration"], {"idempotency_key"}),
    "confirm_migration": (["migration"], {"idempotency_key"}),
    "delete_consumer": (["consumer"], {"idempotency_key"}),
    "usage": (["provider"], set()),
    "allocations": (["consumer"], set()),
    "provider_allocations": (["provider"], set()),
    "usages": (["project_id", "user_id", "consumer_type"], set()),
    "history": (["uuid"], set()),
    "head": ([], set()),
    "subscribe": (["after"], set()),
    "audit": ([], set()),
    "state_at": (["position", "at"], set()),
    "diff": (["a", "b"], set()),
    "rebuild": ([], set()),
}


@pytest.mark.parametrize("method", sorted(SIGNATURES))
def test_store_methods_have_the_issues_names_and_keyword_names(method: str) -> None:
    positional, keyword_only = SIGNATURES[method]
    params = list(inspect.signature(getattr(AllocationStore, method)).parameters.values())[1:]
    leading = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert leading[: len(positional)] == positional, (method, leading)
    by_name = {p.name: p for p in params}
    for name in keyword_only:
        assert name in by_name, (method, name)
        assert by_name[name].kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if "idempotency_key" in keyword_only:
        assert by_name["idempotency_key"].default is None
    # the optional ones the issue gives defaults for
    defaults = {
        "create_provider": {"parent": None},
        "usages": {"user_id": None, "consumer_type": None},
        "subscribe": {"after": 0},
        "state_at": {"position": None, "at": None},
    }
    for name, default in defaults.get(method, {}).items():
        assert by_name[name].default == default, (method, name, by_name[name].default)
    if method == "set_allocations":
        assert by_name["generation"].default is inspect.Parameter.empty, (
            "generation must be given (None: absent)"
        )


def test_open_store_takes_a_url_and_options_and_the_errors_carry_the_issues_codes() -> None:
    params = list(inspect.signature(open_store).parameters.values())
    assert params[0].name == "url" and params[-1].kind is inspect.Parameter.VAR_KEYWORD
    codes = {
        "ConcurrentUpdate": "placement.concurrent_update",
        "ConsumerDeleted": "evstore.consumer.deleted",
        "InventoryInUse": "placement.inventory.inuse",
        "ProviderInUse": "placement.resource_provider.inuse",
        "DuplicateName": "placement.duplicate_name",
    }
    for name, code in codes.items():
        assert getattr(evstore, name).code == code, name
    for name in (
        "CapacityExceeded",
        "ConstraintViolation",
        "InvalidInventory",
        "ProviderNotFound",
        "CannotDeleteParent",
        "NotFound",
        "InvalidInput",
    ):
        cls = getattr(evstore, name)
        assert issubclass(cls, evstore.EvstoreError) and isinstance(cls.code, str) and cls.code, name
    assert issubclass(evstore.InvalidInput, ValueError)
    for model in (evstore.Inventory, evstore.ConsumerAllocations):
        assert hasattr(model, "model_validate") and hasattr(model, "model_fields"), "a pydantic v2 model"


async def test_urls_uuid_arguments_and_return_shapes_as_the_issue_gives_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "relative").mkdir()
    async with open_store("sqlite:///relative/path.db") as store:  # relative to the working directory
        await store.create_provider(uuid.uuid4(), "rel")
    assert (tmp_path / "relative" / "path.db").is_file()
    absolute = tmp_path / "absolute.db"
    url = f"sqlite:///{absolute}"
    assert url.startswith("sqlite:////")
    node, server, other = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    async with open_store(url) as store:
        # every uuid argument accepts str or uuid.UUID (upper case too); uuids come back lowercase dashed str
        await store.create_provider(node, "node")
        generation = await store.set_inventories(
            str(node).upper(), {"VCPU": Inventory(total=8), "MEMORY_MB": Inventory(total=1024)}, generation=0
        )
        assert generation == 1 and isinstance(generation, int)
        await store.set_allocations(
            server,
            {node: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        usage = await store.usage(str(node))
        assert usage.generation == 2 and dict(usage.usages) == {"VCPU": 2, "MEMORY_MB": 0}
        mine = await store.allocations(str(server).upper())
        assert dict(mine.allocations) == {str(node): {"VCPU": 2}}
        assert all(type(k) is str and k == str(uuid.UUID(k)) for k in mine.allocations)
        assert (mine.project_id, mine.user_id, mine.consumer_type, mine.generation, mine.deleted) == (
            "p",
            "u",
            "INSTANCE",
            1,
            False,
        )
        absent = await store.allocations(other)
        assert absent.generation is None and absent.deleted is False and dict(absent.allocations) == {}
        assert await store.provider_allocations(node) == {str(server): {"VCPU": 2}}
        events = [e async for e in store.history(node)]
        assert [e.position for e in events] == [1, 2, 3]
        for e in events:
            assert isinstance(e.type, str) and e.recorded_at.tzinfo is not None and e.metadata is not None
        assert events[-1].payload["consumer"] == str(server)
        assert await store.head() == 3
        assert (await store.audit()).clean is True
    with sqlite3.connect(absolute) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


# --- point 11: the library never configures logging --------------------------------------------

_PROBE = """
import asyncio, json, logging, sys, uuid
import structlog
import evstore
from evstore import Inventory, open_store

async def main():
    async with open_store(sys.argv[1]) as store:
        rp = str(uuid.uuid4())
        await store.create_provider(rp, "n")
        await store.set_inventories(rp, {"VCPU": Inventory(total=1)}, generation=0)
        try:
            await store.set_allocations(str(uuid.uuid4()), {rp: {"VCPU": 5}}, project_id="p",
                                        user_id="u", consumer_type="INSTANCE", generation=None)
        except evstore.CapacityExceeded:
            pass
        await store.audit()

asyncio.run(main())
root = logging.getLogger()
print(json.dumps({"structlog_configured": structlog.is_configured(),
                  "root_handlers": len(root.handlers), "root_level": root.level,
                  "loggers_with_handlers": sorted(n for n, l in logging.Logger.manager.loggerDict.items()
                                                  if isinstance(l, logging.Logger) and l.handlers)}))
"""


def test_the_library_never_configures_logging_and_logs_each_outcome(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, f"sqlite:///{tmp_path}/l.db"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    *lines, last = done.stdout.strip().splitlines()
    found = json.loads(last)
    assert found == {
        "structlog_configured": False,
        "root_handlers": 0,
        "root_level": 30,
        "loggers_with_handlers": [],
    }, found
    # unconfigured structlog prints each command's outcome: accepted with its position, rejected with its code
    text = "\n".join(lines)
    assert "command.accepted" in text and "command.rejected" in text, text
    assert "evstore.allocation.capacity_exceeded" in text, text


# --- point 12: `evstore demo` with its default database, then `evstore audit --db PATH [--json]` --


def test_a_bare_evstore_demo_writes_its_default_database_in_the_working_directory(tmp_path: Path) -> None:
    script = str(Path(sys.executable).parent / "evstore")
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [script, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
        )

    demo = run("demo")
    assert demo.returncode == 0, demo.stderr
    assert (tmp_path / "evstore-demo.db").is_file(), sorted(p.name for p in tmp_path.iterdir())
    assert "clean" in demo.stdout and "VCPU" in demo.stdout and "Traceback" not in demo.stderr
    audit = run("audit", "--db", "evstore-demo.db", "--json")
    assert audit.returncode == 0, audit.stderr
    report = json.loads(audit.stdout)
    assert report["clean"] is True
    human = run("audit", "--db", "evstore-demo.db")
    assert human.returncode == 0 and "clean" in human.stdout
