"""Stop 45, helper H: the command line's messages said alike what is alike - a store URL from
EVSTORE_URL, a missing database, a file where a directory belongs, an empty or malformed
position, an option of evstore itself given after the command, a libpq keyword string's secrets
(see each test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evstore import cli, errors

pytestmark = pytest.mark.usefixtures("logging_as_it_was")


def _in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``evstore ARGS`` run by ``cli.main`` in this process: (exit status, stdout, stderr)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        cli.main(list(args))
    out = capsys.readouterr()
    return int(done.value.code or 0), out.out, out.err


@pytest.fixture
def demo_db(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    db = tmp_path / "d.db"
    code, _, err = _in_process(capsys, "demo", "--db", str(db), "--instances", "3", "--nodes", "2")
    assert code == 0, err
    return db


def test_an_error_about_a_url_from_evstore_url_says_so_though_it_names_no_store(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, demo_db: Path
) -> None:
    """The message "Unknown SQLite store option(s) frob" named no store, so the "(from EVSTORE_URL)" an error
    naming the store gets was left out: the reader of an error about a URL they never typed was
    not told where it came from. Given as --url, it stays unmarked."""
    url = f"sqlite:///{demo_db}?frob=1"
    monkeypatch.setenv("EVSTORE_URL", url)
    code, out, err = _in_process(capsys, "audit")
    assert (code, out) == (1, "")
    assert err.startswith("error: evstore.invalid_input: Unknown SQLite store option(s) frob"), err
    assert err.endswith(" (from EVSTORE_URL)\n"), err
    monkeypatch.delenv("EVSTORE_URL")
    code, _, err = _in_process(capsys, "audit", "--url", url)
    assert code == 1 and "EVSTORE_URL" not in err, err


def test_an_error_found_in_the_store_not_its_url_stays_unmarked(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, demo_db: Path
) -> None:
    monkeypatch.setenv("EVSTORE_URL", f"sqlite:///{demo_db}")
    code, _, err = _in_process(capsys, "history", "5b9a2ad6-67b7-4cb7-989b-ec8a1e41b594")
    assert code == 1 and "EVSTORE_URL" not in err, err


def test_a_missing_database_is_said_alike_by_db_url_and_evstore_url(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--db missing.db`` said "no database file at missing.db (check the path, or create one with
    `evstore demo`)", ``EVSTORE_URL=sqlite:///missing.db`` (or --url) "no database at missing.db"."""
    monkeypatch.chdir(tmp_path)
    hint = "no database file at missing.db (check the path, or create one with `evstore demo`)"
    code, _, err = _in_process(capsys, "audit", "--db", "missing.db")
    assert (code, err) == (1, f"error: evstore.not_found: {hint}\n")
    code, _, err = _in_process(capsys, "audit", "--url", "sqlite:///missing.db")
    assert (code, err) == (1, f"error: evstore.not_found: {hint}\n")
    monkeypatch.setenv("EVSTORE_URL", "sqlite:///missing.db")
    code, _, err = _in_process(capsys, "audit")
    assert (code, err) == (1, f"error: evstore.not_found: {hint} (from EVSTORE_URL)\n")
    assert not (tmp_path / "missing.db").exists()


@pytest.mark.parametrize("how", ["--db", "--url"])
def test_demo_into_a_directory_that_is_a_file_says_it_is_a_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, how: str
) -> None:
    """``demo --db notdb.txt/x.db``, notdb.txt a regular file, said "directory notdb.txt does not
    exist": it does, as a file."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notdb.txt").write_text("text\n")
    value = "notdb.txt/x.db" if how == "--db" else "sqlite:///notdb.txt/x.db"
    code, out, err = _in_process(capsys, "demo", how, value, "--instances", "3", "--nodes", "2")
    assert (code, out) == (1, ""), err
    assert err.startswith("error: evstore.invalid_input: notdb.txt is a file, not a directory"), err
    assert "does not exist" not in err
    assert (tmp_path / "notdb.txt").read_text() == "text\n"


def test_a_dangling_link_on_the_way_is_not_called_a_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    code, _, err = _in_process(capsys, "demo", "--db", "dangling/x.db", "--instances", "3", "--nodes", "2")
    assert code == 1 and "is a file" not in err and "does not exist" in err, err


def test_an_empty_after_is_said_empty_as_an_empty_at_is(
    capsys: pytest.CaptureFixture[str], demo_db: Path
) -> None:
    """``tail --after ''`` said click's "Input should be a valid integer", where ``state --at ''``
    says "--at is empty"."""
    code, _, err = _in_process(capsys, "state", "--db", str(demo_db), "--at", "")
    assert (code, err) == (
        2,
        "error: evstore.usage: --at is empty: give a position or an ISO time with a zone\n",
    )
    for empty in ("", " "):
        code, _, err = _in_process(capsys, "tail", "--db", str(demo_db), "--no-follow", "--after", empty)
        assert (code, err) == (2, "error: evstore.usage: --after is empty: give a position\n")


@pytest.mark.parametrize("text", ["1_0", "\u0665", "0x5", "5.0"])
def test_a_position_is_ascii_digits_alike_for_every_option(
    capsys: pytest.CaptureFixture[str], demo_db: Path, text: str
) -> None:
    """--at refused "1_0" (underscores) and "\\u0665" (a non-ASCII digit) while ``tail --after 1_0`` read
    position 10 (Python's int). Decided: a position is ASCII digits, a sign and spaces around them
    allowed (as click and --at read them: ``--at +3`` is 3, ``--at " -7 "`` out of range,
    tests/test_cli_exit_rules.py), the same for --at, diff's bounds and --after."""
    code, _, err = _in_process(capsys, "state", "--db", str(demo_db), "--at", text)
    assert code == 1 and "must be a position" in err, err
    code, _, err = _in_process(capsys, "tail", "--db", str(demo_db), "--no-follow", "--after", text)
    assert code == 2, err
    assert f"--after must be a position (e.g. 120), got {text!r}" in err, err


@pytest.mark.parametrize("text", ["+5", " 5", "5 ", "05"])
def test_a_sign_or_spaces_around_a_position_are_read_alike(
    capsys: pytest.CaptureFixture[str], demo_db: Path, text: str
) -> None:
    code, out, err = _in_process(capsys, "state", "--db", str(demo_db), "--at", text, "--json")
    assert code == 0 and json.loads(out)["position"] == 5, err
    code, out, err = _in_process(
        capsys, "tail", "--db", str(demo_db), "--after", text, "--limit", "1", "--json"
    )
    assert code == 0 and json.loads(out)["position"] == 6, err


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["-v", "-v"], "give it before the command, evstore -v -v audit ..."),
        (["-vv"], "give it before the command, evstore -vv audit ..."),
        (["-vvx"], "give it before the command, evstore -vv audit ..."),
        (["--verbose", "-v"], "give it before the command, evstore --verbose -v audit ..."),
        (["--version"], "evstore --version (it prints the version, and runs no command)"),
    ],
    ids=["v-v", "vv", "vvx", "verbose-v", "version"],
)
def test_the_hint_for_an_option_of_evstore_after_the_command_gives_it_as_typed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], hint: str
) -> None:
    """``audit -v -v`` suggested ``evstore -v audit`` (one -v: no traceback, README says -vv shows
    it), ``-vvx`` too, and ``audit --version`` suggested ``evstore --version audit ...``, which
    prints the version and runs no audit."""
    code, _, err = _in_process(capsys, "audit", *args, "--db", str(tmp_path / "x.db"))
    assert code == 2, err
    assert hint in err, err


SECRETS = ["oauth_client_secret", "sslpassword", "password", "scram_client_key", "scram_server_key"]


@pytest.mark.parametrize("keyword", SECRETS)
def test_a_libpq_secret_is_hidden_wherever_a_url_or_keyword_string_is_echoed(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, keyword: str
) -> None:
    """``oauth_client_secret=S3CRET host=h`` was echoed whole: only password and sslpassword were
    hidden. Every secret-bearing libpq keyword (PostgreSQL 18's oauth_client_secret and SCRAM keys
    too) is hidden as ***, by redact_url, redact_text and the CLI's messages."""
    for text in (
        f"{keyword}=S3CRET host=h",
        f"host=h {keyword}='S3 CRET'",
        f"postgresql://h/db?{keyword}=S3CRET",
    ):
        assert "S3" not in errors.redact_url(text), (text, errors.redact_url(text))
        assert "S3" not in errors.redact_text(f"cannot parse {text!r}", text)
        for given in (["--url", text], []):
            monkeypatch.setenv("EVSTORE_URL", text)
            code, out, err = _in_process(capsys, "audit", *given)
            assert code in (1, 2) and "S3" not in err + out, (text, err)


def test_newer_libpq_keywords_are_known(capsys: pytest.CaptureFixture[str]) -> None:
    """PostgreSQL 17 and 18's keywords were missing from LIBPQ_KEYWORDS: a keyword string starting
    with one was not said to be one, and one holding one could not be written as a URL."""
    new = (
        "servicefile sslkeylogfile min_protocol_version max_protocol_version oauth_issuer "
        "oauth_client_id oauth_client_secret oauth_scope scram_client_key scram_server_key"
    ).split()
    assert set(new) <= cli.LIBPQ_KEYWORDS
    built = cli.libpq_as_url(
        "host=h dbname=d oauth_issuer=https://i oauth_client_secret=S3CRET scram_client_key=K3Y"
    )
    assert built is not None and "S3CRET" not in built and "K3Y" not in built, built
    assert "oauth_client_secret=***" in built and "scram_client_key=***" in built, built
    code, _, err = _in_process(capsys, "audit", "--url", "min_protocol_version=3.2 host=h")
    assert code == 1 and "a libpq keyword/value connection string, min_protocol_version=" in err, err


def test_a_url_path_starting_with_a_tilde_is_checked_as_sqlite_opens_it(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_db: Path
) -> None:
    """``--url sqlite:///~/x.db`` names the file ``./~/x.db`` (SQLite expands no ``~``): a store
    at ``$HOME/x.db`` does not make it exist, nor ``~`` a directory SQLite is then told of. (The
    first version of the check above read it as --db reads a path, ``~`` expanded.)"""
    home = tmp_path / "home"
    home.mkdir()
    demo_db.rename(home / "x.db")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    code, _, err = _in_process(capsys, "stats", "--url", "sqlite:///~/x.db")
    hint = "(check the path, or create one with `evstore demo`)"
    assert (code, err) == (1, f"error: evstore.not_found: no database file at ~/x.db {hint}\n")
    code, _, err = _in_process(capsys, "stats", "--db", "~/x.db")
    assert code == 0, err


def test_export_into_a_directory_that_is_a_file_says_it_is_a_file(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path, demo_db: Path
) -> None:
    """``export -o notdb.txt/x.jsonl`` said "evstore.io: ... Not a directory" (the same check as
    demo's, given_path's, says it now, as a directory where a file belongs is said)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notdb.txt").write_text("text\n")
    code, out, err = _in_process(capsys, "export", "--db", str(demo_db), "-o", "notdb.txt/x.jsonl")
    assert (code, out) == (1, "")
    assert err.startswith("error: evstore.invalid_input: notdb.txt is a file, not a directory"), err
