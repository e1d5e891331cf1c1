"""The peers' measures as pure functions of merged sums: covariances, linearity, CKA, orthogonal
Procrustes, TwoNN.  No I/O: the merge (warehouse/merge/) feeds them the merged moments and samples."""

from __future__ import annotations

import numpy as np


def covariance(n: int, s1: np.ndarray, s2: np.ndarray) -> np.ndarray:
    """C = (Σhhᵀ − (Σh)(Σh)ᵀ/n) / (n − 1), float64."""
    return (s2 - np.outer(s1, s1) / n) / (n - 1)


def cross_covariance(n: int, sx: np.ndarray, sy: np.ndarray, sxy: np.ndarray) -> np.ndarray:
    return (sxy - np.outer(sx, sy) / n) / (n - 1)


def linearity_from_cov(cxx: np.ndarray, cyy: np.ndarray, cxy: np.ndarray,
                       eig: tuple[np.ndarray, np.ndarray] | None = None) -> float:
    """1 − ‖X̃A − Ỹ‖²_F for centred, Frobenius-normalised X, Y and the least-squares A, which is
    tr(C_yx C_xx⁺ C_xy) / tr(C_yy).  C_xx⁺ from the symmetric eigendecomposition C_xx = V diag(w) Vᵀ
    (`eig`, if the caller has it), eigenvalues at or below numpy lstsq's cutoff (eps · d · w_max)
    treated as zero — the least-squares solution, at a fraction of lstsq's SVD cost:
    tr(C_yx C_xx⁺ C_xy) = Σ_k ‖(Vᵀ C_xy)_k‖² / w_k over the kept k."""
    w, V = eig if eig is not None else np.linalg.eigh(cxx)
    keep = w > np.finfo(np.float64).eps * len(w) * max(float(w.max()), 0.0)
    P = V[:, keep].T @ cxy  # (k, d)
    return float(((P * P).sum(1) / w[keep]).sum() / np.trace(cyy))


def similarities_from_cov(cxx: np.ndarray, cyy: np.ndarray, cxy: np.ndarray) -> tuple[float, float]:
    """(linear CKA, orthogonal Procrustes similarity) of centred X, Y from their covariances.

    With X, Y centred, XᵀY = (n−1)·C_xy, so CKA = ‖XᵀY‖²_F / (‖XᵀX‖_F ‖YᵀY‖_F) = ‖C_xy‖²_F /
    (‖C_xx‖_F ‖C_yy‖_F) (Kornblith et al. 2019), and the orthogonal Procrustes similarity
    max_R ⟨XR, Y⟩ / (‖X‖_F ‖Y‖_F) over orthogonal R = ‖XᵀY‖_* / (‖X‖_F ‖Y‖_F) =
    ‖C_xy‖_* / √(tr C_xx · tr C_yy) (nuclear norm: the sum of singular values)."""
    cka = float(np.sum(cxy * cxy) / (np.linalg.norm(cxx) * np.linalg.norm(cyy)))
    nuclear = float(np.linalg.svd(cxy, compute_uv=False).sum())
    return cka, nuclear / float(np.sqrt(np.trace(cxx) * np.trace(cyy)))


def _nn_distances(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distances of every point to its first and second nearest neighbours, from the exact
    differences √Σ(x − y)² in float64 (scipy's cdist, bit-identical to torch.cdist's
    'donot_use_mm' mode; no Gram-matrix shortcut: TwoNN reacts to the rounding of near-duplicate
    distances).  Rows in blocks of ≤ 32 MB of distances: memory O(S·d + 4M), time O(S²·d)."""
    from scipy.spatial.distance import cdist  # only a commit with samples needs it

    X = np.ascontiguousarray(X, dtype=np.float64)  # (S, d)
    S = len(X)
    out = np.empty((S, 2), dtype=np.float64)
    step = max(1, (32 << 20) // (8 * max(S, 1)))
    for a in range(0, S, step):
        b = min(a + step, S)
        D = cdist(X[a:b], X)  # (b − a, S)
        D[np.arange(b - a), np.arange(a, b)] = np.inf
        out[a:b] = np.sort(D, axis=1)[:, :2] if S <= 2 else np.sort(np.partition(D, 1, axis=1)[:, :2], axis=1)
    return out[:, 0], out[:, 1]


def twonn_microscope(X: np.ndarray, reduction_factor: int = 5, eps: float = 1e-8) -> float:
    """TwoNN as llm-microscope's `intrinsic_dimension`: centre, scale by the mean norm, ratios
    μ = r₂/r₁ sorted (μ ≤ 1 + eps dropped), then the slope through the origin of −log(1 − F)
    on log μ over the smallest n/reduction_factor of them."""
    X = X - X.mean(0, keepdims=True)
    X = X / np.sqrt((X * X).sum(1)).mean()
    r1, r2 = _nn_distances(X)
    bad = r1 < eps
    r1, r2 = np.where(bad, eps, r1), np.where(bad, eps, r2)
    mu = np.sort(np.where(bad, -1.0, r2 / r1))
    useless = int((mu <= 1 + eps).sum())
    mu = mu[useless:]
    n = len(mu)
    f_emp = np.arange(1 + useless, n + 1 + useless) / (n + useless)
    k = min(n // reduction_factor, n - 1)
    with np.errstate(divide="ignore", invalid="ignore"):  # NaN where the oracle gives NaN too
        x, y = np.log(mu)[:k], -np.log(1 - f_emp)[:k]
        return float((x * y).sum() / (x * x).sum())


def _nn_distances_gram(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """As scikit-learn's `pairwise_distances` (which scikit-dimension uses when d > 25): distances
    from the Gram matrix, ‖x‖² + ‖y‖² − 2⟨x, y⟩ clipped at 0, the diagonal set to 0."""
    sq = np.einsum("ij,ij->i", X, X)
    D = -2.0 * (X @ X.T)
    D += sq[:, None]
    D += sq[None, :]
    np.maximum(D, 0, out=D)
    np.fill_diagonal(D, 0)
    D = np.sort(np.sqrt(D), axis=1)
    return D[:, 1], D[:, 2]


def twonn_skdim(X: np.ndarray, discard_fraction: float = 0.1) -> float:
    """TwoNN as scikit-dimension's `TwoNN()` (Facco et al. 2017): ratios μ of all points (those
    with r₁ = 0 dropped), the largest 10 % discarded, F = i/N, slope through the origin.  TwoNN
    reacts to tiny changes of near-duplicate distances, so the distances are computed as
    scikit-dimension computes them (Gram matrix for d > 25, exact below)."""
    X = np.asarray(X, dtype=np.float64)
    r1, r2 = _nn_distances_gram(X) if X.shape[1] > 25 else _nn_distances(X)
    with np.errstate(divide="ignore", invalid="ignore"):
        mu = r2 / r1
    mu = mu[np.isfinite(mu)]
    N = len(mu)
    keep = int(N * (1 - discard_fraction))
    mu = np.sort(mu)[:keep]
    f = np.arange(1, keep + 1) / N
    with np.errstate(divide="ignore", invalid="ignore"):
        x, y = np.log(mu), -np.log(1 - f)
        return float((x * y).sum() / (x * x).sum())
