"""A client for the real OpenStack Placement 16.0.0, run by :mod:`tests.peers.placement_driver`.

The driver is one subprocess in the Placement venv, speaking JSON lines on its stdin/stdout. One
process serves a whole test session; :meth:`PlacementPeer.reset` gives each sequence a fresh,
empty SQLite database. Calls block on a pipe for a few milliseconds: async callers go through
:meth:`PlacementPeer.acall`, which runs them on a worker thread.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
from pathlib import Path
from typing import Any

DRIVER = Path(__file__).with_name("placement_driver.py")
MICROVERSION = "1.39"


class PeerError(RuntimeError):
    """The driver failed (not a Placement error response: those are ordinary answers)."""


class PlacementPeer:
    def __init__(self, python: Path) -> None:
        self._proc = subprocess.Popen(
            [str(python), "-I", str(DRIVER)],  # -I: keep tests/peers off sys.path
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            bufsize=1,
        )
        self._lock = threading.Lock()

    def _exchange(self, message: dict[str, Any]) -> dict[str, Any]:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        with self._lock:
            self._proc.stdin.write(json.dumps(message) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise PeerError(f"the Placement driver exited (status {self._proc.poll()})")
        answer: dict[str, Any] = json.loads(line)
        if answer.get("status") == "error":
            raise PeerError(f"{answer['error']}\n{answer.get('traceback', '')}")
        return answer

    def reset(self, db: Path) -> None:
        """Switch Placement to a fresh, empty database file."""
        self._exchange({"op": "reset", "db": str(db)})

    def purge_orphans(self) -> list[str]:
        purged: list[str] = self._exchange({"op": "purge_orphans"})["purged"]
        return purged

    def call(self, method: str, path: str, body: Any = None, version: str = MICROVERSION) -> tuple[int, Any]:
        """``(status, decoded JSON body or None)`` of one HTTP request to Placement."""
        answer = self._exchange({"method": method, "path": path, "body": body, "version": version})
        return int(answer["status"]), answer["body"]

    async def acall(
        self, method: str, path: str, body: Any = None, version: str = MICROVERSION
    ) -> tuple[int, Any]:
        return await asyncio.to_thread(self.call, method, path, body, version)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()
