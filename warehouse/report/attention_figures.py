"""Inside attention, as figures: how far each head's queries and keys drift from the origin
(qk_geometry: Godey et al. 2024) and how much each head attends to the first token (attention_sink,
attention_sink_rate: Gu et al. 2025), by layer at the final checkpoint (every head a point, the
layer's mean a line) and across training (every head a row of a heatmap; the sink rate a line).
"""

from __future__ import annotations

import altair as alt
import polars as pl

from .charts import (HEIGHT, WIDTH, color_by, has_twins, line_chart, tooltips, training_missing, twin_overlay,
                     x_axis)
from .data import Data, Figure

QK_MISSING = ("no data for qk_geometry (extract with --attention; a model whose attention does not go "
              "through transformers' attention interface has none)")
SINK_MISSING = "no data for attention_sink (extract with --attention-sinks)"
SINK_EPSILON = 0.3  # Gu et al.'s threshold, as attention_sink_rate uses it


def _heads_by_layer(df: pl.DataFrame, value: str, y_title: str, tips: list[str], dash: str | None = None,
                    dash_order: list[str] | None = None):
    """Every head a faint point, the mean over heads of each layer a line."""
    base = alt.Chart(df)
    enc = dict(x=alt.X("layer:Q", title="Block (0-based)", axis=x_axis("layer", df)), color=color_by())
    extra = {}
    if dash:
        extra["strokeDash"] = alt.StrokeDash(f"{dash}:N", title=dash.capitalize(),
                                             scale=alt.Scale(domain=dash_order, range=[[1, 0], [6, 3]]))
    points = base.mark_point(opacity=0.35, size=18).encode(
        **enc, y=alt.Y(f"{value}:Q", title=y_title), tooltip=tooltips(*tips),
        **({"shape": alt.Shape(f"{dash}:N", title=dash.capitalize())} if dash else {}))
    line = base.mark_line().encode(**enc, y=alt.Y(f"mean({value}):Q", title=y_title), **extra)
    return alt.layer(points, line).properties(width=WIDTH, height=HEIGHT)


def fig_qk_drift_layers(d: Data) -> Figure:
    f = Figure("fig44_qk_drift_by_layer", "Query and key drift per head, by layer",
               "‖mean q‖ / √(mean ‖q‖²) of each head's queries (solid) and keys (dashed) after the rotary embedding "
               "(1: every vector the mean, 0: mean zero); each head a point, the layer's mean a line; final "
               "checkpoint, all sources. Godey et al. (2024) find queries and keys drifting along shared "
               "directions as training goes on.")
    df = d.final("qk_geometry", order="model, layer, head")
    if df.is_empty():
        f.missing = QK_MISSING
        return f
    df = df.unpivot(index=["model", "checkpoint", "step", "layer", "head", "kv_head", "n"],
                    on=["q_drift_share", "k_drift_share"], variable_name="measure", value_name="drift_share")
    f.chart = _heads_by_layer(df, "drift_share", "Drift share", ["model", "checkpoint", "layer", "head", "measure",
                                                                  "drift_share"], "measure",
                              ["q_drift_share", "k_drift_share"])
    f.data = df
    return f


def _head_rows(df: pl.DataFrame) -> pl.DataFrame:
    """A `block_head` label (block·head, zero-padded so that it sorts) for each row."""
    return df.with_columns(pl.format("{}·{}", pl.col("layer").cast(pl.String).str.zfill(2),
                                     pl.col("head").cast(pl.String).str.zfill(2)).alias("block_head"))


def fig_qk_drift_training(d: Data) -> Figure:
    f = Figure("fig45_qk_drift_training", "Query drift of every head during training",
               "‖mean q‖ / √(mean ‖q‖²) of every head (rows: block·head) at every checkpoint (columns), one panel "
               "per model; all sources.")
    df = d.training("qk_geometry", order="model, step, layer, head")
    if df.is_empty():
        f.missing = training_missing("qk_geometry") + " (extract with --attention)"
        return f
    df = _head_rows(df)
    rows = df["block_head"].n_unique()
    rect = alt.Chart(df).mark_rect().encode(
        x=alt.X("step:O", title="Training step"),
        y=alt.Y("block_head:O", title="Block · head", sort="descending"),
        color=alt.Color("q_drift_share:Q", title="Query drift share", scale=alt.Scale(scheme="viridis")),
        tooltip=tooltips("model", "checkpoint", "step", "layer", "head", "q_drift_share", "k_drift_share",
                         "qk_drift_cos"),
    )
    chart = alt.layer(rect, twin_overlay(rect, "rect")) if has_twins(df) else rect
    f.chart = chart.properties(width=WIDTH * 0.8, height=min(900, max(HEIGHT * 0.8, 6 * rows))).facet(
        column=alt.Column("model:N", title="Model")).resolve_scale(x="independent", y="independent")
    f.data = df
    return f


def fig_sink_layers(d: Data) -> Figure:
    f = Figure("fig46_attention_sink_by_layer", "Attention on the first token per head, by layer",
               f"Mean attention of each head on its window's first token over the query positions after it (each "
               f"head a point, the layer's mean a line); a head above {SINK_EPSILON} is a sink (Gu et al. 2025); "
               f"final checkpoint, all sources.")
    df = d.final("attention_sink", order="model, layer, head")
    if df.is_empty():
        f.missing = SINK_MISSING
        return f
    f.chart = _heads_by_layer(df, "sink_attention", "Attention on the first token",
                              ["model", "checkpoint", "layer", "head", "n", "mean_window", "sink_attention"])
    f.data = df
    return f


def fig_sink_rate_training(d: Data) -> Figure:
    f = Figure("fig47_sink_rate_training", "Sink rate during training",
               f"The share of heads (every block) whose mean attention on the first token exceeds {SINK_EPSILON} "
               "(Gu et al. 2025's sink rate) at each checkpoint; all sources.")
    df = d.training("attention_sink_rate", order="model, step")
    if df.is_empty():
        f.missing = training_missing("attention_sink_rate") + " (extract with --attention-sinks)"
        return f
    f.chart = line_chart(df, "step", "Training step", "sink_rate", f"Sink rate (ε = {SINK_EPSILON})",
                         ["model", "checkpoint", "step", "heads", "sink_heads", "sink_rate", "mean_window"])
    f.data = df
    return f
