"""What ``pip install .`` promises: the declared dependency ranges are ones evstore runs with."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lower_bounds() -> dict[str, tuple[int, ...]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    bounds = {}
    for requirement in project["dependencies"]:
        found = re.match(r"([A-Za-z0-9_.-]+).*?>=\s*([0-9.]+)", requirement)
        assert found, f"{requirement!r} has no lower bound"
        bounds[found[1].lower()] = tuple(int(part) for part in found[2].split("."))
    return bounds


def test_the_declared_minimums_are_versions_the_cli_runs_with() -> None:
    """Regression (review 25, helper-e): pyproject said ``typer>=0.12`` and ``rich>=13``. With
    typer 0.12-0.25 ``evstore`` died at import (``No module named 'typer._click'``: the CLI takes
    click's exceptions from the copy typer vendors since 0.26), and with rich before 14.3 a piped
    ``import``/``rebuild`` error was no longer one line (a disabled progress bar printed a newline
    as it stopped). The CLI's tests pass with typer 0.26.0, rich 14.3.0 and the other minimums."""
    bounds = _lower_bounds()
    assert bounds["typer"] >= (0, 26), bounds["typer"]
    assert bounds["rich"] >= (14, 3), bounds["rich"]


def test_the_postgres_extra_asks_for_an_asyncpg_that_takes_a_reset() -> None:
    """Regression (review 25, helper-e): the ``postgres`` extra said ``asyncpg>=0.29``; with 0.29
    every PostgreSQL open failed as ``evstore.internal: TypeError: connect() got an unexpected
    keyword argument 'reset'`` (``create_pool(reset=...)`` is new in asyncpg 0.30)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in ("postgres", "test"):
        [asyncpg] = [r for r in extras[extra] if r.startswith("asyncpg")]
        found = re.search(r">=\s*([0-9.]+)", asyncpg)
        assert found and tuple(int(p) for p in found[1].split(".")) >= (0, 30), (extra, asyncpg)


def test_the_version_is_the_same_in_pyproject_and_the_package() -> None:
    """``evstore --version`` prints ``evstore.__version__``, written out by hand next to
    pyproject's: a release that bumps one must bump the other (helper-65 noticed nothing checked)."""
    import evstore

    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"] == evstore.__version__
