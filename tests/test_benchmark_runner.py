"""The benchmark runner's own logic (tests/benchmarks/run.py, tests/peers/venv.py), without running a
benchmark: what it tells a user when something it needs is missing, and how it judges the targets.
No timing is asserted anywhere here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.peers import venv


def test_an_unusable_peers_cache_is_reported_as_unavailable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a cache dir that cannot be created (its parent is a file): the benchmark and the differential
    # tests must hear "unavailable, because ..." (and skip that peer), not crash on FileExistsError
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EVSTORE_PEERS_CACHE", str(blocker / "cache"))
    with pytest.raises(venv.PeerUnavailable, match="EVSTORE_PEERS_CACHE"):
        venv.ensure_venv("anything", ("nothing-installed",))
