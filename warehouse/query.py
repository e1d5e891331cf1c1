"""DuckDB views over the warehouse: base tables from the manifest, metrics from `queries/*.sql`.

The base views (one per table of schema.py, and `runs`) read exactly the Parquet files that the
manifest lists, so files of unfinished or replaced runs are never seen.  The metric views read
only the merged tables (merge.py), never the per-partial ones, so their cost does not grow with
the number of partials.  Each metric is one `.sql` file in `queries/` whose header says

    -- <name>: <one line>
    -- Formula: ...
    -- Inputs: view, view, ...
    -- Columns: col, col, ...

and whose body is one SELECT; it becomes `CREATE VIEW <name> AS <body>`.
"""

from __future__ import annotations

import importlib.resources
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.dataset as ds

from common.default_warehouse import DEFAULT_WAREHOUSE
from common.errors import UserError

from . import merge, schema, store
from . import storage
from .storage import open_storage


def _queries_dir() -> Path:
    """queries/*.sql: in an installed wheel the package data warehouse/queries/ (pyproject.toml maps the
    repository's queries/ there); in a checkout, editable install or not, the repository's queries/."""
    packaged = importlib.resources.files(__package__) / "queries"
    if packaged.is_dir():  # a wheel unpacks into site-packages: a real directory
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "queries"


QUERIES_DIR = _queries_dir()
BASE_VIEWS = (*schema.TABLES, "runs")


@dataclass(frozen=True)
class Metric:
    name: str
    path: Path
    inputs: tuple[str, ...]
    columns: tuple[str, ...]
    body: str


def _header(text: str, field: str, path: Path) -> str:
    m = re.search(rf"^--\s*{field}:\s*(.*)$", text, re.MULTILINE)
    if not m:
        raise ValueError(f"{path}: header lacks '-- {field}:'")
    return m.group(1).strip()


def views_reference(directory: Path = QUERIES_DIR) -> str:
    """docs/views.md: every view's description, formula, inputs and columns, from the headers of
    `queries/*.sql` (regenerate with `python scripts/views_doc.py`; a test keeps it current)."""
    out = ["# Views", "",
           "Generated from the headers of `queries/*.sql` by `python scripts/views_doc.py`; do not edit by hand.",
           "Every view is keyed by model, checkpoint and step; most by source (`'all'`: the merge) and layer.",
           "Base tables (the Parquet files, one view each): " + ", ".join(f"`{t}`" for t in BASE_VIEWS) + ".", ""]
    for m in sorted(load_metrics(directory), key=lambda m: m.name):
        text = m.path.read_text()
        about = re.search(rf"^--\s*{re.escape(m.name)}:\s*(.*)$", text, re.MULTILINE)
        out += [f"## `{m.name}`", "", about.group(1).strip() if about else "", "",
                f"- **Formula**: {_header(text, 'Formula', m.path)}",
                f"- **Inputs**: {', '.join(f'`{i}`' for i in m.inputs)}",
                f"- **Columns**: {', '.join(f'`{c}`' for c in m.columns)}", ""]
    return "\n".join(out)


def load_metrics(directory: Path = QUERIES_DIR) -> list[Metric]:
    """The metric views, in an order where every view comes after its inputs."""
    metrics = {}
    for path in sorted(directory.glob("*.sql")):
        text = path.read_text()
        split = lambda s: tuple(x.strip() for x in s.split(",") if x.strip())  # noqa: E731
        body = "\n".join(line for line in text.splitlines() if not line.startswith("--")).strip()
        metrics[path.stem] = Metric(
            path.stem, path, split(_header(text, "Inputs", path)),
            split(_header(text, "Columns", path)), body.rstrip(";"),
        )
    ordered, done = [], set(BASE_VIEWS)
    while len(ordered) < len(metrics):
        ready = [m for m in metrics.values() if m.name not in done and set(m.inputs) <= done]
        if not ready:
            missing = {m.name: set(m.inputs) - done for m in metrics.values() if m.name not in done}
            raise ValueError(f"queries/ has unknown or cyclic inputs: {missing}")
        for m in ready:
            ordered.append(m)
            done.add(m.name)
    return ordered


def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


_WIDTHS = {"float16": 0, "float32": 1, "float64": 2}


def _stored_dtype(entry: dict) -> str:
    """The dtype of an entry's token vectors: --vector-dtype, float32 where float16 would overflow
    (the entry's stats say what was stored)."""
    return entry.get("stats", {}).get("vector_dtype") or entry.get("settings", {}).get("vector_dtype") or "float32"


def _files(table: str, entries: list[dict]) -> list[str]:
    """The table's files, sorted, except that for token_sums a file of the widest vector dtype comes
    first: DuckDB binds a list of Parquet files by the first file's schema alone (reading one footer,
    whatever the number of partials) and casts the others to it, so the first must be the widest
    (float16 and float32 → float64 are exact).  `union_by_name` would read every footer when the
    views are created (+0.4 s at 512 tiny partials, more with a large model's footers)."""
    files = sorted(e["files"][table] for e in entries)
    if table == "token_sums" and files:
        widest = max(entries, key=lambda e: (_WIDTHS.get(_stored_dtype(e), 1), e["files"][table]))["files"][table]
        files.remove(widest)
        files.insert(0, widest)
    return files


def _vector_schema(table: str, arrow_schema, entries: list[dict]):
    """token_sums' vec is float16/32/64 by --vector-dtype: the widest the files hold."""
    if table != "token_sums":
        return arrow_schema
    widest = max((_stored_dtype(e) for e in entries), key=_WIDTHS.get)
    i = arrow_schema.get_field_index("vec")
    return arrow_schema.set(i, arrow_schema.field(i).with_type(schema.vector_type(widest)))


def base_view_sql(root, manifest: dict, con: duckdb.DuckDBPyConnection | None = None) -> list[str]:
    """CREATE VIEW statements of the base tables over the files the manifest lists.  Local files and
    views.sql: read_parquet of the paths / s3:// URLs.  With `con` and a warehouse on S3: each table
    is a pyarrow dataset over the S3 filesystem, registered in `con` (no DuckDB extension needed)."""
    st = open_storage(root)
    via_arrow = con is not None and not st.local
    statements = []
    for table, arrow_schema in schema.TABLES.items():
        entries = [e for e in manifest["entries"].values() if table in e["files"]]
        files = _files(table, entries)
        cols = ", ".join(f'"{f.name}"' for f in arrow_schema)
        if files and via_arrow:  # paths and schema given: no file is opened or listed until a query reads it
            con.register(f"_files_{table}", ds.FileSystemDataset.from_paths(
                [st.path(f) for f in files], schema=_vector_schema(table, arrow_schema, entries),
                format=ds.ParquetFileFormat(), filesystem=st.fs))
            src = f"SELECT {cols} FROM _files_{table}"
        elif files:
            file_list = "[" + ", ".join(_sql_str(st.uri(f)) for f in files) + "]"
            src = f"SELECT {cols} FROM read_parquet({file_list}, hive_partitioning = false)"
        else:
            src = "SELECT " + ", ".join(
                f'CAST(NULL AS {schema.duckdb_type(f.type)}) AS "{f.name}"' for f in arrow_schema
            ) + " WHERE false"
        statements.append(f"CREATE OR REPLACE VIEW {table} AS {src};")
    if con is not None:  # a Python connection: the runs of this very manifest, in memory
        con.register("_runs", store.runs_table(manifest))
        statements.append("CREATE OR REPLACE VIEW runs AS SELECT * FROM _runs;")
    elif manifest["entries"]:
        statements.append(
            f"CREATE OR REPLACE VIEW runs AS SELECT * FROM read_parquet({_sql_str(st.uri(store.RUNS_FILE))});")
    else:
        statements.append(
            "CREATE OR REPLACE VIEW runs AS SELECT " + ", ".join(
                f"CAST(NULL AS {schema.duckdb_type(f.type)}) AS {f.name}" for f in schema.RUNS
            ) + " WHERE false;"
        )
    return statements


def all_view_sql(root, manifest: dict, con: duckdb.DuckDBPyConnection | None = None) -> list[str]:
    return base_view_sql(root, manifest, con) + [
        f"CREATE OR REPLACE VIEW {m.name} AS\n{m.body};" for m in load_metrics()
    ]


def companions_current(root, manifest: dict) -> bool:
    """views.sql, runs.parquet and manifest.json all written from the latest record (two writers'
    companion writes may land in either order: the older one is then rewritten here)."""
    if not manifest["entries"]:
        return True
    st = open_storage(root)
    gen = manifest.get("generation", 0)
    tag = views_tag(manifest).encode()  # views.sql's first line: read only that much
    return (st.exists(store.VIEWS_FILE) and st.read_bytes(store.VIEWS_FILE, len(tag)) == tag
            and store.companion_generations(st) == (gen, gen))


def refresh_companions(root, strict: bool = True) -> dict:
    """Rewrite manifest.json, runs.parquet and views.sql if they are behind the commit log (a process
    died between the record and them, or two writers' companions landed out of order); returns the
    current manifest.  strict=False (queries): a warehouse the user may only read (read-only keys, a
    read-only mount) is queried without rewriting them — they are caches, the log is the state."""
    root = open_storage(root)
    manifest = store.read_manifest(root)
    if not companions_current(root, manifest):  # no lock: each file is replaced atomically
        try:
            store.write_companions(root, manifest)
            write_views_file(root, manifest)
        except (OSError, UserError):
            if strict:
                raise
    return manifest


def views_tag(manifest: dict) -> str:
    """views.sql's first line: the manifest generation it was written from and a digest of the
    queries/*.sql it was made of, so that a changed view definition (a new version of this tool)
    rewrites it as a new commit does."""
    import hashlib

    h = hashlib.blake2b(digest_size=8)
    for path in sorted(QUERIES_DIR.glob("*.sql")):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return store.generation_tag(manifest).rstrip("\n") + f" queries {h.hexdigest()}\n"


def write_views_file(root, manifest: dict | None = None) -> str:
    """The init file for the DuckDB shell: `duckdb -init WAREHOUSE/views.sql`.  For a warehouse on
    S3 it names s3:// URLs, which the shell reads with its httpfs extension (see docs/scale-out.md)."""
    st = open_storage(root)
    manifest = manifest if manifest is not None else store.read_manifest(st)
    how = ("duckdb -init " + st.uri(store.VIEWS_FILE) if st.local else
           "duckdb (with httpfs and an S3 secret; see docs/scale-out.md), then .read " + st.uri(store.VIEWS_FILE) +
           " -- or `python cli.py pull` for a local copy")
    text = (
        views_tag(manifest)
        + "-- Views over this warehouse, regenerated at every commit (python cli.py views rewrites it).\n"
        "-- Open with:  " + how + "\n"
        + "\n".join(all_view_sql(st, manifest)) + "\n"
    )
    store.atomic_write_bytes(st, store.VIEWS_FILE, text.encode())
    return st.display(store.VIEWS_FILE)


class PendingPartials(UserWarning):
    """Partials committed without a fold (`extract --no-fold`, a sweep's checkpoint still running): the
    views hold every group's folded partials exactly, and not these until `cli.py merge` folds them."""


def pending_line(manifest: dict) -> str | None:
    """One line saying which partials the views do not count yet (None: every partial is folded)."""
    todo = {merge.partial_id(e): e for group in merge.pending(manifest).values() for e in group}
    if not todo:
        return None
    pairs = sorted({f"{e['model']}@{e['checkpoint']}" for e in todo.values()})
    where = ", ".join(pairs[:3]) + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")
    return (f"{len(todo)} committed partial(s) of {where} are not folded into the views yet "
            "(`python cli.py merge` folds them; view runs: folded = false)")


def connect(root=DEFAULT_WAREHOUSE) -> "ReadOnlyConnection":
    """An in-memory DuckDB connection with every view of the warehouse at `root` (a directory or
    s3://bucket/prefix), read-only: locked (`read_only`) and every statement checked
    (`ReadOnlyConnection`).  Use it as a DuckDBPyConnection: `connect(wh).execute(q).pl()`.  Partials
    committed but not folded yet are not in the views: a `PendingPartials` warning says so."""
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
    con = duckdb.connect()
    try:
        for stmt in all_view_sql(root, manifest, con):
            con.execute(stmt)
    except duckdb.Error as e:
        con.close()
        raise UserError(duckdb_error_line(e)) from None
    read_only(con, _listed_paths(root, manifest))
    return ReadOnlyConnection(con)


# ---------------------------------------------------------------- verified before the views read it

def verify_listed(root, manifest: dict) -> int:
    """Verify every local file the views read — each file the manifest lists that has a recorded
    checksum — against its commit record (size and blake2b), but each file version only once: a
    verified file is remembered in the warehouse's own cache (store.verified_cache_file) by absolute
    path, size, mtime_ns, ctime_ns, inode and recorded hash, so a later connect only stat()s it, and after a commit hashes
    only the new files.  A file whose bytes changed is re-hashed; if they differ from the record,
    one UserError line names it and how to repair it (merge.repair_hint).  A cache that cannot be
    read or written means hashing every time: slower, never wrong.  Files of records written before
    checksums existed are skipped.  A warehouse on S3 is not verified here (a listing for sizes and
    times would cost every start-up): `validate` and the store's own integrity checks cover it.
    Returns the number of files hashed."""
    st = open_storage(root)
    if not st.local:
        return 0
    cache, lines = store.read_verified_cache(st)
    hashed, current, new = 0, {}, {}
    for e in manifest["entries"].values():
        sums = e.get("checksums") or {}
        for rel in e["files"].values():
            want = sums.get(rel)
            if not want:
                continue
            path = os.path.abspath(st.path(rel))
            key = store.file_key(path, want)
            if key is None or cache.get(path) != key:
                try:
                    storage.verify(st, rel, want, merge.repair_hint(e))
                except storage.MissingFile:
                    raise UserError(f"{st.display(rel)}: listed in the manifest but missing; "
                                    f"{merge.repair_hint(e)}") from None
                hashed += 1
                if store.file_key(path, want) != key:  # changed while it was hashed: hashed again next time
                    continue
                new[path] = key
            current[path] = key
    if lines > 2 * len(current) + 1000:  # replaced files' lines piled up: keep the listed ones only
        store.rewrite_verified(st, current)
    else:
        store.append_verified(st, new)
    return hashed


def duckdb_error_line(e: Exception) -> str:
    """A DuckDB error as one line; a file the manifest lists but that is gone is named as such."""
    text = " ".join(str(e).split())
    m = re.search(r'No files found that match the pattern "([^"]+)"', text)
    if m:
        return f"{m.group(1)}: listed in the manifest but missing (run `python cli.py validate`)"
    return text[:400]


# ---------------------------------------------------------------- read-only connections

READ_ONLY_SETTINGS = (  # set after the views are bound, in this order; lock_configuration last
    "SET autoinstall_known_extensions = false", "SET autoload_known_extensions = false",
    "SET allow_community_extensions = false", "SET allow_persistent_secrets = false",
    "SET enable_external_access = false", "SET lock_configuration = true")


def _listed_paths(root, manifest: dict) -> list[str]:
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
        con.execute("SET allowed_paths = [" + ", ".join(_sql_str(p) for p in paths) + "]")
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


def sql(query: str, warehouse: str | Path = DEFAULT_WAREHOUSE):
    """Run `query` against the warehouse's views and return a Polars DataFrame.

    Example: sql("SELECT * FROM inter_sim ORDER BY model, layer", "warehouse")
    """
    check_read_only(query)
    con = connect(warehouse)
    try:
        return con.sql(query).pl()
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
