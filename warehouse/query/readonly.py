"""The read-only guard of query connections: `read_only` locks a DuckDB connection whose views are
bound (it may open only the files the manifest lists, loads no extension, and its settings cannot
change again), and `ReadOnlyConnection` / `ReadOnlyRelation` check every statement first
(`check_read_only`: only queries pass), so no query can write, delete or reach any other file.
"""

from __future__ import annotations

import re

import duckdb

from common.errors import UserError

from ..storage import open_storage
from ..store import Manifest
from .views import sql_literal


READ_ONLY_SETTINGS = (  # set after the views are bound, in this order; lock_configuration last
    "SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false", "SET allow_persistent_secrets = false",
    "SET enable_external_access = false", "SET lock_configuration = true")


def listed_paths(root, manifest: Manifest) -> list[str]:
    """The local files the views read with read_parquet (a warehouse on S3 is read through pyarrow
    datasets registered in the connection: DuckDB itself opens no file)."""
    st = open_storage(root)
    if not st.local:
        return []
    return sorted({st.uri(f) for e in manifest["entries"].values() for f in e["files"].values()})


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


def _refuse(what: str):
    def refused(*args, **kwargs):
        raise UserError(f"queries are read-only: {what} refused")
    return refused


class _Delegate:
    """Forwards every attribute to the wrapped DuckDB object; results that are connections or
    relations come back wrapped again, so no chain of calls reaches an unchecked one."""

    __slots__ = ("_raw",)
    _SQL_FIRST: frozenset = frozenset()  # methods whose first argument (or `query=`) is SQL text
    _REFUSED: dict = {}  # method → what the refusal says

    def __init__(self, raw):
        object.__setattr__(self, "_raw", raw)

    def __getattr__(self, name):
        if name in self._REFUSED:
            return _refuse(self._REFUSED[name])
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
        setattr(self._raw, name, value)

    def __dir__(self):
        return sorted(set(dir(self._raw)) - set(self._REFUSED))

    def __repr__(self):
        return repr(self._raw)

    def __str__(self):
        return str(self._raw)


class ReadOnlyConnection(_Delegate):
    """What `connect()` returns: a DuckDBPyConnection (locked by `read_only`) whose every statement —
    execute, executemany, sql, query, from_query, and the same on its cursors and duplicates — is
    first checked by `check_read_only`, and whose relations are `ReadOnlyRelation`s.  It closes the
    one hole the lock leaves (a listed Parquet file overwritten in place) and, as a bonus, refuses
    in-memory DDL/DML too.  Everything else (fetchall, pl, df, register, close, `with`) is the
    connection's own.  Python functions registered with create_function run as the caller's code."""

    __slots__ = ()
    _SQL_FIRST = frozenset({"execute", "executemany", "sql", "query", "from_query"})
    _REFUSED = {"register_filesystem": "registering a file system",
                "query_appender": "an appender that runs DML"}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._raw.close()
        return False


class ReadOnlyRelation(_Delegate):
    """A DuckDBPyRelation of a `ReadOnlyConnection`: reading it (fetchall, pl, df, arrow, show,
    filter/project/aggregate…, and `query(name, sql)` after `check_read_only`) works; the methods
    that write a file or a table (to_parquet, write_parquet, to_csv, write_csv, to_table, create,
    insert_into, insert, update) are refused."""

    __slots__ = ()
    _REFUSED = {m: f"relation.{m}()" for m in (
        "to_parquet", "write_parquet", "to_csv", "write_csv", "to_table", "create", "insert_into",
        "insert", "update")}

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
