"""The matrix-product back-ends of the moments (moments.py): which kernel multiplies a batch's rows.

* float32 on an x86-64 CPU with AVX-512: oneDNN on the rows transposed (`ONEDNN`; torch's MKL runs
  only its AVX2 kernels on AMD CPUs, oneDNN picks its kernels by instruction set);
* float32 elsewhere on a CPU: torch (MKL) on the rows as they are (`avx512()` says which);
* bfloat16: every product exact in float32 — one tensor-core GEMM with a float32 output where this
  torch offers `torch.mm(..., out_dtype=)` on the device (`mm_out_dtype`), else the operands upcast;
* `add_gram_upper`, `panel_edges`: the upper triangle of xᵀx by row panels, whichever kernel makes each panel.
"""

from __future__ import annotations

import functools
import platform

import torch


def add_gram_upper(S: torch.Tensor, block, panels: int) -> None:
    """S (d, d) float64 += the upper triangle of xᵀx, by row panels: rows a:b of xᵀx from column a
    on, `block(a, b)` (b − a, d − a) in the products' dtype, each added into the float64 sums —
    (panels + 1)/(2 · panels) of a full product's multiply-adds (3/4 for 2, 5/8 for 4; a symmetric
    rank-k update, which torch lacks, would be 1/2).  Entries below the diagonal inside a panel are
    added too and never read (`Moments.s2` takes the upper triangle)."""
    for a, b in panel_edges(S.shape[0], panels):
        S[a:b, a:] += block(a, b)


def panel_edges(d: int, panels: int, halve_last: bool = False) -> list[tuple[int, int]]:
    """(a, b) of each of `panels` row panels of equal width over d rows (fewer where d is smaller), the
    widest-reaching first: panel a:b of an upper triangle spans columns a:d.  `halve_last`: the last
    panel as two of half its width (the crew's last tasks: two short ones end together where one
    would run alone)."""
    k = max(1, min(panels, d))
    edges = [round(i * d / k) for i in range(k + 1)]
    if halve_last and edges[-1] - edges[-2] >= 2:
        edges.insert(-1, (edges[-2] + edges[-1]) // 2)
    return list(zip(edges, edges[1:]))


def onednn_nt():
    """a bᵀ for contiguous float32 CPU tensors a (i, M), b (j, M), through oneDNN (the op torch's
    own compiler uses for float32 linear layers), or None where it is missing or not x86-64.  Why:
    on AMD CPUs torch's MKL runs its AVX2 kernels even where the CPU has AVX-512; oneDNN picks its
    kernels by instruction set.  Only contiguous operands are fed to it: other layouts cost a copy
    inside, column slices a slow generic path."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        op = torch.ops.mkldnn._linear_pointwise
        a = torch.arange(12, dtype=torch.float32).reshape(3, 4)
        b = a[:2].contiguous()
        if not torch.equal(op(a, b, None, "none", [], ""), a @ b.T):  # small integers: exact
            return None
    except (AttributeError, RuntimeError):
        return None
    return lambda a, b: op(a, b, None, "none", [], "")  # linear(a, weight b) = a bᵀ


ONEDNN = onednn_nt()


@functools.cache
def avx512() -> bool:
    """Whether torch's CPU kernels run at AVX-512 here.  Why it matters: on an AVX2-only CPU oneDNN
    and MKL multiply equally fast, and MKL reads the rows transposed in place, so the transposed copy
    oneDNN's path needs is saved."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@functools.cache
def mkl_skips_avx512() -> bool:
    """Whether this CPU has AVX-512 that MKL's float32 products would not use: AVX-512 on a CPU that
    is not Intel's (MKL dispatches its AVX-512 kernels on Intel CPUs only).  There oneDNN's products
    on transposed rows win despite the transposed copy; on Intel CPUs MKL reading the rows in place
    does, and on AVX2-only CPUs the two multiply equally fast (`avx512`)."""
    if not avx512():
        return False
    try:
        with open("/proc/cpuinfo") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), "")
    except OSError:
        vendor = ""
    return vendor != "GenuineIntel"


def mm_bf16(a: torch.Tensor, b: torch.Tensor, out_dtype: bool = False) -> torch.Tensor:
    """a b in float32 for bfloat16 a (i, k), b (k, j): every product exact (8-bit significands),
    accumulated in float32.  `out_dtype` (a GPU where `mm_out_dtype` said yes): one tensor-core GEMM
    with a float32 output (no rounding of the result to bf16); else the operands upcast exactly to
    float32, the same arithmetic in another summation order (the CPU's path; on a GPU much slower)."""
    if out_dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


@functools.cache
def mm_out_dtype(device: torch.device) -> bool:
    """Whether this torch has `torch.mm(..., out_dtype=)` (bf16 in, float32 out) on `device` — the
    device of the rows (under torchrun each rank its own GPU; never a default "cuda", which would open
    a context on GPU 0 in every rank); asked once per device, on first use (not at import)."""
    try:
        a = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False
