"""A run's settings and what it reports per source.

`Settings` is the checked, resolved form of the extract options (extract/options.py's
`make_settings` builds it): its defaults are the declared ones (extract/declared.py) where the option
passes through unchanged, and a CPU run's resolved value where it does not (device, dtype, shard,
moments' precision, memory budget, module overrides).  Every field but `read_shard` is recorded with
the run's manifest entries.  `SourceResult` is what one source (or one value of a split source) did.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import UserError

from ..accumulate import PRECISIONS
from ..declared import default

DEFAULT_MAX_LENGTH = 4096  # windows of at most this many tokens unless --max-length says otherwise
DEFAULT_BATCH_WINDOWS = 8  # the default token budget of a batch: this many full windows,
DEFAULT_BATCH_TOKENS = 4096  # and at least this many tokens (short --max-length)


@dataclass
class Settings:
    unit: str = default("unit")  # document | sentence
    max_length: int | None = default("max_length")  # default: the model's context
    max_tokens: int | None = default("max_tokens")  # per source (and shard)
    batch_size: int | None = default("batch_size")  # windows per batch at most (alone: exactly)
    batch_tokens: int | None = default("batch_tokens")  # padded tokens per batch at most (default: DEFAULT_BATCH_WINDOWS windows)
    device: str = "cpu"  # resolved: cuda when available unless --device says otherwise
    dtype: str = "float32"  # resolved: bfloat16 on cuda, float32 on cpu unless --dtype says otherwise
    shard: tuple[int, int] = (1, 1)  # resolved from --shard, torchrun or a Slurm array
    vector_dtype: str = default("vector_dtype")
    trust_remote_code: bool = default("trust_remote_code")
    params_only: bool = default("params_only")
    accumulator_device: str | None = default("accumulator_device")
    skip_done: bool = default("skip_done")  # keep finished (checkpoint, source, shard) runs with the same settings
    skip_twins: bool = default("skip_twins")  # skip a checkpoint whose weights another one in the warehouse has
    moments: bool = default("moments")  # Σh, Σhhᵀ per layer (anisotropy, IsoScore, spectra)
    cross_moments: bool = default("cross_moments")  # also Σ h_l h_{l+1}ᵀ per consecutive pair (opt-in)
    moments_precision: str = "float32"  # resolved (check_moments_precision): float32 (shifted), bfloat16 or float64
    sequences: bool = False  # per-window measures (resolved: --sequences or --prompt-entropy)
    prompt_entropy: bool = default("prompt_entropy")  # per-window prompt entropy (an eigendecomposition per window and layer)
    sample: int = default("sample")  # K: bottom-k sample of token vectors per layer (0 = none)
    attention: bool = False  # per-head query/key sums (resolved: --attention, --attention-moments or --attention-sinks)
    attention_moments: bool = default("attention_moments")  # and their per-head second moments
    attention_sinks: bool = default("attention_sinks")  # and the attention on each window's first token
    special_tokens: bool = default("special_tokens")  # count the positions of the tokenizer's special tokens
    memory_budget: int | None = None  # bytes for the token sums (resolved from --memory-budget); None: half the memory free
    spill_dir: str | None = default("spill_dir")  # where sums beyond the budget are spilled (None: the system's temp dir)
    modules: dict = field(default_factory=dict)  # --module ROLE=PATH overrides of the discovered layout
    split_limit: int = default("split_limit")  # a split source: at most this many distinct values
    read_shard: tuple[int, int] | None = None  # the documents read, where not `shard` (a rank of a reducing torchrun job)
    replace: bool = default("replace")  # drop committed partials this run conflicts with instead of refusing
    fold: bool = default("fold")  # fold the partials into the merged tables in the commit (False: append them, pending)


def recorded_setting(settings: dict, key: str):
    """A run's recorded setting; runs from before --cross-moments stored the cross moments with
    every moments run, runs from before --attention measured no attention."""
    if key == "cross_moments" and key not in settings:
        return settings.get("moments")
    if key in ("attention", "attention_moments", "attention_sinks") and key not in settings:
        return False  # runs from before the attention sums had none
    return settings.get(key)


def check_moments_precision(precision: str | None, device: str, dtype: str) -> str:
    """--moments-precision as given, or its default: bfloat16 where the moments live on a GPU and the
    model computes in bfloat16 (exact products on tensor cores), else float32."""
    if precision is None:
        return "bfloat16" if device.startswith("cuda") and dtype == "bfloat16" else "float32"
    if precision not in PRECISIONS:
        raise UserError(f"--moments-precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "bfloat16" and dtype != "bfloat16":
        raise UserError(f"--moments-precision bfloat16 needs --dtype bfloat16 (the products are exact only for "
                        f"bfloat16 hidden states), not {dtype}")
    return precision


@dataclass
class SourceResult:
    source: str
    tokens: int = 0
    documents: int = 0
    skipped: int = 0  # documents with no token
    windows: int = 0
    nonfinite: int = 0
    zero: int = 0
    replaced_lines: int = 0
    skipped_lines: int = 0
    filtered: int = 0
    seconds: float = 0.0
    spills: int = 0  # eviction runs written to disk to stay under the memory budget
    unread: int = 0  # documents read but left when --max-tokens ran out before them (not counted in `documents`)
    spill_bytes: int = 0  # bytes written to spill files (eviction runs and their merges)
    accumulator_peak_bytes: int = 0
    vector_dtype: str | None = None  # the token vectors as stored: --vector-dtype, float32 where float16 overflows
    files: dict = field(default_factory=dict)
    paths: dict = field(default_factory=dict)  # code paths taken: the token sums' and the moments'
