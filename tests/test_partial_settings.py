"""Settings in the identity of a partial: two shards of one source made with settings that change the
numbers (--max-length, --dtype, …) are never folded together — refused in one line naming the setting
and both values, nothing written — and the views equal a clean run; another source name keeps them
apart, --replace drops the old shard; entries of older warehouses without a recorded value are
compared where they recorded it and otherwise not at all."""

from __future__ import annotations

import pytest

from conftest import run_cli, same_numbers, same_rows, views
from test_identity import one_line_error, tree

ARGS = ["--batch-size", "4"]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("gpt_neox", tied=False)  # context 64


def extract(model, wh, *extra, source):
    return run_cli("extract", "--model", model, "--source", source, *ARGS, "--warehouse", wh, *extra)


@pytest.fixture(scope="module")
def clean(model, sources, tmp_path_factory):
    """Clean runs of alpha in halves: --max-length 16, and --dtype bfloat16 --max-length 32."""
    d, src = tmp_path_factory.mktemp("clean-settings"), f"alpha={sources['alpha']}"
    for name, extra in (("short", ["--max-length", "16"]), ("bf16", ["--dtype", "bfloat16", "--max-length", "32"])):
        for shard in ("1/2", "2/2"):
            code, _, err = extract(model, d / name, "--shard", shard, *extra, source=src)
            assert code == 0, err
    return {k: views(d / k) for k in ("short", "bf16")}


@pytest.mark.parametrize("case", ["max_length", "dtype"])
def test_shards_with_different_settings_are_refused_naming_the_setting(case, model, sources, clean, tmp_path):
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    first, other, want = {
        "max_length": (["--max-length", "16"], [], "max_length = 16; this run has max_length = 64"),
        "dtype": (["--dtype", "bfloat16", "--max-length", "32"], ["--max-length", "32"],
                  "dtype = bfloat16; this run has dtype = float32"),
    }[case]
    assert extract(model, wh, "--shard", "1/2", *first, source=src)[0] == 0
    before = tree(wh)
    line = one_line_error(*extract(model, wh, "--shard", "2/2", *other, source=src)[::2])
    assert f"source alpha of {model.name}@main holds shard 1/2 made with {want}" in line, line
    assert "never merged" in line and "--source OTHER=" in line and "--name" in line and "--replace" in line
    assert tree(wh) == before  # refused before any forward pass: nothing written
    assert extract(model, wh, "--shard", "2/2", *first, source=src)[0] == 0  # the same settings: folded
    same_numbers(views(wh), clean["short" if case == "max_length" else "bf16"])
    assert run_cli("validate", "--warehouse", wh)[0] == 0


def test_the_default_window_equals_the_same_window_given(model, sources, tmp_path):
    """The window as run is compared: --max-length 64 and the default (the context, 64) are one setting."""
    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    assert extract(model, wh, "--shard", "1/2", "--max-length", "64", source=src)[0] == 0
    code, _, err = extract(model, wh, "--shard", "2/2", source=src)
    assert code == 0, err


def test_another_source_name_keeps_them_apart_and_replace_drops_the_old_shard(model, sources, clean, tmp_path):
    wh = tmp_path / "wh"
    assert extract(model, wh, "--shard", "1/2", "--max-length", "32", source=f"alpha={sources['alpha']}")[0] == 0
    assert extract(model, wh, "--shard", "2/2", "--max-length", "16", source=f"alpha16={sources['alpha']}")[0] == 0
    assert extract(model, wh, "--shard", "2/2", "--max-length", "16", "--replace",
                   source=f"alpha={sources['alpha']}")[0] == 0  # 1/2 (max_length 32) dropped
    assert extract(model, wh, "--shard", "1/2", "--max-length", "16", source=f"alpha={sources['alpha']}")[0] == 0
    by_source = views(wh)["inter_sim_by_source"]  # alpha: exactly the clean run; alpha16 apart
    want = clean["short"]["inter_sim_by_source"]
    same_rows([r for r in by_source if r[3] == "alpha"], [r for r in want if r[3] == "alpha"], "by_source", 1e-6)
    assert {r[3] for r in by_source} == {r[3] for r in want} | {"alpha16"}


def test_an_older_partial_without_recorded_identity_is_compared_where_it_can_be(model, sources, tmp_path, monkeypatch):
    """A partial written before identities were recorded (simulated: the entry without `identity`)
    counts with its recorded settings and window: another window is refused, the same is folded."""
    import extract.run.provenance as provenance

    real = provenance.manifest_entry

    def old_writer(*args, **kwargs):
        entry = real(*args, **kwargs)
        entry.pop("identity", None)
        return entry

    wh, src = tmp_path / "wh", f"alpha={sources['alpha']}"
    monkeypatch.setattr(provenance, "manifest_entry", old_writer)
    import extract.run.driver as driver

    monkeypatch.setattr(driver, "manifest_entry", old_writer)
    assert extract(model, wh, "--shard", "1/2", "--max-length", "16", source=src)[0] == 0
    monkeypatch.undo()
    line = one_line_error(*extract(model, wh, "--shard", "2/2", source=src)[::2])
    assert "max_length = 16; this run has max_length = 64" in line
    assert extract(model, wh, "--shard", "2/2", "--max-length", "16", source=src)[0] == 0


def test_the_warehouse_compares_only_what_both_record():
    """identity.settings_clash and check_settings on entries as older and newer writers record them."""
    from common.errors import UserError
    from warehouse.merge import check_settings, settings_clash

    def entry(shard, identity=None, settings=None, window=None):
        e = {"model": "m", "checkpoint": "main", "source": "s", "shard": shard, "settings": settings or {},
             "provenance": {} if window is None else {"max_length": window}}
        if identity is not None:
            e["identity"] = identity
        return e

    new = entry("1-of-2", {"dtype": "float32", "max_length": 64, "moments_precision": "float32"})
    very_old = entry("2-of-2", settings={"dtype": "float32", "max_length": None})  # no window, no precision
    old = entry("2-of-2", settings={"dtype": "float32", "max_length": None}, window=64)
    assert settings_clash(new, very_old) is None  # unknown window and precision: not compared
    assert settings_clash(new, old) is None
    assert settings_clash(new, entry("2-of-2", settings={"dtype": "bfloat16"})) == ("dtype", "float32", "bfloat16")
    assert settings_clash(very_old, entry("3-of-3", settings={"dtype": "bfloat16"})) is None  # neither records a list
    check_settings([new, very_old, old])
    with pytest.raises(UserError, match=r"shard 1/2 made with max_length = 64; another partial has max_length = 16"):
        check_settings([new, old, entry("3-of-3", {"max_length": 16})])
