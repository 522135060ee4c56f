"""Timing and result helpers shared by every peer (stdlib only: the Placement peer imports this
file from its own venv, where evstore is not installed)."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


@dataclass
class Recorder:
    """Collects per-command latencies of one measured phase."""

    latencies: list[float] = field(default_factory=list)
    outcomes: dict[str, int] = field(default_factory=dict)
    started: float = 0.0
    stopped: float = 0.0

    def start(self) -> None:
        self.started = time.perf_counter()

    def stop(self) -> None:
        self.stopped = time.perf_counter()

    def add(self, seconds: float, outcome: str = "ok", commands: int = 1) -> None:
        # A logical operation made of several commands (a migration = move + destination write)
        # records one latency per command so that ops/s and latencies count the same unit.
        for _ in range(commands):
            self.latencies.append(seconds / commands)
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + commands

    @contextmanager
    def timed(self, outcome: str = "ok", commands: int = 1) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.add(time.perf_counter() - t0, outcome, commands)

    def result(self, **extra: Any) -> dict[str, Any]:
        lat = sorted(self.latencies)
        seconds = self.stopped - self.started
        return {
            "ops": len(lat),
            "seconds": seconds,
            "ops_per_s": len(lat) / seconds if seconds > 0 else 0.0,
            "p50_ms": percentile(lat, 0.50) * 1000,
            "p99_ms": percentile(lat, 0.99) * 1000,
            "outcomes": dict(sorted(self.outcomes.items())),
            "peak_rss_mb": peak_rss_mb(),
            **extra,
        }


def emit(result: dict[str, Any]) -> None:
    """Peers talk to the runner through one JSON line on stdout (the last line)."""
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
