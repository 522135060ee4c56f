"""The benchmark runner's own logic (tests/benchmarks/run.py, tests/peers/venv.py), without running a
benchmark: what it tells a user when something it needs is missing, and how it judges the targets.
No timing is asserted anywhere here."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import run
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


def _rate(ops_per_s: float) -> dict[str, Any]:
    return {
        "ops_per_s": ops_per_s,
        "p50_ms": 1.0,
        "p99_ms": 2.0,
        "peak_rss_mb": 50.0,
        "ops": 100,
        "seconds": 1.0,
    }


def _results(events: int, *, placement: bool = True) -> dict[str, Any]:
    """A run's results as the phases report them (made-up numbers, nothing measured)."""
    seq = {"evstore": _rate(1000), "sqlite3": _rate(4000), "eventsourcing": _rate(500)}
    if placement:
        seq["placement"] = _rate(10)
    timing = {"n": 3, "mean_ms": 40.0, "median_ms": 20.0, "max_ms": 70.0}
    return {
        "sequential": seq,
        "concurrent": {"evstore": _rate(3000), "sqlite3": _rate(2000), "eventsourcing": _rate(300)},
        "log_reads": {
            "sqlite3 read+json.loads": {
                "events": events,
                "events_per_s": 100.0,
                "seconds": 1.0,
                "peak_rss_mb": 30,
            },
            "replay": {"events": events, "events_per_s": 90.0, "seconds": 1.1, "peak_rss_mb": 60},
            "rebuild": {"events": events, "events_per_s": 50.0, "seconds": 2.0, "peak_rss_mb": 60},
        },
        "time_travel": {
            "head": events,
            "peak_rss_mb": 70,
            "consumer_at": timing,
            "provider_at": {**timing, "median_ms": 60.0},
            "state_at": {**timing, "median_ms": 900.0, "max_ms": 1500.0},
        },
        "audit": {"events": events, "seconds": 14.0, "events_per_s": 1.0, "clean": True, "peak_rss_mb": 300},
        "postgres": {"skipped": "no server given (--postgres URL or EVSTORE_TEST_POSTGRES_URL)"},
        "skipped": {} if placement else {"placement": "not installable: pip install failed"},
    }


def test_every_target_of_the_issue_is_judged() -> None:
    found = run.verdicts(_results(1_003_059))
    status = {v["target"]: v["status"] for v in found.values()}
    assert status == {
        "sequential commands: evstore vs Placement": "PASS",  # 100x >= 50x
        "sequential commands: evstore vs eventsourcing": "PASS",  # 2x >= 1.2x
        "sequential commands: evstore vs raw sqlite3": "FAIL",  # 0.25x < 0.6x
        "64 concurrent tasks: evstore vs raw sqlite3": "FAIL",  # 1.5x < 3x
        "64 concurrent tasks: evstore vs eventsourcing": "PASS",  # 10x >= 5x
        "rebuild vs raw read+json.loads": "FAIL",  # 0.5x < 0.6x
        "replay vs raw read+json.loads": "PASS",  # 0.9x
        # the issue's time travel targets are medians (the mean, 40 ms, is not what is judged)
        "time travel: one consumer at a position": "PASS",  # 20 ms
        "time travel: one provider at a position": "FAIL",  # 60 ms > 50 ms
        "time travel: whole store at a position": "PASS",  # 900 ms
        "audit": "PASS",  # 14 s
        "PostgreSQL: 8 clients vs 1": "not measured",
    }
    assert found[("postgres", "scaling")]["why"].startswith("no server given")


def test_a_short_log_does_not_judge_the_1m_event_targets() -> None:
    # a quick run's 37k-event log says nothing about the audit of a 1M-event log being <= 15 s
    found = run.verdicts(_results(37_221))
    for key in (("time_travel", "consumer_at"), ("time_travel", "provider_at"), ("audit", "seconds")):
        assert found[key]["status"] == "not judged"
        assert "37,221-event log" in found[key]["why"]
    assert found[("log_reads", "replay")]["status"] == "PASS"  # a ratio: judged on any log


def test_the_table_marks_each_target_and_names_a_peer_that_did_not_run() -> None:
    out = _results(1_003_059, placement=False)
    lines = run.table(out).splitlines()

    def row(*words: str) -> str:
        (found,) = [line for line in lines if all(w in line for w in words)]
        return found

    assert "60.0 median" in row("one provider", "FAIL (median <= 50 ms at 1M events)")
    assert "PASS (time <= 15 s at 1M events)" in row("store.audit()")
    # Placement could not be installed: its row and target are still there, saying why
    assert "not measured (>= 50x)" in row("sequential commands", "placement: not installable")
    assert "not measured (>= 3x)" in row("postgresql", "8 clients / 1: no server given")


def test_an_unwritable_json_path_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to fail with a traceback after the whole run (13-20 minutes), losing the results
    monkeypatch.setattr(run, "suite", _must_not_run)
    monkeypatch.delenv("EVSTORE_TEST_POSTGRES_URL", raising=False)
    with pytest.raises(SystemExit) as exited:
        _main(monkeypatch, "--quick", "--json", str(tmp_path / "missing-dir" / "results.json"))
    assert exited.value.code == 2
    assert "--json" in capsys.readouterr().err
    # a writable path is left as it was found (no empty file behind)
    assert run.check_json_path(str(tmp_path / "results.json")) == ""
    assert not (tmp_path / "results.json").exists()


def test_an_unusable_postgres_url_is_refused_before_the_run_without_its_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # it used to die with a traceback in the middle of the first round
    if not run.postgres_backend_present():
        pytest.skip("asyncpg is not installed")
    monkeypatch.setattr(run, "suite", _must_not_run)
    with pytest.raises(SystemExit) as exited:
        _main(
            monkeypatch,
            "--quick",
            "--skip-placement",
            "--postgres",
            "postgresql://bench:s3cret@127.0.0.1:1/nothing",
        )
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "cannot use the PostgreSQL server at postgresql://bench:***@127.0.0.1:1/nothing" in err
    assert "s3cret" not in err and "Traceback" not in err


def test_the_working_directory_is_removed_when_a_phase_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    workdir = tmp_path / "bench"

    def failing(argv: list[str], *rest: Any, **kw: Any) -> dict[str, Any]:
        (workdir / "ev.db").write_text("half a run")
        raise RuntimeError(f"{' '.join(argv[:3])} failed (1): ...")

    monkeypatch.setattr(run, "run_peer", failing)
    monkeypatch.setattr(run, "eventsourcing_python", lambda: ("", "not installable: (test)"))
    args = argparse.Namespace(
        quick=True, workdir=str(workdir), keep=False, postgres=None, skip_placement=True
    )
    with pytest.raises(RuntimeError, match="evstore_peer seq failed"):
        run.suite(args)
    assert not workdir.exists()


def _main(monkeypatch: pytest.MonkeyPatch, *argv: str) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m tests.benchmarks.run", *argv])
    run.main()


def _must_not_run(args: Any) -> dict[str, Any]:
    raise AssertionError("the benchmark ran")


def test_the_leak_count_of_evstore_is_measured_not_printed_as_zero() -> None:
    # the footer used to say "(bug 1848343; evstore: 0)" whatever evstore's run left behind
    out = _results(37_221)
    out.update(mode="quick", duration_s=1.0, machine={"nproc": 2, "cpu": "x", "python": "3", "sqlite": "3"})
    out["sequential"]["evstore"].update(leaked_consumers=3, deleted_consumers=40)
    out["sequential"]["placement"].update(
        operations=300,
        http_requests=600,
        leaked_consumers=11,
        deleted_consumers=12,
        durability={"synchronous": 2, "journal_mode": "wal"},
    )
    (line,) = [x for x in run.notes(out).splitlines() if x.startswith("Placement:")]
    assert "11 of 12 deleted instances left holding allocations" in line
    assert "3 of 40 for evstore" in line


def test_the_postgresql_footer_gives_the_clients_own_cpu_per_command() -> None:
    # 8 clients vs 1 is bounded by the two cores the clients share with the server: the footer
    # says what each command cost the clients (from each client's process_time)
    out = _results(37_221)
    out.update(mode="quick", duration_s=1.0, machine={"nproc": 2, "cpu": "x", "python": "3", "sqlite": "3"})
    out["sequential"].pop("placement")
    out["postgres_server"] = {"server_version": "15.18", "fsync": "on", "synchronous_commit": "on"}
    out["postgres"] = {
        "1_clients": {"client_cpu_us_per_op": 880.4},
        "8_clients": {"client_cpu_us_per_op": 1320.6},
    }
    (line,) = [x for x in run.notes(out).splitlines() if x.startswith("PostgreSQL")]
    assert line.endswith("the clients' own CPU per command: 880 us (1 client), 1321 us (8)")
