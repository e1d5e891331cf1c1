"""Per-(layer, token) sums of unit vectors, accumulated without drift.

For every batch and layer the activations are upcast to float64, normalised (û = h/‖h‖) and
added per token type into the float64 accumulator (`index_add_`); when the accumulator lives
on another device (host memory for a model whose sums do not fit beside it on the GPU), a
per-batch partial over the batch's distinct tokens is summed first and folded in.  Normalising in float64 keeps ‖û‖² = 1 to ~1e-16, so identical vectors
give an Intra-Sim of 1 to ~1e-12 (float32 normalisation leaves errors of ~1e-7).  Vectors with
a NaN/inf component or zero norm are counted per layer and excluded, never summed.
"""

from __future__ import annotations

import torch


class TokenSums:
    """sums[layer, token] = Σ û (float64), counts[layer, token] = n."""

    def __init__(self, n_layers: int, rows: int, d: int, device: torch.device | str,
                 master_device: torch.device | str | None = None, fold_partials: bool | None = None):
        self.device = torch.device(device)
        self.master = torch.device(master_device or device)
        self.fold_partials = self.master != self.device if fold_partials is None else fold_partials
        self.sums = torch.zeros(n_layers, rows, d, dtype=torch.float64, device=self.master)
        self.counts = torch.zeros(n_layers, rows, dtype=torch.int64, device=self.master)
        self.nonfinite = torch.zeros(n_layers, dtype=torch.int64, device=self.master)
        self.zero = torch.zeros(n_layers, dtype=torch.int64, device=self.master)
        self._batch = None
        self.moments: Moments | None = None  # optional consumers of the raw (unnormalised) vectors
        self.sample: Sample | None = None

    def set_batch(self, input_ids: torch.Tensor, counted: torch.Tensor) -> int:
        """input_ids, counted: (B, T); counted marks the positions that enter the statistics.
        Returns their number M."""
        sel = counted.reshape(-1).nonzero().squeeze(1)  # (M,)
        ids = input_ids.reshape(-1).index_select(0, sel)  # (M,)
        if not self.fold_partials:
            self._batch = (sel, ids, None, None)
        else:  # fold a per-batch partial over the batch's distinct tokens into the remote master
            uniq, inv = torch.unique(ids, return_inverse=True)  # (U,), (M,)
            self._batch = (sel, inv, uniq, uniq.to(self.master))
        self._ones = torch.ones(len(ids), dtype=torch.int64, device=ids.device)
        return len(ids)

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: (B, T, d) in any float dtype."""
        sel, index, uniq, uniq_master = self._batch
        d = hidden.shape[-1]
        x = hidden.reshape(-1, d).index_select(0, sel).double()  # (M, d) float64
        norm = torch.linalg.vector_norm(x, dim=1)  # (M,)
        ok = torch.isfinite(norm) & (norm > 0)  # (M,)
        all_ok = bool(ok.all())  # the one host sync per layer and batch
        if self.moments is not None:
            self.moments.add(layer, x, ok, all_ok)
        if self.sample is not None:
            self.sample.add(layer, x)
        x.div_(norm.unsqueeze(1))  # û
        counts = self._ones
        if not all_ok:  # rare: NaN/inf or zero vectors are counted, then zeroed out
            finite = torch.isfinite(norm)
            self.nonfinite[layer] += (~finite).sum().to(self.master)
            self.zero[layer] += (finite & (norm == 0)).sum().to(self.master)
            x[~ok] = 0.0
            counts = ok.long()
        if uniq is None:
            self.sums[layer].index_add_(0, index, x)
            self.counts[layer].index_add_(0, index, counts)
        else:
            partial = torch.zeros(len(uniq), d, dtype=torch.float64, device=x.device)
            partial.index_add_(0, index, x)  # (U, d)
            count = torch.zeros(len(uniq), dtype=torch.int64, device=x.device).index_add_(0, index, counts)
            self.sums[layer].index_add_(0, uniq_master, partial.to(self.master))
            self.counts[layer].index_add_(0, uniq_master, count.to(self.master))


class Moments:
    """Per layer: n, Σh (d,), Σhhᵀ (d, d); per consecutive pair (l, l+1): Σ h_l h_{l+1}ᵀ — float64,
    over the raw hidden states.  A vector with NaN/inf or zero norm is left out of its layer, and
    a pair's cross moment only takes tokens counted in both layers (`n_pair`)."""

    def __init__(self, n_layers: int, d: int, device: torch.device | str, cross: bool = True):
        dev = torch.device(device)
        self.n = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self.s1 = torch.zeros(n_layers, d, dtype=torch.float64, device=dev)
        self.s2 = torch.zeros(n_layers, d, d, dtype=torch.float64, device=dev)
        self.cross = torch.zeros(n_layers - 1, d, d, dtype=torch.float64, device=dev) if cross else None
        self.n_pair = torch.zeros(n_layers - 1, dtype=torch.int64, device=dev)
        self._prev: tuple[int, torch.Tensor, torch.Tensor, bool] | None = None

    def add(self, layer: int, x: torch.Tensor, ok: torch.Tensor, all_ok: bool) -> None:
        """x: (M, d) float64 raw vectors of the batch's counted positions; ok: (M,) bool,
        all_ok = ok.all() (computed once by the caller)."""
        xs = x if all_ok else x[ok]  # (M', d)
        self.n[layer] += len(xs)
        self.s1[layer] += xs.sum(0)
        self.s2[layer].addmm_(xs.T, xs)
        if self.cross is not None and self._prev is not None and self._prev[0] == layer - 1:
            _, px, pok, p_all_ok = self._prev
            if p_all_ok and all_ok:
                self.cross[layer - 1].addmm_(px.T, x)
                self.n_pair[layer - 1] += len(x)
            else:
                both = pok & ok
                self.cross[layer - 1].addmm_(px[both].T, x[both])
                self.n_pair[layer - 1] += int(both.sum())
        if self.cross is not None:
            self._prev = (layer, x.clone(), ok, all_ok)  # x is normalised in place afterwards


class Sample:
    """A bottom-k sample of K token vectors per layer: the K counted positions with the smallest
    position keys (a hash of source, document and position).  The union of two samples' bottom-k
    is the bottom-k of the union, so shards and sources merge into the sample one run would draw."""

    def __init__(self, n_layers: int, k: int, d: int):
        self.k = k
        self.keys = torch.empty(0, dtype=torch.int64)  # (S,) kept keys, ascending
        self.meta = torch.empty(0, 3, dtype=torch.int64)  # (S, 3): document, position, token id
        self.vecs = [torch.empty(0, d, dtype=torch.float32) for _ in range(n_layers)]
        self._plan = None

    def set_batch(self, keys: torch.Tensor, meta: torch.Tensor) -> None:
        """keys: (M,) int64 position keys of the batch's counted positions; meta: (M, 3)."""
        keys, meta = keys.cpu(), meta.cpu()
        allk = torch.cat([self.keys, keys])
        order = torch.argsort(allk)[: self.k]  # bottom-k of old ∪ new
        order = order[torch.argsort(allk[order])]
        old = order[order < len(self.keys)]
        new = order[order >= len(self.keys)] - len(self.keys)
        self.keys = torch.cat([self.keys[old], keys[new]])
        self.meta = torch.cat([self.meta[old], meta[new]])
        resort = torch.argsort(self.keys)
        self.keys, self.meta = self.keys[resort], self.meta[resort]
        self._plan = (old, new, resort)

    def add(self, layer: int, x: torch.Tensor) -> None:
        """x: (M, d) float64 raw vectors, rows in the order of the keys given to set_batch."""
        old, new, resort = self._plan
        self.vecs[layer] = torch.cat([self.vecs[layer][old], x[new.to(x.device)].float().cpu()])[resort]
