#!/usr/bin/env bash
# The GPU measurement of the default pass, as one run of at most 8 minutes on one GPU (docs/performance.md,
# "Measuring it on a GPU").  From the repository root:  bash bench/gpu_check.sh  — into $OUT (default
# ./gpu-check), three files: steps.txt (every step's output, appended as each ends), summary.txt (the lines
# that matter) and doctor.json.  GPU_CHECK_SECONDS (default 465) is the whole run's deadline: a shorter one
# leaves device time to rerun a step; GPU_CHECK_STEPS (default: all) the steps to run, by name.  Steps,
# most important first, each with its own time limit and skipped once the deadline is near:
#   env        the GPU, torch and Triton versions; carried wheels (.whl/: duckdb, zstandard, pysbd) installed
#              where the machine lacks them (no package index needed); Numba is not needed: the GPU's sums do
#              not use it, and a CPU accumulator without it takes the eager path (recorded, one warning)
#   p14        Pythia-1.4B shape (d 2,048, 24 blocks, V 50,304; 8 × 2,048 tokens, random bf16 weights): bare
#              forward against the default pass (the Triton token-sum kernels, --triton, + bf16 moments through
#              gram.py's Triton kernel), interleaved batch by batch; one batch's top kernels; the sums checked
#              against the eager path and float64 moments; the paths taken printed
#   tests      the CUDA-only tests (no host sync in the batch loop, the GPU paths against float64, the Triton
#              kernels compiled for the GPU, gram.py's kernel against float64)
#   gram       gram.py's kernel alone per layer (d 2,048, 16,384 rows) under several tiles, launches and flush
#              intervals, raw and split rows, time and covariance error, beside torch's products
#              (bench_gram.py): gram.py's constants are chosen from it
#   p14-torch  p14 with the bf16 moments through torch's products (ISO_MOMENTS_GRAM=torch: the path before
#              gram.py's kernel), for the ratio with and without the kernel
#   p14-split  the same as p14 with every layer's moments centred and split (a trained model's mean-dominated
#              layers)
#   doctor     cli.py doctor at the 1.4B shape on Zipf text (its saved model and text made by the step mk,
#              which runs with it: name both in GPU_CHECK_STEPS)
#   l8         the Llama-3-8B shape (d 4,096, 32 blocks, GQA 8, V 128,256; 4 × 2,048 tokens)
#   blocks     the Triton token-sum kernels alone, per layer, under several block sizes (bench_triton_blocks.py)
#   p14-compiled the same as p14 with the compiled step instead of the Triton kernels (--no-triton)
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
O=${OUT:-gpu-check}
T=$(mktemp -d)  # each step's output, before it is appended to $O/steps.txt
mkdir -p "$O"
END=$((SECONDS + ${GPU_CHECK_SECONDS:-465}))  # no step starts within 40 s of it
P=python3

step() {  # step NAME LIMIT_S COMMAND...: run it within its limit and the run's deadline
    local name=$1 limit=$2 left=$((END - SECONDS))
    shift 2
    if [[ -n ${GPU_CHECK_STEPS:-} && " $GPU_CHECK_STEPS " != *" $name "* ]]; then return; fi
    if ((left <= 40)); then echo "$name skipped: ${left} s left" | tee -a "$O/summary.txt"; return; fi
    ((limit > left)) && limit=$left
    timeout "$limit" "$@" >"$T/$name.txt" 2>&1
    echo "$name rc $? at ${SECONDS} s" | tee -a "$T/$name.txt" >>"$O/summary.txt"
    { echo "=== $name"; cat "$T/$name.txt"; } >>"$O/steps.txt"
}

{
    date -u
    nvidia-smi -L
    if ! $P -c 'import duckdb, zstandard, pysbd' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
        $P -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl &&
            export PYTHONPATH=/tmp/site
    fi
    $P -c 'import torch, triton, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
"triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
    # the code measured (the device copy's .git may be stale): the same command on a checkout names its commit
    echo "code sha256 $(cat cli.py $(find extract common warehouse bench tests queries -type f \( -name '*.py' -o \
        -name '*.sql' -o -name '*.sh' \) | LC_ALL=C sort) | sha256sum | cut -c1-16)"
} >"$T/env.txt" 2>&1
{ echo "=== env"; cat "$T/env.txt"; } >>"$O/steps.txt"
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD

B="bench/bench_extract.py --device cuda --dtype bfloat16 --direct --moments --no-write --batches 4"
P14="--hidden 2048 --layers 24 --batch 8 --seq 2048"
step p14 120 $P $B $P14 --triton --profile --check
step tests 120 $P -m pytest tests/test_gpu_path.py tests/test_accumulate.py tests/test_triton.py tests/test_gram.py -p no:xdist \
    -p no:cacheprovider -k "cuda or gpu_paths or triton or lack or gram or rounds"
step gram 90 $P bench/bench_gram.py --d 2048 --rows 16384
ISO_MOMENTS_GRAM=torch step p14-torch 90 $P $B $P14 --triton
step p14-split 90 $P $B $P14 --split-all
step mk 75 $P -c "
import numpy as n, types, pathlib as q
from bench.bench_extract import build_model
build_model(q.Path('/tmp/p14'), types.SimpleNamespace(arch='gpt_neox', vocab=50304, hidden=2048, layers=24, seq=2048,
                                                      intermediate=None, kv_heads=None))
g = n.random.default_rng(0); p = n.arange(1, 50305) ** -1.1
q.Path('/tmp/zipf.txt').write_text('\n'.join(' '.join('t%d' % i for i in g.choice(50304, 2048, p=p / p.sum()))
                                             for _ in range(72)))"
step doctor 130 $P cli.py doctor --model /tmp/p14 --source zipf=/tmp/zipf.txt --seconds 20 --out "$O/doctor.json"
step l8 120 $P $B --arch llama --hidden 4096 --layers 32 --intermediate 14336 --kv-heads 8 --vocab 128256 \
    --batch 4 --seq 2048
step blocks 90 $P bench/bench_triton_blocks.py
step p14-compiled 90 $P $B $P14 --no-triton --check
grep -E "^(===|torch|GPU|20)|ratio|tok/s|paths|peak|check|moments bfloat16|passed|failed|skipped|random |mean |massive |BLOCK_|^NORMS_D=|^ROWS=" \
    "$O/steps.txt" >>"$O/summary.txt"
cat "$O/summary.txt"
