"""Figures of how much each layer changes the residual stream — block influence and angular distance
by layer and, for the last and the middle block, across training — and of Ethayarajh's random-word
similarity by layer beside Inter-Sim.
"""

from __future__ import annotations

import altair as alt
import polars as pl

from .charts import HEIGHT, WIDTH, color_by, line_chart, peer_by_layer, tooltips, training_missing, x_axis
from .data import Data, Figure

LAYER_TITLE = "Layer pair l -> l + 1 (0 = embedding)"


def fig_block_influence_layers(d: Data) -> Figure:
    f = peer_by_layer(
        d, "fig41_block_influence_by_layer", "Block influence per layer (Men et al.; Gromov et al.)",
        "How far each layer turns the token vectors it is given: row l compares hidden states l and l + 1 of the "
        "same tokens (so row l is block l + 1; where the model has a final norm, the last row is that norm). "
        "Block influence 1 − mean cos(h_l, h_{l+1}) (solid; ShortGPT's measure for choosing blocks to remove) and "
        "angular distance mean arccos(cos)/π (dashed); final checkpoint, all sources.",
        "layer_change", "value", "Change from layer l to l + 1", [], ["block_influence", "angular_distance"])
    if f.chart is not None:
        f.chart = f.chart.encode(x=alt.X("layer:Q", title=LAYER_TITLE, axis=x_axis("layer", f.data)))
    return f


def _blocks(d: Data) -> pl.DataFrame:
    """Per (model, checkpoint): the layer_change rows of its last block and its middle block (row
    l = block l + 1), named in `block`."""
    return d.q("SELECT model, checkpoint, count(*) FILTER (WHERE layer_kind = 'block') AS blocks "
               "FROM layer_norms WHERE source = 'all' GROUP BY ALL").with_columns(
        (pl.col("blocks") - 1).alias("last"), (pl.max_horizontal(pl.col("blocks") // 2, 1) - 1).alias("middle"))


def fig_block_influence_training(d: Data) -> Figure:
    f = Figure("fig42_block_influence_training", "Block influence of the last and the middle block during training",
               "1 − mean cos(input, output) of each model's last block (solid) and middle block (dashed, block "
               "⌊blocks/2⌋) at each checkpoint; all sources.")
    df = d.training("layer_change", "source = 'all'", order="model, step, layer")
    if df.is_empty():
        f.missing = training_missing("layer_change")
        return f
    rows = df.join(_blocks(d), on=["model", "checkpoint"])
    df = pl.concat([rows.filter(pl.col("layer") == pl.col(which)).with_columns(pl.lit(f"{which} block").alias("block"))
                    for which in ("last", "middle")]).drop("blocks", "last", "middle").sort("model", "block", "step")
    f.chart = line_chart(df, "step", "Training step", "block_influence", "Block influence (1 - mean cosine)",
                         ["model", "checkpoint", "step", "layer", "block", "n", "block_influence", "angular_distance"],
                         dash="block", dash_title="Block", dash_order=["last block", "middle block"])
    f.data = df
    return f


def fig_random_word_sim_layers(d: Data) -> Figure:
    f = Figure("fig43_random_word_sim_by_layer", "Random-word similarity per layer (Ethayarajh) beside Inter-Sim",
               "Ethayarajh's baseline: the mean cosine between a token vector of one window and one of another, "
               "each window weighing one (solid); Inter-Sim, each token weighing one (dashed). A window is a "
               "sentence with --unit sentence, as in the paper. Final checkpoint, all sources.")
    df = d.final("random_word_sim", "source = 'all'", order="model, layer")
    if df.is_empty():
        f.missing = "no data for random_word_sim (every extract writes it: the warehouse holds no token data)"
        return f
    inter = d.q("SELECT model, checkpoint, layer, inter_sim FROM inter_sim")
    df = df.join(inter, on=["model", "checkpoint", "layer"], how="left")
    measures = ["random_word_sim", "inter_sim"]
    f.chart = alt.Chart(df).transform_fold(measures, as_=["measure", "similarity"]).mark_line(point=True).encode(
        x=alt.X("layer:Q", title="Layer index (0 = embedding)", axis=x_axis("layer", df)),
        y=alt.Y("similarity:Q", title="Mean cosine", scale=alt.Scale(zero=False)),
        color=color_by(),
        strokeDash=alt.StrokeDash("measure:N", title="Measure", scale=alt.Scale(domain=measures, range=[[1, 0], [6, 3]]),
                                  legend=alt.Legend(symbolType="stroke", symbolStrokeColor="#444", symbolStrokeWidth=2,
                                                    symbolSize=400, symbolFillColor="transparent")),
        tooltip=tooltips("model", "checkpoint", "layer", "windows", "random_word_sim", "inter_sim"),
    ).properties(width=WIDTH, height=HEIGHT)
    f.data = df
    return f
