"""What the report's figures are drawn from and what each one is: `Data` (the views, restricted to
--model / --checkpoint, as Polars frames), a `Figure` (its chart and rows, or why it was not
drawn) and the `Report` they make.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import altair as alt
import duckdb
import polars as pl

from common.errors import UserError

from ..query import connect, duckdb_error_line, sql_literal


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


class Data:
    """The views, restricted to --model / --checkpoint, as Polars frames."""

    def __init__(self, warehouse, models: list[str] | None, checkpoints: list[str] | None):
        self.con = connect(warehouse)
        self.models, self.checkpoints = models or [], checkpoints or []
        self.twins: pl.DataFrame | None = None  # the checkpoint_twins view, read once

    def where(self, extra: str = "") -> str:
        conds = []
        if self.models:
            conds.append("model IN (" + ", ".join(sql_literal(m) for m in self.models) + ")")
        if self.checkpoints:
            conds.append("checkpoint IN (" + ", ".join(sql_literal(c) for c in self.checkpoints) + ")")
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
        """Rows of models that have at least two checkpoints with a step, with `twin_of` (with_twins):
        every figure across training marks the checkpoints whose weights another one has."""
        return self.with_twins(self.q(
            f"WITH v AS (SELECT * FROM {name}{self.where(extra)}), "
            "m AS (SELECT model FROM v WHERE step IS NOT NULL GROUP BY model HAVING count(DISTINCT step) >= 2) "
            "SELECT v.* FROM v JOIN m USING (model) WHERE v.step IS NOT NULL" + (f" ORDER BY {order}" if order else "")
        ))

    def with_twins(self, df: pl.DataFrame) -> pl.DataFrame:
        """`df` with a column `twin_of`: for a row of a checkpoint whose weights equal another
        checkpoint's (the checkpoint_twins view), that checkpoint; null otherwise."""
        if self.twins is None:
            self.twins = self.q("SELECT model, checkpoint, twin_of FROM checkpoint_twins")
        if "twin_of" in df.columns or not {"model", "checkpoint"} <= set(df.columns):
            return df
        return df.join(self.twins, on=["model", "checkpoint"], how="left", maintain_order="left")
