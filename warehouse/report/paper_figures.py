"""The paper's figures: Inter-Sim and average Intra-Sim by layer and across training (Figures 1-4),
the isotropy I(W) of the embedding and unembedding (5-7), the final LayerNorm's parameters (8-9),
Inter-Sim by layer and step and by source, and the most and least contextualised tokens.
"""

from __future__ import annotations

import html

import altair as alt
import polars as pl

from ..query import sql_literal
from .charts import (AVGNORM_TITLE, HEIGHT, PALETTE, RATIO_TITLE, WIDTH, centered_label, color_by, has_twins,
                     last_layer, line_chart, tooltips, training_line, training_missing, twin_overlay, x_axis)
from .data import Data, Figure

TOKENS_SHOWN = 15
TOKENS_MIN_N = 5


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
    a = line_chart(df, "layer", "Layer index (0 = embedding)", "inter_sim", "Inter-Sim (mean cosine)", tips)
    b = line_chart(df, "relative_depth", "Relative depth (0 = embedding, 1 = last layer)", "inter_sim",
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
    f.chart = line_chart(df, "layer", "Layer index (0 = embedding)", "avg_intra_sim", "Average Intra-Sim (mean cosine)",
                         ["model", "checkpoint", "layer", "tokens", "avg_intra_sim"])
    f.data = df
    return f


def fig_inter_sim_training(d: Data) -> Figure:
    return training_line(
        d, "fig3_inter_sim_training", "Figure 3. Inter-Sim of the last layer during training",
        "Inter-Sim of each model's last layer (the final norm where there is one) at each checkpoint.",
        "inter_sim", "inter_sim", "Inter-Sim (mean cosine)", ["model", "checkpoint", "step", "layer", "n", "inter_sim"])


def fig_avg_intra_training(d: Data) -> Figure:
    return training_line(
        d, "fig4_avg_intra_sim_training", "Figure 4. Average Intra-Sim of the last layer during training",
        "Average Intra-Sim of each model's last layer at each checkpoint.", "avg_intra_sim", "avg_intra_sim",
        "Average Intra-Sim (mean cosine)", ["model", "checkpoint", "step", "layer", "tokens", "avg_intra_sim"])


def _iso_bars(df: pl.DataFrame, matrix: str):
    df = centered_label(df)
    return alt.Chart(df).mark_bar().encode(
        x=alt.X("model:N", title="Model", axis=alt.Axis(labelAngle=-30)),
        xOffset=alt.XOffset("variant:N"),
        y=alt.Y("i_w:Q", title=f"I(W) of the {matrix} (min Z / max Z)", scale=alt.Scale(domain=[0, 1])),
        color=alt.Color("variant:N", title="Matrix", scale=alt.Scale(range=PALETTE)),
        tooltip=tooltips("model", "checkpoint", "matrix", "centered", "i_w", "i_w_eigh_signs"),
    ).properties(width=WIDTH, height=HEIGHT)


def fig_isotropy(d: Data, matrix: str, number: int) -> Figure:
    f = Figure(f"fig{number}_isotropy_{matrix}", f"Figure {number}. I(W) of the {matrix} matrix",
               f"Partition-function isotropy I(W) = min Z(c) / max Z(c) over ± eigenvectors c of WᵀW, for the raw "
               f"{matrix} matrix W and the mean-centred Ŵ (final checkpoint of each model; 1 = isotropic).")
    df = d.final("isotropy", sql_literal(matrix).join(["matrix = ", ""]), order="model, centered")
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
        f.missing = training_missing("isotropy")
        return f
    df = centered_label(df)
    f.chart = line_chart(df, "step", "Training step", "i_w", "I(W) of the unembedding (min Z / max Z)",
                         ["model", "checkpoint", "step", "variant", "i_w", "i_w_eigh_signs"], dash="variant",
                         dash_title="Matrix", dash_order=["W (raw)", "Ŵ (mean-centred)"])
    f.data = df
    return f


def _norm_long(df: pl.DataFrame) -> pl.DataFrame:
    index = ["model", "checkpoint", "step", "module"] + (["twin_of"] if "twin_of" in df.columns else [])
    return df.unpivot(index=index, on=["avgnorm_g", "avgnorm_b"],
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
        tooltip=tooltips("model", "checkpoint", "module", "parameter", "avgnorm"),
    ).properties(width=WIDTH, height=HEIGHT)
    ratio = alt.Chart(df).mark_bar(color=PALETTE[2]).encode(
        x=alt.X("model:N", title="Model", axis=alt.Axis(labelAngle=-30)),
        y=alt.Y("b_g_ratio:Q", title=RATIO_TITLE),
        tooltip=tooltips("model", "checkpoint", "b_g_ratio", "sum_b_over_g", "b_parallel_norm", "b_perp_norm"),
    ).properties(width=WIDTH * 0.6, height=HEIGHT)
    f.chart, f.data = alt.hconcat(bars, ratio), df
    return f


def fig_layernorm_training(d: Data) -> Figure:
    f = Figure("fig9_final_layernorm_training", "Figure 9. The final LayerNorm's parameters during training",
               "avgnorm of the final norm's gain g (solid) and bias b (dashed), and ‖b‖/‖g‖, at each checkpoint.")
    df = d.training("layernorm", "is_final AND avgnorm_b IS NOT NULL", order="model, step")
    if df.is_empty():
        f.missing = training_missing("layernorm") + " and a final LayerNorm with a bias"
        return f
    a = line_chart(_norm_long(df), "step", "Training step", "avgnorm", AVGNORM_TITLE,
                   ["model", "checkpoint", "step", "parameter", "avgnorm"], dash="parameter", dash_title="Parameter",
                   dash_order=["g (gain)", "b (bias)"])
    b = line_chart(df, "step", "Training step", "b_g_ratio", RATIO_TITLE,
                   ["model", "checkpoint", "step", "b_g_ratio", "sum_b_over_g"])
    f.chart, f.data = alt.hconcat(a, b), df
    return f


def fig_heatmap(d: Data) -> Figure:
    f = Figure("fig10_inter_sim_heatmap", "Inter-Sim per layer and training step",
               "Inter-Sim of every layer (rows) at every checkpoint (columns), one panel per model.")
    df = d.training("inter_sim", order="model, step, layer")
    if df.is_empty():
        f.missing = training_missing("inter_sim")
        return f
    rect = alt.Chart(df).mark_rect().encode(
        x=alt.X("step:O", title="Training step"),
        y=alt.Y("layer:O", title="Layer index (0 = embedding)", sort="descending"),
        color=alt.Color("inter_sim:Q", title="Inter-Sim", scale=alt.Scale(scheme="viridis")),
        tooltip=tooltips("model", "checkpoint", "step", "layer", "n", "inter_sim"),
    )
    chart = alt.layer(rect, twin_overlay(rect, "rect")) if has_twins(df) else rect
    f.chart = chart.properties(width=WIDTH * 0.8, height=HEIGHT * 0.8).facet(
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
        x=alt.X("layer:Q", title="Layer index (0 = embedding)", axis=x_axis("layer", df)),
        y=alt.Y("inter_sim:Q", title="Inter-Sim (mean cosine)", scale=alt.Scale(zero=False)),
        color=color_by("source", "Source"),
        tooltip=tooltips("model", "checkpoint", "source", "layer", "n", "inter_sim"),
    ).properties(width=WIDTH * 0.8, height=HEIGHT * 0.8).facet(column=alt.Column("model:N", title="Model"))
    f.data = df
    return f


def fig_tokens(d: Data) -> Figure:
    f = Figure("table1_contextualised_tokens", "Most and least contextualised tokens",
               f"Tokens of each model's last layer (final checkpoint) with the lowest Intra-Sim (most "
               f"contextualised) and the highest (least), among tokens seen at least {TOKENS_MIN_N} times.")
    # Each model's final checkpoint and last layer from the per-layer totals first, then only that
    # slice of the per-token view (a sweep holds every layer × token type × checkpoint: reading it
    # whole would cost time and memory in proportion).
    ends = last_layer(d.final("layer_totals", "source = 'all'")).select("model", "checkpoint", "layer").sort("model")
    parts = [d.q(f"SELECT * FROM intra_sim WHERE model = {sql_literal(r['model'])} AND checkpoint = {sql_literal(r['checkpoint'])} "
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
