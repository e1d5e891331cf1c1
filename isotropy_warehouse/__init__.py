"""isotropy-warehouse: the command line (`cli`) and what every layer shares (`errors`, `faults`).

The layers themselves are the top-level packages `extract` (model → sums) and `warehouse` (files,
commits, merging, views, report); this package holds only the lowest shared pieces and the highest
(the command line), so it imports nothing at import time.
"""

__version__ = "0.1.0"
