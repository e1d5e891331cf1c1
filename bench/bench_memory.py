"""Benchmark: memory of extraction for a large vocabulary, through the user's command.

Builds a 4-block Llama-style toy with a 128,256-token vocabulary (Llama-3's) and d = 256, saved
with `save_pretrained` (tokenizer: one word per id), and runs `cli.py extract` as a child
process, reporting its peak RSS (ru_maxrss):

  1. text of 40k tokens drawn by a Zipf law (s = 1.1), as in real text: the sparse
     accumulators hold only the token types seen;
  2. text of 200k tokens drawn uniformly, touching ~100k token types with 6 blocks (8 layer
     indices): dense float64 accumulators would need 8 · 128,256 · 256 · 8 B = 2.1 GB and the
     sparse ones ~1.7 GB; run once unbudgeted and once with --memory-budget 512MB (spills), and
     the two warehouses are compared (float64 vectors: equal to 1e-12).

    python bench/bench_memory.py
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import run_script  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 128_256


def build(directory: Path, layers: int, d: int = 256) -> Path:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * d, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=VOCAB - 1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    words = {f"t{i}": i for i in range(VOCAB - 3)}  # text tokens; the last three ids are special
    words.update({"<unk>": VOCAB - 3, "<pad>": VOCAB - 2, "<s>": VOCAB - 1})
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", VOCAB - 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                            bos_token="<s>").save_pretrained(directory)
    os.sync()  # written pages must reach the disk before the kernel can drop them from RSS (MADV_PAGEOUT)
    return directory


def text(path: Path, tokens: int, zipf: bool) -> Path:
    rng = np.random.default_rng(0)
    if zipf:
        p = np.arange(1, VOCAB - 2) ** -1.1
        p /= p.sum()
        ids = rng.choice(VOCAB - 3, size=tokens, p=p)
    else:
        ids = rng.integers(0, VOCAB - 3, size=tokens)
    lines = [" ".join(f"t{i}" for i in ids[a:a + 500]) for a in range(0, tokens, 500)]  # + BOS: 501 ≤ 512
    path.write_text("\n".join(lines) + "\n")
    return path


def run(model: Path, source: Path, wh: Path, *extra: str) -> tuple[float, float, dict]:
    """(seconds, peak RSS in GB, the data entry's stats) of one extract in a child process."""
    seconds, gb, r = run_script(ROOT / "cli.py", "extract", "--model", str(model), "--source", f"s={source}",
                                "--warehouse", str(wh), "--device", "cpu", "--max-length", "512",
                                "--vector-dtype", "float64", *extra)
    if r.returncode or gb != gb:
        sys.exit(f"extract failed:\n{r.stderr[-2000:]}")
    manifest = json.loads((wh / "manifest.json").read_text())
    stats = next(e["stats"] for e in manifest["entries"].values() if e["kind"] == "data")
    return seconds, gb, stats


def sums(wh: Path) -> dict:
    manifest = json.loads((wh / "manifest.json").read_text())
    f = next(e["files"]["token_sums"] for e in manifest["entries"].values() if e["kind"] == "data")
    t = pq.read_table(wh / f, columns=["layer", "token_id", "n", "vec"])
    vec = np.stack(t.column("vec").to_numpy(zero_copy_only=False))
    return {"keys": list(zip(t.column("layer").to_pylist(), t.column("token_id").to_pylist())),
            "n": t.column("n").to_numpy(), "vec": vec}


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="isomem-"))
    try:
        measure_all(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ~11 GB of models and warehouses


def measure_all(tmp: Path) -> None:
    print(f"{time.strftime('%Y-%m-%d')}, {sys.platform}, python {sys.version.split()[0]}")
    small = build(tmp / "toy4", layers=4)
    s, gb, st = run(small, text(tmp / "zipf.txt", 40_000, True), tmp / "wh-zipf")
    print(f"1. 4 blocks, vocab 128,256, d 256, {st['tokens']} Zipf tokens: {s:.1f} s, peak RSS {gb:.2f} GB; "
          f"accumulator peak {st['accumulator_peak_bytes'] / 1e6:.0f} MB, {st['spills']} spills "
          f"(dense: {6 * VOCAB * 256 * 8 / 1e9:.2f} GB)")
    big = build(tmp / "toy6", layers=6)
    uni = text(tmp / "uniform.txt", 200_000, False)
    s1, gb1, st1 = run(big, uni, tmp / "wh-free", "--memory-budget", "100GB")
    s2, gb2, st2 = run(big, uni, tmp / "wh-512", "--memory-budget", "512MB")
    print(f"2. 6 blocks, 200k uniform tokens (dense accumulators {8 * VOCAB * 256 * 8 / 1e9:.2f} GB):")
    print(f"   unbudgeted      : {s1:.1f} s, peak RSS {gb1:.2f} GB, accumulator peak {st1['accumulator_peak_bytes'] / 1e6:.0f} MB")
    print(f"   --memory-budget 512MB: {s2:.1f} s, peak RSS {gb2:.2f} GB, accumulator peak "
          f"{st2['accumulator_peak_bytes'] / 1e6:.0f} MB, {st2['spills']} spills")
    a, b = sums(tmp / "wh-free"), sums(tmp / "wh-512")
    same = a["keys"] == b["keys"] and (a["n"] == b["n"]).all()
    diff = float(np.abs(a["vec"] - b["vec"]).max())
    print(f"   budgeted == unbudgeted: same (layer, token) rows and counts {same}, max |Δ Σû| {diff:.1e}")


if __name__ == "__main__":
    main()
