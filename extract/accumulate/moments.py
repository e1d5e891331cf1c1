"""The moments of the raw hidden states, summed in float64: per layer n, Σh, Σhhᵀ and, opt-in, the
cross moments Σ h_l h_{l+1}ᵀ of consecutive layers — what anisotropy, IsoScore, PCA, effective rank,
linearity and CKA are computed from.  Each batch's d×d products run in the chosen precision
(`PRECISIONS`) through the kernels of matmul.py, and are added into float64 sums, so rounding never
accumulates across batches; on a CPU the work runs on the crew beside the token sums (crew.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from common.errors import UserError

from . import gram
from .background import SideStream, Worker, cpu_plan
from .by_type import TypeCounts, weighted_gram
from .crew import Crew, Task
from .kernels import reused
from .matmul import ONEDNN, add_gram_upper, mkl_skips_avx512, mm_bf16, mm_out_dtype, panel_edges
from .paths import first_line, slow_path

PRECISIONS = ("float32", "float64", "bfloat16")  # of the moments' per-batch products


@dataclass(eq=False)
class _Job:
    """One layer's batch on its way into the products (`Moments._job`)."""

    layer: int
    M: int  # rows
    x: list  # the chunks of the copied rows, views of the layer's buffer
    prev: tuple | None  # the previous layer's (layer, chunks, ok, Σh): the cross moment's other side
    tasks: list = field(default_factory=list)
    bad: bool = False  # a non-finite value among the rows (`begin`): no product was added


class Moments:
    """Per layer: n, Σh (d,), Σhhᵀ (d, d); per consecutive pair (l, l+1): Σ h_l h_{l+1}ᵀ — summed in
    float64 over the raw hidden states.  A vector with NaN/inf or zero norm is left out of its layer
    (the caller zeroes its row, so it adds nothing to any sum), and a pair's cross moment only takes
    tokens counted in both layers (`n_pair`; a zeroed row on either side adds nothing).  Counts stay
    on the device: no host sync.

    precision "float64": each batch's d×d products in float64 (products of float32/bf16 values are
    exact in float64; only the float64 sums round).  "float32" (the default): each batch's products
    in float32 — faster on a CPU — added into the float64 sums, so rounding never
    accumulates across batches.  So that float32 products do not lose the covariance to cancellation
    against a large mean, every row of a layer is shifted by a fixed centre c (the layer's first-batch
    mean, in float32) before the product and the shift is undone in float64 at the end: with R the rows
    fed (zeroed ones included) and s = Σh over them (zeroed rows add nothing),

        Σ_rows (h−c)(h−c)ᵀ = Σhhᵀ − c sᵀ − s cᵀ + R ccᵀ,   Σ (h_l−c_l)(h_m−c_m)ᵀ = Σ h_l h_mᵀ − s_l c_mᵀ − c_l s_mᵀ + R c_l c_mᵀ

    so the stored sums mean the same whatever the precision (the error against float64:
    docs/views-guide.md, precision).
    On a CPU the float32 products are taken over chunks of ≤ CHUNK rows, each chunk's products folded
    into the float64 sums: on an AVX-512 x86-64 CPU that MKL would run at AVX2 (AMD's) through oneDNN
    (`onednn_nt`) on the rows transposed ((d, rows) each), on others through torch (MKL) on the rows
    as they are, centred as they are copied; elsewhere through torch, one product per batch.  Each
    chunk's upper triangle is taken by row panels (`panel_edges`).

    On a CPU with more than one intra-op thread the float32 products run on the crew (crew.py, the
    default; `ISO_MOMENTS_WORKER`, background.py): the token sums hand each layer's rows to `begin`,
    whose chunk copies and panel products run beside the token sums of the same rows while the
    forward waits, and `end` adds the counts and Σh — the same tasks `add` runs in order on the
    caller's thread, so the sums are bit-identical.  With `background` (ISO_MOMENTS_WORKER=thread)
    all of a batch's work is queued to one low-priority thread (`Worker`) instead, in the same order;
    the sums (`n`, `s1`, `n_pair`, `s2()`, `cross()`) wait for the queue when read.  The shifted
    rows go to two reused buffers (a fresh (M, d) tensor per layer costs page faults)."""

    QUEUE_BYTES = 256 << 20  # rows waiting for the background thread, at most (one call's always fits)
    CHUNK = 512  # rows per float32 product on oneDNN's path: shorter float32 sums (docs/views-guide.md: precision)

    COPY_TASKS = 4  # tasks that copy a batch's chunks (the products wait for all of them)
    CHUNK_BF16 = 4096  # rows per bf16 product (float32 accumulation inside it): docs/views-guide.md, precision

    def __init__(self, n_layers: int, d: int, device: torch.device | str, cross: bool = True,
                 precision: str = "float32", background: bool | None = None, triton: bool | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"moments precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        dev = torch.device(device)
        self._bf16 = precision == "bfloat16"
        self._n = torch.zeros(n_layers, dtype=torch.int64, device=dev)
        self._s1 = torch.zeros(n_layers, d, dtype=torch.float64, device=dev)
        self._s2 = torch.zeros(n_layers, d, d, dtype=torch.float64, device=dev)  # Σ(h−c)(h−c)ᵀ, upper triangle
        self._cross = torch.zeros(n_layers - 1, d, d, dtype=torch.float64, device=dev) if cross else None
        self._n_pair = torch.zeros(n_layers - 1, dtype=torch.int64, device=dev)
        self._shifted = precision == "float32"
        self._c = torch.zeros(n_layers, d, dtype=torch.float32, device=dev)  # centres (0: not shifted)
        self._c_set = [not self._shifted] * n_layers
        self._rows = [0] * n_layers  # R: rows fed per layer (host ints: shapes, no sync)
        self._pair_rows = [0] * max(n_layers - 1, 0)
        self._pair_s = torch.zeros(max(n_layers - 1, 0), 2, d, dtype=torch.float64, device=dev)  # s_l, s_m over pair batches
        self._prev: tuple | None = None  # the previous layer's rows for its cross moment (`_book`, `_add_bf16`)
        self._by_type = TypeCounts()  # layers whose batches were the embedding's rows (`add_by_type`)
        self._dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}[precision]
        # float32 on a CPU: products of ≤ CHUNK-row chunks, through oneDNN on transposed rows where
        # the CPU has AVX-512 and MKL would not use it (`mkl_skips_avx512`: MKL runs only its AVX2
        # kernels on AMD), else MKL on the rows as they are (no transposed copy)
        self._nt = ONEDNN if self._shifted and dev.type == "cpu" and mkl_skips_avx512() else None
        self._chunked = self._shifted and dev.type == "cpu"
        self._bufs = [None, None]  # the copied rows, layers alternating (`reused`)
        self._scratches = [None] * self.COPY_TASKS  # the copy tasks' centred rows, one per task
        self._split_bufs = [None, None]  # bf16: hi | lo, layers alternating
        self._split: list[bool | None] = [None] * n_layers  # bf16: centred hi+lo rows (decided at the first batch)
        self._ratio: list[float | None] = [None] * n_layers  # bf16: the first batch's ‖μ‖²/tr C per layer
        self._dim_ratio: list[float | None] = [None] * n_layers  # and its max μ_i² / max C_ii
        self._tensor_cores = dev.type == "cuda"  # bf16 products with a float32 output, where torch has them
        self._out_dtype: bool | None = None  # decided at the first bf16 rows (`add`)
        # bf16 on a GPU: gram.py's kernel (on a CPU only where asked: tests, in Triton's interpreter)
        self._triton = self._bf16 and (gram.wanted(dev) if triton is None else triton)
        self.paths: dict[str, str] = {"moments": {
            "float64": "float64", "bfloat16": f"bfloat16 (Triton Gram kernel, float64 every {gram.FLUSH} rows)"
            if self._triton else "bfloat16 (tensor cores, float32 out)" if self._tensor_cores else
            "bfloat16 (float32 products of the upcast rows)",
            "float32": "float32 (centred" + (", oneDNN)" if self._nt is not None else ")")}[precision]}
        if self._bf16:
            self.paths["moments_rows"] = "raw"
        # row panels of each chunk's upper triangle: more, narrower ones on a CPU's chunks (fewer wasted
        # multiply-adds below the diagonal, and tasks for the crew to balance), where they stay ≥ 128 wide,
        # the last halved (`_job`)
        self._panels = min(8, max(2, d // 128)) if self._chunked else 4
        where, threads = "inline", 1
        if dev.type == "cpu":  # the crew by default (crew.py), or a background thread (background.py)
            where, threads = cpu_plan()
            if background is not None:
                where = "thread" if background else "inline"
        elif background:
            where = "stream" if dev.type == "cuda" else "thread"
        self._worker = None
        self._crew = None
        if where == "stream":  # a side stream: the products overlap the forward's kernels, no host sync
            self._worker = SideStream(dev)
        elif where == "thread":
            self._worker = Worker(max_bytes=self.QUEUE_BYTES, threads=threads)
        elif where == "crew" and self._chunked and torch.get_num_threads() > 1:
            self._crew = Crew(torch.get_num_threads())  # one helper per intra-op thread of the forward's

    @property
    def worker(self):
        """The executor the products run on (a Worker thread, a CUDA side stream), or None: inline."""
        return self._worker

    @property
    def crew(self) -> Crew | None:
        """The CPU's crew that runs a layer's token sums beside these products (`begin`), or None."""
        return self._crew

    @property
    def has_cross(self) -> bool:
        return self._cross is not None

    @property
    def by_type(self) -> bool:
        """Whether `add_by_type` may take a batch: the CPU's float32 products, no cross moment (it needs the
        rows), no background thread (its queue keeps the order of additions)."""
        return self._chunked and self._cross is None and self._worker is None

    @property
    def n(self) -> torch.Tensor:
        """(L,) vectors counted per layer."""
        self.finish()
        return self._n

    @property
    def s1(self) -> torch.Tensor:
        """(L, d) float64 Σh per layer."""
        self.finish()
        return self._s1

    @property
    def n_pair(self) -> torch.Tensor:
        """(L − 1,) tokens counted in both layers of each pair."""
        self.finish()
        return self._n_pair

    def add(self, layer: int, h: torch.Tensor, ok: torch.Tensor, s: torch.Tensor | None = None,
            n: torch.Tensor | None = None) -> None:
        """h: (M, d) raw vectors of the batch's counted positions, rows that are not ok zeroed;
        ok: (M,) bool.  The caller must not modify h or ok afterwards (a thread may read them later).
        s: (d,) float64 Σh and n: () ok.sum() of these rows where the caller has them already (the
        token sums' per-window Σh, summed): then no path reads the rows again for them (float64 sums
        of the same values in another order: equal to ~1e-16 relative, exactly where float64 holds
        every partial sum, i.e. unless the rows' exponents span more than ~40 bits)."""
        if self._bf16 and h.dtype != torch.bfloat16:
            raise UserError(f"--moments-precision bfloat16 needs bfloat16 hidden states; layer {layer}'s are "
                            f"{str(h.dtype).removeprefix('torch.')}: use --moments-precision float32")
        dev = self._s1.device
        h, ok = h.to(dev), ok.to(dev)
        if self._bf16 and not self._triton and self._out_dtype is None:  # decided once, on the caller's thread
            self._out_dtype = self._tensor_cores and mm_out_dtype(h.device)
            if self._tensor_cores and not self._out_dtype:
                slow_path(self.paths, "moments", "bfloat16 (float32 products: no mm out_dtype)",
                          f"--moments-precision bfloat16: this torch {torch.__version__} has no torch.mm(..., "
                          f"out_dtype=float32) on {h.device}; the products run in float32 (~10x slower)")
        given = (s.to(dev), n.to(dev)) if s is not None and n is not None else None
        if self._worker is None:
            self._add(layer, h, ok, given)
        else:  # h and ok are this batch's own tensors: nothing else writes them
            self._worker.submit(self._add, layer, h, ok, given, nbytes=h.numel() * h.element_size())

    def _add(self, layer: int, h: torch.Tensor, ok: torch.Tensor, given=None) -> None:
        if self._bf16:
            return self._add_bf16(layer, h, ok, given)
        s, n = given if given is not None else (h.sum(0, dtype=torch.float64), ok.sum())
        if self._shifted and not self._c_set[layer]:
            self._centre(layer, s, n)
        job = self._job(layer, h)
        for task in job.tasks:  # in order on this thread: what the crew runs in parallel (`begin`)
            task.fn()
        self._book(job, ok, s, n)

    def add_by_type(self, layer: int, weight: torch.Tensor, ids: torch.Tensor, ok: torch.Tensor, s: torch.Tensor,
                    n: torch.Tensor) -> None:
        """A batch whose rows are weight[ids] (the input embedding's rows, checked by the caller: by_type.py),
        ids (M,) int64, ok (M,) the rows counted, s and n their Σh and number (as `add`'s): n and Σh now, each
        type's count of counted rows for the products, which `finish` adds once per type, weighted by its
        count (`weighted_gram`).  Only where `by_type` says so."""
        if self._shifted and not self._c_set[layer]:
            self._centre(layer, s, n)
        self._n[layer] += n
        self._s1[layer] += s
        ids = ids[ok]
        self._rows[layer] += len(ids)  # R: the weighted rows are the counted ones (no zeroed rows)
        self._by_type.add(layer, weight, ids)

    # ------------------------------------------------------------ a batch's products as tasks

    def begin(self, layer: int, h: torch.Tensor) -> "_Job | None":
        """The crew's share of `add` (a CPU's float32 rows, the layer's centre known): the batch's chunk
        copies and panel products as tasks (`_Job.tasks`) that need neither n, Σh nor which rows are
        ok, so they run beside the token sums of the same rows; `end` adds the rest.  h: (M, d) the
        rows as gathered, not yet zeroed where not ok (a non-finite row makes the products skip, and
        `end` adds the zeroed rows the plain way).  None: this batch goes through `add`."""
        if self._crew is None or not self._c_set[layer]:  # (a crew exists only for chunked float32 rows)
            return None
        return self._job(layer, h.to(self._s1.device), guard=True)

    def end(self, job: "_Job", h: torch.Tensor, ok: torch.Tensor, s: torch.Tensor, n: torch.Tensor) -> None:
        """After `begin`'s tasks ran: the batch's counts and sums (as `add`'s arguments)."""
        if job.bad:  # nothing was added: the rows, zeroed where not ok, the plain way
            return self._add(job.layer, h, ok, (s, n))
        self._book(job, ok, s, n)

    def _job(self, layer: int, h: torch.Tensor, guard: bool = False) -> "_Job":
        """One batch's products as tasks: the rows copied into chunks of `buf` (centred where the
        products are shifted) — oneDNN's ≤ CHUNK rows transposed, (d, rows); MKL's on a CPU ≤ CHUNK
        rows as they are, (rows, d); elsewhere all M rows, (M, d) — then, after every copy, each row
        panel of the upper triangle (`panel_edges`) and of the cross moment summed over the chunks in
        order, so each entry's float64 additions come in one order whoever runs which panel."""
        M, d = h.shape
        buf = reused(self._bufs, layer % 2, (M * d,), self._dtype, h.device)
        T = self._nt is not None
        step = self.CHUNK if self._chunked else max(M, 1)
        spans = [(a, min(a + step, M)) for a in range(0, M, step)]
        x = [buf[a * d: b * d].view((d, b - a) if T else (b - a, d)) for a, b in spans]
        prev = None
        if self._cross is not None and self._prev is not None and self._prev[0] == layer - 1:
            prev = self._prev  # the previous layer's chunks: the other buffer, the same rows
        job = _Job(layer, M, x, prev)
        c = self._c[layer] if self._shifted else None
        groups = max(1, min(self.COPY_TASKS, len(spans)))
        copies = tuple(Task(functools.partial(self._copy, job, h, spans[i::groups], x[i::groups], c, guard, i))
                       for i in range(groups))
        edges = panel_edges(d, self._panels, halve_last=self._chunked)
        job.tasks = [*copies, *(Task(functools.partial(self._cross_panel, job, a, b), copies)
                                for a, b in edges if prev is not None),
                     *(Task(functools.partial(self._gram_panel, job, a, b), copies) for a, b in edges)]
        return job

    def _copy(self, job: "_Job", h: torch.Tensor, spans, chunks, c, guard: bool, scratch: int = 0) -> None:
        """Rows a:b of h into each chunk, exactly (float32/bf16 into float32, anything into float64),
        less the centre c where there is one (h − c in float32); `guard`: a non-finite value marks the
        job bad.  oneDNN's transposed chunks are centred row by row first, into this task's own
        `scratch` buffer (the rows read once, in order; the guard reads the buffer while it is in cache),
        then transposed."""
        T = self._nt is not None
        for (a, b), xc in zip(spans, chunks):
            if T:  # oneDNN's rows are always centred (float32 products)
                rows = torch.sub(h[a:b], c, out=reused(self._scratches, scratch, (b - a, h.shape[1]), torch.float32,
                                                       h.device))
                xc.copy_(rows.T)
            elif c is not None:
                rows = torch.sub(h[a:b], c, out=xc)
            else:
                rows = xc.copy_(h[a:b])
            if guard and not bool(torch.isfinite(rows.sum())):
                job.bad = True

    def _gram_panel(self, job: "_Job", a: int, b: int) -> None:
        """Rows a:b of the upper triangle, from column a on: Σ over the chunks of their products."""
        if job.bad:
            return
        S = self._s2[job.layer]
        for xc in job.x:
            S[a:b, a:] += self._nt(xc[a:b], xc[a:]) if self._nt is not None else xc[:, a:b].T @ xc[:, a:]

    def _cross_panel(self, job: "_Job", a: int, b: int) -> None:
        """Rows a:b of Σ (h_l − c_l)(h_{l+1} − c_{l+1})ᵀ, l the previous layer: over the chunk pairs."""
        if job.bad:
            return
        C = self._cross[job.layer - 1]
        for p, xc in zip(job.prev[1], job.x):
            C[a:b] += self._nt(p[a:b], xc) if self._nt is not None else p[:, a:b].T @ xc

    def _book(self, job: "_Job", ok: torch.Tensor, s: torch.Tensor, n: torch.Tensor) -> None:
        """A batch's counts and Σh, and the pair's bookkeeping for the cross moment."""
        layer = job.layer
        self._n[layer] += n
        self._rows[layer] += job.M
        self._s1[layer] += s
        if job.prev is not None:
            _, _, pok, ps = job.prev
            self._n_pair[layer - 1] += (pok & ok).sum()
            self._pair_rows[layer - 1] += job.M
            if self._shifted:
                self._pair_s[layer - 1, 0] += ps
                self._pair_s[layer - 1, 1] += s
        if self._cross is not None:
            self._prev = (layer, job.x, ok, s)

    def _centre(self, layer: int, s: torch.Tensor, n: torch.Tensor) -> None:
        """A layer's centre for the float32 products: its first batch's mean, on the device (no sync)."""
        self._c[layer] = (s / n.clamp(min=1)).float()
        self._c_set[layer] = True

    def _add_bf16(self, layer: int, h: torch.Tensor, ok: torch.Tensor, given=None) -> None:
        """precision "bfloat16": products of bf16 rows, every one exact in float32.  On a GPU one
        Triton kernel per product takes all of the batch's rows (gram.py: float32 sums of ≤ gram.FLUSH
        rows on the tensor cores, added into float64 in registers; the split parts made inside it);
        elsewhere float32 accumulation over ≤ CHUNK_BF16 rows per product, each product added into
        the float64 sums.  Only the upper triangle of a layer's Gram matrix is multiplied and
        folded (`_add_sym`, gram.py's tiles); a cross moment is one full product of the two layers'
        rows (views of the rows as given, no copies).  How the rows go in is decided per layer at its first batch
        (`_decide`, one host read per layer, once):

        * a small mean: the raw rows as they are.
        * a large mean (‖μ‖²/tr C > SPLIT_RATIO, or a few massive dimensions: max μ_i²/max C_ii >
          SPLIT_DIM_RATIO; float32 sums of raw products lose the covariance, the error growing like
          these ratios): the rows centred on a bf16 centre c (the first batch's mean, rounded),
          x = h − c in float32 (exact: both have 8-bit significands), split into bf16 parts
          x = hi + lo (+ 2⁻¹⁸|x| at most), and Σ x xᵀ = Σ hiᵀhi + hiᵀlo + loᵀhi + loᵀlo
          (`_add_sym`: 2.25× a raw layer's multiply-adds, 3.6× its upper triangle's); rows that are
          not ok are zeroed after centring, and the shift is undone in float64 when the sums are read
          (`s2`, `cross`).  The error does not grow with the mean."""
        M, d = h.shape
        s, n = given if given is not None else (h.sum(0, dtype=torch.float64), ok.sum())  # (d,) Σh, () rows ok
        self._n[layer] += n
        self._s1[layer] += s
        self._rows[layer] += M
        if self._split[layer] is None:
            self._decide(layer, h, s, n)
        prev = self._prev if self._cross is not None else None
        paired = prev is not None and prev[0] == layer - 1 and prev[1] == M
        if paired:
            self._n_pair[layer - 1] += (prev[2] & ok).sum()
            if self._split[layer] or self._split[layer - 1]:  # Σh over the rows counted in both (cross)
                both = (prev[2] & ok).unsqueeze(1)  # (M, 1)
                self._pair_s[layer - 1, 0] += torch.where(both, prev[4], 0).sum(0, dtype=torch.float64)
                self._pair_s[layer - 1, 1] += torch.where(both, h, 0).sum(0, dtype=torch.float64)
        gram_done = False  # the Gram matrix added by gram.py's kernel
        if self._triton:  # gram.py: every row of the batch in one kernel per product, parts made inside
            side = (h, ok, self._c[layer], self._split[layer])
            try:
                gram.add(self._s2[layer], side)
                gram_done = True
                if paired:
                    gram.add(self._cross[layer - 1], (prev[4], prev[2], self._c[layer - 1], self._split[layer - 1]),
                             side)
                    paired = False
            except gram.launch_errors() as e:  # raised before the kernel added anything: torch's products
                self._no_kernel(h.device, e)
            if self._triton:
                if self._cross is not None:
                    self._prev = (layer, M, ok, None, h)
                return
        parts = self._parts(layer, h, ok)
        if self._cross is not None:  # this layer's rows (or parts) are kept for the next layer's cross moment
            self._prev = (layer, M, ok, parts, h)
        prev_parts = (prev[3] if prev[3] is not None else self._parts(layer - 1, prev[4], prev[2])) if paired else None
        for a in range(0, M, self.CHUNK_BF16):
            P = [x[a: a + self.CHUNK_BF16] for x in parts]  # (k, d) each
            if not gram_done:
                self._add_sym(self._s2[layer], P)
            if paired:
                self._cross[layer - 1] += self._gram([x[a: a + self.CHUNK_BF16] for x in prev_parts], P)

    def _no_kernel(self, device: torch.device, e: BaseException) -> None:
        """gram.py's kernel cannot run here (it raised before adding anything): torch's products from now on,
        with one warning and the path recorded."""
        self._triton = False
        self._out_dtype = self._tensor_cores and mm_out_dtype(device)
        slow_path(self.paths, "moments", "bfloat16 (torch products: the Triton Gram kernel failed)",
                  f"--moments-precision bfloat16: the Triton Gram kernel cannot run on {device} "
                  f"({type(e).__name__}: {first_line(e)}); torch's products instead (ISO_MOMENTS_GRAM=torch skips it)")

    SPLIT_RATIO = 1.0  # ‖μ‖²/tr C above which a layer's bf16 rows are centred and split (see _add_bf16)
    # max_i μ_i² / max_i C_ii above which they are too: a few massive dimensions whose mean dominates
    # the largest variance, though not the trace (a trained model's massive activations).  Raw rows'
    # covariance error, relative to the largest entry, measured against float64 (docs/views-guide.md,
    # precision): 6.3e-6 on a trained model's layer at a ratio of 7.2, 3e-6–6e-5 on synthetic rows at
    # 25–623; the split rows' 6.5e-7 at every ratio.  Below 8, raw rows stay within 1e-5 on CPUs (a GPU's
    # tensor cores err more inside one float32 sum, so gram.py's kernel keeps each to gram.FLUSH rows:
    # docs/views-guide.md, precision)
    SPLIT_DIM_RATIO = 8.0

    def _decide(self, layer: int, h: torch.Tensor, s: torch.Tensor, n: torch.Tensor) -> None:
        """A layer's first batch: raw or centred-and-split rows, from its ‖μ‖²/tr C and max μ_i²/max C_ii
        (one host read)."""
        k = n.clamp(min=1).double()
        mu = s / k  # (d,)
        q = h.double().square().sum(0) / k  # (d,) mean h_i² over the counted rows (zeroed rows add nothing)
        mu2 = mu.square()
        both = torch.stack([mu2.sum() / (q.sum() - mu2.sum()).clamp_min(1e-300),
                            mu2.max() / (q - mu2).max().clamp_min(1e-300)])
        ratio, dim_ratio = both.tolist()
        self._ratio[layer] = ratio
        self._dim_ratio[layer] = dim_ratio
        self._split[layer] = ratio > self.SPLIT_RATIO or dim_ratio > self.SPLIT_DIM_RATIO
        if self._split[layer]:
            self._c[layer] = mu.to(torch.bfloat16).float()  # a bf16 value: h − c is exact in float32
            split = [i for i, x in enumerate(self._split) if x]
            self.paths["moments_rows"] = (f"centred hi+lo in layers {split} (|mu|^2/tr C > {self.SPLIT_RATIO:g} or "
                                          f"max mu_i^2/max C_ii > {self.SPLIT_DIM_RATIO:g}), raw elsewhere")

    def _parts(self, layer: int, h: torch.Tensor, ok: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The rows as they go into the products: (h,), or the centred rows' bf16 parts (hi, lo), views
        of one (M, 2d) buffer per layer parity (the previous layer's parts stay for its cross moment)."""
        if not self._split[layer]:
            return (h,)
        M, d = h.shape
        buf = reused(self._split_bufs, layer % 2, (M, 2 * d), torch.bfloat16, h.device)
        hi, lo = buf[:M, :d], buf[:M, d:]
        x = torch.where(ok.unsqueeze(1), h.float() - self._c[layer], 0.0)  # (M, d) float32, exact
        hi.copy_(x)  # rounded to bf16
        lo.copy_(x.sub_(hi))  # x − hi exact in float32; |lo| ≤ 2⁻⁹|x|
        return hi, lo

    PANELS = 4  # row panels of a bf16 Gram matrix's upper triangle: 5/8 of a full product's multiply-adds

    def _add_sym(self, S: torch.Tensor, P: list[torch.Tensor]) -> None:
        """S (d, d) float64 += the upper triangle of xᵀx (`s2` reads no more), for x the rows (k, d) or
        the sum of their parts hi + lo: by row panels, each panel's products summed in float32 and
        folded once — hiᵀhi + loᵀlo by panels, hiᵀlo once in full for its transpose's share (2.25 k·d²
        multiply-adds for split rows, 0.625 k·d² for raw ones; products of views, no copies)."""
        if self._out_dtype:
            mm = lambda a, b: mm_bf16(a, b, True)  # noqa: E731
        else:  # the rows upcast once (exact), not each panel's operands: the same products
            P = [x.float() for x in P]
            mm = torch.mm
        if len(P) == 1:
            x = P[0]
            add_gram_upper(S, lambda a, b: mm(x[:, a:b].T, x[:, a:]), self.PANELS)
            return
        hi, lo = P
        cross = mm(hi.T, lo)  # (d, d) float32: hiᵀlo, and loᵀhi as its transpose

        def block(a, b):  # rows a:b of the upper triangle's panel of Σ x xᵀ, (b − a, d − a)
            out = mm(hi[:, a:b].T, hi[:, a:])
            out += mm(lo[:, a:b].T, lo[:, a:])
            out += cross[a:b, a:]
            out += cross[a:, a:b].T
            return out

        add_gram_upper(S, block, self.PANELS)

    def _gram(self, A: list[torch.Tensor], B: list[torch.Tensor]) -> torch.Tensor:
        """Σ_{p, q} A_pᵀ B_q, (d, d) float32: one product per pair of parts (views, no copies)."""
        out = None
        for a in A:
            for b in B:
                p = mm_bf16(a.T, b, self._out_dtype)
                out = p if out is None else out.add_(p)
        return out

    def finish(self) -> None:
        """Wait for the queued work (re-raising its error) and add the products by type; the sums are
        complete after."""
        if self._worker is not None:
            self._worker.wait()
        with torch.inference_mode():  # the sums may be inference tensors (made in the forward loop's mode)
            for layer, weight, ids, w in self._by_type.pending():  # the sums take each layer's whole, or nothing
                self._s2[layer] += weighted_gram(weight, ids, w, self._c[layer].to(self._dtype), self.CHUNK,
                                                 self._panels)
                self._by_type.drop(layer)

    def close(self) -> None:
        """Stop the background thread or the crew (always call; idempotent)."""
        if self._worker is not None:
            self._worker.close()
        if self._crew is not None:
            self._crew.close()

    def s2(self, layer: int) -> np.ndarray:
        """Σhhᵀ of a layer, (d, d) float64."""
        self.finish()
        S = self._s2[layer].triu()
        S = S + S.triu(1).T
        if self._shifted:
            c, s = self._c[layer].double(), self._s1[layer]
            S = S + torch.outer(c, s) + torch.outer(s, c) - self._rows[layer] * torch.outer(c, c)
        elif self._bf16 and self._split[layer]:  # centred rows, zeroed where not ok: n rows of −c fewer
            c, s = self._c[layer].double(), self._s1[layer]
            S = S + torch.outer(c, s) + torch.outer(s, c) - self._n[layer].double() * torch.outer(c, c)
        return S.cpu().numpy()

    def cross(self, layer: int) -> np.ndarray:
        """Σ h_l h_{l+1}ᵀ over the tokens counted in layers `layer` and `layer` + 1, (d, d) float64."""
        self.finish()
        C = self._cross[layer]
        if self._shifted:
            a, b = self._c[layer].double(), self._c[layer + 1].double()
            sa, sb = self._pair_s[layer, 0], self._pair_s[layer, 1]
            C = C + torch.outer(sa, b) + torch.outer(a, sb) - self._pair_rows[layer] * torch.outer(a, b)
        elif self._bf16 and (self._split[layer] or self._split[layer + 1]):  # over the rows counted in both
            a, b = self._c[layer].double(), self._c[layer + 1].double()  # 0 for a raw layer
            sa, sb = self._pair_s[layer, 0], self._pair_s[layer, 1]
            C = C + torch.outer(sa, b) + torch.outer(a, sb) - self._n_pair[layer].double() * torch.outer(a, b)
        return C.cpu().numpy()
