"""Two trees' read phases on one log, in alternating runs: the raw read, replay, rebuild, audit.

    python -m tests.benchmarks.read_ab --db LOG --trees BEFORE AFTER [--pairs 3]
        [--phases raw,replay,rebuild,audit]

LOG is written once beforehand (``python -m tests.benchmarks.evstore_peer biglog --db LOG --events
300000``; both trees must read its schema). Each run is a fresh process of the tree's own peer
(``raw_peer read`` or ``evstore_peer PHASE``) started in that tree with ``PYTHONPATH`` set to it, so
that ``evstore`` is that tree's (see the README's trap about ``-m``). Pairs alternate the order
(BEFORE then AFTER, then AFTER then BEFORE). Printed per run: the peer's wall time and the child's
CPU (user + system, all its threads); then, per phase, AFTER/BEFORE of each pair and their median,
and each tree's phase against the raw read of the same pair (raw seconds / phase seconds, as the
runner's "of raw"). On a loaded machine the CPU ratios hold better than the wall ones.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys


def _run(tree: str, phase: str, db: str) -> tuple[float, float]:
    """One phase in a fresh process of ``tree``: (its wall seconds, the process's CPU seconds)."""
    peer, name = ("raw_peer", "read") if phase == "raw" else ("evstore_peer", phase)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-m", f"tests.benchmarks.{peer}", name, "--db", db],
        cwd=tree,
        env=dict(os.environ, PYTHONPATH=tree),
        capture_output=True,
        text=True,
        check=False,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"{tree}: {phase} failed\n{done.stderr}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return float(result["seconds"]), cpu


def _summary(trees: list[str], phases: list[str], runs: dict[str, dict[str, list[float]]], what: str) -> None:
    before, after = trees
    print(f"\n{what}, {os.path.basename(after)}/{os.path.basename(before)} per pair:")
    for phase in phases:
        ratios = [b / a for a, b in zip(runs[before][phase], runs[after][phase], strict=True)]
        shown = " ".join(f"{r:.3f}" for r in ratios)
        print(f"  {phase:8} {shown}  median {statistics.median(ratios):.3f}")
    if "raw" not in phases:
        return
    for phase in (p for p in phases if p != "raw"):
        for tree in trees:
            of_raw = [raw / s for raw, s in zip(runs[tree]["raw"], runs[tree][phase], strict=True)]
            shown = " ".join(f"{r:.3f}" for r in of_raw)
            median = statistics.median(of_raw)
            print(f"  {os.path.basename(tree)} {phase} x of raw: {shown}  median {median:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", required=True)
    ap.add_argument("--trees", nargs=2, required=True, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--phases", default="raw,replay,rebuild,audit")
    args = ap.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    db = os.path.abspath(args.db)
    phases = args.phases.split(",")
    wall: dict[str, dict[str, list[float]]] = {t: {p: [] for p in phases} for t in trees}
    cpu: dict[str, dict[str, list[float]]] = {t: {p: [] for p in phases} for t in trees}
    for pair in range(args.pairs):
        for tree in trees if pair % 2 == 0 else trees[::-1]:
            for phase in phases:
                seconds, used = _run(tree, phase, db)
                wall[tree][phase].append(seconds)
                cpu[tree][phase].append(used)
                print(
                    f"pair {pair} {os.path.basename(tree):>12} {phase:8} wall {seconds:7.3f} s  "
                    f"cpu {used:7.3f} s  load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    _summary(trees, phases, wall, "wall")
    _summary(trees, phases, cpu, "process CPU")


if __name__ == "__main__":
    main()
