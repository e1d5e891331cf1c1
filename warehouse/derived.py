"""Derived tables: the peers' isotropy measures, computed from the mergeable sums.

For every (model, checkpoint) and every source (and source = 'all', the merge of all), the
moments of all partials are summed, then per layer:

* covariance C = (Σhhᵀ − (Σh)(Σh)ᵀ/n) / (n − 1) → its eigenvalues (`spectrum`) and diagonal
  (`dim_variance`); anisotropy, effective rank, IsoScore and outlier dimensions are SQL over them;
* linearity to the next layer (Razzhigaev et al. 2024, `procrustes_similarity`):
  tr(C_yx C_xx⁺ C_xy) / tr(C_yy), and the centred variant between X and Y − X; linear CKA and
  the orthogonal Procrustes similarity to the next layer from the same covariances;
* TwoNN intrinsic dimension on the merged bottom-k sample, as llm-microscope computes it and as
  scikit-dimension's `TwoNN` does;
* for the frequency-debiased Inter-Sim: the number of token types T and ‖Σ_t s_t/‖s_t‖‖².

The results are written as a 'derived' manifest entry per (model, checkpoint) that records the
data runs it was computed from; `ensure_derived` recomputes it whenever those change.  Only
checkpoints extracted with --moments or --sample get derived tables (they re-read every partial).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from extract import faults

from . import schema, store


def covariance(n: int, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """C = (Σhhᵀ − (Σh)(Σh)ᵀ/n) / (n − 1), float64."""
    return (s2 - np.outer(s1, s1) / n) / (n - 1)


def cross_covariance(n: int, sx: np.ndarray, sy: np.ndarray, sxy: np.ndarray) -> np.ndarray:
    return (sxy - np.outer(sx, sy) / n) / (n - 1)


def linearity_from_cov(cxx: np.ndarray, cyy: np.ndarray, cxy: np.ndarray) -> float:
    """1 − ‖X̃A − Ỹ‖²_F for centred, Frobenius-normalised X, Y and the least-squares A, which is
    tr(C_yx C_xx⁺ C_xy) / tr(C_yy) (solved by least squares, no explicit inverse)."""
    a = np.linalg.lstsq(cxx, cxy, rcond=None)[0]  # C_xx⁺ C_xy
    return float(np.trace(cxy.T @ a) / np.trace(cyy))


def similarities_from_cov(cxx: np.ndarray, cyy: np.ndarray, cxy: np.ndarray) -> tuple[float, float]:
    """(linear CKA, orthogonal Procrustes similarity) of centred X, Y from their covariances.

    With X, Y centred, XᵀY = (n−1)·C_xy, so CKA = ‖XᵀY‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F) = ‖C_xy‖²_F /
    (‖C_xx‖_F ‖C_yy‖_F) (Kornblith et al. 2019), and the orthogonal Procrustes similarity
    max_R ⟨XR, Y⟩ / (‖X‖_F ‖Y‖_F) over orthogonal R = ‖XᵀY‖_* / (‖X‖_F ‖Y‖_F) =
    ‖C_xy‖_* / √(tr C_xx · tr C_yy) (nuclear norm: the sum of singular values)."""
    cka = float(np.sum(cxy * cxy) / (np.linalg.norm(cxx) * np.linalg.norm(cyy)))
    nuclear = float(np.linalg.svd(cxy, compute_uv=False).sum())
    return cka, nuclear / float(np.sqrt(np.trace(cxx) * np.trace(cyy)))


def _nn_distances(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distances of every point to its first and second nearest neighbours (exact differences)."""
    t = torch.from_numpy(np.ascontiguousarray(X, dtype=np.float64))
    D = torch.cdist(t, t, compute_mode="donot_use_mm_for_euclid_dist")  # (S, S)
    D.fill_diagonal_(float("inf"))
    two = torch.topk(D, 2, dim=1, largest=False).values.numpy()
    return two[:, 0], two[:, 1]


def twonn_microscope(X: np.ndarray, reduction_factor: int = 5, eps: float = 1e-8) -> float:
    """TwoNN as llm-microscope's `intrinsic_dimension`: centre, scale by the mean norm, ratios
    μ = r₂/r₁ sorted (μ ≤ 1 + eps dropped), then the slope through the origin of −log(1 − F)
    on log μ over the smallest n/reduction_factor of them."""
    X = X - X.mean(0, keepdims=True)
    X = X / np.sqrt((X * X).sum(1)).mean()
    r1, r2 = _nn_distances(X)
    bad = r1 < eps
    r1, r2 = np.where(bad, eps, r1), np.where(bad, eps, r2)
    mu = np.sort(np.where(bad, -1.0, r2 / r1))
    useless = int((mu <= 1 + eps).sum())
    mu = mu[useless:]
    n = len(mu)
    f_emp = np.arange(1 + useless, n + 1 + useless) / (n + useless)
    k = min(n // reduction_factor, n - 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN where the oracle gives NaN too
        x, y = np.log(mu)[:k], -np.log(1 - f_emp)[:k]
        return float((x * y).sum() / (x * x).sum())


def _nn_distances_gram(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """As scikit-learn's `pairwise_distances` (which scikit-dimension uses when d > 25): distances
    from the Gram matrix, ‖x‖² + ‖y‖² − 2⟨x, y⟩ clipped at 0, the diagonal set to 0."""
    sq = np.einsum("ij,ij->i", X, X)
    D = -2.0 * (X @ X.T)
    D += sq[:, None]
    D += sq[None, :]
    np.maximum(D, 0, out=D)
    np.fill_diagonal(D, 0)
    D = np.sort(np.sqrt(D), axis=1)
    return D[:, 1], D[:, 2]


def twonn_skdim(X: np.ndarray, discard_fraction: float = 0.1) -> float:
    """TwoNN as scikit-dimension's `TwoNN()` (Facco et al. 2017): ratios μ of all points (those
    with r₁ = 0 dropped), the largest 10 % discarded, F = i/N, slope through the origin.  TwoNN
    reacts to tiny changes of near-duplicate distances, so the distances are computed as
    scikit-dimension computes them (Gram matrix for d > 25, exact below)."""
    X = np.asarray(X, dtype=np.float64)
    r1, r2 = _nn_distances_gram(X) if X.shape[1] > 25 else _nn_distances(X)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = r2 / r1
    mu = mu[np.isfinite(mu)]
    N = len(mu)
    keep = int(N * (1 - discard_fraction))
    mu = np.sort(mu)[:keep]
    f = np.arange(1, keep + 1) / N
    with np.errstate(divide="ignore", invalid="ignore"):
        x, y = np.log(mu), -np.log(1 - f)
        return float((x * y).sum() / (x * x).sum())


def _read(root: Path, files: list[str], columns=None) -> list[dict]:
    rows = []
    for f in files:
        rows.extend(pq.read_table(root / f, columns=columns).to_pylist())
    return rows


def compute(root: Path, entries: list[dict], sample_k: int | None) -> dict[str, dict[str, list]]:
    """Derived rows for one (model, checkpoint) from its data entries."""
    model, checkpoint, step = entries[0]["model"], entries[0]["checkpoint"], entries[0]["step"]
    out = {t: defaultdict(list) for t in schema.DERIVED_TABLES}
    groups = {"all": entries} | {s: [e for e in entries if e["source"] == s] for s in sorted({e["source"] for e in entries})}

    def key(table, source, layer):
        row = out[table]
        row["model"].append(model)
        row["checkpoint"].append(checkpoint)
        row["step"].append(step)
        row["source"].append(source)
        row["layer"].append(layer)

    for source, group in groups.items():
        # ---- moments: spectrum, per-dimension variance, linearity
        mfiles = [e["files"]["moments"] for e in group if "moments" in e["files"]]
        merged = {}
        if mfiles and len(mfiles) == len(group):
            for r in _read(root, mfiles):
                m = merged.setdefault(r["layer"], {"n": 0, "s1": 0.0, "s2": 0.0, "n_pair": 0, "cross": 0.0,
                                                   "has_cross": r["s_cross"] is not None})
                m["n"] += r["n"]
                m["s1"] = m["s1"] + np.asarray(r["s1"])
                m["s2"] = m["s2"] + np.asarray(r["s2"])
                if r["s_cross"] is not None:
                    m["n_pair"] += r["n_pair"]
                    m["cross"] = m["cross"] + np.asarray(r["s_cross"])
        covs = {}
        for layer, m in sorted(merged.items()):
            if m["n"] < 2:
                continue
            d = len(m["s1"])
            C = covariance(m["n"], m["s1"], m["s2"].reshape(d, d))
            covs[layer] = C
            evals = np.linalg.eigvalsh(C)[::-1]
            for k, ev in enumerate(evals, 1):
                key("spectrum", source, layer)
                out["spectrum"]["n"].append(m["n"])
                out["spectrum"]["k"].append(k)
                out["spectrum"]["eigenvalue"].append(float(ev))
            for dim in range(d):
                key("dim_variance", source, layer)
                out["dim_variance"]["dim"].append(dim)
                out["dim_variance"]["mean"].append(float(m["s1"][dim] / m["n"]))
                out["dim_variance"]["variance"].append(float(C[dim, dim]))
        linearity = {}
        for layer, m in merged.items():
            nxt = merged.get(layer + 1)
            if not m["has_cross"] or nxt is None or not (m["n_pair"] == m["n"] == nxt["n"]) or m["n"] < 2:
                continue  # exact only when both layers counted the same tokens
            d = len(m["s1"])
            cxx, cyy = covs[layer], covs[layer + 1]
            cxy = cross_covariance(m["n"], m["s1"], nxt["s1"], m["cross"].reshape(d, d))
            c_dd = cyy - cxy - cxy.T + cxx  # Y − X
            c_xd = cxy - cxx
            linearity[layer] = (linearity_from_cov(cxx, cyy, cxy), linearity_from_cov(cxx, c_dd, c_xd),
                                *similarities_from_cov(cxx, cyy, cxy))
        # ---- the bottom-k sample: intrinsic dimension
        sfiles = [e["files"]["samples"] for e in group if "samples" in e["files"]]
        twonn = {}
        if sfiles and len(sfiles) == len(group) and sample_k:
            by_layer = defaultdict(list)
            for r in _read(root, sfiles, ["layer", "key", "vec"]):
                by_layer[r["layer"]].append((r["key"], r["vec"]))
            for layer, items in by_layer.items():
                items.sort(key=lambda kv: kv[0])
                X = np.asarray([v for _, v in items[:sample_k]], dtype=np.float64)
                X = X[np.isfinite(X).all(1)]
                if len(X) >= 10:
                    twonn[layer] = (len(X), twonn_microscope(X), twonn_skdim(X))
        # ---- token types: frequency-debiased Inter-Sim
        types = {}
        parts = defaultdict(list)  # layer → [(ids, vectors)] over the partials
        for e in group:
            t = pq.read_table(root / e["files"]["token_sums"], columns=["layer", "token_id", "vec"])
            if t.num_rows == 0:
                continue
            layer_col, ids = t.column("layer").to_numpy(), t.column("token_id").to_numpy()
            flat = t.column("vec").combine_chunks().values.to_numpy(zero_copy_only=False).astype(np.float64)
            V = flat.reshape(len(ids), -1)
            for layer in np.unique(layer_col):
                sel = layer_col == layer
                parts[int(layer)].append((ids[sel], V[sel]))
        for layer, items in parts.items():
            ids = np.concatenate([i for i, _ in items])
            V = np.concatenate([v for _, v in items])
            order = np.argsort(ids, kind="stable")
            ids, V = ids[order], V[order]
            starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
            per_type = np.add.reduceat(V, starts, axis=0)  # Σ over partials of each type's Σû
            norms = np.linalg.norm(per_type, axis=1)
            unit = per_type[norms > 0] / norms[norms > 0, None]
            total = unit.sum(0)
            types[layer] = (len(unit), float(total @ total))
        layers = sorted(set(merged) | set(types))
        for layer in layers:
            key("layer_metrics", source, layer)
            lm = out["layer_metrics"]
            lm["n"].append(int(merged[layer]["n"]) if layer in merged else 0)
            lin = linearity.get(layer, (None, None, None, None))
            lm["linearity"].append(lin[0])
            lm["linearity_centered"].append(lin[1])
            lm["cka"].append(lin[2])
            lm["procrustes_orthogonal"].append(lin[3])
            tw = twonn.get(layer, (None, None, None))
            lm["sample_size"].append(tw[0])
            lm["twonn"].append(tw[1])
            lm["twonn_skdim"].append(tw[2])
            ty = types.get(layer, (None, None))
            lm["types"].append(ty[0])
            lm["types_sum_sq"].append(ty[1])
    return out


def _inputs(entries: list[dict]) -> list[str]:
    return sorted(e["run_id"] + ":" + e["key"] for e in entries)


def wants_derived(entries: list[dict]) -> bool:
    """Derived tables are computed for checkpoints extracted with --moments or --sample: computing
    them reads every partial of the checkpoint again, which plain runs should not pay for."""
    return any(e["settings"].get("moments") or e["settings"].get("sample") for e in entries)


def _data_by_pair(manifest: dict) -> dict[tuple[str, str], list[dict]]:
    data = defaultdict(list)
    for e in manifest["entries"].values():
        if e["kind"] == "data":
            data[(e["model"], e["checkpoint"])].append(e)
    return {p: es for p, es in data.items() if wants_derived(es)}


def stale_pairs(manifest: dict) -> list[tuple[str, str]]:
    """(model, checkpoint)s whose derived entry is missing, outdated, or left over."""
    data = _data_by_pair(manifest)
    derived = {(e["model"], e["checkpoint"]): e for e in manifest["entries"].values() if e["kind"] == "derived"}
    out = [p for p, es in data.items() if derived.get(p, {}).get("inputs") != _inputs(es)]
    return out + [p for p in derived if p not in data]


def ensure_derived(root: Path, pairs: set[tuple[str, str]] | None = None) -> int:
    """Recompute the derived entry of every (model, checkpoint) in `pairs` (default: all) whose data
    runs changed since it was computed; returns how many were recomputed."""
    root = Path(root)
    done = 0
    with store.locked(root):
        manifest = store.read_manifest(root)
        data = _data_by_pair(manifest)
        remove = [k for k, e in manifest["entries"].items()
                  if e["kind"] == "derived" and (e["model"], e["checkpoint"]) not in data]
        new_entries = []
        for pair, entries in sorted(data.items()):
            if pairs is not None and pair not in pairs:
                continue
            entries.sort(key=lambda e: (e["source"], e["shard"]))
            inputs = _inputs(entries)
            dkey = store.entry_key("derived", *pair)
            old = manifest["entries"].get(dkey)
            if old is not None and old.get("inputs") == inputs:
                continue
            ks = {e["settings"].get("sample") or 0 for e in entries}
            rows = compute(root, entries, min(ks) if ks else None)
            run_id = store.new_run_id()
            files, writers = {}, []
            try:
                for table in schema.DERIVED_TABLES:
                    w = store.TableWriter(root, table, {"model": pair[0], "checkpoint": pair[1]}, run_id)
                    writers.append(w)
                    cols = rows[table]
                    w.write(dict(cols) if cols else {f.name: [] for f in schema.TABLES[table]})
                    files[table] = w.close()
            except BaseException:
                for w in writers:
                    w.abort()
                raise
            new_entries.append({
                "key": dkey, "kind": "derived", "model": pair[0], "checkpoint": pair[1],
                "step": entries[0]["step"], "source": None, "shard": None, "run_id": run_id,
                "finished_at": entries[-1]["finished_at"], "hidden_size": entries[0]["hidden_size"],
                "files": files, "inputs": inputs, "stats": {}, "settings": {}, "provenance": {},
            })
            done += 1
        if new_entries or remove:
            faults.hit("derive")
            store.commit_locked(root, manifest, new_entries, remove)
    return done
