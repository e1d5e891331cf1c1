"""Per-window and per-layer measures of the 2024–2026 literature, from the pass the token sums make:
sequence-level representations (Skean et al. 2025's dataset entropy, the spectrum of pooled
window vectors), curvature, prompt entropy (opt-in) and massive activations (Sun et al. 2024).

A *window* is what one forward row holds (a document piece, or a sentence with `--unit sentence`);
its vectors are its counted positions whose vector is finite and non-zero (as everywhere), in order.
Everything stored is a sum or a top-k, so shards, sources and machines merge:

* sequence moments, per layer and pooling — 'mean' (z = the window's mean vector), 'last' (z = its
  last vector), 'normalized' (ẑ = z_mean/‖z_mean‖): windows W, Σz (d,), Σzzᵀ (d, d), float64
  sums of per-batch float64 products (a `Moments` each, without cross moments, exact whatever the
  token moments' precision: a batch adds only B rows per layer, B its windows);
* curvature: over windows with a valid pair, Σ of the window's mean angle c_k = arccos(|⟨v_k,
  v_{k+1}⟩| / (‖v_k‖‖v_{k+1}‖)), v_k = h_{k+1} − h_k of consecutive vectors (float64), and their count;
* prompt entropy (`prompt_entropy=True`): per window with N ≥ 2 vectors, Z = the vectors minus
  their mean, rows L2-normalised (zero rows dropped), p = eig(ZZᵀ)/Σ, H(p)/log(min(N, d)): its sum
  and count (one eigendecomposition per window and layer: the cost is why it is opt-in);
* massive activations: Σ|h| over every counted vector and dimension (float64), and the top-k |h|
  with the dimension, token, document and position where each occurs.

What these need of the M rows is four numbers per row (`row_terms` in accumulate/kernels.py: Σ|h|,
max|h|, and the curvature's ‖v_k‖ and ⟨v_{k+1}, v_k⟩, float64).  The token-sum pass computes them
from the float64 rows it forms anyway — on the CPU from each cache-resident chunk
(`TokenSums._add_chunked`), compiled (`layer_step`) in the norm's reduction over d — so the rows are
not read again here: only the windows' last vectors and the top-k candidates' rows (B + k rows) are
gathered, and prompt entropy (opt-in) reads its windows' rows.  Given rows without the terms, `add`
computes them itself (same function, in float64 chunks).  Cost per batch and layer beyond the
terms: O(M) (curvature's angles, the top-k's sort of the row maxima) plus three (B × d)ᵀ(B × d)
products; 3·(d² + d) float64 sums per layer.  On a CPU the work queues to the moments' background
thread (same order: bit-identical)."""

from __future__ import annotations

import math

import numpy as np
import torch

from .accumulate.kernels import rows_terms
from .accumulate.moments import Moments

POOLINGS = ("mean", "last", "normalized")


class WindowMeasures:
    """Sequence moments, curvature, prompt entropy, massive activations of every layer."""

    CHUNK = 512  # rows per float64 chunk where the row terms are computed here (`rows_terms`)

    def __init__(self, n_layers: int, d: int, device: torch.device | str, precision: str = "float32",
                 prompt_entropy: bool = False, top_k: int = 10, worker=None):
        dev = torch.device(device)
        self.L, self.d, self.k = n_layers, d, top_k
        # Exact products whatever the token moments' precision: these are B rows per batch (one per
        # window), not M tokens, so float64 costs little; float32 products left noise eigenvalues
        # (~1e-7 of the largest) in a rank-deficient covariance — 'last' pooling at the embedding layer,
        # windows ending in the same token — that effective rank's p > 0 counted (tests/test_sequences.py).
        # `precision` is accepted for the caller's symmetry.
        self.pooled = {p: Moments(n_layers, d, dev, cross=False, precision="float64", background=False)
                       for p in POOLINGS}
        self.curv_windows = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self.curv_sum = torch.zeros(n_layers, dtype=torch.float64, device=dev)
        self.prompt_entropy = prompt_entropy
        self.pe_windows = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self.pe_sum = torch.zeros(n_layers, dtype=torch.float64, device=dev)
        self.sum_abs = torch.zeros(n_layers, dtype=torch.float64, device=dev)
        # top-k per layer: |h| (float64), dim, and the row's (document, position, token id)
        self.top_val = torch.full((n_layers, top_k), -1.0, dtype=torch.float64, device=dev)
        self.top_dim = torch.zeros(n_layers, top_k, dtype=torch.int64, device=dev)
        self.top_meta = torch.zeros(n_layers, top_k, 3, dtype=torch.int64, device=dev)
        self._worker = worker
        self._dev = dev

    @property
    def worker(self):
        """The executor the per-window terms run on (shared with the moments), or None: inline."""
        return self._worker

    # ------------------------------------------------------------ per batch

    def set_batch(self, win: np.ndarray, n_windows: int, meta: np.ndarray | None) -> None:
        """win: (M,) each counted row's window (ascending); meta: (M, 3) document, position, token id."""
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(self._dev, non_blocking=True)  # noqa: E731
        M = len(win)
        same = win[1:] == win[:-1]  # (M − 1,) rows k, k + 1 in one window
        starts = np.searchsorted(win, np.arange(n_windows))  # (B,) first row of each window
        ends = np.searchsorted(win, np.arange(n_windows), side="right")
        if meta is None:
            meta = np.full((M, 3), -1, dtype=np.int64)
        by_place = np.lexsort((meta[:, 1], meta[:, 0]))  # (M,) rows by (document, position)
        self._batch = (to(win), n_windows, to(same), starts, ends, to(meta.astype(np.int64)), to(by_place))

    def add(self, layer: int, h: torch.Tensor, ok: torch.Tensor, m: torch.Tensor, n_w: torch.Tensor,
            terms: tuple[torch.Tensor, ...] | None = None, sel: torch.Tensor | None = None) -> None:
        """h: (M, d) raw rows, zero where not ok — or, with `sel` (M,), the rows h[sel] (h (N, d), e.g.
        the layer's hidden states flattened: only the few rows needed are gathered, unmasked: they
        are masked here); ok: (M,) bool; m: (B, d) float64 Σh per window; n_w: (B,) vectors per
        window; terms: `row_terms` of the rows where the token-sum pass computed them already (then
        the M rows are not read again here, except by prompt entropy), else computed here.  The
        caller must not modify them afterwards."""
        dev = self._dev  # the accumulators' device (--accumulator-device may differ from the model's)
        if terms is not None:
            terms = tuple(t.to(dev) for t in terms)
        args = (layer, h.to(dev), ok.to(dev), m.to(dev), n_w.to(dev), self._batch, terms,
                None if sel is None else sel.to(dev))
        if self._worker is None:
            self._add(*args)
        else:
            nbytes = h.numel() * h.element_size() if sel is None else len(ok) * 32
            self._worker.submit(self._add, *args, nbytes=nbytes)

    def _add(self, layer, h, ok, m, n_w, batch, terms=None, sel=None) -> None:
        win, B, same, starts, ends, meta, by_place = batch
        M, d = len(ok), h.shape[1]
        if M == 0:  # a batch without a counted position
            return

        def rows(idx):  # (k, d) the counted rows idx, zero where not ok, in h's dtype
            r = h.index_select(0, idx if sel is None else sel.index_select(0, idx))
            return r if sel is None else r.masked_fill(~ok.index_select(0, idx).unsqueeze(1), 0)

        if terms is None:  # the rows' own pass (callers without the token-sum pass's terms)
            terms = rows_terms(h, ok, self.CHUNK)
        abs_sum, row_max, nv, dot = terms  # (M,) each, float64
        # sequence representations
        has = n_w > 0  # (B,)
        z_mean = m / n_w.clamp(min=1).unsqueeze(1).to(torch.float64)  # (B, d) float64
        z_mean = z_mean.masked_fill(~has.unsqueeze(1), 0)
        idx = torch.where(ok, torch.arange(M, device=ok.device), -1)
        last = torch.full((B,), -1, dtype=torch.int64, device=ok.device).scatter_reduce_(0, win, idx, "amax")
        z_last = rows(last.clamp(min=0)).masked_fill(~has.unsqueeze(1), 0)  # (B, d)
        norm = torch.linalg.vector_norm(z_mean, dim=1)  # (B,)
        unit = has & (norm > 0)
        z_hat = torch.where(unit.unsqueeze(1), z_mean / norm.clamp_min(1e-300).unsqueeze(1), 0.0)
        self.pooled["mean"].add(layer, z_mean, has)
        self.pooled["last"].add(layer, z_last, has)
        self.pooled["normalized"].add(layer, z_hat, unit)
        # massive activations: Σ|h| (float64 row sums of the exact float64 rows), and the top-k entries
        # in the order (|h| desc, document, position, dim).  They lie in the first k rows by (max |h|
        # desc, document, position): a row after those has k rows before it whose maxima come before
        # each of its entries — ties included.
        self.sum_abs[layer] += abs_sum.sum()
        kk = min(self.k, M)
        rowmax = row_max.index_select(0, by_place)  # (M,) in (document, position) order
        top = by_place[torch.argsort(rowmax, descending=True, stable=True)[:kk]]  # (kk,)
        val = torch.cat([self.top_val[layer], rows(top).abs().reshape(-1).to(torch.float64)])
        dim = torch.cat([self.top_dim[layer], torch.arange(d, device=ok.device).repeat(kk)])
        met = torch.cat([self.top_meta[layer], meta.index_select(0, top).repeat_interleave(d, 0)])
        keep = top_order(val, met, dim)[: self.k]
        self.top_val[layer], self.top_dim[layer], self.top_meta[layer] = val[keep], dim[keep], met[keep]
        # curvature: v_k = h_{k+1} − h_k within a window, both vectors ok; ‖v_k‖ and ⟨v_{k+1}, v_k⟩ in
        # float64 from `row_terms` (rows k of the (M,) terms; the last one or two rows are padding)
        if M >= 3:
            nv = nv[: M - 1]  # (M − 1,) ‖v_k‖
            v_ok = same & ok[1:] & ok[:-1] & (nv > 0)
            pair = v_ok[1:] & v_ok[:-1]  # (M − 2,) consecutive velocities of one window
            cos = dot[: M - 2].abs() / (nv[1:] * nv[:-1]).clamp_min(1e-300)
            c = torch.where(pair, torch.arccos(cos.clamp(max=1.0)), 0.0)  # (M − 2,)
            w = win[1:-1]  # the window of pair (k, k + 1): that of row k + 1
            c_sum = torch.zeros(B, dtype=torch.float64, device=ok.device).index_add_(0, w, c)
            c_n = torch.zeros(B, dtype=torch.int64, device=ok.device).index_add_(0, w, pair.long())
            valid = c_n > 0
            self.curv_sum[layer] += torch.where(valid, c_sum / c_n.clamp(min=1), 0.0).sum()
            self.curv_windows[layer] += valid.sum()
        if self.prompt_entropy:
            self._prompt_entropy(layer, rows(torch.arange(M, device=ok.device)), ok, starts, ends)

    def _prompt_entropy(self, layer, h, ok, starts, ends) -> None:
        """One eigendecomposition per window with ≥ 2 vectors (float64, on the CPU)."""
        hs, oks = h.to(torch.float64).cpu(), ok.cpu()
        total, count = 0.0, 0
        for a, b in zip(starts, ends):
            Z = hs[a:b][oks[a:b]]  # (N, d) the window's vectors
            N = Z.shape[0]
            if N < 2:
                continue
            Z = Z - Z.mean(0)
            nz = torch.linalg.vector_norm(Z, dim=1)
            Z = Z[nz > 0] / nz[nz > 0].unsqueeze(1)
            if Z.shape[0] == 0:
                continue
            G = Z @ Z.T if Z.shape[0] <= Z.shape[1] else Z.T @ Z  # the same non-zero eigenvalues
            lam = torch.linalg.eigvalsh(G).clamp(min=0)
            p = lam / lam.sum()
            p = p[p > 0]
            total += float(-(p * p.log()).sum()) / math.log(min(N, self.d))
            count += 1
        self.pe_sum[layer] += total
        self.pe_windows[layer] += count

    def finish(self) -> None:
        if self._worker is not None:
            self._worker.wait()

    def scalars(self) -> dict[str, list]:
        """Per layer: Σ|h|, the curvature and prompt-entropy sums (None where not measured), by the
        names of `layer_sums`' columns (schema.WINDOW_SCALARS)."""
        self.finish()
        out = {k: getattr(self, k).cpu().tolist() for k in ("sum_abs", "curv_windows", "curv_sum")}
        for k in ("pe_windows", "pe_sum"):
            out[k] = getattr(self, k).cpu().tolist() if self.prompt_entropy else [None] * self.L
        return out

    def top(self, layer: int) -> dict[str, list]:
        """The layer's top-k rows, largest first (entries never filled are left out)."""
        self.finish()
        val = self.top_val[layer].cpu().numpy()
        keep = val >= 0
        meta = self.top_meta[layer].cpu().numpy()[keep]
        return {"rank": list(range(1, int(keep.sum()) + 1)), "abs_value": val[keep].tolist(),
                "dim": self.top_dim[layer].cpu().numpy()[keep].tolist(), "token_id": meta[:, 2].tolist(),
                "document": meta[:, 0].tolist(), "position": meta[:, 1].tolist()}


def top_order(val: torch.Tensor, meta: torch.Tensor, dim: torch.Tensor) -> torch.Tensor:
    """Indices ordering candidates by |h| descending, then document, position, dimension ascending
    (a total order: the merge of shards keeps what one run keeps)."""
    order = torch.argsort(dim, stable=True)
    for key in (meta[:, 1], meta[:, 0]):
        order = order[torch.argsort(key[order], stable=True)]
    return order[torch.argsort(val[order], descending=True, stable=True)]
