"""Queries: DuckDB views over a warehouse, read-only.  The entry points (the Python API):

    connect(warehouse)               a read-only DuckDB connection with every view
    sql(query, warehouse)            a query's result as a Polars DataFrame
    view(name, warehouse)            one view as a Polars DataFrame
    isoscore_star(zeta, warehouse)   IsoScore* with shrinkage ζ

and the public face of the modules behind them:

- views.py       the views' SQL: base views over the files the manifest lists, metrics from queries/*.sql
- views_file.py  views.sql for the DuckDB shell; every companion kept current with the commit log
- checks.py      what connect() checks first: listed files against their checksums, pending partials
- readonly.py    the read-only guard: a locked connection whose every statement is checked
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import duckdb

from common.default_warehouse import DEFAULT_WAREHOUSE
from common.errors import UserError

from .. import merge
from ..storage import open_storage, reading_once, retry_policy
from .checks import PendingPartials, pending_line, verify_listed
from .readonly import (READ_ONLY_SETTINGS, ReadOnlyConnection, ReadOnlyRelation, check_read_only, listed_paths,
                       read_only)
from .views import (BASE_VIEWS, QUERIES_DIR, Metric, all_view_sql, base_view_sql, bound_files, file_literal,
                    glob_escaped, glob_unescaped, load_metrics, sql_literal, view_closure, view_names,
                    views_read, views_reference)
from .views_file import companions_current, refresh_companions, views_tag, write_views_file

__all__ = ["connect", "sql", "view", "isoscore_star", "duckdb_error_line",
           "PendingPartials", "pending_line", "verify_listed",
           "READ_ONLY_SETTINGS", "ReadOnlyConnection", "ReadOnlyRelation", "check_read_only", "listed_paths",
           "read_only",
           "BASE_VIEWS", "QUERIES_DIR", "Metric", "all_view_sql", "base_view_sql", "bound_files", "file_literal",
           "glob_escaped", "glob_unescaped", "load_metrics", "sql_literal", "view_closure", "view_names",
           "views_read", "views_reference",
           "companions_current", "refresh_companions", "views_tag", "write_views_file"]


@reading_once
def connect(root=DEFAULT_WAREHOUSE, views=None) -> "ReadOnlyConnection":
    """An in-memory DuckDB connection with every view of the warehouse at `root` (a directory or
    s3://bucket/prefix), read-only: locked (`read_only`) and every statement checked
    (`ReadOnlyConnection`).  Use it as a DuckDBPyConnection: `connect(wh).execute(q).pl()`.  Partials
    committed but not folded yet are not in the views: a `PendingPartials` warning says so.

    `views`: only these views and the views they read (each view is created, unbound, at every opening;
    a program that reads a few opens faster), e.g. `connect(wh, views=["inter_sim"])`."""
    root = open_storage(root, must_exist=True)
    manifest = refresh_companions(root, strict=False)
    stale, extra = merge.stale_groups(manifest)
    if stale or extra:  # only a hand-edited manifest or a warehouse restored in parts gets here
        raise UserError(f"{root}: merged tables do not match the partials for {len(stale) + len(extra)} group(s); "
                        "run `python cli.py validate --warehouse ... --fix`")
    line = pending_line(manifest)
    if line:
        warnings.warn(PendingPartials(line), stacklevel=2)
    verify_listed(root, manifest)
    only = None if views is None else view_closure([views] if isinstance(views, str) else views)
    con = duckdb.connect()
    try:
        for stmt in all_view_sql(root, manifest, con, only, defer=True):
            con.execute(stmt)
    except duckdb.Error as e:
        con.close()
        raise UserError(duckdb_error_line(e)) from None
    read_only(con, listed_paths(root, manifest))
    return ReadOnlyConnection(con)


def duckdb_error_line(e: Exception) -> str:
    """A DuckDB error as one line; a file the manifest lists but that is gone is named as such."""
    text = " ".join(str(e).split())
    # A listed file that is gone: DuckDB finds no such file, or, under the lock (`read_only`), tries the
    # path as a directory (PATH/**/*.parquet), which allowed_paths refuses.
    m = re.search(r'No files found that match the pattern "([^"]+)"', text) or \
        re.search(r'Cannot access (?:file|directory) "([^"]+?)/\*\*/\*\.parquet"', text)
    if m:
        return f"{glob_unescaped(m.group(1))}: listed in the manifest but missing (run `python cli.py validate`)"
    if "AWS Error" in text:  # a scan's S3 read that failed past the retries (or at once: see s3_retry)
        return f"{text[:300]} (the S3 store kept failing: try again later, or allow more: {retry_policy().settings()})"
    return text[:400]


def sql(query: str, warehouse: str | Path = DEFAULT_WAREHOUSE):
    """Run `query` against the warehouse's views and return a Polars DataFrame.  Any failure — a
    refused statement, an SQL error, a file the views cannot read — is one `UserError` line.

    Example: sql("SELECT * FROM inter_sim ORDER BY model, layer", "warehouse")
    """
    check_read_only(query)
    con = connect(warehouse, views=views_read(query))
    try:
        return con.sql(query).pl()
    except duckdb.Error as e:
        raise UserError(duckdb_error_line(e)) from None
    finally:
        con.close()


def view(name: str, warehouse: str | Path = DEFAULT_WAREHOUSE):
    """One view (e.g. "avg_intra_sim") as a Polars DataFrame."""
    return sql(f"SELECT * FROM {name}", warehouse)


def isoscore_star(zeta: float, warehouse: str | Path = DEFAULT_WAREHOUSE):
    """IsoScore* (Rudman et al.) with shrinkage toward C₀ = I: the IsoScore of (1 − ζ)C + ζI, whose
    eigenvalues are (1 − ζ)λ + ζ.  Columns: model, checkpoint, step, source, layer, n, zeta, isoscore_star.

    Example: isoscore_star(0.1, "warehouse")
    """
    if not 0 <= zeta <= 1:
        raise UserError(f"zeta must lie in [0, 1], got {zeta}")
    z = float(zeta)
    body = next(m.body for m in load_metrics() if m.name == "isoscore")
    # The isoscore view's own query over the shrunk spectrum (a CTE named like the table it reads).
    return sql(f"""
        WITH spectrum AS (
            SELECT model, checkpoint, step, source, layer, n, k, (1 - {z}) * eigenvalue + {z} AS eigenvalue
            FROM main.spectrum
        )
        SELECT model, checkpoint, step, source, layer, n, {z} AS zeta, isoscore AS isoscore_star
        FROM ({body}) ORDER BY model, checkpoint, source, layer""", warehouse)
