"""The ``evstore`` script and ``python -m evstore``: the command line of :mod:`evstore.cli`.

The script's entry point is here rather than in :mod:`evstore.cli` so that a Ctrl-C while Python
still imports the command line (typer, rich, structlog: ~0.2 s; the models and the store are
imported once a command runs, where it catches its own) ends the command as a Ctrl-C during its
work does - exit 130, nothing printed - instead of with a traceback of the import. (This
package's ``__init__`` imports only the errors: its other names load on first use.)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

#: the exit status of a command interrupted by Ctrl-C (evstore.cli's; 128 + SIGINT, as shells say)
EXIT_INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> None:
    """Run the ``evstore`` command line (``argv``: the arguments, default ``sys.argv[1:]``)."""
    try:
        from evstore.cli import main as cli_main

        cli_main(argv)
    except KeyboardInterrupt:  # (during the import: once it runs, the CLI catches its own)
        sys.exit(EXIT_INTERRUPTED)


if __name__ == "__main__":
    main()
