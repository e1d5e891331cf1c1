"""Two extracts of one checkpoint into one warehouse, one source each: the second keeps the
parameter tables (its phase line says "parameter tables (kept)").  Prints both phase lines.

    python bench/bench_params_kept.py
"""

import subprocess, sys, tempfile, time, types
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_matrix import build_model, write_pile
args = types.SimpleNamespace(hidden=512, layers=6, vocab=50304, arch="gpt_neox", intermediate=None, kv_heads=None, seq=512)
with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    model = build_model(tmp / "model", args, punctuation=True)
    for name in ("a", "b"):
        write_pile(tmp / f"{name}.jsonl", 5000, args.vocab)
    for name in ("a", "b"):
        t = time.perf_counter()
        p = subprocess.run([sys.executable, "cli.py", "extract", "--model", str(model), "--source", f"{name}={tmp / (name + '.jsonl')}",
                            "--max-length", "512", "--warehouse", str(tmp / "wh")], capture_output=True, text=True)
        line = [l for l in p.stderr.splitlines() if "s: load" in l]
        print(f"source {name}: whole process {time.perf_counter() - t:.1f} s; {line[0] if line else p.stderr[-500:]}")
