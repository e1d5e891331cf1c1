"""What extract_model / probe_isotropy cost on a Pythia-70M-shaped random model on the CPU: the weights
fingerprint (sha256 of every state_dict tensor, extract/fingerprint.py), and one probe's phases (parameter tables, forward, write, commit).

Run: PYTHONPATH=$PWD OMP_NUM_THREADS=1 python bench/bench_api.py [--tokens 5000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=5000)
    a = ap.parse_args()
    import tiny
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from extract.api import probe_isotropy, weights_fingerprint

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=50304, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                           intermediate_size=2048, max_position_embeddings=2048, rotary_pct=0.25)
    model = GPTNeoXForCausalLM(config).train()
    n = sum(p.numel() for p in model.parameters())
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(f"model: Pythia-70M shape, {n / 1e6:.1f} M parameters, state_dict {nbytes / 1e6:.0f} MB float32, "
          f"torch threads {torch.get_num_threads()}")
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        t = time.perf_counter()
        weights_fingerprint(m)
        dt = time.perf_counter() - t
        b = sum(t.numel() * t.element_size() for t in m.state_dict().values())
        print(f"weights_fingerprint {str(dtype)[6:]}: {dt:.2f} s for {b / 1e6:.0f} MB ({b / dt / 1e9:.2f} GB/s)")
    model = model.to(torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = tiny.make_tokenizer(tmp / "tok")
        src = tmp / "probe.txt"
        src.write_text("\n".join(tiny.corpus(2000, seed=3)) + "\n")
        for i in range(2):
            t = time.perf_counter()
            numbers = probe_isotropy(model, tok, f"probe={src}", tmp / "wh", name="bench", step=i,
                                     max_tokens=a.tokens, max_length=512, log=print)
            print(f"probe_isotropy {a.tokens} tokens: {time.perf_counter() - t:.1f} s in all; {numbers}")


if __name__ == "__main__":
    main()
