"""The report: the paper's Figures 1-9 (and more) drawn from the warehouse's views, offline.

`build_report()` queries the views, draws each figure with Altair when the warehouse holds the data
it needs (otherwise it records a one-line note saying why not), and writes under `out/`:
`index.html` (Vega, Vega-Lite and vega-embed inlined: no network needed), and per figure
`<id>.png`, `<id>.svg` and `<id>.csv` (the exact rows the chart draws).

- data.py           Data (the views as Polars frames), Figure, Report
- charts.py         chart helpers and figure templates shared by the figures
- paper_figures.py  the paper's figures
- peer_figures.py   the peers' measures as figures
- attention_figures.py  per-head query/key drift and attention sinks as figures
- change_figures.py block influence (the layer change) and random-word similarity
- registry.py       FIGURES: every figure, in the page's order
- page.py           the files and the HTML page (build_report)
"""

from .data import Data, Figure, Report
from .page import build_report
from .peer_figures import MEASURES
from .registry import FIGURES

__all__ = ["build_report", "Data", "Figure", "Report", "FIGURES", "MEASURES"]
