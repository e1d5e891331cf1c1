"""The peers' measures as figures, by layer (final checkpoint) and across training: anisotropy,
intrinsic dimension, linearity, CKA and Procrustes, the top dimensions of Inter-Sim, common drift,
Inter-Sim by token frequency, αReQ, outlier kurtosis, massive activations, the unembedding's
singular values, and the sequence-level measures (effective rank, dataset and prompt entropy,
curvature).
"""

from __future__ import annotations

from dataclasses import dataclass

import altair as alt
import polars as pl

from .charts import (HEIGHT, WIDTH, centered_label, color_by, has_twins, last_layer, line_chart, peer_by_layer,
                     pooled_by_layer, tooltips, training_line, training_missing, twin_overlay, x_axis)
from .data import Data, Figure


def fig_anisotropy_layers(d: Data) -> Figure:
    return peer_by_layer(
        d, "fig12_anisotropy_by_layer", "Anisotropy per layer (Razzhigaev et al.)",
        "λ_max / Σλ of the covariance of each layer's hidden states (all sources, final checkpoint).",
        "anisotropy", "anisotropy", "Anisotropy (largest eigenvalue share)",
        ["model", "checkpoint", "layer", "n", "anisotropy"])


def fig_anisotropy_training(d: Data) -> Figure:
    return training_line(
        d, "fig13_anisotropy_training", "Anisotropy of the last layer during training",
        "λ_max / Σλ of the last layer's hidden states at each checkpoint.", "anisotropy", "anisotropy",
        "Anisotropy (largest eigenvalue share)", ["model", "checkpoint", "step", "layer", "anisotropy"],
        "source = 'all'")


def fig_intrinsic_dim_layers(d: Data) -> Figure:
    return peer_by_layer(
        d, "fig14_intrinsic_dim_by_layer", "Intrinsic dimension per layer (TwoNN)",
        "TwoNN on the bottom-k sample of each layer: llm-microscope's estimator (solid) and "
        "scikit-dimension's (dashed); final checkpoint, all sources.",
        "intrinsic_dim", "dimension", "Intrinsic dimension (TwoNN)", [], ["twonn", "twonn_skdim"])


def fig_intrinsic_dim_training(d: Data) -> Figure:
    return training_line(
        d, "fig15_intrinsic_dim_training", "Intrinsic dimension of the last layer during training",
        "TwoNN (llm-microscope's estimator) on the last layer's sample at each checkpoint.", "intrinsic_dim",
        "twonn", "Intrinsic dimension (TwoNN)", ["model", "checkpoint", "step", "layer", "sample_size", "twonn"],
        "source = 'all'")


def fig_linearity_layers(d: Data) -> Figure:
    return peer_by_layer(
        d, "fig16_linearity_by_layer", "Linearity of each layer's map to the next",
        "1 − ‖X̃A − Ỹ‖² for layer l → l + 1 over all tokens (solid), and between X and Y − X (dashed); "
        "final checkpoint, all sources.",
        "linearity", "score", "Linearity score", [], ["linearity", "linearity_centered"])


def fig_dim_contrib(d: Data) -> Figure:
    """The three dimensions that contribute most to each layer's Inter-Sim."""
    f = Figure("fig17_dim_contrib_top", "Top dimensions of Inter-Sim per layer (Timkey & van Schijndel)",
               "Each layer's three dimensions with the largest contribution ((Σû)_i² − Σû_i²)/(n² − n) to its "
               "Inter-Sim (the contributions of all dimensions sum to Inter-Sim); final checkpoint, all sources. "
               "One or two rogue dimensions carrying most of it is the pattern the paper reports.")
    df = d.final("dim_contrib", "source = 'all'", order="model, layer, contrib DESC")
    if df.is_empty():
        f.missing = "no data for dim_contrib"
        return f
    df = (df.with_columns(pl.col("contrib").rank("ordinal", descending=True).over(["model", "layer"])
                          .cast(pl.Int64).alias("rank"))
            .filter(pl.col("rank") <= 3).sort(["model", "layer", "rank"]))
    df = df.with_columns(pl.format("top {}", pl.col("rank")).alias("top"))
    f.chart = alt.Chart(df).mark_point(filled=True, size=80).encode(
        x=alt.X("layer:Q", title="Layer index (0 = embedding)", axis=x_axis("layer", df)),
        y=alt.Y("contrib:Q", title="Contribution to Inter-Sim"),
        color=color_by(), shape=alt.Shape("top:N", title="Rank"),
        tooltip=tooltips("model", "checkpoint", "layer", "rank", "dim", "contrib"),
    ).properties(width=WIDTH, height=HEIGHT)
    f.data = df
    return f


def fig_drift_layers(d: Data) -> Figure:
    return peer_by_layer(
        d, "fig18_drift_by_layer", "Common drift per layer (Biś et al.)",
        "Mean cosine of each vector to the layer's mean vector μ; all sources, final checkpoint. "
        "‖μ‖ is in the view `drift` (mean_norm).",
        "drift", "mean_cos_to_mean", "Mean cosine to the mean vector",
        ["model", "checkpoint", "layer", "n", "mean_norm", "mean_cos_to_mean"])


def fig_drift_training(d: Data) -> Figure:
    return training_line(
        d, "fig19_drift_training", "Common drift of the last layer during training",
        "Mean cosine of the last layer's vectors to their mean vector at each checkpoint.", "drift",
        "mean_cos_to_mean", "Mean cosine to the mean vector",
        ["model", "checkpoint", "step", "layer", "mean_norm", "mean_cos_to_mean"], "source = 'all'")


def fig_inter_sim_by_frequency(d: Data) -> Figure:
    f = Figure("fig20_inter_sim_by_frequency", "Inter-Sim by token frequency (last layer)",
               "Inter-Sim among the vectors of token types whose count n_t has ⌊log₂ n_t⌋ = bucket "
               "(sources combined, final checkpoint, last layer): frequency distortion (Zhou et al.).")
    df = d.final("inter_sim_by_frequency", order="model, layer, bucket")
    if df.is_empty():
        f.missing = "no data for inter_sim_by_frequency"
        return f
    df = last_layer(df)
    f.chart = line_chart(df, "bucket", "Frequency bucket: floor(log2 count)", "inter_sim", "Inter-Sim",
                         ["model", "checkpoint", "layer", "bucket", "types", "n", "inter_sim"])
    f.data = df
    return f


def fig_similarity_layers(d: Data) -> Figure:
    return peer_by_layer(
        d, "fig21_cka_procrustes_by_layer", "Similarity of each layer to the next: CKA and Procrustes",
        "Linear CKA (solid) and the orthogonal Procrustes similarity ‖XᵀY‖_*/(‖X‖_F‖Y‖_F) (dashed) of "
        "layer l and l + 1, centred, over all tokens; final checkpoint, all sources.",
        "linearity", "similarity", "Similarity to the next layer", [], ["cka", "procrustes_orthogonal"])


def fig_massive_layers(d: Data) -> Figure:
    f = Figure("fig26_massive_activations_by_layer", "Massive activations per layer (Sun et al.)",
               "The largest |h| of each layer over all counted tokens and dimensions, as a multiple of the mean |h| "
               "(the tooltip says which token and dimension); final checkpoint, all sources. Sun et al. report "
               "values thousands of times the mean, at a few dimensions and tokens, from the early layers on.")
    df = d.final("massive_activations", "source = 'all' AND rank = 1", order="model, layer")
    if df.is_empty():
        f.missing = "no data for massive_activations (extract with --sequences)"
        return f
    f.chart = line_chart(df, "layer", "Layer index (0 = embedding)", "ratio_to_mean_abs", "Largest |h| / mean |h|",
                         ["model", "checkpoint", "layer", "dim", "token", "abs_value", "ratio_to_mean_abs"])
    f.data = df
    return f


def fig_massive_training(d: Data) -> Figure:
    f = Figure("fig27_massive_activations_training", "Massive activations during training",
               "The largest |h| / mean |h| over all layers at each checkpoint (the layer is in the tooltip).")
    df = d.training("massive_activations", "source = 'all' AND rank = 1", order="model, step, layer")
    if df.is_empty():
        f.missing = training_missing("massive_activations")
        return f
    df = df.filter(pl.col("ratio_to_mean_abs") == pl.col("ratio_to_mean_abs").max().over(["model", "checkpoint"]))
    df = df.unique(["model", "checkpoint"], keep="first", maintain_order=True)
    f.chart = line_chart(df, "step", "Training step", "ratio_to_mean_abs", "Largest |h| / mean |h|",
                         ["model", "checkpoint", "step", "layer", "dim", "token", "ratio_to_mean_abs"])
    f.data = df
    return f


def _weight_matrix(df: pl.DataFrame) -> pl.DataFrame:
    """The unembedding where the model has one of its own, else the embedding."""
    has = df.filter(pl.col("matrix") == "unembedding").select("model", "checkpoint").unique()
    return pl.concat([df.filter(pl.col("matrix") == "unembedding"),
                      df.filter(pl.col("matrix") == "embedding").join(has, on=["model", "checkpoint"], how="anti")])


def fig_weight_spectrum(d: Data) -> Figure:
    f = Figure("fig28_weight_spectrum", "Singular values of the unembedding (Godey et al.)",
               "Singular values of the unembedding matrix (the embedding where there is none), raw W (solid) and "
               "mean-centred (dashed), largest first, log scale: a fast decay is the softmax bottleneck's "
               "spectral saturation. Final checkpoint.")
    df = d.final("weight_spectrum", order="model, matrix, centered, k")
    if df.is_empty():
        f.missing = "no parameter tables in the warehouse"
        return f
    df = centered_label(_weight_matrix(df))
    f.chart = alt.Chart(df).mark_line().encode(
        x=alt.X("k:Q", title="Rank k"), y=alt.Y("singular_value:Q", title="Singular value", scale=alt.Scale(type="log")),
        color=color_by(), strokeDash=alt.StrokeDash("variant:N", title="Matrix"),
        tooltip=tooltips("model", "checkpoint", "matrix", "variant", "k", "singular_value"),
    ).properties(width=WIDTH, height=HEIGHT)
    f.data = df
    return f


def fig_weight_spectrum_training(d: Data) -> Figure:
    f = Figure("fig29_weight_spectrum_training", "Singular values of the unembedding during training",
               "Mean-centred singular values of the unembedding (the embedding where there is none) at each "
               "checkpoint, coloured by training step, one panel per model.")
    df = d.training("weight_spectrum", "centered", order="model, step, k")
    if df.is_empty():
        f.missing = training_missing("weight_spectrum")
        return f
    df = _weight_matrix(df)
    lines = alt.Chart(df).mark_line().encode(
        x=alt.X("k:Q", title="Rank k"), y=alt.Y("singular_value:Q", title="Singular value", scale=alt.Scale(type="log")),
        color=alt.Color("step:Q", title="Step", scale=alt.Scale(scheme="viridis")), detail="checkpoint:N",
        tooltip=tooltips("model", "checkpoint", "step", "matrix", "k", "singular_value"),
    )
    chart = alt.layer(lines, twin_overlay(lines, "line")) if has_twins(df) else lines
    f.chart = chart.properties(width=WIDTH, height=HEIGHT).facet(
        column=alt.Column("model:N", title=None))
    f.data = df
    return f


def fig_sequence_rank_layers(d: Data) -> Figure:
    return pooled_by_layer(
        d, "fig30_sequence_effective_rank_by_layer", "Effective rank of sequence representations per layer",
        "exp(entropy) of the covariance spectrum of one pooled vector per window: the windows' mean vectors (solid) "
        "and last vectors (dashed); final checkpoint, all sources (Skean et al.'s sequence-level view).",
        "effective_rank", "Effective rank over windows")


def fig_sequence_rank_training(d: Data) -> Figure:
    return training_line(
        d, "fig31_sequence_effective_rank_training", "Effective rank of mean-pooled windows during training",
        "Effective rank of the covariance of the windows' mean vectors, last layer, each checkpoint.",
        "sequence_spectrum", "effective_rank", "Effective rank over windows",
        ["model", "checkpoint", "step", "layer", "windows", "effective_rank"], "source = 'all' AND pooling = 'mean'")


@dataclass
class _Measure:
    """A per-layer measure drawn twice: by layer (final checkpoint) and its last layer across training."""
    number: int  # the by-layer figure's number; the training figure is number + 1
    view: str
    value: str
    title: str
    cite: str
    y_title: str
    about: str  # what it is, for the by-layer caption
    tips: tuple[str, ...] = ()  # columns besides model, checkpoint, (step,) layer and the value

    def by_layer(self, d: Data) -> Figure:
        return peer_by_layer(d, f"fig{self.number}_{self.view}_by_layer", f"{self.title} per layer ({self.cite})",
                             f"{self.about} Final checkpoint, all sources.", self.view, self.value, self.y_title,
                             ["model", "checkpoint", "layer", *self.tips, self.value])

    def training(self, d: Data) -> Figure:
        return training_line(d, f"fig{self.number + 1}_{self.view}_training",
                             f"{self.title} of the last layer during training",
                             f"{self.title} of the last layer at each checkpoint.", self.view, self.value,
                             self.y_title, ["model", "checkpoint", "step", "layer", *self.tips, self.value],
                             "source = 'all'")


MEASURES = [
    _Measure(22, "alpha_req", "alpha_req", "αReQ", "Agrawal et al.; Li et al.", "alpha (spectral decay)",
             "The power-law decay α of each layer's covariance spectrum (weighted fit of log λ_k over ranks "
             "12 … 100); larger α: variance concentrated in fewer directions.", ("n",)),
    _Measure(24, "outlier_kurtosis", "kurtosis", "Outlier kurtosis", "He et al.", "Kurtosis of the second moments",
             "Kurtosis of the per-dimension second moments s_j = Σh_j²/n: mean s_j² / (mean s_j)². 1 when every "
             "dimension carries the same energy; large when a few outlier dimensions dominate.", ("n",)),
    _Measure(32, "dataset_entropy", "dataset_entropy", "Dataset entropy", "Skean et al.",
             "Dataset entropy (normalised)",
             "Entropy of the spectrum of Σ ẑẑᵀ/W over the windows' normalised mean vectors ẑ, divided by "
             "log min(W, d): 1 = spread evenly over directions.", ("windows",)),
    _Measure(34, "curvature", "curvature", "Curvature", "Hosseini & Fedorenko; Skean et al.", "Curvature (radians)",
             "Mean angle (radians) between consecutive token-to-token steps h_{k+1} − h_k within a window, averaged "
             "over windows; lower = straighter trajectories.", ("windows",)),
    _Measure(36, "prompt_entropy", "prompt_entropy", "Prompt entropy", "Skean et al.", "Prompt entropy (normalised)",
             "Per window, the entropy of the spectrum of its centred, normalised vectors' Gram matrix, divided by "
             "log min(N, d); averaged over windows.", ("windows",)),
]
