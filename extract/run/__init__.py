"""The extract run, in rooms by role:

- `settings`: the run's checked settings (`Settings`) and what each source reports (`SourceResult`);
- `windows`: token windows and padded batches;
- `stream`: one source (or a split source's values) through the model into the sums;
- `tables`: writing the sums and the parameter tables;
- `provenance`: what a run records beside its numbers, and its manifest entries;
- `preflight`: what the warehouse already holds or would refuse, checked before the forward passes;
- `driver`: `extract`, checkpoint by checkpoint, one commit each.

The entry points are re-exported here: `extract`, `Interrupted`, `summary_line`, `Settings`,
`SourceResult`.
"""

from .driver import Interrupted, extract, summary_line
from .settings import Settings, SourceResult

__all__ = ["Interrupted", "Settings", "SourceResult", "extract", "summary_line"]
