"""Per-checkpoint parameters: partition functions of the (un)embedding, norm gains and biases, vocabulary.

The partition function Z(c) = Σ_i exp⟨c, W_i⟩ is kept in log-space (float64 log-sum-exp),
for every eigenvector c of WᵀW and for −c.  Beside it, `z_eigh_sign` reproduces the authors'
script: eigenvectors with the signs torch.linalg.eigh returns and exp() summed in float32.
"""

from __future__ import annotations

import torch

from .architectures import get_module, is_norm
from .memory import page_out, release_memory
from .models import Loaded


def _float64_device(device: torch.device) -> torch.device:
    """The parameters' device where it computes in float64, else the CPU (e.g. Apple's MPS)."""
    try:
        torch.zeros(1, dtype=torch.float64, device=device).sum().item()
        return device
    except (RuntimeError, TypeError):
        return torch.device("cpu")


def partition_rows(W: torch.Tensor, chunk_bytes: int = 1 << 22) -> dict[str, list]:
    """Eigen-decomposition of WᵀW and log Z(±c), raw and centred. W: (V, d), rows as stored.

    Computed where W lives (float64 there, CPU fallback), in chunks of rows so that memory is
    O(chunk · d + d²) whatever V is, in two passes over W — what the arithmetic needs: one for Σw
    and the Gram matrix WᵀW (V·d² multiply-adds), one for the projections onto both eigenbases at
    once, W·[E | E_c] (2·V·d²), and their log-sum-exps.  The centred Gram matrix shares the raw
    one: (W−μ)ᵀ(W−μ) = WᵀW − V·μμᵀ, and (W−μ)c = Wc − μ·c.  The authors' float32 convention
    takes the same Gram matrices rounded to float32 (closer to WᵀW than a float32 sum would be;
    its eigenvectors' signs are what it depends on), float32 projections and exp()."""
    W = W.detach()
    dev = _float64_device(W.device)
    V, d = W.shape
    rows = max(1, chunk_bytes // (8 * d))
    chunks = [(a, min(a + rows, V)) for a in range(0, V, rows)]

    def part(a, b):
        """Rows a:b in float64 (an exact copy of the stored values, never a view)."""
        return W[a:b].to(dev, torch.float64, copy=True)  # (rows, d)

    total = torch.zeros(d, dtype=torch.float64, device=dev)
    G = torch.zeros(d, d, dtype=torch.float64, device=dev)
    for a, b in chunks:
        w = part(a, b)
        total += w.sum(0)
        G.addmm_(w.T, w)
    mu = total / V  # (d,)
    grams = (G, G - V * torch.outer(mu, mu))  # raw, centred: (d, d) each
    eig = [torch.linalg.eigh(g) for g in grams]  # (d,), (d, d): columns are eigenvectors
    E = torch.cat([eig[0][1], eig[1][1]], 1)  # (d, 2d): both bases, one product per chunk
    shift = torch.cat([torch.zeros(d, dtype=torch.float64, device=dev), mu @ eig[1][1]])  # (2d,) μ·c, centred half
    E32 = torch.cat([torch.linalg.eigh(g.float())[1] for g in grams], 1)  # (d, 2d) the float32 convention
    shift32 = torch.cat([torch.zeros(d, dtype=torch.float32, device=dev), mu.float() @ E32[:, d:]])
    lse = torch.full((2, 2 * d), -torch.inf, dtype=torch.float64, device=dev)  # sign, (raw | centred) eig
    z32 = torch.zeros(2 * d, dtype=torch.float32, device=dev)
    for a, b in chunks:
        w = part(a, b)
        proj = w @ E - shift  # (rows, 2d): ⟨c_k, W_i⟩, then ⟨c_k, W_i − μ⟩
        lse[0] = torch.logaddexp(lse[0], torch.logsumexp(proj, dim=0))
        lse[1] = torch.logaddexp(lse[1], torch.logsumexp(proj.neg_(), dim=0))
        # The authors' convention, in float32 from end to end (may overflow to inf).
        z32 += torch.exp(w.float() @ E32 - shift32).sum(0)
    out = {k: [] for k in ("centered", "eig_index", "eigenvalue", "log_z_pos", "log_z_neg", "z_eigh_sign")}
    for c in (0, 1):
        half = slice(c * d, (c + 1) * d)
        out["centered"] += [bool(c)] * d
        out["eig_index"] += list(range(d))
        out["eigenvalue"] += eig[c][0].tolist()
        out["log_z_pos"] += lse[0, half].tolist()
        out["log_z_neg"] += lse[1, half].tolist()
        out["z_eigh_sign"] += z32[half].double().tolist()
    return out


def partition_table(loaded: Loaded) -> dict[str, list]:
    model, layout = loaded.model, loaded.layout
    emb = get_module(model, layout.embedding).weight
    unemb_mod = get_module(model, layout.unembedding)
    unemb_w = getattr(unemb_mod, "weight", None)
    tied = unemb_w is not None and unemb_w.data_ptr() == emb.data_ptr()
    # An untied unembedding that the checkpoint did not hold (an encoder saved without its
    # head) was freshly initialised: it is not the model's, so it is left out; so is a model
    # with no LM head at all.
    missing = unemb_w is None or (not tied and f"{layout.unembedding}.weight" in loaded.missing_keys)
    unemb = None if missing else unemb_w
    rows: dict[str, list] = {}
    cache = {}
    for matrix, W in (("embedding", emb), ("unembedding", unemb)):
        if W is None:
            continue
        key = W.data_ptr()
        if key not in cache:
            cache[key] = partition_rows(W)
            page_out(W)
            release_memory()
        part = cache[key]
        n = len(part["eig_index"])
        for k, v in part.items():
            rows.setdefault(k, []).extend(v)
        rows.setdefault("matrix", []).extend([matrix] * n)
        rows.setdefault("tied", []).extend([tied] * n)
        rows.setdefault("rows", []).extend([W.shape[0]] * n)
    return rows


def norm_table(loaded: Loaded) -> dict[str, list]:
    """Every LayerNorm/RMSNorm whose weights were loaded from the checkpoint (not freshly initialised)."""
    model, layout = loaded.model, loaded.layout
    final = get_module(model, layout.final_norm)
    rows = {k: [] for k in ("module", "norm_type", "is_final", "dim", "gain", "bias")}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not is_norm(module) or weight is None or f"{name}.weight" in loaded.missing_keys:
            continue
        bias = getattr(module, "bias", None)
        g = weight.detach().double().cpu().tolist()
        b = bias.detach().double().cpu().tolist() if bias is not None else [None] * len(g)
        rows["module"] += [name] * len(g)
        rows["norm_type"] += [type(module).__name__] * len(g)
        rows["is_final"] += [module is final] * len(g)
        rows["dim"] += list(range(len(g)))
        rows["gain"] += g
        rows["bias"] += b
    return rows


def vocab_table(loaded: Loaded) -> dict[str, list]:
    tok = loaded.tokenizer
    vocab = tok.get_vocab()  # token string → id
    special = set(getattr(tok, "all_special_ids", []))
    ids = sorted(vocab.values())
    by_id = {i: s for s, i in vocab.items()}
    # Text a person reads: the decoded token (byte-level BPE's 'Ġthe' reads ' the').
    texts = [tok.convert_tokens_to_string([by_id[i]]) for i in ids]
    return {"token_id": ids, "token": texts, "special": [i in special for i in ids]}
