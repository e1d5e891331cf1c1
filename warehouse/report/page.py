"""The report's output: each drawn figure's SVG, PNG and CSV, and `index.html` with every chart (Vega,
Vega-Lite and vega-embed inlined: no network needed), built by `build_report`.
"""

from __future__ import annotations

import datetime as _dt
import functools
import html
import json
from pathlib import Path

import altair as alt

from common.progress import progress

from .. import store
from ..storage import open_storage, reading_once
from .charts import note_twins
from .data import Data, Figure, Report
from .registry import FIGURES


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
    is slow, so the bundle is kept in the user's cache directory per vl-convert and Vega-Lite
    version; a cache that cannot be read or written is only slower."""
    import vl_convert as vlc

    version = f"{getattr(vlc, '__version__', 'unknown')}-{_vl_version()}"
    cache = store.cache_dir()
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


@reading_once
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
        note_twins(fig)  # a figure across training that holds twin checkpoints: its caption says which
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
