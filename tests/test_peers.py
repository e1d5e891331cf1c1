"""The peers' isotropy measures from the same single pass, each against its authors' package
(llm-microscope, IsoScore, scikit-dimension) on the very same vectors (synthetic known answers:
test_known_answers.py)."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest
import torch

import reference as ref
from conftest import run_cli
from warehouse.query import connect, isoscore_star

MAXLEN = 32


def microscope():
    """llm-microscope 0.0.7's __init__ fails to import (`from logit_lens import *`): load functions.py by path."""
    spec = importlib.util.find_spec("llm_microscope")
    path = spec.submodule_search_locations[0] + "/functions.py"
    module_spec = importlib.util.spec_from_file_location("llm_microscope_functions", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def peers(workdir, sources, model_factory):
    """Two sources, alpha split into 2 shards, moments and a sample larger than the data (so the
    sample holds every vector and the oracles see exactly the same points)."""
    path = model_factory("gpt_neox", tied=False)
    wh = workdir / "peers-wh"
    a, b = f"alpha={sources['alpha']}", f"beta={sources['beta']}"
    for args in (["--source", a, "--shard", "1/2"], ["--source", a, "--shard", "2/2"], ["--source", b]):
        code, _, err = run_cli("extract", "--model", path, *args, "--warehouse", wh, "--max-length", MAXLEN,
                               "--moments-precision", "float64", "--sample", 100000,  # exact products (the CKA test)
                               "--cross-moments", "--sequences", "--prompt-entropy")
        assert code == 0, err
    texts = {"alpha": ref.source_texts(sources["alpha"]), "beta": ref.source_texts(sources["beta"])}
    windows = {k: [] for k in ("all", "alpha", "beta")}
    states = {
        "all": ref.hidden_states(str(path), texts["alpha"] + texts["beta"], MAXLEN, windows=windows["all"]),
        "alpha": ref.hidden_states(str(path), texts["alpha"], MAXLEN, windows=windows["alpha"]),
        "beta": ref.hidden_states(str(path), texts["beta"], MAXLEN, windows=windows["beta"]),
    }
    return {"wh": wh, "states": states, "con": connect(wh),
            "windows": {k: np.array(v) for k, v in windows.items()}}


def view(peers, name, value):
    rows = peers["con"].execute(f"SELECT source, layer, {value} FROM {name}").fetchall()
    return {(s, layer): v for s, layer, v in rows}


SOURCES = ["all", "alpha", "beta"]


def test_anisotropy_equals_llm_microscope(peers):
    got = view(peers, "anisotropy", "anisotropy")
    f = microscope()
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            assert got[(source, layer)] == pytest.approx(f.calculate_anisotropy_torch(torch.tensor(X)), rel=1e-6)


def test_isoscore_equals_the_isoscore_package(peers):
    from IsoScore import IsoScore

    got = view(peers, "isoscore", "isoscore")
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            want = float(IsoScore.IsoScore(X))
            assert got[(source, layer)] == pytest.approx(want, rel=1e-6, abs=1e-9)


def test_isoscore_star_equals_the_package_with_identity_shrinkage(peers):
    from IsoScore import IsoScore

    df = isoscore_star(0.3, peers["wh"])
    got = {(r["source"], r["layer"]): r["isoscore_star"] for r in df.iter_rows(named=True)}
    X = peers["states"]["all"][2][1]
    want = float(IsoScore.istar().IsoScore_star(X, torch.eye(X.shape[1], dtype=torch.float64), 0.3))
    assert got[("all", 2)] == pytest.approx(want, rel=1e-6)


def test_pca_spectrum_effective_rank_and_outlier_dims_equal_numpy(peers):
    con = peers["con"]
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            C = np.cov(X.T)
            want = np.sort(np.linalg.eigvalsh(C))[::-1]
            got = [r[0] for r in con.execute(
                "SELECT eigenvalue FROM pca_spectrum WHERE source = ? AND layer = ? ORDER BY k", [source, layer]).fetchall()]
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12 * want[0])
            p = np.clip(want, 0, None) / np.clip(want, 0, None).sum()
            erank = np.exp(-(p[p > 0] * np.log(p[p > 0])).sum())
            assert view(peers, "effective_rank", "effective_rank")[(source, layer)] == pytest.approx(erank, rel=1e-6)
            share = np.diag(C) / np.trace(C)
            got_share = [r[0] for r in con.execute(
                "SELECT share FROM outlier_dims WHERE source = ? AND layer = ? ORDER BY dim", [source, layer]).fetchall()]
            np.testing.assert_allclose(got_share, share, rtol=1e-6)


def test_alpha_req_and_outlier_kurtosis_equal_numpy(peers):
    """alpha_req and outlier_kurtosis against numpy on the hidden states captured by hooks (two
    sources, alpha in 2 shards, and 'all')."""
    alpha, kurt = view(peers, "alpha_req", "alpha_req"), view(peers, "outlier_kurtosis", "kurtosis")
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            want = ref.alpha_req_numpy(np.sort(np.linalg.eigvalsh(np.cov(X.T)))[::-1], len(X))
            assert want is not None  # d = 32: ranks 12 … 22
            assert alpha[(source, layer)] == pytest.approx(want, rel=1e-6), (source, layer)
            s = (X * X).mean(0)  # raw second moment per dimension
            assert kurt[(source, layer)] == pytest.approx((s * s).mean() / s.mean() ** 2, rel=1e-6), (source, layer)


def test_weight_spectrum_equals_numpy_svd(peers, model_factory):
    """Singular values of the stored embedding and unembedding, raw and centred, against numpy's SVD."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_factory("gpt_neox", tied=False))
    mats = {"embedding": model.get_input_embeddings().weight, "unembedding": model.get_output_embeddings().weight}
    rows = peers["con"].execute("SELECT matrix, tied, centered, rows, k, singular_value FROM weight_spectrum "
                                "ORDER BY matrix, centered, k").fetchall()
    assert {(r[0], r[2]) for r in rows} == {(m, c) for m in mats for c in (False, True)}
    for name, W in mats.items():
        W = W.detach().double().numpy()
        for centered in (False, True):
            A = W - W.mean(0) if centered else W
            want = np.linalg.svd(A, compute_uv=False)  # descending
            got = [r for r in rows if r[0] == name and r[2] == centered]
            assert [r[4] for r in got] == list(range(1, len(want) + 1))
            assert all(r[1] is False and r[3] == W.shape[0] for r in got)
            np.testing.assert_allclose([r[5] for r in got], want, rtol=1e-6, atol=1e-9 * want[0])


def entropy(lam: np.ndarray, norm: int) -> float:
    p = np.clip(lam, 0, None) / np.clip(lam, 0, None).sum()
    p = p[p > 0]
    return float(-(p * np.log(p)).sum() / np.log(norm))


def window_reference(X: np.ndarray, win: np.ndarray) -> dict:
    """The per-window measures by their definitions, float64, from one layer's counted vectors X
    (n, d) and each vector's window."""
    d = X.shape[1]
    groups = [X[win == w] for w in np.unique(win)]
    means = np.array([g.mean(0) for g in groups])
    lasts = np.array([g[-1] for g in groups])
    out = {}
    for pooling, Z in (("mean", means), ("last", lasts)):
        lam = np.sort(np.linalg.eigvalsh(np.cov(Z.T)))[::-1]
        out[pooling] = (len(Z), entropy(lam, 2) * np.log(2), lam.max() / lam.sum(), ref.alpha_req_numpy(lam, len(Z)))
    hat = means / np.linalg.norm(means, axis=1, keepdims=True)
    out["dataset_entropy"] = entropy(np.linalg.eigvalsh(hat.T @ hat / len(hat)), min(len(hat), d))
    curv = []
    for g in groups:
        v = np.diff(g, axis=0)
        c = [np.arccos(min(1.0, abs(a @ b) / (np.linalg.norm(a) * np.linalg.norm(b)))) for a, b in zip(v, v[1:])
             if np.linalg.norm(a) > 0 and np.linalg.norm(b) > 0]
        if c:
            curv.append(np.mean(c))
    out["curvature"] = (len(curv), np.mean(curv))
    pe = []
    for g in groups:
        if len(g) >= 2:
            Z = g - g.mean(0)
            Z = Z[np.linalg.norm(Z, axis=1) > 0]
            Z /= np.linalg.norm(Z, axis=1, keepdims=True)
            pe.append(entropy(np.linalg.eigvalsh(Z @ Z.T), min(len(g), d)))
    out["prompt_entropy"] = (len(pe), np.mean(pe))
    return out


def test_sequence_measures_equal_their_definitions(peers):
    """sequence_spectrum (mean and last pooling), dataset_entropy, curvature and prompt_entropy
    against numpy on the hidden states captured by hooks, each window's vectors by its window
    number (two sources, alpha in 2 shards, and 'all'), to 1e-6."""
    con = peers["con"]
    seq = {(s, layer, p): (w, er, an, al) for s, layer, p, w, er, an, al in con.execute(
        "SELECT source, layer, pooling, windows, effective_rank, anisotropy, alpha_req FROM sequence_spectrum").fetchall()}
    ds = view(peers, "dataset_entropy", "dataset_entropy")
    curv = {(s, layer): (w, c) for s, layer, w, c in con.execute(
        "SELECT source, layer, windows, curvature FROM curvature").fetchall()}
    pe = {(s, layer): (w, c) for s, layer, w, c in con.execute(
        "SELECT source, layer, windows, prompt_entropy FROM prompt_entropy").fetchall()}
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            want = window_reference(X, peers["windows"][source])
            for pooling in ("mean", "last"):
                w, er, an, al = seq[(source, layer, pooling)]
                W, er_want, an_want, al_want = want[pooling]
                assert w == W and er == pytest.approx(np.exp(er_want), rel=1e-6), (source, layer, pooling)
                assert an == pytest.approx(an_want, rel=1e-6)
                assert (al is None) == (al_want is None) and (al is None or al == pytest.approx(al_want, rel=1e-6))
            assert ds[(source, layer)] == pytest.approx(want["dataset_entropy"], rel=1e-6)
            assert curv[(source, layer)][0] == want["curvature"][0]
            assert curv[(source, layer)][1] == pytest.approx(want["curvature"][1], rel=1e-6)
            assert pe[(source, layer)][0] == want["prompt_entropy"][0]
            assert pe[(source, layer)][1] == pytest.approx(want["prompt_entropy"][1], rel=1e-6)


def test_massive_activations_equal_the_top_entries(peers):
    """The top-10 |h| of each layer against numpy's over every counted vector and dimension (values,
    dimensions, tokens; the ratio to the mean |h|), merged across the shards and sources."""
    rows = peers["con"].execute("SELECT source, layer, rank, dim, abs_value, token_id, document_source, "
                                "ratio_to_mean_abs FROM massive_activations ORDER BY source, layer, rank").fetchall()
    for source in SOURCES:
        for layer, (ids, X) in peers["states"][source].items():
            got = [r for r in rows if r[0] == source and r[1] == layer]
            A = np.abs(X)
            flat = np.argsort(-A, axis=None, kind="stable")[:10]
            want_val = A.reshape(-1)[flat]
            assert [r[2] for r in got] == list(range(1, 11))
            np.testing.assert_allclose([r[4] for r in got], want_val, rtol=1e-6)
            assert sorted((r[3], r[5]) for r in got) == sorted((int(f % X.shape[1]), int(ids[f // X.shape[1]]))
                                                              for f in flat)
            np.testing.assert_allclose([r[7] for r in got], want_val / A.mean(), rtol=1e-6)
            assert {r[6] for r in got} <= ({"alpha", "beta"} if source == "all" else {source})


def test_linearity_equals_procrustes_similarity(peers):
    f = microscope()
    got = view(peers, "linearity", "linearity")
    got_c = view(peers, "linearity", "linearity_centered")
    for source in SOURCES:
        st = peers["states"][source]
        for layer in range(len(st) - 1):
            x, y = torch.tensor(st[layer][1]), torch.tensor(st[layer + 1][1])
            assert got[(source, layer)] == pytest.approx(f.procrustes_similarity(x, y), rel=1e-6)
            # 0.0.7's procrustes_similarity_centered returns None (its last line is `sim = float`);
            # it is procrustes_similarity(x, y − x), which is what it computes up to there.
            assert f.procrustes_similarity_centered(x, y) is None
            assert got_c[(source, layer)] == pytest.approx(f.procrustes_similarity(x, y - x), rel=1e-6)
    assert (("all", len(peers["states"]["all"]) - 1)) not in got  # the last layer has no successor


def test_intrinsic_dimension_equals_both_implementations(peers):
    """On the very vectors of the merged sample (read back from the warehouse): TwoNN is a
    nearest-neighbour statistic, so the oracles must see the same float32-stored points."""
    import skdim

    f = microscope()
    got = view(peers, "intrinsic_dim", "twonn")
    got_sk = view(peers, "intrinsic_dim", "twonn_skdim")
    sizes = view(peers, "intrinsic_dim", "sample_size")
    con = peers["con"]
    for source in SOURCES:
        where = "" if source == "all" else f"AND source = '{source}'"
        for layer, (_, X) in peers["states"][source].items():
            rows = con.execute(f"SELECT vec FROM samples WHERE layer = ? {where} ORDER BY key", [layer]).fetchall()
            S = np.array([r[0] for r in rows], dtype=np.float64)
            assert sizes[(source, layer)] == len(S) == len(X)  # K exceeds the data: every vector
            np.testing.assert_allclose(np.sort(S, axis=None), np.sort(X, axis=None), atol=1e-4)
            want = f.intrinsic_dimension(torch.tensor(S), "cpu")  # NaN for both where vectors repeat (layer 0)
            assert got[(source, layer)] == pytest.approx(want, rel=1e-6, nan_ok=True)
            if layer > 0:  # layer 0 repeats vectors (r1 = 0): skdim warns and drops them, as we do
                assert got_sk[(source, layer)] == pytest.approx(skdim.id.TwoNN().fit(S).dimension_, rel=1e-6)


def test_inter_sim_types_equals_pairwise_cosines_of_type_means(peers):
    got = view(peers, "inter_sim_types", "inter_sim_types")
    for source in SOURCES:
        for layer, (ids, X) in peers["states"][source].items():
            U = X / np.linalg.norm(X, axis=1, keepdims=True)
            means = np.stack([U[ids == t].mean(0) for t in np.unique(ids)])
            assert got[(source, layer)] == pytest.approx(ref.mean_pairwise_cosine(means), abs=1e-6)


def test_sample_merges_across_shards_like_a_single_run(workdir, sources, model_factory):
    path = model_factory("gpt_neox", tied=False)
    one, two = workdir / "sample-one", workdir / "sample-two"
    common = ["--model", path, "--source", f"alpha={sources['alpha']}", "--max-length", MAXLEN, "--sample", 40,
              "--sequences"]
    assert run_cli("extract", *common, "--warehouse", one)[0] == 0
    for shard in ("1/2", "2/2"):
        assert run_cli("extract", *common, "--warehouse", two, "--shard", shard)[0] == 0
    q = "SELECT key, document, position, token_id, vec FROM samples WHERE layer = 2 ORDER BY key"
    single = connect(one).execute(q + " LIMIT 40").fetchall()
    merged = connect(two).execute(q + " LIMIT 40").fetchall()
    assert len(single) == 40 and [r[:4] for r in single] == [r[:4] for r in merged]  # same tokens
    np.testing.assert_allclose([r[4] for r in single], [r[4] for r in merged], atol=1e-5)  # batching numerics
    assert connect(one).execute("SELECT count(DISTINCT layer), count(*) FROM samples").fetchall()[0] == (4, 160)
    # the top-10 |h| (a top-k of the shards' top-k) and the per-window sums merge like one run
    q = ("SELECT layer, rank, dim, token_id, document_source, document, position, abs_value, ratio_to_mean_abs "
         "FROM massive_activations WHERE source = 'alpha' ORDER BY layer, rank")
    single, merged = connect(one).execute(q).fetchall(), connect(two).execute(q).fetchall()
    assert len(single) == 40 and [r[:7] for r in single] == [r[:7] for r in merged]
    np.testing.assert_allclose([r[7:] for r in single], [r[7:] for r in merged], rtol=1e-5)  # batching numerics
    for v, cols in (("curvature", "windows, curvature"), ("dataset_entropy", "windows, dataset_entropy"),
                    ("sequence_spectrum", "windows, effective_rank, anisotropy")):
        q = f"SELECT {cols} FROM {v} WHERE source = 'alpha' ORDER BY ALL"
        single, merged = connect(one).execute(q).fetchall(), connect(two).execute(q).fetchall()
        assert single and [r[0] for r in single] == [r[0] for r in merged], v
        np.testing.assert_allclose([r[1:] for r in single], [r[1:] for r in merged], rtol=1e-5, err_msg=v)


def test_window_measures_are_null_where_not_measured(workdir, sources, model_factory):
    """Without --prompt-entropy the prompt_entropy view has no row; without --sequences (the default)
    none of the per-window views has one; a group mixing a run with and one without is NULL, not a
    partial sum; --prompt-entropy implies --sequences."""
    path = model_factory("gpt_neox", tied=False)
    wh = workdir / "window-nulls"
    common = ["--model", path, "--max-length", MAXLEN, "--warehouse", wh]
    assert run_cli("extract", *common, "--source", f"alpha={sources['alpha']}", "--sequences")[0] == 0
    assert run_cli("extract", *common, "--source", f"beta={sources['beta']}")[0] == 0
    con = connect(wh)
    count = lambda v, s: con.execute(f"SELECT count(*) FROM {v} WHERE source = '{s}'").fetchone()[0]  # noqa: E731
    assert count("prompt_entropy", "alpha") == 0 and count("curvature", "alpha") > 0
    for v in ("curvature", "sequence_spectrum", "dataset_entropy", "massive_activations", "prompt_entropy"):
        assert count(v, "beta") == 0 and count(v, "all") == 0, v
    assert count("anisotropy", "all") > 0  # the rest of the pass is there
    code, _, err = run_cli("extract", *common, "--source", f"alpha={sources['alpha']}", "--no-sequences",
                           "--prompt-entropy")
    assert code == 2 and "cannot go with --no-sequences" in err
    assert run_cli("extract", *common, "--source", f"gamma={sources['alpha']}", "--prompt-entropy")[0] == 0
    con.close()
    con = connect(wh)
    assert count("prompt_entropy", "gamma") > 0 and count("curvature", "gamma") > 0


# ---------------------------------------------------------------- measures no peer offers


def test_dim_contrib_equals_pairwise_products_and_sums_to_inter_sim(peers):
    rows = peers["con"].execute("SELECT source, layer, dim, contrib FROM dim_contrib").fetchall()
    got = {(s, layer, dim): v for s, layer, dim, v in rows}
    inter = view(peers, "inter_sim_by_source", "inter_sim") | {
        ("all", layer): v for layer, v in peers["con"].execute("SELECT layer, inter_sim FROM inter_sim").fetchall()}
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            want = ref.dim_contrib(X)
            ours = np.array([got[(source, layer, i)] for i in range(len(want))])
            assert np.abs(ours - want).max() < 1e-9, (source, layer)
            assert ours.sum() == pytest.approx(inter[(source, layer)], abs=1e-9)
            assert ours.sum() == pytest.approx(ref.mean_pairwise_cosine(X), abs=1e-9)


def test_drift_equals_the_definition(peers):
    rows = peers["con"].execute("SELECT source, layer, mean_norm, mean_cos_to_mean FROM drift").fetchall()
    got = {(s, layer): (a, b) for s, layer, a, b in rows}
    for source in SOURCES:
        for layer, (_, X) in peers["states"][source].items():
            norm, cos = ref.drift(X)  # ‖μ‖ cancels: the batched float32 forward's ~1e-7 shows
            assert got[(source, layer)][0] == pytest.approx(norm, rel=1e-6)
            assert got[(source, layer)][1] == pytest.approx(cos, rel=1e-6, abs=1e-9)


def test_intra_sentence_sim_equals_the_definition(peers):
    got = view(peers, "intra_sentence_sim", "intra_sentence_sim")
    windows = dict(peers["con"].execute(
        "SELECT source || ':' || layer, windows FROM intra_sentence_sim").fetchall())
    for source in SOURCES:
        w = peers["windows"][source]
        for layer, (_, X) in peers["states"][source].items():
            assert got[(source, layer)] == pytest.approx(ref.intra_sentence_sim(X, w), rel=1e-7)  # float32 forward
            assert windows[f"{source}:{layer}"] == sum(1 for k in np.unique(w) if (w == k).sum() >= 2)


def test_inter_sim_by_frequency_equals_pairwise_cosines_per_bucket(peers):
    rows = peers["con"].execute("SELECT layer, bucket, types, n, inter_sim FROM inter_sim_by_frequency").fetchall()
    got = {(layer, b): (t, n, v) for layer, b, t, n, v in rows}
    for layer, (ids, X) in peers["states"]["all"].items():
        uniq, counts = np.unique(ids, return_counts=True)
        bucket_of = dict(zip(uniq, np.floor(np.log2(counts)).astype(int)))
        buckets = np.array([bucket_of[t] for t in ids])
        for b in np.unique(buckets):
            sel = buckets == b
            if sel.sum() < 2:
                continue
            types, n, value = got[(layer, int(b))]
            assert (types, n) == (len(np.unique(ids[sel])), int(sel.sum()))
            # float32 token vectors (the default): 1e-6
            assert value == pytest.approx(ref.mean_pairwise_cosine(X[sel]), abs=1e-6), (layer, b)
    assert {b for _, b in got} >= {0, 1, 2}


def test_cka_and_orthogonal_procrustes_equal_svd(peers):
    """The formula from merged float64 moments against the SVD definition on the very vectors the
    moments summed (the sample holds them all, read back from the warehouse): 1e-12.  Against the
    oracle's own forward only to 1e-8: extract runs padded batches, the oracle one window at a time,
    and float32 GEMMs of other shapes round differently on some CPUs (Intel Xeon, 2026-11-25: the
    states differ by ≤ 4.8e-8 relative Frobenius, 13 % of the entries by an ulp or two, layer 0
    bit-equal; CKA then moves by up to 1.1e-9, and 4-ulp random noise on the states moves it by up to
    3e-9, while our formula on the oracle's states equals the SVD one to 2e-15)."""
    con = peers["con"]
    rows = con.execute("SELECT source, layer, cka, procrustes_orthogonal FROM linearity").fetchall()
    got = {(s, layer): (c, p) for s, layer, c, p in rows}
    for source in SOURCES:
        states = peers["states"][source]
        where = "" if source == "all" else f"AND source = '{source}'"
        sample = [np.array([r[0] for r in con.execute(
            f"SELECT vec FROM samples WHERE layer = ? {where} ORDER BY source, document, position",
            [layer]).fetchall()], dtype=np.float64) for layer in range(len(states))]
        for layer in range(len(states) - 1):
            assert len(sample[layer]) == len(states[layer][1])  # every vector
            cka, proc = ref.cka_procrustes(sample[layer], sample[layer + 1])
            assert got[(source, layer)][0] == pytest.approx(cka, rel=1e-12)
            assert got[(source, layer)][1] == pytest.approx(proc, rel=1e-12)
            cka, proc = ref.cka_procrustes(states[layer][1], states[layer + 1][1])
            assert got[(source, layer)][0] == pytest.approx(cka, rel=1e-8)
            assert got[(source, layer)][1] == pytest.approx(proc, rel=1e-8)
            assert 0 < proc <= 1 and 0 < cka <= 1


def test_bfloat16_moments_against_float64_end_to_end(workdir, sources, model_factory):
    """`--dtype bfloat16 --moments-precision bfloat16` (the GPU default, here on the CPU: the same
    products upcast) against exact float64 products of the same bf16 hidden states, through the
    CLI: covariances, eigenvalues and the moment views to the bounds docs/views-guide.md states;
    the precision is recorded; float32 hidden states are refused before anything runs."""
    model = model_factory("gpt_neox", tied=False)
    cons = {}
    for name, precision, cross in (("bfloat16", "bfloat16", True), ("float64", "float64", True),
                                   ("bfloat16-no-cross", "bfloat16", False)):
        wh = workdir / f"bf16-moments-{name}"
        code, _, err = run_cli("extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--source",
                               f"beta={sources['beta']}", "--warehouse", wh, "--max-length", MAXLEN, "--dtype",
                               "bfloat16", "--moments-precision", precision, *(["--cross-moments"] if cross else []))
        assert code == 0, err
        cons[name] = connect(wh)
    q = "SELECT layer, n, s1, s2, s_cross FROM moments_merged WHERE source = 'all' ORDER BY layer"
    want = cons["float64"].execute(q).fetchall()
    for name in ("bfloat16", "bfloat16-no-cross"):  # with the cross moments h_prevᵀh, or the Gram matrices alone
        got = cons[name].execute(q).fetchall()
        assert len(got) == len(want) > 2
        for (layer, n, s1, s2, sx), (_, n64, s1_64, s2_64, sx64) in zip(got, want):
            assert n == n64 and np.array_equal(s1, s1_64)  # Σh is float64 either way
            d = len(s1)
            cov = lambda a, b: np.array(b).reshape(d, d) / n - np.outer(a, a) / n**2  # noqa: E731
            c16, c64 = cov(s1, s2), cov(s1_64, s2_64)
            assert np.abs(c16 - c64).max() <= 1e-5 * np.abs(c64).max(), (name, layer)
            e16, e64 = np.linalg.eigvalsh(c16), np.linalg.eigvalsh(c64)
            assert np.abs(e16 - e64).max() <= 1e-6 * e64.max(), (name, layer)
            if name == "bfloat16-no-cross":
                assert sx is None
                continue
            assert (sx is None) == (sx64 is None)  # None at the last layer only
            if sx is not None:
                assert np.abs(np.array(sx) - np.array(sx64)).max() <= 1e-6 * np.abs(np.array(sx64)).max()
    for name, col in (("anisotropy", "anisotropy"), ("isoscore", "isoscore"), ("effective_rank", "effective_rank"),
                      ("linearity", "cka"), ("linearity", "linearity")):
        q = f"SELECT layer, {col} FROM {name} WHERE source = 'all'"
        a, b = dict(cons["bfloat16"].execute(q).fetchall()), dict(cons["float64"].execute(q).fetchall())
        assert a.keys() == b.keys() and a
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1e-3), (name, col, k, a[k], b[k])
    settings = json.loads(cons["bfloat16"].execute("SELECT settings FROM runs WHERE kind = 'data' LIMIT 1").fetchone()[0])
    assert settings["moments_precision"] == "bfloat16" and settings["dtype"] == "bfloat16"
    for con in cons.values():
        con.close()
    wh = workdir / "bf16-moments-refused"
    code, _, err = run_cli("extract", "--model", model, "--source", f"alpha={sources['alpha']}", "--warehouse", wh,
                           "--moments-precision", "bfloat16")
    assert code != 0 and "needs --dtype bfloat16" in err and len(err.strip().splitlines()) == 1 and not wh.exists()


def test_default_float32_moments_against_float64(peers, workdir, sources, model_factory):
    """The default pass (moments on, float32 products of centred vectors, float64 sums) against the
    exact float64 products over the same tokens: the bounds docs/views-guide.md states."""
    wh = workdir / "peers-wh-f32"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--source",
                           f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}", "--warehouse", wh,
                           "--max-length", MAXLEN)  # no moments flag: they are on by default
    assert code == 0, err
    con = connect(wh)
    q = "SELECT layer, n, s1, s2, s_cross FROM moments_merged WHERE source = 'all' ORDER BY layer"
    got, want = con.execute(q).fetchall(), peers["con"].execute(q).fetchall()
    assert len(got) == len(want) > 2
    for (layer, n, s1, s2, sx), (_, n64, s1_64, s2_64, sx64) in zip(got, want):
        assert n == n64
        d = len(s1)
        cov = lambda a, b: np.array(b).reshape(d, d) / n - np.outer(a, a) / n**2  # noqa: E731
        c32, c64 = cov(s1, s2), cov(s1_64, s2_64)
        assert np.abs(c32 - c64).max() <= 1e-6 * np.abs(c64).max(), layer  # measured ~1e-7
        e32, e64 = np.linalg.eigvalsh(c32), np.linalg.eigvalsh(c64)
        assert np.abs(e32 - e64).max() <= 1e-7 * e64.max(), layer
        assert sx is None  # the cross moments are opt-in (--cross-moments)
    _same_moment_views(con, peers["con"], "all", (("anisotropy", "anisotropy"), ("isoscore", "isoscore")))
    assert con.execute("SELECT count(*) FROM linearity").fetchone()[0] == 0
    settings = json.loads(con.execute("SELECT settings FROM runs WHERE kind = 'data' LIMIT 1").fetchone()[0])
    assert settings["moments"] is True and settings["moments_precision"] == "float32"
    assert settings["cross_moments"] is False
    con.close()
    # --no-moments: no moments table, no moment views for that run (the Inter-Sim views are unaffected)
    off = workdir / "peers-wh-off"
    code, _, err = run_cli("extract", "--model", model_factory("gpt_neox", tied=False), "--source",
                           f"alpha={sources['alpha']}", "--warehouse", off, "--max-length", MAXLEN, "--no-moments")
    assert code == 0, err
    con = connect(off)
    assert con.execute("SELECT count(*) FROM moments").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM anisotropy").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] > 0
    con.close()


def _same_moment_views(con, con64, source: str, views) -> None:
    """The views' values of one source in two warehouses, to the float32 moments' bound (1e-5)."""
    for name, col in views:
        q = f"SELECT layer, {col} FROM {name} WHERE source = '{source}'"
        a, b = dict(con.execute(q).fetchall()), dict(con64.execute(q).fetchall())
        assert a.keys() == b.keys() and a, (name, col)
        for k in b:
            assert abs(a[k] - b[k]) <= 1e-5 * max(abs(b[k]), 1e-3), (name, col, k, a[k], b[k])


def test_cross_moments_are_opt_in_and_never_half_merged(peers, workdir, sources, model_factory):
    """--cross-moments stores Σ h_l h_{l+1}ᵀ (float32 products, float64 sums) and gives linearity, CKA and
    Procrustes equal to the float64 run's; a group whose partials do not all hold them gives no
    linearity row at all (never one from part of the tokens); --no-moments refuses them."""
    from extract.run.settings import recorded_setting

    model = model_factory("gpt_neox", tied=False)
    wh = workdir / "peers-wh-cross"
    common = ["--model", model, "--warehouse", wh, "--max-length", MAXLEN, "--source", f"alpha={sources['alpha']}"]
    for shard, flags in (("1/2", ["--cross-moments"]), ("2/2", [])):
        code, _, err = run_cli("extract", *common, "--shard", shard, *flags)
        assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM anisotropy WHERE source = 'alpha'").fetchone()[0] > 2
    assert con.execute("SELECT count(*) FROM linearity").fetchone()[0] == 0  # shard 2/2 has none
    con.close()
    code, _, err = run_cli("extract", *common, "--shard", "2/2", "--cross-moments")  # replaces that partial
    assert code == 0, err
    con = connect(wh)
    q = "SELECT layer, s_cross FROM moments_merged WHERE source = 'alpha' AND s_cross IS NOT NULL ORDER BY layer"
    got, want = con.execute(q).fetchall(), peers["con"].execute(q).fetchall()
    assert len(got) == len(want) == len(peers["states"]["alpha"]) - 1
    for (layer, sx), (_, sx64) in zip(got, want):
        assert np.abs(np.array(sx) - np.array(sx64)).max() <= 1e-6 * np.abs(np.array(sx64)).max(), layer
    _same_moment_views(con, peers["con"], "alpha", (("linearity", "cka"), ("linearity", "procrustes_orthogonal"),
                                                     ("linearity", "linearity"), ("linearity", "linearity_centered")))
    settings = [json.loads(r[0]) for r in con.execute("SELECT settings FROM runs WHERE kind = 'data'").fetchall()]
    assert [r["cross_moments"] for r in settings] == [True, True]
    con.close()
    off = workdir / "peers-wh-cross-refused"
    code, _, err = run_cli("extract", "--model", model, "--warehouse", off, "--source", f"alpha={sources['alpha']}",
                           "--no-moments", "--cross-moments")
    assert code == 2 and "--cross-moments" in err and len(err.strip().splitlines()) == 1 and not off.exists()
    # --skip-done: a run recorded before the option held cross moments whenever it held moments
    assert recorded_setting({"moments": True}, "cross_moments") is True
    assert recorded_setting({"moments": False}, "cross_moments") is False
    assert recorded_setting({"moments": True, "cross_moments": False}, "cross_moments") is False
