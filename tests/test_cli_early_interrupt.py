"""Ctrl-C while the ``evstore`` script is still starting (Python importing the command line:
typer, rich, pydantic, the projections, ~0.3 s) ends it as a Ctrl-C during a command does: exit
130, no traceback.

Regression (session 33, helper B; known since earlier reviews): the script's entry point was
``evstore.cli:main``, so Python imported ``evstore`` (its models, pydantic) and the whole command
line before ``main`` could catch anything, and a Ctrl-C in that first ~0.3 s printed a
``KeyboardInterrupt`` traceback of the import (and exited -2). The entry point is now
``evstore.__main__:main``, which catches it around the import, and ``import evstore`` loads only
the errors (the rest on first use). The Ctrl-C is sent deterministically, by the child itself,
as Python starts importing a given module (a timed kill would depend on the machine's speed).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from tests.test_cli_support import REPO


def _entry_point() -> tuple[str, str]:
    """The ``evstore`` script's target in pyproject.toml: (module, function)."""
    target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["evstore"]
    module, _, function = target.partition(":")
    return module, function


def _interrupted_at(
    module: str, args: list[str], *, run_as_module: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run the ``evstore`` script as pip writes it (or ``python -m evstore``), with SIGINT sent to
    itself when Python starts importing ``module``."""
    entry, function = _entry_point()
    start = (
        "import runpy\nrunpy.run_module('evstore', run_name='__main__', alter_sys=True)"
        if run_as_module
        else f"from {entry} import {function}\nsys.exit({function}())"
    )
    script = (
        textwrap.dedent(
            """
        import os, signal, sys

        class CtrlC:
            def find_spec(self, name, path=None, target=None):
                if name == {module!r}:
                    sys.meta_path.remove(self)
                    os.kill(os.getpid(), signal.SIGINT)
                return None

        sys.meta_path.insert(0, CtrlC())
        sys.argv[0] = "evstore"
        """
        ).format(module=module)
        + start
    )
    env = {k: v for k, v in os.environ.items() if k != "EVSTORE_URL"}
    return subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False, stdin=subprocess.DEVNULL,
        # (a shell's background job inherits SIGINT ignored: give it the terminal's default)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip


#: modules the script imports before the command runs (the CLI itself and its libraries), and ones
#: a command imports as it starts (the models, the projections, the store)
EARLY = [
    "evstore.cli",
    "typer",
    "rich.console",
    "structlog",
    "pydantic",
    "evstore.events",
    "projections.audit",
    "evstore.store",
]


@pytest.mark.parametrize("module", EARLY)
def test_ctrl_c_while_the_script_starts_exits_130_without_a_traceback(tmp_path: Path, module: str) -> None:
    done = _interrupted_at(module, ["import", "-", "--db", str(tmp_path / "new.db")])
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr
    assert not (tmp_path / "new.db").exists()


@pytest.mark.parametrize("module", ["evstore.cli", "typer"])
def test_ctrl_c_while_python_m_evstore_starts_exits_130_without_a_traceback(module: str) -> None:
    done = _interrupted_at(module, ["--help"], run_as_module=True)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 130, done.stderr


def test_import_evstore_leaves_the_models_and_the_store_for_later() -> None:
    """What makes the window short: ``import evstore`` (which the script's wrapper runs before
    any of evstore's code can catch a Ctrl-C) imports neither pydantic nor the store; every name
    of ``__all__`` still resolves, and ``evstore.events`` / ``evstore.schema`` as attributes too."""
    script = textwrap.dedent(
        """
        import sys, evstore
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("pydantic", "projections", "typer")
                       or m in ("evstore.events", "evstore.schema", "evstore.store"))
        assert not heavy, heavy
        missing = [name for name in evstore.__all__ if getattr(evstore, name, None) is None]
        assert not missing, missing
        assert evstore.events.Metadata is evstore.Metadata and evstore.schema.Inventory is evstore.Inventory
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO, check=False
    )
    assert done.returncode == 0, done.stderr
