"""Per-checkpoint parameters: partition functions of the (un)embedding, norm gains and biases, vocabulary.

The partition function Z(c) = Σ_i exp⟨c, W_i⟩ is kept in log-space (float64 log-sum-exp),
for every eigenvector c of WᵀW and for −c.  Beside it, `z_eigh_sign` reproduces the authors'
script: eigenvectors with the signs torch.linalg.eigh returns and exp() summed in float32.
"""

from __future__ import annotations

import torch

from .architectures import get_module, is_norm
from .models import Loaded


def partition_rows(W: torch.Tensor) -> dict[str, list]:
    """Eigen-decomposition of WᵀW and log Z(±c), raw and centred. W: (V, d), rows as stored."""
    out = {k: [] for k in ("centered", "eig_index", "eigenvalue", "log_z_pos", "log_z_neg", "z_eigh_sign")}
    W64 = W.detach().to("cpu", torch.float64)  # (V, d)
    W32 = W.detach().to("cpu", torch.float32)
    for centered in (False, True):
        A = W64 - W64.mean(0, keepdim=True) if centered else W64  # (V, d)
        evals, evecs = torch.linalg.eigh(A.T @ A)  # (d,), (d, d): columns are eigenvectors
        proj = A @ evecs  # (V, d): ⟨c_k, W_i⟩
        log_pos = torch.logsumexp(proj, dim=0)  # (d,)
        log_neg = torch.logsumexp(-proj, dim=0)
        # The authors' convention, in float32 from end to end.
        B = W32 - W32.mean(0, keepdim=True) if centered else W32
        _, evecs32 = torch.linalg.eigh(B.T @ B)
        z32 = torch.exp(B @ evecs32).sum(0)  # (d,) may overflow to inf
        d = W.shape[1]
        out["centered"] += [centered] * d
        out["eig_index"] += list(range(d))
        out["eigenvalue"] += evals.tolist()
        out["log_z_pos"] += log_pos.tolist()
        out["log_z_neg"] += log_neg.tolist()
        out["z_eigh_sign"] += z32.double().tolist()
    return out


def partition_table(loaded: Loaded) -> dict[str, list]:
    model, family = loaded.model, loaded.family
    emb = get_module(model, family.embedding).weight
    unemb_mod = get_module(model, family.unembedding)
    if unemb_mod is None:
        raise RuntimeError(f"{family.name}: no unembedding module at {family.unembedding!r}; update FAMILIES")
    tied = unemb_mod.weight.data_ptr() == emb.data_ptr()
    # An untied unembedding that the checkpoint did not hold (an encoder saved without its
    # head) was freshly initialised: it is not the model's, so it is left out.
    missing = not tied and f"{family.unembedding}.weight" in loaded.missing_keys
    unemb = None if missing else unemb_mod.weight
    rows: dict[str, list] = {}
    cache = {}
    for matrix, W in (("embedding", emb), ("unembedding", unemb)):
        if W is None:
            continue
        key = W.data_ptr()
        if key not in cache:
            cache[key] = partition_rows(W)
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
    model, family = loaded.model, loaded.family
    final = get_module(model, family.final_norm)
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
