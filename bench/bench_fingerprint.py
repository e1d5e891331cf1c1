"""The tensor fingerprint of a 7B checkpoint: its cost cold (the files' pages evicted from the page
cache with posix_fadvise DONTNEED), warm (in the page cache) and again with the fingerprint cache.

    python bench/bench_fingerprint.py --dir /path/on/the/disk/to/measure [--keep]

Writes a Llama-2-7B-shaped checkpoint of random bf16 bytes (6.74e9 parameters, 13.5 GB, two shards
and an index as the hub holds it) under DIR, measures, and removes it (unless --keep).  Also reads
the files once with plain reads (no hashing) for the disk's own speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from extract import fingerprint as fp  # noqa: E402

D, V, FF, LAYERS = 4096, 32000, 11008, 32


def tensors() -> list[tuple[str, list[int]]]:
    out = [("model.embed_tokens.weight", [V, D])]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + f"self_attn.{m}_proj.weight", [D, D]) for m in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", [FF, D]), (p + "mlp.up_proj.weight", [FF, D]),
                (p + "mlp.down_proj.weight", [D, FF]), (p + "input_layernorm.weight", [D]),
                (p + "post_attention_layernorm.weight", [D])]
    return out + [("model.norm.weight", [D]), ("lm_head.weight", [V, D])]


def write_shard(path: Path, items: list[tuple[str, list[int]]], rng) -> int:
    header, offset = {}, 0
    for name, shape in items:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        left = offset
        while left:
            n = min(left, 64 << 20)
            f.write(rng.bytes(n))
            left -= n
    return offset


def evict(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)  # (dirty pages cannot be dropped)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def plain_read(files: list[Path]) -> float:
    buf = bytearray(8 << 20)
    t = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass
    return time.perf_counter() - t


def timed(directory: Path) -> tuple[float, float, str, int]:
    fp.MEMO.clear()
    before, cpu = fp.READ["bytes"], time.process_time()
    t = time.perf_counter()
    print_ = fp.tensor_fingerprint(directory)
    return time.perf_counter() - t, time.process_time() - cpu, print_, fp.READ["bytes"] - before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="fp-cache-")  # a cache of its own
    root = Path(args.dir) / "llama-7b-random"
    root.mkdir(parents=True, exist_ok=True)
    items = tensors()
    half = 1 + 23 * 9  # the embedding and 23 blocks in the first shard (~9.9 GB), the rest in the second
    shards = {"model-00001-of-00002.safetensors": items[:half], "model-00002-of-00002.safetensors": items[half:]}
    try:
        t = time.perf_counter()
        rng = np.random.default_rng(0)
        total = sum(write_shard(root / name, part, rng) for name, part in shards.items())
        (root / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": {n: s for s, part in shards.items() for n, _ in part}}))
        files = [root / s for s in shards]
        print(f"wrote {total / 1e9:.2f} GB of tensors ({sum(int(np.prod(s)) for _, s in items) / 1e9:.2f}e9 bf16 "
              f"parameters) in {time.perf_counter() - t:.0f} s; {fp.workers()} hashing threads; load {os.getloadavg()}")
        evict(files)
        print(f"plain read, cold: {plain_read(files):.1f} s")
        print(f"plain read, warm: {plain_read(files):.1f} s")
        for label in ("cold", "warm"):
            if label == "cold":
                evict(files)
            wall, cpu, got, read = timed(root)
            print(f"fingerprint, {label} page cache: {wall:.1f} s wall, {cpu:.1f} s CPU, {read / 1e9:.2f} GB hashed "
                  f"({read / wall / 1e9:.2f} GB/s); {got}; load {os.getloadavg()}")
            if label == "cold":  # the warm run hashes again, and fills the cache
                shutil.rmtree(Path(os.environ["XDG_CACHE_HOME"], "isotropy-warehouse", fp.CACHE_DIR), ignore_errors=True)
        wall, cpu, got, read = timed(root)
        print(f"fingerprint, rerun with the cache: {wall * 1e3:.1f} ms wall, {read} bytes hashed; {got}")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(os.environ["XDG_CACHE_HOME"], ignore_errors=True)


if __name__ == "__main__":
    main()
