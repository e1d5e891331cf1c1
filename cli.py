"""`python cli.py …` from a checkout: the same command line as the installed `isotropy-warehouse`
(isotropy_warehouse/cli.py)."""

from isotropy_warehouse.cli import app, main  # noqa: F401  (tests import cli.app)

if __name__ == "__main__":
    main()
