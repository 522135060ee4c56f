"""The ``evstore`` command line: run the demo cloud, audit a store, and debug it from its log.

Every command names its store with ``--db PATH`` (SQLite file), ``--url URL`` (``sqlite:///...``
or ``postgresql://...``) or the ``EVSTORE_URL`` environment variable. Output is a readable table by
default and JSON with ``--json``. Exit status: 0 success (a clean audit), 1 error, 2 usage error,
3 audit findings. An error is one line on stderr, ``error: <code>: <message>``, never a traceback.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Annotated, Any, NoReturn

import structlog
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer._click.exceptions import ClickException

from evstore import errors as err
from projections.audit import AuditReport
from projections.state import State

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_FINDINGS = 3

DEFAULT_DEMO_DB = Path("evstore-demo.db")

app = typer.Typer(
    name="evstore",
    help="Event-sourced allocation store: demo, audit and replay debugging.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

DbOption = Annotated[
    Path | None, typer.Option("--db", help="SQLite database file.", dir_okay=False, show_default=False)
]
UrlOption = Annotated[
    str | None,
    typer.Option("--url", help="Store URL (sqlite:///path.db, postgresql://...); default $EVSTORE_URL."),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


# --- plumbing -----------------------------------------------------------------------------------


def configure_logging(verbosity: int) -> None:
    """structlog to stderr: WARNING by default, INFO with -v, DEBUG with -vv."""
    level = logging.WARNING if verbosity <= 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def console() -> Console:
    # Piped output (scripts, tests) must not be folded at 80 columns: uuids are 36 characters.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 200
    return Console(highlight=False, soft_wrap=False, width=width)


def note(message: str) -> None:
    """A human remark on stderr (keeps stdout clean for --json)."""
    print(message, file=sys.stderr, flush=True)


def fail(code: str, message: str, exit_code: int = EXIT_ERROR) -> NoReturn:
    first_line = message.strip().splitlines()[0] if message.strip() else "(no message)"
    print(f"error: {code}: {first_line}", file=sys.stderr, flush=True)
    raise typer.Exit(exit_code)


def sqlite_url(path: Path) -> str:
    return "sqlite:///" + str(path.expanduser().absolute())


def resolve_url(db: Path | None, url: str | None, *, must_exist: bool = True) -> str:
    """The store URL from --db, --url or $EVSTORE_URL (in that order); one of them is required."""
    if db is not None and url is not None:
        raise err.InvalidInput("give either --db or --url, not both")
    if db is not None:
        if must_exist and not db.exists():
            raise err.NotFound(f"no database at {db} (check the path, or create one with `evstore demo`)")
        return sqlite_url(db)
    chosen = url or os.environ.get("EVSTORE_URL")
    if not chosen:
        raise err.InvalidInput("no store given: use --db PATH, --url URL or set EVSTORE_URL")
    if must_exist and chosen.startswith("sqlite:"):
        from evstore.log.sqlite import parse_sqlite_url

        path, _ = parse_sqlite_url(chosen)
        if path != ":memory:" and not Path(path).exists():
            raise err.NotFound(f"no database at {path}")
    return chosen


def run(work: Callable[[], Coroutine[Any, Any, int]]) -> NoReturn:
    """Run one command's coroutine; turn every failure into one line on stderr and an exit code."""
    try:
        code = asyncio.run(work())
    except typer.Exit:
        raise
    except err.EvstoreError as exc:
        fail(exc.code, exc.message)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except OSError as exc:
        fail("evstore.io", str(exc))
    except Exception as exc:  # a bug: still one line, the traceback only at -vv
        structlog.get_logger("evstore").debug("cli.crash", exc_info=True)
        fail("evstore.internal", f"{type(exc).__name__}: {exc}")
    raise typer.Exit(code)


def emit_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=False, default=str), flush=True)


@app.callback()
def _root(
    verbose: Annotated[
        int, typer.Option("--verbose", "-v", count=True, help="Log to stderr: -v info, -vv debug.")
    ] = 0,
) -> None:
    configure_logging(verbose)


# --- rendering ----------------------------------------------------------------------------------


def usage_table(state: State, title: str) -> Table:
    """Per provider: each class as used/capacity (red when over capacity)."""
    classes = sorted({rc for p in state.providers.values() for rc in p.inventories})
    table = Table(title=title)
    table.add_column("provider")
    table.add_column("uuid", no_wrap=True)
    table.add_column("gen", justify="right")
    for rc in classes:
        table.add_column(rc, justify="right")
    for prov in sorted(state.providers.values(), key=lambda p: p.name):
        cells = []
        for rc in classes:
            inv = prov.inventories.get(rc)
            used = prov.usages.get(rc, 0)
            if inv is None:
                cells.append(f"{used}/-" if used else "-")
                continue
            text = f"{used}/{inv.capacity:g}"
            cells.append(f"[red]{text}[/red]" if used > inv.capacity else text)
        table.add_row(escape(prov.name), prov.uuid, str(prov.generation), *cells)
    return table


def usage_json(state: State) -> list[dict[str, Any]]:
    return [
        {
            "provider": p.uuid,
            "name": p.name,
            "generation": p.generation,
            "usages": {
                rc: {"used": p.usages.get(rc, 0), "capacity": inv.capacity}
                for rc, inv in p.inventories.items()
            },
        }
        for p in sorted(state.providers.values(), key=lambda p: p.name)
    ]


def print_audit(out: Console, report: AuditReport, url: str) -> None:
    verdict = "[green]clean[/green]" if report.clean else f"[red]{len(report.findings)} finding(s)[/red]"
    out.print(
        f"Audit of {escape(url)}: head {report.head}, {report.events_checked} events checked: {verdict}"
    )
    if report.clean:
        return
    table = Table()
    table.add_column("kind")
    table.add_column("positions", no_wrap=True)
    table.add_column("finding")
    for f in report.findings:
        table.add_row(f.kind, ", ".join(map(str, f.positions)) or "-", escape(f.message))
    out.print(table)


# --- commands -----------------------------------------------------------------------------------


@app.command()
def demo(
    db: DbOption = None,
    url: UrlOption = None,
    seed: Annotated[int, typer.Option(help="Seed of the simulated cloud (same seed, same plan).")] = 1848343,
    nodes: Annotated[int, typer.Option(help="Compute nodes.", min=2, max=100)] = 6,
    instances: Annotated[int, typer.Option(help="Instances to build.", min=1, max=100_000)] = 200,
    json_out: JsonOption = False,
) -> None:
    """Simulate a small cloud (builds, resizes, migrations, deletes racing reverts), then audit it.

    Uses ./evstore-demo.db unless told otherwise; an existing demo file is replaced. Exit 0 only
    when the final audit is clean.
    """

    async def work() -> int:
        from evstore.demo import run_demo
        from evstore.store import open_store

        if db is None and url is None and not os.environ.get("EVSTORE_URL"):
            target = sqlite_url(_fresh_file(DEFAULT_DEMO_DB))
        elif db is not None and url is None:
            target = sqlite_url(_fresh_file(db))
        else:
            target = resolve_url(db, url, must_exist=False)
        async with open_store(target) as store:
            if await store.head() != 0:
                raise err.InvalidInput(f"the demo needs an empty store and {target} already has events")
            report = await run_demo(store, seed=seed, nodes=nodes, instances=instances)
            state = await store.backend.load_state()
            audit = await store.audit()
        if json_out:
            emit_json(
                {
                    "url": target,
                    "seed": seed,
                    "head": report.head,
                    "counts": dict(sorted(report.counts.items())),
                    "rejected": dict(sorted(report.rejected.items())),
                    "deleted_mid_migration": [list(p) for p in report.deleted_mid_migration],
                    "rejected_reverts": [list(p) for p in report.rejected_reverts],
                    "usage": usage_json(state),
                    "audit": audit.to_dict(),
                }
            )
        else:
            out = console()
            out.print(usage_table(state, f"Usage after the demo (seed {seed}, {report.head} events)"))
            summary = Table(title="What happened")
            summary.add_column("what")
            summary.add_column("count", justify="right")
            c = report.counts
            for label, value in (
                ("instances built", c["builds"]),
                ("builds with no valid host", c["builds_failed"]),
                ("migrations started", c["migrations_started"]),
                ("resizes started", c["resizes_started"]),
                ("migrations/resizes confirmed", c["confirmed"]),
                ("migrations/resizes reverted", c["reverted"]),
                ("rolled back (no valid host)", c["migrations_no_valid_host"]),
                ("instances deleted", c["deletes"]),
                ("  deleted mid-migration, racing a revert", len(report.deleted_mid_migration)),
                ("  race won by the delete (revert rejected)", c["races_delete_won"]),
                ("  race won by the revert (then deleted)", c["races_revert_won"]),
            ):
                summary.add_row(label, str(value))
            for code, n in sorted(report.rejected.items()):
                summary.add_row(f"rejected: {code}", str(n))
            out.print(summary)
            print_audit(out, audit, target)
            if report.rejected_reverts:
                inst, _ = report.rejected_reverts[0]
                out.print(f"Try: evstore history {inst} --url {target}")
        return EXIT_OK if audit.clean else EXIT_FINDINGS

    run(work)


def _fresh_file(path: Path) -> Path:
    """Remove a previous demo database (and its WAL files) so the demo starts empty."""
    removed = []
    for suffix in ("", "-wal", "-shm"):
        candidate = Path(str(path) + suffix)
        if candidate.exists():
            candidate.unlink()
            removed.append(candidate.name)
    if removed:
        note(f"removed existing {', '.join(removed)}")
    return path


@app.command()
def audit(db: DbOption = None, url: UrlOption = None, json_out: JsonOption = False) -> None:
    """Replay the log and check it: drift, leaks, over-capacity, integrity. Exit 3 on findings."""

    async def work() -> int:
        from evstore.store import open_store

        target = resolve_url(db, url)
        async with open_store(target) as store:
            report = await store.audit()
        if json_out:
            emit_json(report.to_dict())
        else:
            print_audit(console(), report, target)
        return EXIT_OK if report.clean else EXIT_FINDINGS

    run(work)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``evstore`` script."""
    try:
        code = app(args=list(argv) if argv is not None else None, standalone_mode=False, prog_name="evstore")
    except ClickException as exc:
        message = exc.format_message()
        if message:
            print(f"error: evstore.usage: {message}", file=sys.stderr)
        _exit(exc.exit_code)
    except typer.Exit as exc:
        _exit(exc.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        sys.exit(130)
    _exit(code if isinstance(code, int) else EXIT_OK)


def _exit(code: int) -> NoReturn:
    # A storage failure while opening can leave a database worker thread behind (non-daemon);
    # a command line must still end with its exit status rather than hang.
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    main()
