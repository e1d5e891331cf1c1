"""The per-head query/key sums of one layer and batch as one function on whole tensors (`qk_step`),
written for torch.compile: the GPU path of `AttentionSums` (attention.py).  Compiled, the float64
upcast, the masking and the division by the norms fuse into the reductions over the batch's
positions, so no float64 copy of the queries and keys is written — the eager path (a gather of the
counted rows into float64 chunks) would write and read ~10 of them.  Eager, it is the same
arithmetic (tested against the chunked path, and compiled with inductor on the CPU).
"""

from __future__ import annotations

import functools

import torch

F64 = torch.float64


def qk_step(query: torch.Tensor, key: torch.Tensor, counted: torch.Tensor):
    """query (B, H, T, hd), key (B, G, T, hd) in any float dtype, counted (B, T) bool.  A position
    counts where it is counted and its query and key are finite and non-zero in every head (ok).
    Returns device tensors (no sync): (n, excluded, ok (B, T), Σq (H, hd), Σq̂ (H, hd), Σ‖q‖² (H,),
    Σk (G, hd), Σk̂ (G, hd), Σ‖k‖² (G,), Σ⟨q̂, k̂⟩ (H,) with each query head's key head), float64."""
    B, H, T, hd = query.shape
    G = key.shape[1]
    qn = torch.linalg.vector_norm(query, dim=-1, dtype=F64)  # (B, H, T)
    kn = torch.linalg.vector_norm(key, dim=-1, dtype=F64)  # (B, G, T)
    ok = counted & (qn.isfinite() & (qn > 0)).all(1) & (kn.isfinite() & (kn > 0)).all(1)  # (B, T)
    okh = ok.unsqueeze(1)  # (B, 1, T)
    q = torch.where(okh.unsqueeze(-1), query.to(F64), 0.0)  # (B, H, T, hd), zero where not ok
    k = torch.where(okh.unsqueeze(-1), key.to(F64), 0.0)
    qu = q * torch.where(okh, qn.reciprocal(), 0.0).unsqueeze(-1)  # q̂
    ku = k * torch.where(okh, kn.reciprocal(), 0.0).unsqueeze(-1)
    dots = (qu.reshape(B, G, H // G, T, hd) * ku.unsqueeze(2)).sum(-1)  # (B, G, H/G, T)
    return (ok.sum(), (counted & ~ok).sum(), ok,
            q.sum((0, 2)), qu.sum((0, 2)), torch.where(okh, qn * qn, 0.0).sum((0, 2)),
            k.sum((0, 2)), ku.sum((0, 2)), torch.where(okh, kn * kn, 0.0).sum((0, 2)),
            dots.sum((0, 3)).reshape(H))


@functools.cache
def compiled_qk_step():
    """`qk_step` under torch.compile, one compiled function per process (B and T marked unbacked on
    every call by `run_qk`: compiled once for any batch shape)."""
    return torch.compile(qk_step, dynamic=None)


def run_qk(fn, query: torch.Tensor, key: torch.Tensor, counted: torch.Tensor):
    """Call the compiled `qk_step` with B and T marked unbacked, torch's recompile limit an error
    (the caller falls back to the eager path) instead of a silent fallback inside torch."""
    import torch._dynamo.decorators  # loaded by torch.compile already; named here for the linters

    mark = torch._dynamo.decorators.mark_unbacked
    for t in (query, key):
        mark(t, 0)
        mark(t, 2)
    mark(counted, 0)
    mark(counted, 1)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return fn(query, key, counted)
