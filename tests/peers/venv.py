"""Dedicated virtual environments for peer implementations, created on demand and cached.

A peer (e.g. the real OpenStack Placement) must not be installed into evstore's own environment:
its dependency tree (oslo.*, SQLAlchemy, ...) is large and pinned differently. Each peer gets its
own venv under ``$EVSTORE_PEERS_CACHE`` (default ``~/.cache/evstore-peers``), built once with
``pip install`` by package name and reused afterwards. A lock file makes parallel test processes
(pytest-xdist workers, two CI jobs) wait for one another instead of racing on the same directory.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import venv
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

PLACEMENT_REQUIREMENTS = ("openstack-placement==16.0.0",)
_READY = ".evstore-peer-ready"


class PeerUnavailable(RuntimeError):
    """The peer's venv could not be created (no network to the package index, build failure...)."""


def cache_root() -> Path:
    configured = os.environ.get("EVSTORE_PEERS_CACHE")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "evstore-peers"


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # (closed by the with below)
    except OSError as exc:  # an impossible or read-only cache: the peer is unavailable, saying why
        raise PeerUnavailable(
            f"cannot use the peers' cache {path.parent} (EVSTORE_PEERS_CACHE): {exc}"
        ) from exc
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _python_of(directory: Path) -> Path:
    return directory / "bin" / "python"


def ensure_venv(name: str, requirements: Sequence[str], *, timeout: float = 900.0) -> Path:
    """The python of the cached venv ``name`` with ``requirements`` installed, creating it if needed.

    The venv counts as ready only once a marker recording the exact requirements is written, so an
    interrupted build is thrown away and redone rather than half-used.
    """
    directory = cache_root() / name
    marker = directory / _READY
    wanted = "\n".join(requirements)
    python = _python_of(directory)
    if marker.exists() and marker.read_text() == wanted and python.exists():
        return python
    with _locked(cache_root() / f"{name}.lock"):
        if marker.exists() and marker.read_text() == wanted and python.exists():
            return python  # another process built it while we waited
        shutil.rmtree(directory, ignore_errors=True)
        try:
            venv.EnvBuilder(with_pip=True, clear=True).create(directory)
            result = subprocess.run(
                [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *requirements],
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            shutil.rmtree(directory, ignore_errors=True)
            raise PeerUnavailable(f"cannot create the {name} venv: {exc}") from exc
        if result.returncode != 0:
            shutil.rmtree(directory, ignore_errors=True)
            tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise PeerUnavailable(f"pip install {' '.join(requirements)} failed: {tail[0]}")
        marker.write_text(wanted)
        return python


def placement_python() -> Path:
    """The python of a venv with OpenStack Placement 16.0.0 installed (created on first use)."""
    return ensure_venv("placement-16", PLACEMENT_REQUIREMENTS)


if __name__ == "__main__":  # `python -m tests.peers.venv` pre-builds the venv (e.g. in CI setup)
    try:
        print(placement_python())
    except PeerUnavailable as exc:
        print(exc, file=sys.stderr)
        sys.exit(1)
