"""Every option of `extract`, declared once: name, kind, default, group, help and flag spellings.

The command line builds the `extract` command's parameters and its grouped --help from `OPTIONS`
(isotropy_warehouse/extract_options.py); the Python API's keywords and defaults (`extract.api`), a sweep
file's [settings] and per-source keys (`extract/sweep.py`), the source options (`SOURCE_OPTIONS`),
the run's `Settings` defaults and the settings a run records and --skip-done compares
(`RESULT_SETTINGS`) all read it.  This module imports nothing heavy: `cli.py --help` loads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.default_warehouse import DEFAULT_WAREHOUSE, ENV_VAR

REQUIRED = ...  # the default of an option that must be given
KINDS = ("str", "int", "flag", "list", "path")

# (key, title) of each group, in the order --help shows them.
GROUPS = (
    ("model", "Model and checkpoints"),
    ("data", "Data"),
    ("batching", "Batching"),
    ("measures", "Measures"),
    ("storage", "Storage and scale-out"),
    ("advanced", "Advanced (rarely needed; each says when)"),
)


@dataclass(frozen=True)
class Option:
    """One option of `extract`.  `name`: the Python name (the command's parameter, the API's keyword,
    a sweep file's key).  `kind`: str | int | flag (on/off) | list (repeatable) | path.  `flags`: the
    command line's spellings, the long one first (short ones after it).  `off`: the flag that turns a
    flag option off (--no-moments), if it has one.  `source`: an option of how a source is read (a
    sweep may give it per source).  `recorded`: the key under which a run's manifest entry records
    it among its settings (None: not recorded there).  `result`: it changes a run's numbers, so
    --skip-done keeps a finished run only where the recorded value is the same."""

    name: str
    kind: str
    default: object
    group: str
    help: str
    flags: tuple[str, ...]
    off: str | None = None
    source: bool = False
    recorded: str | None = None
    result: bool = False

    @property
    def flag(self) -> str:
        """The long spelling that turns it on or takes its value, e.g. --unit, --moments."""
        return self.flags[0]

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def value_default(self):
        """The default as a value (None for a required option)."""
        return None if self.required else self.default


def _option(name: str, kind: str, default, group: str, help: str, *, flags: tuple[str, ...] = (),
            off: str | None = None, source: bool = False, recorded: bool | str = True,
            result: bool = False) -> Option:
    assert kind in KINDS and group in dict(GROUPS), (name, kind, group)
    flags = flags or ("--" + name.replace("_", "-"),)
    if kind == "flag" and off is None and default is not False:
        off = "--no-" + flags[0][2:]  # an option on by default, or undecided, can be turned off
    key = name if recorded is True else (recorded or None)
    return Option(name, kind, default, group, help, flags, off, source, key, result)


OPTIONS: tuple[Option, ...] = (
    # ---------------------------------------------------------------- model and checkpoints
    _option("model", "str", REQUIRED, "model", recorded=False, flags=("--model", "-m"),
            help="Pythia alias (pythia-70m … pythia-12b[-deduped]), 'minilm', a local directory or a hub id."),
    _option("checkpoint", "list", None, "model", recorded=False, flags=("--checkpoint", "-c"),
            help="Revision(s), e.g. step143000 (repeatable). Default: the final weights ('main')."),
    _option("checkpoints", "str", None, "model", recorded=False,
            help="COUNT evenly spaced Pythia steps (21 = the paper's); for a local directory COUNT evenly spaced "
                 "of its stepN sub-directories, or 'all'."),
    _option("name", "str", None, "model", recorded=False,
            help="The model's name in the warehouse (default: the directory's name, the hub id or the alias). Two "
                 "different weights under one name are refused: name one of them."),
    _option("device", "str", None, "model",
            help="cpu | cuda (default: cuda when available)."),
    _option("dtype", "str", None, "model", result=True,
            help="float32 | bfloat16 | float16 (default: bfloat16 on cuda, float32 on cpu)."),
    _option("trust_remote_code", "flag", False, "model",
            help="Allow model code from the hub (off by default)."),
    # ---------------------------------------------------------------- data
    _option("source", "list", None, "data", recorded=False, flags=("--source", "-s"),
            help="NAME=PATH (.txt, .jsonl, .jsonl.zst, .json.gz, .parquet), NAME=hf:ID_OR_DIR[:CONFIG][@REVISION] (a "
                 "Hugging Face dataset: hub id, save_to_disk or data directory; --split, --text-column), "
                 "NAME=pythia:PREFIX (Pythia's pre-tokenised training rows PREFIX.bin/.idx; --steps), or a built-in "
                 "(stdlib-docs); repeatable."),
    _option("unit", "str", "document", "data", result=True,
            help="document | sentence (the paper's unit; pysbd splits)."),
    _option("max_length", "int", None, "data", result=True,
            help="Tokens per window (default: the model's context)."),
    _option("max_tokens", "int", None, "data", result=True,
            help="Stop each source after N tokens."),
    _option("pile_set", "list", None, "data", source=True, result=True,
            help="Keep only Pile documents with this meta.pile_set_name. Repeatable: several values make each its "
                 "own source NAME.VALUE in one read (as --split-by meta.pile_set_name, keeping only those values)."),
    _option("split_by", "str", None, "data", source=True,
            help="FIELD (a dotted path, e.g. meta.pile_set_name, or a Parquet / dataset column): each distinct value "
                 "becomes its own source NAME.VALUE, all from one read of the file (docs/extract.md, 'One read, many "
                 "sources')."),
    _option("split", "str", "train", "data", source=True, recorded=False,
            help="The split of hf: dataset sources."),
    _option("text_column", "str", "text", "data", source=True, recorded=False,
            help="The column of hf: dataset sources that holds the text."),
    _option("steps", "str", None, "data", source=True, recorded=False,
            help="A:B: the training steps (inclusive) of pythia: sources."),
    _option("encoding_errors", "str", "strict", "data", source=True, recorded=False,
            help="Lines that are not UTF-8: strict (fail, naming the line) | replace | skip (both counted)."),
    # ---------------------------------------------------------------- batching
    _option("batch_tokens", "int", None, "batching",
            help="Padded tokens per forward pass at most, windows sorted by length so padding stays small (default: "
                 "8 full windows and at least 4,096: 4,096 at --max-length 512, 16,384 at 2,048)."),
    _option("batch_size", "int", None, "batching",
            help="Windows per forward pass: alone, exactly N (the old fixed-count batches); with --batch-tokens, at "
                 "most N."),
    # ---------------------------------------------------------------- measures
    _option("moments", "flag", True, "measures", result=True,
            help="Store Σh, Σhhᵀ per layer (float64 sums, d² per layer) for anisotropy, IsoScore, PCA, effective "
                 "rank, αReQ (on by default)."),
    _option("cross_moments", "flag", False, "measures", off="--no-cross-moments", result=True,
            help="Also Σ h_l h_{l+1}ᵀ per pair of consecutive layers (d² more per layer) for linearity, CKA and "
                 "Procrustes (opt-in: more than doubles the moments' arithmetic; its cost: docs/measures.md)."),
    _option("sequences", "flag", None, "measures", result=True,
            help="Also the per-window measures: moments of mean-, last- and normalised-mean-pooled window vectors "
                 "(sequence_spectrum, dataset_entropy), curvature, massive activations (opt-in; its cost: "
                 "docs/measures.md)."),
    _option("prompt_entropy", "flag", False, "measures", result=True,
            help="Also the prompt entropy of every window (one eigendecomposition per window and layer; implies "
                 "--sequences; cost in docs/measures.md)."),
    _option("sample", "int", 0, "measures", result=True,
            help="Also keep a mergeable bottom-k sample of K token vectors per layer (intrinsic dimension)."),
    _option("attention", "flag", None, "measures", result=True,
            help="Also per-head query/key sums of every block's self-attention after the rotary embedding (n, Σq, "
                 "Σk, Σq̂, Σk̂, Σ‖q‖², Σ‖k‖², Σ⟨q̂,k̂⟩; qk_geometry), captured through transformers' attention "
                 "interface (opt-in; a model whose attention does not use it gets none, said in one line; cost: "
                 "docs/measures.md)."),
    _option("attention_moments", "flag", False, "measures", result=True,
            help="Also each head's uncentred second moments Σqqᵀ, Σkkᵀ (head_dim² each; qk_direction: Q-Filters' "
                 "direction and sign). Implies --attention."),
    _option("attention_sinks", "flag", False, "measures", result=True,
            help="Also the attention on each window's first token per head (attention_sink, sink rate; a second "
                 "score pass over every query and key: opt-in, cost in docs/measures.md). Implies --attention."),
    _option("special_tokens", "flag", False, "measures", flags=("--count-special-tokens",),
            off="--no-count-special-tokens", result=True,
            help="Also count the positions of the special tokens the tokenizer adds (BOS, [CLS], [SEP]: attention "
                 "sinks); by default they are fed but not counted."),
    _option("params_only", "flag", False, "measures",
            help="Write only the parameter tables (no data)."),
    # ---------------------------------------------------------------- storage and scale-out
    _option("warehouse", "str", DEFAULT_WAREHOUSE, "storage", recorded=False, flags=("--warehouse", "-w"),
            help="Warehouse directory, or s3://bucket/prefix (endpoint, keys, region from AWS_ENDPOINT_URL, "
                 f"AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION). Default: ./isotropy-warehouse, or "
                 f"${ENV_VAR} when set."),
    _option("shard", "str", None, "storage", result=True,
            help="I/N: process a deterministic 1/N of each source's documents. Default: from torchrun (RANK+1 of "
                 "WORLD_SIZE), a Slurm job array (task of count), else 1/1."),
    _option("vector_dtype", "str", "float32", "storage", result=True,
            help="Storage of per-token sum vectors: float32 | float64 (exact merges, 2x bytes) | float16 (half the "
                 "bytes; a partial whose sums would overflow float16 is stored in float32, with a warning)."),
    _option("skip_done", "flag", False, "storage",
            help="Keep runs already in the warehouse with the same settings and data (resume a sweep) instead of "
                 "replacing them."),
    _option("skip_twins", "flag", False, "storage",
            help="Skip a checkpoint whose weights (every tensor's name, dtype, shape and bytes) equal those of another "
                 "checkpoint of this model already in the warehouse; without it such a checkpoint is run, with a warning "
                 "(the checkpoint_twins view lists them; e.g. hub branches that serve the final weights)."),
    _option("replace", "flag", False, "storage",
            help="Drop committed partials this run conflicts with instead of refusing: shards of its sources that "
                 "overlap its shard without being covered by it (a new sharding), shards of another version of a "
                 "source file, and whatever holds other weights under this model name and checkpoint "
                 "(docs/extract.md, 'Shards and identity')."),
    _option("fold", "flag", True, "storage",
            help="Fold this run's partials into the merged tables the views read, in its commit (with every partial "
                 "of the checkpoint still pending, in one pass). --no-fold only appends them: the commit then costs "
                 "the partials' bytes, not the checkpoint's merged state (Slurm arrays, one job per shard); they are "
                 "pending, not in the views, until `cli.py merge` (or `cli.py sweep`, `compact`) folds them."),
    _option("compact", "flag", False, "storage", recorded=False,
            help="Compact each checkpoint right after its commit (as `cli.py compact`: the disk keeps the views' "
                 "tables only; the checkpoint then takes no new partial, so give it only to the run that completes "
                 "a checkpoint)."),
    # ---------------------------------------------------------------- advanced
    _option("accumulator_device", "str", None, "advanced",
            help="Where the float64 sums live (default: --device). Only for a model that leaves too little GPU "
                 "memory for its sums: 'cpu' frees that memory, at the cost of a copy per batch."),
    _option("moments_precision", "str", None, "advanced", result=True,
            help="Per-batch d×d products of the moments, added into float64 sums: float32 (rows shifted by a centre; "
                 "~1e-7 relative) | bfloat16 (the bf16 hidden states' exact products on tensor cores, float32 "
                 "accumulation; needs --dtype bfloat16) | float64 (exact products, slowest). Default: bfloat16 on "
                 "cuda with --dtype bfloat16, else float32. The default is as exact as every measure needs; change "
                 "it to check rounding. Its errors: docs/views-guide.md, 'Moments by default, and their precision'."),
    _option("memory_budget", "str", None, "advanced",
            help="Bytes the float64 token sums may hold (e.g. 512MB, 20GiB); beyond it they are spilled exactly to "
                 "--spill-dir and merged at the end. Default: half the memory free on the accumulator's device, "
                 "which adapts to the machine; set it to share a machine with other jobs."),
    _option("spill_dir", "path", None, "advanced",
            help="Directory for spilled sums (default: the system's temp directory); for a temp directory too small "
                 "for the sums beyond --memory-budget."),
    _option("split_limit", "int", 64, "advanced",
            help="At most this many distinct --split-by values per source (each holds its own sums: moments are "
                 "2·L·d² float64 per value). A guard against splitting by a field with too many values; raise it "
                 "when a field really has more."),
    _option("rows_per_step", "int", 1024, "advanced", source=True, recorded=False,
            help="Rows per training step of pythia: sources (Pythia: 1,024); only for another model's "
                 "pre-tokenised training data."),
    _option("seq_length", "int", 2049, "advanced", source=True, recorded=False,
            help="Tokens per row of pythia: sources; the model saw the first seq-length − 1. Only for another "
                 "model's pre-tokenised training data."),
    _option("module", "list", None, "advanced", recorded="modules", result=True,
            help="ROLE=PATH, only for a model whose layout discovery gets wrong: name the module (roles: embedding, "
                 "blocks, final_norm, unembedding; PATH 'none' for none), e.g. --module final_norm=model.norm. "
                 "Repeatable."),
)

BY_NAME: dict[str, Option] = {o.name: o for o in OPTIONS}

# What names the run rather than setting it: the API and a sweep file give these in their own ways.
RUN_NAMES = ("model", "checkpoint", "checkpoints", "source", "warehouse", "name")

# Options of how a source is read (a sweep may give them per source); the rest are the run's settings.
SOURCE_OPTIONS = tuple(o.name for o in OPTIONS if o.source)

# Settings that change a run's numbers, by the key a run records them under: a finished run with the
# same ones can be kept (--skip-done).  `shard` and `pile_set` are recorded from the source's shard
# and filter.
RESULT_SETTINGS = tuple(o.recorded for o in OPTIONS if o.result)


def defaults() -> dict:
    """Every option's default by name (None for a required one)."""
    return {o.name: o.value_default for o in OPTIONS}


def default(name: str):
    """One option's default."""
    return BY_NAME[name].value_default

# Result settings whose values may differ between the partials of one source: which documents and
# tokens a partial counts (`shard`, `max_tokens`) and which tables it writes (a fold keeps a table only
# where every partial of the group has it).  Every other result setting is an identity setting.
MIXABLE_SETTINGS = ("shard", "max_tokens", "moments", "cross_moments", "sequences", "prompt_entropy", "sample",
                    "attention", "attention_moments", "attention_sinks")

# Settings that make a partial what it is: a data entry records each one's value under `identity`
# (extract/run/provenance.py), and the warehouse never folds partials of one source whose recorded
# values differ (warehouse/merge/identity.py).  A new result setting is one unless listed above.
IDENTITY_SETTINGS = tuple(k for k in RESULT_SETTINGS if k not in MIXABLE_SETTINGS)
