"""The ``evstore`` script and ``python -m evstore``: the command line of :mod:`evstore.cli`.

The script's entry point is here rather than in :mod:`evstore.cli` so that a Ctrl-C while Python
still imports the command line (typer, rich, structlog: ~0.2 s; the models and the store are
imported once a command runs, where it catches its own) ends the command as a Ctrl-C during its
work does - exit 130, nothing printed - instead of with a traceback of the import. (This
package's ``__init__`` imports only the errors: its other names load on first use.)
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence
from typing import Any

#: the exit status of a command interrupted by Ctrl-C (evstore.cli's; 128 + SIGINT, as shells say)
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> None:
    """Run the ``evstore`` command line (``argv``: the arguments, default ``sys.argv[1:]``), and
    end with its exit status (``SystemExit``). Run as the program - the ``evstore`` script, ``python
    -m evstore`` - Ctrl-C is ignored once that status is decided, until the process ends (see
    :func:`_decided`); called in a process that goes on (a test, an embedder), SIGINT's handler is
    put back as it was when it returns."""
    before = _sigint_handler()
    try:
        try:
            try:
                from evstore.cli import main as cli_main

                cli_main(argv)
            finally:
                _decided()
        except KeyboardInterrupt:  # (during the import: once it runs, the CLI catches its own)
            _decided()
            sys.exit(EXIT_INTERRUPTED)
    finally:
        if not _the_program() and before is not None:
            _set_sigint(before)


def _the_program() -> bool:
    """Whether this process is the ``evstore`` program, ending with :func:`main`: its ``__main__``
    module is this one run by ``python -m evstore``, or a script that imported :func:`main` to call
    it (the ``evstore`` script pip writes does that, ``sys.exit(main())``) - not a test runner or
    an application that calls it and goes on."""
    return getattr(sys.modules.get("__main__"), "main", None) is main


def _sigint_handler() -> Any:
    """SIGINT's handler now (None: not one Python can put back, or not the main thread)."""
    try:
        return signal.getsignal(signal.SIGINT)
    except ValueError:  # pragma: no cover (getsignal works in any thread; kept for symmetry)
        return None


def _set_sigint(handler: Any) -> None:
    try:
        signal.signal(signal.SIGINT, handler)
    except ValueError:  # (not the main thread: nothing raises KeyboardInterrupt there)
        pass


def _decided() -> None:
    """The command has ended, its status decided (its work done and its output flushed, or not):
    from here a Ctrl-C can stop nothing, and is ignored until the process ends (or, called in a
    process that goes on, until :func:`main` returns). Taken, it raised KeyboardInterrupt where the
    exit was passing - this frame, or Python joining its threads as it ends - which printed a
    traceback and ended the process by SIGINT (or "Exception ignored" and the command's status).
    The command's own status is the true one then: an import that committed, 0, not 130, which
    says it was stopped and left the store as it was."""
    _set_sigint(signal.SIG_IGN)


if __name__ == "__main__":
    main()
