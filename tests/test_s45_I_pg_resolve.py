"""Stop 45, helper I: a PostgreSQL host name that does not resolve at open - a typo, EAI_NONAME -
is not ``transient`` (trying again meets the same; the message says to check the host); only a
resolver's temporary failure (EAI_AGAIN) is, and its message says to try again."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest

from evstore import StorageError, open_store


def _resolver_failing(monkeypatch: pytest.MonkeyPatch, errno: int, text: str) -> None:
    async def getaddrinfo(self: Any, host: Any, *args: Any, **kwargs: Any) -> Any:
        raise socket.gaierror(errno, text)

    monkeypatch.setattr(asyncio.BaseEventLoop, "getaddrinfo", getaddrinfo)


async def test_a_host_name_that_does_not_resolve_is_not_transient(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolver_failing(monkeypatch, socket.EAI_NONAME, "Name or service not known")
    with pytest.raises(StorageError) as caught:
        await open_store("postgresql://u@db.exmaple.test:5432/evstore?connect_timeout=5")
    failed = caught.value
    assert failed.details.get("transient") is not True, failed.details
    assert "does not resolve" in failed.message and "check the host" in failed.message, failed.message
    assert "try again" not in failed.message, failed.message


async def test_a_temporary_resolver_failure_is_transient_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _resolver_failing(monkeypatch, socket.EAI_AGAIN, "Temporary failure in name resolution")
    with pytest.raises(StorageError) as caught:
        await open_store("postgresql://u@db.example.test:5432/evstore?connect_timeout=5")
    failed = caught.value
    assert failed.details.get("transient") is True, failed.details
    assert "try again" in failed.message and "does not resolve" not in failed.message, failed.message
