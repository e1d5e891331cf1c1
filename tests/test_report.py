"""The report: chart data equals the views, partial warehouses explain themselves, and a real
browser renders every chart from disk with the network cut off."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import polars as pl
import pytest

from conftest import run_cli
from warehouse import report as rep
from warehouse.report import page as rep_page
from warehouse.query import connect

# figure id → (view, key columns, value columns, restriction)
CHART_VIEWS = {
    "fig1_inter_sim_by_layer": ("inter_sim", ["model", "checkpoint", "layer"], ["n", "inter_sim"]),
    "fig2_avg_intra_sim_by_layer": ("avg_intra_sim", ["model", "checkpoint", "layer"], ["tokens", "avg_intra_sim"]),
    "fig3_inter_sim_training": ("inter_sim", ["model", "checkpoint", "layer"], ["n", "inter_sim"]),
    "fig4_avg_intra_sim_training": ("avg_intra_sim", ["model", "checkpoint", "layer"], ["avg_intra_sim"]),
    "fig5_isotropy_unembedding": ("isotropy", ["model", "checkpoint", "matrix", "centered"], ["i_w", "i_w_eigh_signs"]),
    "fig6_isotropy_embedding": ("isotropy", ["model", "checkpoint", "matrix", "centered"], ["i_w", "i_w_eigh_signs"]),
    "fig7_isotropy_training": ("isotropy", ["model", "checkpoint", "matrix", "centered"], ["i_w"]),
    "fig8_final_layernorm": ("layernorm", ["model", "checkpoint", "module"], ["avgnorm_g", "avgnorm_b", "b_g_ratio"]),
    "fig9_final_layernorm_training": ("layernorm", ["model", "checkpoint", "module"], ["avgnorm_g", "avgnorm_b", "b_g_ratio"]),
    "fig10_inter_sim_heatmap": ("inter_sim", ["model", "checkpoint", "layer"], ["inter_sim"]),
    "fig11_inter_sim_by_source": ("inter_sim_by_source", ["model", "checkpoint", "source", "layer"], ["inter_sim"]),
    "table1_contextualised_tokens": ("intra_sim", ["model", "checkpoint", "layer", "token_id"], ["n", "intra_sim", "token"]),
    "fig12_anisotropy_by_layer": ("anisotropy", ["model", "checkpoint", "source", "layer"], ["anisotropy"]),
    "fig13_anisotropy_training": ("anisotropy", ["model", "checkpoint", "source", "layer"], ["anisotropy"]),
    "fig14_intrinsic_dim_by_layer": ("intrinsic_dim", ["model", "checkpoint", "source", "layer"], []),
    "fig15_intrinsic_dim_training": ("intrinsic_dim", ["model", "checkpoint", "source", "layer"], ["twonn", "twonn_skdim"]),
    "fig16_linearity_by_layer": ("linearity", ["model", "checkpoint", "source", "layer"], []),
    "fig17_dim_contrib_top": ("dim_contrib", ["model", "checkpoint", "source", "layer", "dim"], ["contrib"]),
    "fig18_drift_by_layer": ("drift", ["model", "checkpoint", "source", "layer"], ["mean_norm", "mean_cos_to_mean"]),
    "fig19_drift_training": ("drift", ["model", "checkpoint", "source", "layer"], ["mean_cos_to_mean"]),
    "fig20_inter_sim_by_frequency": ("inter_sim_by_frequency", ["model", "checkpoint", "layer", "bucket"],
                                     ["types", "n", "inter_sim"]),
    "fig21_cka_procrustes_by_layer": ("linearity", ["model", "checkpoint", "source", "layer"], []),
    "fig22_alpha_req_by_layer": ("alpha_req", ["model", "checkpoint", "source", "layer"], ["n", "alpha_req"]),
    "fig23_alpha_req_training": ("alpha_req", ["model", "checkpoint", "source", "layer"], ["alpha_req"]),
    "fig24_outlier_kurtosis_by_layer": ("outlier_kurtosis", ["model", "checkpoint", "source", "layer"], ["kurtosis"]),
    "fig25_outlier_kurtosis_training": ("outlier_kurtosis", ["model", "checkpoint", "source", "layer"], ["kurtosis"]),
    "fig26_massive_activations_by_layer": ("massive_activations", ["model", "checkpoint", "source", "layer", "rank"],
                                           ["dim", "abs_value", "token_id", "ratio_to_mean_abs"]),
    "fig27_massive_activations_training": ("massive_activations", ["model", "checkpoint", "source", "layer", "rank"],
                                           ["dim", "ratio_to_mean_abs"]),
    "fig28_weight_spectrum": ("weight_spectrum", ["model", "checkpoint", "matrix", "centered", "k"], ["singular_value"]),
    "fig29_weight_spectrum_training": ("weight_spectrum", ["model", "checkpoint", "matrix", "centered", "k"],
                                       ["singular_value"]),
    "fig30_sequence_effective_rank_by_layer": ("sequence_spectrum", ["model", "checkpoint", "source", "layer", "pooling"],
                                               ["windows", "effective_rank"]),
    "fig31_sequence_effective_rank_training": ("sequence_spectrum", ["model", "checkpoint", "source", "layer", "pooling"],
                                               ["effective_rank"]),
    "fig32_dataset_entropy_by_layer": ("dataset_entropy", ["model", "checkpoint", "source", "layer"], ["dataset_entropy"]),
    "fig33_dataset_entropy_training": ("dataset_entropy", ["model", "checkpoint", "source", "layer"], ["dataset_entropy"]),
    "fig34_curvature_by_layer": ("curvature", ["model", "checkpoint", "source", "layer"], ["windows", "curvature"]),
    "fig35_curvature_training": ("curvature", ["model", "checkpoint", "source", "layer"], ["curvature"]),
    "fig36_prompt_entropy_by_layer": ("prompt_entropy", ["model", "checkpoint", "source", "layer"], ["prompt_entropy"]),
    "fig37_prompt_entropy_training": ("prompt_entropy", ["model", "checkpoint", "source", "layer"], ["prompt_entropy"]),
    "fig44_qk_drift_by_layer": ("qk_geometry", ["model", "checkpoint", "layer", "head"], []),
    "fig45_qk_drift_training": ("qk_geometry", ["model", "checkpoint", "layer", "head"], ["q_drift_share"]),
    "fig46_attention_sink_by_layer": ("attention_sink", ["model", "checkpoint", "layer", "head"],
                                      ["n", "sink_attention"]),
    "fig47_sink_rate_training": ("attention_sink_rate", ["model", "checkpoint"], ["heads", "sink_rate"]),
    "fig41_block_influence_by_layer": ("layer_change", ["model", "checkpoint", "source", "layer"], []),
    "fig42_block_influence_training": ("layer_change", ["model", "checkpoint", "source", "layer"],
                                       ["n", "block_influence", "angular_distance"]),
    "fig43_random_word_sim_by_layer": ("random_word_sim", ["model", "checkpoint", "source", "layer"],
                                       ["windows", "random_word_sim"]),
}


@pytest.fixture(scope="session")
def trained(workdir, sources):
    """Two micro models (tied, untied) trained for a few steps, extracted over two sources."""
    wh = workdir / "trained-wh"
    for tied in ("--tied", "--untied"):
        out = workdir / "micro" / f"micro{tied[1:]}"
        code, _, err = run_cli("train", "--source", f"alpha={sources['alpha']}", "--out", out, tied, "--width", 32,
                               "--depth", 2, "--context", 32, "--vocab", 300, "--steps", 8, "--save-every", 4,
                               "--batch-size", 4)
        assert code == 0, err
        code, _, err = run_cli("extract", "--model", out, "--checkpoints", "all", "--source",
                               f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}", "--warehouse", wh,
                               "--moments", "--cross-moments", "--sample", 200, "--prompt-entropy",  # implies --sequences
                               "--attention-sinks")
        assert code == 0, err
    return wh


@pytest.fixture(scope="session")
def full_report(trained, workdir):
    out = workdir / "report"
    code, _, err = run_cli("report", "--warehouse", trained, "--out", out)
    assert code == 0, err
    return out


def test_every_figure_is_drawn_with_png_svg_and_csv(full_report):
    for fig in CHART_VIEWS:
        assert (full_report / f"{fig}.csv").stat().st_size > 0, fig
        if not fig.startswith("table"):
            assert (full_report / f"{fig}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert "<svg" in (full_report / f"{fig}.svg").read_text()[:500]
    page = (full_report / "index.html").read_text()
    assert "Not drawn" not in page
    assert "micro-tied" in page and "alpha" in page and "beta" in page and "step8" in page


@pytest.mark.parametrize("fig", sorted(CHART_VIEWS))
def test_chart_data_equals_the_view(full_report, trained, fig):
    view, keys, values = CHART_VIEWS[fig]
    chart = pl.read_csv(full_report / f"{fig}.csv", infer_schema_length=None)
    truth = connect(trained).sql(f"SELECT * FROM {view}").pl()
    assert chart.height > 0
    if "measure" in chart.columns:  # two measures in one column (solid and dashed lines)
        value, wide = chart.columns[-1], None
        values = sorted(chart["measure"].unique().to_list())
        for m in values:
            part = chart.filter(pl.col("measure") == m).select(keys + [pl.col(value).alias(m)])
            wide = part if wide is None else wide.join(part, on=keys)
        chart = wide
    joined = chart.select(keys + values).join(truth.select(keys + values), on=keys, how="left", suffix="_view")
    for v in values:
        a, b = joined[v], joined[f"{v}_view"]
        assert b.null_count() == 0, (fig, "rows missing from the view")
        if a.dtype.is_float():
            assert ((a - b).abs() <= 1e-12 * b.abs().clip(lower_bound=1e-300)).all(), (fig, v)
        else:
            assert (a.cast(pl.String) == b.cast(pl.String)).all(), (fig, v)


def test_training_figures_use_every_step_and_the_last_layer(full_report, trained):
    df = pl.read_csv(full_report / "fig3_inter_sim_training.csv")
    assert sorted(df.filter(pl.col("model") == "micro-tied")["step"].to_list()) == [0, 4, 8]
    lin = pl.read_csv(full_report / "fig16_linearity_by_layer.csv")
    assert set(lin["measure"].to_list()) == {"linearity", "linearity_centered"}
    assert set(df["layer"].to_list()) == {3}  # 2 blocks + final norm
    f1 = pl.read_csv(full_report / "fig1_inter_sim_by_layer.csv")
    assert set(f1["checkpoint"].to_list()) == {"step8"}  # the final checkpoint
    assert f1["relative_depth"].min() == 0 and f1["relative_depth"].max() == 1


def test_empty_warehouse_explains_itself(workdir):
    wh, out = workdir / "empty-wh", workdir / "empty-report"
    wh.mkdir()
    code, _, err = run_cli("report", "--warehouse", wh, "--out", out)
    assert code == 0, err
    page = (out / "index.html").read_text()
    assert page.count("class='missing'") == len(rep.FIGURES)
    assert "no token data in the warehouse" in page and f"0 of {len(rep.FIGURES)} figures drawn" in err


def test_partial_warehouse_draws_what_it_can(workdir, model_factory):
    wh, out = workdir / "partial-wh", workdir / "partial-report"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--params-only", "--warehouse", wh)
    assert code == 0, err
    code, _, err = run_cli("report", "--warehouse", wh, "--out", out)
    assert code == 0, err
    drawn = sorted(p.stem for p in out.glob("*.png"))
    assert drawn == ["fig28_weight_spectrum", "fig5_isotropy_unembedding", "fig6_isotropy_embedding",
                     "fig8_final_layernorm"]
    assert "not drawn: Figure 1. Inter-Sim per layer: no token data" in err


def test_model_and_checkpoint_filters(monkeypatch, trained, workdir):
    """The two figures the filters are checked on (drawn and explained), through the command line."""
    from warehouse.report.paper_figures import fig_inter_sim_layers, fig_inter_sim_training

    monkeypatch.setattr(rep_page, "FIGURES", [fig_inter_sim_layers, fig_inter_sim_training])
    out = workdir / "filtered-report"
    code, _, err = run_cli("report", "--warehouse", trained, "--out", out, "--model", "micro-untied", "--checkpoint", "step4")
    assert code == 0, err
    f1 = pl.read_csv(out / "fig1_inter_sim_by_layer.csv")
    assert set(zip(f1["model"], f1["checkpoint"])) == {("micro-untied", "step4")}
    assert "Figure 3" in (out / "index.html").read_text()  # explained as not drawn: one checkpoint


def test_token_text_is_shown_as_text(monkeypatch, trained, workdir):
    evil = "<script>window.__pwned = 1</script><img src=x onerror=alert(1)>"
    real = rep.Data.q
    reads: list[str] = []

    def q(self, sql):  # every read of the per-token view gets hostile token text
        reads.append(sql)
        df = real(self, sql)
        return df.with_columns(pl.lit(evil).alias("token")) if "FROM intra_sim" in sql and "token" in df.columns else df

    monkeypatch.setattr(rep.Data, "q", q)
    d, shown = rep.Data(trained, None, None), []  # the figures that read the per-token view: the ones drawn
    for make in rep.FIGURES:
        before = len(reads)
        make(d)
        if any("FROM intra_sim" in sql for sql in reads[before:]):
            shown.append(make)
    d.con.close()
    assert shown
    monkeypatch.setattr(rep_page, "FIGURES", shown)
    out = workdir / "evil-report"
    rep.build_report(trained, out, png=False)
    page = (out / "index.html").read_text()
    assert evil not in page and "window.__pwned" in page  # present, escaped
    assert "&lt;script&gt;window.__pwned" in page
    assert "</script>" not in rep_page._script_json({"t": evil})


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_a_real_browser_renders_every_chart_offline(full_report, tmp_path):
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (.ci/run installs Debian's chromium)")
        pytest.skip("chromium not installed")
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",  # any fetch would fail
              f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=30000"]
    url = (full_report / "index.html").as_uri()
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    status = json.loads(re.search(r'<pre id="render-status"[^>]*>(.*?)</pre>', dom, re.S).group(1))
    charts = sum(1 for f in CHART_VIEWS if not f.startswith("table"))
    assert status == {"charts": charts, "rendered": charts, "errors": []}
    assert dom.count("<svg") >= charts
    shot = tmp_path / "shot.png"
    subprocess.run(common + ["--window-size=1200,2000", f"--screenshot={shot}", url], capture_output=True, timeout=120)
    from PIL import Image

    img = Image.open(shot).convert("RGB")
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50  # lines, bars, text: not a blank page
    # the Okabe-Ito blue of the first series is on screen
    assert any(abs(r - 0) < 20 and abs(g - 114) < 20 and abs(b - 178) < 20 for _, (r, g, b) in colours)


def test_charts_drawn_once_equal_what_altair_saves(tmp_path):
    """A chart's SVG and PNG, from one validated spec and one Vega layout (the PNG rasterised from the
    SVG), are the bytes `chart.save` writes for each."""
    import altair as alt

    data = pl.DataFrame({"layer": list(range(6)) * 2, "inter_sim": [0.1 * i for i in range(12)],
                         "model": ["tied"] * 6 + ["untied é"] * 6})
    chart = rep_page._configure(alt.Chart(data).mark_line(point=True).encode(x="layer:O", y="inter_sim:Q",
                                                                         color="model:N"))
    fig = rep.Figure("f", "t", "c", chart=chart, data=data)
    rep_page._draw(fig, tmp_path, png=True)
    chart.save(str(tmp_path / "alt.svg"))
    chart.save(str(tmp_path / "alt.png"), scale_factor=2)
    assert (tmp_path / "f.svg").read_text(encoding="utf-8") == (tmp_path / "alt.svg").read_text(encoding="utf-8")
    assert (tmp_path / "f.png").read_bytes() == (tmp_path / "alt.png").read_bytes()
    assert fig.spec == chart.to_dict()


def test_the_vega_bundle_is_cached_per_version_and_an_unwritable_cache_is_only_slower(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    rep_page._js_bundle.cache_clear()
    try:
        bundle = rep_page._js_bundle()
        [kept] = (tmp_path / "cache" / "isotropy-warehouse").iterdir()
        assert kept.name.startswith("vega-bundle-") and kept.read_text(encoding="utf-8") == bundle
        assert "vegaEmbed" in bundle
        kept.write_text("/* from the cache */", encoding="utf-8")
        rep_page._js_bundle.cache_clear()
        assert rep_page._js_bundle() == "/* from the cache */"  # read, not rebuilt
        (tmp_path / "file").write_text("")
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a cache under a file: cannot be made
        rep_page._js_bundle.cache_clear()
        assert rep_page._js_bundle() == bundle
    finally:
        rep_page._js_bundle.cache_clear()
