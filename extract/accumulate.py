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

    def set_batch(self, input_ids: torch.Tensor, counted: torch.Tensor) -> None:
        """input_ids, counted: (B, T); counted marks the positions that enter the statistics."""
        sel = counted.reshape(-1).nonzero().squeeze(1)  # (M,)
        ids = input_ids.reshape(-1).index_select(0, sel)  # (M,)
        if not self.fold_partials:
            self._batch = (sel, ids, None, None)
        else:  # fold a per-batch partial over the batch's distinct tokens into the remote master
            uniq, inv = torch.unique(ids, return_inverse=True)  # (U,), (M,)
            self._batch = (sel, inv, uniq, uniq.to(self.master))
        self._ones = torch.ones(len(ids), dtype=torch.int64, device=ids.device)

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: (B, T, d) in any float dtype."""
        sel, index, uniq, uniq_master = self._batch
        d = hidden.shape[-1]
        x = hidden.reshape(-1, d).index_select(0, sel).double()  # (M, d) float64
        norm = torch.linalg.vector_norm(x, dim=1)  # (M,)
        ok = torch.isfinite(norm) & (norm > 0)  # (M,)
        x.div_(norm.unsqueeze(1))  # û
        counts = self._ones
        if not bool(ok.all()):  # rare: NaN/inf or zero vectors are counted, then zeroed out
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
