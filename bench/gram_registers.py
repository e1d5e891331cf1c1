"""gram.py's kernel compiled for NVIDIA GPUs without one: Triton's own compiler and ptxas, then cuobjdump's
resource usage — registers, stack (spills) and shared memory per tile, step, warps and row kind — so
that gram.py's tile is one that keeps its float32 and float64 accumulators in registers.

    python bench/gram_registers.py                      # sm80 and sm90, a few tiles
    python bench/gram_registers.py --archs 90 --configs 128x64x32:8,128x128x64:8
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled, not interpreted
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from extract.accumulate import gram  # noqa: E402
from extract.accumulate.triton_kernels import gram_kernel  # noqa: E402

SIGNATURE = {"a": "*bf16", "sa": "i32", "ok_a": "*u8", "c_a": "*fp32", "b": "*bf16", "sb": "i32", "ok_b": "*u8",
             "c_b": "*fp32", "tiles": "*i32", "M": "i32", "out": "*fp64", "D": "constexpr", "SPLIT_A": "constexpr",
             "SPLIT_B": "constexpr", "BM": "constexpr", "BN": "constexpr", "BK": "constexpr", "FLUSH": "constexpr",
             "DOT": "constexpr", "PRECISION": "constexpr"}
ALIGNED = ("a", "sa", "ok_a", "c_a", "b", "sb", "ok_b", "c_b", "tiles", "out")  # 16-byte aligned, as in Moments


def usage(arch: int, bm: int, bn: int, bk: int, warps: int, split: bool, d: int) -> str:
    names = list(SIGNATURE)
    consts = {"D": d, "SPLIT_A": split, "SPLIT_B": split, "BM": bm, "BN": bn, "BK": bk, "FLUSH": gram.FLUSH,
              "DOT": tl.bfloat16, "PRECISION": "tf32"}
    src = ASTSource(fn=gram_kernel, signature=SIGNATURE, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": gram.STAGES})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = next((x.strip() for x in out.splitlines() if "REG:" in x), "?")
    return " ".join(w for w in line.split() if w.split(":")[0] in ("REG", "STACK")) + f" shared {k.metadata.shared}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="80,90")
    ap.add_argument("--configs", default=f"{gram.BM}x{gram.BN}x{gram.BK}:{gram.WARPS},128x64x64:8,128x128x32:8,"
                                         "128x128x64:8,64x64x32:4")
    ap.add_argument("--d", type=int, default=2048)
    args = ap.parse_args()
    print(f"triton {triton.__version__}; gram.py's default {gram.BM}x{gram.BN}x{gram.BK}:{gram.WARPS}, "
          f"{gram.STAGES} stages, FLUSH {gram.FLUSH}; d {args.d}")
    for arch in (int(a) for a in args.archs.split(",")):
        for config in args.configs.split(","):
            tile, warps = config.split(":")
            bm, bn, bk = (int(x) for x in tile.split("x"))
            for split in (False, True):
                print(f"sm{arch} {config:14} {'split' if split else 'raw':5} "
                      f"{usage(arch, bm, bn, bk, int(warps), split, args.d)}", flush=True)


if __name__ == "__main__":
    main()
