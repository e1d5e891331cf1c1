"""Text sources: readers for the supported formats, sharding, fingerprints (sentences: sentences.py).

Formats: `.txt` (one document per non-empty line), `.jsonl` / `.jsonl.zst` / `.json.gz` in the
Pile's format (`{"text": ..., "meta": {"pile_set_name": ...}}`), `.parquet` with a `text`
column.  Bytes that are not UTF-8 are replaced (U+FFFD) and the lines counted.

Built-in sources need no file: `stdlib-docs` is every docstring (module, class, function) of
the running Python's standard library, read at run time, one document each.

Hugging Face datasets: `NAME=hf:ID_OR_DIR[:CONFIG][@REVISION]` — a hub id (streamed), a directory
written by `save_to_disk`, or a local dataset directory (data files `load_dataset` reads); one
document per row, from `--text-column` of `--split` (the `datasets` package, imported only here).

One read, many sources: `--split-by FIELD` (a dotted path into a JSON line, a Parquet or dataset
row, e.g. `meta.pile_set_name`) makes each distinct value of the field its own source, named
`NAME.VALUE` (`split_name`), from one read of the file; several `--pile-set` values are the same
split by `meta.pile_set_name`, keeping only those values.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from common import faults
from common.errors import UserError

from .pythia import PythiaBatches, open_batches, parse_steps, training_rows
from .pythia import fingerprint as pythia_fingerprint

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
FORMATS = (".jsonl.zst", ".jsonl", ".json.gz", ".txt", ".parquet")
_SURROGATE = re.compile("[\ud800-\udfff]")  # lone surrogates: what "\ud800" in JSON decodes to


@dataclass(frozen=True)
class HFDataset:
    """A Hugging Face dataset: a hub id or a local directory, with its config, revision, split and
    text column."""
    ref: str
    config: str | None
    revision: str | None
    split: str
    text_column: str

    @property
    def local(self) -> Path | None:
        p = Path(self.ref).expanduser()
        return p if p.is_dir() else None

    def describe(self) -> str:
        return (f"hf:{self.ref}" + (f":{self.config}" if self.config else "") +
                (f"@{self.revision}" if self.revision else "") + f" split {self.split}, column {self.text_column}")


@dataclass
class Source:
    name: str
    path: Path | None  # None for a built-in source or a dataset
    pile_set: str | None = None
    encoding_errors: str = "strict"  # strict (fail) | replace (U+FFFD) | skip (drop the line)
    hf: HFDataset | None = None
    pythia: PythiaBatches | None = None  # pre-tokenised training rows: token ids, no text
    split_by: str | None = None  # a field (dotted path): each of its values is its own source
    split_values: tuple[str, ...] | None = None  # only these values (several --pile-set); None: all
    split_value: str | None = None  # a per-value source of a split: its value (its name is split_name's)

    @property
    def builtin(self) -> bool:
        return self.path is None and self.hf is None and self.pythia is None

    @property
    def pretokenized(self) -> bool:
        return self.pythia is not None

    def describe(self) -> str:
        if self.pythia is not None:
            return self.pythia.describe()
        if self.hf is not None:
            return self.hf.describe()
        return f"built-in {self.name}" if self.builtin else str(self.path)


def stdlib_files(root: Path, skip: set[str]) -> list[Path]:
    """The .py files under root, no directory named in skip on their path, sorted as Paths sort."""
    import os

    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]  # pruned, not walked (site-packages is large)
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def definitions(tree):
    """Module, class and function nodes in `ast.walk`'s breadth-first order, without visiting
    expressions: no expression holds a statement, so leaving their subtrees out changes neither
    the depth nor the relative order of the definitions."""
    import ast
    from collections import deque

    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    blocks = (ast.stmt, ast.excepthandler, ast.match_case)  # the nodes that can hold statements
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        for _, value in ast.iter_fields(node):
            if isinstance(value, list):
                todo.extend(v for v in value if isinstance(v, blocks))
            elif isinstance(value, blocks):
                todo.append(value)
        if isinstance(node, kinds):
            yield node


@functools.lru_cache(maxsize=1)
def stdlib_docstrings() -> tuple[str, ...]:
    """Docstrings of the installed standard library, in a fixed order (sorted files, AST order)."""
    import ast
    import sysconfig

    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    docs = []
    for path in stdlib_files(root, skip):
        try:
            tree = ast.parse(path.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        for node in definitions(tree):
            doc = ast.get_docstring(node)
            if doc and doc.strip():
                docs.append(doc.strip())
    return tuple(docs)


BUILTIN = {"stdlib-docs": stdlib_docstrings}


@dataclass
class ReadStats:
    documents: int = 0  # documents yielded (after the shard and --pile-set filters)
    filtered: int = 0  # documents dropped by --pile-set
    rows: int = 0  # rows read (a split: every row, whatever its value)
    unassigned: int = 0  # a split: rows without the field (no value, so no source)
    value_rows: dict = field(default_factory=dict)  # a split: rows of each value (every shard)
    replaced_lines: int = 0  # lines with bytes that were not UTF-8, replaced
    skipped_lines: int = 0  # lines with bytes that were not UTF-8, dropped


def parse_hf(name: str, body: str, split: str, text_column: str) -> HFDataset:
    """ID_OR_DIR[:CONFIG][@REVISION] after 'hf:' (a local directory is taken whole when it exists)."""
    ref, revision = body, None
    if "@" in ref and not Path(ref).expanduser().is_dir():
        ref, revision = ref.rsplit("@", 1)
    config = None
    if ":" in ref and not Path(ref).expanduser().is_dir():
        ref, config = ref.rsplit(":", 1)
    if not ref or revision == "" or config == "":
        raise UserError(f"--source {name}=hf:{body}: expected hf:ID_OR_DIR[:CONFIG][@REVISION]")
    return HFDataset(ref, config, revision, split, text_column)


PILE_FIELD = "meta.pile_set_name"


def parse_source(spec: str, pile_set: str | list[str] | None = None, encoding_errors: str = "strict",
                 split: str = "train", text_column: str = "text", steps: str | None = None,
                 rows_per_step: int = 1024, seq_length: int = 2049, split_by: str | None = None) -> Source:
    """One --source.  `pile_set`: one value (keep those documents, the source keeps its name) or
    several (a split by meta.pile_set_name keeping those values); `split_by`: a split."""
    src = _parse_source(spec, encoding_errors, split, text_column, steps, rows_per_step, seq_length)
    values = [pile_set] if isinstance(pile_set, str) else list(dict.fromkeys(pile_set or []))
    if len(values) > 1:
        if split_by not in (None, PILE_FIELD):
            raise UserError(f"several --pile-set values split the source by {PILE_FIELD}; with --split-by "
                            f"{split_by} give at most one --pile-set")
        src.split_by, src.split_values = PILE_FIELD, tuple(values)
    else:
        src.pile_set = values[0] if values else None
        src.split_by = split_by
    if src.split_by is not None or src.pile_set is not None:
        check_split(src)
    return src


def check_split(source: Source) -> None:
    """--split-by and --pile-set need rows with fields: JSON lines, Parquet or a dataset (a .txt,
    built-in or pythia: source has none: refused, not silently unfiltered); the field a dotted path."""
    field_ = source.split_by or PILE_FIELD
    if any(not part for part in field_.split(".")):
        raise UserError(f"--split-by {field_!r}: expected a field or a dotted path such as meta.pile_set_name")
    what = "" if source.path is None else str(source.path)
    if source.builtin or source.pythia is not None or what.endswith(".txt"):
        raise UserError(f"--source {source.name}: {source.describe()}: --pile-set and --split-by need rows with "
                        "fields (.jsonl, .jsonl.zst, .json.gz, .parquet or hf:)")
    top = field_.split(".")[0]
    if what.endswith(".parquet"):
        names = _parquet_columns(source.path)
        if top not in names:
            raise UserError(f"--split-by {field_}: {source.path} has no column {top!r} (columns: {', '.join(names)})")
    if source.hf is not None:
        names = _hf_open(source).column_names
        if names is not None and top not in names:
            raise UserError(f"--split-by {field_}: {source.describe()} has no column {top!r} (columns: "
                            f"{', '.join(names)})")


def field_value(row, path: str) -> str | None:
    """The value at a dotted path of a row (nested dicts), as text: strings as they are, numbers and
    booleans as JSON writes them; None when absent or null."""
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    if value is None:
        return None
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, ensure_ascii=False)


SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")


def split_name(prefix: str, value: str) -> str:
    """The source name of one value of a split: `PREFIX.VALUE` with each run of characters a name
    cannot hold (spaces, parentheses, slashes, …) turned into one '_', leading and trailing '.', '_'
    and '-' dropped (`blank` when nothing is left), cut to 64 characters.  The same value always gets
    the same name (shards and machines agree); two values of one read that get the same name stop
    the run (`accumulate_split`).  The value itself is in each run's settings (`split_value`)."""
    slug = SLUG_RE.sub("_", value).strip("._-") or "blank"
    return f"{prefix}.{slug}"[:64].rstrip("._-")


def split_source(parent: Source, value: str) -> Source:
    """The source of one value of a split: the parent's file and filters, its own name."""
    return Source(split_name(parent.name, value), parent.path, parent.pile_set, parent.encoding_errors, parent.hf,
                  parent.pythia, parent.split_by, None, value)


def _parquet_columns(path: Path) -> list[str]:
    import pyarrow.parquet as pq

    try:
        return list(pq.ParquetFile(path).schema_arrow.names)
    except Exception as e:  # pyarrow raises several types for a bad file
        raise UserError(f"{path}: not a readable Parquet file ({e})") from None


def _parse_source(spec: str, encoding_errors: str = "strict", split: str = "train", text_column: str = "text",
                  steps: str | None = None, rows_per_step: int = 1024, seq_length: int = 2049) -> Source:
    if encoding_errors not in ("strict", "replace", "skip"):
        raise UserError(f"--encoding-errors {encoding_errors!r}: expected strict, replace or skip")
    if spec in BUILTIN:
        return Source(spec, None)
    if "=" not in spec:
        raise UserError(f"--source {spec!r}: expected NAME=PATH or a built-in source ({', '.join(BUILTIN)})")
    name, path = spec.split("=", 1)
    if not NAME_RE.match(name) or name == "all":
        raise UserError(
            f"--source {spec!r}: NAME must be 1-64 letters, digits, '.', '_' or '-' (not starting with "
            "'.' or '-', and not 'all')"
        )
    if path.startswith("pythia:"):
        if rows_per_step < 1 or seq_length < 2:
            raise UserError("--rows-per-step must be ≥ 1 and --seq-length ≥ 2")
        batches = PythiaBatches(path[len("pythia:"):], parse_steps(steps), rows_per_step, seq_length)
        open_batches(batches, f"--source {name}")  # a bad header or step range fails here
        return Source(name, None, None, encoding_errors, pythia=batches)
    if path.startswith("hf:"):
        src = Source(name, None, None, encoding_errors, parse_hf(name, path[3:], split, text_column))
        _hf_open(src)  # a wrong id, split or column fails here, before any model is loaded
        return src
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"--source {name}: {path}: no such file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise UserError(f"--source {name}: {path}: cannot read ({e.strerror})") from None
    if not str(p).endswith(FORMATS):
        raise UserError(f"--source {name}: {path}: unsupported format (use {', '.join(FORMATS)})")
    return Source(name, p, None, encoding_errors)


def fingerprint(source: Source) -> str:
    """blake2b of the file's bytes, of a built-in source's documents, or of a local dataset
    directory's files (names and bytes); a hub dataset: its id, config, split, column and the
    revision (the commit the hub resolves it to when the hub can be reached)."""
    if source.pythia is not None:
        return pythia_fingerprint(source.pythia, f"--source {source.name}")
    h = hashlib.blake2b(digest_size=16)
    if source.hf is not None:
        hf = source.hf
        if hf.local is None:
            return f"{hf.describe()} commit {_hub_commit(hf)}"
        for f in sorted(p for p in hf.local.rglob("*") if p.is_file()):
            h.update(str(f.relative_to(hf.local)).encode() + b"\0")
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 22), b""):
                    h.update(chunk)
        h.update(f"{hf.config}|{hf.split}|{hf.text_column}".encode())
        return h.hexdigest()
    if source.builtin:
        for doc in BUILTIN[source.name]():
            h.update(doc.encode())
            h.update(b"\0")
        return h.hexdigest()
    with open(source.path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _decode(raw: bytes, stats: ReadStats, source: Source, lineno: int) -> str | None:
    """The line as text; None when it is to be skipped."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if source.encoding_errors == "replace":
            stats.replaced_lines += 1
            return raw.decode("utf-8", errors="replace")
        if source.encoding_errors == "skip":
            stats.skipped_lines += 1
            return None
        raise UserError(f"{source.path}:{lineno}: bytes that are not UTF-8 ({e.reason} at byte {e.start}); "
                        "use --encoding-errors replace or skip") from None


def _zstd_lines(path: Path) -> Iterator[bytes]:
    """Lines of a (multi-frame) zstd file; a stream that ends inside a frame is an error."""
    import zstandard

    dobj, pending, ended = zstandard.ZstdDecompressor().decompressobj(), b"", True
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            while chunk:
                try:
                    out = dobj.decompress(chunk)
                except zstandard.ZstdError as e:
                    raise UserError(f"{path}: corrupt zstd stream ({e})") from None
                ended = dobj.eof
                chunk = dobj.unused_data if ended else b""
                if ended:
                    dobj = zstandard.ZstdDecompressor().decompressobj()
                pending += out
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    yield line + b"\n"
    if not ended:
        raise UserError(f"{path}: truncated zstd stream (the file ends inside a frame)")
    if pending:
        yield pending


def _binary_lines(path: Path) -> Iterator[bytes]:
    name = str(path)
    if name.endswith(".zst"):
        yield from _zstd_lines(path)
    elif name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            try:
                yield from f
            except (OSError, EOFError) as e:
                raise UserError(f"{path}: corrupt or truncated gzip stream ({e})") from None
    else:
        with open(path, "rb") as f:
            yield from f


def _hub_commit(hf: HFDataset) -> str:
    try:
        from huggingface_hub import HfApi

        return HfApi().dataset_info(hf.ref, revision=hf.revision).sha or "unknown"
    except Exception:  # offline, or no such dataset on the hub: recorded as such  # noqa: BLE001
        return "unresolved"


def _hf_rows(source: Source) -> Iterator[dict]:
    """The rows of a dataset source's split (streamed from the hub, or read from disk)."""
    yield from _hf_open(source)


def _hf_open(source: Source):
    """The dataset source's split, its text column checked where the dataset names its columns;
    every failure is one line (a UserError)."""
    hf = source.hf
    try:
        import datasets
    except ImportError:
        raise UserError(f"--source {source.name}=hf:…: needs the `datasets` package (pip install datasets)") from None
    where = f"--source {source.name}={hf.describe()}"
    try:
        if hf.local is not None and any((hf.local / f).exists() for f in ("state.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(str(hf.local))  # written by save_to_disk
            if isinstance(ds, datasets.DatasetDict):
                if hf.split not in ds:
                    raise UserError(f"{where}: no split {hf.split!r} (splits: {', '.join(ds)})")
                ds = ds[hf.split]
        else:  # a hub id (streamed) or a directory of data files
            ds = datasets.load_dataset(str(hf.local or hf.ref), hf.config, split=hf.split, revision=hf.revision,
                                       streaming=True)
        names = ds.column_names
        if names is not None and hf.text_column not in names:
            raise UserError(f"{where}: no column {hf.text_column!r} (columns: {', '.join(names)}); use --text-column")
        return ds
    except UserError:
        raise
    except Exception as e:  # datasets raises many types (not found, bad split, offline hub)  # noqa: BLE001
        raise UserError(f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}") from None


def _row_document(source: Source, row: dict, text, split: str | None, stats: ReadStats):
    """A row with fields (a JSON line, a Parquet or dataset row) as `_raw_documents` yields it: None
    (with a split, (None, None)) when --pile-set drops it, so it keeps its document index; else its
    text ("" when not a string), with a split paired with the row's value of the field."""
    if source.pile_set is not None and field_value(row, PILE_FIELD) != source.pile_set:
        stats.filtered += 1
        return None if split is None else (None, None)
    text = text if isinstance(text, str) else ""
    return text if split is None else (text, field_value(row, split))


def _raw_documents(source: Source, stats: ReadStats, split: str | None = None) -> Iterator:
    """Each document's text — or, for a pre-tokenised source, its token ids (int64); None for a
    document --pile-set drops (it keeps its index).  With `split` (a field), (text or None, the
    row's value of the field or None) instead."""
    if source.pythia is not None:
        yield from training_rows(source.pythia, f"--source {source.name}")
        return
    if source.hf is not None:
        col = source.hf.text_column
        for row in _hf_rows(source):
            if col not in row:
                raise UserError(f"--source {source.name}: a row has no column {col!r} (columns: {', '.join(row)})")
            if row[col] is not None and not isinstance(row[col], str):
                raise UserError(f"--source {source.name}: column {col!r} holds {type(row[col]).__name__} values, "
                                "not text; name the text column with --text-column")
            yield _row_document(source, row, row[col], split, stats)
        return
    if source.builtin:
        yield from BUILTIN[source.name]()
        return
    path = source.path
    name = str(path)
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for a bad file
            raise UserError(f"{path}: not a readable Parquet file ({e})") from None
        if "text" not in pf.schema_arrow.names:
            raise UserError(f"{path}: Parquet file has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
        kind = pf.schema_arrow.field("text").type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_null(kind)):
            raise UserError(f"{path}: Parquet column 'text' holds {kind}, not text")
        fields = [f for f in (split, PILE_FIELD if source.pile_set is not None else None) if f]
        columns = list(dict.fromkeys(["text", *(f.split(".")[0] for f in fields)]))
        try:
            for batch in pf.iter_batches(columns=columns):
                if fields:  # rows as dicts: nested (struct) fields by their dotted paths
                    for row in batch.to_pylist():
                        yield _row_document(source, row, row["text"], split, stats)
                    continue
                for text in batch.column(0).to_pylist():
                    yield text if isinstance(text, str) else ""
        except (pa.ArrowException, OSError) as e:
            raise UserError(f"{path}: unreadable Parquet data ({str(e)[:200]})") from None
        return
    if name.endswith(".txt"):
        for lineno, raw in enumerate(_binary_lines(path), 1):
            text = _decode(raw, stats, source, lineno)
            if text and text.strip():
                yield text.strip()
        return
    for lineno, raw in enumerate(_binary_lines(path), 1):  # JSON lines
        if not raw.strip():
            continue
        line = _decode(raw, stats, source, lineno)
        if line is None:
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise UserError(f"{path}:{lineno}: malformed JSON line ({str(e)[:200]})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise UserError(f"{path}:{lineno}: JSON line has no string field 'text'")
        text = obj["text"]
        if not text.isascii() and _SURROGATE.search(text):  # "\ud800": valid JSON, not text a tokenizer takes
            if source.encoding_errors == "skip":
                stats.skipped_lines += 1
                continue
            if source.encoding_errors != "replace":
                raise UserError(f"{path}:{lineno}: the text holds an unpaired surrogate escape (such as \\ud800), "
                                "which is not Unicode text; use --encoding-errors replace or skip")
            stats.replaced_lines += 1
            text = _SURROGATE.sub("\ufffd", text)
        yield _row_document(source, obj, text, split, stats)


def indexed_documents(source: Source, shard: tuple[int, int], stats: ReadStats) -> Iterator[tuple[int, str]]:
    """(index in the source, text) of the documents of shard I of N (index mod N == I − 1)."""
    i, n = shard
    for index, text in enumerate(_raw_documents(source, stats)):
        faults.hit("read")
        if index % n != i - 1 or text is None:
            continue
        stats.documents += 1
        yield index, text


def split_documents(source: Source, shard: tuple[int, int], stats: ReadStats
                    ) -> Iterator[tuple[int, str, str]]:
    """(index in the source, value of the split field, text) of the documents of shard I of N, in
    one read; each document has the index a filtered run of its value gives it (rows of other
    values, rows without the field and rows --pile-set drops keep their place)."""
    i, n = shard
    keep = None if source.split_values is None else set(source.split_values)
    for index, (text, value) in enumerate(_raw_documents(source, stats, source.split_by)):
        faults.hit("read")
        stats.rows += 1
        if text is None:  # --pile-set
            continue
        if value is None:
            stats.unassigned += 1
            continue
        stats.value_rows[value] = stats.value_rows.get(value, 0) + 1
        if index % n != i - 1 or (keep is not None and value not in keep):
            continue
        yield index, value, text


def documents(source: Source, shard: tuple[int, int], stats: ReadStats) -> Iterator[str]:
    """The source's documents that belong to shard I of N."""
    for _, text in indexed_documents(source, shard, stats):
        yield text


def position_keys(salt: int, doc: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """A 63-bit hash of (source, document, position) per token (splitmix64): the order in which
    tokens enter the bottom-k sample, the same whatever the shard or batch they come in."""
    with np.errstate(over="ignore"):
        z = (np.uint64(salt) ^ (doc.astype(np.uint64) << np.uint64(24)) ^ pos.astype(np.uint64))
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(1)).astype(np.int64)


def source_salt(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def parse_shard(spec: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", spec.strip())
    if not m or not (1 <= int(m.group(1)) <= int(m.group(2))):
        raise UserError(f"--shard {spec!r}: expected I/N with 1 ≤ I ≤ N (e.g. 1/4)")
    return int(m.group(1)), int(m.group(2))
