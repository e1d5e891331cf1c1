"""The chart helpers every figure uses (one palette, sizes, axes, lines) and the figure templates
of a view's value by layer (final checkpoint) and of its last layer across training.
"""

from __future__ import annotations

import altair as alt
import polars as pl

from .data import Data, Figure

# Okabe & Ito's colour-blind-safe palette (black last).
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"]
WIDTH, HEIGHT = 380, 250
# Axis titles in ASCII: the chart fonts lack '‖' and '√'.
AVGNORM_TITLE = "avgnorm = ||v|| / sqrt(d)"
RATIO_TITLE = "||b|| / ||g||"


def color_by(field_: str = "model", title: str = "Model"):
    """Colour by a nominal column, in the palette."""
    return alt.Color(f"{field_}:N", title=title, scale=alt.Scale(range=PALETTE))


def tooltips(*fields: str) -> list:
    """The columns a chart's tooltip shows."""
    return [alt.Tooltip(f) for f in fields]


def x_axis(x: str, df: pl.DataFrame | None = None) -> alt.Axis:
    """The x axis of a layer, bucket or step column (integer ticks) or any other."""
    if x in ("layer", "bucket"):  # integer ticks only: one per value when they are few
        values = sorted(df[x].unique().to_list()) if df is not None and x in df.columns else None
        if values and len(values) <= 30:
            return alt.Axis(values=values, format="d")
        return alt.Axis(tickMinStep=1, format="d")
    if x == "step":
        return alt.Axis(tickCount=6, labelOverlap="greedy")
    return alt.Axis()


def line_chart(df: pl.DataFrame, x: str, x_title: str, y: str, y_title: str, tooltip: list[str],
               color: str = "model", color_title: str = "Model", dash: str | None = None,
               dash_title: str | None = None, dash_order: list[str] | None = None):
    """Lines with points of `y` against `x`, one colour per model (or `color`), solid and dashed by `dash`."""
    enc = dict(
        x=alt.X(f"{x}:Q", title=x_title, axis=x_axis(x, df)),
        y=alt.Y(f"{y}:Q", title=y_title, scale=alt.Scale(zero=False)),
        color=color_by(color, color_title),
        tooltip=tooltips(*tooltip),
    )
    if dash:  # the first value of dash_order is drawn solid, the second dashed
        enc["strokeDash"] = alt.StrokeDash(f"{dash}:N", title=dash_title,
                                           scale=alt.Scale(domain=dash_order, range=[[1, 0], [6, 3]]),
                                           legend=alt.Legend(symbolType="stroke", symbolStrokeColor="#444", symbolStrokeWidth=2, symbolSize=400, symbolFillColor="transparent"))
    chart = alt.Chart(df).mark_line(point=True).encode(**enc)
    if has_twins(df):
        chart = alt.layer(chart, twin_overlay(chart, "point"))
    return chart.properties(width=WIDTH, height=HEIGHT)


# ---------------------------------------------------------------- twin checkpoints, marked on every training figure

TWIN_COLOR = "#D55E00"


def has_twins(df: pl.DataFrame | None) -> bool:
    """Whether rows of `df` (a figure's data) belong to checkpoints whose weights another checkpoint
    has (Data.with_twins: a non-null `twin_of`)."""
    return df is not None and "twin_of" in df.columns and df["twin_of"].null_count() < df.height


def twin_overlay(base: alt.Chart, mark: str) -> alt.Chart:
    """A layer over `base` (same data and encodings) that marks the rows of twin checkpoints: a hollow
    diamond on a point ('point'), an outlined cell ('rect'), a dashed line ('line')."""
    style = {"point": lambda c: c.mark_point(shape="diamond", size=220, filled=False, strokeWidth=2),
             "rect": lambda c: c.mark_rect(fill=None, stroke=TWIN_COLOR, strokeWidth=2),
             "line": lambda c: c.mark_line(strokeWidth=2)}[mark]
    return style(base).encode(color=alt.value(TWIN_COLOR), strokeDash=alt.value([4, 3] if mark == "line" else [1, 0]),
                              tooltip=tooltips("model", "checkpoint", "step", "twin_of")
                              ).transform_filter("isValid(datum.twin_of)")


def note_twins(fig: Figure) -> None:
    """A drawn figure that holds twin checkpoints: its caption says which (every figure, at drawing)."""
    if fig.missing is None and has_twins(fig.data):
        fig.caption = f"{fig.caption} {twin_note(fig.data)}"


def twin_note(df: pl.DataFrame) -> str:
    """The sentence a caption gets when the figure holds twin checkpoints."""
    pairs = df.filter(pl.col("twin_of").is_not_null()).select("model", "checkpoint", "twin_of").unique().sort(
        "model", "checkpoint")
    named = [f"{r['model']}@{r['checkpoint']} = {r['twin_of']}" for r in pairs.iter_rows(named=True)]
    shown = ", ".join(named[:6]) + (f" and {len(named) - 6} more" if len(named) > 6 else "")
    return (f"Marked in vermillion (diamond, outlined cell or dashed line): checkpoints whose weights equal another "
            f"checkpoint's, every tensor identical (the checkpoint_twins view): {shown}.")


def last_layer(df: pl.DataFrame) -> pl.DataFrame:
    """Rows of each (model, checkpoint)'s last layer (the final norm where there is one)."""
    return df.filter(pl.col("layer") == pl.col("layer").max().over(["model", "checkpoint"]))


def centered_label(df: pl.DataFrame) -> pl.DataFrame:
    """A `variant` column naming the raw matrix W and the mean-centred Ŵ."""
    return df.with_columns(
        pl.when(pl.col("centered")).then(pl.lit("Ŵ (mean-centred)")).otherwise(pl.lit("W (raw)")).alias("variant")
    )


def training_missing(name: str) -> str:
    """Why a figure across training was not drawn."""
    return f"needs a model with at least two checkpoints that have a step (stepN) in {name}"


def peer_by_layer(d: Data, fid: str, title: str, caption: str, view: str, value: str, y_title: str,
                  tips: list[str], dash_values: list[str] | None = None) -> Figure:
    """A view's value by layer at each model's final checkpoint, all sources (two measures of one
    quantity solid and dashed when `dash_values` names them)."""
    f = Figure(fid, title, caption)
    df = d.final(view, "source = 'all'", order="model, layer")
    if df.is_empty():
        f.missing = f"no data for {view}" + (f" (extract with {PEER_FLAGS[view]})" if view in PEER_FLAGS else "")
        return f
    if dash_values:  # two measures of one quantity, solid and dashed, in one column `value`
        df = df.unpivot(index=["model", "checkpoint", "step", "source", "layer"], on=dash_values,
                        variable_name="measure", value_name=value)
        f.chart = line_chart(df, "layer", "Layer index (0 = embedding)", value, y_title,
                             ["model", "checkpoint", "layer", "measure", value], dash="measure", dash_title="Measure",
                             dash_order=dash_values)
    else:
        f.chart = line_chart(df, "layer", "Layer index (0 = embedding)", value, y_title, tips)
    f.data = df
    return f


def training_line(d: Data, fid: str, title: str, caption: str, view: str, value: str, y_title: str,
                  tips: list[str], extra: str = "") -> Figure:
    """A value of each model's last layer against the training step."""
    f = Figure(fid, title, caption)
    df = d.training(view, extra, order="model, step, layer")
    if df.is_empty():
        f.missing = training_missing(view) + (f" (extract with {PEER_FLAGS[view]})" if view in PEER_FLAGS else "")
        return f
    df = last_layer(df)
    f.chart = line_chart(df, "step", "Training step", value, y_title, tips)
    f.data = df
    return f


PEER_FLAGS = {"anisotropy": "--moments", "linearity": "--cross-moments", "intrinsic_dim": "--sample K",
              "alpha_req": "--moments", "outlier_kurtosis": "--moments", "dataset_entropy": "--sequences",
              "curvature": "--sequences", "prompt_entropy": "--prompt-entropy"}


def pooled_by_layer(d: Data, fid: str, title: str, caption: str, value: str, y_title: str) -> Figure:
    """sequence_spectrum's `value` by layer, mean pooling solid and last-vector pooling dashed."""
    f = Figure(fid, title, caption)
    df = d.final("sequence_spectrum", "source = 'all'", order="model, layer, pooling")
    if df.is_empty():
        f.missing = "no data for sequence_spectrum (extract with --sequences)"
        return f
    f.chart = line_chart(df, "layer", "Layer index (0 = embedding)", value, y_title,
                         ["model", "checkpoint", "layer", "pooling", "windows", value], dash="pooling",
                         dash_title="Pooling", dash_order=["mean", "last"])
    f.data = df
    return f
