"""The read-only guard of query connections: `read_only` locks a DuckDB connection whose views are
bound (it may open only the files the manifest lists, loads no extension, and its settings cannot
change again), and `ReadOnlyConnection` / `ReadOnlyRelation` check every statement first
(`check_read_only`: only queries pass), so no query can write, delete or reach any other file.
The wrappers hand out only the attributes on their allow-lists (reading, fetching, relational
building blocks): every other one — private ones such as `_submit` or `_write` included — is
refused, so a method DuckDB adds later is refused until it is judged and listed.
"""

from __future__ import annotations

import re

import duckdb

from common.errors import UserError

from ..storage import open_storage
from ..store import Manifest
from .views import glob_escaped, sql_literal


READ_ONLY_SETTINGS = (  # set after the views are bound, in this order; lock_configuration last
    "SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false", "SET allow_persistent_secrets = false",
    "SET enable_external_access = false", "SET lock_configuration = true")


def listed_paths(root, manifest: Manifest) -> list[str]:
    """The local files the views read with read_parquet (a warehouse on S3 is read through pyarrow
    datasets registered in the connection: DuckDB itself opens no file), each also as the escaped
    pattern the views name it by (views.glob_escaped: DuckDB checks the pattern, then the file)."""
    st = open_storage(root)
    if not st.local:
        return []
    files = {st.uri(f) for e in manifest["entries"].values() for f in e["files"].values()}
    return sorted(files | {glob_escaped(f) for f in files})


def read_only(con: duckdb.DuckDBPyConnection, paths: list[str]) -> None:
    """Lock a connection whose views are bound: DuckDB may open only `paths` (the files the manifest
    lists), installs and loads no extension, and its configuration cannot be changed again — so a
    query cannot create, delete or reach any other file (COPY … TO, ATTACH, EXPORT DATABASE, INSTALL,
    LOAD, read_csv('/etc/…') fail with DuckDB's Permission Error).  DuckDB's allow-list is for reading
    *and* writing (DuckDB 2.0 has no read-only file system setting, and `disabled_filesystems` would
    stop the views' reads too): a `COPY … TO '<a listed file>' (USE_TMP_FILE false)` could still
    overwrite one of those files, so `connect()` hands out the connection only inside a
    `ReadOnlyConnection`, which checks every statement first (`check_read_only`)."""
    if paths:
        con.execute("SET allowed_paths = [" + ", ".join(sql_literal(p) for p in paths) + "]")
    for stmt in READ_ONLY_SETTINGS:
        con.execute(stmt)


def check_read_only(query: str) -> None:
    """Refuse (UserError) any statement of `query` that is not a query: only SELECT (WITH, FROM …,
    VALUES, DESCRIBE, SHOW, SUMMARIZE are SELECTs to DuckDB) and EXPLAIN of a SELECT pass."""
    try:
        statements = duckdb.extract_statements(query)
    except duckdb.Error as e:
        raise UserError(" ".join(str(e).split())) from None
    for s in statements:
        kind = s.type
        if kind == duckdb.StatementType.EXPLAIN:  # EXPLAIN ANALYZE runs its statement: it must be a query too
            inner = re.sub(r"^\s*EXPLAIN\s+(ANALY[SZ]E\s+)?", "", s.query, flags=re.IGNORECASE)
            try:
                kinds = [t.type for t in duckdb.extract_statements(inner)]
            except duckdb.Error:  # EXPLAIN (FORMAT …) and the like: refused rather than parsed here
                kinds = []
            if kinds == [duckdb.StatementType.SELECT]:
                continue
        elif kind == duckdb.StatementType.SELECT:
            continue
        text = " ".join(s.query.split())
        raise UserError(f"queries are read-only: {kind.name} statement refused "
                        f"({text[:60] + ('…' if len(text) > 60 else '')})")


def _checked(query) -> None:
    """check_read_only for what DuckDB's Python API takes as a query: text or a parsed Statement."""
    if isinstance(query, str):
        check_read_only(query)
    elif isinstance(query, duckdb.Statement):
        check_read_only(query.query)
    else:
        raise UserError(f"queries are read-only: a query must be SQL text, not {type(query).__name__}")


def _wrap(result):
    """A connection or relation that DuckDB hands back, kept behind the read-only checks."""
    if isinstance(result, duckdb.DuckDBPyConnection):
        return ReadOnlyConnection(result)
    if isinstance(result, duckdb.DuckDBPyRelation):
        return ReadOnlyRelation(result)
    return result


class Refused(UserError, AttributeError):
    """An attribute the read-only wrappers do not hand out: a one-line UserError, and to `hasattr`
    and `getattr(…, default)` an attribute that is not there."""


class _Delegate:
    """Hands out the wrapped DuckDB object's attributes that `ALLOWED` lists (and refuses every other
    one, public or private); results that are connections or relations come back wrapped again, so no
    chain of calls reaches an unchecked one.  The raw object is the one slot `_raw`."""

    __slots__ = ("_raw",)
    KIND = "object"
    ALLOWED: frozenset = frozenset()  # the attributes handed out
    _SQL_FIRST: frozenset = frozenset()  # of those, methods whose first argument (or `query=`) is SQL text

    def __init__(self, raw):
        object.__setattr__(self, "_raw", raw)

    def __getattr__(self, name):
        if name not in self.ALLOWED:
            if name.startswith("__") and name.endswith("__"):
                raise AttributeError(name)  # protocols Python probes for (copy, pickle, …): as if absent
            raise Refused(f"queries are read-only: {self.KIND}.{name} refused (not on the read-only wrapper's "
                          "allow-list)")
        attr = getattr(self._raw, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            if name in self._SQL_FIRST:
                _checked(args[0] if args else kwargs.get("query", kwargs.get("sql_query")))
            return _wrap(attr(*args, **kwargs))
        call.__name__, call.__doc__ = name, attr.__doc__
        return call

    def __setattr__(self, name, value):
        raise UserError(f"queries are read-only: setting {self.KIND}.{name} refused")

    def __delattr__(self, name):
        raise UserError(f"queries are read-only: deleting {self.KIND}.{name} refused")

    def __dir__(self):
        return sorted(self.ALLOWED)

    def __repr__(self):
        return repr(self._raw)

    def __str__(self):
        return str(self._raw)


# What a connection hands out: its checked statements, results, relations over the views or over
# Python data, cursors, types, and the caller's own Python functions.  Not: appenders and append,
# extensions, file systems, profiling and checkpoints (configuration or files), private methods.
_CONNECTION = frozenset({
    "execute", "executemany", "sql", "query", "from_query",  # checked (_SQL_FIRST)
    "fetchall", "fetchone", "fetchmany", "fetchdf", "fetch_df", "fetch_df_chunk", "fetchnumpy", "df",
    "to_arrow_table", "to_arrow_reader", "torch", "tf",
    "description", "rowcount", "close", "cursor", "duplicate", "interrupt", "query_progress", "complete",
    "get_table_names", "extract_statements", "table", "view", "values", "from_arrow", "from_df",
    "read_parquet", "from_parquet", "read_csv", "from_csv_auto", "read_json",  # the lock limits them to listed files
    "register", "unregister", "create_function", "remove_function", "begin", "commit", "rollback", "abort",
    "list_filesystems", "filesystem_is_registered", "array_type", "decimal_type", "dtype", "enum_type",
    "list_type", "map_type", "row_type", "sqltype", "string_type", "struct_type", "union_type", "type",
})

# What a relation hands out: reading, fetching, and building other relations.  Not: the writers
# (to_parquet, write_parquet, to_csv, write_csv, to_table, create, insert_into, insert, update),
# views in the catalogue (create_view, to_view), private methods (`_write`, `_con`, …).
_RELATION = frozenset({
    "query",  # checked (ReadOnlyRelation.__getattr__)
    "aggregate", "alias", "any_value", "apply", "arg_max", "arg_min", "arrow", "avg", "bit_and", "bit_or",
    "bit_xor", "bitstring_agg", "bool_and", "bool_or", "close", "columns", "count", "cross", "cume_dist",
    "dense_rank", "describe", "description", "df", "distinct", "drop", "dtypes", "except_", "explain", "favg",
    "fetch_arrow_reader", "fetch_arrow_table", "fetch_record_batch", "fetchall", "fetchdf", "fetchmany",
    "fetchnumpy", "fetchone", "filter", "first", "first_value", "fsum", "geomean", "group_by", "head",
    "histogram", "intersect", "iter_rows", "join", "lag", "last", "last_value", "lead", "limit", "list",
    "map", "materialize", "max", "mean", "median", "min", "mode", "n_tile", "nth_value", "offset", "order",
    "percent_rank", "pivot", "pl", "preview", "product", "project", "quantile", "quantile_cont",
    "quantile_disc", "rank", "rank_dense", "rename", "row_number", "sample", "select", "select_dtypes",
    "select_types", "set_alias", "shape", "show", "sort", "sql_query", "std", "stddev", "stddev_pop",
    "stddev_samp", "string_agg", "sum", "tf", "to_arrow_reader", "to_arrow_table", "to_df", "to_dicts",
    "torch", "type", "types", "union", "union_by_name", "unique", "unnest", "unpivot", "value_counts", "var",
    "var_pop", "var_samp", "variance", "with_columns", "_repr_mimebundle_",  # (Jupyter's display)
})


class ReadOnlyConnection(_Delegate):
    """What `connect()` returns: a DuckDBPyConnection (locked by `read_only`) whose every statement —
    execute, executemany, sql, query, from_query, and the same on its cursors and duplicates — is
    first checked by `check_read_only`, and whose relations are `ReadOnlyRelation`s.  It closes the
    one hole the lock leaves (a listed Parquet file overwritten in place) and, as a bonus, refuses
    in-memory DDL/DML too.  Only the attributes of `ALLOWED` are handed out (fetchall, pl, df,
    register, close, `with`, …); every other one is refused.  Python functions registered with
    create_function run as the caller's code."""

    __slots__ = ()
    KIND = "connection"
    ALLOWED = _CONNECTION
    _SQL_FIRST = frozenset({"execute", "executemany", "sql", "query", "from_query"})

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._raw.close()
        return False


class ReadOnlyRelation(_Delegate):
    """A DuckDBPyRelation of a `ReadOnlyConnection`: reading it (fetchall, pl, df, arrow, show,
    filter/project/aggregate…, and `query(name, sql)` after `check_read_only`) works; only the
    attributes of `ALLOWED` are handed out, so the methods that write a file, a table or a view
    (to_parquet, write_parquet, to_csv, write_csv, to_table, create, create_view, insert_into,
    insert, update) and every private one are refused."""

    __slots__ = ()
    KIND = "relation"
    ALLOWED = _RELATION

    def __getattr__(self, name):
        if name == "query":  # query(virtual_table_name, sql_query): the SQL is the second argument
            raw_query = self._raw.query

            def query(virtual_table_name, sql_query):
                _checked(sql_query)
                return _wrap(raw_query(virtual_table_name, sql_query))
            return query
        return super().__getattr__(name)

    def __len__(self):
        return len(self._raw)

    def __getitem__(self, key):
        return _wrap(self._raw[key])

    def __contains__(self, key):
        return key in self._raw

    def __arrow_c_stream__(self, *args, **kwargs):
        return self._raw.__arrow_c_stream__(*args, **kwargs)
