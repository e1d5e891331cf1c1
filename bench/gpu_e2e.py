"""End to end on a GPU, through the user's command: `cli.py extract --device cuda` against
`--device cpu` on the same saved model and text, and a small `--memory-budget` (spills) against
none.  Reads the Parquet files with pyarrow only (no DuckDB needed on the GPU machine).

    python bench/gpu_e2e.py            # needs a CUDA device
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent


def build(tmp: Path, vocab: int = 50304, hidden: int = 256, layers: int = 4, docs: int = 2000) -> tuple[Path, Path]:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import AutoModelForCausalLM, GPTNeoXConfig, PreTrainedTokenizerFast

    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                           intermediate_size=4 * hidden, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp / "model")
    words = {f"t{i}": i for i in range(vocab - 1)}
    words["<s>"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab - 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", bos_token="<s>").save_pretrained(tmp / "model")
    rng = np.random.default_rng(0)
    p = np.arange(1, vocab) ** -1.1
    p /= p.sum()
    lines = [" ".join(f"t{i}" for i in rng.choice(vocab - 1, size=rng.integers(20, 200), p=p)) for _ in range(docs)]
    (tmp / "text.txt").write_text("\n".join(lines) + "\n")
    return tmp / "model", tmp / "text.txt"


def extract(model: Path, text: Path, wh: Path, *extra: str) -> float:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(ROOT / "cli.py"), "extract", "--model", str(model), "--source",
                        f"s={text}", "--warehouse", str(wh), "--max-length", "512", "--batch-size", "16", "--vector-dtype", "float64", *extra],
                       capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"extract {' '.join(extra)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def table(wh: Path, name: str):
    manifest = json.loads((wh / "manifest.json").read_text())
    files = [e["files"][name] for e in manifest["entries"].values() if name in e["files"]]
    return pa.concat_tables([pq.read_table(wh / f) for f in files]).to_pydict()


def sums(wh: Path) -> dict:
    t = table(wh, "token_sums")
    return {(l, tok): (n, np.array(v)) for l, tok, n, v in zip(t["layer"], t["token_id"], t["n"], t["vec"])}


def compare(a: dict, b: dict) -> tuple[bool, float]:
    same = a.keys() == b.keys() and all(a[k][0] == b[k][0] for k in a)
    worst = max(float(np.abs(a[k][1] - b[k][1]).max() / max(1.0, np.abs(b[k][1]).max())) for k in a) if same else float("nan")
    return same, worst


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="gpu-e2e-"))
    model, text = build(tmp)
    times = {}
    times["cpu float32"] = extract(model, text, tmp / "cpu", "--device", "cpu", "--dtype", "float32")
    times["cuda float32"] = extract(model, text, tmp / "gpu32", "--device", "cuda", "--dtype", "float32")
    times["cuda float32 budget 64MB"] = extract(model, text, tmp / "gpu32b", "--device", "cuda", "--dtype", "float32",
                                                "--memory-budget", "64MB")
    times["cuda bfloat16"] = extract(model, text, tmp / "gpu16", "--device", "cuda", "--dtype", "bfloat16")
    for k, v in times.items():
        print(f"{k:28s} {v:6.1f} s (whole process)")
    cpu, gpu, gpub = sums(tmp / "cpu"), sums(tmp / "gpu32"), sums(tmp / "gpu32b")
    print(f"(layer, token) rows: {len(cpu)}")
    same, worst = compare(gpu, cpu)
    print(f"cuda float32 vs cpu float32: same keys and counts {same}, max relative |Δ Σû| {worst:.2e}")
    same, worst = compare(gpub, gpu)
    stats = json.loads((tmp / "gpu32b" / "manifest.json").read_text())
    spills = [e["stats"].get("spills") for e in stats["entries"].values() if e["kind"] == "data"]
    print(f"cuda budget 64MB vs unbudgeted: same keys and counts {same}, max relative |Δ Σû| {worst:.2e}, spills {spills}")
    pc, pg = table(tmp / "cpu", "partition_fn"), table(tmp / "gpu32", "partition_fn")
    d = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(pg["log_z_pos"], pc["log_z_pos"]))
    print(f"partition function log Z (computed on the GPU in float64 vs on the CPU): max relative diff {d:.2e}")
    lay = [e["provenance"].get("layout") for e in stats["entries"].values() if e["kind"] == "data"][0]
    print(f"layout: {lay}")


if __name__ == "__main__":
    main()
