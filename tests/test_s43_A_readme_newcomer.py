"""The README read top to bottom by a newcomer who believes every word (stop 43, helper A): the
claims the earlier README tests (``test_readme_contract.py``, ``test_readme_example.py``,
``test_cli_demo_audit.py``) leave out."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer.main

from evstore import InvalidInput, Metadata, open_store
from evstore.cli import app
from tests.conftest import make_provider, new_uuid

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()

#: options the README gives a command in its prose, away from the command's name ("`--json`:
#: `upgraded_from`, ..." in the sentence on `evstore upgrade`; "`-vv` shows" the traceback)
_NAMED_IN_PROSE = {
    "upgrade": {"--json"},
    "stats": {"--json"},
    "release": {"--json"},
    "confirm-migration": {"--json"},
    "": {"-v"},
}


def _readme_cli_options(commands: set[str]) -> dict[str, set[str]]:
    """Each command the README shows (in inline code and in its shell blocks) with the options it
    gives it there; "" for ``evstore``'s own options."""
    spans = re.findall(r"`([^`\n]+)`", README)
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        spans += block.splitlines()
    found: dict[str, set[str]] = {}
    for span in spans:
        for part in re.split(r"\||;|&&| #", span):
            shown = re.match(r"\s*(?:evstore\s+)?([a-z][a-z-]*)\b(.*)", part)
            if shown and shown.group(1) in commands:
                options = re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-[a-z]+)\b", shown.group(2))
                found.setdefault(shown.group(1), set()).update(options)
            root = re.match(r"\s*evstore\s+((?:-[-a-z]+\s*)+)", part)
            if root:
                found.setdefault("", set()).update(root.group(1).split())
    return found


def test_every_command_and_option_the_readme_shows_is_one_the_cli_has() -> None:
    """README, "Debugging a leak" and around it: `rebuild --full`, `export -o FILE`, `tail
    [--after N]`, `snapshot [--every N]`, `state --at N --consumer C`, ... A newcomer types what the
    README shows; each of those commands exists and takes each of those options (read from the
    command line's own definition, not from its help text)."""
    group = typer.main.get_command(app)
    commands = set(group.commands)  # type: ignore[attr-defined]
    shown = _readme_cli_options(commands)
    for command, options in _NAMED_IN_PROSE.items():
        shown.setdefault(command, set()).update(options)
    # the README shows most of them: a parser that found nothing would pass vacuously
    assert {"audit", "history", "state", "diff", "rebuild", "export", "tail", "snapshot"} <= set(shown)
    everywhere = set().union(*shown.values())
    assert {"--full", "--force", "-o", "--every", "--after", "--follow", "--history"} <= everywhere
    missing = []
    for command, options in sorted(shown.items()):
        cli = group if command == "" else group.commands[command]  # type: ignore[attr-defined]
        has = {"--help", "-h"} | {opt for param in cli.params for opt in (*param.opts, *param.secondary_opts)}
        missing += [f"evstore {command} {option}".replace("  ", " ") for option in options - has]
    assert not missing, missing


def test_the_readmes_embedded_api_example_runs_the_same_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """README, "SQLite or PostgreSQL?": "The behaviour is the same". The embedded-API example, given
    a PostgreSQL URL in place of its SQLite file, prints what its comments say, as on SQLite
    (``test_readme_example.py``): the revert after the delete refused, nothing leaked, the
    instance's history, a clean audit."""
    snippet = README.split("```python\n")[1].split("```")[0]
    assert snippet.count('"sqlite:///cloud.db"') == 1
    done = subprocess.run(
        [sys.executable, "-c", snippet.replace('"sqlite:///cloud.db"', repr(pg_url))],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    printed = [line for line in done.stdout.splitlines() if "[info" not in line and "[warning" not in line]
    assert printed[0].startswith("evstore.consumer.deleted Instance "), printed
    assert "was deleted at position 5" in printed[0]
    assert printed[1:] == [
        "{'MEMORY_MB': 0, 'VCPU': 0}",
        "3 AllocationsReplaced req-1",
        "4 MigrationStarted None",
        "5 ConsumerDeleted None",
    ]
    assert not (tmp_path / "cloud.db").exists()


async def test_diff_lists_the_providers_created_and_deleted_by_uuid_and_names_them(tmp_path: Path) -> None:
    """README, `diff(a, b)`: "the providers created and deleted in between (their uuids;
    `provider_names` names them...)" - a reader of the former wording ("by name") looked for names
    in ``providers_created`` and found uuids."""
    assert "the providers created and deleted in between (their uuids; `provider_names` names them" in README
    async with open_store(f"sqlite:///{tmp_path / 'd.db'}") as store:
        await make_provider(store, VCPU=4)
        start = await store.head()
        gone = new_uuid()
        await store.create_provider(gone, "short-lived")
        await store.delete_provider(gone)
        diff = await store.diff(start, await store.head())
    assert (diff.providers_created, diff.providers_deleted) == ([gone], [gone])
    assert diff.provider_names[gone] == "short-lived"


async def test_an_unknown_open_store_option_is_named_in_details_field(tmp_path: Path) -> None:
    """README, "The embedded API": "an `InvalidInput`'s `details["field"]` names the argument
    refused as the caller wrote it". A misspelt ``open_store`` keyword - what ``StoreOptions``
    exists to catch - is refused with its name only in the message."""
    url = f"sqlite:///{tmp_path / 'o.db'}"
    with pytest.raises(InvalidInput) as refused:
        await open_store(url, snapshot_evry=5)  # type: ignore[call-arg]
    assert refused.value.details.get("field") == "snapshot_evry", refused.value.details
    with pytest.raises(InvalidInput) as twice:
        await open_store(f"{url}?busy_timeout=1&busy_timeout=2")
    assert twice.value.details.get("field") == "busy_timeout", twice.value.details


async def test_an_unknown_open_store_option_on_postgresql_is_named_in_details_field(pg_url: str) -> None:
    """The same on PostgreSQL: a misspelt keyword, a URL key given twice, one of evstore's keywords
    written into the URL where only the backend's options go (the lead, with helper A's test)."""
    with pytest.raises(InvalidInput) as refused:
        await open_store(pg_url, pool_sise=5)  # type: ignore[call-arg]
    assert refused.value.details.get("field") == "pool_sise", refused.value.details
    with pytest.raises(InvalidInput) as twice:
        await open_store(f"{pg_url}&connect_timeout=1&connect_timeout=2")
    assert twice.value.details.get("field") == "connect_timeout", twice.value.details
    with pytest.raises(InvalidInput) as keyword:
        await open_store(f"{pg_url}&snapshot_every=5")
    assert keyword.value.details.get("field") == "snapshot_every", keyword.value.details


async def test_an_open_lines_that_gives_nothing_the_second_time_is_named_in_details_field(
    tmp_path: Path,
) -> None:
    """README, `import_events(lambda: lines)`: "a callable answering the lines, a file or a list: it
    is read twice". A newcomer's ``lambda: f`` over one open file answers nothing the second time:
    refused, nothing written, with the argument named in ``details["field"]`` as its other refusals
    have it (it was in the message only); an empty export likewise."""
    async with open_store(f"sqlite:///{tmp_path / 'a.db'}") as source:
        await make_provider(source, VCPU=4)
        (tmp_path / "a.jsonl").write_text("".join([f"{line}\n" async for line in source.export()]))
    async with open_store(f"sqlite:///{tmp_path / 'b.db'}") as target:
        with (tmp_path / "a.jsonl").open() as once:
            with pytest.raises(InvalidInput) as refused:
                await target.import_events(lambda: once)
        assert await target.head() == 0
    assert "second time" in str(refused.value)
    assert refused.value.details.get("field") == "open_lines", refused.value.details
    async with open_store(f"sqlite:///{tmp_path / 'c.db'}") as target:
        with pytest.raises(InvalidInput, match="the export file is empty") as empty:
            await target.import_events(lambda: [])
    assert empty.value.details.get("field") == "open_lines", empty.value.details


async def test_metadatas_64_kib_are_counted_as_the_log_stores_it_ascii_escaped(tmp_path: Path) -> None:
    """README: "at most 64 KiB of your JSON per command - evstore's own keys not counted; as stored,
    ASCII, a non-ASCII character taking its `\\uXXXX` escape". 11,000 ``é`` are 22 KB of UTF-8 but
    66 KB as the log stores them (``\\u00e9``, 6 bytes each): refused, where 11,000 ``e`` pass;
    ``Metadata`` refuses what a command does, and a refused command writes nothing."""
    assert "as stored, ASCII, a non-ASCII character taking its `\\uXXXX` escape" in README
    wide, narrow = {"note": "\u00e9" * 11_000}, {"note": "e" * 11_000}
    with pytest.raises(InvalidInput) as built:
        Metadata(**wide)
    assert built.value.details["field"] == "metadata" and "66,011 bytes of JSON" in str(built.value)
    Metadata(**narrow)
    async with open_store(f"sqlite:///{tmp_path / 'm.db'}") as store:
        with pytest.raises(InvalidInput) as refused:
            await store.create_provider(new_uuid(), "wide", metadata=wide)
        assert refused.value.details["field"] == "metadata"
        assert await store.head() == 0
        receipt = await store.create_provider(new_uuid(), "narrow", metadata=narrow)
        [event] = await store.read()
    assert receipt.positions == (1,) and event.to_dict()["metadata"]["note"] == narrow["note"]


async def test_the_read_only_mappings_nested_dicts_are_the_callers_copies(tmp_path: Path) -> None:
    """README: `usage`, `inventories`, `allocations` and `usages` "answer read-only mappings, whose
    nested dicts are the caller's copies": the mapping refuses an assignment; a nested dict - a
    consumer's ``{class: amount}`` on a provider - takes one, and the store is none the wiser
    (``test_results_are_copies.py`` scrambles every result; this is the README's sentence)."""
    assert "answer read-only mappings, whose nested dicts are the caller's copies" in README
    async with open_store(f"sqlite:///{tmp_path / 'r.db'}") as store:
        rp = await make_provider(store, VCPU=8)
        consumer = new_uuid()
        await store.set_allocations(
            consumer,
            {rp: {"VCPU": 2}},
            project_id="p",
            user_id="u",
            consumer_type="INSTANCE",
            generation=None,
        )
        for view in (await store.usage(rp), await store.allocations(consumer), await store.usages("p")):
            with pytest.raises(TypeError):
                view[next(iter(view))] = 0  # type: ignore[index]
        held = await store.allocations(consumer)
        held[rp]["VCPU"] = 7  # the caller's copy
        assert held == {rp: {"VCPU": 7}}
        assert await store.allocations(consumer) == {rp: {"VCPU": 2}}
        assert await store.usage(rp) == {"VCPU": 2}


def test_every_file_and_test_the_readme_cites_exists() -> None:
    """README, "Guarantees": each guarantee is "proved by" the tests it names (a file, or a file's
    test), and the README points at `.ci/postgres`, `tests/benchmarks/README.md`,
    `evstore/log/postgres.py`: a reader who follows one finds it (a renamed test would leave the
    table citing nothing)."""
    cited = set(re.findall(r"`((?:tests|evstore|projections|\.ci)/[\w./-]+)(?:::(\w+))?`", README))
    cited |= {(path, "") for path in re.findall(r"`\. (\.ci/\w+)`", README)}
    assert (".ci/postgres", "") in cited and len({name for _, name in cited if name}) >= 6, cited
    missing = []
    for path, name in sorted(cited):
        source = ROOT / path
        if not source.is_file():
            missing.append(path)
        elif name and not re.search(rf"^(async )?def {name}\(", source.read_text(), re.M):
            missing.append(f"{path}::{name}")
    assert not missing, missing
