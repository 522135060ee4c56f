"""Run the benchmark suite: ``python -m tests.benchmarks.run [--quick] [--json PATH]``.

One workload (see :mod:`tests.benchmarks.workload`), four systems, each phase in its own
process, peers run back-to-back (and, in the full run, interleaved over several rounds, the
median kept), everything compared as ratios within this one run:

- evstore on SQLite (``synchronous=FULL``, WAL: its durable default);
- OpenStack Placement 16.0.0 driven as Nova drives it, in-process through its WSGI app, in its
  own venv under the cache dir (created and pip-installed on first use);
- the ``eventsourcing`` library on SQLite (installed into a cache venv if this interpreter lacks it);
- raw ``sqlite3`` doing the minimum durable work (the limit).

Plus rebuild/replay against raw reads of the same log, time travel and audit on a large log,
and, when a server is given (``--postgres URL`` or ``EVSTORE_TEST_POSTGRES_URL``) and the
backend exists, PostgreSQL with 8 clients on disjoint providers versus one.
Prints one table and writes JSON with ``--json PATH``. Never part of the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evstore.errors import redact_url
from tests.benchmarks.workload import generate
from tests.peers.venv import PLACEMENT_REQUIREMENTS, PeerUnavailable, ensure_venv, placement_python

REPO = Path(__file__).resolve().parents[2]
PLACEMENT_VERSION = PLACEMENT_REQUIREMENTS[0].partition("==")[2]  # what tests.peers.venv installs


@dataclass(frozen=True)
class Sizes:
    seq_commands: int
    placement_ops: int
    queries: int
    placement_queries: int
    conc_commands_per_task: int
    big_events: int
    consumer_samples: int
    state_samples: int
    rounds: int
    pg_commands: int


QUICK = Sizes(3000, 300, 2000, 200, 40, 30_000, 30, 2, 1, 300)
FULL = Sizes(10_000, 1500, 5000, 1000, 150, 1_000_000, 200, 3, 3, 2000)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- environments -----------------------------------------------------------------------------


def placement_venv_python() -> tuple[Path | None, str]:
    """Placement's venv: the one the differential tests use (``tests.peers.venv``, built once);
    or None and why not."""
    log(f"Placement {PLACEMENT_VERSION}: using (or first building) its cached venv...")
    try:
        return placement_python(), ""
    except PeerUnavailable as exc:
        log(f"Placement is not installable: {exc}")
        return None, f"not installable: {exc}"


def eventsourcing_python() -> tuple[str, str]:
    """This interpreter if it has eventsourcing, else a cache venv that does; or "" and why not."""
    probe = "import eventsourcing"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return sys.executable, "this interpreter"
    log("eventsourcing is not in this interpreter: using (or first building) a cached venv with it...")
    try:
        python = ensure_venv("eventsourcing", ("eventsourcing",))
    except PeerUnavailable as exc:
        log(f"eventsourcing is not installable: {exc}")
        return "", f"not installable: {exc}"
    return str(python), f"a venv the benchmark installed it into ({python.parent.parent})"


# --- running peers ----------------------------------------------------------------------------


def run_peer(argv: list[str], python: str = sys.executable, timeout: float = 3600) -> dict[str, Any]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([python, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(argv[:3])} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def peer(module: str, *args: str) -> list[str]:
    return ["-m", f"tests.benchmarks.{module}", *args]


def fresh(workdir: Path, name: str) -> str:
    for suffix in ("", "-wal", "-shm"):
        p = workdir / f"{name}{suffix}"
        if p.exists():
            p.unlink()
    return str(workdir / name)


def median_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The round with the median throughput (its latencies and RSS come with it)."""
    ordered = sorted(results, key=lambda r: r["ops_per_s"])
    chosen = dict(ordered[len(ordered) // 2])
    chosen["rounds_ops_per_s"] = [r["ops_per_s"] for r in results]
    return chosen


# --- the suite --------------------------------------------------------------------------------


def suite(args: argparse.Namespace) -> dict[str, Any]:
    """Every phase; the working directory and the PostgreSQL schemas made for the run are removed
    however the run ends (unless ``--keep``: then the databases stay, for a look)."""
    sizes = QUICK if args.quick else FULL
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="evstore-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "machine": machine(),
        "code": code_version(),
        "sizes": vars_of(sizes),
    }
    schemas: list[str] = []
    try:
        measure(args, out, sizes, workdir, schemas)
    finally:
        if args.postgres:
            drop_schemas(args.postgres, schemas)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return out


def drop_schemas(url: str, schemas: list[str]) -> None:
    """Drop the schemas this run made (each once; one that cannot be dropped is reported)."""
    while schemas:
        schema = schemas.pop()
        try:
            run_peer(peer("evstore_peer", "pgdrop", "--url", url, "--schema", schema))
        except (RuntimeError, subprocess.SubprocessError) as exc:
            log(f"could not drop the PostgreSQL schema {schema} this run made: {exc}")


def measure(
    args: argparse.Namespace, out: dict[str, Any], sizes: Sizes, workdir: Path, schemas: list[str]
) -> None:
    started = time.perf_counter()

    seq_w = generate(commands_per_stream=sizes.seq_commands, target_live=200, n_queries=sizes.queries)
    conc_w = generate(
        streams=64, commands_per_stream=sizes.conc_commands_per_task, target_live=8, n_queries=0
    )
    seq_path, conc_path = workdir / "seq.json", workdir / "conc.json"
    seq_path.write_text(json.dumps(seq_w.to_json()))
    conc_path.write_text(json.dumps(conc_w.to_json()))
    placement_w = generate(
        commands_per_stream=sizes.seq_commands, target_live=200, n_queries=sizes.placement_queries
    )
    placement_path = workdir / "placement.json"
    placement_path.write_text(json.dumps(placement_w.to_json()))

    es_python, es_how = eventsourcing_python()
    out["eventsourcing_env"] = es_how
    skipped: dict[str, str] = {}
    out["skipped"] = skipped
    if not es_python:
        skipped["eventsourcing"] = es_how
    placement_python, why = (None, "--skip-placement") if args.skip_placement else placement_venv_python()
    if placement_python is None:
        skipped["placement"] = why

    pg_url = args.postgres
    pg_ok = bool(pg_url) and postgres_backend_present()

    def pg_schema() -> str:
        made = run_peer(peer("evstore_peer", "pgsetup", "--url", str(pg_url)))
        schemas.append(made["schema"])
        out["postgres_server"] = made["server"]
        return str(made["url"])

    # sequential and concurrent, peers back-to-back within each round
    seq: dict[str, list[dict[str, Any]]] = {}
    conc: dict[str, list[dict[str, Any]]] = {}
    for rnd in range(sizes.rounds):
        log(f"round {rnd + 1}/{sizes.rounds}: sequential")
        ev = peer("evstore_peer")
        seq.setdefault("evstore", []).append(
            run_peer([*ev, "seq", "--workload", str(seq_path), "--db", fresh(workdir, "ev.db")])
        )
        seq.setdefault("sqlite3", []).append(
            run_peer(peer("raw_peer", "seq", "--workload", str(seq_path), "--db", fresh(workdir, "raw.db")))
        )
        if es_python:
            seq.setdefault("eventsourcing", []).append(
                run_peer(
                    peer("es_peer", "seq", "--workload", str(seq_path), "--db", fresh(workdir, "es.db")),
                    es_python,
                )
            )
            # information, no target: the synchronous library called the way an asyncio service
            # must call it (off the event loop), which is what evstore's commands always pay for
            es_args = ["seq", "--to-thread", "--workload", str(seq_path), "--db", fresh(workdir, "es.db")]
            seq.setdefault("eventsourcing via to_thread", []).append(
                run_peer(peer("es_peer", *es_args), es_python)
            )
        if pg_ok:
            seq.setdefault("evstore postgresql", []).append(
                run_peer([*ev, "seq", "--workload", str(seq_path), "--url", pg_schema()])
            )
        if rnd == 0:
            seq.setdefault("evstore+info-logging", []).append(
                run_peer(
                    [*ev, "seq", "--log-info", "--workload", str(seq_path), "--db", fresh(workdir, "ev.db")]
                )
                | {"round": 0}
            )
        log(f"round {rnd + 1}/{sizes.rounds}: 64 concurrent tasks")
        conc.setdefault("evstore", []).append(
            run_peer([*ev, "conc", "--workload", str(conc_path), "--db", fresh(workdir, "ev.db")])
        )
        for variant in ("conc", "conc-group"):
            conc.setdefault("sqlite3" if variant == "conc" else "sqlite3 group commit", []).append(
                run_peer(
                    peer("raw_peer", variant, "--workload", str(conc_path), "--db", fresh(workdir, "raw.db"))
                )
            )
        if pg_ok:
            conc.setdefault("evstore postgresql", []).append(
                run_peer([*ev, "conc", "--workload", str(conc_path), "--url", pg_schema()])
            )
        if es_python:
            conc.setdefault("eventsourcing", []).append(
                run_peer(
                    peer("es_peer", "conc", "--workload", str(conc_path), "--db", fresh(workdir, "es.db")),
                    es_python,
                )
            )
    if placement_python is not None:
        log(f"Placement {PLACEMENT_VERSION}: sequential ({sizes.placement_ops} operations)")
        # the evstore rounds above ran the whole stream; Placement runs its first operations
        seq["placement"] = [
            run_peer(
                [
                    "tests/benchmarks/placement_peer.py",
                    "seq",
                    "--workload",
                    str(placement_path),
                    "--db",
                    fresh(workdir, "placement.db"),
                    "--max-ops",
                    str(sizes.placement_ops),
                ],
                str(placement_python),
            )
        ]
    out["log_cost"] = run_peer(peer("evstore_peer", "logcost"))
    out["sequential"] = {k: median_result(v) for k, v in seq.items()}
    out["concurrent"] = {k: median_result(v) for k, v in conc.items()}

    # the big log: rebuild, replay (vs raw reads), time travel, audit
    log(f"writing a log of {sizes.big_events} events (not measured)...")
    big = fresh(workdir, "big.db")
    out["big_log"] = run_peer(peer("evstore_peer", "biglog", "--db", big, "--events", str(sizes.big_events)))
    reads: dict[str, list[dict[str, Any]]] = {}
    for _ in range(2 if args.quick else 3):  # interleaved; the median is kept
        reads.setdefault("sqlite3 read+json.loads", []).append(
            run_peer(peer("raw_peer", "read", "--db", big))
        )
        for phase in ("replay", "rebuild"):
            reads.setdefault(phase, []).append(run_peer(peer("evstore_peer", phase, "--db", big)))
    out["log_reads"] = {k: sorted(v, key=lambda r: r["events_per_s"])[len(v) // 2] for k, v in reads.items()}
    log("time travel and audit...")
    samples = ["--consumer-samples", str(sizes.consumer_samples), "--state-samples", str(sizes.state_samples)]
    out["time_travel"] = run_peer(peer("evstore_peer", "timetravel", "--db", big, *samples))
    out["audit"] = run_peer(peer("evstore_peer", "audit", "--db", big))
    out["export"] = run_peer(peer("evstore_peer", "export", "--db", big))
    log(
        f"export of {out['export']['events']} events: {out['export']['seconds']:.1f} s, "
        f"peak RSS {out['export']['peak_rss_mb']:.0f} MiB"
    )

    drop_schemas(str(pg_url), schemas)
    if not pg_url:
        out["postgres"] = {"skipped": "no server given (--postgres URL or EVSTORE_TEST_POSTGRES_URL)"}
    elif not pg_ok:
        out["postgres"] = {"skipped": "the PostgreSQL backend (evstore.log.postgres) is not in this build"}
    else:
        out["postgres"] = postgres_scaling(pg_url, workdir, sizes)
    out["duration_s"] = time.perf_counter() - started
    if code_version() != out["code"]:
        # every phase runs in a fresh process that imports the tree as it is at that moment
        out["code"]["changed_during_run"] = True


def postgres_backend_present() -> bool:
    probe = "import asyncpg; from evstore.log.postgres import PostgresBackend"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, cwd=REPO).returncode == 0


def postgres_scaling(url: str, workdir: Path, sizes: Sizes) -> dict[str, Any]:
    """8 client processes on disjoint providers versus one client, same per-client stream length."""
    w = generate(
        n_providers=8 * 5,
        streams=8,
        commands_per_stream=sizes.pg_commands,
        target_live=50,
        disjoint=True,
        n_queries=0,
    )
    path = workdir / "pg.json"
    path.write_text(json.dumps(w.to_json()))
    try:
        made = run_peer(peer("evstore_peer", "pgsetup", "--workload", str(path), "--url", url))
    except RuntimeError as exc:
        return {"skipped": f"cannot use {redact_url(url)}: {str(exc)[-300:]}"}
    try:
        results = _pg_rounds(made["url"], path, sizes)
    finally:
        run_peer(peer("evstore_peer", "pgdrop", "--url", url, "--schema", made["schema"]))
    results["server"] = made["server"]
    return results


def _pg_rounds(url: str, path: Path, sizes: Sizes) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for clients in (1, 8):
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "PYTHONPATH": str(REPO)}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    *peer(
                        "evstore_peer", "pgclient", "--workload", str(path), "--url", url, "--stream", str(i)
                    ),
                ],
                cwd=REPO,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for i in range(clients)
        ]
        for p in procs:
            assert p.stdout is not None
            p.stdout.readline()  # "ready"
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=3600) for p in procs]
        wall = time.perf_counter() - t0
        per = []
        for o, e in outs:
            lines = [x for x in o.splitlines() if x.startswith("{")]
            if not lines:
                raise RuntimeError(f"a PostgreSQL client failed: {e[-1500:]}")
            per.append(json.loads(lines[-1]))
        ops = sum(r["ops"] for r in per)
        results[f"{clients}_clients"] = {
            "ops": ops,
            "seconds": wall,
            "ops_per_s": ops / wall,
            "p50_ms": statistics.median(r["p50_ms"] for r in per),
            "p99_ms": max(r["p99_ms"] for r in per),
            "peak_rss_mb": max(r["peak_rss_mb"] for r in per),
            # the clients' own CPU per command (the server's, on the same cores, comes on top)
            "client_cpu_us_per_op": 1e6 * sum(r.get("cpu_s", 0.0) for r in per) / ops if ops else 0.0,
        }
        if clients == 1:
            # the 8-client run must not reuse the consumers of stream 0
            w2 = generate(
                n_providers=8 * 5,
                streams=8,
                commands_per_stream=sizes.pg_commands,
                target_live=50,
                disjoint=True,
                n_queries=0,
                stream_seed=99,
            )
            path.write_text(json.dumps(w2.to_json()))
    results["scaling"] = results["8_clients"]["ops_per_s"] / results["1_clients"]["ops_per_s"]
    return results


def vars_of(sizes: Sizes) -> dict[str, int]:
    return dict(sizes.__dict__)


def code_version() -> dict[str, Any]:
    """The commit measured, and whether the code differs from it (peers import the working tree)."""

    def git(*args: str) -> str:
        try:
            done = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return done.stdout.strip() if done.returncode == 0 else ""

    changes = git(
        "status", "--porcelain", "--", "evstore", "projections", "tests/benchmarks", "pyproject.toml"
    )
    return {"commit": git("rev-parse", "--short", "HEAD") or "unknown", "uncommitted": bool(changes)}


def machine() -> dict[str, Any]:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import sqlite3

    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.platform(),
    }


# --- the table --------------------------------------------------------------------------------

TARGETS = {
    ("sequential", "placement"): 50.0,
    ("sequential", "eventsourcing"): 1.2,
    ("sequential", "sqlite3"): 0.6,
    ("concurrent", "sqlite3"): 3.0,
    ("concurrent", "eventsourcing"): 5.0,
    ("log_reads", "rebuild"): 0.6,
    ("log_reads", "replay"): 0.6,
}


def speedup(base: dict[str, Any] | None, other: dict[str, Any]) -> float:
    """How many times evstore's rate the other system's is. Rounds ran back-to-back, so the ratio
    is taken within each round and the median kept: load from other processes shifts whole
    rounds, and per-round ratios cancel most of it."""
    if not base or not other["ops_per_s"]:
        return 0.0
    a, b = base.get("rounds_ops_per_s", []), other.get("rounds_ops_per_s", [])
    if len(a) == len(b) and len(a) > 1:
        return float(statistics.median(x / y for x, y in zip(a, b, strict=True)))
    if "round" in other and other["round"] < len(a):  # ran in one round only: pair with that round
        return float(a[other["round"]] / other["ops_per_s"])
    return float(base["ops_per_s"] / other["ops_per_s"])


#: the time travel and audit targets are set on a log this long: a shorter one cannot judge them
BIG_LOG = 1_000_000
#: upper bounds: (section, key) -> (bound, unit, what is compared)
LIMITS = {
    ("time_travel", "consumer_at"): (50.0, "ms", "median"),
    ("time_travel", "provider_at"): (50.0, "ms", "median"),
    ("time_travel", "state_at"): (1000.0, "ms", "median"),
    ("audit", "seconds"): (15.0, "s", "time"),
}
PG_SCALING = 3.0  # 8 clients on disjoint providers vs one
NAMES = {
    ("sequential", "placement"): "sequential commands: evstore vs Placement",
    ("sequential", "eventsourcing"): "sequential commands: evstore vs eventsourcing",
    ("sequential", "sqlite3"): "sequential commands: evstore vs raw sqlite3",
    ("concurrent", "sqlite3"): "64 concurrent tasks: evstore vs raw sqlite3",
    ("concurrent", "eventsourcing"): "64 concurrent tasks: evstore vs eventsourcing",
    ("log_reads", "rebuild"): "rebuild vs raw read+json.loads",
    ("log_reads", "replay"): "replay vs raw read+json.loads",
    ("time_travel", "consumer_at"): "time travel: one consumer at a position",
    ("time_travel", "provider_at"): "time travel: one provider at a position",
    ("time_travel", "state_at"): "time travel: whole store at a position",
    ("audit", "seconds"): "audit",
    ("postgres", "scaling"): "PostgreSQL: 8 clients vs 1",
}


def verdicts(out: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Every target of the issue, judged from this run's results: PASS, FAIL, "not measured" (with
    why: a peer not installed, no PostgreSQL) or "not judged" (a log shorter than the target's)."""

    def judged(key: tuple[str, str], value: float | None, goal: str, ok: bool, why: str) -> dict[str, Any]:
        if value is None:
            status = "not measured"
        elif why:
            status = "not judged"
        else:
            status = "PASS" if ok else "FAIL"
        return {"target": NAMES[key], "goal": goal, "value": value, "status": status, "why": why}

    skipped = out.get("skipped", {})
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for (section, system), target in TARGETS.items():
        value: float | None = None
        if section == "log_reads":
            reads = out.get("log_reads", {})
            raw, r = reads.get("sqlite3 read+json.loads"), reads.get(system)
            if r and raw and raw["events_per_s"]:
                value = r["events_per_s"] / raw["events_per_s"]
        else:
            results = out.get(section, {})
            if system in results and "evstore" in results:
                value = speedup(results["evstore"], results[system])
        why = "" if value is not None else skipped.get(system, "not run")
        goal = f">= {target:g}x"
        found[(section, system)] = judged(
            (section, system), value, goal, value is not None and value >= target, why
        )
    for (section, key), (bound, unit, what) in LIMITS.items():
        result = out.get(section) or {}
        events = result.get("head" if section == "time_travel" else "events", 0)
        value = None
        if section == "time_travel" and key in result:
            value = result[key]["median_ms"]
        elif section == "audit" and key in result:
            value = result[key]
        why = "" if value is not None else "not run"
        if value is not None and events < BIG_LOG:
            why = f"a {events:,}-event log; the target is for {BIG_LOG:,}"
        goal = f"{what} <= {bound:g} {unit} at 1M events"
        found[(section, key)] = judged((section, key), value, goal, value is not None and value <= bound, why)
    pg = out.get("postgres", {})
    value = pg.get("scaling")
    found[("postgres", "scaling")] = judged(
        ("postgres", "scaling"),
        value,
        f">= {PG_SCALING:g}x",
        value is not None and value >= PG_SCALING,
        "" if value is not None else str(pg.get("skipped", "not run")),
    )
    return found


def mark(verdict: dict[str, Any] | None) -> str:
    """The table's target column: the status and the goal."""
    if verdict is None:
        return ""
    return f"{verdict['status']} ({verdict['goal']})"


def table(out: dict[str, Any]) -> str:
    rows: list[tuple[str, ...]] = []
    head = ("phase", "system", "ops/s", "p50 ms", "p99 ms", "peak RSS MiB", "evstore is", "target")
    judge = verdicts(out)

    def add_rate_rows(section: str, label: str) -> None:
        results = out.get(section, {})
        base = results.get("evstore")
        for system, r in results.items():
            ratio = speedup(base, r)
            r["evstore_ratio"] = ratio
            rows.append(
                (
                    label,
                    system,
                    f"{r['ops_per_s']:,.0f}",
                    f"{r['p50_ms']:.2f}",
                    f"{r['p99_ms']:.2f}",
                    f"{r['peak_rss_mb']:.0f}",
                    "" if system == "evstore" else f"{ratio:,.2f}x",
                    mark(judge.get((section, system))),
                )
            )
        for (where, system), verdict in judge.items():
            if where == section and system not in results:  # a peer that did not run: say so
                rows.append((label, f"{system}: {verdict['why']}", "", "", "", "", "", mark(verdict)))

    add_rate_rows("sequential", "sequential commands")
    seq = out.get("sequential", {})
    for system, r in seq.items():
        q = r.get("queries")
        if q:
            rows.append(
                (
                    "queries",
                    system,
                    f"{q['ops_per_s']:,.0f}",
                    f"{q['p50_ms']:.3f}",
                    f"{q['p99_ms']:.3f}",
                    "",
                    "",
                    "",
                )
            )
    add_rate_rows("concurrent", "64 concurrent tasks")
    reads = out.get("log_reads", {})
    raw = reads.get("sqlite3 read+json.loads")
    for name, r in reads.items():
        ratio = r["events_per_s"] / raw["events_per_s"] if raw else 0.0
        label = f"{name} ({r['events']:,} events)"
        rows.append(
            (
                "rebuild / replay",
                label,
                f"{r['events_per_s']:,.0f} ev/s",
                f"{r['seconds']:.2f} s",
                "",
                f"{r['peak_rss_mb']:.0f}",
                "" if r is raw else f"{ratio:.2f}x of raw",
                mark(judge.get(("log_reads", name))),
            )
        )
    tt = out.get("time_travel")
    if tt:
        warm = "snapshots taken" if "snapshots" in tt else "no snapshots"
        for key, what in (
            ("consumer_at", "one consumer at a random position (its history)"),
            ("state_at_cold", "whole store, first question (no snapshot yet)"),
            ("provider_at", f"one provider at a random position ({warm})"),
            ("state_at", f"whole store at a random position ({warm})"),
        ):
            if key not in tt:
                continue
            rows.append(
                (
                    "time travel",
                    f"{what} ({tt['head']:,} events)",
                    "",
                    f"{tt[key]['median_ms']:.1f} median",
                    f"{tt[key]['max_ms']:.1f} max",
                    f"{tt['peak_rss_mb']:.0f}",
                    "",
                    mark(judge.get(("time_travel", key))),
                )
            )
    if tt and "take_snapshots_s" in tt:
        rows.append(
            (
                "time travel",
                f"store.take_snapshots() ({tt['snapshots']} snapshots)",
                "",
                f"{tt['take_snapshots_s']:.2f} s",
                "",
                "",
                "",
                "",
            )
        )
    au = out.get("audit")
    if au:
        rows.append(
            (
                "audit",
                f"store.audit() ({au['events']:,} events, clean={au['clean']})",
                f"{au['events_per_s']:,.0f} ev/s",
                f"{au['seconds']:.2f} s",
                "",
                f"{au['peak_rss_mb']:.0f}",
                "",
                mark(judge[("audit", "seconds")]),
            )
        )
    pg = out.get("postgres", {})
    if "skipped" in pg:
        verdict = judge[("postgres", "scaling")]
        rows.append(("postgresql", f"8 clients / 1: {verdict['why']}", "", "", "", "", "", mark(verdict)))
    else:
        for k in ("1_clients", "8_clients"):
            r = pg[k]
            rows.append(
                (
                    "postgresql",
                    "1 client" if k == "1_clients" else "8 clients",
                    f"{r['ops_per_s']:,.0f}",
                    f"{r['p50_ms']:.2f}",
                    f"{r['p99_ms']:.2f}",
                    f"{r['peak_rss_mb']:.0f}",
                    "",
                    "",
                )
            )
        verdict = judge[("postgres", "scaling")]
        rows.append(
            ("postgresql", "8 clients / 1 client", f"{pg['scaling']:.2f}x", "", "", "", "", mark(verdict))
        )

    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row) for row in rows]
    return "\n".join(lines)


def leak_count(result: dict[str, Any] | None) -> str:
    """Bug 1848343 as measured on evstore's sequential run ("not counted" if it did not say)."""
    if not result or "leaked_consumers" not in result:
        return "not counted"
    return f"{result['leaked_consumers']} of {result['deleted_consumers']}"


def notes(out: dict[str, Any]) -> str:
    m = out["machine"]
    lines = [
        f"machine: {m['nproc']} CPUs, {m['cpu']}, Python {m['python']}, SQLite {m['sqlite']}",
        f"mode: {out['mode']}, duration {out['duration_s']:.0f} s; "
        f"eventsourcing: {out.get('eventsourcing_env')}",
    ]
    code = out.get("code", {})
    if code:
        state = "with uncommitted changes" if code.get("uncommitted") else "clean"
        if code.get("changed_during_run"):
            state += "; THE CODE CHANGED DURING THE RUN (phases measured different code)"
        lines.append(f"code: commit {code.get('commit')} ({state})")
    seq = out.get("sequential", {})
    if "evstore" in seq and "evstore+info-logging" in seq:
        a, b = seq["evstore"], seq["evstore+info-logging"]
        cost = (b["seconds"] / b["ops"] - a["seconds"] / a["ops"]) * 1e6
        lc = out.get("log_cost", {})
        info, filtered = lc.get("info_default_config_us", 0.0), lc.get("filtered_warning_us", 0.0)
        lines.append(
            f"logging: one structlog call per command costs {info:.1f} us at info with structlog's default "
            f"config (to /dev/null), {filtered:.1f} us filtered at WARNING (as benchmarked); "
            f"end-to-end difference {cost:+.0f} us per command (within noise)"
        )
    if out.get("postgres_server"):
        srv = out["postgres_server"]
        line = (
            f"PostgreSQL {srv['server_version']}: fsync={srv['fsync']} "
            f"synchronous_commit={srv['synchronous_commit']}"
        )
        pg = out.get("postgres", {})
        cpu = [pg.get(k, {}).get("client_cpu_us_per_op") for k in ("1_clients", "8_clients")]
        if all(cpu):
            line += f"; the clients' own CPU per command: {cpu[0]:.0f} us (1 client), {cpu[1]:.0f} us (8)"
        lines.append(line)
    pl = seq.get("placement")
    if pl:
        lines.append(
            f"Placement: {pl['operations']} operations = {pl['ops']} commands = "
            f"{pl['http_requests']} HTTP requests; SQLite synchronous={pl['durability']['synchronous']} "
            f"journal={pl['durability']['journal_mode']}; "
            f"{pl['leaked_consumers']} of {pl.get('deleted_consumers', '?')} deleted instances left holding "
            f"allocations (bug 1848343); {leak_count(seq.get('evstore'))} for evstore (its whole stream)"
        )
    es = seq.get("eventsourcing")
    if es:
        lines.append(
            f"eventsourcing {es.get('version')}: SQLite synchronous={es.get('synchronous')} (2 = FULL), WAL"
        )
    for system, why in out.get("skipped", {}).items():
        lines.append(f"{system}: NOT RUN ({why}); its targets are not measured")
    return "\n".join(lines)


def check_json_path(path: str) -> str:
    """Why the results could not be written to ``path`` at the end of the run ("" if they can):
    asked before a run of up to 20 minutes, not after it."""
    target = Path(path)
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    if not existed:
        target.unlink(missing_ok=True)
    return ""


def check_postgres(url: str) -> str:
    """Why the PostgreSQL server at ``url`` cannot be used ("" if it can): one connection, before
    anything is measured."""
    try:
        result = run_peer(peer("evstore_peer", "pgcheck", "--url", url), timeout=120)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        return str(exc).strip().splitlines()[-1]
    return str(result.get("error", ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m tests.benchmarks.run",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes, one round (about 2 minutes)")
    p.add_argument("--json", metavar="PATH", help="write all results as JSON")
    p.add_argument(
        "--postgres",
        metavar="URL",
        help="a PostgreSQL server (a schema is made for each phase and dropped; default: "
        "EVSTORE_TEST_POSTGRES_URL, if set)",
    )
    p.add_argument("--skip-placement", action="store_true", help="do not install or run Placement")
    p.add_argument("--workdir", help="where the databases go (default: a temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the databases")
    args = p.parse_args(argv)
    if args.json and (problem := check_json_path(args.json)):
        p.error(f"--json {args.json}: cannot write there: {problem}")
    source = "--postgres" if args.postgres else "EVSTORE_TEST_POSTGRES_URL"
    args.postgres = args.postgres or os.environ.get("EVSTORE_TEST_POSTGRES_URL") or None
    if args.postgres and postgres_backend_present() and (problem := check_postgres(args.postgres)):
        p.error(f"{source}: cannot use the PostgreSQL server at {redact_url(args.postgres)}: {problem}")
    out = suite(args)
    rendered = table(out)  # also stores each row's ratio into out
    out["targets"] = list(verdicts(out).values())
    print(rendered)
    print()
    print(notes(out))
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(out, indent=2))
        except OSError as exc:
            log(f"could not write the results to {args.json}: {exc.strerror or exc}")
            sys.exit(1)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
