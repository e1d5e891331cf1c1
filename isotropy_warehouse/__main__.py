"""`python -m isotropy_warehouse …`: the same commands as `isotropy-warehouse …` and `python cli.py …`."""

from isotropy_warehouse.cli import main

main()
