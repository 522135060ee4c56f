"""``python -m evstore`` runs the ``evstore`` command line."""

from evstore.cli import main

if __name__ == "__main__":
    main()
