"""Attention on the first token (attention sinks, Gu et al. 2025): per query head, Σᵢ A[i, 0] over
the query positions i ≥ 1 of every window, from a second score pass over the queries and keys the
model's attention kernel receives.

The kernel the model runs (sdpa, flash) does not return its probabilities, so the scores are
computed again as the model's eager attention computes them: s = (q · scaling)·kᵀ, soft-capped where
the model caps them (`softcap`), plus a position bias where the model passes one (T5), under the
mask the kernel applies — the 4-D mask it is handed (additive or boolean), else causal (where the
module is causal), the key padding of a 2-D mask and a sliding window (`sliding_window`, what a
flash kernel applies itself).  Learned sink logits (`s_aux`) join the softmax's denominator.  In
log space: A[i, 0] = exp(s[i, 0] − logsumexp_j s[i, j]), the log-sum-exp over each row's allowed
keys, float32 scores (~1e-7 relative), the sum over positions in float64.  Query rows are taken in
chunks so a chunk's scores (B, H, t, T) stay under CHUNK_SCORES floats; where the mask is the causal
one built here (no 4-D mask given), a chunk's scores stop at its last row (half the work).

On a GPU, where the model needs neither soft-capping nor sink logits, the same probabilities come from
torch's fused attention kernel instead (`fused_first_column`: a one-hot value, float32, its online
softmax in the same log space), without the scores in memory; on a CPU that kernel is no faster.
"""

from __future__ import annotations

import torch

CHUNK_SCORES = 1 << 24  # float32 scores per chunk of query rows (64 MiB)
FUSED_DEVICES = ("cuda",)  # where torch's fused attention kernel computes them (`fused_first_column`)


def allowed_keys(B: int, T: int, rows: slice, device, key_padding: torch.Tensor | None, causal: bool,
                 window: int | None) -> torch.Tensor:
    """(B, 1, t, T) bool: the keys each query row of `rows` may attend (no 4-D mask given)."""
    i = torch.arange(T, device=device)[rows][:, None]  # (t, 1)
    j = torch.arange(T, device=device)[None, :]  # (1, T)
    ok = torch.ones(i.shape[0], T, dtype=torch.bool, device=device)
    if causal:
        ok = ok & (j <= i)
    if window is not None:
        ok = ok & (j > i - window)
    ok = ok[None, None].expand(B, 1, -1, -1)
    if key_padding is not None:  # (B, T): 1 = a token
        ok = ok & key_padding.bool()[:, None, None, :]
    return ok


def fused_first_column(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, bias: torch.Tensor | None,
                       causal: bool, scaling: float, queries: torch.Tensor) -> torch.Tensor:
    """(H,) float64: the same sums from torch's scaled_dot_product_attention over float32 queries and
    keys with a one-hot value (v_0 = e_1, every other v_j = 0), whose output at row i is Σ_j A[i, j] v_j
    = A[i, 0]: its kernels' online softmax (exponentials of differences to each row's running
    maximum, float32) without the (B, H, T, T) scores in memory."""
    B, H, T, _ = query.shape
    G = key.shape[1]
    value = torch.zeros(B, G, T, 8, dtype=torch.float32, device=query.device)  # 8: every kernel's head size
    value[:, :, 0, 0] = 1.0
    if bias is not None:  # T5's position bias joins the mask as an additive float mask
        add = bias.float()
        if mask is not None:
            add = add.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else add + mask.float()
        elif causal:
            add = add.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=query.device).tril(), float("-inf"))
        mask, causal = add, False
    elif mask is not None and mask.dtype != torch.bool:
        mask = mask.float()
    first = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value, attn_mask=mask, is_causal=causal, scale=scaling, enable_gqa=G != H)[..., 0]
    return torch.where(queries[:, None], first, 0.0).to(torch.float64).sum((0, 2))  # (B, H, T) → (H,)


def sink_sums(module, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict,
              queries: torch.Tensor) -> torch.Tensor:
    """(H,) float64: Σ over the query positions `queries` (B, T) bool of the attention on key 0.
    query (B, H, T, hd), key (B, G, T, hd) as the kernel receives them."""
    B, H, T, hd = query.shape
    G = key.shape[1]
    g = H // G
    scaling = kwargs.get("scaling")
    scaling = hd ** -0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    bias = kwargs.get("position_bias")
    s_aux = kwargs.get("s_aux")
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    window = kwargs.get("sliding_window")
    four_d = attention_mask is not None and attention_mask.dim() == 4
    padding = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    if softcap is None and s_aux is None and query.device.type in FUSED_DEVICES:
        mask = attention_mask if four_d else None
        if not four_d and (padding is not None or window is not None):
            mask = allowed_keys(B, T, slice(0, T), query.device, padding, causal and T > 1, window)
        return fused_first_column(query, key, mask, bias, causal and T > 1 and not four_d and mask is None,
                                  scaling, queries)
    qf = query.float() * scaling  # (B, H, T, hd): the scaling folded into the queries
    kt = key.float().transpose(2, 3)[:, :, None]  # (B, G, 1, hd, T)
    out = torch.zeros(H, dtype=torch.float64, device=query.device)
    step = max(1, CHUNK_SCORES // max(1, B * H * T))
    for a in range(0, T, step):
        b = min(a + step, T)
        # keys beyond the chunk's last row are masked for every row of a causal mask this builds itself
        keys = b if not four_d and causal else T
        s = torch.matmul(qf[:, :, a:b].reshape(B, G, g, b - a, hd), kt[..., :keys]).reshape(B, H, b - a, keys)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            s += bias[..., a:b, :keys].float()
        if four_d:
            m = attention_mask[..., a:b, :]
            if m.dtype == torch.bool:
                s.masked_fill_(~m, float("-inf"))
            else:
                s += m.float()
        else:
            s.masked_fill_(~allowed_keys(B, T, slice(a, b), query.device, padding, causal and T > 1, window)[..., :keys],
                           float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (B, H, t)
        if s_aux is not None:
            lse = torch.logaddexp(lse, s_aux.float().reshape(1, H, 1))
        first = torch.exp(s[..., 0] - lse)  # (B, H, t): A[i, 0]
        out += torch.where(queries[:, None, a:b], first, 0.0).to(torch.float64).sum((0, 2))
    return out
