"""Merging partials into the merged tables the views read: the public face of eight modules, one role each.

- groups.py       which merged entry (group) a partial folds into, what each holds, what is pending
- fold_tokens.py  the streaming k-way fold of per-token sums (the algebra, float64, memory bounded)
- fold.py         the fold of one group: every merged table written from its old state and partials
- coverage.py     what a partial covers; which committed partials a new one replaces or conflicts with
- identity.py     whether entries are made of the same weights (twins too) and the same settings
- commits.py      commit records: appending partials, folding pending ones, racing writers, rebuilds
- checks.py       every merged table against a fresh merge of its partials
- compaction.py   a finished checkpoint's per-partial vectors dropped

A partial is one (model, checkpoint, source, shard) run's sums; its groups are its source and 'all'.
Views read only merged tables, so they answer in the same time whatever the number of partials; a
merged entry holds exactly the partials its `inputs` list (never part of one), and the partials
committed since are pending until a fold (commits.py).  Above warehouse.store, below warehouse.query.
"""

from .checks import TOLERANCES, check, compare_tables  # noqa: F401
from .commits import (commit, committed_files, discard, empty_groups, fold_groups, fold_pending, held,  # noqa: F401
                      rebuild)
from .compaction import compact  # noqa: F401
from .coverage import check_conflicts, conflict_line, covers, overlaps, replacements, shard_of  # noqa: F401
from .fold import fold_group, relabel_group  # noqa: F401
from .identity import check_settings, identities_differ, settings_clash, twin_checkpoints  # noqa: F401
from .groups import (ALL, check_open, checked, expected_groups, folded_members, group_key, is_compacted,  # noqa: F401
                     partial_id, pending, pending_pairs, repair_hint, stale_groups)
from ..storage import open_storage  # noqa: F401

__all__ = ["TOLERANCES", "check", "compare_tables", "commit", "committed_files", "discard", "empty_groups",
           "fold_groups", "fold_pending", "held", "rebuild", "compact", "check_conflicts", "conflict_line", "covers",
           "overlaps", "replacements", "shard_of", "fold_group", "relabel_group", "check_settings",
           "identities_differ", "settings_clash", "twin_checkpoints", "ALL", "check_open", "checked",
           "expected_groups", "folded_members", "group_key", "is_compacted", "partial_id", "pending", "pending_pairs",
           "repair_hint", "stale_groups", "open_storage"]
