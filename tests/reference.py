"""The slow, obvious computations that the views are checked against.

Hidden states are captured independently of the extractor's hooks: through Hugging Face's
own `output_hidden_states`, one window at a time (no padding), and for the last block's raw
output (which `hidden_states` lacks when a final norm follows) from a copy of the model whose
final norm is replaced by the identity.  Metrics are then computed by definition in float64:
O(n²) pairwise cosines, numpy eigen-decompositions.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
import torch

from extract.architectures import get_module
from extract.models import load, resolve_model


def token_windows(tok, texts, content: int, max_tokens: int | None = None):
    budget = max_tokens if max_tokens is not None else float("inf")
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids), content):
            piece = ids[s:s + content][: int(min(budget, content))]
            budget -= len(piece)
            yield piece
            if budget <= 0:
                return


def _specials(tok) -> tuple[list[int], list[int]]:
    """The tokenizer's template around a text, from its own special-tokens mask."""
    enc = tok("x y z", add_special_tokens=True, return_special_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["special_tokens_mask"]
    first = mask.index(0)
    last = len(mask) - mask[::-1].index(0)
    return ids[:first], ids[last:]


def hidden_states(model_dir: str, texts: list[str], max_length: int, max_tokens: int | None = None,
                  windows: list | None = None):
    """{layer: (list of token ids, (n, d) float64 array)} over every counted position.

    Windows of `max_length` tokens, the tokenizer's special tokens included (and not counted);
    `windows`, when given, receives each counted position's window number."""
    loaded = load(resolve_model(model_dir), "main", torch.float32, "cpu")
    lay, model, tok = loaded.layout, loaded.model.float(), loaded.tokenizer
    base = get_module(model, lay.base)
    has_final = get_module(model, lay.final_norm) is not None
    if has_final:
        bare = copy.deepcopy(model)
        parent, _, attr = lay.final_norm.rpartition(".")
        setattr(get_module(bare, parent), attr, torch.nn.Identity())
        bare_base = get_module(bare, lay.base)
    prefix, suffix = _specials(tok)
    content = max_length - len(prefix) - len(suffix)
    out = defaultdict(lambda: ([], []))
    with torch.no_grad():
        for ids in token_windows(tok, texts, content, max_tokens):
            seq = prefix + ids + suffix
            x = torch.tensor([seq])
            hs = base(input_ids=x, output_hidden_states=True).hidden_states
            layers = list(hs)
            if has_final:  # hs = [emb, block 1 … block L−1, final_norm(block L)]
                last = bare_base(input_ids=x, output_hidden_states=True).hidden_states[-1]
                layers = layers[:-1] + [last, layers[-1]]
            keep = slice(len(prefix), len(prefix) + len(ids))
            if windows is not None:
                windows.extend([windows[-1] + 1 if windows else 0] * len(ids))
            for layer, h in enumerate(layers):
                out[layer][0].extend(seq[keep])
                out[layer][1].append(h[0, keep].double().numpy())
    return {k: (np.array(ids), np.concatenate(vs)) for k, (ids, vs) in out.items()}


def own_hidden_states(model_dir: str, texts: list[str], special: bool = False):
    """The model's own `output_hidden_states`, each document fed whole as its tokenizer encodes it
    by default (special tokens added), loaded with `AutoModel` (nothing of the extractor; an
    encoder-decoder's encoder, a `…ForCausalLM` of such a family with its own class):
    {index into hidden_states: (token ids, (n, d) float64)} at the positions that the
    tokenizer's special-tokens mask marks 0 (or at every position when `special`)."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES as SEQ2SEQ

    config = AutoConfig.from_pretrained(model_dir)
    if getattr(config, "is_encoder_decoder", False):  # the encoder's own hidden states
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).get_encoder().eval()
    elif config.model_type in SEQ2SEQ:  # an encoder-decoder family's decoder saved alone (BartForCausalLM)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    else:
        model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = defaultdict(lambda: ([], []))
    with torch.no_grad():
        for text in texts:
            enc = tok(text, add_special_tokens=True, return_special_tokens_mask=True)
            ids = torch.tensor([enc["input_ids"]])
            keep = torch.ones(ids.shape[1], dtype=torch.bool) if special else \
                torch.tensor(enc["special_tokens_mask"]) == 0
            hs = model(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  output_hidden_states=True).hidden_states
            for i, h in enumerate(hs):
                out[i][0].extend(ids[0, keep].tolist())
                out[i][1].append(h[0, keep].double().numpy())
    return {k: (np.array(v[0]), np.concatenate(v[1])) for k, v in out.items()}


def mean_pairwise_cosine(X: np.ndarray) -> float:
    """(1/(n²−n)) Σ_{i≠j} cos(x_i, x_j), by the definition."""
    n = len(X)
    U = X / np.linalg.norm(X, axis=1, keepdims=True)
    G = U @ U.T
    return float((G.sum() - np.trace(G)) / (n * n - n))


def inter_sim(states) -> dict[int, float]:
    return {layer: mean_pairwise_cosine(X) for layer, (_, X) in states.items()}


def intra_sim(states) -> dict[tuple[int, int], float]:
    out = {}
    for layer, (ids, X) in states.items():
        for t in np.unique(ids):
            rows = X[ids == t]
            if len(rows) >= 2:
                out[(layer, int(t))] = mean_pairwise_cosine(rows)
    return out


def avg_intra_sim(intra: dict) -> dict[int, float]:
    by_layer = defaultdict(list)
    for (layer, _), v in intra.items():
        by_layer[layer].append(v)
    return {layer: float(np.mean(v)) for layer, v in by_layer.items()}


def isotropy(W: np.ndarray) -> float:
    """I(W) = min Z(c) / max Z(c) over c = ± eigenvectors of WᵀW, Z summed directly with exp()."""
    _, vecs = np.linalg.eigh(W.T @ W)
    Z = np.concatenate([np.exp(W @ vecs).sum(0), np.exp(-W @ vecs).sum(0)])
    return float(Z.min() / Z.max())


def isotropy_eigh_signs(W: np.ndarray) -> float:
    """The authors' script: torch eigh's signs only, everything in float32."""
    W = torch.tensor(W, dtype=torch.float32)
    _, vecs = torch.linalg.eigh(W.T @ W)
    Z = torch.exp(W @ vecs).sum(0)
    return float(Z.min() / Z.max())


def layernorm_summary(g: np.ndarray, b: np.ndarray) -> dict[str, float]:
    d = len(g)
    gp = 1.0 / g
    par = b @ gp / np.linalg.norm(gp)
    perp = b - (b @ gp) / (gp @ gp) * gp
    return {
        "avgnorm_g": np.linalg.norm(g) / np.sqrt(d), "avgnorm_b": np.linalg.norm(b) / np.sqrt(d),
        "b_g_ratio": np.linalg.norm(b) / np.linalg.norm(g), "sum_b_over_g": float(np.sum(b / g)),
        "b_parallel_norm": abs(par), "b_perp_norm": np.linalg.norm(perp),
    }


def source_texts(path) -> list[str]:
    """Documents of a .txt or .jsonl.zst file, read without the extractor's readers."""
    import json

    import zstandard

    path = str(path)
    if path.endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(open(path, "rb").read()).decode()
        return [json.loads(line)["text"] for line in data.splitlines() if line.strip()]
    return [line.strip() for line in open(path, encoding="utf-8") if line.strip()]


def unit(X: np.ndarray) -> np.ndarray:
    return X / np.linalg.norm(X, axis=1, keepdims=True)


def dim_contrib(X: np.ndarray) -> np.ndarray:
    """Timkey & van Schijndel: contrib_i = (1/(n²−n)) Σ_{a≠b} û_{a,i} û_{b,i}, pair by pair (O(n²))."""
    U = unit(X)
    n = len(U)
    G = np.einsum("ai,bi->i", U, U)  # Σ_a Σ_b û_ai û_bi
    return (G - (U * U).sum(0)) / (n * n - n)


def drift(X: np.ndarray) -> tuple[float, float]:
    mu = X.mean(0)
    return float(np.linalg.norm(mu)), float((unit(X) @ (mu / np.linalg.norm(mu))).mean())


def intra_sentence_sim(X: np.ndarray, windows: np.ndarray) -> float:
    """Ethayarajh: per window, the mean cosine of its vectors to the window's mean vector; averaged
    over windows with at least two vectors."""
    out = []
    for w in np.unique(windows):
        rows = X[windows == w]
        if len(rows) >= 2:
            m = rows.mean(0)
            out.append(float((unit(rows) @ (m / np.linalg.norm(m))).mean()))
    return float(np.mean(out))


def cka_procrustes(X: np.ndarray, Y: np.ndarray) -> tuple[float, float]:
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    cka = np.linalg.norm(Xc.T @ Yc) ** 2 / (np.linalg.norm(Xc.T @ Xc) * np.linalg.norm(Yc.T @ Yc))
    nuclear = np.linalg.svd(Xc.T @ Yc, compute_uv=False).sum()
    return float(cka), float(nuclear / (np.linalg.norm(Xc) * np.linalg.norm(Yc)))


def alpha_req_numpy(eigenvalues: np.ndarray, n: int = 10**9) -> float | None:
    """αReQ by its definition: the weighted (1/k) least-squares line through (log k, log λ_k),
    k = 12 … min(100, d − 10, n − 1), λ_k > 0 (eigenvalues descending, of n vectors); None below
    10 ranks."""
    d = len(eigenvalues)
    k = np.arange(1, d + 1)
    keep = (k >= 12) & (k <= min(100, d - 10, n - 1)) & (eigenvalues > 1e-12 * eigenvalues.max())
    if keep.sum() < 10:
        return None
    x, y, w = np.log(k[keep]), np.log(eigenvalues[keep]), np.sqrt(1.0 / k[keep])
    slope, _ = np.linalg.lstsq(np.stack([x, np.ones_like(x)], 1) * w[:, None], y * w, rcond=None)[0]
    return -slope


def layer_change(a: np.ndarray, b: np.ndarray) -> tuple[int, float, float]:
    """The layer change between two layers' rows of the same tokens (n, d) each, by its definition in float64:
    (n, Σ cos(a_i, b_i), Σ arccos(cos)/π)."""
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    return len(a), float(cos.sum()), float((np.arccos(np.clip(cos, -1, 1)) / np.pi).sum())
