"""Stop 43, helper I: how the command line names the store it was given - a store URL from
EVSTORE_URL, a blank EVSTORE_URL, a path given as --url (see each test)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from evstore import cli, open_store
from tests.conftest import allocate, make_provider, new_uuid


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``evstore ARGS`` run by ``cli.main`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


_HINT = " (check the path, or create one with `evstore demo`)"


def _small_store(path: Path) -> None:
    async def build() -> None:
        async with open_store(f"sqlite:///{path}") as store:
            provider = await make_provider(store, "node-1", VCPU=8)
            await allocate(store, new_uuid(), {provider: {"VCPU": 2}})

    asyncio.run(build())


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("sqlite:///{tmp}/gone.db",
         "evstore.not_found: no database file at {tmp}/gone.db (check the path, or create one "
         "with `evstore demo`) (from EVSTORE_URL)"),
        ("sqlite:///{tmp}",
         "evstore.invalid_input: {tmp} is a directory, not a database file (from EVSTORE_URL)"),
        ("mysql://db/x",
         "evstore.invalid_input: Unsupported store URL 'mysql://db/x': use sqlite:///path.db or "
         "postgresql://... (from EVSTORE_URL)"),
    ],
    ids=["missing", "directory", "scheme"],
)  # fmt: skip
def test_an_error_naming_a_store_from_evstore_url_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, url: str, said: str
) -> None:
    """An error about a store whose URL came from EVSTORE_URL never said it came from there: with a
    stale export, "no database at /old/path.db" left its reader looking for where that path came
    from."""
    monkeypatch.setenv("EVSTORE_URL", url.format(tmp=tmp_path))
    code, out, err = _in_process(capsys, "audit")
    assert (code, out) == (1, "")
    assert err == f"error: {said.format(tmp=tmp_path)}\n"


@pytest.mark.usefixtures("logging_as_it_was")
def test_a_store_named_by_an_option_or_an_error_not_naming_it_leaves_evstore_url_unsaid(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    db = tmp_path / "s.db"
    _small_store(db)
    monkeypatch.setenv("EVSTORE_URL", f"sqlite:///{db}")
    # (the store from EVSTORE_URL, but an error about a consumer, not about it)
    code, _, err = _in_process(capsys, "history", "5b9a2ad6-67b7-4cb7-989b-ec8a1e41b594")
    assert code == 1 and "EVSTORE_URL" not in err, err
    # (--url wins over EVSTORE_URL: an error about its store is not EVSTORE_URL's, even when
    # both name the same file)
    code, _, err = _in_process(capsys, "audit", "--url", f"sqlite:///{tmp_path}/gone.db")
    assert (code, err) == (1, f"error: evstore.not_found: no database file at {tmp_path}/gone.db{_HINT}\n")
    monkeypatch.setenv("EVSTORE_URL", f"sqlite:///{tmp_path}/gone.db")
    code, _, err = _in_process(capsys, "audit", "--url", f"sqlite:///{tmp_path}/gone.db")
    assert (code, err) == (1, f"error: evstore.not_found: no database file at {tmp_path}/gone.db{_HINT}\n")
    code, _, err = _in_process(capsys, "audit", "--db", str(db))
    assert code == 0, err


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize("blank", ["", " ", "\t\n"], ids=["empty", "space", "whitespace"])
def test_a_blank_evstore_url_is_a_usage_error_as_a_blank_url_option_is(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, blank: str
) -> None:
    """``EVSTORE_URL=" "`` was ``evstore.invalid_input: Unsupported store URL ' '`` (exit 1) where a
    blank ``--url`` is a usage error (exit 2, README: an empty option is one); an empty
    EVSTORE_URL was "no store given ... or set EVSTORE_URL" - set, yet empty."""
    monkeypatch.setenv("EVSTORE_URL", blank)
    code, out, err = _in_process(capsys, "audit")
    assert (code, out) == (2, "")
    assert err == (
        "error: evstore.usage: no store given: EVSTORE_URL is empty; use --db PATH, --url URL or set "
        "EVSTORE_URL to a store URL\n"
    )


@pytest.mark.usefixtures("logging_as_it_was")
@pytest.mark.parametrize(
    ("given", "hint"),
    [("./x.db", "use --db ./x.db or sqlite:///./x.db"), ("x y.db", "use --db 'x y.db' or sqlite:///x y.db"),
     ("/var/lib/x.db", "use --db /var/lib/x.db or sqlite:////var/lib/x.db")],
    ids=["relative", "space", "absolute"],
)  # fmt: skip
def test_a_path_given_as_url_is_told_how_to_name_that_file(
    capsys: pytest.CaptureFixture[str], given: str, hint: str
) -> None:
    """``--url ./x.db`` said only "use sqlite:///path.db or postgresql://...", leaving the reader
    to work out that a path wants --db, or sqlite:/// with it."""
    code, out, err = _in_process(capsys, "audit", "--url", given)
    assert (code, out) == (1, "")
    said = f"Unsupported store URL {given!r}: a path, not a URL; {hint}"
    assert err == f"error: evstore.invalid_input: {said}\n"


@pytest.mark.usefixtures("logging_as_it_was")
def test_a_keyword_string_given_as_url_gets_no_path_hint_nor_shows_its_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _in_process(capsys, "audit", "--url", "host=db user=app password=Secret1")
    assert code == 1 and err.startswith("error: evstore.invalid_input: Unsupported store URL "), err
    assert "Secret1" not in err and "a path" not in err, err
