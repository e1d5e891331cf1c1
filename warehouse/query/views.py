"""The views' SQL: base views (one per table of schema.py, and `runs`) that read exactly the Parquet
files the manifest lists, so files of unfinished or replaced runs are never seen, and metric views
from `queries/*.sql`.  The metric views read only the merged tables (warehouse.merge), never the
per-partial ones, so their cost does not grow with the number of partials.  Each metric is one
`.sql` file in `queries/` whose header says

    -- <name>: <one line>
    -- Formula: ...
    -- Inputs: view, view, ...
    -- Columns: col, col, ...

and whose body is one SELECT; it becomes `CREATE VIEW <name> AS <body>`.
"""

from __future__ import annotations

import importlib.resources
import re
from dataclasses import dataclass
from pathlib import Path

import duckdb
import pyarrow.dataset as ds

from common.errors import UserError

from .. import schema, store
from ..storage import open_storage
from ..store import Entry, Manifest


def _queries_dir() -> Path:
    """queries/*.sql: in an installed wheel the package data warehouse/queries/ (pyproject.toml maps the
    repository's queries/ there); in a checkout, editable install or not, the repository's queries/."""
    packaged = importlib.resources.files("warehouse") / "queries"
    if packaged.is_dir():  # a wheel unpacks into site-packages: a real directory
        return Path(str(packaged))
    return Path(__file__).resolve().parents[2] / "queries"


QUERIES_DIR = _queries_dir()
BASE_VIEWS = (*schema.TABLES, "runs")


@dataclass(frozen=True)
class Metric:
    """One metric view of queries/: its name, file, input views, columns and SELECT body."""
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


_METRICS: dict[Path, tuple[tuple, list[Metric]]] = {}  # directory → (its .sql files' versions, their metrics)


def load_metrics(directory: Path = QUERIES_DIR) -> list[Metric]:
    """The metric views, in an order where every view comes after its inputs (parsed again only when
    a file of `directory` was added, removed or changed: every connect() asks)."""
    paths = sorted(directory.glob("*.sql"))
    stamp = tuple((p.name, s.st_mtime_ns, s.st_size, s.st_ino) for p in paths for s in [p.stat()])
    cached = _METRICS.get(directory)
    if cached is not None and cached[0] == stamp:
        return list(cached[1])
    ordered = _parse_metrics(paths)
    _METRICS[directory] = (stamp, ordered)
    return list(ordered)


def _parse_metrics(paths: list[Path]) -> list[Metric]:
    metrics = {}
    for path in paths:
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


def sql_literal(s: str) -> str:
    """`s` as an SQL string literal."""
    return "'" + s.replace("'", "''") + "'"


_GLOB_CHAR = re.compile(r"([*?\[])")
_ESCAPED_CHAR = re.compile(r"\[([*?\[])\]")


def glob_escaped(path: str) -> str:
    """`path` as a pattern that matches exactly itself.  DuckDB's file readers expand `*`, `?` and
    `[…]` in every path they are given, a list's items included (a warehouse under `run*/` would also
    read `run-backup/`), and take no escape character; a one-character class matches that character
    only, so each becomes `[*]`, `[?]`, `[[]` (`]`, `{`, `}`, `\\`, quotes and spaces are literal)."""
    return _GLOB_CHAR.sub(r"[\1]", path)


def glob_unescaped(pattern: str) -> str:
    """The path `glob_escaped` made `pattern` of (for messages)."""
    return _ESCAPED_CHAR.sub(r"\1", pattern)


def file_literal(uri: str) -> str:
    """A file's path or URL as the SQL literal a DuckDB reader takes to mean that file alone."""
    return sql_literal(glob_escaped(uri))


_WIDTHS = {"float16": 0, "float32": 1, "float64": 2}


def _stored_dtype(entry: Entry) -> str:
    """The dtype of an entry's token vectors: --vector-dtype, float32 where float16 would overflow
    (the entry's stats say what was stored)."""
    return entry.get("stats", {}).get("vector_dtype") or entry.get("settings", {}).get("vector_dtype") or "float32"


def bound_files(table: str, entries: list[Entry]) -> list[str]:
    """The table's files, sorted, except that for token_sums a file of the widest vector dtype comes
    first: DuckDB binds a list of Parquet files by the first file's schema alone (reading one footer,
    whatever the number of partials) and casts the others to it, so the first must be the widest
    (float16 and float32 → float64 are exact).  `union_by_name` would read every footer when the
    views are created (a cost that grows with the number of partials and the model's size)."""
    files = sorted(e["files"][table] for e in entries)
    if table == "token_sums" and files:
        widest = max(entries, key=lambda e: (_WIDTHS.get(_stored_dtype(e), 1), e["files"][table]))["files"][table]
        files.remove(widest)
        files.insert(0, widest)
    return files


def _vector_schema(table: str, arrow_schema, entries: list[Entry]):
    """token_sums' vec is float16/32/64 by --vector-dtype: the widest the files hold."""
    if table != "token_sums":
        return arrow_schema
    widest = max((_stored_dtype(e) for e in entries), key=_WIDTHS.get)
    i = arrow_schema.get_field_index("vec")
    return arrow_schema.set(i, arrow_schema.field(i).with_type(schema.vector_type(widest)))


def create_view(name: str, defer: bool) -> str:
    """The head of a view's CREATE statement, up to AS.  `defer`: DuckDB (2.0 on) binds the view when a query
    reads it rather than when it is created — a query binds every view it reads in any case, and binding at
    creation as well would read each base table's Parquet metadata and expand every metric's inputs again,
    for views most connections never read."""
    return f"CREATE OR REPLACE VIEW {name}{' WITH (DEFER_BINDING)' if defer else ''} AS"


def base_view_sql(root, manifest: Manifest, con: duckdb.DuckDBPyConnection | None = None,
                  only: set[str] | None = None, defer: bool = False) -> list[str]:
    """CREATE VIEW statements of the base tables over the files the manifest lists (`only`: of those
    tables alone; `defer`: see `create_view`).  Local files and views.sql: read_parquet of the paths / s3:// URLs, glob characters
    escaped (`file_literal`).  With `con` and a warehouse on S3: each table is a pyarrow dataset over
    the S3 filesystem, registered in `con` (no DuckDB extension needed)."""
    st = open_storage(root)
    via_arrow = con is not None and not st.local
    statements = []
    for table, arrow_schema in schema.TABLES.items():
        if only is not None and table not in only:
            continue
        entries = [e for e in manifest["entries"].values() if table in e["files"]]
        files = bound_files(table, entries)
        cols = ", ".join(f'"{f.name}"' for f in arrow_schema)
        if files and via_arrow:  # paths and schema given: no file is opened or listed until a query reads it
            # (with the sizes their records give, a scan asks the store for no object's size: no HEAD)
            sizes = {rel: c.get("size") for e in entries for rel, c in (e.get("checksums") or {}).items()}
            fmt = ds.ParquetFileFormat()
            con.register(f"_files_{table}", ds.FileSystemDataset(
                [fmt.make_fragment(st.path(f), filesystem=st.fs, file_size=sizes.get(f)) for f in files],
                schema=_vector_schema(table, arrow_schema, entries), format=fmt, filesystem=st.fs))
            src = f"SELECT {cols} FROM _files_{table}"
        elif files:
            file_list = "[" + ", ".join(file_literal(st.uri(f)) for f in files) + "]"
            src = f"SELECT {cols} FROM read_parquet({file_list}, hive_partitioning = false)"
        else:
            src = "SELECT " + ", ".join(
                f'CAST(NULL AS {schema.duckdb_type(f.type)}) AS "{f.name}"' for f in arrow_schema
            ) + " WHERE false"
        statements.append(f"{create_view(table, defer)} {src};")
    if only is None or "runs" in only:
        statements.append(f"{create_view('runs', defer)} {_runs_select(st, manifest, con)};")
    return statements


def _runs_select(st, manifest: Manifest, con) -> str:
    if con is not None:  # a Python connection: the runs of this very manifest, in memory
        con.register("_runs", store.runs_table(manifest))
        return "SELECT * FROM _runs"
    if manifest["entries"]:
        return f"SELECT * FROM read_parquet({file_literal(st.uri(store.RUNS_FILE))})"
    return "SELECT " + ", ".join(
        f"CAST(NULL AS {schema.duckdb_type(f.type)}) AS {f.name}" for f in schema.RUNS) + " WHERE false"


def view_names() -> set[str]:
    """Every view's name: the base tables, `runs` and the metrics of queries/."""
    return set(BASE_VIEWS) | {m.name for m in load_metrics()}


def view_closure(names) -> set[str]:
    """`names` and every view they read, transitively (by the `Inputs:` of the metrics' headers); a name
    that is no view is one UserError line."""
    metrics = {m.name: m for m in load_metrics()}
    names = [n.lower() for n in names]  # DuckDB's names ignore case
    unknown = sorted(set(names) - set(BASE_VIEWS) - metrics.keys())
    if unknown:
        raise UserError(f"no such view: {', '.join(unknown)} (the views: docs/views.md)")
    out, todo = set(), list(names)
    while todo:
        name = todo.pop()
        if name not in out:
            out.add(name)
            todo.extend(metrics[name].inputs if name in metrics else ())
    return out


_CATALOGUE = re.compile(r"\b(show|describe|summarize|pragma\w*|information_schema|pg_\w+|sqlite_\w+|duckdb_\w+)\b",
                        re.IGNORECASE)  # statements and table functions that list or describe the catalogue


def views_read(query: str) -> set[str] | None:
    """The views a SELECT reads when it reads nothing else (parsed, not bound); None when it reads
    a name that is no view, a table function or the catalogue (`SHOW`, `duckdb_views()`, …), or
    nothing at all: such a query needs a connection with every view."""
    if _CATALOGUE.search(query):
        return None
    try:
        names = {n.lower() for n in duckdb.get_table_names(query, qualified=False)}  # (names ignore case)
    except duckdb.Error:
        return None
    known = view_names()
    if not names or not names <= known:
        return None
    # and every view named anywhere in the text: the parser's list misses some places (a subquery inside
    # `* REPLACE (…)`); a name in a string or a comment only binds a view more
    return names | ({w.lower() for w in re.findall(r"\w+", query)} & known)


def all_view_sql(root, manifest: Manifest, con: duckdb.DuckDBPyConnection | None = None,
                 only: set[str] | None = None, defer: bool = False) -> list[str]:
    """Every view's CREATE statement, inputs first; `only`: of those views alone (a `view_closure`, so
    that each view's inputs are among them); `defer`: each bound when a query reads it (`create_view`)."""
    return base_view_sql(root, manifest, con, only, defer) + [
        f"{create_view(m.name, defer)}\n{m.body};" for m in load_metrics() if only is None or m.name in only
    ]
