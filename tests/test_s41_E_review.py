"""Stop 41, helper E (review of the stop's changes): cases the stop's fixes left out."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from evstore import StorageError, open_store


async def test_a_host_whose_every_address_refuses_says_nothing_listens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Review (stop 41, helper E): the hint for a port nothing listens on (helper D's fix) was
    given only for a ``ConnectionRefusedError``; a host name with more than one address - the
    usual ``localhost`` with ``::1`` and ``127.0.0.1`` - is refused at each, and asyncio then
    raises a plain ``OSError("Multiple exceptions: [Errno 111] ..., [Errno 111] ...")``: the
    driver's text alone, no hint. Now it gets the same hint."""
    real = socket.getaddrinfo

    def two_addresses(host: Any, port: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "two-addresses.invalid":
            return [
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.2", port)),
            ]
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", two_addresses)
    with socket.socket() as sock:  # (a port just free: nothing listens on it)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(StorageError) as caught:
        async with open_store(
            f"postgresql://evstore:pw@two-addresses.invalid:{port}/evstore", connect_timeout=5
        ):
            pass
    assert "Multiple exceptions" in caught.value.message
    assert "check the host and the port" in caught.value.message
