"""The layer change (`layer_change`: block influence, angular distance) and Ethayarajh's random-word
similarity (`random_word_sim`) against their definitions: the angle's precision where arccos loses
it; every path of the token-sum pass on batches with NaN, zero, uncounted and one-vector windows
against float64 numpy; and the views of real extracts (a decoder with a final norm, an encoder;
`--unit sentence` with a one-token sentence) against the models' own `output_hidden_states`, two
shards equal to one run, sources merged by sum."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import reference as ref
import tiny
from conftest import run_cli
from test_sequences import feed_windows, layer_rows, windows_batch
from extract.accumulate import kernels
from extract.accumulate.sums import TokenSums
from extract.sentences import SentenceSplitter
from warehouse.query import connect


def test_the_angle_keeps_its_digits_where_arccos_loses_them():
    """One token whose vector turns by θ from 0 to π between two layers (float32 rows, the first of norm
    2): the CPU's chunked path, the general eager path and `change_norms` (the compiled step's) give
    θ/π to 1e-13 relative (1e-15 absolute at 0 and π) and cos θ to 1e-15, against atan2 of the float32
    components in float64 — where arccos of the cosine returns 0 at θ = 1e-8 (arccos(1 − ε) ≈ √(2ε))."""
    d = 16
    for t in [0.0, 1e-12, 1e-8, 1e-4, 0.5, math.pi / 2, 3.0, math.pi - 1e-6, math.pi]:
        prev = torch.zeros(1, 1, d)
        prev[..., 0] = 2.0
        cur = torch.zeros(1, 1, d)
        cur[..., 0], cur[..., 1] = math.cos(t), math.sin(t)  # rounded to float32
        want = math.atan2(float(cur[0, 0, 1]), float(cur[0, 0, 0]))  # the angle between the float32 vectors
        got = []
        for general in (False, True):
            acc = TokenSums(2, 10, d, "cpu", fused=False)
            acc.host_sync_free = not general
            acc.set_batch(torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
            acc.add(0, prev)
            acc.add(1, cur)
            assert int(acc.change_n[0]) == 1
            got.append((float(acc.change_angle[0]), float(acc.change_cos[0])))
        x = cur[0].double() / torch.linalg.vector_norm(cur[0].double(), dim=1, keepdim=True)
        one = torch.ones(1, dtype=torch.bool)
        n, cos, angle = kernels.change_sums(*kernels.change_norms(prev[0], torch.tensor([0.5], dtype=torch.float64), x),
                                            one)
        got.append((float(angle), float(cos)))
        for angle, cos in got:
            assert abs(angle * math.pi - want) <= max(1e-13 * want, 1e-15), (t, angle * math.pi, want)
            assert abs(cos - math.cos(want)) <= 1e-15, (t, cos)
    assert math.acos(math.cos(1e-8)) == 0.0  # arccos at θ = 1e-8: every digit lost


def _definition(batches, L: int, d: int) -> dict:
    """Per layer in float64 numpy over the counted finite non-zero vectors (layer l: `layer_rows`):
    the layer change to l + 1 over the rows ok at both (n, Σcos, Σ arccos(cos)/π), and per window
    with ≥ 1 vector the mean unit vector ū (windows, Σū, Σ‖ū‖²)."""
    out = {"change": [[0, 0.0, 0.0] for _ in range(L)], "unit": [[0, np.zeros(d), 0.0] for _ in range(L)]}
    for _, counted, hidden, _ in batches:
        H = [layer_rows(hidden, layer).double().numpy() for layer in range(L)]  # (B, T, d) each
        C = counted.numpy()
        ok = [C & np.isfinite(h).all(-1) & (np.abs(h).sum(-1) > 0) for h in H]  # (B, T) each
        for layer in range(L):
            with np.errstate(invalid="ignore", divide="ignore"):
                U = H[layer] / np.linalg.norm(H[layer], axis=-1, keepdims=True)
            for w in range(H[layer].shape[0]):
                rows = U[w][ok[layer][w]]
                if len(rows):
                    ubar = rows.mean(0)
                    u = out["unit"][layer]
                    u[0] += 1
                    u[1] += ubar
                    u[2] += ubar @ ubar
            if layer + 1 < L:
                both = ok[layer] & ok[layer + 1]
                for k, v in enumerate(ref.layer_change(H[layer][both], H[layer + 1][both])):
                    out["change"][layer][k] += v
    return out


def test_every_token_sum_path_equals_the_float64_definition():
    """The CPU's chunked path (chunks of 5 rows: the change's rows split across chunks), the general
    eager path, per-batch partials folded into another accumulator (--accumulator-device) and a table
    under a budget that spills: the layer change and the windows' mean unit vectors equal the float64
    definition (counts exact, sums to 1e-12; the angle's sum to 1e-9: the definition's arccos loses
    digits near 0), the chunked and general paths bit for bit.  A window with one counted vector
    counts (ū = û); the batch with B = T = 1 and the windows whose vectors are all excluded do not
    break it.  (The compiled step is checked against the eager path in test_gpu_path.py.)"""
    L, V, d = 3, 60, 8
    gen = torch.Generator().manual_seed(21)
    batches = [windows_batch(B, T, V, d, gen) for B, T in ((3, 20), (1, 1), (2, 9), (5, 4), (1, 30))]
    batches[2][1][1] = False  # a window with no counted vector
    accs = {"chunked": TokenSums(L, V, d, "cpu", fused=False), "general": TokenSums(L, V, d, "cpu", fused=False),
            "folded": TokenSums(L, V, d, "cpu", fold_partials=True),
            "spilled": TokenSums(L, V, d, "cpu", fused=False, budget=40 * (L * (8 * d + 8) + 8))}
    accs["chunked"].CHUNK = 5
    accs["general"].host_sync_free = False
    for acc in accs.values():
        feed_windows(acc, batches, L)
    assert accs["spilled"].spill_count > 0
    want = _definition(batches, L, d)
    assert any(int(c.sum()) == 1 for _, c, _, _ in batches)  # a window of one counted vector
    for name, acc in accs.items():
        for layer in range(L):
            n, cos, angle = want["change"][layer]
            assert int(acc.change_n[layer]) == n and (n > 0) == (layer + 1 < L), (name, layer)
            assert abs(float(acc.change_cos[layer]) - cos) <= 1e-12 * max(1, abs(cos)), (name, layer)
            assert abs(float(acc.change_angle[layer]) - angle) <= 1e-9 * max(1, angle), (name, layer)
            w, s, q = want["unit"][layer]
            assert int(acc.unit_windows[layer]) == w
            assert np.allclose(acc.sum_ubar[layer].numpy(), s, rtol=1e-12, atol=1e-12), (name, layer)
            assert abs(float(acc.sum_ubar_sq[layer]) - q) <= 1e-12 * q, (name, layer)
        acc.close()
    for k in ("change_n", "change_cos", "change_angle", "unit_windows", "sum_ubar", "sum_ubar_sq"):
        assert torch.equal(getattr(accs["chunked"], k), getattr(accs["general"], k)), k


# ---------------------------------------------------------------- the views of real extracts


@pytest.fixture(scope="module")
def texts(workdir):
    """Two sources of documents; alpha's third document is one token in both tokenizers ('The')."""
    docs = {"alpha": tiny.corpus(5, seed=31)[:2] + ["The"] + tiny.corpus(3, seed=32),
            "beta": tiny.corpus(4, seed=33)}
    paths = {}
    for name, lines in docs.items():
        paths[name] = workdir / "layer-change" / f"{name}.txt"
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text("\n".join(lines) + "\n")
    return docs, paths


def _reference(model, docs: list[str]) -> dict:
    """layer_change and random_word_sim by their definitions, on the model's own `output_hidden_states`
    of each sentence (a window of --unit sentence), float64: {layer: (n, block influence, angular
    distance)}, {layer: (windows, random-word similarity)}."""
    sentences = [s for doc in docs for s in SentenceSplitter()(doc)]
    win: list[int] = []
    states = ref.hidden_states(str(model), sentences, 64, windows=win)
    win = np.array(win)
    change, rws = {}, {}
    for layer in states:
        U = ref.unit(states[layer][1])
        if layer + 1 in states:
            cos = (U * ref.unit(states[layer + 1][1])).sum(1)  # the same tokens, in the same order
            change[layer] = (len(cos), 1 - cos.mean(), float(np.mean(np.arccos(np.clip(cos, -1, 1)) / np.pi)))
        ubar = np.stack([U[win == w].mean(0) for w in np.unique(win)])  # (W, d): every window has a vector
        G = ubar @ ubar.T  # the mean over pairs of windows w ≠ w' of ⟨ū_w, ū_w'⟩
        W = len(ubar)
        rws[layer] = (W, float((G.sum() - np.trace(G)) / (W * W - W)))
    return change, rws, int((np.bincount(win) == 1).sum())


def trained_like(model_factory, workdir):
    """The tiny GPT-NeoX with a dominant mean, as trained models have: every token embedding plus one
    vector m of norm 3 (~27× a token's own, half of it in one 'massive' dimension), which the residual
    stream carries through every block — so the tokens' cosines are near 1 and a block turns them by
    small angles (where arccos of the cosine loses digits)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = workdir / "models" / "gpt_neox-dominant-mean"
    if not path.exists():
        shutil.copytree(model_factory("gpt_neox", tied=False), path)
        weights = load_file(path / "model.safetensors")
        emb = weights["gpt_neox.embed_in.weight"]  # (V, d)
        m = torch.randn(emb.shape[1], generator=torch.Generator().manual_seed(5))
        m = 3.0 * m / m.norm() * 0.5 ** 0.5
        m[3] += 3.0 * 0.5 ** 0.5  # ‖m‖ ≈ 3, about half of it along dimension 3
        weights["gpt_neox.embed_in.weight"] = emb + m
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _views(wh) -> tuple[dict, dict]:
    con = connect(wh)
    change = {(s, layer): (n, b, a) for s, layer, n, b, a in con.execute(
        "SELECT source, layer, n, block_influence, angular_distance FROM layer_change").fetchall()}
    rws = {(s, layer): (w, v) for s, layer, w, v in con.execute(
        "SELECT source, layer, windows, random_word_sim FROM random_word_sim").fetchall()}
    return change, rws


@pytest.mark.parametrize("family", ["gpt_neox", "bert"])
def test_views_equal_the_definition_on_the_models_own_hidden_states(workdir, model_factory, texts, family):
    """A decoder with a final norm and a dominant mean (GPT-NeoX, `trained_like`: rows 0 … L, the last
    from block L to the norm) and an encoder (BERT: [CLS]/[SEP] fed, not counted), `--unit sentence`:
    per source and for 'all' (the merge of both) the views equal the definition on the model's own
    float64 hidden states to 1e-6 (float32 forwards; with the dominant mean, block influence to 1e-6 of
    itself); every block has a row.  Two shards of the sources (GPT-NeoX; the merge is the same for any
    family) make the same views to 1e-12 (one window per batch: the forwards are the same whatever the
    shard, the sums merge)."""
    docs, paths = texts
    model = trained_like(model_factory, workdir) if family == "gpt_neox" else model_factory(family, tied=False)
    args = ["--model", model, "--source", f"alpha={paths['alpha']}", "--source", f"beta={paths['beta']}",
            "--unit", "sentence", "--max-length", 64, "--batch-size", 1, "--no-moments"]
    whole, halves = workdir / f"layer-change-{family}", workdir / f"layer-change-{family}-halves"
    code, _, err = run_cli("extract", *args, "--warehouse", whole)
    assert code == 0, err
    for shard in ("1/2", "2/2") if family == "gpt_neox" else ():
        code, _, err = run_cli("extract", *args, "--shard", shard, "--warehouse", halves)
        assert code == 0, err
    change, rws = _views(whole)
    n_layers = connect(whole).execute("SELECT max(n_layers) FROM layer_norms").fetchone()[0]
    blocks = 2
    assert n_layers == blocks + 1 + (family == "gpt_neox")  # 2 blocks, and GPT-NeoX's final norm
    for source, group in (("alpha", docs["alpha"]), ("beta", docs["beta"]), ("all", docs["alpha"] + docs["beta"])):
        want_change, want_rws, one_token = _reference(model, group)
        assert one_token == (source != "beta")  # the one-token sentence: a window of one vector
        assert sorted(layer for s, layer in change if s == source) == list(range(n_layers - 1))
        assert sorted(layer for s, layer in rws if s == source) == list(range(n_layers))
        for layer, (n, bi, ad) in want_change.items():
            got = change[(source, layer)]
            assert got[0] == n and got[1] == pytest.approx(bi, abs=1e-6) and got[2] == pytest.approx(ad, abs=1e-6)
            assert 0 < got[2] < 1
            if family == "gpt_neox" and layer + 2 < n_layers:  # the blocks turn the dominant mean's tokens little
                assert got[1] < 1e-2 and got[1] == pytest.approx(bi, rel=1e-6), (source, layer, got, bi)
        if family == "gpt_neox":  # the dominant mean: tokens of different sentences nearly parallel
            assert all(v > 0.9 for _, v in want_rws.values()), want_rws
        for layer, (w, v) in want_rws.items():
            got = rws[(source, layer)]
            assert got[0] == w and got[1] == pytest.approx(v, abs=1e-6), (source, layer, got, v)
    if family != "gpt_neox":
        return
    shards_change, shards_rws = _views(halves)
    for mine, theirs in ((change, shards_change), (rws, shards_rws)):
        assert mine.keys() == theirs.keys()
        for k, row in mine.items():
            assert row[0] == theirs[k][0] and all(abs(a - b) <= 1e-12 for a, b in zip(row[1:], theirs[k][1:])), k
