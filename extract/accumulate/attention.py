"""Per-head query/key sums of every block's self-attention, in float64, from the queries and keys
the model hands its attention kernel (after the rotary embedding: what attention uses).

Per layer l (the 0-based block) and query head h, over the counted positions whose queries and keys
are finite and non-zero in every head (n; the others are counted in `excluded`):
Σq, Σq̂ (hd,), Σ‖q‖², Σ⟨q̂ᵢ, k̂ᵢ⟩ with q head h's key head h // (H / H_kv) (as HF's `repeat_kv` pairs
them); per key head: Σk, Σk̂, Σ‖k‖²; with `moments` the uncentred Σqqᵀ and Σkkᵀ (hd × hd each); with
`sinks` Σᵢ A[i, 0] over the query positions i ≥ 1 of every window (`sinks.py`).  Everything is a
sum, so shards, sources and machines merge by addition.

Cost per layer and batch: on a CPU one gather of the M counted rows of q (M, H, hd) and k (M, H_kv,
hd) into float64 and ~8 passes over them (norms, units, sums), CHUNK rows at a time so the copies stay
in cache; on a GPU the compiled `qk_step` (qk_kernels.py) over the whole tensors, the upcast fused
into its reductions (the chunked path where the compiler fails); with `moments` two batched
(hd × M)(M × hd) float64 products per head.  Nothing here waits for the device: counts stay device
tensors, the positions come from the host with the batch.
"""

from __future__ import annotations

import numpy as np
import torch

from .paths import first_line, slow_path
from .qk_kernels import compiled_qk_step, run_qk
from .sinks import sink_sums

F64 = torch.float64


class LayerState:
    """The sums of one layer: H query heads, G key heads of width hd, on `device`."""

    def __init__(self, H: int, G: int, hd: int, device: torch.device, moments: bool, sinks: bool):
        z = lambda *shape: torch.zeros(*shape, dtype=F64, device=device)  # noqa: E731
        self.H, self.G, self.hd = H, G, hd
        self.n = torch.zeros((), dtype=torch.int64, device=device)
        self.excluded = torch.zeros((), dtype=torch.int64, device=device)
        self.sum_q, self.unit_q, self.sq_q = z(H, hd), z(H, hd), z(H)
        self.sum_k, self.unit_k, self.sq_k = z(G, hd), z(G, hd), z(G)
        self.pair = z(H)  # Σ⟨q̂ᵢ, k̂ᵢ⟩ with each query head's key head
        self.s2_q = z(H, hd, hd) if moments else None
        self.s2_k = z(G, hd, hd) if moments else None
        self.sink = z(H) if sinks else None  # Σ_i A[i, 0] per query head
        self.sink_n = 0  # query positions i ≥ 1 (host: from the batch's window lengths)
        self.windows = 0
        self.max_window = 0

    TENSORS = ("n", "excluded", "sum_q", "unit_q", "sq_q", "sum_k", "unit_k", "sq_k", "pair", "s2_q", "s2_k", "sink")


class AttentionSums:
    """The per-head sums of every layer.  `shapes`: per layer (H, H_kv, hd), from the probe of
    extract/attention.py; `set_batch` before each forward, then `add` from the attention wrapper."""

    CHUNK_CPU = 256  # counted rows per float64 step on a CPU (2 MiB at d 1024: the copies stay in cache)
    CHUNK_GPU = 8192  # and on a GPU (bounded memory: 8192 · d · 8 bytes per float64 copy)

    def __init__(self, shapes: list[tuple[int, int, int]], device: torch.device | str, moments: bool = False,
                 sinks: bool = False, compiled: bool | None = None):
        self.device = torch.device(device)
        self.moments, self.sinks = moments, sinks
        self.layers = [LayerState(H, G, hd, self.device, moments, sinks) for H, G, hd in shapes]
        self.chunk = self.CHUNK_GPU if self.device.type == "cuda" else self.CHUNK_CPU
        use = self.device.type == "cuda" if compiled is None else compiled  # the GPU: `qk_step` compiled
        self._compiled = compiled_qk_step() if use else None
        self._compiled_once = False
        self.paths = {"attention_step": "compiled" if use else "eager"}  # recorded with the run's stats
        self._batch = None

    def set_batch(self, counted: torch.Tensor, mask: torch.Tensor | None) -> None:
        """counted: (B, T) bool on the host, the positions the token sums count; mask: (B, T) the
        attention mask (1 = a token, 0 = padding; None: no padding).  No device sync."""
        B, T = counted.shape
        sel_np = np.flatnonzero(counted.reshape(-1).numpy())  # (M,) flat positions b·T + t
        lens = (mask.sum(1).numpy() if mask is not None else np.full(B, T)).astype(np.int64)  # (B,) window lengths
        sel = (self._to_device(torch.from_numpy(sel_np // T)), self._to_device(torch.from_numpy(sel_np % T)))
        queries = None
        if self.sinks:  # query positions i ≥ 1 of each window (right-padded: position 0 is column 0)
            q = (np.arange(T)[None, :] >= 1) & (np.arange(T)[None, :] < lens[:, None])  # (B, T)
            queries = self._to_device(torch.from_numpy(q))
        counted_dev = self._to_device(counted) if self._compiled is not None else None
        self._batch = (B, T, sel, len(sel_np), queries, lens, counted_dev)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def add(self, layer: int, module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict) -> None:
        """query (B, H, T, hd), key (B, H_kv, T, hd): what the block's attention kernel receives."""
        B, T, sel, M, queries, lens, counted = self._batch
        st = self.layers[layer]
        if query.shape[0] != B or query.shape[2] != T or key.shape[2] != T:
            raise RuntimeError(f"attention of layer {layer}: queries {tuple(query.shape)} and keys {tuple(key.shape)} "
                               f"do not match the batch's {B} × {T} positions")
        if self.sinks:
            st.sink += sink_sums(module, query, key, attention_mask, kwargs, queries)
            st.sink_n += int((lens - 1).clip(min=0).sum())
            st.windows += B
            st.max_window = max(st.max_window, int(lens.max()))
        if M == 0:
            return
        if self._compiled is not None and self._add_compiled(st, query, key, counted, sel):
            return
        H, G, hd = st.H, st.G, st.hd
        rows, cols = sel  # (M,) each counted position's window and place in it
        for a in range(0, M, self.chunk):
            r, c = rows[a:a + self.chunk], cols[a:a + self.chunk]
            x = torch.empty(len(r), H + G, hd, dtype=F64, device=self.device)  # (m, H + G, hd): q heads, then k
            x[:, :H] = query[r, :, c]  # gathered from (B, H, T, hd) as it is: no copy of the whole tensor
            x[:, H:] = key[r, :, c]
            self._add_rows(st, x)

    def _add_compiled(self, st: LayerState, query, key, counted, sel) -> bool:
        """The compiled `qk_step` (whole tensors, no float64 copies); False where it cannot run (then
        the eager path from here on, same sums, with one warning)."""
        try:
            out = run_qk(self._compiled, query, key, counted)
        except Exception as e:  # no Triton / compiler here, or a recompile failed or hit the limit
            why = "recompile" if self._compiled_once else "compile"
            slow_path(self.paths, "attention_step", f"eager ({why} failed: {type(e).__name__})",
                      f"torch.compile of the attention sums' step: {why} failed ({type(e).__name__}: "
                      f"{first_line(e)}); using the eager path (slower, same sums)")
            self._compiled = None
            return False
        self._compiled_once = True
        n, excluded, ok, *sums = out
        st.n += n
        st.excluded += excluded
        for name, t in zip(("sum_q", "unit_q", "sq_q", "sum_k", "unit_k", "sq_k", "pair"), sums):
            getattr(st, name).add_(t)
        if st.s2_q is not None:  # the second moments: the counted rows gathered (products, not fused)
            rows, cols = sel
            keep = ok[rows, cols][:, None, None]  # (M, 1, 1)
            for a in range(0, len(rows), self.chunk):
                r, c, k = rows[a:a + self.chunk], cols[a:a + self.chunk], keep[a:a + self.chunk]
                q = torch.where(k, query[r, :, c].to(F64), 0.0).transpose(0, 1)  # (H, m, hd)
                kk = torch.where(k, key[r, :, c].to(F64), 0.0).transpose(0, 1)
                st.s2_q += torch.bmm(q.transpose(1, 2), q)
                st.s2_k += torch.bmm(kk.transpose(1, 2), kk)
        return True

    def _add_rows(self, st: LayerState, x: torch.Tensor) -> None:
        """x (m, H + G, hd): the float64 query heads then key heads of m counted positions."""
        m, H, G = x.shape[0], st.H, st.G
        norm = torch.linalg.vector_norm(x, dim=2)  # (m, H + G)
        ok = (torch.isfinite(norm) & (norm > 0)).all(1)  # (m,) every head's q and k finite and non-zero
        st.n += ok.sum()
        st.excluded += m - ok.sum()
        if self.device.type != "cpu" or not bool(ok.all()):  # a check that costs nothing on the CPU
            x = torch.where(ok[:, None, None], x, 0.0)  # NaN/inf or zero rows out of every sum
            norm = torch.where(ok[:, None], norm, 1.0)
            sq = (norm * norm * ok[:, None]).sum(0)
        else:
            sq = (norm * norm).sum(0)
        s = x.sum(0)  # (H + G, hd)
        if st.s2_q is not None:  # (H, hd, m) @ (H, m, hd): uncentred second moments per head
            xt = x.permute(1, 0, 2)  # (H + G, m, hd)
            s2 = torch.bmm(xt.transpose(1, 2), xt)
            st.s2_q += s2[:H]
            st.s2_k += s2[H:]
        x.mul_(norm.reciprocal_()[:, :, None])  # units, zero where excluded
        u = x.sum(0)
        st.sum_q += s[:H]
        st.sum_k += s[H:]
        st.unit_q += u[:H]
        st.unit_k += u[H:]
        st.sq_q += sq[:H]
        st.sq_k += sq[H:]
        g = H // G  # query head h = j·g + i reads key head j
        st.pair += (x[:, :H].reshape(m, G, g, st.hd) * x[:, H:, None, :]).sum((0, 3)).reshape(H)

    def rows(self) -> list[dict]:
        """Per layer and head, the table's rows (extract/run/tables.py writes them): 'query' rows per
        query head, 'key' rows per key head; host values."""
        out = []
        for layer, st in enumerate(self.layers):
            n, excluded = int(st.n), int(st.excluded)
            g = st.H // st.G
            for role, count in (("query", st.H), ("key", st.G)):
                s = (st.sum_q, st.unit_q, st.sq_q, st.s2_q) if role == "query" else (st.sum_k, st.unit_k, st.sq_k, st.s2_k)
                S, U, Q, S2 = (None if t is None else t.cpu().numpy() for t in s)
                pair = st.pair.cpu().numpy() if role == "query" else None
                sink = st.sink.cpu().numpy() if role == "query" and st.sink is not None else None
                for h in range(count):
                    out.append({
                        "layer": layer, "role": role, "head": h, "kv_head": h // g if role == "query" else h,
                        "n": n, "excluded": excluded, "sum": S[h], "sum_unit": U[h], "sum_sq": float(Q[h]),
                        "pair_cos": float(pair[h]) if pair is not None else None,
                        "s2": S2[h].reshape(-1) if S2 is not None else None,
                        "sink_n": st.sink_n if sink is not None else None,
                        "sink_sum": float(sink[h]) if sink is not None else None,
                        "sink_windows": st.windows if sink is not None else None,
                        "sink_max_window": st.max_window if sink is not None else None,
                    })
        return out
