"""Where the warehouse is when a command or call names none: `./isotropy-warehouse` in the current
directory, or the environment variable ISOTROPY_WAREHOUSE (a directory or s3://bucket/prefix), read
when the package is imported.  Every command's --warehouse, a sweep file's `warehouse` and the query
functions (`warehouse.query.connect`, `sql`, `view`) default to this one value: never a folder of the
source tree."""

from __future__ import annotations

import os

ENV_VAR = "ISOTROPY_WAREHOUSE"
FALLBACK = "isotropy-warehouse"

DEFAULT_WAREHOUSE = os.environ.get(ENV_VAR) or FALLBACK
