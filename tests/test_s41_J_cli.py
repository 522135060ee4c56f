"""Stop 41, helper J: small command-line items - a uuid argument pasted with spaces around it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from evstore import open_store
from tests.conftest import allocate, make_provider, new_uuid
from tests.test_cli_support import evstore


def _small_store(path: Path) -> tuple[str, str]:
    """A SQLite store holding one provider and one consumer's allocation on it: (provider, consumer)."""

    async def build() -> tuple[str, str]:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            consumer = new_uuid()
            await allocate(store, consumer, {provider: {"VCPU": 2}})
            return provider, consumer

    return asyncio.run(build())


def test_a_uuid_argument_pasted_with_spaces_around_it_is_taken_as_the_uuid(tmp_path: Path) -> None:
    """``--at " 5"`` was trimmed, a uuid argument was not: ``history " <uuid> "`` (pasted from a
    table, a log line) was refused as malformed (exit 1). Every uuid argument now trims the
    whitespace around it, as --at does; what is inside is checked as before."""
    db = tmp_path / "s.db"
    provider, consumer = _small_store(db)
    where = ("--db", str(db), "--json")
    spaced_consumer, spaced_provider = f" {consumer.upper()}\t", f"\u00a0{provider} \n"

    done = evstore("history", spaced_consumer, *where)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["uuid"] == consumer
    done = evstore("history", spaced_provider, *where)
    assert done.returncode == 0, done.stderr
    for option, given, at in (
        ("--consumer", spaced_consumer, ()),
        ("--consumer", spaced_consumer, ("--at", " 3 ")),
        ("--provider", spaced_provider, ()),
        ("--provider", spaced_provider, ("--at", "3")),
    ):
        done = evstore("state", option, given, *at, *where)
        assert done.returncode == 0, (option, at, done.stderr)
        assert consumer in done.stdout and provider in done.stdout, (option, at, done.stdout)
    # (a uuid the log names and that is no migration: the command's own refusal, past the parse)
    done = evstore("confirm-migration", spaced_consumer, *where)
    assert done.returncode == 1 and done.stderr.startswith("error: evstore.not_found: "), done.stderr
    done = evstore("release", spaced_consumer, *where)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["consumer"] == consumer
    # what is inside the spaces is checked as before; only spaces remain a usage error
    for bad in (f" {consumer[:-1]} ", f"{consumer[:8]} {consumer[9:]}"):
        done = evstore("history", bad, *where)
        assert done.returncode == 1 and done.stderr.startswith(
            "error: evstore.invalid_input: Malformed uuid"
        ), done.stderr
    done = evstore("history", "  ", *where)
    assert done.returncode == 2 and done.stderr.startswith("error: evstore.usage: "), done.stderr
