"""isotropy-warehouse's command line (`cli`), the top floor: it parses options and calls `extract`
(model → sums) and `warehouse` (files, commits, merging, views, report), which stand on `common`."""

__version__ = "0.1.0"
