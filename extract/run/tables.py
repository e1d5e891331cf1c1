"""Writing a run's tables: one source's sums (token_sums, layer_sums, and as measured moments,
sequence_moments, massive, samples, attention_sums) and a checkpoint's parameter tables (partition_fn, norm_params,
vocab), each a Parquet file per table through `store.TableWriter`, aborted (removed) on failure; and
the empty partition folders a failed checkpoint leaves behind."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from urllib.parse import quote

import numpy as np
import pyarrow as pa

from warehouse import schema, store

from ..accumulate import TokenSums
from ..architectures import get_module
from ..hooks import layer_kinds
from ..models import Loaded
from ..params import norm_table, partition_table, vocab_table
from ..sources import Source
from . import params_cache
from .settings import Settings


class _Float16Overflow(Exception):
    """A token sum has a component beyond float16's range."""


def _token_rows(writer: store.TableWriter, acc: TokenSums, n_layers: int, key: dict, vector_dtype: str
                ) -> list[tuple[np.ndarray, int]]:
    """Writes every layer's token rows (vectors in `vector_dtype`); returns per layer Σ_t Σû (d,)
    float64 and the vectors counted.  Raises _Float16Overflow at the first float16 vector with an
    infinite component (a token type counted more than 65,504 times can reach it: |Σû| ≤ n_t)."""
    vec_np = {"float64": np.float64, "float32": np.float32, "float16": np.float16}[vector_dtype]
    totals = []
    for layer in range(n_layers):
        total = np.zeros(acc.d, dtype=np.float64)  # (d,)
        n_total = 0
        for ids, counts, S in acc.layer_rows(layer):  # (m,), (m,), (m, d) float64
            m = len(ids)
            with np.errstate(over="ignore"):
                V = S.astype(vec_np)  # (m, d)
            if vec_np is np.float16 and np.isinf(V).any():
                raise _Float16Overflow
            writer.write({
                **{k: [v] * m for k, v in key.items()},
                "layer": np.full(m, layer, np.int16), "token_id": ids.astype(np.int32),
                "n": counts, "sum_sq": np.einsum("ij,ij->i", S, S), "vec": store.list_array(V),
            })
            total += S.sum(0)
            n_total += int(counts.sum())
        totals.append((total, n_total))
    return totals


def write_sums(root, loaded: Loaded, source: Source, settings: Settings, acc: TokenSums,
               run_id: str) -> tuple[dict[str, str], str]:
    """token_sums and layer_sums of one (checkpoint, source, shard), one Parquet file each,
    written in chunks of token types (memory bounded whatever V and d are).  Returns the files and
    the dtype the token vectors were stored in: --vector-dtype, except float16 where a sum would
    overflow it (then float32, the file written again; the entry's stats say so)."""
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint, "source": source.name,
              "shard": f"{settings.shard[0]}-of-{settings.shard[1]}"}
    key = {**values, "step": loaded.step}
    kinds = layer_kinds(loaded.model, loaded.layout)

    def token_writer(vector_dtype: str) -> store.TableWriter:
        return store.TableWriter(root, "token_sums", values, run_id, schema.TOKEN_SUMS.set(
            schema.TOKEN_SUMS.get_field_index("vec"),
            pa.field("vec", schema.vector_type(vector_dtype), nullable=False)))

    stored = settings.vector_dtype
    writers = [token_writer(stored)]
    try:
        try:
            totals = _token_rows(writers[0], acc, len(kinds), key, stored)
        except _Float16Overflow:
            writers[0].abort()
            stored = "float32"
            writers[0] = token_writer(stored)
            totals = _token_rows(writers[0], acc, len(kinds), key, stored)
        writers.append(store.TableWriter(root, "layer_sums", values, run_id))
        layer_rows = {k: [] for k in ("layer", "layer_kind", "n_layers", "n", "sum_sq", "n_nonfinite",
                                      "n_zero", "vec", "sum_h", "sum_u2", "windows", "window_cos",
                                      *schema.WINDOW_SCALARS, *schema.CHANGE_SUMS, "unit_windows", "sum_ubar",
                                      "sum_ubar_sq")}
        ex = acc.extra
        scalars = ex.scalars() if ex is not None else {k: [None] * len(kinds) for k in schema.WINDOW_SCALARS}
        nonfinite, zero = acc.nonfinite.cpu(), acc.zero.cpu()
        sum_h, sum_u2 = acc.sum_h.cpu().numpy(), acc.sum_u2.cpu().numpy()
        windows, window_cos = acc.windows.cpu().numpy(), acc.window_cos.cpu().numpy()
        change = {k: getattr(acc, k).cpu().tolist() for k in schema.CHANGE_SUMS}  # index l: layer l → l + 1
        unit_windows, sum_ubar = acc.unit_windows.cpu().tolist(), acc.sum_ubar.cpu().numpy()
        sum_ubar_sq = acc.sum_ubar_sq.cpu().tolist()
        for layer, kind in enumerate(kinds):
            total, n_total = totals[layer]
            layer_rows["layer"].append(layer)
            layer_rows["layer_kind"].append(kind)
            layer_rows["n_layers"].append(len(kinds))
            layer_rows["n"].append(n_total)
            layer_rows["sum_sq"].append(float(total @ total))
            layer_rows["n_nonfinite"].append(int(nonfinite[layer]))
            layer_rows["n_zero"].append(int(zero[layer]))
            layer_rows["vec"].append(total.tolist())
            layer_rows["sum_h"].append(sum_h[layer].tolist())
            layer_rows["sum_u2"].append(sum_u2[layer].tolist())
            layer_rows["windows"].append(int(windows[layer]))
            layer_rows["window_cos"].append(float(window_cos[layer]))
            for k, v in scalars.items():
                layer_rows[k].append(v[layer])
            for k, v in change.items():
                layer_rows[k].append(v[layer] if layer + 1 < len(kinds) else None)
            layer_rows["unit_windows"].append(unit_windows[layer])
            layer_rows["sum_ubar"].append(sum_ubar[layer].tolist())
            layer_rows["sum_ubar_sq"].append(sum_ubar_sq[layer])
        writers[1].write({**{k: [v] * len(kinds) for k, v in key.items()}, **layer_rows})
        files = {"token_sums": writers[0].close(), "layer_sums": writers[1].close()}
        if acc.moments is not None:
            w = store.TableWriter(root, "moments", values, run_id)
            writers.append(w)
            m = acc.moments
            for layer in range(len(kinds)):  # one row group per layer: d×d matrices are large
                last = layer == len(kinds) - 1 or not m.has_cross
                w.write({**{k: [v] for k, v in key.items()}, "layer": [layer], "n": [int(m.n[layer])],
                         "s1": [m.s1[layer].cpu().numpy()], "s2": [m.s2(layer).reshape(-1)],
                         "n_pair": [None if last else int(m.n_pair[layer])],
                         "s_cross": [None if last else m.cross(layer).reshape(-1)]})
            files["moments"] = w.close()
        if ex is not None:
            w = store.TableWriter(root, "sequence_moments", values, run_id)
            writers.append(w)
            for layer in range(len(kinds)):
                for pooling, mo in ex.pooled.items():
                    w.write({**{k: [v] for k, v in key.items()}, "layer": [layer], "pooling": [pooling],
                             "n": [int(mo.n[layer])], "s1": [mo.s1[layer].cpu().numpy()],
                             "s2": [mo.s2(layer).reshape(-1)]})
            files["sequence_moments"] = w.close()
            w = store.TableWriter(root, "massive", values, run_id)
            writers.append(w)
            for layer in range(len(kinds)):
                top = ex.top(layer)
                if top["rank"]:
                    w.write({**{k: [v] * len(top["rank"]) for k, v in key.items()},
                             "layer": [layer] * len(top["rank"]), **top})
            files["massive"] = w.close()
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
        if getattr(acc, "attention", None) is not None:
            w = store.TableWriter(root, "attention_sums", values, run_id)
            writers.append(w)
            rows = acc.attention.rows()
            w.write({**{k: [v] * len(rows) for k, v in key.items()},
                     **{f.name: [r[f.name] for r in rows] for f in schema.ATTENTION_SUMS if f.name not in key}})
            files["attention_sums"] = w.close()
        return files, stored
    except BaseException:
        for w in writers:
            w.abort()
        raise


def write_params(root, loaded: Loaded, run_id: str, prov: dict | None = None) -> dict[str, str]:
    """The parameter tables of one checkpoint (partition_fn, norm_params, vocab); returns their files.
    With the checkpoint's provenance `prov`, the partition table comes from the cache of tables
    (params_cache.py) where it holds this checkpoint's, else is computed and kept there."""
    values = {"model": loaded.ref.name, "checkpoint": loaded.checkpoint}
    key = {**values, "step": loaded.step}
    files = {}
    written = []
    emb = get_module(loaded.model, loaded.layout.embedding).weight  # where and in what the table is computed
    cached = None if prov is None else params_cache.cache_key(
        prov.get("model_identity"), prov.get("params_code"), prov.get("layout"), f"{emb.device.type} {emb.dtype}")
    partition = params_cache.read(cached)
    if partition is None:
        partition = partition_table(loaded)
        params_cache.write(cached, partition)
    try:
        for table, rows in (("partition_fn", partition), ("norm_params", norm_table(loaded)),
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


def remove_empty_dirs(root, model: str, checkpoint: str) -> None:
    """After a failed checkpoint: the partition folders of (model, checkpoint) that hold nothing (its
    writers created them; their files were removed), bottom-up; folders with any file stay."""
    if not getattr(root, "local", False):
        return  # object stores have no folders
    tables = Path(root.path("tables"))
    if not tables.is_dir():
        return
    for table in tables.iterdir():
        top = table / f"model={quote(model, safe='')}"
        for folder, _, _ in os.walk(top / f"checkpoint={quote(checkpoint, safe='')}", topdown=False):
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        for d in (top, table):
            with contextlib.suppress(OSError):
                os.rmdir(d)
    with contextlib.suppress(OSError):
        os.rmdir(tables)

