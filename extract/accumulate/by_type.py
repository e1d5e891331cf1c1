"""Layer 0's moments by token type.  In most decoder models (GPT-NeoX, Llama, Mistral, Qwen, …) the first
hidden state is the input embedding's own row for the token: h_i = E[id_i].  Then a batch's Σ h hᵀ over
its tokens is Σ_t n_t E_t E_tᵀ over the token types it holds, n_t the type's count — so the per-token
products of that layer can wait: each type's count is kept, and the types' rows, each weighted by its
count, are multiplied once when the sums are read (U rows for the U types seen, never more than the
tokens: every type seen was seen once at least).

Whether a batch qualifies is checked exactly, every batch: its layer-0 rows must equal E's rows for its
ids bit for bit (a model that adds position embeddings, scales the embedding or normalises it fails the
check and takes the per-token products, as does any batch with a NaN).  Used by the CPU's float32 moments
(moments.py) where no cross moment needs layer 0's rows.
"""

from __future__ import annotations

import torch


def embedding_rows(h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the rows h (M, d) are exactly weight[ids] (weight (V, d), ids (M,) int64)."""
    if weight.dim() != 2 or weight.shape[1] != h.shape[1] or weight.dtype != h.dtype or weight.device != h.device:
        return False
    return torch.equal(h, weight.index_select(0, ids))


class EmbeddingRows:
    """The input embedding's weight (V, d), and whether batches are still checked against it: a batch whose
    layer-0 rows are not its rows stops the checks for the rest of the run (a model whose first hidden
    state is no embedding row fails them all, and checks once)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.checking = True

    def match(self, h: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this batch's layer-0 rows h (M, d) are weight[ids], ids (M,) int64."""
        self.checking = self.checking and embedding_rows(h, self.weight, ids)
        return self.checking


class TypeCounts:
    """Per layer taken by type: the embedding's weight and each token type's count of counted rows,
    pending until `take`."""

    def __init__(self):
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer → (weight, counts (V′,) int64)

    def __bool__(self) -> bool:
        return bool(self._pending)

    def add(self, layer: int, weight: torch.Tensor, ids: torch.Tensor) -> None:
        """Count one batch's rows of `layer`, each the row weight[id] for id in ids (M,) int64."""
        counts = torch.bincount(ids)
        if layer in self._pending:
            old = self._pending[layer][1]
            if len(old) < len(counts):
                old, counts = counts, old
            old[: len(counts)] += counts
            counts = old
        self._pending[layer] = (weight.detach(), counts)  # a model's parameter: no graph when the sums are read

    def take(self):
        """Each pending layer's (layer, rows X (U, d), counts w (U,) int64) over the types counted, then
        nothing pending."""
        pending, self._pending = self._pending, {}
        for layer, (weight, counts) in pending.items():
            ids = counts.nonzero().squeeze(1)  # (U,)
            yield layer, weight.index_select(0, ids.to(weight.device)), counts[ids]
