"""Per-(layer, token) sums of unit vectors, accumulated without drift.

For every batch and layer the activations are upcast to float64, normalised (û = h/‖h‖) and
summed per token type into a per-batch partial (at most B·T terms), which is folded into the
float64 accumulator.  Normalising in float64 keeps ‖û‖² = 1 to ~1e-16, so identical vectors
give an Intra-Sim of 1 to ~1e-12 (float32 normalisation leaves errors of ~1e-7).  Vectors with
a NaN/inf component or zero norm are counted per layer and excluded, never summed.
"""

from __future__ import annotations

import torch


class TokenSums:
    """sums[layer, token] = Σ û (float64), counts[layer, token] = n."""

    def __init__(self, n_layers: int, rows: int, d: int, device: torch.device | str,
                 master_device: torch.device | str | None = None):
        self.device = torch.device(device)
        self.master = torch.device(master_device or device)
        self.sums = torch.zeros(n_layers, rows, d, dtype=torch.float64, device=self.master)
        self.counts = torch.zeros(n_layers, rows, dtype=torch.int64, device=self.master)
        self.nonfinite = torch.zeros(n_layers, dtype=torch.int64, device=self.master)
        self.zero = torch.zeros(n_layers, dtype=torch.int64, device=self.master)
        self._batch = None

    def set_batch(self, input_ids: torch.Tensor, counted: torch.Tensor) -> None:
        """input_ids, counted: (B, T); counted marks the positions that enter the statistics."""
        sel = counted.reshape(-1).nonzero().squeeze(1)  # (M,)
        ids = input_ids.reshape(-1).index_select(0, sel)  # (M,)
        uniq, inv = torch.unique(ids, return_inverse=True)  # (U,), (M,)
        self._batch = (sel, uniq, inv, uniq.to(self.master))

    def add(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden: (B, T, d) in any float dtype."""
        sel, uniq, inv, uniq_master = self._batch
        d = hidden.shape[-1]
        x = hidden.reshape(-1, d).index_select(0, sel).double()  # (M, d)
        norm = torch.linalg.vector_norm(x, dim=1)  # (M,)
        finite = torch.isfinite(norm)
        ok = finite & (norm > 0)
        u = torch.where(ok[:, None], x / torch.where(ok, norm, 1.0)[:, None], 0.0)  # (M, d)
        partial = torch.zeros(len(uniq), d, dtype=torch.float64, device=x.device)
        partial.index_add_(0, inv, u)  # (U, d), one batch
        count = torch.zeros(len(uniq), dtype=torch.int64, device=x.device).index_add_(0, inv, ok.long())
        self.sums[layer].index_add_(0, uniq_master, partial.to(self.master))
        self.counts[layer].index_add_(0, uniq_master, count.to(self.master))
        self.nonfinite[layer] += (~finite).sum().to(self.master)
        self.zero[layer] += (finite & (norm == 0)).sum().to(self.master)
