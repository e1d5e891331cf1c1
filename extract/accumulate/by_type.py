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

from .matmul import add_gram_upper


def embedding_rows(h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> bool:
    """Whether the rows h (M, d) are exactly weight[ids] (weight (V, d), ids (M,) int64)."""
    if weight.dim() != 2 or weight.shape[1] != h.shape[1] or weight.dtype != h.dtype or weight.device != h.device:
        return False
    return torch.equal(h, weight.index_select(0, ids))


class EmbeddingRows:
    """The input embedding's weight (V, d), whether batches are still checked against it, and how many
    matched: a batch whose layer-0 rows are not its rows stops the checks for the rest of the run (a model
    whose first hidden state is no embedding row fails them all, and checks once)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.checking = True
        self.batches = 0  # batches whose layer-0 rows were the embedding's

    def match(self, h: torch.Tensor, ids: torch.Tensor) -> bool:
        """Whether this batch's layer-0 rows h (M, d) are weight[ids], ids (M,) int64."""
        self.checking = self.checking and embedding_rows(h, self.weight, ids)
        self.batches += self.checking
        return self.checking

    def path(self) -> str | None:
        """The run's code path for layer 0's moments, None where no batch went by type."""
        if not self.batches:
            return None
        if self.checking:
            return "layer 0 (its rows are the input embedding's)"
        return (f"layer 0: its first {self.batches} batches by type (their rows were the input embedding's), "
                "the rest per token")


class TypeCounts:
    """Per layer taken by type: the embedding's weight and each token type's count of counted rows,
    pending until their products are added (`pending`, then `drop`)."""

    def __init__(self):
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer → (weight, counts (V′,) int64)

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

    def pending(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Each pending layer's (layer, weight, ids (U,) of the types counted, their counts (U,) int64); they
        stay pending until `drop`."""
        out = []
        for layer, (weight, counts) in self._pending.items():
            ids = counts.nonzero().squeeze(1)  # (U,)
            out.append((layer, weight, ids, counts[ids]))
        return out

    def drop(self, layer: int) -> None:
        """The layer's pending counts are in the sums now."""
        del self._pending[layer]


def weighted_gram(weight: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, c: torch.Tensor, chunk: int,
                  panels: int) -> torch.Tensor:
    """Σ_t w_t (x_t − c)(x_t − c)ᵀ, (d, d) float64, upper triangle (below it partly filled, never read), over
    the types ids (U,), x_t = weight[t], w (U,) their counts: what the counted rows of those types add to
    the moments' shifted sums, each type's product once.  As the rows' own products: in c's dtype by row
    panels over ≤ `chunk` types (w_t (x_t − c) rounded once), each added into float64.  The rows are
    gathered `chunk` at a time: no copy of the embedding."""
    S = torch.zeros(c.shape[0], c.shape[0], dtype=torch.float64, device=c.device)
    for a in range(0, len(ids), chunk):
        x = weight.index_select(0, ids[a: a + chunk].to(weight.device)).to(c.dtype) - c  # (k, d)
        xw = x * w[a: a + chunk, None].to(c.dtype)
        add_gram_upper(S, lambda p, q: xw[:, p:q].T @ x[:, p:], panels)
    return S
