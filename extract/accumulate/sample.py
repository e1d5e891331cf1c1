"""The bottom-k sample of raw token vectors per layer (`--sample K`): a sample that merges across
shards and sources into the one a single run would draw (for the intrinsic-dimension views)."""

from __future__ import annotations

import torch


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
        """x: (M, d) raw vectors, rows in the order of the keys given to set_batch."""
        old, new, resort = self._plan
        self.vecs[layer] = torch.cat([self.vecs[layer][old], x[new.to(x.device)].float().cpu()])[resort]
