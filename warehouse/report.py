"""The report: the paper's Figures 1-9 (and more) drawn from the warehouse's views, offline.

`build_report()` queries the views, draws each figure with Altair when the warehouse holds
the data it needs (otherwise it records a one-line note saying why not), and writes under
`out/`: `index.html` (Vega, Vega-Lite and vega-embed inlined: no network needed), and per
figure `<id>.png`, `<id>.svg` and `<id>.csv` (the exact rows the chart draws).
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import json
from dataclasses import dataclass, field
from pathlib import Path

import altair as alt
import duckdb
import polars as pl

from common.progress import progress

from common.errors import UserError

from . import store
from .query import connect, duckdb_error_line
from .storage import open_storage

# Okabe & Ito's colour-blind-safe palette (black last).
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
WIDTH, HEIGHT = 380, 250
# Axis titles in ASCII: the chart fonts lack '‖' and '√'.
AVGNORM_TITLE = "avgnorm = ||v|| / sqrt(d)"
RATIO_TITLE = "||b|| / ||g||"
TOKENS_SHOWN = 15
TOKENS_MIN_N = 5


@dataclass
class Figure:
    id: str
    title: str
    caption: str
    chart: alt.TopLevelMixin | None = None
    data: pl.DataFrame | None = None
    missing: str | None = None  # why it was not drawn
    table_html: str | None = None  # for tabular "figures"
    spec: dict | None = None  # the chart's Vega-Lite spec, validated once (files and page share it)


@dataclass
class Report:
    out: Path
    figures: list[Figure] = field(default_factory=list)

    @property
    def drawn(self) -> list[Figure]:
        return [f for f in self.figures if f.missing is None]

    @property
    def missing(self) -> list[Figure]:
        return [f for f in self.figures if f.missing is not None]


# ---------------------------------------------------------------- data


class Data:
    """The views, restricted to --model / --checkpoint, as Polars frames."""

    def __init__(self, warehouse, models: list[str] | None, checkpoints: list[str] | None):
        self.con = connect(warehouse)
        self.models, self.checkpoints = models or [], checkpoints or []

    def where(self, extra: str = "") -> str:
        conds = []
        if self.models:
            conds.append("model IN (" + ", ".join(_lit(m) for m in self.models) + ")")
        if self.checkpoints:
            conds.append("checkpoint IN (" + ", ".join(_lit(c) for c in self.checkpoints) + ")")
        if extra:
            conds.append(extra)
        return (" WHERE " + " AND ".join(conds)) if conds else ""

    def q(self, sql: str) -> pl.DataFrame:
        try:
            return self.con.sql(sql).pl()
        except duckdb.Error as e:  # a file gone or damaged since the views were bound: one line, no traceback
            raise UserError(duckdb_error_line(e)) from None

    def final(self, name: str, extra: str = "", order: str = "") -> pl.DataFrame:
        """Rows of each model's final checkpoint: 'main' if present, else the largest step."""
        return self.q(
            f"WITH v AS (SELECT * FROM {name}{self.where(extra)}), "
            "f AS (SELECT model, arg_max(checkpoint, coalesce(step, 9223372036854775807)) AS checkpoint "
            "FROM (SELECT DISTINCT model, checkpoint, step FROM v) GROUP BY model) "
            "SELECT v.* FROM v JOIN f USING (model, checkpoint)" + (f" ORDER BY {order}" if order else "")
        )

    def training(self, name: str, extra: str = "", order: str = "") -> pl.DataFrame:
        """Rows of models that have at least two checkpoints with a step."""
        return self.q(
            f"WITH v AS (SELECT * FROM {name}{self.where(extra)}), "
            "m AS (SELECT model FROM v WHERE step IS NOT NULL GROUP BY model HAVING count(DISTINCT step) >= 2) "
            "SELECT v.* FROM v JOIN m USING (model) WHERE v.step IS NOT NULL" + (f" ORDER BY {order}" if order else "")
        )


def _lit(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


# ---------------------------------------------------------------- chart helpers


def _color(field_: str = "model", title: str = "Model"):
    return alt.Color(f"{field_}:N", title=title, scale=alt.Scale(range=PALETTE))


def _tooltip(*fields: str) -> list:
    return [alt.Tooltip(f) for f in fields]


def _x_axis(x: str, df: pl.DataFrame | None = None) -> alt.Axis:
    if x in ("layer", "bucket"):  # integer ticks only: one per value when they are few
        values = sorted(df[x].unique().to_list()) if df is not None and x in df.columns else None
        if values and len(values) <= 30:
            return alt.Axis(values=values, format="d")
        return alt.Axis(tickMinStep=1, format="d")
    if x == "step":
        return alt.Axis(tickCount=6, labelOverlap="greedy")
    return alt.Axis()


def _line(df: pl.DataFrame, x: str, x_title: str, y: str, y_title: str, tooltip: list[str], color: str = "model",
          color_title: str = "Model", dash: str | None = None, dash_title: str | None = None,
          dash_order: list[str] | None = None):
    enc = dict(
        x=alt.X(f"{x}:Q", title=x_title, axis=_x_axis(x, df)),
        y=alt.Y(f"{y}:Q", title=y_title, scale=alt.Scale(zero=False)),
        color=_color(color, color_title),
        tooltip=_tooltip(*tooltip),
    )
    if dash:  # the first value of dash_order is drawn solid, the second dashed
        enc["strokeDash"] = alt.StrokeDash(f"{dash}:N", title=dash_title,
                                           scale=alt.Scale(domain=dash_order, range=[[1, 0], [6, 3]]),
                                           legend=alt.Legend(symbolType="stroke", symbolStrokeColor="#444", symbolStrokeWidth=2, symbolSize=400, symbolFillColor="transparent"))
    return alt.Chart(df).mark_line(point=True).encode(**enc).properties(width=WIDTH, height=HEIGHT)


def _last_layer(df: pl.DataFrame) -> pl.DataFrame:
    """Rows of each (model, checkpoint)'s last layer (the final norm where there is one)."""
    return df.filter(pl.col("layer") == pl.col("layer").max().over(["model", "checkpoint"]))


def _centered_label(df: pl.DataFrame) -> pl.DataFrame:
    return df.with_columns(
        pl.when(pl.col("centered")).then(pl.lit("Ŵ (mean-centred)")).otherwise(pl.lit("W (raw)")).alias("variant")
    )


# ---------------------------------------------------------------- figures


def fig_inter_sim_layers(d: Data) -> Figure:
    f = Figure("fig1_inter_sim_by_layer", "Figure 1. Inter-Sim per layer",
               "Mean cosine similarity between all token vectors of a layer (final checkpoint of each model), "
               "against the layer index and against relative depth (0 = embedding, 1 = last layer).")
    df = d.final("inter_sim", order="model, layer")
    if df.is_empty():
        f.missing = "no token data in the warehouse (run `extract` with a --source)"
        return f
    depth = d.q("SELECT DISTINCT model, checkpoint, n_layers FROM layer_norms")
    df = df.join(depth, on=["model", "checkpoint"]).with_columns(
        (pl.col("layer") / (pl.col("n_layers") - 1)).alias("relative_depth")).drop("n_layers")
    tips = ["model", "checkpoint", "layer", "relative_depth", "n", "inter_sim"]
    a = _line(df, "layer", "Layer index (0 = embedding)", "inter_sim", "Inter-Sim (mean cosine)", tips)
    b = _line(df, "relative_depth", "Relative depth (0 = embedding, 1 = last layer)", "inter_sim",
              "Inter-Sim (mean cosine)", tips)
    f.chart, f.data = alt.hconcat(a, b), df
    return f


def fig_avg_intra_layers(d: Data) -> Figure:
    f = Figure("fig2_avg_intra_sim_by_layer", "Figure 2. Average Intra-Sim per layer",
               "Unweighted mean over token types (n ≥ 2) of the mean cosine between occurrences of the same "
               "token (final checkpoint of each model).")
    df = d.final("avg_intra_sim", order="model, layer")
    if df.is_empty():
        f.missing = "no token type occurs twice in the warehouse's data"
        return f
    f.chart = _line(df, "layer", "Layer index (0 = embedding)", "avg_intra_sim", "Average Intra-Sim (mean cosine)",
                    ["model", "checkpoint", "layer", "tokens", "avg_intra_sim"])
    f.data = df
    return f


def _training_missing(name: str) -> str:
    return f"needs a model with at least two checkpoints that have a step (stepN) in {name}"


def fig_inter_sim_training(d: Data) -> Figure:
    return _training_line(
        d, "fig3_inter_sim_training", "Figure 3. Inter-Sim of the last layer during training",
        "Inter-Sim of each model's last layer (the final norm where there is one) at each checkpoint.",
        "inter_sim", "inter_sim", "Inter-Sim (mean cosine)", ["model", "checkpoint", "step", "layer", "n", "inter_sim"])


def fig_avg_intra_training(d: Data) -> Figure:
    return _training_line(
        d, "fig4_avg_intra_sim_training", "Figure 4. Average Intra-Sim of the last layer during training",
        "Average Intra-Sim of each model's last layer at each checkpoint.", "avg_intra_sim", "avg_intra_sim",
        "Average Intra-Sim (mean cosine)", ["model", "checkpoint", "step", "layer", "tokens", "avg_intra_sim"])


def _iso_bars(df: pl.DataFrame, matrix: str):
    df = _centered_label(df)
    return alt.Chart(df).mark_bar().encode(
        x=alt.X("model:N", title="Model", axis=alt.Axis(labelAngle=-30)),
        xOffset=alt.XOffset("variant:N"),
        y=alt.Y("i_w:Q", title=f"I(W) of the {matrix} (min Z / max Z)", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("variant:N", title="Matrix", scale=alt.Scale(range=PALETTE)),
        tooltip=_tooltip("model", "checkpoint", "matrix", "centered", "i_w", "i_w_eigh_signs"),
    ).properties(width=WIDTH, height=HEIGHT)


def fig_isotropy(d: Data, matrix: str, number: int) -> Figure:
    f = Figure(f"fig{number}_isotropy_{matrix}", f"Figure {number}. I(W) of the {matrix} matrix",
               f"Partition-function isotropy I(W) = min Z(c) / max Z(c) over ± eigenvectors c of WᵀW, for the raw "
               f"{matrix} matrix W and the mean-centred Ŵ (final checkpoint of each model; 1 = isotropic).")
    df = d.final("isotropy", _lit(matrix).join(["matrix = ", ""]), order="model, centered")
    if df.is_empty():
        f.missing = f"no {matrix} matrix parameters in the warehouse"
        return f
    f.chart, f.data = _iso_bars(df, matrix), df
    return f


def fig_isotropy_training(d: Data) -> Figure:
    f = Figure("fig7_isotropy_training", "Figure 7. I(W) of the unembedding during training",
               "I(W) of the raw (solid) and mean-centred (dashed) unembedding matrix at each checkpoint.")
    df = d.training("isotropy", "matrix = 'unembedding'", order="model, step, centered")
    if df.is_empty():
        f.missing = _training_missing("isotropy")
        return f
    df = _centered_label(df)
    f.chart = _line(df, "step", "Training step", "i_w", "I(W) of the unembedding (min Z / max Z)",
                    ["model", "checkpoint", "step", "variant", "i_w", "i_w_eigh_signs"], dash="variant",
                    dash_title="Matrix", dash_order=["W (raw)", "Ŵ (mean-centred)"])
    f.data = df
    return f


def _norm_long(df: pl.DataFrame) -> pl.DataFrame:
    return df.unpivot(index=["model", "checkpoint", "step", "module"], on=["avgnorm_g", "avgnorm_b"],
                      variable_name="parameter", value_name="avgnorm").with_columns(
        pl.col("parameter").replace({"avgnorm_g": "g (gain)", "avgnorm_b": "b (bias)"}))


def fig_layernorm(d: Data) -> Figure:
    f = Figure("fig8_final_layernorm", "Figure 8. The final LayerNorm's parameters",
               "avgnorm(v) = ‖v‖/√d of the final norm's gain g and bias b, and the ratio ‖b‖/‖g‖ "
               "(final checkpoint of each model).")
    df = d.final("layernorm", "is_final AND avgnorm_b IS NOT NULL", order="model")
    if df.is_empty():
        f.missing = "no model with a final LayerNorm that has a bias (encoders and RMSNorm models have none)"
        return f
    long = _norm_long(df)
    bars = alt.Chart(long).mark_bar().encode(
        x=alt.X("model:N", title="Model", axis=alt.Axis(labelAngle=-30)), xOffset="parameter:N",
        y=alt.Y("avgnorm:Q", title=AVGNORM_TITLE),
        color=alt.Color("parameter:N", title="Parameter", scale=alt.Scale(range=PALETTE)),
        tooltip=_tooltip("model", "checkpoint", "module", "parameter", "avgnorm"),
    ).properties(width=WIDTH, height=HEIGHT)
    ratio = alt.Chart(df).mark_bar(color=PALETTE[2]).encode(
        x=alt.X("model:N", title="Model", axis=alt.Axis(labelAngle=-30)),
        y=alt.Y("b_g_ratio:Q", title=RATIO_TITLE),
        tooltip=_tooltip("model", "checkpoint", "b_g_ratio", "sum_b_over_g", "b_parallel_norm", "b_perp_norm"),
    ).properties(width=WIDTH * 0.6, height=HEIGHT)
    f.chart, f.data = alt.hconcat(bars, ratio), df
    return f


def fig_layernorm_training(d: Data) -> Figure:
    f = Figure("fig9_final_layernorm_training", "Figure 9. The final LayerNorm's parameters during training",
               "avgnorm of the final norm's gain g (solid) and bias b (dashed), and ‖b‖/‖g‖, at each checkpoint.")
    df = d.training("layernorm", "is_final AND avgnorm_b IS NOT NULL", order="model, step")
    if df.is_empty():
        f.missing = _training_missing("layernorm") + " and a final LayerNorm with a bias"
        return f
    a = _line(_norm_long(df), "step", "Training step", "avgnorm", AVGNORM_TITLE,
              ["model", "checkpoint", "step", "parameter", "avgnorm"], dash="parameter", dash_title="Parameter",
              dash_order=["g (gain)", "b (bias)"])
    b = _line(df, "step", "Training step", "b_g_ratio", RATIO_TITLE,
              ["model", "checkpoint", "step", "b_g_ratio", "sum_b_over_g"])
    f.chart, f.data = alt.hconcat(a, b), df
    return f


def fig_heatmap(d: Data) -> Figure:
    f = Figure("fig10_inter_sim_heatmap", "Inter-Sim per layer and training step",
               "Inter-Sim of every layer (rows) at every checkpoint (columns), one panel per model.")
    df = d.training("inter_sim", order="model, step, layer")
    if df.is_empty():
        f.missing = _training_missing("inter_sim")
        return f
    f.chart = alt.Chart(df).mark_rect().encode(
        x=alt.X("step:O", title="Training step"),
        y=alt.Y("layer:O", title="Layer index (0 = embedding)", sort="descending"),
        color=alt.Color("inter_sim:Q", title="Inter-Sim", scale=alt.Scale(scheme="viridis")),
        tooltip=_tooltip("model", "checkpoint", "step", "layer", "n", "inter_sim"),
    ).properties(width=WIDTH * 0.8, height=HEIGHT * 0.8).facet(
        column=alt.Column("model:N", title="Model")).resolve_scale(x="independent")
    f.data = df
    return f


def fig_by_source(d: Data) -> Figure:
    f = Figure("fig11_inter_sim_by_source", "Inter-Sim per layer, by text source",
               "Inter-Sim per layer computed on each source separately (final checkpoint), one panel per model.")
    df = d.final("inter_sim_by_source", order="model, source, layer")
    if df.is_empty():
        f.missing = "no token data in the warehouse"
        return f
    f.chart = alt.Chart(df).mark_line(point=True).encode(
        x=alt.X("layer:Q", title="Layer index (0 = embedding)", axis=_x_axis("layer", df)),
        y=alt.Y("inter_sim:Q", title="Inter-Sim (mean cosine)", scale=alt.Scale(zero=False)),
        color=_color("source", "Source"),
        tooltip=_tooltip("model", "checkpoint", "source", "layer", "n", "inter_sim"),
    ).properties(width=WIDTH * 0.8, height=HEIGHT * 0.8).facet(column=alt.Column("model:N", title="Model"))
    f.data = df
    return f


def fig_tokens(d: Data) -> Figure:
    f = Figure("table1_contextualised_tokens", "Most and least contextualised tokens",
               f"Tokens of each model's last layer (final checkpoint) with the lowest Intra-Sim (most "
               f"contextualised) and the highest (least), among tokens seen at least {TOKENS_MIN_N} times.")
    # Each model's final checkpoint and last layer from the per-layer totals first, then only that
    # slice of the per-token view (a sweep holds 26 layers × 50k types × every checkpoint: reading it
    # whole took 14 s and 7.6 GB for 63 checkpoints).
    ends = _last_layer(d.final("layer_totals", "source = 'all'")).select("model", "checkpoint", "layer").sort("model")
    parts = [d.q(f"SELECT * FROM intra_sim WHERE model = {_lit(r['model'])} AND checkpoint = {_lit(r['checkpoint'])} "
                 f"AND layer = {r['layer']} AND n >= {TOKENS_MIN_N} ORDER BY intra_sim") for r in ends.iter_rows(named=True)]
    df = pl.concat(parts) if parts else pl.DataFrame()
    if df.is_empty():
        f.missing = f"no token type occurs {TOKENS_MIN_N} times or more"
        return f
    ranked = df.with_columns(pl.col("intra_sim").rank("ordinal").over("model").alias("rank_low"),
                             pl.col("intra_sim").rank("ordinal", descending=True).over("model").alias("rank_high"))
    most = ranked.filter(pl.col("rank_low") <= TOKENS_SHOWN).with_columns(pl.lit("most").alias("contextualised"))
    least = ranked.filter(pl.col("rank_high") <= TOKENS_SHOWN).with_columns(pl.lit("least").alias("contextualised"))
    out = pl.concat([most, least]).drop("rank_low", "rank_high").sort(["model", "contextualised", "intra_sim"])
    f.data = out
    parts = []
    for (model,), group in out.group_by(["model"], maintain_order=True):
        rows = "".join(
            f"<tr><td>{html.escape(r['contextualised'])}</td><td><code>{html.escape(repr(r['token'] or ''))}</code></td>"
            f"<td>{r['token_id']}</td><td>{r['n']}</td><td title='{r['intra_sim']!r}'>{r['intra_sim']:.4f}</td></tr>"
            for r in group.iter_rows(named=True))
        parts.append(f"<h3>{html.escape(model)} (layer {group['layer'][0]}, checkpoint "
                     f"{html.escape(group['checkpoint'][0])})</h3><table><thead><tr><th>contextualised</th>"
                     f"<th>token</th><th>id</th><th>n</th><th>Intra-Sim</th></tr></thead><tbody>{rows}</tbody></table>")
    f.table_html = "".join(parts)
    return f


def _peer_by_layer(d: Data, fid: str, title: str, caption: str, view: str, value: str, y_title: str,
                   tips: list[str], dash_values: list[str] | None = None) -> Figure:
    f = Figure(fid, title, caption)
    df = d.final(view, "source = 'all'", order="model, layer")
    if df.is_empty():
        f.missing = f"no data for {view}" + (f" (extract with {PEER_FLAGS[view]})" if view in PEER_FLAGS else "")
        return f
    if dash_values:  # two measures of one quantity, solid and dashed, in one column `value`
        df = df.unpivot(index=["model", "checkpoint", "step", "source", "layer"], on=dash_values,
                        variable_name="measure", value_name=value)
        f.chart = _line(df, "layer", "Layer index (0 = embedding)", value, y_title,
                        ["model", "checkpoint", "layer", "measure", value], dash="measure", dash_title="Measure",
                        dash_order=dash_values)
    else:
        f.chart = _line(df, "layer", "Layer index (0 = embedding)", value, y_title, tips)
    f.data = df
    return f


def _training_line(d: Data, fid: str, title: str, caption: str, view: str, value: str, y_title: str,
                   tips: list[str], extra: str = "") -> Figure:
    """A value of each model's last layer against the training step."""
    f = Figure(fid, title, caption)
    df = d.training(view, extra, order="model, step, layer")
    if df.is_empty():
        f.missing = _training_missing(view) + (f" (extract with {PEER_FLAGS[view]})" if view in PEER_FLAGS else "")
        return f
    df = _last_layer(df)
    f.chart = _line(df, "step", "Training step", value, y_title, tips)
    f.data = df
    return f


PEER_FLAGS = {"anisotropy": "--moments", "linearity": "--cross-moments", "intrinsic_dim": "--sample K",
              "alpha_req": "--moments", "outlier_kurtosis": "--moments", "dataset_entropy": "--sequences",
              "curvature": "--sequences", "prompt_entropy": "--prompt-entropy"}


def fig_anisotropy_layers(d: Data) -> Figure:
    return _peer_by_layer(
        d, "fig12_anisotropy_by_layer", "Anisotropy per layer (Razzhigaev et al.)",
        "λ_max / Σλ of the covariance of each layer's hidden states (all sources, final checkpoint).",
        "anisotropy", "anisotropy", "Anisotropy (largest eigenvalue share)",
        ["model", "checkpoint", "layer", "n", "anisotropy"])


def fig_anisotropy_training(d: Data) -> Figure:
    return _training_line(
        d, "fig13_anisotropy_training", "Anisotropy of the last layer during training",
        "λ_max / Σλ of the last layer's hidden states at each checkpoint.", "anisotropy", "anisotropy",
        "Anisotropy (largest eigenvalue share)", ["model", "checkpoint", "step", "layer", "anisotropy"],
        "source = 'all'")


def fig_intrinsic_dim_layers(d: Data) -> Figure:
    return _peer_by_layer(
        d, "fig14_intrinsic_dim_by_layer", "Intrinsic dimension per layer (TwoNN)",
        "TwoNN on the bottom-k sample of each layer: llm-microscope's estimator (solid) and "
        "scikit-dimension's (dashed); final checkpoint, all sources.",
        "intrinsic_dim", "dimension", "Intrinsic dimension (TwoNN)", [], ["twonn", "twonn_skdim"])


def fig_intrinsic_dim_training(d: Data) -> Figure:
    return _training_line(
        d, "fig15_intrinsic_dim_training", "Intrinsic dimension of the last layer during training",
        "TwoNN (llm-microscope's estimator) on the last layer's sample at each checkpoint.", "intrinsic_dim",
        "twonn", "Intrinsic dimension (TwoNN)", ["model", "checkpoint", "step", "layer", "sample_size", "twonn"],
        "source = 'all'")


def fig_linearity_layers(d: Data) -> Figure:
    return _peer_by_layer(
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
        x=alt.X("layer:Q", title="Layer index (0 = embedding)", axis=_x_axis("layer", df)),
        y=alt.Y("contrib:Q", title="Contribution to Inter-Sim"),
        color=_color(), shape=alt.Shape("top:N", title="Rank"),
        tooltip=_tooltip("model", "checkpoint", "layer", "rank", "dim", "contrib"),
    ).properties(width=WIDTH, height=HEIGHT)
    f.data = df
    return f


def fig_drift_layers(d: Data) -> Figure:
    return _peer_by_layer(
        d, "fig18_drift_by_layer", "Common drift per layer (Biś et al.)",
        "Mean cosine of each vector to the layer's mean vector μ; all sources, final checkpoint. "
        "‖μ‖ is in the view `drift` (mean_norm).",
        "drift", "mean_cos_to_mean", "Mean cosine to the mean vector",
        ["model", "checkpoint", "layer", "n", "mean_norm", "mean_cos_to_mean"])


def fig_drift_training(d: Data) -> Figure:
    return _training_line(
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
    df = _last_layer(df)
    f.chart = _line(df, "bucket", "Frequency bucket: floor(log2 count)", "inter_sim", "Inter-Sim",
                    ["model", "checkpoint", "layer", "bucket", "types", "n", "inter_sim"])
    f.data = df
    return f


def fig_similarity_layers(d: Data) -> Figure:
    return _peer_by_layer(
        d, "fig21_cka_procrustes_by_layer", "Similarity of each layer to the next: CKA and Procrustes",
        "Linear CKA (solid) and the orthogonal Procrustes similarity ‖XᵀY‖_*/(‖X‖_F‖Y‖_F) (dashed) of "
        "layer l and l + 1, centred, over all tokens; final checkpoint, all sources.",
        "linearity", "similarity", "Similarity to the next layer", [], ["cka", "procrustes_orthogonal"])


def _pooled_by_layer(d: Data, fid: str, title: str, caption: str, value: str, y_title: str) -> Figure:
    """sequence_spectrum's `value` by layer, mean pooling solid and last-vector pooling dashed."""
    f = Figure(fid, title, caption)
    df = d.final("sequence_spectrum", "source = 'all'", order="model, layer, pooling")
    if df.is_empty():
        f.missing = "no data for sequence_spectrum (extract with --sequences)"
        return f
    f.chart = _line(df, "layer", "Layer index (0 = embedding)", value, y_title,
                    ["model", "checkpoint", "layer", "pooling", "windows", value], dash="pooling",
                    dash_title="Pooling", dash_order=["mean", "last"])
    f.data = df
    return f


def fig_massive_layers(d: Data) -> Figure:
    f = Figure("fig26_massive_activations_by_layer", "Massive activations per layer (Sun et al.)",
               "The largest |h| of each layer over all counted tokens and dimensions, as a multiple of the mean |h| "
               "(the tooltip says which token and dimension); final checkpoint, all sources. Sun et al. report "
               "values thousands of times the mean, at a few dimensions and tokens, from the early layers on.")
    df = d.final("massive_activations", "source = 'all' AND rank = 1", order="model, layer")
    if df.is_empty():
        f.missing = "no data for massive_activations (extract with --sequences)"
        return f
    f.chart = _line(df, "layer", "Layer index (0 = embedding)", "ratio_to_mean_abs", "Largest |h| / mean |h|",
                    ["model", "checkpoint", "layer", "dim", "token", "abs_value", "ratio_to_mean_abs"])
    f.data = df
    return f


def fig_massive_training(d: Data) -> Figure:
    f = Figure("fig27_massive_activations_training", "Massive activations during training",
               "The largest |h| / mean |h| over all layers at each checkpoint (the layer is in the tooltip).")
    df = d.training("massive_activations", "source = 'all' AND rank = 1", order="model, step, layer")
    if df.is_empty():
        f.missing = _training_missing("massive_activations")
        return f
    df = df.filter(pl.col("ratio_to_mean_abs") == pl.col("ratio_to_mean_abs").max().over(["model", "checkpoint"]))
    df = df.unique(["model", "checkpoint"], keep="first", maintain_order=True)
    f.chart = _line(df, "step", "Training step", "ratio_to_mean_abs", "Largest |h| / mean |h|",
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
    df = _centered_label(_weight_matrix(df))
    f.chart = alt.Chart(df).mark_line().encode(
        x=alt.X("k:Q", title="Rank k"), y=alt.Y("singular_value:Q", title="Singular value", scale=alt.Scale(type="log")),
        color=_color(), strokeDash=alt.StrokeDash("variant:N", title="Matrix"),
        tooltip=_tooltip("model", "checkpoint", "matrix", "variant", "k", "singular_value"),
    ).properties(width=WIDTH, height=HEIGHT)
    f.data = df
    return f


def fig_weight_spectrum_training(d: Data) -> Figure:
    f = Figure("fig29_weight_spectrum_training", "Singular values of the unembedding during training",
               "Mean-centred singular values of the unembedding (the embedding where there is none) at each "
               "checkpoint, coloured by training step, one panel per model.")
    df = d.training("weight_spectrum", "centered", order="model, step, k")
    if df.is_empty():
        f.missing = _training_missing("weight_spectrum")
        return f
    df = _weight_matrix(df)
    f.chart = alt.Chart(df).mark_line().encode(
        x=alt.X("k:Q", title="Rank k"), y=alt.Y("singular_value:Q", title="Singular value", scale=alt.Scale(type="log")),
        color=alt.Color("step:Q", title="Step", scale=alt.Scale(scheme="viridis")), detail="checkpoint:N",
        tooltip=_tooltip("model", "checkpoint", "step", "matrix", "k", "singular_value"),
    ).properties(width=WIDTH, height=HEIGHT).facet(column=alt.Column("model:N", title=None))
    f.data = df
    return f


def fig_sequence_rank_layers(d: Data) -> Figure:
    return _pooled_by_layer(
        d, "fig30_sequence_effective_rank_by_layer", "Effective rank of sequence representations per layer",
        "exp(entropy) of the covariance spectrum of one pooled vector per window: the windows' mean vectors (solid) "
        "and last vectors (dashed); final checkpoint, all sources (Skean et al.'s sequence-level view).",
        "effective_rank", "Effective rank over windows")


def fig_sequence_rank_training(d: Data) -> Figure:
    return _training_line(
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
        return _peer_by_layer(d, f"fig{self.number}_{self.view}_by_layer", f"{self.title} per layer ({self.cite})",
                              f"{self.about} Final checkpoint, all sources.", self.view, self.value, self.y_title,
                              ["model", "checkpoint", "layer", *self.tips, self.value])

    def training(self, d: Data) -> Figure:
        return _training_line(d, f"fig{self.number + 1}_{self.view}_training",
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


FIGURES = [
    fig_inter_sim_layers, fig_avg_intra_layers, fig_inter_sim_training, fig_avg_intra_training,
    lambda d: fig_isotropy(d, "unembedding", 5), lambda d: fig_isotropy(d, "embedding", 6),
    fig_isotropy_training, fig_layernorm, fig_layernorm_training, fig_heatmap, fig_by_source, fig_tokens,
    fig_anisotropy_layers, fig_anisotropy_training, fig_intrinsic_dim_layers, fig_intrinsic_dim_training,
    fig_linearity_layers, fig_dim_contrib, fig_drift_layers, fig_drift_training, fig_inter_sim_by_frequency,
    fig_similarity_layers, MEASURES[0].by_layer, MEASURES[0].training, MEASURES[1].by_layer, MEASURES[1].training,
    fig_massive_layers, fig_massive_training, fig_weight_spectrum, fig_weight_spectrum_training,
    fig_sequence_rank_layers, fig_sequence_rank_training,
    *[f for m in MEASURES[2:] for f in (m.by_layer, m.training)],
]


# ---------------------------------------------------------------- output


def _configure(chart):
    return chart.configure_axis(labelFontSize=12, titleFontSize=13).configure_legend(
        labelFontSize=12, titleFontSize=13).configure_header(labelFontSize=13, titleFontSize=13)


def _script_json(obj) -> str:
    """JSON that is safe inside a <script> element (no '</script>', no HTML comments)."""
    return json.dumps(obj).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _vl_version() -> str:
    return "_".join(alt.VEGALITE_VERSION.split(".")[:2])


def _draw(fig: Figure, out: Path, png: bool) -> None:
    """The chart's SVG and (2× scale) PNG: the spec is built and validated once, Vega lays the chart
    out once, and the PNG is rasterised from that SVG — byte for byte what `chart.save` writes for
    each, at a third of its cost."""
    import vl_convert as vlc

    fig.spec = fig.chart.to_dict()
    svg = vlc.vegalite_to_svg(fig.spec, vl_version=_vl_version())
    (out / f"{fig.id}.svg").write_text(svg, encoding="utf-8")
    if png:
        (out / f"{fig.id}.png").write_bytes(vlc.svg_to_png(svg, scale=2, ppi=72))


@functools.cache
def _js_bundle() -> str:
    """Vega, Vega-Lite and vega-embed in one script (inlined: the report works offline).  Bundling
    takes seconds, so the bundle is kept in the user's cache directory per vl-convert and Vega-Lite
    version; a cache that cannot be read or written is only slower."""
    import os

    import vl_convert as vlc

    version = f"{getattr(vlc, '__version__', 'unknown')}-{_vl_version()}"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "isotropy-warehouse"
    path = cache / f"vega-bundle-{version}.js"
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        pass
    bundle = vlc.javascript_bundle(vl_version=_vl_version())
    try:
        store.atomic_write_bytes(cache, path.name, bundle.encode())  # whole or absent, whatever runs beside it
    except OSError:
        pass
    return bundle


PAGE_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1100px; color: #222; }
h1 { margin-bottom: 0.2em; } figure { margin: 2em 0; } figcaption { color: #444; margin-bottom: 0.5em; }
table { border-collapse: collapse; margin: 0.5em 2em 1em 0; display: inline-table; vertical-align: top; }
td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: left; } .missing { color: #8a4b00; }
.links a { margin-right: 1em; font-size: 0.9em; } dl { display: grid; grid-template-columns: max-content auto; gap: 0 1em; }
"""

ERROR_CAPTURE = """
window.__errors = [];
(function () {
  const orig = console.error;
  console.error = function (...args) { window.__errors.push(args.map(String).join(' ')); orig.apply(console, args); };
  window.addEventListener('error', e => window.__errors.push(String(e.message)));
  window.addEventListener('unhandledrejection', e => window.__errors.push(String(e.reason)));
})();
"""


def _meta(d: Data, warehouse) -> dict:
    def column(sql: str) -> list:
        return d.q(sql).to_series(0).to_list()  # through Data.q: a DuckDB error is one line

    data_runs = d.where("kind = 'data'")
    excluded = d.where("source = 'all' AND (n_nonfinite > 0 OR n_zero > 0)")
    return {
        "warehouse": open_storage(warehouse).uri(""),
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "models": column(f"SELECT DISTINCT model FROM runs{d.where()} ORDER BY 1"),
        "checkpoints": column(f"SELECT checkpoint FROM runs{d.where()} GROUP BY checkpoint "
                              "ORDER BY min(step) NULLS FIRST, checkpoint"),
        "sources": column(f"SELECT DISTINCT source FROM runs{data_runs} ORDER BY 1"),
        "tokens": column(f"SELECT coalesce(sum(tokens), 0) FROM runs{data_runs}")[0],
        "nonfinite": d.q(f"SELECT model, checkpoint, layer, n_nonfinite, n_zero FROM layer_norms{excluded} ORDER BY ALL"),
    }


def build_report(warehouse: Path, out: Path, models: list[str] | None = None,
                 checkpoints: list[str] | None = None, png: bool = True) -> Report:
    warehouse, out = open_storage(warehouse, must_exist=True), Path(out)
    d = Data(warehouse, models, checkpoints)
    report = Report(out)
    out.mkdir(parents=True, exist_ok=True)
    for make in progress("report", iterable=FIGURES, unit="figure"):  # a bar on a terminal, else plain lines
        fig = make(d)
        report.figures.append(fig)
        if fig.missing:
            continue
        fig.data.write_csv(out / f"{fig.id}.csv")
        if fig.chart is not None:
            fig.chart = _configure(fig.chart)
            _draw(fig, out, png)
    meta = _meta(d, warehouse)
    d.con.close()
    store.atomic_write_bytes(out, "index.html", _page(report, meta).encode())
    return report


def _page(report: Report, meta: dict) -> str:
    e = html.escape
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Isotropy report</title>",
        f"<style>{PAGE_CSS}</style><script>{ERROR_CAPTURE}</script>",
        f"<script>{_js_bundle()}</script></head><body>",
        "<h1>Isotropy report</h1><dl>",
        f"<dt>Warehouse</dt><dd><code>{e(meta['warehouse'])}</code></dd>",
        f"<dt>Drawn</dt><dd>{e(meta['generated'])}</dd>",
        f"<dt>Models</dt><dd>{e(', '.join(meta['models']) or '(none)')}</dd>",
        f"<dt>Checkpoints</dt><dd>{e(', '.join(meta['checkpoints']) or '(none)')}</dd>",
        f"<dt>Sources</dt><dd>{e(', '.join(meta['sources']) or '(none)')}</dd>",
        f"<dt>Tokens</dt><dd>{meta['tokens']:,}</dd></dl>",
    ]
    nf = meta["nonfinite"]
    if nf.height:
        rows = "".join(f"<tr><td>{e(r['model'])}</td><td>{e(r['checkpoint'])}</td><td>{r['layer']}</td>"
                       f"<td>{r['n_nonfinite']}</td><td>{r['n_zero']}</td></tr>" for r in nf.iter_rows(named=True))
        parts.append("<p class='missing'><b>Excluded activations.</b> Vectors with NaN/inf components or zero norm "
                     "were counted and left out of every metric:</p><table><tr><th>model</th><th>checkpoint</th>"
                     f"<th>layer</th><th>NaN/inf</th><th>zero</th></tr>{rows}</table>")
    if report.missing:
        parts.append("<h2>Not drawn</h2><ul>" + "".join(
            f"<li class='missing'><b>{e(f.title)}</b>: {e(f.missing)}.</li>" for f in report.missing) + "</ul>")
    specs = {}
    for f in report.drawn:
        links = [f"<a href='{f.id}.csv'>data (CSV)</a>"]
        if f.chart is not None:
            links = [f"<a href='{f.id}.png'>PNG</a>", f"<a href='{f.id}.svg'>SVG</a>"] + links
            specs[f.id] = f.spec
        body = f"<div id='{f.id}' class='chart'></div>" if f.chart is not None else f.table_html
        parts.append(f"<figure><h2>{e(f.title)}</h2><figcaption>{e(f.caption)}</figcaption>{body}"
                     f"<div class='links'>{''.join(links)}</div></figure>")
    parts.append("<pre id='render-status' hidden></pre><script>")
    parts.append(f"const specs = {_script_json(specs)};")
    parts.append("""
const embeds = Object.entries(specs).map(([id, spec]) =>
  vegaEmbed('#' + id, spec, {renderer: 'svg', actions: false}).then(() => id));
Promise.allSettled(embeds).then(results => {
  const rendered = results.filter(r => r.status === 'fulfilled').length;
  results.filter(r => r.status === 'rejected').forEach(r => window.__errors.push(String(r.reason)));
  const status = document.getElementById('render-status');
  status.textContent = JSON.stringify({charts: results.length, rendered: rendered, errors: window.__errors});
  document.body.dataset.rendered = String(rendered);
});
</script></body></html>""")
    return "\n".join(parts)
