"""Checks: every merged table against a fresh merge of its partials, within per-table tolerances."""

from __future__ import annotations

import tempfile
from collections import defaultdict

import numpy as np
import pyarrow as pa

from common.errors import UserError

from ..storage import Storage, StorageFault, open_storage, reading_once
from ..store import Manifest, partial_id

from .commits import discard
from .fold import fold_group
from .groups import checked, expected_groups, folded_members, stale_groups

def _table(st: Storage, rel: str | None, columns: list[str] | None = None) -> pa.Table | None:
    return st.read_table(rel, columns=columns) if rel else None


# Tolerance of each merged table against a fresh merge of its partials, as (relative to the value,
# relative to the column's largest magnitude): |x − y| ≤ a·|y| + b·max|y|.  Sums (n exact, float
# sums in another order) agree to ~1e-15 relative; 1e-9 leaves room for many partials.  Tables
# derived through an eigendecomposition or a least-squares fit of merged moments (spectrum,
# dim_variance, layer_metrics) inherit the moments' rounding amplified by the conditioning: 1e-6 of
# the value plus 1e-9 of the largest (e.g. the top eigenvalue).  Samples and massive rows are copies:
# exact.  Integer and string columns are always compared exactly.
TOLERANCES = {
    "token_stats": (1e-9, 1e-12), "token_vectors": (1e-9, 1e-12), "layer_totals": (1e-9, 1e-12),
    "frequency_buckets": (1e-9, 1e-12), "moments_merged": (1e-9, 1e-12), "sequence_moments_merged": (1e-9, 1e-12),
    "samples_merged": (0.0, 0.0), "massive_merged": (0.0, 0.0),
    "spectrum": (1e-6, 1e-9), "sequence_eigenvalues": (1e-6, 1e-9), "dim_variance": (1e-6, 1e-9),
    "layer_metrics": (1e-6, 1e-9), "attention_totals": (1e-9, 1e-12), "attention_direction": (1e-6, 1e-9),
}


def _floats(col: pa.ChunkedArray) -> tuple[np.ndarray, list | None]:
    """A float or list-of-float column as flat float64 values (nulls: NaN) and its list lengths."""
    import pyarrow.compute as pc

    col = col.combine_chunks()
    lengths = None
    while pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        lengths = (lengths or []) + [pc.list_value_length(col).to_pylist()]
        col = pc.list_flatten(col)
    return col.cast(pa.float64()).to_numpy(zero_copy_only=False).astype(np.float64), lengths


def compare_tables(a: pa.Table, b: pa.Table, table: str) -> str | None:
    """Why `a` (stored) differs from `b` (a fresh merge) beyond the table's tolerance (None: equal)."""
    rel_tol, col_tol = TOLERANCES.get(table, (1e-9, 1e-12))
    if a.column_names != b.column_names:
        return f"columns {a.column_names}, a fresh merge has {b.column_names}"
    if a.num_rows != b.num_rows:
        return f"{a.num_rows} rows, a fresh merge has {b.num_rows}"
    exact = [f.name for f in a.schema if pa.types.is_integer(f.type) or pa.types.is_string(f.type)
             or pa.types.is_boolean(f.type)]
    order = [(c, "ascending") for c in exact]
    if order:
        a, b = a.sort_by(order), b.sort_by(order)
    for f in a.schema:
        x, y = a.column(f.name), b.column(f.name)
        if f.name in exact:
            if not x.equals(y):
                return f"column {f.name} differs"
            continue
        (xv, xl), (yv, yl) = _floats(x), _floats(y)
        if xl != yl or xv.shape != yv.shape:
            return f"column {f.name}: vector lengths differ"
        if not xv.size:
            continue
        scale = float(np.nanmax(np.abs(yv))) if np.isfinite(yv).any() else 0.0
        with np.errstate(invalid="ignore"):
            ok = (np.abs(xv - yv) <= rel_tol * np.abs(yv) + col_tol * scale) | (xv == yv) | (np.isnan(xv) & np.isnan(yv))
        if not ok.all():
            i = int(np.argmin(ok))
            return f"column {f.name}: {xv[i]!r} where a fresh merge has {yv[i]!r} (tolerance {rel_tol:g} relative)"
    return None


@reading_once
def check(root, manifest: Manifest) -> list[tuple[str, str]]:
    """(merged key, problem) for groups that are stale or left over, or any of whose merged tables
    differs from a fresh merge of the partials it holds (pending ones aside) beyond TOLERANCES; compacted groups: layer counts
    against the partials' layer_sums.  Inputs are verified against their checksums first (a corrupt
    partial is reported, not merged).  The fresh merges are written to a local temporary directory."""
    root = open_storage(root)
    stale, extra = stale_groups(manifest)
    problems = [(k, f"merged tables of {k} are out of date (--fix re-merges them)") for k in stale]
    problems += [(k, f"merged entry {k} has no partials left (--fix removes it)") for k in extra]
    with tempfile.TemporaryDirectory(prefix="iso-check-") as tmp_dir:
        tmp = open_storage(tmp_dir)
        last = None  # (partial ids, fresh merge) of the group merged just before, kept for the next one
        try:
            for k, (model, checkpoint, group, members) in expected_groups(manifest).items():
                if k in stale:
                    continue
                have = manifest["entries"].get(k)
                members = folded_members(manifest, k, members)  # pending partials are not in it yet
                if have is None or not members:
                    continue
                try:
                    if have.get("compacted") or any(e.get("compacted") for e in members):
                        st = checked(root, [have, *members])
                        want_n = defaultdict(int)
                        for e in members:
                            for r in st.read_table(e["files"]["layer_sums"], columns=["layer", "n"]).to_pylist():
                                want_n[r["layer"]] += r["n"]
                        got = {r["layer"]: r["n"] for r in _table(st, have["files"].get("layer_totals"),
                                                                     ["layer", "n"]).to_pylist()}
                        if got != dict(want_n):
                            problems.append((k, f"{k}: layer counts {got} differ from its partials' {dict(want_n)}"))
                        continue
                    ids = sorted(partial_id(e) for e in members)
                    if last is not None and last[0] == ids:  # e.g. 'all' of a one-source checkpoint: the same
                        fresh, relabel = last[1], group      # merge but for the source column
                    else:
                        if last is not None:
                            discard(tmp, [last[1]])
                            last = None
                        fresh, relabel = fold_group(root, model, checkpoint, group, None, members, [], members,
                                                    dest=tmp), None
                        last = (ids, fresh)
                except StorageFault:  # the store failed, not the partial
                    raise
                except UserError as e:  # a damaged partial: reported by the file checks, named here too
                    problems.append((k, f"{k}: cannot be re-merged: {e}"))
                    continue
                st = checked(root, [have])
                for table in sorted(set(have["files"]) | set(fresh["files"])):
                    if (table in have["files"]) != (table in fresh["files"]):
                        why = "missing" if table in fresh["files"] else "not in a fresh merge"
                        problems.append((k, f"{k}: {table} {why} (--fix re-merges)"))
                        continue
                    try:
                        why = compare_tables(_table(st, have["files"][table]),
                                             _relabeled(_table(tmp, fresh["files"][table]), relabel), table)
                    except StorageFault:
                        raise
                    except UserError as e:
                        why = str(e)
                    except Exception as e:  # pyarrow raises several types for a damaged file
                        why = f"unreadable ({str(e)[:200]})"
                    if why:
                        problems.append((k, f"{k}: {table} differs from a fresh merge of its partials: "
                                            f"{why} (--fix re-merges)"))
        finally:  # the fresh merge's files and the lease that protects them
            if last is not None:
                discard(tmp, [last[1]])
    return problems


def _relabeled(table: pa.Table, group: str | None) -> pa.Table:
    """`table` (a fresh merge of the same partials for another group) with its source column set to
    `group` (None: as it is)."""
    if group is None or "source" not in table.column_names:
        return table
    i = table.column_names.index("source")
    return table.set_column(i, table.schema.field(i), pa.array([group] * table.num_rows, table.schema.field(i).type))
