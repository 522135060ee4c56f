"""Stop 45, helper J's review of evstore/logs.py (every module's guarded log lines): a failing
structlog configuration's report goes to stderr only - where there is none (``sys.stderr`` is None:
pythonw, a daemon that dropped it), nowhere, as the standard library's ``Handler.handleError``
does - never to standard output, which may carry what the program writes (``evstore export``'s
lines, a host's JSON)."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import pytest
import structlog

from evstore import open_store
from evstore.logs import get_logger, log_failed
from tests.conftest import make_provider

pytestmark = pytest.mark.usefixtures("logging_as_it_was")


def _raising_processor() -> None:
    def boom(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        raise RuntimeError("the host's processor failed")

    structlog.configure(
        processors=[boom],
        logger_factory=structlog.ReturnLoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        cache_logger_on_first_use=False,
    )


def test_a_failed_line_is_not_reported_on_stdout_when_there_is_no_stderr(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _raising_processor()
    monkeypatch.setattr(sys, "stderr", None)
    get_logger("evstore.test").warning("test.line", n=1)
    try:
        raise RuntimeError("handled")
    except RuntimeError:
        log_failed("test.direct")
    monkeypatch.undo()
    out, err = capsys.readouterr()
    assert out == "" and err == "", (out, err)


async def test_a_command_with_no_stderr_writes_nothing_on_stdout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _raising_processor()
    async with open_store("sqlite:///:memory:") as store:
        monkeypatch.setattr(sys, "stderr", None)
        await make_provider(store)
        monkeypatch.undo()
    out, err = capsys.readouterr()
    assert out == "" and err == "", (out, err)


def test_with_a_stderr_the_failure_is_still_reported_there(capsys: pytest.CaptureFixture[str]) -> None:
    _raising_processor()
    get_logger("evstore.test").warning("test.line")
    out, err = capsys.readouterr()
    assert out == "" and "log line 'test.line' not emitted" in err and "the host's processor failed" in err
