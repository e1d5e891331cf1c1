"""The extract command: model × checkpoints × sources → sums in the warehouse.

For each checkpoint: load the model, compute its parameter tables, then for each source
stream batches through the model with hooks that fold every layer into `TokenSums`, write
the sums, and commit the checkpoint's entries (params + every source) to the manifest in one
atomic step.  Nothing of a checkpoint is visible until all of its sources have finished.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from warehouse import schema, store

from . import faults
from .accumulate import Moments, Sample, TokenSums
from .architectures import get_module
from .errors import UserError
from .hooks import capture_layers, layer_kinds
from .models import DTYPES, Loaded, ModelRef, check_dtype, load
from .params import norm_table, partition_table, vocab_table
from .sources import ReadStats, SentenceSplitter, Source, fingerprint, indexed_documents, position_keys, source_salt


@dataclass
class Settings:
    unit: str = "document"  # document | sentence
    max_length: int | None = None  # default: the model's context
    max_tokens: int | None = None  # per source (and shard)
    batch_size: int = 8
    device: str = "cpu"
    dtype: str = "float32"
    shard: tuple[int, int] = (1, 1)
    vector_dtype: str = "float32"
    trust_remote_code: bool = False
    params_only: bool = False
    accumulator_device: str | None = None
    skip_done: bool = False  # keep finished (checkpoint, source, shard) runs with the same settings
    moments: bool = False  # Σh, Σhhᵀ per layer and Σ h_l h_{l+1}ᵀ (issue: peers' metrics)
    sample: int = 0  # K: bottom-k sample of token vectors per layer (0 = none)


# Settings that change a run's numbers: a finished run with the same ones can be kept (--skip-done).
RESULT_SETTINGS = ("unit", "max_length", "max_tokens", "dtype", "shard", "vector_dtype", "pile_set", "moments", "sample")


@dataclass
class SourceResult:
    source: str
    tokens: int = 0
    documents: int = 0
    skipped: int = 0  # documents with no token
    windows: int = 0
    nonfinite: int = 0
    zero: int = 0
    replaced_lines: int = 0
    skipped_lines: int = 0
    filtered: int = 0
    seconds: float = 0.0
    files: dict = field(default_factory=dict)


# ---------------------------------------------------------------- provenance


def git_hash() -> str:
    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev + ("-dirty" if dirty else "")) if rev else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def package_versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "tokenizers", "pyarrow", "duckdb", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


# ---------------------------------------------------------------- token windows


def windows(loaded: Loaded, texts: Iterator[tuple[int, str]], settings: Settings, result: SourceResult,
            splitter: SentenceSplitter | None) -> Iterator[tuple[list[int], int, int]]:
    """Token windows (ids, document index, position of the first token in the document's token
    stream): documents or sentences, cut into --max-length pieces."""
    tok, fam = loaded.tokenizer, loaded.family
    max_len = settings.max_length or loaded.context
    content = max_len - 2 if fam.special_tokens else max_len
    budget = settings.max_tokens
    chunk: list[str] = []
    docs: list[int] = []
    offset = {"doc": -1, "pos": 0}

    def flush():
        nonlocal budget
        enc = tok(chunk, add_special_tokens=False)["input_ids"]
        for ids, doc in zip(enc, docs):
            if doc != offset["doc"]:
                offset["doc"], offset["pos"] = doc, 0
            for start in range(0, len(ids), content):
                piece = ids[start:start + content]
                if budget is not None:
                    piece = piece[:budget]
                    budget -= len(piece)
                if piece:
                    yield piece, doc, offset["pos"] + start
                if budget is not None and budget <= 0:
                    return
            offset["pos"] += len(ids)

    for doc, text in texts:
        units = splitter(text) if splitter else [text]
        if not units or not any(u.strip() for u in units):
            result.skipped += 1
            continue
        chunk.extend(units)
        docs.extend([doc] * len(units))
        if len(chunk) >= 256:
            yield from flush()
            chunk, docs = [], []
            if budget is not None and budget <= 0:
                return
    if chunk:
        yield from flush()


def batches(loaded: Loaded, wins: Iterator[tuple[list[int], int, int]], batch_size: int, device: str
            ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Padded batches (input_ids, attention_mask, counted, where), the first three (B, T) on the
    device and `where` (B, T, 2) on the CPU: each position's document index and position in the
    document.  Windows are sorted by length within a buffer of 32 batches to waste little padding."""
    fam, tok = loaded.family, loaded.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0

    def make(group):
        seqs = []
        for ids, _, _ in group:
            seqs.append([tok.cls_token_id, *ids, tok.sep_token_id] if fam.special_tokens else ids)
        T = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), T), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        counted = torch.zeros((len(seqs), T), dtype=torch.bool)
        where = torch.zeros((len(seqs), T, 2), dtype=torch.long)
        for i, (s, (ids, doc, start)) in enumerate(zip(seqs, group)):
            input_ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            first = 1 if fam.special_tokens else 0
            counted[i, first : first + len(ids)] = True
            where[i, first : first + len(ids), 0] = doc
            where[i, first : first + len(ids), 1] = torch.arange(start, start + len(ids))
        return input_ids.to(device), mask.to(device), counted.to(device), where

    buffer: list[tuple[list[int], int, int]] = []
    for w in wins:
        buffer.append(w)
        if len(buffer) >= 32 * batch_size:
            buffer.sort(key=lambda w: len(w[0]))
            for i in range(0, len(buffer), batch_size):
                yield make(buffer[i : i + batch_size])
            buffer = []
    buffer.sort(key=lambda w: len(w[0]))
    for i in range(0, len(buffer), batch_size):
        yield make(buffer[i : i + batch_size])


# ---------------------------------------------------------------- one source


def forward_kwargs(loaded: Loaded) -> dict:
    return {"use_cache": False} if loaded.family.head == "causal" else {}


def accumulate_source(loaded: Loaded, source: Source, settings: Settings, result: SourceResult
                      ) -> TokenSums:
    base = get_module(loaded.model, loaded.family.base)
    emb = get_module(loaded.model, loaded.family.embedding)
    kinds = layer_kinds(loaded.model, loaded.family)
    d = emb.weight.shape[1]
    acc = TokenSums(len(kinds), emb.weight.shape[0], d, settings.device, settings.accumulator_device)
    if settings.moments:
        acc.moments = Moments(len(kinds), d, settings.accumulator_device or settings.device)
    if settings.sample:
        acc.sample = Sample(len(kinds), settings.sample, d)
    salt = source_salt(source.name)
    stats = ReadStats()
    splitter = SentenceSplitter() if settings.unit == "sentence" else None
    texts = indexed_documents(source, settings.shard, stats)
    kwargs = forward_kwargs(loaded)
    bar = tqdm(desc=f"{loaded.ref.name}@{loaded.checkpoint} {source.name}", unit="tok",
               unit_scale=True, total=settings.max_tokens, mininterval=1.0, file=sys.stderr,
               disable=None)
    start = time.perf_counter()
    with torch.inference_mode(), capture_layers(loaded.model, loaded.family, acc.add):
        for input_ids, mask, counted, where in batches(
            loaded, windows(loaded, texts, settings, result, splitter), settings.batch_size, settings.device
        ):
            n = acc.set_batch(input_ids, counted)
            if acc.sample is not None:
                w = where[counted.cpu()]  # (M, 2): document, position
                keys = torch.from_numpy(position_keys(salt, w[:, 0].numpy(), w[:, 1].numpy()))
                acc.sample.set_batch(keys, torch.cat([w, input_ids[counted].cpu()[:, None]], 1))
            base(input_ids=input_ids, attention_mask=mask, **kwargs)
            faults.hit("forward")
            result.tokens += n
            result.windows += input_ids.shape[0]
            bar.update(n)
    bar.close()
    result.seconds = time.perf_counter() - start
    result.documents = stats.documents
    result.replaced_lines = stats.replaced_lines
    result.skipped_lines = stats.skipped_lines
    result.filtered = stats.filtered
    result.nonfinite = int(acc.nonfinite.sum())
    result.zero = int(acc.zero.sum())
    return acc


def write_sums(root: Path, loaded: Loaded, source: Source, settings: Settings, acc: TokenSums,
               run_id: str) -> dict[str, str]:
    """token_sums and layer_sums of one (checkpoint, source, shard), one Parquet file each."""
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint, "source": source.name,
              "shard": f"{settings.shard[0]}-of-{settings.shard[1]}"}
    key = {**values, "step": loaded.step}
    kinds = layer_kinds(loaded.model, loaded.family)
    vec_np = {"float64": np.float64, "float32": np.float32, "float16": np.float16}[settings.vector_dtype]
    tok_schema = schema.TOKEN_SUMS.set(
        schema.TOKEN_SUMS.get_field_index("vec"),
        pa.field("vec", schema.vector_type(settings.vector_dtype), nullable=False),
    )
    writers = [store.TableWriter(root, "token_sums", values, run_id, tok_schema),
               store.TableWriter(root, "layer_sums", values, run_id)]
    try:
        layer_rows = {k: [] for k in ("layer", "layer_kind", "n_layers", "n", "sum_sq",
                                      "n_nonfinite", "n_zero", "vec")}
        for layer, kind in enumerate(kinds):
            counts = acc.counts[layer].cpu()
            ids = counts.nonzero().squeeze(1)  # (U,)
            S = acc.sums[layer].index_select(0, ids.to(acc.sums.device)).cpu()  # (U, d) float64
            m, d = S.shape
            flat = pa.array(S.numpy().astype(vec_np).reshape(-1))
            vec = pa.ListArray.from_arrays(pa.array(np.arange(0, (m + 1) * d, d, dtype=np.int32)), flat)
            writers[0].write({
                **{k: [v] * m for k, v in key.items()},
                "layer": np.full(m, layer, np.int16), "token_id": ids.numpy().astype(np.int32),
                "n": counts[ids].numpy(), "sum_sq": (S * S).sum(1).numpy(), "vec": vec,
            })
            total = S.sum(0)  # (d,) float64
            layer_rows["layer"].append(layer)
            layer_rows["layer_kind"].append(kind)
            layer_rows["n_layers"].append(len(kinds))
            layer_rows["n"].append(int(counts.sum()))
            layer_rows["sum_sq"].append(float(total @ total))
            layer_rows["n_nonfinite"].append(int(acc.nonfinite[layer]))
            layer_rows["n_zero"].append(int(acc.zero[layer]))
            layer_rows["vec"].append(total.tolist())
        writers[1].write({**{k: [v] * len(kinds) for k, v in key.items()}, **layer_rows})
        files = {"token_sums": writers[0].close(), "layer_sums": writers[1].close()}
        if acc.moments is not None:
            w = store.TableWriter(root, "moments", values, run_id)
            writers.append(w)
            m = acc.moments
            for layer in range(len(kinds)):  # one row group per layer: d×d matrices are large
                last = layer == len(kinds) - 1 or m.cross is None
                w.write({**{k: [v] for k, v in key.items()}, "layer": [layer], "n": [int(m.n[layer])],
                         "s1": [m.s1[layer].cpu().numpy()], "s2": [m.s2[layer].cpu().numpy().reshape(-1)],
                         "n_pair": [None if last else int(m.n_pair[layer])],
                         "s_cross": [None if last else m.cross[layer].cpu().numpy().reshape(-1)]})
            files["moments"] = w.close()
        if acc.sample is not None:
            w = store.TableWriter(root, "samples", values, run_id)
            writers.append(w)
            smp = acc.sample
            for layer in range(len(kinds)):
                k = len(smp.keys)
                w.write({**{kk: [v] * k for kk, v in key.items()}, "layer": np.full(k, layer, np.int16),
                         "key": smp.keys.numpy(), "document": smp.meta[:, 0].numpy(),
                         "position": smp.meta[:, 1].numpy(), "token_id": smp.meta[:, 2].numpy().astype(np.int32),
                         "vec": list(smp.vecs[layer].numpy())})
            files["samples"] = w.close()
        return files
    except BaseException:
        for w in writers:
            w.abort()
        raise


def write_params(root: Path, loaded: Loaded, run_id: str) -> dict[str, str]:
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint}
    key = {**values, "step": loaded.step}
    files = {}
    written = []
    try:
        for table, rows in (("partition_fn", partition_table(loaded)), ("norm_params", norm_table(loaded)),
                            ("vocab", vocab_table(loaded))):
            w = store.TableWriter(root, table, values, run_id)
            written.append(w)
            n = len(next(iter(rows.values()))) if rows else 0
            w.write({**{k: [v] * n for k, v in key.items()}, **rows} if n else
                    {f.name: [] for f in schema.TABLES[table]})
            files[table] = w.close()
        return files
    except BaseException:
        for w in written:
            w.abort()
        raise


# ---------------------------------------------------------------- the command


def _entry(kind: str, loaded: Loaded, run_id: str, files: dict, settings: Settings, d: int,
           source: Source | None = None, result: SourceResult | None = None, prov: dict | None = None
           ) -> dict:
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}" if source else None
    s = asdict(settings)
    s["shard"] = shard
    s["pile_set"] = source.pile_set if source else None
    return {
        "key": store.entry_key(kind, loaded.ref.name, loaded.checkpoint, source and source.name, shard),
        "kind": kind, "model": loaded.ref.name, "checkpoint": loaded.checkpoint, "step": loaded.step,
        "source": source and source.name, "shard": shard, "run_id": run_id,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hidden_size": d, "files": files,
        "stats": ({k: v for k, v in asdict(result).items() if k not in ("files", "source")}
                  if result else {}),
        "settings": s, "provenance": prov or {},
    }


def _done(manifest: dict, ref: ModelRef, checkpoint: str, source: Source, settings: Settings,
          source_fingerprint: str) -> bool:
    shard = f"{settings.shard[0]}-of-{settings.shard[1]}"
    entry = manifest["entries"].get(store.entry_key("data", ref.name, checkpoint, source.name, shard))
    if entry is None or entry["provenance"].get("source_fingerprint") != source_fingerprint:
        return False
    if entry["provenance"].get("model_location") != ref.location:
        return False
    want = {**asdict(settings), "shard": shard, "pile_set": source.pile_set}
    return all(entry["settings"].get(k) == want[k] for k in RESULT_SETTINGS)


def extract(ref: ModelRef, checkpoints: list[str], sources: list[Source], root: Path,
            settings: Settings, log=print) -> list[SourceResult]:
    root = Path(root)
    dtype = DTYPES[settings.dtype]
    check_dtype(dtype, settings.device)
    store.read_manifest(root)  # fails early on a warehouse of another schema version
    prints = {s.name: fingerprint(s) for s in sources}
    results: list[SourceResult] = []
    base_prov = {"git_hash": git_hash(), "packages": package_versions(), "model_location": ref.location}
    for checkpoint in checkpoints:
        todo = list(sources)
        if settings.skip_done:
            manifest = store.read_manifest(root)
            todo = [s for s in sources if not _done(manifest, ref, checkpoint, s, settings, prints[s.name])]
            params_key = store.entry_key("params", ref.name, checkpoint)
            if not todo and params_key in manifest["entries"]:
                log(f"{ref.name}@{checkpoint}: already in the warehouse with these settings; skipped")
                continue
        loaded = load(ref, checkpoint, dtype, settings.device, settings.trust_remote_code)
        if settings.max_length is not None and settings.max_length > loaded.context:
            raise UserError(f"--max-length {settings.max_length} exceeds the model's context of {loaded.context} tokens")
        d = get_module(loaded.model, loaded.family.embedding).weight.shape[1]
        store.check_compatible(store.read_manifest(root), ref.name, d)
        run_id = store.new_run_id()
        prov = {**base_prov, "model_revision": loaded.revision_hash or checkpoint}
        written: list[str] = []
        try:
            params_files = write_params(root, loaded, run_id)
            written += params_files.values()
            loaded.model.to(device=settings.device, dtype=dtype)
            entries = [_entry("params", loaded, run_id, params_files, settings, d, prov=prov)]
            for source in ([] if settings.params_only else todo):
                result = SourceResult(source.name)
                acc = accumulate_source(loaded, source, settings, result)
                if result.tokens == 0:
                    raise UserError(f"--source {source.name}: {source.describe()}: no tokens to process "
                                    f"({result.documents} documents after filters)")
                files = write_sums(root, loaded, source, settings, acc, run_id)
                written += files.values()
                del acc
                result.files = files
                entries.append(_entry("data", loaded, run_id, files, settings, d, source, result,
                                      {**prov, "source_fingerprint": prints[source.name],
                                       "source_path": source.describe() if source.builtin else str(source.path.resolve())}))
                results.append(result)
                if result.replaced_lines:
                    log(f"warning: {source.name}: {result.replaced_lines} lines had bytes that are not UTF-8 (replaced with U+FFFD)")
                if result.skipped_lines:
                    log(f"warning: {source.name}: {result.skipped_lines} lines had bytes that are not UTF-8 (skipped)")
                if result.nonfinite:
                    log(f"warning: {source.name}: {result.nonfinite} NaN/inf activations counted and excluded")
            store.commit(root, entries)
        except BaseException:
            for rel in written:
                with contextlib.suppress(FileNotFoundError):
                    (root / rel).unlink()
            raise
        finally:
            del loaded
        for r in results[-len(todo):] if todo and not settings.params_only else []:
            log(f"{ref.name}@{checkpoint} {r.source}: {r.tokens} tokens, {r.documents} documents, "
                f"{r.skipped} skipped, {r.windows} windows, {r.nonfinite} non-finite, "
                f"{r.seconds:.1f} s ({r.tokens / max(r.seconds, 1e-9):.0f} tok/s)")
    return results


def summary_line(results: list[SourceResult], seconds: float) -> str:
    tokens = sum(r.tokens for r in results)
    return (f"done: {tokens} tokens, {sum(r.documents for r in results)} documents, "
            f"{sum(r.skipped for r in results)} skipped, {sum(r.nonfinite for r in results)} non-finite, "
            f"{seconds:.1f} s")

