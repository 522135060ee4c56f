"""Two trees' sequential or 64-task phase side by side, in alternating runs, with each thread's CPU.

    python -m tests.benchmarks.thread_cpu {seq,conc} --trees BEFORE AFTER [--pairs 4] [--synchronous OFF]

Each run is a fresh process (this file run as a script, ``PYTHONPATH`` set to the tree, so that
``evstore`` and the benchmark's driver are that tree's) on a fresh file, with the quick run's
workload (``seq``: 3,000 commands one at a time; ``conc``: 64 tasks of 200). Printed per run:
ops/s, microseconds of wall time per command, and CPU per command of the event loop's thread,
the busiest other thread (the writer connection's) and the rest (from ``/proc/self/task/*/schedstat``,
read around the measured part); also the process's CPU over one idle second after a last command
(an idle store must not spin). Then, per pair, AFTER/BEFORE of each, and their medians: on a busy
machine a single run moves by tens of percent, the ratio within a pair much less.
``--synchronous OFF`` leaves out the ``fdatasync``, whose latency another process's writes to the
same disk can multiply (the hops and the CPU stay).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _thread_ns() -> dict[int, int]:
    """Each thread of this process: nanoseconds it ran."""
    out: dict[int, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[0])
        except OSError:  # (ended meanwhile)
            pass
    return out


async def _child(phase: str, workload: str, db: str, synchronous: str) -> dict[str, Any]:
    import logging

    import structlog

    from evstore import open_store
    from tests.benchmarks.common import Recorder
    from tests.benchmarks.evstore_peer import Driver, load_workload, setup

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    w = load_workload(workload)
    async with open_store(f"sqlite:///{db}", synchronous=synchronous) as store:
        await setup(store, w)
        rec = Recorder()
        streams = w.streams[:1] if phase == "seq" else w.streams

        async def run(stream: list[Any]) -> None:
            driver = Driver(store, rec)
            for op in stream:
                await driver.run(op)

        before = _thread_ns()
        rec.start()
        await asyncio.gather(*(run(s) for s in streams))
        rec.stop()
        after = _thread_ns()
        result = rec.result()
        await Driver(store, Recorder()).run(w.streams[0][0])  # (a last command, then idle)
        idle_from = _thread_ns()
        await asyncio.sleep(1.0)
        idle_to = _thread_ns()
    n = result["ops"]
    main = os.getpid()
    others = sorted((after[t] - before.get(t, 0) for t in after if t != main), reverse=True)
    return {
        "ops_s": round(result["ops_per_s"]),
        "us_op": round(1e6 / result["ops_per_s"], 1),
        "loop_us": round((after[main] - before[main]) / n / 1000, 1),
        "writer_us": round((others[0] if others else 0) / n / 1000, 1),
        "rest_us": round(sum(others[1:]) / n / 1000, 1),
        "idle_ms_per_s": round(sum(idle_to[t] - idle_from.get(t, 0) for t in idle_to) / 1e6, 2),
    }


def _workloads(directory: Path) -> dict[str, Path]:
    from tests.benchmarks.workload import generate

    paths = {"seq": directory / "seq.json", "conc": directory / "conc.json"}
    seq = generate(commands_per_stream=3000, target_live=200, n_queries=0)
    conc = generate(streams=64, commands_per_stream=200, target_live=8, n_queries=0)
    paths["seq"].write_text(json.dumps(seq.to_json()))
    paths["conc"].write_text(json.dumps(conc.to_json()))
    return paths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["seq", "conc"])
    p.add_argument("--trees", nargs=2, metavar=("BEFORE", "AFTER"))
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--synchronous", default="FULL")
    p.add_argument("--child", nargs=2, metavar=("WORKLOAD", "DB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(asyncio.run(_child(args.phase, *args.child, args.synchronous))))
        return
    if not args.trees:
        p.error("--trees BEFORE AFTER: two checkouts to compare")
    trees = [str(Path(t).resolve()) for t in args.trees]
    keys = ("us_op", "loop_us", "writer_us")
    with tempfile.TemporaryDirectory(prefix="evstore-threadcpu-") as tmp:
        workload = _workloads(Path(tmp))[args.phase]
        ratios: dict[str, list[float]] = {k: [] for k in keys}
        for pair in range(1, args.pairs + 1):
            runs = []
            for label, tree in zip(("before", "after"), trees, strict=True):
                db = Path(tmp) / f"{label}-{pair}.db"
                started = time.perf_counter()
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        args.phase,
                        "--synchronous",
                        args.synchronous,
                        "--child",
                        str(workload),
                        str(db),
                    ],
                    cwd=tree,
                    env={**os.environ, "PYTHONPATH": tree},
                    capture_output=True,
                    text=True,
                    check=True,
                )
                run = json.loads(out.stdout.strip().splitlines()[-1])
                runs.append(run)
                print(
                    f"pair {pair} {label:6s} {json.dumps(run)} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
            for k in keys:
                ratios[k].append(runs[1][k] / runs[0][k])
        load = os.getloadavg()[0]
        print(
            f"after/before per pair ({args.phase}, synchronous={args.synchronous}, load average {load:.1f}):"
        )
        for k in keys:
            shown = " / ".join(f"{r:.2f}" for r in ratios[k])
            print(f"  {k:10s} {shown}   median {statistics.median(ratios[k]):.3f}")


if __name__ == "__main__":
    main()
