"""Per-head query/key geometry (qk_geometry, qk_direction) and attention sinks (attention_sink,
attention_sink_rate) against their definitions, computed the slow way on queries and keys captured
independently of the extractor: forward hooks on each attention's projections, reshaped into heads
and rotated with the model's own rotary embedding, each document fed alone as its tokenizer
encodes it, O(n²) cosines and numpy's eigh in float64; sinks against the eager attention's own
`output_attentions=True`.  On GPT-NeoX (partial rotary), Llama (grouped-query, full rotary) and the
real MiniLM (an encoder, no rotary).  Then shards (two shards = one run), --no-attention, a family
the capture does not cover, which families are covered, and the interface left as it was."""

from __future__ import annotations

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

import reference as ref
import tiny
from conftest import run_cli, same_rows
from warehouse.query import connect

CONTEXT = 128  # every test document fits one window: the reference feeds documents whole
FAMILIES = ("gpt_neox", "llama", "minilm")
NOT_COVERED = {"bloom", "deberta-v2", "falcon"}  # families whose attention does not call the interface


def model_path(family: str, model_factory) -> str:
    if family == "minilm":
        from extract.models import resolve_model

        return resolve_model("minilm").location
    return str(model_factory(family, tied=family in ("gpt2", "bert", "gemma", "opt"), context=CONTEXT))


def _heads(x: torch.Tensor, hd: int) -> torch.Tensor:
    """(1, T, H·hd) → (1, H, T, hd)."""
    return x.view(x.shape[0], x.shape[1], -1, hd).transpose(1, 2)


def reference(path: str, texts: list[str]) -> dict:
    """Per layer: Q (n, H, hd), K (n, G, hd) float64 at the counted positions (the tokenizer's
    special-tokens mask 0), and the eager attention's Σ_{i≥1} A[i, 0] per head, its n and windows."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tok = AutoTokenizer.from_pretrained(path)
    kind = model.config.model_type
    lib = importlib.import_module(type(model).__module__)
    if kind == "bert":
        blocks = model.encoder.layer
        hd = model.config.hidden_size // model.config.num_attention_heads
        projections = [(b.attention.self.query, b.attention.self.key) for b in blocks]
    else:
        blocks = model.layers
        hd = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        projections = [(b.attention.query_key_value,) if kind == "gpt_neox" else (b.self_attn.q_proj, b.self_attn.k_proj)
                       for b in blocks]
    got: dict = {}
    hooks = [m.register_forward_hook(lambda m, a, out, key=(i, j): got.__setitem__(key, out))
             for i, ms in enumerate(projections) for j, m in enumerate(ms)]
    out = {i: {"q": [], "k": [], "sink": 0.0, "sink_n": 0, "windows": 0} for i in range(len(blocks))}
    try:
        with torch.no_grad():
            for text in texts:
                enc = tok(text, add_special_tokens=True, return_special_tokens_mask=True)
                ids = torch.tensor([enc["input_ids"]])
                keep = torch.tensor(enc["special_tokens_mask"]) == 0
                res = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_attentions=True)
                T = ids.shape[1]
                rope = model.rotary_emb(torch.zeros(1, T, 1), torch.arange(T)[None]) if kind != "bert" else None
                for i in range(len(blocks)):
                    if kind == "gpt_neox":  # fused (1, T, H·3·hd): per head q | k | v
                        qkv = got[i, 0].view(1, T, -1, 3 * hd).transpose(1, 2)
                        q, k, _ = qkv.chunk(3, dim=-1)
                    else:
                        q, k = _heads(got[i, 0], hd), _heads(got[i, 1], hd)
                    if rope is not None:
                        q, k = lib.apply_rotary_pos_emb(q, k, *rope)
                    out[i]["q"].append(q[0].transpose(0, 1)[keep].double().numpy())  # (n, H, hd)
                    out[i]["k"].append(k[0].transpose(0, 1)[keep].double().numpy())
                    A = res.attentions[i][0].double()  # (H, T, T)
                    out[i]["sink"] = out[i]["sink"] + A[:, 1:, 0].sum(1).numpy()
                    out[i]["sink_n"] += T - 1
                    out[i]["windows"] += 1
    finally:
        for h in hooks:
            h.remove()
    for o in out.values():
        o["q"], o["k"] = np.concatenate(o["q"]), np.concatenate(o["k"])
    return out


def pair_mean_cos(A: np.ndarray, B: np.ndarray) -> float:
    """(1/(n²−n)) Σ_{i≠j} cos(a_i, b_j), by the definition."""
    n = len(A)
    G = (A / np.linalg.norm(A, axis=1, keepdims=True)) @ (B / np.linalg.norm(B, axis=1, keepdims=True)).T
    return float((G.sum() - np.trace(G)) / (n * n - n))


@pytest.fixture(scope="module")
def runs(workdir, sources, model_factory):
    """(model path, warehouse, args) per family, extracted once with every attention measure."""
    out = {}

    def get(family):
        if family not in out:
            path = model_path(family, model_factory)
            args = ["--model", path, "--source", f"alpha={sources['alpha']}", "--max-length", CONTEXT,
                    "--batch-size", 5, "--attention-moments", "--attention-sinks", "--no-moments"]
            wh = workdir / f"attention-{family}"
            code, _, err = run_cli("extract", *args, "--warehouse", wh)
            assert code == 0, err
            out[family] = (path, wh, args)
        return out[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_views_equal_their_definitions(runs, sources, family):
    path, wh, _ = runs(family)
    want = reference(path, ref.source_texts(sources["alpha"]))
    con = connect(wh)
    geo = {(r[0], r[1]): r for r in con.execute(
        "SELECT layer, head, n, q_anisotropy, k_anisotropy, qk_mean_cos, qk_drift_cos, q_drift_share, k_drift_share, "
        "kv_head FROM qk_geometry").fetchall()}
    sink = {(r[0], r[1]): r for r in con.execute(
        "SELECT layer, head, n, sink_attention, windows FROM attention_sink").fetchall()}
    direc = {(r[0], r[1]): r for r in con.execute(
        "SELECT layer, head, top_share, q_mean_along, k_mean_along, q_mean_sign, k_mean_sign, epsilon "
        "FROM qk_direction WHERE source = 'all'").fetchall()}
    heads = sum(w["q"].shape[1] for w in want.values())
    assert len(geo) == len(sink) == len(direc) == heads
    if family == "llama":
        assert want[0]["k"].shape[1] < want[0]["q"].shape[1]  # grouped-query attention is exercised
    for layer, w in want.items():
        Q, K = w["q"], w["k"]
        n, H, _ = Q.shape
        g = H // K.shape[1]
        for h in range(H):
            q, k = Q[:, h], K[:, h // g]
            got = geo[layer, h]
            assert got[2] == n and got[9] == h // g
            mean_q, mean_k = q.mean(0), k.mean(0)
            expect = (ref.mean_pairwise_cosine(q), ref.mean_pairwise_cosine(k), pair_mean_cos(q, k),
                      float(q.sum(0) @ k.sum(0) / np.linalg.norm(q.sum(0)) / np.linalg.norm(k.sum(0))),
                      float(np.linalg.norm(mean_q) / np.sqrt((q * q).sum(1).mean())),
                      float(np.linalg.norm(mean_k) / np.sqrt((k * k).sum(1).mean())))
            assert got[3:9] == pytest.approx(expect, abs=2e-6), (family, layer, h)
            lam, vec = np.linalg.eigh(q.T @ q / n)
            v = vec[:, -1] * (1 if mean_q @ vec[:, -1] >= 0 else -1)
            d = direc[layer, h]
            assert d[2:5] == pytest.approx((lam[-1] / lam.sum(), mean_q @ v, mean_k @ v), abs=2e-6)
            assert d[5:] == (1, int(np.sign(mean_k @ v)), int(np.sign(mean_k @ v)))
            s = sink[layer, h]
            assert s[2] == w["sink_n"] and s[4] == w["windows"]
            assert s[3] == pytest.approx(w["sink"][h] / w["sink_n"], rel=1e-6, abs=1e-7), (family, layer, h)
    rate = con.execute("SELECT heads, sink_rate FROM attention_sink_rate").fetchall()
    assert rate == [(heads, pytest.approx(np.mean([w["sink"][h] / w["sink_n"] > 0.3 for w in want.values()
                                                    for h in range(len(w["sink"]))])))]


def test_two_shards_equal_one_run(workdir, sources, model_factory):
    """Shards merge by sum: with one window per forward (each window's queries and keys the same
    whatever else is in the batch) two shards give one run's views to float64 rounding."""
    args = ["--model", model_path("gpt_neox", model_factory), "--source", f"alpha={sources['alpha']}",
            "--source", f"beta={sources['beta']}", "--max-length", 32, "--batch-size", 1, "--no-moments",
            "--attention-moments", "--attention-sinks"]
    one, two = workdir / "attention-one-run", workdir / "attention-two-shards"
    assert run_cli("extract", *args, "--warehouse", one)[0] == 0
    for shard in ("1/2", "2/2"):
        code, _, err = run_cli("extract", *args, "--shard", shard, "--warehouse", two)
        assert code == 0, err
    a, b = connect(one), connect(two)
    assert b.execute("SELECT count(DISTINCT shard) FROM attention_sums").fetchone()[0] == 2
    for view in ("qk_geometry", "qk_geometry_by_source", "attention_sink", "qk_direction", "qk_sums"):
        want = a.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall()
        got = b.execute(f"SELECT * FROM {view} ORDER BY ALL").fetchall()
        assert want, view
        same_rows(got, want, view, 1e-9)


def test_no_attention_writes_none(workdir, sources, model_factory):
    wh = workdir / "attention-off"
    code, _, err = run_cli("extract", "--model", model_factory("llama", tied=False, context=CONTEXT), "--source",
                           f"alpha={sources['alpha']}", "--max-tokens", 200, "--no-attention", "--warehouse", wh)
    assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM attention_totals").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM qk_geometry").fetchone()[0] == 0
    assert not list((Path(wh) / "tables").glob("attention_*"))
    code, _, err = run_cli("extract", "--model", model_factory("llama", tied=False, context=CONTEXT), "--source",
                           f"alpha={sources['alpha']}", "--no-attention", "--attention-sinks", "--warehouse", wh)
    assert code != 0 and "--no-attention" in err and len(err.strip().splitlines()) == 1


def test_partials_with_and_without_attention_fold_together(workdir, sources, model_factory):
    """The attention settings may differ between the partials of one source: the group keeps the
    attention rows only where every partial has them, and a column (sinks) only where every partial
    measured it; a re-run of one shard replaces its rows (never counted twice)."""
    wh = workdir / "attention-mixed"
    common = ["--model", model_factory("llama", tied=False, context=CONTEXT), "--source", f"alpha={sources['alpha']}",
              "--max-length", 32, "--max-tokens", 150, "--no-moments", "--warehouse", wh]
    for args in (["--shard", "1/2", "--attention-sinks"], ["--shard", "2/2", "--no-attention"]):
        code, _, err = run_cli("extract", *common, *args)
        assert code == 0, err
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM attention_totals").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] > 0
    con.close()
    code, _, err = run_cli("extract", *common, "--shard", "2/2", "--attention")  # replaces shard 2: no sinks
    assert code == 0, err
    con = connect(wh)
    n_tokens = con.execute("SELECT n FROM layer_totals WHERE source = 'all' AND layer = 0").fetchone()[0]
    assert con.execute("SELECT count(*) FROM attention_sink").fetchone()[0] == 0
    assert {r[0] for r in con.execute("SELECT DISTINCT n FROM qk_geometry").fetchall()} == {n_tokens}


def test_a_family_without_the_interface_says_so_and_writes_none(workdir, sources, model_factory):
    wh = workdir / "attention-bloom"
    code, _, err = run_cli("extract", "--model", model_factory("bloom", tied=False, context=CONTEXT), "--source",
                           f"alpha={sources['alpha']}", "--source", f"beta={sources['beta']}", "--max-tokens", 200,
                           "--attention", "--warehouse", wh)
    assert code == 0, err
    notes = [line for line in err.splitlines() if "no per-head attention sums" in line]
    assert len(notes) == 1 and "attention interface" in notes[0]
    con = connect(wh)
    assert con.execute("SELECT count(*) FROM attention_totals").fetchone()[0] == 0
    assert con.execute("SELECT count(*) FROM inter_sim").fetchone()[0] > 0  # the rest is measured


@pytest.mark.parametrize("family", sorted(tiny.FAMILY_SPECS))
def test_which_families_the_capture_covers(model_factory, family):
    from extract.attention import attention_plan
    from extract.models import load, resolve_model
    from extract.architectures import text_config

    loaded = load(resolve_model(model_path(family, model_factory)), "main", torch.float32, "cpu")
    plan, why = attention_plan(loaded.model, loaded.layout)
    assert (plan is None) == (family in NOT_COVERED), why
    if plan is not None:
        cfg = text_config(loaded.model.config)
        H = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None) or cfg.n_heads
        assert len(plan.shapes) == len(set(plan.layers.values())) == 2
        assert all(s[0] == H and H % s[1] == 0 for s in plan.shapes)


def _interface_state():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return {k: ALL_ATTENTION_FUNCTIONS[k] for k in ALL_ATTENTION_FUNCTIONS}


@pytest.mark.parametrize("family, fused", [(f, False) for f in ("gpt_neox", "llama", "gemma2", "t5", "mistral",
                                                                 "gpt_bigcode", "bert", "phi")]
                         + [(f, True) for f in ("llama", "t5", "mistral", "gpt_bigcode", "bert")])
def test_sinks_equal_eager_attention(model_factory, monkeypatch, family, fused):
    """Padded and unpadded batches through the model's own kernel with the capture in place (sdpa;
    eager for Gemma-2's soft-capping; no mask at all without padding, as extract feeds it) against
    the eager attention's `output_attentions` on the same batch, scores taken three rows at a time —
    or (`fused`, the GPU's path, here on the CPU) from torch's fused kernel with a one-hot value:
    soft-capping, T5's position bias, sliding windows, grouped and multi-query keys, encoders."""
    from extract.accumulate import AttentionSums, sinks
    from extract.architectures import get_module
    from extract.attention import attention_plan, capture_attention
    from extract.models import forward_kwargs, load, resolve_model

    path = model_path(family, model_factory)
    loaded = load(resolve_model(path), "main", torch.float32, "cpu")
    eager = load(resolve_model(path), "main", torch.float32, "cpu")
    eager.model.set_attn_implementation("eager")
    base, kw = get_module(loaded.model, loaded.layout.base), forward_kwargs(loaded.layout.head)
    before = _interface_state()
    plan, _ = attention_plan(loaded.model, loaded.layout)
    vocab = loaded.model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(5, min(vocab, 300), (3, 20), generator=torch.Generator().manual_seed(0))
    padded = torch.ones_like(ids)
    padded[1, 13:] = 0
    padded[2, 6:] = 0
    for mask in (padded, None):
        monkeypatch.setattr(sinks, "CHUNK_SCORES", 3 * 3 * plan.shapes[0][0] * 20)  # chunks of 3 query rows
        monkeypatch.setattr(sinks, "FUSED_DEVICES", ("cuda", "cpu") if fused else ())
        counted = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        sums = AttentionSums(plan.shapes, "cpu", sinks=True, moments=True)
        sums.set_batch(counted, mask)
        with torch.inference_mode(), capture_attention(plan, sums.add):
            base(input_ids=ids, attention_mask=mask, **kw)
        assert _interface_state() == before
        with torch.no_grad():
            res = get_module(eager.model, eager.layout.base)(input_ids=ids, attention_mask=mask,
                                                             output_attentions=True, **kw)
        attentions = res.attentions if getattr(res, "attentions", None) is not None else res.encoder_attentions
        queries = (torch.arange(20)[None] >= 1) & counted
        for layer, A in enumerate(attentions):  # (B, H, T, T)
            want = (A[..., 0].double() * queries[:, None]).sum((0, 2))
            assert sums.layers[layer].sink.numpy() == pytest.approx(want.numpy(), rel=1e-5, abs=1e-6), (family, layer)
            assert sums.layers[layer].sink_n == int(queries.sum())
            assert int(sums.layers[layer].n) == int(counted.sum())


def test_the_interface_is_restored_after_a_failure(model_factory):
    from extract.architectures import get_module
    from extract.attention import attention_plan, capture_attention
    from extract.models import load, resolve_model

    loaded = load(resolve_model(model_path("gemma2", model_factory)), "main", torch.float32, "cpu")  # eager
    before = _interface_state()
    plan, _ = attention_plan(loaded.model, loaded.layout)

    def fail(*args):
        raise KeyError("boom")

    with pytest.raises(KeyError), capture_attention(plan, fail):
        get_module(loaded.model, loaded.layout.base)(input_ids=torch.tensor([[5, 6, 7]]))
    assert _interface_state() == before


def _qk_batches(gen):
    """(query, key, counted) batches of several shapes, grouped-query (H 4, H_kv 2), with padding, a
    NaN query, a zero key, B = 1 and T = 1."""
    out = []
    for B, T in ((3, 7), (1, 1), (2, 5), (1, 9)):
        q = torch.randn(B, 4, T, 8, generator=gen).bfloat16()
        k = torch.randn(B, 2, T, 8, generator=gen).bfloat16()
        counted = torch.ones(B, T, dtype=torch.bool)
        if T > 2:
            counted[-1, -1] = False
            q[0, 1, 0, 3] = float("nan")
            k[-1, 0, 1] = 0.0
        out.append((q, k, counted))
    return out


@pytest.mark.parametrize("compile_", [False, True])
def test_the_gpu_step_equals_the_chunked_path(compile_):
    """`qk_step` (the GPU path: whole tensors, compiled there; here eagerly, and compiled with inductor
    on the CPU without a recompile for B = 1 or T = 1) gives the chunked CPU path's sums."""
    from torch._dynamo.utils import counters

    from extract.accumulate import AttentionSums
    from extract.accumulate import qk_kernels

    gen = torch.Generator().manual_seed(3)
    chunked = AttentionSums([(4, 2, 8)], "cpu", moments=True, compiled=False)
    step = AttentionSums([(4, 2, 8)], "cpu", moments=True, compiled=compile_)
    if not compile_:
        step._compiled = qk_kernels.qk_step  # the same function, eagerly
    batches = _qk_batches(gen)
    graphs = None
    for i, (q, k, counted) in enumerate(batches):
        for s in (chunked, step):
            s.set_batch(counted, None)
            s.add(0, None, q, k, None, {})
        if i == 0:
            graphs = counters["stats"]["unique_graphs"]
    assert step._compiled is not None  # never fell back to the chunked path
    if compile_:
        assert step.paths["attention_step"] == "compiled"
        assert counters["stats"]["unique_graphs"] == graphs, "the compiled step recompiled"
    a, b = chunked.layers[0], step.layers[0]
    assert int(a.n) == int(b.n) == sum(int(c.sum()) for _, _, c in batches) - 6  # a NaN query, a zero key ×3
    assert int(a.excluded) == int(b.excluded) == 6
    for name in ("sum_q", "unit_q", "sq_q", "sum_k", "unit_k", "sq_k", "pair", "s2_q", "s2_k"):
        assert torch.allclose(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-12), name
