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
    """Per layer taken by type: the embedding's weight, each token type's count of counted rows and the
    batches counted, pending until their products are added (`pending`, then `drop`)."""

    def __init__(self):
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer → (weight, counts (V′,) int64)
        self.batches: dict[int, int] = {}  # layer → batches taken by type in the run
        self._mixed: set[int] = set()  # layers with batches per token after some by type

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
        self.batches[layer] = self.batches.get(layer, 0) + 1

    def describe(self, layer: int, per_token: bool = False) -> str | None:
        """The code path's line for `layer`, None where no batch of it went by type; `per_token`: a batch of
        it goes per token now (after some went by type: a later batch was not the embedding's rows)."""
        k = self.batches.get(layer, 0)
        if not k:
            return None
        if per_token:
            self._mixed.add(layer)
        if layer in self._mixed:
            return f"layer {layer}: its first {k} batches by type (their rows were the input embedding's), the rest per token"
        return f"layer {layer} (its rows are the input embedding's)"

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
