"""The one explicit schema of the warehouse.

Every table stores *sums*, never means: rows of the same key from different shards,
sources or machines merge by summation, and every division happens in `queries/`.

Partition columns (model, checkpoint, source, shard) have fixed types (strings) and are
stored both as Hive-style directory names (percent-encoded) and inside each file, so a
file is self-describing; the views read them from the files (hive_partitioning = false).
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 6  # 6: layer_sums gained the layer change (change_*) and the windows' mean unit vectors (unit_windows, sum_ubar, sum_ubar_sq); 5: layer_sums gained sum_abs, curvature and prompt-entropy sums; sequence_moments, massive; 4: layer_metrics gained intra_types, intra_sim_sum; 3: merged tables folded at commit; 2: layer_sums gained sum_h, sum_u2, windows, window_cos

# Partition columns, in directory order, per table.
DATA_PARTITIONS = ("model", "checkpoint", "source", "shard")
PARAM_PARTITIONS = ("model", "checkpoint")
MERGED_PARTITIONS = ("model", "checkpoint", "source")  # source: a text source, or 'all' 

_KEY_DATA = [
    pa.field("model", pa.string(), nullable=False),
    pa.field("checkpoint", pa.string(), nullable=False),
    pa.field("step", pa.int64()),  # NULL when the revision names no step
    pa.field("source", pa.string(), nullable=False),
    pa.field("shard", pa.string(), nullable=False),  # "I-of-N"
]
_KEY_PARAMS = [
    pa.field("model", pa.string(), nullable=False),
    pa.field("checkpoint", pa.string(), nullable=False),
    pa.field("step", pa.int64()),
]


def vector_type(vector_dtype: str) -> pa.DataType:
    """Per-token sum vectors: float32 by default; float64 for exact merges, float16 for half the bytes."""
    return pa.list_({"float64": pa.float64(), "float32": pa.float32(), "float16": pa.float16()}[vector_dtype])


# Per (model, checkpoint, source, shard, layer, token_id): n and Σû over that token's vectors.
# sum_sq = ‖Σû‖² computed in float64 from the float64 accumulator, before `vec` is rounded.
TOKEN_SUMS = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("sum_sq", pa.float64(), nullable=False),
        pa.field("vec", vector_type("float32"), nullable=False),
    ]
)

# Per (model, checkpoint, source, shard, layer): totals over every counted token vector.
# vec is Σû in float64; n_nonfinite / n_zero count the excluded NaN/inf and zero-norm vectors.
LAYER_SUMS = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("layer_kind", pa.string(), nullable=False),  # embedding | block | final_norm
        pa.field("n_layers", pa.int16(), nullable=False),  # number of layer indices (L + 1 or L + 2)
        pa.field("n", pa.int64(), nullable=False),
        pa.field("sum_sq", pa.float64(), nullable=False),
        pa.field("n_nonfinite", pa.int64(), nullable=False),
        pa.field("n_zero", pa.int64(), nullable=False),
        pa.field("vec", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_h", pa.list_(pa.float64()), nullable=False),  # Σh of the raw vectors (d,)
        pa.field("sum_u2", pa.list_(pa.float64()), nullable=False),  # Σ û_i² per dimension i (d,)
        pa.field("windows", pa.int64(), nullable=False),  # windows fed with ≥ 2 counted vectors
        pa.field("window_cos", pa.float64(), nullable=False),  # Σ over them of mean_i cos(h_i, mean of the window)
        # extract/sequences.py (NULL where not measured: --no-sequences; pe_*: without --prompt-entropy)
        pa.field("sum_abs", pa.float64()),  # Σ |h_j| over every counted vector and dimension
        pa.field("curv_windows", pa.int64()),  # windows with ≥ 1 pair of consecutive velocities
        pa.field("curv_sum", pa.float64()),  # Σ over them of the window's mean curvature angle
        pa.field("pe_windows", pa.int64()),  # windows with ≥ 2 vectors (prompt entropy)
        pa.field("pe_sum", pa.float64()),  # Σ over them of the normalised prompt entropy
        # from this layer to the next, over the vectors counted (finite, non-zero) at both (NULL on the last layer)
        pa.field("change_n", pa.int64()),  # their number
        pa.field("change_cos", pa.float64()),  # Σ cos(h_layer, h_layer+1)
        pa.field("change_angle", pa.float64()),  # Σ angle/π, the angle 2·atan2(‖û − û'‖, ‖û + û'‖) = arccos(cos)
        # per window with ≥ 1 counted vector, its mean unit vector ū_w = (Σ_{i∈w} û_i)/n_w
        pa.field("unit_windows", pa.int64(), nullable=False),  # those windows
        pa.field("sum_ubar", pa.list_(pa.float64()), nullable=False),  # Σ_w ū_w (d,)
        pa.field("sum_ubar_sq", pa.float64(), nullable=False),  # Σ_w ‖ū_w‖²
    ]
)

# layer_sums' layer-change sums (NULL on a partial's last layer).
CHANGE_SUMS = ("change_n", "change_cos", "change_angle")

# layer_sums' per-layer scalars of the per-window measures (extract/sequences.py), NULL where not measured.
WINDOW_SCALARS = ("sum_abs", "curv_windows", "curv_sum", "pe_windows", "pe_sum")

# Per (model, checkpoint, source, shard, layer): raw moments (--moments), float64.
# s2 and s_cross are d×d matrices, row-major; s_cross = Σ h_layer h_{layer+1}ᵀ over the n_pair tokens
# counted in both layers (NULL for the last layer).
MOMENTS = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("s1", pa.list_(pa.float64()), nullable=False),
        pa.field("s2", pa.list_(pa.float64()), nullable=False),
        pa.field("n_pair", pa.int64()),
        pa.field("s_cross", pa.list_(pa.float64())),
    ]
)

# Per (model, checkpoint, source, shard, layer, pooling): moments of pooled window vectors, float64:
# pooling 'mean' (the window's mean vector), 'last' (its last vector), 'normalized' (mean / ‖mean‖);
# n = windows, s1 = Σz (d,), s2 = Σzzᵀ (d×d, row-major).
SEQUENCE_MOMENTS = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("pooling", pa.string(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("s1", pa.list_(pa.float64()), nullable=False),
        pa.field("s2", pa.list_(pa.float64()), nullable=False),
    ]
)

# Per (model, checkpoint, source, shard, layer, rank): the top-k |h| over the partial's counted
# vectors and dimensions (rank 1 = largest; ties: document, position, dim ascending).
MASSIVE = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("abs_value", pa.float64(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("document", pa.int64(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),
    ]
)

# Per (model, checkpoint, source, shard, layer, key): the bottom-k sample (--sample K) of raw
# token vectors; key = 63-bit hash of (source, document, position), the same in every layer.
SAMPLES = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("key", pa.int64(), nullable=False),
        pa.field("document", pa.int64(), nullable=False),
        pa.field("position", pa.int64(), nullable=False),
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("vec", pa.list_(pa.float32()), nullable=False),
    ]
)

# Per (model, checkpoint, source, shard, layer, role, head): the per-head sums of a block's
# self-attention (extract --attention), float64, at the counted positions whose queries and keys are
# finite and non-zero (n; `excluded` the others), after the rotary embedding.  role 'query': query head
# `head`, reading key head `kv_head` (head // (H / H_kv)); role 'key': key head `head` (kv_head = head).
# layer = the 0-based block.  sum = Σx, sum_unit = Σx/‖x‖ (head_dim,), sum_sq = Σ‖x‖²; pair_cos =
# Σᵢ⟨q̂ᵢ, k̂ᵢ⟩ with the key head (query rows; NULL on key rows); s2 = Σxxᵀ (head_dim², row-major;
# --attention-moments, else NULL); sink_* (query rows, --attention-sinks, else NULL): query positions
# i ≥ 1 of every window, Σᵢ A[i, 0] (attention on the window's first position), windows, the longest
# window.
ATTENTION_SUMS = pa.schema(
    _KEY_DATA
    + [
        pa.field("layer", pa.int16(), nullable=False),
        pa.field("role", pa.string(), nullable=False),  # query | key
        pa.field("head", pa.int32(), nullable=False),
        pa.field("kv_head", pa.int32(), nullable=False),
        pa.field("n", pa.int64(), nullable=False),
        pa.field("excluded", pa.int64(), nullable=False),
        pa.field("sum", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_unit", pa.list_(pa.float64()), nullable=False),
        pa.field("sum_sq", pa.float64(), nullable=False),
        pa.field("pair_cos", pa.float64()),
        pa.field("s2", pa.list_(pa.float64())),
        pa.field("sink_n", pa.int64()),
        pa.field("sink_sum", pa.float64()),
        pa.field("sink_windows", pa.int64()),
        pa.field("sink_max_window", pa.int64()),
    ]
)

# Per (model, checkpoint, matrix, centered, eigenvector): log Z(±c) for the eigenvectors c of WᵀW.
# log_z_pos / log_z_neg: float64 log-sum-exp; z_eigh_sign: Z(c) with the sign torch.linalg.eigh
# returned, computed in float32 as the authors' script does (may be +inf).
PARTITION_FN = pa.schema(
    _KEY_PARAMS
    + [
        pa.field("matrix", pa.string(), nullable=False),  # embedding | unembedding
        pa.field("tied", pa.bool_(), nullable=False),
        pa.field("centered", pa.bool_(), nullable=False),
        pa.field("rows", pa.int64(), nullable=False),
        pa.field("eig_index", pa.int32(), nullable=False),
        pa.field("eigenvalue", pa.float64(), nullable=False),
        pa.field("log_z_pos", pa.float64(), nullable=False),
        pa.field("log_z_neg", pa.float64(), nullable=False),
        pa.field("z_eigh_sign", pa.float64(), nullable=False),
    ]
)

# Per (model, checkpoint, norm module, dimension): gain g and bias b (NULL for RMSNorm).
NORM_PARAMS = pa.schema(
    _KEY_PARAMS
    + [
        pa.field("module", pa.string(), nullable=False),
        pa.field("norm_type", pa.string(), nullable=False),  # class name
        pa.field("is_final", pa.bool_(), nullable=False),
        pa.field("dim", pa.int32(), nullable=False),
        pa.field("gain", pa.float64(), nullable=False),
        pa.field("bias", pa.float64()),
    ]
)

# Per (model, checkpoint, token_id): the token's text as the tokenizer writes it.
VOCAB = pa.schema(
    _KEY_PARAMS
    + [
        pa.field("token_id", pa.int32(), nullable=False),
        pa.field("token", pa.string(), nullable=False),
        pa.field("special", pa.bool_(), nullable=False),
    ]
)

# ---- Merged tables (warehouse/merge/): folded at commit, one file set per (model, checkpoint, group),
# group = a source (its shards merged) or 'all' (every partial of the checkpoint).  Views read only these.
_KEY_MERGED = _KEY_PARAMS + [pa.field("source", pa.string(), nullable=False)]

# Per (…, group, layer, token_id): n and the exact ‖Σû‖² = Σ_p sum_sq_p + 2 Σ_{p<q} ⟨s_p, s_q⟩.
TOKEN_STATS = pa.schema(_KEY_MERGED + [
    pa.field("layer", pa.int16(), nullable=False),
    pa.field("token_id", pa.int32(), nullable=False),
    pa.field("n", pa.int64(), nullable=False),
    pa.field("sum_sq", pa.float64(), nullable=False),
])
# The merged Σû (float64) of each (layer, token_id): the state later partials fold into (dropped by compact).
TOKEN_VECTORS = pa.schema(_KEY_MERGED + [
    pa.field("layer", pa.int16(), nullable=False),
    pa.field("token_id", pa.int32(), nullable=False),
    pa.field("vec", pa.list_(pa.float64()), nullable=False),
])
# layer_sums merged per group; sum_sq by the same algebra as token_stats.
LAYER_TOTALS = pa.schema(_KEY_MERGED + [f for f in LAYER_SUMS if f.name not in {f.name for f in _KEY_DATA}])
# Per (…, group, layer, bucket): the token types whose merged count n_t has ⌊log₂ n_t⌋ = bucket.
FREQUENCY_BUCKETS = pa.schema(_KEY_MERGED + [
    pa.field("layer", pa.int16(), nullable=False),
    pa.field("bucket", pa.int32(), nullable=False),
    pa.field("types", pa.int64(), nullable=False),
    pa.field("n", pa.int64(), nullable=False),
    pa.field("sum_sq", pa.float64(), nullable=False),  # ‖Σ_{t ∈ bucket} Σû_t‖², float64
])
# The merged moments and bottom-k sample (state for later folds; dropped by compact).
MOMENTS_MERGED = pa.schema(_KEY_MERGED + [f for f in MOMENTS if f.name not in {f.name for f in _KEY_DATA}])
SAMPLES_MERGED = pa.schema(_KEY_MERGED + [f for f in SAMPLES if f.name not in {f.name for f in _KEY_DATA}])
SEQUENCE_MOMENTS_MERGED = pa.schema(_KEY_MERGED + [f for f in SEQUENCE_MOMENTS
                                                   if f.name not in {f.name for f in _KEY_DATA}])
# The group's top-k: of the union of its partials' (document_source: the source of the document).
_MASSIVE_VALUES = [f for f in MASSIVE if f.name not in {f.name for f in _KEY_DATA}]
_AT_DOC = [f.name for f in _MASSIVE_VALUES].index("document")
MASSIVE_MERGED = pa.schema(_KEY_MERGED + _MASSIVE_VALUES[:_AT_DOC]
                           + [pa.field("document_source", pa.string(), nullable=False)] + _MASSIVE_VALUES[_AT_DOC:])

# attention_sums merged per group (sums; sink_max_window the largest; a column NULL where a partial lacks it).
ATTENTION_TOTALS = pa.schema(_KEY_MERGED + [f for f in ATTENTION_SUMS if f.name not in {f.name for f in _KEY_DATA}])

# Derived per group from the merged state: source = 'all' holds the merge of every source.
_KEY_DERIVED = _KEY_MERGED + [pa.field("layer", pa.int16(), nullable=False)]
SPECTRUM = pa.schema(_KEY_DERIVED + [
    pa.field("n", pa.int64(), nullable=False),
    pa.field("k", pa.int32(), nullable=False),  # 1 = largest
    pa.field("eigenvalue", pa.float64(), nullable=False),  # of the covariance (n − 1 denominator)
])
# Per (…, group, layer, pooling, k): 'mean' / 'last': eigenvalues of the covariance of the pooled
# vectors over windows (n − 1 denominator); 'normalized': eigenvalues of Σẑẑᵀ/W (not centred).
SEQUENCE_SPECTRUM = pa.schema(_KEY_DERIVED + [
    pa.field("pooling", pa.string(), nullable=False),
    pa.field("windows", pa.int64(), nullable=False),
    pa.field("k", pa.int32(), nullable=False),  # 1 = largest
    pa.field("eigenvalue", pa.float64(), nullable=False),
])
DIM_VARIANCE = pa.schema(_KEY_DERIVED + [
    pa.field("dim", pa.int32(), nullable=False),
    pa.field("mean", pa.float64(), nullable=False),
    pa.field("variance", pa.float64(), nullable=False),
])
LAYER_METRICS = pa.schema(_KEY_DERIVED + [
    pa.field("n", pa.int64(), nullable=False),
    pa.field("linearity", pa.float64()),  # to layer + 1
    pa.field("linearity_centered", pa.float64()),
    pa.field("cka", pa.float64()),  # linear CKA to layer + 1 (centred)
    pa.field("procrustes_orthogonal", pa.float64()),  # orthogonal Procrustes similarity to layer + 1 (centred)
    pa.field("sample_size", pa.int64()),
    pa.field("twonn", pa.float64()),
    pa.field("twonn_skdim", pa.float64()),
    pa.field("types", pa.int64()),  # token types with n ≥ 1
    pa.field("types_sum_sq", pa.float64()),  # ‖Σ_t s_t/‖s_t‖‖² over those types
    pa.field("intra_types", pa.int64()),  # token types with n ≥ 2
    pa.field("intra_sim_sum", pa.float64()),  # Σ over them of (‖s_t‖² − n_t)/(n_t² − n_t)
])

# Per (…, group, layer, head): the top eigenvector v of a query head's uncentred second moment Σqqᵀ/n
# (Q-Filters' direction), oriented so that the query mean projects on it with q_mean_along ≥ 0;
# k_mean_along: the mean of its key head along v (its sign: Q-Filters' ε); eigenvalue / trace: v's share.
ATTENTION_DIRECTION = pa.schema(_KEY_DERIVED + [
    pa.field("head", pa.int32(), nullable=False),
    pa.field("kv_head", pa.int32(), nullable=False),
    pa.field("n", pa.int64(), nullable=False),
    pa.field("eigenvalue", pa.float64(), nullable=False),  # the largest of Σqqᵀ/n
    pa.field("trace", pa.float64(), nullable=False),  # Σ‖q‖²/n, the sum of its eigenvalues
    pa.field("q_mean_along", pa.float64(), nullable=False),  # ⟨Σq/n, v⟩
    pa.field("k_mean_along", pa.float64(), nullable=False),  # ⟨Σk/n, v⟩
])

TABLES: dict[str, pa.Schema] = {
    "token_sums": TOKEN_SUMS,
    "layer_sums": LAYER_SUMS,
    "moments": MOMENTS,
    "samples": SAMPLES,
    "sequence_moments": SEQUENCE_MOMENTS,
    "massive": MASSIVE,
    "attention_sums": ATTENTION_SUMS,
    "token_stats": TOKEN_STATS,
    "token_vectors": TOKEN_VECTORS,
    "layer_totals": LAYER_TOTALS,
    "frequency_buckets": FREQUENCY_BUCKETS,
    "moments_merged": MOMENTS_MERGED,
    "samples_merged": SAMPLES_MERGED,
    "sequence_moments_merged": SEQUENCE_MOMENTS_MERGED,
    "massive_merged": MASSIVE_MERGED,
    "attention_totals": ATTENTION_TOTALS,
    "spectrum": SPECTRUM,
    "sequence_eigenvalues": SEQUENCE_SPECTRUM,
    "dim_variance": DIM_VARIANCE,
    "layer_metrics": LAYER_METRICS,
    "attention_direction": ATTENTION_DIRECTION,
    "partition_fn": PARTITION_FN,
    "norm_params": NORM_PARAMS,
    "vocab": VOCAB,
}


def write_options(table: str, arrow_schema: pa.Schema) -> dict:
    """Parquet writer options: zstd; dictionary encoding only for string columns (dictionary attempts on
    float vectors cost write time for nothing); token_stats' sorted ids delta-encoded and sum_sq
    byte-stream-split (fewer bytes per row); vectors and d×d moments uncompressed (random mantissas
    barely compress: zstd would save a few percent of the bytes and cost write and read time, which
    every commit pays)."""
    opts = {"compression": "zstd", "use_dictionary": [f.name for f in arrow_schema if pa.types.is_string(f.type)]}
    if table == "token_sums":
        opts["compression"] = {f.name: ("none" if f.name == "vec" else "zstd") for f in arrow_schema}
    elif table == "token_stats":
        opts["column_encoding"] = {"layer": "DELTA_BINARY_PACKED", "token_id": "DELTA_BINARY_PACKED",
                                   "sum_sq": "BYTE_STREAM_SPLIT"}
    elif table in ("token_vectors", "moments", "moments_merged", "sequence_moments", "sequence_moments_merged",
                   "attention_sums", "attention_totals"):
        opts["compression"] = "none"
    return opts


DATA_TABLES = ("token_sums", "layer_sums", "moments", "samples", "sequence_moments", "massive", "attention_sums")
MERGED_TABLES = ("token_stats", "token_vectors", "layer_totals", "frequency_buckets", "moments_merged",
                 "samples_merged", "sequence_moments_merged", "massive_merged", "spectrum",
                 "sequence_eigenvalues", "dim_variance", "layer_metrics", "attention_totals", "attention_direction")
STATE_TABLES = ("token_vectors", "moments_merged", "samples_merged", "sequence_moments_merged")  # only for later folds: compact drops them
PARAM_TABLES = ("partition_fn", "norm_params", "vocab")

# Manifest entries, flattened into the `runs` view.
RUNS = pa.schema(
    [
        pa.field("kind", pa.string()),  # data | params | merged
        pa.field("model", pa.string()),
        pa.field("checkpoint", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("source", pa.string()),
        pa.field("shard", pa.string()),
        pa.field("run_id", pa.string()),
        pa.field("finished_at", pa.string()),
        pa.field("hidden_size", pa.int64()),
        pa.field("tokens", pa.int64()),
        pa.field("documents", pa.int64()),
        pa.field("skipped", pa.int64()),
        pa.field("nonfinite", pa.int64()),
        pa.field("git_hash", pa.string()),
        pa.field("model_revision", pa.string()),
        pa.field("source_fingerprint", pa.string()),
        pa.field("settings", pa.string()),  # JSON
        pa.field("provenance", pa.string()),  # JSON
        pa.field("stats", pa.string()),  # JSON: every counter of the run (spills, accumulator peak bytes, …)
        pa.field("folded", pa.bool_()),  # data: whether its source group and 'all' hold it (false: pending a fold)
    ]
)


def duckdb_type(t: pa.DataType) -> str:
    """DuckDB type name for an Arrow type of this schema (for empty views)."""
    if pa.types.is_list(t):
        return duckdb_type(t.value_type) + "[]"
    return {
        pa.string(): "VARCHAR",
        pa.int16(): "SMALLINT",
        pa.int32(): "INTEGER",
        pa.int64(): "BIGINT",
        pa.float16(): "FLOAT",
        pa.float32(): "FLOAT",
        pa.float64(): "DOUBLE",
        pa.bool_(): "BOOLEAN",
    }[t]
