"""Instructions per command of the event loop's thread and of the others (the writer), by callgrind.

    python -m tests.benchmarks.thread_instr {seq,conc} --trees TREE [TREE ...] [--sizes 100 400]

For a machine too loaded for :mod:`tests.benchmarks.thread_cpu`'s wall and CPU times (stop 42:
per-pair ratios of 0.3-4.5 at a load average of 5-6): each tree runs the phase's workload (that
of ``thread_cpu``: ``seq`` one stream, ``conc`` 64 streams at once) under ``valgrind
--tool=callgrind --separate-threads=yes`` twice, with the first N and then M operations of each
stream, and the difference of each thread's instruction count is divided by the difference of
the commands run: what opening, setting up and closing cost drops out. ``synchronous=OFF``
(callgrind counts instructions: the ``fdatasync`` would only lengthen the run). A run takes 1-3
minutes per size. Instructions are not time (cache misses, system calls and the ``fdatasync``
do not show): confirm a gain with ``thread_cpu`` where the machine allows. The writer's count
repeats within ~1-2% from run to run; the loop thread's moves by up to ~5%, since how many loop
turns a sequential command takes depends on the two threads' timing.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


async def _child(phase: str, workload: str, db: str, n: int) -> int:
    import logging

    import structlog

    from evstore import open_store
    from tests.benchmarks.common import Recorder
    from tests.benchmarks.evstore_peer import Driver, load_workload, setup

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    w = load_workload(workload)
    async with open_store(f"sqlite:///{db}", synchronous="OFF") as store:
        await setup(store, w)
        rec = Recorder()
        streams = [s[:n] for s in (w.streams[:1] if phase == "seq" else w.streams)]

        async def run(stream: list[Any]) -> None:
            driver = Driver(store, rec)
            for op in stream:
                await driver.run(op)

        rec.start()
        await asyncio.gather(*(run(s) for s in streams))
        rec.stop()
    return int(rec.result()["ops"])


def _counts(out: str) -> tuple[int, int]:
    """(the main thread's instructions, all other threads') of one callgrind run."""
    main = others = 0
    for path in glob.glob(f"{out}-*"):
        thread = int(path.rsplit("-", 1)[1])
        for line in Path(path).read_text().splitlines():
            if line.startswith("totals:"):
                count = int(line.split()[1])
                if thread == 1:
                    main += count
                else:
                    others += count
    return main, others


def _run(tree: str, phase: str, workload: Path, tmp: Path, n: int) -> tuple[int, int, int]:
    tag = f"{abs(hash(tree))}-{phase}-{n}"
    out = tmp / f"cg-{tag}.out"
    result = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--separate-threads=yes",
            "--dump-instr=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            __file__,
            phase,
            "--child",
            str(workload),
            str(tmp / f"{tag}.db"),
            str(n),
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
        capture_output=True,
        text=True,
        check=True,
    )
    ops = int(result.stdout.strip().splitlines()[-1])
    return (ops, *_counts(str(out)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("phase", choices=["seq", "conc"])
    p.add_argument("--trees", nargs="+")
    p.add_argument("--sizes", nargs=2, type=int, metavar=("N", "M"), help="operations per stream")
    p.add_argument("--child", nargs=3, metavar=("WORKLOAD", "DB", "N"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        workload, db, n = args.child
        print(asyncio.run(_child(args.phase, workload, db, int(n))))
        return
    if not args.trees:
        p.error("--trees TREE [TREE ...]: checkouts to measure")
    sizes = args.sizes or ((100, 400) if args.phase == "seq" else (20, 60))
    from tests.benchmarks.thread_cpu import _workloads

    with tempfile.TemporaryDirectory(prefix="evstore-threadinstr-") as tmp:
        workload = _workloads(Path(tmp))[args.phase]
        for tree in (str(Path(t).resolve()) for t in args.trees):
            (ops_a, main_a, other_a), (ops_b, main_b, other_b) = (
                _run(tree, args.phase, workload, Path(tmp), n) for n in sizes
            )
            commands = ops_b - ops_a
            print(
                json.dumps(
                    {
                        "tree": tree,
                        "commands": commands,
                        "loop_kinstr": round((main_b - main_a) / commands / 1000, 1),
                        "writer_kinstr": round((other_b - other_a) / commands / 1000, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
